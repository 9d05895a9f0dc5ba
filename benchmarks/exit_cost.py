"""What leaving costs a process that holds the ControlNet script's models: from its last line to
the process reaped, plain python against the drop-in's exit (Note [The drop-in leaves quickly]
in overmind.shared.process.teardown) and ``os._exit``, interleaved, page cache warm. A component figure:
the whole run is in ``overmind-bench``'s warm-up curve.

    python benchmarks/exit_cost.py [--rounds 3]

No server: every load is plain (``OVERMIND_NO_AUTOSTART=1``), so only the exit differs. The
drop-in's rows also time its atexit callback, and the search for open files within it (the rest
is the collection), from wrappers around the real ones. Uses the models ``overmind-bench``
generates (``~/.cache/overmind-bench``, ``base``; generated if absent).
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

from overmind.bench.models import ensure_models

CHILD = r"""
import atexit, gc, json, os, sys, time
mode, paths = sys.argv[1], json.loads(sys.argv[2])
parts = {}
if mode == "drop-in":
    import overmind.api
    overmind.api.monkey_patch_all()
    from overmind.shared.process import teardown

    def timed_flush(flush=teardown.flush_left_open):
        started = time.monotonic()
        flush()
        parts["find_and_flush"] = time.monotonic() - started

    def timed(callback=teardown._at_exit):  # the drop-in's own callback, its flush timed inside it
        teardown.flush_left_open = timed_flush
        started = time.monotonic()
        callback()
        parts["callback"] = time.monotonic() - started
        print(json.dumps(parts), file=sys.stderr, flush=True)

    atexit.unregister(teardown._at_exit)  # in its place, before any other callback is registered
    atexit.register(timed)
import torch
from diffusers import AutoencoderKL, ControlNetModel, StableDiffusionControlNetPipeline

a = ControlNetModel.from_pretrained(paths["controlnet_a"], torch_dtype=torch.float16)
b = ControlNetModel.from_pretrained(paths["controlnet_b"], torch_dtype=torch.float16)
vae = AutoencoderKL.from_pretrained(paths["sd"], subfolder="vae", torch_dtype=torch.float16)
pipe = StableDiffusionControlNetPipeline.from_pretrained(paths["sd"], vae=vae, controlnet=[a, b],
                                                         torch_dtype=torch.float16, safety_checker=None)
print("objects", len(gc.get_objects()), flush=True)
print("last_line", repr(time.monotonic()), flush=True)
if mode == "os._exit":
    os._exit(0)
"""

MODES = ("plain", "drop-in", "os._exit")


def _exit_once(mode: str, paths: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OVERMIND_")}
    env.update(HF_HUB_OFFLINE="1", OVERMIND_NO_AUTOSTART="1", OVERMIND_PRESTART="0")
    proc = subprocess.run([sys.executable, "-c", CHILD, mode, json.dumps({k: str(v) for k, v in paths.items()})],
                          env=env, capture_output=True, text=True, check=True)
    reaped = time.monotonic()
    said = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if line.startswith(("last_line", "objects")))
    row = {"exit": reaped - float(said["last_line"]), "objects": int(said["objects"])}
    parts = [line for line in proc.stderr.splitlines() if line.startswith("{")]
    if parts:
        row.update(json.loads(parts[-1]))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the three exits (default 3)")
    args = parser.parse_args()
    paths = ensure_models(Path.home() / ".cache" / "overmind-bench", "base", ["sd", "controlnet_a", "controlnet_b"])
    rows: dict = {mode: [] for mode in MODES}
    for number in range(args.rounds):
        for mode in MODES:
            rows[mode].append(_exit_once(mode, paths))
            print(f"round {number + 1} {mode}: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                                          for k, v in rows[mode][-1].items()), flush=True)
    print("median exit, from the last line to the process reaped:")
    for mode in MODES:
        values = [r["exit"] for r in rows[mode]]
        extra = ""
        if mode == "drop-in":
            extra = "  (its callback {:.3f} s, of which finding and flushing open files {:.3f} s)".format(
                statistics.median(r["callback"] for r in rows[mode]),
                statistics.median(r["find_and_flush"] for r in rows[mode]))
        print(f"  {mode:9} {statistics.median(values):.3f} s (min {min(values):.3f}, max {max(values):.3f}){extra}")


if __name__ == "__main__":
    main()
