"""A script run from the shell, start to ready model and to first use of every weight: plain
``python``, ``python`` with ``monkey_patch_all()``, ``overmind run``, and the first ``overmind run``
of a new context. Now part of ``overmind-bench``; this is a thin wrapper.

    python benchmarks/whole_process.py [--runs 5] [--only controlnet|lm|imports] [--cold] [--json FILE]

runs ``overmind-bench --scenarios whole_process --whole-runs N [--whole-scripts NAME]
[--drop-page-cache]`` with the bench's model cache (``~/.cache/overmind-bench``,
``OVERMIND_BENCH_CACHE``): SD1.5-size ControlNet pipeline, a 1.1 B Llama-layout LM, and
``-c "import torch, diffusers, transformers"``. See :mod:`overmind.bench.whole`.
"""

from __future__ import annotations

import argparse
import sys

from overmind.bench import main as bench_main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5, help="timed runs per script and mode (default 5)")
    parser.add_argument("--only", choices=["controlnet", "lm", "imports"])
    parser.add_argument("--cold", action="store_true", help="also with the model's files evicted from the page cache")
    parser.add_argument("--scale", default="base", help="overmind-bench --scale (default base: SD1.5 sizes, 1.1 B LM)")
    parser.add_argument("--json", help="write the figures to this file (overmind-bench's schema)")
    args = parser.parse_args()
    argv = ["--scenarios", "whole_process", "--whole-runs", str(args.runs), "--scale", args.scale]
    argv += ["--whole-scripts", args.only] if args.only else []
    argv += ["--drop-page-cache"] if args.cold else []
    argv += ["--json", args.json] if args.json else []
    return bench_main(argv)


if __name__ == "__main__":
    sys.exit(main())
