"""What ``overmind run`` adds when it cannot run warm: no server at all, so it execs plain python.

    .venv/bin/python benchmarks/run_overhead.py [--pairs 15]

Pairs of fresh processes, ``python -c pass`` then ``overmind run -c pass``, with a private,
empty runtime directory and ``OVERMIND_NO_AUTOSTART=1`` (no server is started); prints the
medians and their difference. Note [Never worse than plain python] in overmind.frontend.run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=15)
    args = parser.parse_args()
    bin_dir = Path(sys.executable).parent
    with tempfile.TemporaryDirectory(prefix="om-none-", dir="/tmp") as runtime:
        env = dict(os.environ, OVERMIND_RUNTIME_DIR=runtime, OVERMIND_NO_AUTOSTART="1")
        commands = {"python -c pass": [sys.executable, "-c", "pass"],
                    "overmind run -c pass": [str(bin_dir / "overmind"), "run", "-c", "pass"]}
        times: dict[str, list[float]] = {name: [] for name in commands}
        for _ in range(args.pairs):
            for name, argv in commands.items():
                started = time.monotonic()
                subprocess.run(argv, env=env, check=True)
                times[name].append(time.monotonic() - started)
    medians = {name: statistics.median(values) for name, values in times.items()}
    for name, median in medians.items():
        print(f"{name:<22} median {median * 1000:6.1f} ms over {args.pairs} runs")
    extra = medians["overmind run -c pass"] - medians["python -c pass"]
    print(f"overmind run with no server costs {extra * 1000:.1f} ms more than plain python")
    return 0


if __name__ == "__main__":
    sys.exit(main())
