"""Hits served from the model files against hits from sealed memfds: the ControlNet
script with ``monkey_patch_all()``, page cache warm, whole process from the shell.

    python benchmarks/file_segments.py [--pairs 5]

Two servers in private runtime directories: one settles every file segment into a sealed memfd
at once (``OVERMIND_SETTLE_AFTER=0``), the other serves from the files. Each is filled by two
runs; then rounds of (memfd, file, plain python) runs, interleaved, and the medians. Uses the
models ``overmind-bench`` generates (``~/.cache/overmind-bench``, ``base``; generated if absent).
Note [Settling file segments] in overmind.server.settle.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from overmind.bench.models import ensure_models
from overmind.bench.whole import script_source


def _status(env: dict) -> dict:
    out = subprocess.run([sys.executable, "-m", "overmind", "status", "--json"], env=env, capture_output=True,
                         text=True, check=True).stdout
    return json.loads(out)


def _run(script: Path, env: dict) -> float:
    started = time.monotonic()
    subprocess.run([sys.executable, str(script)], env=env, capture_output=True, check=True)
    return time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=5, help="rounds of memfd, file and plain runs (default 5)")
    args = parser.parse_args()
    paths = ensure_models(Path.home() / ".cache" / "overmind-bench", "base", ["sd", "controlnet_a", "controlnet_b"])
    folder = Path(tempfile.mkdtemp(prefix="overmind-file-segments-"))
    script = folder / "controlnet.py"
    script.write_text(script_source("controlnet", paths))
    base = {k: v for k, v in os.environ.items() if not k.startswith("OVERMIND_")}
    base["HF_HUB_OFFLINE"] = "1"
    servers = {}
    try:
        for name, settle in (("memfd", "0"), ("file", "")):  # "": never settle when idle
            runtime = tempfile.mkdtemp(prefix="om-", dir="/tmp")
            env = {**base, "OVERMIND_RUNTIME_DIR": runtime, "OVERMIND_SETTLE_AFTER": settle, "OVERMIND": "1",
                   "OVERMIND_NO_AUTOSTART": "1"}
            subprocess.run([sys.executable, "-m", "overmind.server", "--daemon"], env=env, check=True,
                           capture_output=True)
            servers[name] = env
            _run(script, env)
            _run(script, env)
            for _ in range(1200):  # the fills, and for memfd the copies, done
                files = (status := _status(env))["file_segments"]
                if status["loading"] == 0 and (name == "file" or (files["bytes"] == 0 and not files["copying"])):
                    break
                time.sleep(0.5)
            print(f"{name}: {files}", flush=True)
        times: dict = {"memfd": [], "file": [], "plain": []}
        for _ in range(args.pairs):
            for name in times:
                times[name].append(_run(script, servers.get(name, base)))
            print({k: round(v[-1], 2) for k, v in times.items()}, flush=True)
        plain = statistics.median(times["plain"])
        for name, values in times.items():
            median = statistics.median(values)
            print(f"{name:6s} median {median:.2f} s ({median / plain:.2f} x plain)  {[round(t, 2) for t in values]}")
    finally:
        for env in servers.values():
            subprocess.run([sys.executable, "-m", "overmind", "shutdown"], env=env, capture_output=True)


if __name__ == "__main__":
    main()
