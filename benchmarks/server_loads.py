"""Server acceptance (issue 3): cold and warm loads through overmind-server, fresh processes.

    python benchmarks/server_loads.py [--runs 3] [--json FILE]

Workloads, generated locally with random weights (cached in .bench-cache/):
- ``controlnet``: the seed's four calls, SD1.5 sizes, fp16 safetensors: AutoencoderKL, two
  ControlNetModels, StableDiffusionControlNetPipeline(vae=vae, controlnet=[a, b]).
- ``lm``: a 1.1 B parameter Llama-style causal LM in bf16.

Each run is a fresh process, page cache warm. ``plain`` has OVERMIND_DISABLE=1; ``cold``
runs right after ``overmind evict --all`` (loader zygote already up); ``first`` is a cold
load on a server started just before; ``warm`` hits. A cold load runs the original
loader in the calling process while the server caches in the background (Note [Cold
loads run behind the caller] in overmind.server); the script waits until the server is
idle before the next run. Times cover the load calls only: every mode imports the
libraries before the clock starts. Also measures what ``import overmind.api;
monkey_patch_all()`` adds to a fresh interpreter's start-up.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import CACHE, run_json, summary, warm_page_cache  # noqa: E402

CONTROLNET = """
import json, time
import overmind.api
overmind.api.monkey_patch_all()
import torch
from diffusers import AutoencoderKL, ControlNetModel, StableDiffusionControlNetPipeline
t = {{}}
t0 = time.perf_counter()
vae = AutoencoderKL.from_pretrained({sd!r}, subfolder="vae", torch_dtype=torch.float16)
t["vae"] = time.perf_counter() - t0; t1 = time.perf_counter()
depth = ControlNetModel.from_pretrained({cn_a!r}, torch_dtype=torch.float16)
t["depth"] = time.perf_counter() - t1; t1 = time.perf_counter()
edge = ControlNetModel.from_pretrained({cn_b!r}, torch_dtype=torch.float16)
t["edge"] = time.perf_counter() - t1; t1 = time.perf_counter()
pipe = StableDiffusionControlNetPipeline.from_pretrained({sd!r}, vae=vae, controlnet=[edge, depth],
                                                         torch_dtype=torch.float16, safety_checker=None)
