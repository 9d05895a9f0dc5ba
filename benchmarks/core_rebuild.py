"""Zero-copy core acceptance: SD1.5-size fp16 UNet.

    python benchmarks/core_rebuild.py [--runs 3]

1. ``UNet2DConditionModel.from_pretrained`` in fresh processes (page cache warm)
   against rebuilding the same model from a sealed segment in fresh processes.
   Both sides import ``UNet2DConditionModel`` before the clock starts.
2. Writing the UNet into a new sealed segment (``overmind.shared.segments.reductions.pack``)
   against ``torch.empty`` + ``copy_`` of the same storages into fresh memory, both
   in one fresh process per run (order alternated).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import CACHE, run_json, summary, warm_page_cache  # noqa: E402

import torch  # noqa: E402

PLAIN = """
import json, time, torch
from diffusers import UNet2DConditionModel  # both sides import the class before the clock starts
t = time.perf_counter()
m = UNet2DConditionModel.from_pretrained({path!r}, torch_dtype=torch.float16)
print(json.dumps({{"seconds": time.perf_counter() - t}}))
"""

REBUILD = """
import json, time, ctypes, torch, psutil
from diffusers import UNet2DConditionModel
from overmind.shared.segments.memfd import Segment
from overmind.shared.segments.reductions import unpack
from overmind.shared.segments.native import HAVE_EXTENSION
skeleton = open({skeleton!r}, "rb").read()
rss0 = psutil.Process().memory_info().rss
t = time.perf_counter()
mappings = [None if h is None else Segment.open_proc({pid}, h[0], h[1]).map_private() for h in {handles!r}]
model = unpack(skeleton, mappings)
dt = time.perf_counter() - t
rss1 = psutil.Process().memory_info().rss
ranges = [(ctypes.addressof(ctypes.c_char.from_buffer(m)), len(m)) for m in mappings if m is not None]
inside = all(any(b <= p.data_ptr() < b + n for b, n in ranges) for p in model.state_dict().values() if p.numel())
print(json.dumps({{"seconds": dt, "rss_delta": rss1 - rss0, "inside": inside, "ext": HAVE_EXTENSION}}))
"""


def ensure_unet() -> Path:
    path = CACHE / "unet-sd15-fp16"
    if not (path / "config.json").exists():
        from overmind.modelgen import save_unet

        print(f"generating SD1.5-size UNet into {path} ...", file=sys.stderr)
        save_unet(path, "sd15", torch.float16)
    return path


FILL = """
import gc, json, time, torch
from diffusers import UNet2DConditionModel
from overmind.shared.segments.reductions import pack
model = UNet2DConditionModel.from_pretrained({path!r}, torch_dtype=torch.float16)
seen, storages = set(), []
for t in model.state_dict().values():
    s = t.untyped_storage()
    if s.data_ptr() not in seen:
        seen.add(s.data_ptr()); storages.append(s)
for s in storages:  # fault in the source pages once, so neither side pays for them
    torch.empty(0, dtype=torch.uint8).set_(s).sum()

def time_copy():
    t = time.perf_counter()
    copies = []
    for s in storages:
        dst = torch.empty(s.nbytes(), dtype=torch.uint8)
        dst.copy_(torch.empty(0, dtype=torch.uint8).set_(s))
        copies.append(dst)
    return time.perf_counter() - t

def time_pack():
    t = time.perf_counter()
    packed = pack(model, "unet")
    dt = time.perf_counter() - t
    packed.close()
    return dt

first, second = (time_pack, time_copy) if {pack_first} else (time_copy, time_pack)
a = first(); gc.collect(); b = second()
pack_s, copy_s = (a, b) if {pack_first} else (b, a)
print(json.dumps({{"pack_s": pack_s, "copy_s": copy_s, "nbytes": sum(s.nbytes() for s in storages)}}))
"""
# Fresh memory for torch.empty: a fixed mmap threshold stops glibc from handing back
# heap pages that an earlier free left already faulted in.
FRESH_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "131072"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args()

    from diffusers import UNet2DConditionModel
    from overmind.shared.segments.reductions import pack

    path = ensure_unet()
    warm_page_cache(path)
    pack_s, copy_s = [], []
    for run in range(args.runs):
        fill = run_json(FILL.format(path=str(path), pack_first=run % 2 == 0), env=FRESH_MALLOC)
        pack_s.append(fill["pack_s"])
        copy_s.append(fill["copy_s"])
        nbytes = fill["nbytes"]
    model = UNet2DConditionModel.from_pretrained(path, torch_dtype=torch.float16)
    packed = pack(model, "unet")
    del model
    gc.collect()

    with tempfile.NamedTemporaryFile(suffix=".skeleton", delete=False) as f:
        f.write(packed.skeleton)
    plain, rebuild = [], []
    try:
        for _ in range(args.runs):
            plain.append(run_json(PLAIN.format(path=str(path)))["seconds"])
            rebuild.append(run_json(REBUILD.format(skeleton=f.name, pid=os.getpid(),
                                                   handles=packed.handles())))
    finally:
        os.unlink(f.name)

    plain_med = statistics.median(plain)
    rebuild_med = statistics.median(r["seconds"] for r in rebuild)
    result = {
        "model_bytes": nbytes,
        "storages": packed.storages,
        "plain_from_pretrained_s": summary(plain),
        "rebuild_from_segment_s": summary([r["seconds"] for r in rebuild]),
        "rebuild_over_plain": rebuild_med / plain_med,
        "rebuild_rss_delta_fraction": max(r["rss_delta"] for r in rebuild) / nbytes,
        "rebuild_storages_inside_mapping": all(r["inside"] for r in rebuild),
        "extension": rebuild[0]["ext"],
        "pack_s": summary(pack_s),
        "empty_copy_s": summary(copy_s),
        "pack_gb_s": nbytes / statistics.median(pack_s) / 1e9,
        "empty_copy_gb_s": nbytes / statistics.median(copy_s) / 1e9,
    }
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    ok = result["rebuild_over_plain"] <= 0.10 and result["pack_gb_s"] >= result["empty_copy_gb_s"]
    print(f"rebuild/plain = {result['rebuild_over_plain']:.3f} (<= 0.10), "
          f"pack {result['pack_gb_s']:.2f} GB/s vs empty+copy_ {result['empty_copy_gb_s']:.2f} GB/s: "
          f"{'PASS' if ok else 'FAIL'}")


if __name__ == "__main__":
    main()
