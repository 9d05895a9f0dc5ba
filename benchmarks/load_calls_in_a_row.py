"""The ControlNet script's four load calls in fresh processes in a row, as an edit-run loop makes
them: a fresh server and state dir (autostarted by run 1, which is cold), then RUNS warm runs
with the default settings (each handed to a warm interpreter), each paired with a plain python
run of the same script (``OVERMIND_DISABLE=1``) in the same round, GAP seconds apart::

    .venv/bin/python benchmarks/load_calls_in_a_row.py [--runs 6] [--gap 3] [--json out.json]

The models are the bench's (``overmind-bench --scenarios controlnet`` makes them, in
~/.cache/overmind-bench/base or OVERMIND_BENCH_CACHE). Prints each round, the four calls'
median against plain's, and the slowest pipeline hit. A component figure: the load calls only,
not the process (the bench and ``real_envs.sh`` time whole processes).
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

SCRIPT = '''\
import overmind.api
overmind.api.monkey_patch_all()
import json, sys, time
import torch
from diffusers import AutoencoderKL, ControlNetModel, StableDiffusionControlNetPipeline

base, times = sys.argv[1], {}


def timed(name, call):
    start = time.perf_counter()
    obj = call()
    times[name] = time.perf_counter() - start
    return obj


vae = timed("vae", lambda: AutoencoderKL.from_pretrained(f"{base}/sd-fp16", subfolder="vae", torch_dtype=torch.float16))
depth = timed("depth", lambda: ControlNetModel.from_pretrained(f"{base}/controlnet-a-fp16", torch_dtype=torch.float16))
edge = timed("edge", lambda: ControlNetModel.from_pretrained(f"{base}/controlnet-b-fp16", torch_dtype=torch.float16))
timed("pipeline", lambda: StableDiffusionControlNetPipeline.from_pretrained(
    f"{base}/sd-fp16", vae=vae, controlnet=[edge, depth], torch_dtype=torch.float16, safety_checker=None))
print(json.dumps(times))
'''
CALLS = ("vae", "depth", "edge", "pipeline")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=6, help="warm runs after the cold one (default 6)")
    parser.add_argument("--gap", type=float, default=3.0, help="seconds between runs (default 3)")
    parser.add_argument("--json", help="write the rounds here")
    args = parser.parse_args()
    base = Path(os.environ.get("OVERMIND_BENCH_CACHE", Path.home() / ".cache" / "overmind-bench")) / "base"
    if not (base / "controlnet-b-fp16").is_dir():
        print(f"no models in {base}: make them with `overmind-bench --scenarios controlnet`", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="overmind-in-a-row-") as work:
        script = Path(work) / "controlnet.py"
        script.write_text(SCRIPT)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "OVERMIND_RUNTIME_DIR": f"{work}/rt",
               "OVERMIND_STATE_DIR": f"{work}/state"}

        def run(**extra) -> dict:
            out = subprocess.run([sys.executable, str(script), str(base)], env={**env, **extra}, cwd=work,
                                 capture_output=True, text=True, timeout=600)
            if out.returncode != 0 or "overmind:" in out.stderr:
                raise SystemExit(f"a run failed ({out.returncode}):\n{out.stderr[-3000:]}")
            return json.loads(out.stdout.strip().splitlines()[-1])

        try:
            cold = run()
            print(f"cold: four calls {sum(cold[c] for c in CALLS):.3f} s", flush=True)
            rounds = []
            for i in range(args.runs):
                time.sleep(args.gap)
                plain = run(OVERMIND_DISABLE="1")
                time.sleep(args.gap)
                warm = run()
                rounds.append({"plain": plain, "warm": warm})
                four, plain_four = sum(warm[c] for c in CALLS), sum(plain[c] for c in CALLS)
                print(f"warm {i + 1}: four calls {four:.4f} s, plain {plain_four:.4f} s ({four / plain_four:.3f} x), "
                      + ", ".join(f"{c} {warm[c]:.4f}" for c in CALLS), flush=True)
        finally:
            subprocess.run([sys.executable, "-m", "overmind", "shutdown"], env=env, capture_output=True, timeout=60)
    four = statistics.median(sum(r["warm"][c] for c in CALLS) for r in rounds)
    plain_four = statistics.median(sum(r["plain"][c] for c in CALLS) for r in rounds)
    slowest = max(r["warm"]["pipeline"] for r in rounds)
    print(f"four calls: median {four:.4f} s against plain's {plain_four:.4f} s: {four / plain_four:.3f} x; "
          f"the slowest pipeline hit {slowest:.4f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"cold": cold, "rounds": rounds, "gap_s": args.gap}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
