"""Warm-load time against model size: same tensor count, ~8x the bytes.

    python benchmarks/flatness.py [--runs 15] [--json FILE]

Two Llama-style causal LMs in bf16 with the same layers, hence the same tensors, one
with layers about three times wider (about 8x the bytes), saved into a temp folder.
A private overmind-server caches both; then each is loaded warm in ``--runs`` fresh
processes (libraries imported before the clock starts), alternating between the two so
that both see the same machine noise, and the medians are compared.
A warm load maps the segments and builds one tensor per table entry without touching
the bytes (Note [One mapping per load] in overmind.shared.segments.reductions), so it should not grow
with the bytes.
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

NARROW = dict(hidden_size=512, intermediate_size=1408, num_attention_heads=8, num_key_value_heads=4)
WIDE = dict(hidden_size=1536, intermediate_size=4096, num_attention_heads=24, num_key_value_heads=12)
COMMON = dict(num_hidden_layers=16, vocab_size=4096, max_position_embeddings=512, tie_word_embeddings=False)

WARM = """
import json, time, torch
import overmind.api
overmind.api.monkey_patch_all()
from transformers import AutoModelForCausalLM, LlamaForCausalLM  # imported before the clock
t0 = time.perf_counter()
model = AutoModelForCausalLM.from_pretrained({path!r}, torch_dtype=torch.bfloat16)
elapsed = time.perf_counter() - t0
state = model.state_dict()
print(json.dumps({{"seconds": elapsed, "tensors": len(state), "bytes": sum(t.nbytes for t in state.values())}}))
"""


def run(code: str, env: dict) -> dict:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"child failed ({out.returncode}):\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()

    import torch

    from overmind import modelgen

    with tempfile.TemporaryDirectory(prefix="om-flat-") as tmp:
        root = Path(tmp)
        paths = {}
        for name, widths in (("narrow", NARROW), ("wide", WIDE)):
            paths[name] = modelgen.save_lm(root / name, "small", torch.bfloat16, seed=1, **widths, **COMMON)
        modelgen.age_files(root)
        runtime = root / "rt"
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "OVERMIND_RUNTIME_DIR": str(runtime), "OVERMIND_NO_AUTOSTART": "1"}
        server = subprocess.Popen([sys.executable, "-m", "overmind.server", "--foreground"], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        try:
            if "ready" not in server.stdout.readline():
                raise RuntimeError("overmind-server did not start")
            first = {name: run(WARM.format(path=str(path)), {**env, "OVERMIND_COLD": "wait"})  # fills the cache
                     for name, path in paths.items()}
            warm: dict[str, list[float]] = {name: [] for name in paths}
            for _ in range(args.runs):
                for name, path in paths.items():
                    warm[name].append(run(WARM.format(path=str(path)), {**env, "OVERMIND_STRICT": "1"})["seconds"])
            results = {}
            for name, times in warm.items():
                results[name] = {"tensors": first[name]["tensors"], "bytes": first[name]["bytes"],
                                 "warm_median": statistics.median(times), "warm_min": min(times), "warm_max": max(times)}
                print(f"{name:7s} {first[name]['tensors']:4d} tensors {first[name]['bytes'] / 1e9:6.2f} GB   warm "
                      f"{results[name]['warm_median'] * 1e3:6.1f} ms (min {min(times) * 1e3:.1f}, "
                      f"max {max(times) * 1e3:.1f})", flush=True)
        finally:
            server.terminate()
            server.wait(timeout=30)
    narrow, wide = results["narrow"], results["wide"]
    assert narrow["tensors"] == wide["tensors"]
    summary = {"bytes_ratio": wide["bytes"] / narrow["bytes"], "warm_ratio": wide["warm_median"] / narrow["warm_median"],
               "runs": args.runs, "models": results, "when": time.strftime("%Y-%m-%d %H:%M")}
    print(f"bytes x{summary['bytes_ratio']:.1f}  ->  warm load x{summary['warm_ratio']:.2f} (target <= 1.3)")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
