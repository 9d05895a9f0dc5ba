"""Helpers shared by the benchmark scripts: model cache folder, fresh-process timing."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

CACHE = Path(os.environ.get("OVERMIND_BENCH_CACHE", Path(__file__).resolve().parent.parent / ".bench-cache"))


def warm_page_cache(path: Path) -> int:
    total = 0
    for p in sorted(Path(path).rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                while chunk := f.read(1 << 24):
                    total += len(chunk)
    return total


def run_json(code: str, env: dict | None = None, timeout: float = 600, forbid: str | None = None) -> dict:
    """Run ``code`` in a fresh interpreter; it must print one JSON line last.

    ``forbid``: fail if the child's stderr contains this text (e.g. overmind's fallback warning).
    """
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full_env, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"benchmark child failed ({out.returncode}):\n{out.stderr[-4000:]}")
    if forbid and forbid in out.stderr:
        raise RuntimeError(f"benchmark child printed {forbid!r}:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": len(values)}
