"""The scenarios that run alone, each with its own runner (``overmind-bench --scenarios
compiled``, ``restart`` or ``memory_pressure``, or ``python -m overmind.bench.compiled``,
``.restart`` or ``.pressure``): their results in overmind-bench's document, under a key of
their own (schema: :mod:`overmind.bench.report`), which ``overmind-bench --report`` renders.

    doc = measure("restart", lambda results: ..., argv=["overmind-bench", ...], scale="base")
    write(doc, args.json)           # --json FILE, or stdout without one
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, Optional

from overmind.bench import report

__all__ = ["measure", "command", "write"]


def measure(name: str, run: Callable[[dict], None], *, argv: list[str], scale: str = "base",
            about: Optional[str] = None) -> dict:
    """The document of ``name`` (of :data:`report.ALONE`) as ``run(results)`` measured it: ``run``
    fills ``results`` as it goes (and may set its ``status`` to ``failed`` and its ``reason``);
    when it raises, the document says the run failed, and why, beside what it had measured.
    Ctrl-C is not caught. ``argv``: the command, as the document gives it."""
    from overmind.bench import shmem
    from overmind.bench.models import default_cache_dir
    from overmind.bench.runner import Plan

    started, shmem_enabled = time.monotonic(), shmem.current()
    results: dict = {"status": "ok", "reason": None}
    try:
        run(results)
    except Exception as err:  # noqa: BLE001 -- whatever it raised, the document says so
        traceback.print_exc()
        results.update(status="failed", reason=f"{type(err).__name__}: {err}")
    plan = Plan(scenarios=[], memory_cases=[], startup=False, scale=scale)
    doc = report.document(plan, {"scenarios": {}, "memory": []}, None, cache_dir=default_cache_dir(),
                          wall_s=time.monotonic() - started, cuda_device=None, argv=argv,
                          shmem_enabled=shmem_enabled, about=about, alone={name: results})
    report.validate(doc)
    return doc


def command(module: str, argv: Optional[list]) -> list[str]:
    """The command of a runner started as ``python -m MODULE`` (``argv``: its arguments, None:
    this process's)."""
    return ["python", "-m", module, *(sys.argv[1:] if argv is None else argv)]


def write(doc: dict, path: Optional[str]) -> None:
    """``--json FILE``: the document there, else on stdout."""
    text = json.dumps(doc, indent=2) + "\n"
    if path:
        Path(path).write_text(text)
    else:
        sys.stdout.write(text)
