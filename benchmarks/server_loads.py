"""Cold and warm loads through overmind-server: now ``overmind-bench``; this is a thin wrapper.

    python benchmarks/server_loads.py [--runs 3] [--only controlnet|lm|import] [--json FILE]

runs ``overmind-bench --scenarios controlnet,lm,startup --modes plain,first,cold,warm
--runs N --warm-runs 2N --cache-dir .bench-cache`` (``first``: a cold load on a server
started just before). ``BenchServer`` and ``ensure_models`` stay importable for
``benchmarks/memory.py``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import CACHE  # noqa: E402

from overmind.bench import harness, main as bench_main, models  # noqa: E402


class BenchServer(harness.BenchServer):
    """A private server, started on construction (the interface benchmarks/memory.py uses)."""

    def __init__(self) -> None:
        super().__init__(Path(tempfile.mkdtemp(prefix="om-bench-", dir="/tmp")))
        self.dir = str(self.runtime_dir)
        self.launch()


def ensure_models() -> dict[str, Path]:
    """The ControlNet workload's SD1.5-size models and the 1.1 B LM, generated into .bench-cache once."""
    paths = models.ensure_models(CACHE, "base", ["sd", "controlnet_a", "controlnet_b", "lm"])
    return {"sd": paths["sd"], "cn_a": paths["controlnet_a"], "cn_b": paths["controlnet_b"], "lm": paths["lm"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--only", choices=["controlnet", "lm", "import"])
    parser.add_argument("--json", help="write the figures to this file (overmind-bench's schema)")
    args = parser.parse_args()
    scenarios = {"controlnet": "controlnet", "lm": "lm", "import": "startup", None: "controlnet,lm,startup"}
    argv = ["--scenarios", scenarios[args.only], "--modes", "plain,first,cold,warm", "--runs", str(args.runs),
            "--warm-runs", str(2 * args.runs), "--cache-dir", str(CACHE)]
    return bench_main(argv + (["--json", args.json] if args.json else []))


if __name__ == "__main__":
    sys.exit(main())
