"""``overmind preload FILE``: fill the cache before a model's first use.

    overmind preload models.jsonl       # one call a line, replayed patched, each waiting for its entry
    overmind preload warm_up.py         # a script, run once under `overmind run`, output discarded

A line of a calls file::

    {"fn": "diffusers.ControlNetModel.from_pretrained", "args": ["/models/canny"],
     "kwargs": {"torch_dtype": {"$py": "torch.float16"}}}

``fn`` is a dotted name: a module, then attributes. ``args`` (a list) and ``kwargs`` (an
object) hold JSON values; ``{"$py": "torch.float16"}`` stands for the object that dotted name
names (a lookup, never an ``eval``). Blank lines and lines starting with ``#`` are skipped.

The calls run in a fresh process of the chosen interpreter (``--python``, default the one
running overmind) with ``monkey_patch_all()``, ``OVERMIND_COLD=wait`` and
``OVERMIND_STRICT=1``: each returns once its entry is cached, and one the cache cannot take is
named rather than loaded plainly. Entries filled so are kept across restarts like any other
(Note [The state file] in overmind.server.state). :func:`preload_command` is the front end's part
(stdlib only); :func:`main` runs in that process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any, Optional

__all__ = ["preload_command", "read_calls", "resolve", "main", "PreloadError"]

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class PreloadError(ValueError):
    """A calls file that cannot be read; the message names the line and what to write instead."""


def read_calls(path: str) -> list[tuple[int, dict]]:
    """(line number, call) of every call in ``path``, checked for shape (not resolved)."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise PreloadError(f"cannot read {path}: {err}") from None
    calls = []
    example = '{"fn": "diffusers.DiffusionPipeline.from_pretrained", "args": ["/models/sd"], "kwargs": {}}'
    for number, line in enumerate(lines, 1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        try:
            call = json.loads(text)
        except ValueError as err:
            raise PreloadError(f"{path}:{number}: not a JSON object ({err}); write one call a line, e.g. {example}"
                               ) from None
        if not isinstance(call, dict) or not isinstance(call.get("fn"), str) or not call["fn"].strip():
            raise PreloadError(f"{path}:{number}: a call needs \"fn\", a dotted name; e.g. {example}")
        unknown = set(call) - {"fn", "args", "kwargs"}
        if unknown:
            raise PreloadError(f"{path}:{number}: unknown field(s) {sorted(unknown)}; a call has fn, args and kwargs")
        if not isinstance(call.get("args", []), list) or not isinstance(call.get("kwargs", {}), dict):
            raise PreloadError(f"{path}:{number}: \"args\" must be a list and \"kwargs\" an object")
        calls.append((number, call))
    if not calls:
        raise PreloadError(f"{path} holds no calls; write one JSON object a line, e.g. {example}")
    return calls


def preload_command(path: str, python: Optional[str], env: dict) -> int:
    """The ``overmind preload`` front end: check FILE, then run it in a child; the exit status."""
    python = python or sys.executable
    if not os.path.isfile(path):
        print(f"overmind: preload: {path} is not a file (give a .jsonl file of calls or a .py script; "
              "`overmind preload -h` shows the format)", file=sys.stderr)
        return EXIT_USAGE
    child_env = {**env, "OVERMIND_COLD": "wait"}
    if path.endswith(".py"):
        started = time.monotonic()
        argv = [sys.executable, "-m", "overmind.frontend.run", "--python", python, path]
        proc = subprocess.run(argv, env=child_env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE)
        if proc.returncode != 0:
            tail = proc.stderr.decode(errors="replace").strip().splitlines()[-5:]
            print(f"overmind: preload: {path} exited with status {proc.returncode}:", *tail, sep="\n  ",
                  file=sys.stderr)
            return EXIT_FAILED
        print(f"preloaded {path} in {time.monotonic() - started:.1f}s (its loads are cached if it calls "
              "overmind.api.monkey_patch_all())")
        return EXIT_OK
    try:
        read_calls(path)
    except PreloadError as err:
        print(f"overmind: preload: {err}", file=sys.stderr)
        return EXIT_USAGE
    child_env["OVERMIND_STRICT"] = "1"
    return subprocess.run([python, "-m", "overmind.frontend.preload", os.path.abspath(path)], env=child_env,
                          stdin=subprocess.DEVNULL).returncode


def resolve(name: str) -> Any:
    """The object a dotted name names: the longest importable module, then attributes."""
    import importlib

    parts = name.strip().split(".")
    for split in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for attr in parts[split:]:
            try:
                obj = getattr(obj, attr)
            except AttributeError:
                raise PreloadError(f"{name}: {'.'.join(parts[:split])} has no attribute path "
                                   f"{'.'.join(parts[split:])}") from None
        return obj
    raise PreloadError(f"{name}: no module of that name can be imported")


def _value(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {"$py"} and isinstance(value["$py"], str):
            return resolve(value["$py"])
        return {k: _value(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_value(v) for v in value]
    return value


def main(argv: Optional[list] = None) -> int:
    """In the preloading process: replay every call patched; one line per call."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m overmind.frontend.preload FILE", file=sys.stderr)
        return EXIT_USAGE
    try:
        calls = read_calls(argv[0])
    except PreloadError as err:
        print(f"overmind: preload: {err}", file=sys.stderr)
        return EXIT_USAGE
    import overmind.api

    overmind.api.monkey_patch_all()
    failed = 0
    for number, call in calls:
        where = f"{argv[0]}:{number}"
        started = time.monotonic()
        try:
            fn = resolve(call["fn"])
            obj = fn(*_value(call.get("args", [])), **_value(call.get("kwargs", {})))
        except Exception as err:  # noqa: BLE001 - named, and the next call goes on
            failed += 1
            print(f"failed  {where} {call['fn']}: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}",
                  flush=True)
            continue
        cached = overmind.api.cache_key_of(obj) is not None
        del obj
        if not cached:
            failed += 1
            print(f"failed  {where} {call['fn']}: the call ran but is not cacheable (overmind cannot key or "
                  "rebuild it; the server's log says why)", flush=True)
            continue
        print(f"cached  {where} {call['fn']} in {time.monotonic() - started:.2f}s", flush=True)
    print(f"{len(calls) - failed} of {len(calls)} calls cached", flush=True)
    return EXIT_FAILED if failed else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
