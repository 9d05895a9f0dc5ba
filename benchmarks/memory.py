"""Memory acceptance: K processes holding a model, plain vs through overmind.

    python benchmarks/memory.py [--procs 4]

Each holder process loads, touches every weight once (as inference would), reports
ready and waits. Summed PSS (/proc/PID/smaps_rollup) of the holders (plus the server,
for overmind), minus K x the PSS of an idle process that imported the same libraries,
is compared to the model's tensor bytes. Cases: the ControlNet pipeline (fp16
safetensors), and an SD1.5 UNet saved in fp32 and loaded with torch_dtype=float16,
where plain loads cannot share pages through the page cache.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import CACHE, warm_page_cache  # noqa: E402
from server_loads import BenchServer, ensure_models  # noqa: E402

from overmind.bench.harness import pss  # noqa: E402

HOLD = """
import sys, torch
import overmind.api
overmind.api.monkey_patch_all()
from diffusers import AutoencoderKL, ControlNetModel, StableDiffusionControlNetPipeline, UNet2DConditionModel
case = sys.argv[1]
if case == "idle":
    objects = []
elif case == "controlnet":
    vae = AutoencoderKL.from_pretrained({sd!r}, subfolder="vae", torch_dtype=torch.float16)
    a = ControlNetModel.from_pretrained({cn_a!r}, torch_dtype=torch.float16)
    b = ControlNetModel.from_pretrained({cn_b!r}, torch_dtype=torch.float16)
    pipe = StableDiffusionControlNetPipeline.from_pretrained({sd!r}, vae=vae, controlnet=[b, a],
                                                             torch_dtype=torch.float16, safety_checker=None)
    objects = [m for m in pipe.components.values() if isinstance(m, torch.nn.Module)]
else:
    objects = [UNet2DConditionModel.from_pretrained({unet32!r}, torch_dtype=torch.float16)]
seen, nbytes = set(), 0
for module in objects:
    for t in module.state_dict().values():
        s = t.untyped_storage()
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr()); nbytes += s.nbytes()
            torch.empty(0, dtype=torch.uint8).set_(s).sum()  # touch every page
print(nbytes, flush=True)
sys.stdin.read()
"""


def hold(code: str, case: str, env: dict, procs: int) -> tuple[int, int]:
    """Start ``procs`` holders of ``case``; returns (summed PSS, tensor bytes)."""
    holders = [subprocess.Popen([sys.executable, "-c", code, case], env={**os.environ, **env}, text=True,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
               for _ in range(procs)]
    try:
        nbytes = [int(h.stdout.readline()) for h in holders]
        time.sleep(1)
        return sum(pss(h.pid) for h in holders), nbytes[0]
    finally:
        for h in holders:
            h.kill()
            h.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--procs", type=int, default=4)
    parser.add_argument("--json")
    args = parser.parse_args()
    paths = ensure_models()
    unet32 = CACHE / "unet-sd15-fp32"
    if not (unet32 / "config.json").exists():
        import torch

        from overmind.modelgen import save_unet

        print("generating an fp32 SD1.5 UNet ...", file=sys.stderr)
        save_unet(unet32, "sd15", torch.float32)
    for p in [*paths.values(), unet32]:
        warm_page_cache(p)
    code = HOLD.format(sd=str(paths["sd"]), cn_a=str(paths["cn_a"]), cn_b=str(paths["cn_b"]), unet32=str(unet32))
    plain_env = {"OVERMIND_DISABLE": "1"}
    idle, _ = hold(code, "idle", plain_env, 1)
    server = BenchServer()
    result = {"procs": args.procs, "idle_pss": idle}
    try:
        for case in ("controlnet", "unet_fp32_as_fp16"):
            plain, nbytes = hold(code, case, plain_env, args.procs)
            cached_env = {**server.env, "OVERMIND_COLD": "wait"}
            subprocess.run([sys.executable, "-c", code.replace("sys.stdin.read()", ""), case],
                           env={**os.environ, **cached_env}, check=True, capture_output=True)  # fill the cache
            server.wait_idle()
            cached, _ = hold(code, case, cached_env, args.procs)
            server_pss = pss(int((Path(server.dir) / "server.pid").read_text()))
            extra = args.procs * idle
            result[case] = {
                "tensor_bytes": nbytes,
                "plain_ratio": (plain - extra) / nbytes,
                "overmind_ratio": (cached + server_pss - extra) / nbytes,
            }
            print(json.dumps({case: result[case]}), file=sys.stderr)
    finally:
        server.stop()
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    for case in ("controlnet", "unet_fp32_as_fp16"):
        r = result[case]
        print(f"{case}: {args.procs} processes hold {r['tensor_bytes'] / 1e9:.2f} GB of tensors; "
              f"(summed PSS - idle) / bytes: plain {r['plain_ratio']:.2f}, overmind {r['overmind_ratio']:.2f} (<= 1.15)")


if __name__ == "__main__":
    main()
