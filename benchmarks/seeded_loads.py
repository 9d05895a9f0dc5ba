"""A fine-tuning script's load: ``set_seed(s)`` then a base checkpoint with a new head.

    .venv/bin/python benchmarks/seeded_loads.py [--model PATH] [--runs 5]

The new head is drawn from the caller's seed (Note [Loads that draw random numbers] in
overmind.shared.calls.callstate), so such a load is filed by the generator state it started from. This
measures what that choice costs and saves against the alternative, never caching such loads
(which is what plain python does), in fresh processes, modes interleaved, from process start:

- ``plain``: ``python script.py`` (OVERMIND_DISABLE=1);
- ``same seed``: ``monkey_patch_all()``, the seed of every restart the same (a hit);
- ``new seed``: ``monkey_patch_all()``, a seed never seen before (a lookup of the seedless key,
  then a miss under the seed's own key: the caller loads plainly while the server fills);
- ``run, same seed``: ``overmind run`` of the same script, the seed the same (a hit in a
  child of a warm interpreter that learned the script's imports in two earlier runs).

Every run checks that the head and the next random draw are exactly the plain run's for that
seed. Uses overmind-bench's 1.1 B Llama (bf16) from ~/.cache/overmind-bench unless --model.
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

SCRIPT = r'''
import json, os, sys, time
started = float(os.environ["BENCH_STARTED"])
if os.environ.get("OVERMIND_DISABLE") != "1":
    import overmind.api
    overmind.api.monkey_patch_all()
import torch
from transformers import AutoModelForSequenceClassification, set_seed
imported = time.time()
set_seed(int(sys.argv[2]))
model = AutoModelForSequenceClassification.from_pretrained(sys.argv[1], num_labels=2)
ready = time.time()
total = sum(float(p.float().sum()) for p in model.parameters())  # first use of every weight
used = time.time()
print(json.dumps({"imports": imported - started, "load": ready - imported, "ready": ready - started,
                  "used": used - started, "head": [round(float(x), 6) for x in model.score.weight.flatten()[:8]],
                  "next_draw": [round(float(x), 6) for x in torch.rand(4)], "total": total}))
'''


def run(model: str, seed: int, env: dict, warm: bool = False) -> dict:
    """One fresh process; ``warm``: through ``overmind run`` (a child of a warm interpreter)."""
    env = {**env, "BENCH_STARTED": repr(time.time())}
    front = [os.path.join(os.path.dirname(sys.executable), "overmind"), "run"] if warm else [sys.executable]
    out = subprocess.run([*front, "-c", SCRIPT, model, str(seed)], capture_output=True, text=True, env=env,
                         timeout=900)
    if out.returncode != 0 or "overmind:" in out.stderr:
        raise RuntimeError(f"run failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def wait_idle(env: dict, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = subprocess.run([sys.executable, "-m", "overmind.frontend.cli", "status", "--json"], env=env, capture_output=True,
                             text=True)
        if out.returncode == 0 and json.loads(out.stdout).get("loading", 0) == 0:
            return
        time.sleep(0.5)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(Path.home() / ".cache/overmind-bench/base/lm-bf16"))
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    runtime = tempfile.mkdtemp(prefix="om-seeded-", dir="/tmp")
    base = {**os.environ, "HF_HUB_OFFLINE": "1", "OVERMIND_RUNTIME_DIR": runtime, "TOKENIZERS_PARALLELISM": "false"}
    plain_env = {**base, "OVERMIND_DISABLE": "1"}
    patched = {**base, "OVERMIND_COLD": "wait"}
    try:
        run(args.model, 42, patched)  # fill seed 42 (the caller waits for it here, not in the runs)
        for _ in range(2):  # the warm interpreter learns the script's modules
            run(args.model, 42, base, warm=True)
            wait_idle(base)
        results: dict[str, list] = {"plain": [], "same seed": [], "new seed": [], "run, same seed": []}
        for i in range(args.runs):
            new_seed = 1000 + i
            reference = {42: run(args.model, 42, plain_env), new_seed: run(args.model, new_seed, plain_env)}
            results["plain"].append(reference[42])
            for mode, seed in (("same seed", 42), ("new seed", new_seed), ("run, same seed", 42)):
                out = run(args.model, seed, {**base}, warm=mode.startswith("run"))
                for field in ("head", "next_draw", "total"):
                    if out[field] != reference[seed][field]:
                        raise SystemExit(f"{mode}: {field} differs from plain for seed {seed}")
                results[mode].append(out)
                wait_idle(base)  # the new seed's fill finishes before the next run starts
        plain = {k: statistics.median(r[k] for r in results["plain"]) for k in ("load", "ready", "used")}
        print(f"{args.model}, {args.runs} runs per mode, interleaved; seconds from process start (medians)")
        print(f"{'mode':<14} {'imports':>8} {'load':>7} {'ready':>7} {'used':>7} {'x plain (used)':>15}")
        for mode, rows in results.items():
            med = {k: statistics.median(r[k] for r in rows) for k in ("imports", "load", "ready", "used")}
            print(f"{mode:<14} {med['imports']:8.2f} {med['load']:7.2f} {med['ready']:7.2f} {med['used']:7.2f} "
                  f"{med['used'] / plain['used']:15.3f}")
        print("every run: head and next draw identical to the plain run of its seed")
    finally:
        subprocess.run([sys.executable, "-m", "overmind.frontend.cli", "shutdown"], env=base, capture_output=True)
        subprocess.run(["rm", "-rf", runtime])
    return 0


if __name__ == "__main__":
    sys.exit(main())
