"""What the first pass over a warm model's pages costs a fresh process, over time.

    python benchmarks/first_touch.py [--gib 3.4] [--processes 20] [--every 3]

Fills one segment as a loader does (``Segment.create``, ``pwrite``, ``finish``, then
``collapse_to_huge_pages``), then starts fresh processes one after another. Each maps it as
a client does (``Segment.from_fd`` + ``map_private``), reads one byte of every 4 KiB twice,
and prints both passes with its page faults and CPU time. Same bytes, same pages, same
faults in every process: what changes from one to the next is what this machine charges
for touching them. On a VM that hands free memory back to its host, the first pass varies
by 10 x while the second stays flat; ``overmind-bench``'s ``first use`` of a warm model
inherits that spread. Run it under ``shmem_enabled`` = ``advise`` to see huge pages (it
says how much of the segment was rebuilt), and under ``flock /tmp/overmind-measure.lock``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

from overmind.shared.segments.memfd import Segment

CHILD = r"""
import resource, sys, time, torch
from overmind.shared.segments.memfd import Segment
segment = Segment.from_fd(int(sys.argv[1]), int(sys.argv[2]))
pages = torch.frombuffer(segment.map_private(), dtype=torch.uint8)[::4096]
torch.set_num_threads(1)
before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
pages.sum().item()
first, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
start = time.perf_counter()
pages.sum().item()
second = time.perf_counter() - start
print(f"first pass {first:.3f} s (cpu {after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime:.3f} s, "
      f"{after.ru_minflt - before.ru_minflt} faults), second pass {second:.3f} s")
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=3.4, help="segment size (default 3.4, the ControlNet workload's)")
    parser.add_argument("--processes", type=int, default=20)
    parser.add_argument("--every", type=float, default=3.0, help="seconds between two processes")
    args = parser.parse_args()
    size = int(args.gib * (1 << 30)) // (2 << 20) * (2 << 20)
    segment = Segment.create("first-touch", size)
    chunk = memoryview(bytes([1]) * (16 << 20))  # sliced without copying
    start = time.perf_counter()
    for offset in range(0, size, len(chunk)):
        segment.write_at(offset, chunk[: size - offset])
    segment.finish(size)
    filled = time.perf_counter() - start
    start = time.perf_counter()
    rebuilt = segment.collapse_to_huge_pages()
    print(f"{size / 1e9:.2f} GB segment: filled in {filled:.1f} s, {rebuilt / size:.0%} rebuilt as huge pages "
          f"in {time.perf_counter() - start:.1f} s", flush=True)
    t0 = time.monotonic()
    try:
        for _ in range(args.processes):
            proc = subprocess.run([sys.executable, "-c", CHILD, str(segment.fd), str(size)], pass_fds=[segment.fd],
                                  capture_output=True, text=True, timeout=300)
            line = proc.stdout.strip() if proc.returncode == 0 else f"failed: {proc.stderr.strip()[-500:]}"
            print(f"{time.monotonic() - t0:6.1f} s after: {line}", flush=True)
            time.sleep(args.every)
    finally:
        segment.close()


if __name__ == "__main__":
    main()
