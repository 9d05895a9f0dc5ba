"""How fast a cold load fills the cache: ``overmind.shared.segments.reductions.pack`` of the controlnet workload.

    python benchmarks/fill_rate.py [--runs 3] [--settings never,advise] [--before SRC_DIR]
                                   [--pause SECONDS] [--cache-dir ~/.cache/overmind-bench]

Each measurement is a fresh process that loads overmind-bench's ``controlnet`` scenario
plainly (AutoencoderKL, two ControlNetModels, StableDiffusionControlNetPipeline(vae=vae,
controlnet=[edge, depth]), fp16, the bench's ``base`` scale: 3.58 GB), reads every weight
once (so the source is resident, as after the loader's own load), then packs the four
results into new sealed segments as the loader does (the pipeline refers to the models it
was given) and reports GB/s: tensor bytes written over the seconds ``pack`` took (the entry is
served from then on). Then it times what the loader does next, behind the served entry, where
the setting allows: ``collapse_to_huge_pages`` of every new segment (here at normal priority),
and the share of the bytes in huge pages after it.

``--settings``: run under each value of ``shmem_enabled`` (root; the original is put back
afterwards, also on Ctrl-C). ``--before SRC_DIR``: also run another overmind source tree
(e.g. ``git archive <commit> src | tar -x -C DIR``, with ``overmind/_C*.so`` copied in) on
``PYTHONPATH``, as ``before``. Every run visits each (code, setting) pair in turn, the two
codes back to back in alternating order, and the summary gives each run's after / before.
Run it under ``flock /tmp/overmind-measure.lock``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from overmind.bench import shmem

CHILD = r"""
import json, sys, time, torch
from diffusers import AutoencoderKL, ControlNetModel, StableDiffusionControlNetPipeline
import overmind.shared.segments.reductions as R
import overmind.shared.segments.memfd as M
root = sys.argv[1]
f16 = torch.float16
vae = AutoencoderKL.from_pretrained(root + "/sd-fp16", subfolder="vae", torch_dtype=f16)
depth = ControlNetModel.from_pretrained(root + "/controlnet-a-fp16", torch_dtype=f16)
edge = ControlNetModel.from_pretrained(root + "/controlnet-b-fp16", torch_dtype=f16)
pipe = StableDiffusionControlNetPipeline.from_pretrained(root + "/sd-fp16", vae=vae, controlnet=[edge, depth],
                                                         torch_dtype=f16, safety_checker=None)
seen = set()
for module in pipe.components.values():
    if isinstance(module, torch.nn.Module):
        for t in [*module.parameters(), *module.buffers()]:
            s = t.untyped_storage()
            if s.data_ptr() not in seen:
                seen.add(s.data_ptr())
                torch.empty(0, dtype=torch.uint8).set_(s)[::4096].sum()
written, seconds, segments = 0, 0.0, []
calls = [(vae, None), (depth, None), (edge, None), (pipe, {id(vae): "vae", id(edge): "edge", id(depth): "depth"})]
huge0 = next(int(l.split()[1]) for l in open("/proc/meminfo") if l.startswith("ShmemHugePages:"))
for obj, refs in calls:
    t = time.perf_counter()
    packed = R.pack(obj, name="fill", references=refs)
    seconds += time.perf_counter() - t
    written += packed.nbytes
    segments.append(packed)
huge1 = next(int(l.split()[1]) for l in open("/proc/meminfo") if l.startswith("ShmemHugePages:"))
# What the loader does after answering (code that has it): rebuild the segments out of huge pages.
t = time.perf_counter()
collapsed = sum(s.collapse_to_huge_pages() for p in segments for s in p.segments
                if s is not None and hasattr(s, "collapse_to_huge_pages"))
collapse_seconds = time.perf_counter() - t
huge2 = next(int(l.split()[1]) for l in open("/proc/meminfo") if l.startswith("ShmemHugePages:"))
print(json.dumps({"bytes": written, "seconds": seconds, "gb_per_s": written / seconds / 1e9,
                  "huge_fraction": (huge1 - huge0) * 1024 / written, "memfd": M.__file__,
                  "collapse_seconds": collapse_seconds, "collapsed_bytes": collapsed,
                  "huge_fraction_after_collapse": (huge2 - huge0) * 1024 / written,
                  "segment_bytes": sum(s.size for p in segments for s in p.segments if s is not None)}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--settings", help="comma-separated shmem_enabled values (root), e.g. never,advise")
    parser.add_argument("--before", type=Path, help="another overmind src/ folder to compare with")
    parser.add_argument("--pause", type=float, default=0.0,
                        help="seconds to wait before each measurement, so the memory the last one freed settles "
                             "(this VM hands free memory back to its host within seconds)")
    parser.add_argument("--cache-dir", type=Path, default=Path(os.environ.get(
        "OVERMIND_BENCH_CACHE", Path.home() / ".cache" / "overmind-bench")))
    args = parser.parse_args()
    root = args.cache_dir.expanduser() / "base"
    original = shmem.current()
    settings = list(dict.fromkeys(args.settings.split(","))) if args.settings else [original]
    codes = {"after": None, **({"before": str(args.before.resolve())} if args.before else {})}
    results: dict = {f"{c} {s}": [] for s in settings for c in codes}
    with shmem.Switch(settings) as switch:  # puts the original back, also on Ctrl-C and SIGTERM
        for run in range(args.runs):
            for setting in settings:
                switch.set(setting)
                for code, path in (codes.items() if run % 2 == 0 else reversed(codes.items())):
                    time.sleep(args.pause)
                    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
                    if path:
                        env["PYTHONPATH"] = path
                    proc = subprocess.run([sys.executable, "-c", CHILD, str(root)], capture_output=True, text=True,
                                          env=env, timeout=600)
                    if proc.returncode != 0:
                        raise RuntimeError(proc.stderr[-3000:])
                    out = json.loads(proc.stdout.strip().splitlines()[-1])
                    results[f"{code} {setting}"].append(out)
                    print(f"run {run + 1} {code} {setting}: {out['gb_per_s']:.2f} GB/s, "
                          f"{out['huge_fraction']:.2f} in huge pages; then collapse "
                          f"{out['collapse_seconds']:.2f} s, {out['huge_fraction_after_collapse']:.2f} in huge pages "
                          f"({out['memfd']})", file=sys.stderr, flush=True)
    summary = {k: {"gb_per_s_median": statistics.median(r["gb_per_s"] for r in v),
                   "gb_per_s": [round(r["gb_per_s"], 3) for r in v],
                   "huge_fraction": statistics.median(r["huge_fraction"] for r in v),
                   "collapse_seconds_median": statistics.median(r["collapse_seconds"] for r in v),
                   "huge_fraction_after_collapse": statistics.median(r["huge_fraction_after_collapse"] for r in v),
                   "bytes": v[0]["bytes"], "segment_bytes": v[0]["segment_bytes"]} for k, v in results.items() if v}
    if args.before:  # paired: the two codes ran back to back in each run, in alternating order
        for setting in settings:
            ratios = [a["gb_per_s"] / b["gb_per_s"]
                      for a, b in zip(results[f"after {setting}"], results[f"before {setting}"])]
            summary[f"after / before {setting}"] = {"median": statistics.median(ratios),
                                                    "ratios": [round(r, 3) for r in ratios]}
    print(json.dumps({"original_setting": original, "results": summary}, indent=2))


if __name__ == "__main__":
    main()
