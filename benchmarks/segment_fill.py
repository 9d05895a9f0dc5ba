"""How to fill a memfd segment fastest (issue 2): the methods overmind.memfd chose between.

    python benchmarks/segment_fill.py [--gb 1.7] [--runs 3]

Copies the same already-touched source into a new memfd by: ftruncate + mmap + copy,
fallocate + mmap + copy, mmap + MADV_POPULATE_WRITE + copy, pwrite, and pwrite from two
threads into two memfds; plus torch.empty + copy_ into fresh memory as the reference.
Medians in GB/s.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import threading
import time

import torch

from overmind.memfd import buffer_at

MADV_POPULATE_WRITE = 23


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=1.7)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    n = int(args.gb * 1e9) // 4 * 4
    src = torch.randn(n // 4).view(torch.uint8)  # touched
    view = buffer_at(src.data_ptr(), n)

    def memfd() -> int:
        return os.memfd_create("fill", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)

    def mmap_copy(prepare) -> None:
        fd = memfd()
        prepare(fd)
        m = mmap.mmap(fd, n, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        if prepare is populate:
            m.madvise(MADV_POPULATE_WRITE)
        m[:] = view
        m.close()
        os.close(fd)

    def populate(fd: int) -> None:
        os.ftruncate(fd, n)

    def pwrite_range(fd: int, lo: int, hi: int, base: int = 0) -> None:
        while lo < hi:
            lo += os.pwrite(fd, view[lo:min(hi, lo + (1 << 30))], lo - base)

    def pwrite_one() -> None:
        fd = memfd()
        pwrite_range(fd, 0, n)
        os.close(fd)

    def pwrite_two() -> None:
        fds, half = [memfd(), memfd()], n // 2
        threads = [threading.Thread(target=pwrite_range, args=(fds[0], 0, half)),
                   threading.Thread(target=pwrite_range, args=(fds[1], half, n, half))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for fd in fds:
            os.close(fd)

    def empty_copy() -> None:
        torch.empty(n, dtype=torch.uint8).copy_(src)

    methods = {
        "torch.empty + copy_": empty_copy,
        "ftruncate + mmap + copy": lambda: mmap_copy(lambda fd: os.ftruncate(fd, n)),
        "fallocate + mmap + copy": lambda: mmap_copy(lambda fd: os.posix_fallocate(fd, 0, n)),
        "mmap + MADV_POPULATE_WRITE + copy": lambda: mmap_copy(populate),
        "pwrite": pwrite_one,
        "pwrite, 2 threads, 2 memfds": pwrite_two,
    }
    times: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(args.runs):
        for name, fn in methods.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    result = {name: n / statistics.median(ts) / 1e9 for name, ts in times.items()}
    print(json.dumps({"bytes": n, "gb_per_s": result}, indent=2))


if __name__ == "__main__":
    main()