t["pipeline"] = time.perf_counter() - t1
t["total"] = time.perf_counter() - t0
assert pipe.vae is vae
print(json.dumps(t))
"""

LM = """
import json, time
import overmind.api
overmind.api.monkey_patch_all()
import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM  # the model class imported before the clock
t0 = time.perf_counter()
model = AutoModelForCausalLM.from_pretrained({lm!r}, torch_dtype=torch.bfloat16)
t = {{"total": time.perf_counter() - t0}}
assert model.dtype == torch.bfloat16
print(json.dumps(t))
"""


def ensure_models() -> dict[str, Path]:
    import torch

    from overmind import modelgen

    paths = {"sd": CACHE / "sd15-fp16", "cn_a": CACHE / "controlnet-sd15-a-fp16", "cn_b": CACHE / "controlnet-sd15-b-fp16",
             "lm": CACHE / "llama-1b-bf16"}
    if not (paths["sd"] / "model_index.json").exists():
        print("generating SD1.5-size pipeline ...", file=sys.stderr)
        modelgen.save_sd_pipeline(paths["sd"], "sd15", torch.float16)
    for name, seed in (("cn_a", 11), ("cn_b", 12)):
        if not (paths[name] / "config.json").exists():
            print(f"generating SD1.5-size ControlNet {name} ...", file=sys.stderr)
            modelgen.save_controlnet(paths[name], "sd15", torch.float16, seed=seed)
    if not (paths["lm"] / "config.json").exists():
        print("generating 1.1B LM ...", file=sys.stderr)
        modelgen.save_lm(paths["lm"], "1b", torch.bfloat16)
    return paths


class BenchServer:
    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="om-bench-", dir="/tmp")
        self.env = {"OVERMIND_RUNTIME_DIR": self.dir, "OVERMIND_NO_AUTOSTART": "1"}
        self.start()

    def start(self) -> None:
        subprocess.run([sys.executable, "-m", "overmind.server", "--daemon"], check=True, capture_output=True,
                       env={**os.environ, **self.env})

    def cli(self, *args: str) -> str:
        return subprocess.run([sys.executable, "-m", "overmind.cli", *args], check=True, capture_output=True,
                              text=True, env={**os.environ, **self.env}).stdout

    def stop(self) -> None:
        self.cli("shutdown")

    def wait_idle(self, timeout: float = 600) -> dict:
        """Cold loads finish behind the caller: wait until nothing is loading."""
        deadline = time.monotonic() + timeout
        while True:
            status = json.loads(self.cli("status", "--json"))
            if status["loading"] == 0 or time.monotonic() > deadline:
                return status
            time.sleep(0.2)

    def run(self, code: str) -> dict:
        return run_json(code, env=self.env, forbid="overmind:")


def measure(code: str, server: BenchServer, runs: int, calls: int) -> dict:
    plain = [run_json(code, env={"OVERMIND_DISABLE": "1"}) for _ in range(runs)]
    first, cold, warm = [], [], []
    for _ in range(runs):
        server.stop()
        server.start()
        first.append(server.run(code))
        server.wait_idle()
        server.cli("evict", "--all")
        cold.append(server.run(code))
        server.wait_idle()
        warm.append(server.run(code))
    misses = server.wait_idle()["misses"]
    warm += [server.run(code) for _ in range(runs)]
    status = server.wait_idle()
    if status["misses"] != misses or misses != 2 * calls:
        raise RuntimeError(f"warm runs did not all hit the cache: {status}")

    def table(rows):
        return {k: summary([r[k] for r in rows]) for k in rows[0]}

    out = {"plain": table(plain), "first": table(first), "cold": table(cold), "warm": table(warm)}
    base = out["plain"]["total"]["median"]
    out["ratios"] = {mode: out[mode]["total"]["median"] / base for mode in ("first", "cold", "warm")}
    return out


def import_overhead(repeats: int = 20) -> dict:
    def median_time(code: str) -> float:
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "OVERMIND_NO_AUTOSTART": "1"})
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    bare = median_time("pass")
    patched = median_time("import overmind.api; overmind.api.monkey_patch_all()")
    return {"bare_s": bare, "patched_s": patched, "added_ms": (patched - bare) * 1000}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--only", choices=["controlnet", "lm", "import"])
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args()
    paths = ensure_models()
    for p in paths.values():
        warm_page_cache(p)
    result: dict = {}
    if args.only in (None, "import"):
        result["import"] = import_overhead()
        print(json.dumps({"import": result["import"]}), file=sys.stderr)
    server = BenchServer()
    try:
        if args.only in (None, "controlnet"):
            code = CONTROLNET.format(sd=str(paths["sd"]), cn_a=str(paths["cn_a"]), cn_b=str(paths["cn_b"]))
            result["controlnet"] = measure(code, server, args.runs, calls=4)
            print(json.dumps({"controlnet": result["controlnet"]["ratios"]}), file=sys.stderr)
        if args.only in (None, "lm"):
            result["lm"] = measure(LM.format(lm=str(paths["lm"])), server, args.runs, calls=1)
            print(json.dumps({"lm": result["lm"]["ratios"]}), file=sys.stderr)
    finally:
        server.stop()
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    for name in ("controlnet", "lm"):
        if name in result:
            r, p = result[name]["ratios"], result[name]["plain"]["total"]["median"]
            print(f"{name}: plain {p:.2f}s; warm {r['warm']:.3f}x (<= 0.07), cold {r['cold']:.2f}x, "
                  f"first {r['first']:.2f}x (<= 4)")
    if "import" in result:
        print(f"import overmind.api + monkey_patch_all adds {result['import']['added_ms']:.1f} ms (<= 50)")


if __name__ == "__main__":
    main()
