"""The warm-up curve: runs 1 to 5 of a script, back to back, from a fresh server and an empty cache.

    .venv/bin/python benchmarks/warmup_curve.py --script controlnet --rounds 2
    .venv/bin/python benchmarks/warmup_curve.py --script lm --modes patched,run --drop-page-cache

What a user meets in the loop edit, run, look, run again: each round times plain ``python
script.py`` (``--plain`` runs, their median is the baseline), then for each mode a fresh
``overmind-server`` with an empty cache in a private runtime directory and five runs of the
script with no pause between them (the next starts as the last exits: a fill or an import the
server does behind run 1 must be done by the time run 2 needs it, or run 2 pays), then one
more run after the server was restarted (its cache is gone). Modes: ``patched``
(``OVERMIND=1 python script.py``: the script calls ``monkey_patch_all()``) and ``run``
(``OVERMIND=1 overmind run script.py``). Each figure is the median over rounds of the whole
process's wall time (start to exit, as the shell sees it) over plain's median, with the
server's hit, miss and fork counters after each run. The scripts are overmind-bench's
whole-process scripts (``overmind.bench.whole``) on the models it generates
(``--scale base``: SD1.5-size ControlNet pipeline in fp16, a 1.1 B Llama in bf16).
``--drop-page-cache`` evicts the model files from the page cache before every run (root).
The machine's huge-page setting is left as it is; say it with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from overmind.bench.harness import drop_page_cache
from overmind.bench.models import default_cache_dir, ensure_models, model_files
from overmind.bench.whole import MARK, SCRIPTS, script_source

BIN = Path(sys.executable).parent


def _env(runtime: Path, mode: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OVERMIND")}
    env.update(OVERMIND_RUNTIME_DIR=str(runtime), HF_HUB_OFFLINE="1", OVERMIND_NO_AUTOSTART="1")
    if mode != "plain":
        env["OVERMIND"] = "1"
    return env


def _status(runtime: Path) -> dict:
    out = subprocess.run([str(BIN / "overmind"), "--runtime-dir", str(runtime), "status", "--json"],
                         capture_output=True, text=True).stdout
    try:
        return json.loads(out)
    except ValueError:
        return {}


def _once(folder: Path, script: str, mode: str, runtime: Path, files: list, drop: bool) -> dict:
    if drop:
        drop_page_cache(files)
    argv = {"plain": [sys.executable, f"{script}.py"], "patched": [sys.executable, f"{script}.py"],
            "run": [str(BIN / "overmind"), "run", f"{script}.py"]}[mode]
    start = time.monotonic()
    proc = subprocess.run(argv, cwd=folder, env=_env(runtime, mode), capture_output=True, text=True)
    wall = time.monotonic() - start
    marks = {}
    for line in proc.stdout.splitlines():
        if MARK in line:
            what, at = line.split(MARK, 1)[1].split()[:2]
            marks[what] = float(at) - start
    status = _status(runtime) if mode != "plain" else {}
    return {"wall": wall, "ready": marks.get("ready"), "used": marks.get("used"), "status": proc.returncode,
            "fallback": "Warning: overmind:" in proc.stderr,
            **{k: status.get(k) for k in ("hits", "misses", "runs", "joined")}}


def _server(runtime: Path, start: bool) -> None:
    subprocess.run([str(BIN / "overmind"), "--runtime-dir", str(runtime), "shutdown"], capture_output=True)
    if start:
        subprocess.run([sys.executable, "-m", "overmind.server", "--daemon"], env=_env(runtime, "patched"),
                       capture_output=True, check=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--script", choices=["controlnet", "lm"], default="controlnet")
    parser.add_argument("--scale", default="base")
    parser.add_argument("--modes", default="patched,run")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--plain", type=int, default=3, help="plain runs per round (default 3)")
    parser.add_argument("--drop-page-cache", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    spec = SCRIPTS[args.script]
    paths = ensure_models(default_cache_dir(), args.scale, list(spec.models))
    files = sorted({f for name in spec.models for f in model_files(paths[name])})
    folder = Path(tempfile.mkdtemp(prefix="overmind-curve-"))
    (folder / f"{args.script}.py").write_text(script_source(args.script, paths))
    runtime = Path(tempfile.mkdtemp(prefix="om-curve-", dir="/tmp"))
    modes = args.modes.split(",")
    results: dict = {"plain": [], **{m: {} for m in modes}}
    try:
        for round_ in range(args.rounds):
            for _ in range(args.plain):
                results["plain"].append(_once(folder, args.script, "plain", runtime, files, args.drop_page_cache))
                print(f"round {round_ + 1} plain: {results['plain'][-1]['wall']:.2f} s", flush=True)
            for mode in modes:
                shutil.rmtree(runtime, ignore_errors=True)
                runtime.mkdir(mode=0o700)
                _server(runtime, start=True)
                for run in [*range(1, 6), "restart"]:
                    if run == "restart":
                        _server(runtime, start=True)
                    done = _once(folder, args.script, mode, runtime, files, args.drop_page_cache)
                    results[mode].setdefault(str(run), []).append(done)
                    print(f"round {round_ + 1} {mode} run {run}: {done['wall']:.2f} s, hits {done['hits']} misses "
                          f"{done['misses']} forked {done['runs']} joined {done['joined']}"
                          f"{' FALLBACK' if done['fallback'] else ''}", flush=True)
                _server(runtime, start=False)
    finally:
        _server(runtime, start=False)
        shutil.rmtree(runtime, ignore_errors=True)
        shutil.rmtree(folder, ignore_errors=True)
    plain = statistics.median(r["wall"] for r in results["plain"])
    state = "dropped before each run" if args.drop_page_cache else "warm"
    print(f"\n{args.script} ({args.scale}), page cache {state}, plain python median {plain:.2f} s, "
          f"{args.rounds} rounds; each run's median wall over plain's")
    print("| mode | 1 | 2 | 3 | 4 | 5 | after a server restart |")
    print("|---|---|---|---|---|---|---|")
    for mode in modes:
        cells = [f"{statistics.median(r['wall'] for r in results[mode][str(run)]) / plain:.2f}"
                 for run in [*range(1, 6), "restart"]]
        print(f"| {mode} | " + " | ".join(cells) + " |")
    if args.json:
        args.json.write_text(json.dumps({"plain_median": plain, "results": results, "args": vars(args)}, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
