"""How to fill a memfd segment fastest, under each shmem huge-page setting.

    python benchmarks/segment_fill.py [--gb 1.0] [--runs 5] [--settings never,advise]

Copies the same already-touched source into new memfds by: ``pwrite``; ``pwrite`` from two
threads into two memfds (how a pack fills: Note [Parallel fill] in overmind.shared.segments.writer);
a ``MAP_SHARED`` mapping asked for huge pages (``madvise(MADV_HUGEPAGE)``) and ``memmove``, from
one and from two threads; the same mapping populated with ``MADV_POPULATE_WRITE`` and then
``pwrite``; ``ftruncate`` + plain mapping + ``memmove``; and ``torch.empty`` + ``copy_`` into
fresh memory as the reference. The methods take turns within each run (A B C A B C ...).

``--settings``: run everything once per value of
``/sys/kernel/mm/transparent_hugepage/shmem_enabled`` (root only; the original value is put
back afterwards, also on Ctrl-C or an error). Without it the machine's current setting is
used. For each method: median GB/s and how much of the segment ``ShmemHugePages`` grew by.
Run it under ``flock /tmp/overmind-measure.lock`` (the setting is machine-global).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

from overmind.shared.segments.memfd import buffer_at

# Note [Fresh memory for every method]
# Where the machine is a VM that hands freed memory back to its host (free page reporting,
# as on this Firecracker guest: page_reporting_order=11), a method that reuses memory the
# one before it just freed skips the host's faults and looks several times faster than a
# real cold load, which fills memory freed long ago. So each method starts after the
# reporting delay (2 s) has passed, and each run starts the rotation at the next method.
SHMEM_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
MADV_POPULATE_WRITE = 23
CHUNK = 1 << 30


def current_setting() -> str:
    text = SHMEM_ENABLED.read_text()
    return text[text.index("[") + 1:text.index("]")]


def shmem_huge_bytes() -> int:
    for line in open("/proc/meminfo"):
        if line.startswith("ShmemHugePages:"):
            return int(line.split()[1]) * 1024
    return 0


def methods(n: int, src: torch.Tensor) -> dict:
    view = buffer_at(src.data_ptr(), n)
    base = src.data_ptr()

    def memfd() -> int:
        return os.memfd_create("fill", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)

    def pwrite_range(fd: int, lo: int, hi: int, at: int) -> None:
        while lo < hi:
            done = os.pwrite(fd, view[lo:min(hi, lo + CHUNK)], at)
            lo, at = lo + done, at + done

    def mapped_copy(fd: int, lo: int, hi: int, huge: bool, populate_then_pwrite: bool = False) -> None:
        os.ftruncate(fd, hi - lo)
        m = mmap.mmap(fd, hi - lo, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        try:
            if huge:
                m.madvise(mmap.MADV_HUGEPAGE)
            if populate_then_pwrite:
                m.madvise(MADV_POPULATE_WRITE)
                pwrite_range(fd, lo, hi, 0)
            else:
                ctypes.memmove(ctypes.addressof(ctypes.c_char.from_buffer(m)), base + lo, hi - lo)  # GIL released
        finally:
            m.close()

    def two_threads(fill) -> None:
        fds, half = [memfd(), memfd()], n // 2 // 4096 * 4096
        threads = [threading.Thread(target=fill, args=(fds[0], 0, half)),
                   threading.Thread(target=fill, args=(fds[1], half, n))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return fds

    def one(fill):
        def run():
            fd = memfd()
            fill(fd, 0, n)
            return [fd]
        return run

    def empty_copy():
        torch.empty(n, dtype=torch.uint8).copy_(src)
        return []

    return {
        "torch.empty + copy_": empty_copy,
        "pwrite": one(lambda fd, lo, hi: pwrite_range(fd, lo, hi, 0)),
        "pwrite, 2 threads": lambda: two_threads(lambda fd, lo, hi: pwrite_range(fd, lo, hi, 0)),
        "mmap + memmove": one(lambda fd, lo, hi: mapped_copy(fd, lo, hi, huge=False)),
        "mmap + MADV_HUGEPAGE + memmove": one(lambda fd, lo, hi: mapped_copy(fd, lo, hi, huge=True)),
        "mmap + MADV_HUGEPAGE + memmove, 2 threads": lambda: two_threads(
            lambda fd, lo, hi: mapped_copy(fd, lo, hi, huge=True)),
        "mmap + MADV_HUGEPAGE + POPULATE_WRITE, pwrite": one(
            lambda fd, lo, hi: mapped_copy(fd, lo, hi, huge=True, populate_then_pwrite=True)),
    }


def measure(n: int, runs: int, src: torch.Tensor, settings: list[str], settle: float,
            only: list[str] | None = None) -> dict:
    """Per setting and method: GB/s (median) and the fraction of the segment in huge pages.
    Each run visits every setting, and every method under it, in turn."""
    table = methods(n, src)
    if only:
        table = {k: v for k, v in table.items() if any(o in k for o in only)}
    times = {s: {name: [] for name in table} for s in settings}
    huge = {s: {name: [] for name in table} for s in settings}
    names = list(table)
    for run in range(runs):
        for setting in settings:
            if setting != current_setting():
                SHMEM_ENABLED.write_text(setting)
            # Note [Fresh memory for every method]
            for name in names[run % len(names):] + names[:run % len(names)]:
                fn = table[name]
                time.sleep(settle)
                before = shmem_huge_bytes()
                t = time.perf_counter()
                fds = fn()
                times[setting][name].append(time.perf_counter() - t)
                huge[setting][name].append(shmem_huge_bytes() - before)
                for fd in fds:
                    os.close(fd)
        partial = {name: [round(t, 3) for t in ts] for name, ts in times[setting].items()}
        print(f"run {run + 1} of {runs} done; last setting's seconds: {json.dumps(partial)}", file=sys.stderr,
              flush=True)
    return {s: {name: {"gb_per_s": n / statistics.median(ts) / 1e9, "seconds": [round(t, 3) for t in ts],
                       "huge_fraction": statistics.median(huge[s][name]) / n}
                for name, ts in times[s].items()} for s in settings}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=0.5)
    parser.add_argument("--methods", help="comma-separated substrings: only methods whose name contains one")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--settle", type=float, default=3.0,
                        help="seconds to wait before each method (default 3): Note [Fresh memory for every method]")
    parser.add_argument("--settings", help="comma-separated shmem_enabled values to run under (root), "
                                           "e.g. never,advise")
    args = parser.parse_args()
    n = int(args.gb * 1e9) // (2 << 20) * (2 << 20)
    src = torch.randn(n // 4).view(torch.uint8)  # touched
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))  # restore below
    original = current_setting()
    settings = list(dict.fromkeys(args.settings.split(","))) if args.settings else [original]
    out = {"bytes": n, "runs": args.runs, "original_setting": original}
    try:
        out["results"] = measure(n, args.runs, src, settings, args.settle,
                                 args.methods.split(",") if args.methods else None)
    finally:
        if current_setting() != original:
            SHMEM_ENABLED.write_text(original)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
