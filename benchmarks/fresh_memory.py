"""How fast fresh memory fills, 512 MiB at a time: what a cache fill pays for every new byte.

    python benchmarks/fresh_memory.py [--gb 4] [--pause 8] [--rounds 2]

Each round waits ``--pause`` seconds (time for a VM guest's free page reporting to hand freed
memory back to its host), then fills one new memfd with ``pwrite`` from a 64 MiB buffer that is
already touched, and prints the rate of each 512 MiB; then frees it and at once fills another
(memory just freed, not yet reported). On bare metal the rates are flat. On a guest that
reports free pages (``/sys/module/page_reporting``, virtio-balloon), the first GBs, which reuse
memory freed moments before, fill several times faster than the rest, which the host must
fault in again: this is why a fill of the ControlNet workload's pipeline takes seconds here (Note
[Joining a fill] in ``overmind.server.fills``). Reads only; changes no setting.

``--beside CMD`` measures what such a fill costs a process running beside it (what a user's next
run meets while the cache fills behind the last): CMD (a shell command, e.g. ``python
controlnet.py``) timed alone, beside a fill of ``--gb`` fresh memory at idle CPU priority in a
session of its own (as a cache fill runs), and beside a CPU spinner at the same priority, in
alternating rounds; the medians. Fill and spinner start with CMD and are stopped when it ends.
"""

from __future__ import annotations

import argparse
import os
import time

CHUNK = 512 << 20


def fill(nbytes: int, source: bytes) -> list[float]:
    """GB/s of each CHUNK of one new memfd of ``nbytes``."""
    fd = os.memfd_create("overmind-fresh-memory")
    rates = []
    try:
        for start in range(0, nbytes, CHUNK):
            began = time.monotonic()
            for offset in range(start, start + CHUNK, len(source)):
                os.pwrite(fd, source, offset)
            rates.append(CHUNK / (time.monotonic() - began) / 1e9)
    finally:
        os.close(fd)
    return rates


def reporting() -> str:
    root = "/sys/module/page_reporting/parameters"
    try:
        values = {name: open(os.path.join(root, name)).read().strip() for name in sorted(os.listdir(root))}
    except OSError:
        return "no free page reporting here"
    return "free page reporting: " + ", ".join(f"{k}={v}" for k, v in values.items())


_HELPER = {
    "fill": "import os\nos.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))\nfd = os.memfd_create('fill')\n"
            "source = b'\\1' * (64 << 20)\nfor offset in range(0, {nbytes}, len(source)):\n"
            "    os.pwrite(fd, source, offset)\n",
    "spin": "import os, time\nos.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))\nend = time.monotonic() + 600\n"
            "while time.monotonic() < end:\n    pass\n",
}


def beside(command: str, nbytes: int, rounds: int, pause: float) -> dict:
    """Seconds of ``command`` alone, beside a fresh-memory fill and beside a spinner, per round."""
    import statistics
    import subprocess
    import sys

    times: dict = {"alone": [], "fill": [], "spin": []}
    for _ in range(rounds):
        for case in times:
            time.sleep(pause)
            helper = None
            if case != "alone":
                helper = subprocess.Popen([sys.executable, "-c", _HELPER[case].format(nbytes=nbytes)],
                                          start_new_session=True)
            started = time.monotonic()
            subprocess.run(command, shell=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
            times[case].append(time.monotonic() - started)
            if helper is not None:
                helper.kill()
                helper.wait()
            print(f"{case}: {times[case][-1]:.2f} s", flush=True)
    return {case: statistics.median(values) for case, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=4.0, help="size of each fill (default 4)")
    parser.add_argument("--pause", type=float, default=8.0, help="seconds before each round (default 8)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--beside", metavar="CMD", help="time CMD alone, beside a fill and beside a spinner")
    args = parser.parse_args()
    nbytes = max(CHUNK, int(args.gb * (1 << 30)) // CHUNK * CHUNK)
    if args.beside:
        medians = beside(args.beside, nbytes, args.rounds, args.pause)
        print("medians: " + ", ".join(f"{case} {value:.2f} s ({value / medians['alone']:.2f} x)"
                                      for case, value in medians.items()))
        return
    source = os.urandom(1 << 20) * 64
    print(reporting())
    for number in range(1, args.rounds + 1):
        time.sleep(args.pause)
        after_pause = fill(nbytes, source)
        right_after = fill(nbytes, source)
        print(f"round {number}: GB/s per 512 MiB after a {args.pause:g} s pause: "
              + " ".join(f"{r:.1f}" for r in after_pause))
        print(f"round {number}: GB/s per 512 MiB right after freeing the same: "
              + " ".join(f"{r:.1f}" for r in right_after))


if __name__ == "__main__":
    main()
