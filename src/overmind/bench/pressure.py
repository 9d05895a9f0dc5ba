"""The memory_pressure scenario: does the cache give way to a user's job that needs the memory?

    python -m overmind.bench.pressure --scale base         # SD1.5 sizes and the 1 B LM (5.4 GiB cached)
    python -m overmind.bench.pressure --scale small --margin 16 --json out.json   # a quick try

overmind keeps models in sealed memfd shared memory, which the kernel cannot reclaim without
swap: a job that needs that memory needs the server to let go of its cache, and to refill it
after. With overmind.bench.whole's ControlNet and LM scripts, on a private server:

- *the job beside no server*: its target is ``A0 - --margin`` GiB (default 3), ``A0`` being
  MemAvailable with no server of ours. The job (``--job``, standard library only) maps and
  touches memory in 256 MiB steps 0.1 s apart up to its target, holds it ``--hold`` s (default
  5) and prints JSON lines of its progress; it brakes only to keep the OOM killer away (Note
  [The job's brakes]);
- *the full cache*: a fresh server (``OVERMIND_SETTLE_AFTER=2``) filled by each script run twice
  patched and once with ``overmind run``, its file segments settled into sealed memory;
- *the job beside the full cache*, the same target, while MemAvailable (every 0.1 s) and the
  server's status (0.2 s) are polled: the lowest MemAvailable while the cache held anything, the
  server's pressure events and what it let go (its ``memory`` section), and whether the job and
  the server survived (and ``dmesg``'s OOM lines, where it is readable);
- *warm again*: seconds from the job's exit until the entries are back and the server's
  comeback has nothing pending; then ``overmind run`` against plain ``python`` of the
  ControlNet script in ``--pairs`` alternating pairs (default 3), and one patched run.

Targets (:data:`TARGETS`): the job got its whole target beside the cache; MemAvailable >= 0.5
GiB while the cache held anything; no OOM kill, the job exited 0, the server alive; warm again
within 60 s; ``overmind run`` <= 0.15 x plain; every run's weights' checksum equal to plain's.
Each says pass, fail, or null (not measurable here); the exit status is 0 unless the scenario
failed to run. A table on stderr, and on stdout (or in ``--json FILE``) overmind-bench's
document with the results under ``memory_pressure`` (:mod:`overmind.bench.alone`), which
``overmind-bench --report`` renders. ``overmind-bench --scenarios memory_pressure [--scale S]
[--margin G] [--hold S] [--pairs N]`` runs the same. It takes about ``A0`` of RAM for minutes:
run it when nothing else runs.
"""

from __future__ import annotations

import argparse
import json
import mmap
import operator
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

if TYPE_CHECKING:
    from overmind.bench.harness import BenchServer

__all__ = ["main", "TARGETS", "Brake", "read_meminfo", "job_summary", "check_targets"]

GiB, MiB = 1 << 30, 1 << 20
STEP, STEP_PAUSE, PAGE, CHECK_EVERY = 256 * MiB, 0.1, 4096, 32 * MiB
SCRIPT_NAMES = ("controlnet", "lm")
SETTLE_TIMEOUT, WARM_TIMEOUT = 60.0, 90.0
OOM_LINES = ("Killed process", "Out of memory")
# name -> (comparison, target, what a missing value means: None = not measurable here, False = fail)
TARGETS: dict = {"job_got_ratio": (">=", 1.0, False), "min_available_while_cache_held": (">=", GiB // 2, False),
                 "oom_kills": ("<=", 0, None), "job_exit_status": ("==", 0, False),
                 "server_alive": ("==", True, False), "warm_again_seconds": ("<=", 60.0, False),
                 "run_over_plain": ("<=", 0.15, False), "weights_equal": ("==", True, False)}
_OPS: dict[str, Callable] = {">=": operator.ge, "<=": operator.le, "==": operator.eq}


def read_meminfo(text: Optional[str] = None) -> dict[str, int]:
    """/proc/meminfo (or ``text``) as name -> bytes."""
    if text is None:
        with open("/proc/meminfo", encoding="ascii") as f:
            text = f.read()
    out = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            out[name] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return out


def mem_available() -> int:
    return read_meminfo()["MemAvailable"]


class Brake:
    """Note [The job's brakes]
    The job allocates as a real job would, never holding back for the cache: that is what the
    scenario measures. Its only brakes keep the kernel from OOM-killing anything, the server
    included: it stops growing once MemAvailable has stayed under ``low`` (1 GiB) for ``patience``
    (5 s: time enough for the cache to let go), then holds what it has; under ``floor`` (256 MiB)
    it stops at once, lets go of everything and skips its hold. The floor is checked every
    32 MiB touched, within a step too, so one step cannot overshoot it by much."""

    def __init__(self, low: int = GiB, patience: float = 5.0, floor: int = 256 * MiB) -> None:
        self.low, self.patience, self.floor = low, patience, floor
        self.low_since: Optional[float] = None

    def check(self, available: int, now: float) -> Optional[str]:
        """None to go on, else why the job stops growing (a reason starting "floor": at once)."""
        if available < self.floor:
            return f"floor: MemAvailable {available / MiB:.0f} MiB < {self.floor / MiB:.0f} MiB"
        if available >= self.low:
            self.low_since = None
            return None
        if self.low_since is None:
            self.low_since = now
        if now - self.low_since >= self.patience:
            return f"MemAvailable under {self.low / GiB:.2f} GiB for {self.patience:.0f} s"
        return None


def _emit(**fields) -> None:
    print(json.dumps(fields), flush=True)


def job(target: int, hold: float, brake: Optional[Brake] = None) -> int:
    """The user's job (``--job``): Note [The job's brakes]. Prints JSON lines, the last one ``done``."""
    brake = brake or Brake()
    start = time.monotonic()
    chunks: list[mmap.mmap] = []
    got, lowest, stopped = 0, mem_available(), None

    def look() -> Optional[str]:
        nonlocal lowest
        available = mem_available()
        lowest = min(lowest, available)
        return brake.check(available, time.monotonic())

    while got < target and stopped is None:
        size = min(STEP, target - got)
        try:
            chunk = mmap.mmap(-1, size)
        except OSError as err:  # strict overcommit (vm.overcommit_memory=2) says no here
            stopped = f"floor: mmap of {size} bytes failed: {err}"
            break
        chunks.append(chunk)
        for low in range(0, size, CHECK_EVERY):
            if (why := look()) is not None and why.startswith("floor"):
                stopped = why
                break
            high = min(size, low + CHECK_EVERY)
            chunk[low:high:PAGE] = b"\1" * len(range(low, high, PAGE))  # one byte a page: resident
            got += high - low
        _emit(got=got, available=mem_available(), t=time.monotonic() - start)
        if stopped is None and got < target:
            time.sleep(STEP_PAUSE)
            stopped = look()
    grown = time.monotonic() - start
    if stopped is None or not stopped.startswith("floor"):
        _emit(holding=got, seconds=hold)
        until = time.monotonic() + hold
        while time.monotonic() < until:
            time.sleep(0.1)
            if (why := look()) is not None and why.startswith("floor"):
                stopped = why
                break
    for chunk in chunks:
        chunk.close()
    _emit(done=True, target=target, got=got, min_available=lowest, stopped_early=stopped, grow_seconds=grown,
          seconds=time.monotonic() - start)
    return 0


def job_summary(lines: list[str], returncode: Optional[int], wall: float) -> dict:
    """What the parent keeps of a job's output: its ``done`` line (or a failure), status, wall time."""
    done: dict = {}
    got = 0  # the last progress line's, if the job was killed before its done line
    for line in lines:
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if isinstance(doc, dict):
            got = doc.get("got", got)
            done = doc if doc.get("done") else done
    return {"got": got, "target": done.get("target"), "min_available": done.get("min_available"),
            "stopped_early": done.get("stopped_early") if done else "no done line: the job did not finish",
            "grow_seconds": done.get("grow_seconds"), "seconds": done.get("seconds"), "wall_seconds": wall,
            "returncode": returncode, "killed_by_signal": -returncode if returncode and returncode < 0 else None}


def run_job(target: int, hold: float, poll: Optional[Callable[[], None]] = None) -> dict:
    """The job as a child process; ``poll`` is called every 0.1 s (in this thread) while it runs."""
    argv = [sys.executable, "-m", "overmind.bench.pressure", "--job", str(target), "--hold", str(hold)]
    start = time.monotonic()
    child = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    lines: list[str] = []
    stdout = child.stdout
    assert stdout is not None  # stdout=PIPE
    reader = threading.Thread(target=lambda: lines.extend(stdout), daemon=True)
    reader.start()
    try:
        while child.poll() is None:
            if poll is not None:
                poll()
            time.sleep(0.1)
    finally:
        if child.poll() is None:  # an error or Ctrl-C here: the job must not outlive us
            child.kill()
        child.wait()
        reader.join(timeout=10)
    return job_summary(lines, child.returncode, time.monotonic() - start)


class Watch:
    """What the parent sees while the job runs beside the cache (polled from one thread: the
    server's status goes through ``overmind status`` in this process, which redirects stdout)."""

    def __init__(self, server: "BenchServer") -> None:
        self.server, self.start, self.unix_start = server, time.monotonic(), time.time()
        self.held = True  # the cache was full when the job started
        self.min_held: Optional[int] = None  # MemAvailable, while the cache held anything
        self.used_before: Optional[int] = None  # the cache's bytes (status "used"), then its least
        self.used_min: Optional[int] = None
        self.used_first_drop: Optional[float] = None  # seconds since the job started
        self.used_empty: Optional[float] = None
        self.events: dict = {}  # the server's last_event, by its start: the latest version of each
        self.timeline: list = []  # [seconds, MemAvailable, used, pressed]
        self.status_errors, self._next_status = 0, 0.0
        self.memory_before: Optional[dict] = None

    def __call__(self) -> None:
        now = time.monotonic() - self.start
        available = mem_available()
        if self.held:
            self.min_held = available if self.min_held is None else min(self.min_held, available)
        if now >= self._next_status:
            self._next_status = now + 0.2
            self.status(now, available)

    def status(self, now: float, available: int) -> None:
        try:
            status = self.server.status()
        except Exception:  # noqa: BLE001 -- a server gone under pressure: the alive check says so
            self.status_errors += 1
            return
        used = status.get("used", 0)
        memory = self.events_of(status)
        self.memory_before = self.memory_before or memory
        self.held = used > 0
        self.used_before = used if self.used_before is None else self.used_before
        self.used_min = used if self.used_min is None else min(self.used_min, used)
        if self.used_first_drop is None and used < self.used_before:
            self.used_first_drop = now
        if self.used_empty is None and used == 0:
            self.used_empty = now
        self.timeline.append([round(now, 2), available, used, memory.get("pressed")])

    def events_of(self, status: dict) -> dict:
        """Keeps the latest version of the server's last pressure event; its ``memory`` section."""
        memory = status.get("memory") or {}
        event = memory.get("last_event")
        if isinstance(event, dict) and event.get("started") is not None:
            self.events[event["started"]] = event
        return memory

    def report(self) -> dict:
        events = [self.events[k] for k in sorted(self.events) if k >= self.unix_start - 1]
        first = events[0] if events else None
        return {"min_available_while_cache_held": self.min_held, "used_before": self.used_before,
                "used_min": self.used_min, "used_first_drop_seconds": self.used_first_drop,
                "used_empty_seconds": self.used_empty, "status_errors": self.status_errors,
                "memory_before": self.memory_before or None, "events_seen": events,
                "first_event_after_job_start": first["started"] - self.unix_start if first else None,
                "let_go_seconds": first.get("seconds") if first else None, "timeline": self.timeline}


def oom_lines() -> Optional[int]:
    """dmesg's lines of OOM kills so far, or None when dmesg cannot be read here."""
    try:
        proc = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return sum(any(m in line for m in OOM_LINES) for line in proc.stdout.splitlines()) if proc.returncode == 0 else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _until(predicate: Callable[[dict], bool], server: "BenchServer", timeout: float) -> tuple[Optional[float], dict]:
    """Seconds until ``predicate(status)`` (None: not within ``timeout``), and the last status."""
    start = time.monotonic()
    while True:
        status = server.status()
        if predicate(status):
            return time.monotonic() - start, status
        if time.monotonic() - start > timeout:
            return None, status
        time.sleep(0.2)


def _plain(server: "BenchServer", folder: Path, n: int) -> list:
    """Plain ``python`` of the ControlNet script ``n`` times before the job: the reference the next
    run after it is held to (the job leaves the page cache cold for plain as well)."""
    from overmind.bench.whole import time_script

    runs = []
    for _ in range(n):
        server.wait_idle()
        runs.append(time_script([sys.executable, "controlnet.py"], server.client_env(), str(folder)))
    return runs


def _runs(server: "BenchServer", folder: Path, pairs: int, plain_before: list) -> dict:
    """``overmind run`` and plain ``python`` of the ControlNet script in pairs, then one patched run.
    The target is the first run's (the next after the job) over plain's median before the job."""
    from overmind.bench.whole import front_end, time_script

    python, patched_env = [sys.executable], server.client_env({"OVERMIND": "1"})
    timed: dict = {"run": [], "plain": []}
    for _ in range(pairs):
        for mode, argv, env in (("run", front_end(), patched_env), ("plain", python, server.client_env())):
            server.wait_idle()
            timed[mode].append(time_script(argv + ["controlnet.py"], env, str(folder)))
    server.wait_idle()
    patched = time_script(python + ["controlnet.py"], patched_env, str(folder))
    medians = {mode: statistics.median(t["exit"] for t in runs) for mode, runs in timed.items()}
    weights = timed["plain"][0]["weights"]
    before = statistics.median(t["exit"] for t in plain_before)
    return {"controlnet": timed, "median_exit": medians, "patched": patched, "next_run_exit": timed["run"][0]["exit"],
            "plain_before": plain_before, "plain_before_median": before,
            "run_over_plain": timed["run"][0]["exit"] / before,
            "median_run_over_plain_after": medians["run"] / medians["plain"],
            "weights_equal": all(t["weights"] == weights for t in [*timed["run"], *timed["plain"], *plain_before,
                                                                  patched])}


def _beside_cache(server: "BenchServer", folder: Path, target: int, hold: float, pairs: int, results: dict,
                  say: Callable[[str], None]) -> None:
    from overmind.bench.whole import front_end, time_script

    patched_env = server.client_env({"OVERMIND": "1"})
    for name in SCRIPT_NAMES:  # the cache fills, and the interpreter learns
        for argv in ([sys.executable], [sys.executable], front_end()):
            time_script(argv + [f"{name}.py"], patched_env, str(folder))
            server.wait_idle()
    settled, status = _until(lambda s: (s.get("file_segments") or {}).get("bytes", 0) == 0, server, SETTLE_TIMEOUT)
    interpreters = status.get("interpreters") or []
    results["cache"] = cache = {
        "entries": status.get("entries"), "used": status.get("used"), "interpreters": len(interpreters),
        "interpreters_pss": sum(i.get("pss") or 0 for i in interpreters), "available": mem_available(),
        "file_segments_bytes": (status.get("file_segments") or {}).get("bytes"), "memory": status.get("memory"),
        "settled_seconds": settled}
    say(f"the full cache: {cache['entries']} entries, {_gib(cache['used'])}, {cache['interpreters']} interpreters, "
        f"MemAvailable {_gib(cache['available'])}{'' if settled is not None else ' (not settled after 60 s)'}")
    plain_before = _plain(server, folder, pairs)
    say(f"plain python of the ControlNet script before the job: "
        f"{statistics.median(t['exit'] for t in plain_before):.2f} s (median of {pairs})")
    oom_before = oom_lines()
    watch = Watch(server)
    beside = run_job(target, hold, poll=watch)
    alive = _alive(server.pid)
    oom = None if oom_before is None or (oom_after := oom_lines()) is None else oom_after - oom_before
    results["job_beside_cache"] = {**beside, "server_alive": alive, "oom_kills": oom}
    say(f"job beside the full cache: got {_gib(beside['got'])} in {beside['grow_seconds'] or 0:.1f} s, "
        f"stopped early: {beside['stopped_early']}, exit {beside['returncode']}, server alive: {alive}")
    if not alive:
        results["job_beside_cache"].update(watch.report())
        say(f"the server (pid {server.pid}) died beside the job; the end of its log:\n{server.log()[-3000:]}")
        return

    def back(status: dict) -> bool:  # warm again; the pressure event may end after the job
        comeback = watch.events_of(status).get("comeback") or {}
        return (status.get("entries") or 0) >= (cache["entries"] or 0) and not comeback.get("pending")

    seconds, status = _until(back, server, WARM_TIMEOUT)
    results["job_beside_cache"].update(watch.report(), memory_after=status.get("memory"))
    results["warm_again"] = {"seconds": seconds, "entries": status.get("entries"), "used": status.get("used"),
                             "interpreters": len(status.get("interpreters") or []),
                             "comeback": (status.get("memory") or {}).get("comeback")}
    say(f"warm again: {'not within 90' if seconds is None else f'{seconds:.1f}'} s after the job exited "
        f"({status.get('entries')} entries, {_gib(status.get('used'))})")
    results["runs"] = _runs(server, folder, pairs, plain_before)


def run(scale: str, margin: float, hold: float, pairs: int, say: Callable[[str], None],
        results: Optional[dict] = None) -> dict:
    """The scenario; its results, filled into ``results`` as it goes (overmind.bench.alone)."""
    from overmind.bench.harness import BenchServer
    from overmind.bench.models import default_cache_dir, generate_in_child
    from overmind.bench.whole import SCRIPTS, script_source

    results = {} if results is None else results
    results.update(scenario="memory_pressure", scale=scale, margin_bytes=int(margin * GiB), hold=hold, pairs=pairs)
    paths = generate_in_child(default_cache_dir(), scale, sorted({m for n in SCRIPT_NAMES for m in SCRIPTS[n].models}))
    meminfo = read_meminfo()
    a0 = meminfo["MemAvailable"]
    target = max(0, a0 - int(margin * GiB)) // PAGE * PAGE
    results.update(ram=meminfo.get("MemTotal"), swap=meminfo.get("SwapTotal"), available_before=a0,
                   target_bytes=target)
    say(f"MemAvailable {_gib(a0)} with no server of ours: the job's target is {_gib(target)}")
    if target <= 0:
        raise RuntimeError(f"--margin {margin} GiB leaves the job nothing: MemAvailable is {_gib(a0)}")
    results["job_alone"] = alone = run_job(target, hold)
    say(f"job beside no server: got {_gib(alone['got'])} in {alone['grow_seconds'] or 0:.1f} s, "
        f"min MemAvailable {_gib(alone['min_available'])}, stopped early: {alone['stopped_early']}")
    folder = Path(tempfile.mkdtemp(prefix="om-bench-pressure-"))
    server = None
    try:
        for name in SCRIPT_NAMES:
            (folder / f"{name}.py").write_text(script_source(name, paths))
        server = BenchServer.start(extra_env={"OVERMIND_SETTLE_AFTER": "2"})
        _beside_cache(server, folder, target, hold, pairs, results, say)
    finally:
        if server is not None:
            log = Path(tempfile.gettempdir()) / f"om-bench-pressure-{os.getpid()}.log"
            log.write_text(server.log())
            results["server_log"] = str(log)
            server.stop()
        shutil.rmtree(folder, ignore_errors=True)
    results["targets"] = check_targets(results)
    return results


def check_targets(results: dict) -> dict:
    """:data:`TARGETS` against ``results``: name -> value, comparison, target, pass (True, False, None)."""
    beside, runs = results.get("job_beside_cache") or {}, results.get("runs") or {}
    target = results.get("target_bytes") or 0
    values = {"job_got_ratio": beside["got"] / target if target and "got" in beside else None,
              "min_available_while_cache_held": beside.get("min_available_while_cache_held"),
              "oom_kills": beside.get("oom_kills"), "job_exit_status": beside.get("returncode"),
              "server_alive": beside.get("server_alive"),
              "warm_again_seconds": (results.get("warm_again") or {}).get("seconds"),
              "run_over_plain": runs.get("run_over_plain"), "weights_equal": runs.get("weights_equal")}
    out = {}
    for name, (op, goal, missing) in TARGETS.items():
        value = values[name]
        out[name] = {"value": value, "op": op, "target": goal,
                     "pass": missing if value is None else bool(_OPS[op](value, goal))}
    return out


def _gib(value) -> str:
    return "null" if value is None else f"{value / GiB:.2f} GiB"


def _num(value, unit: str = "") -> str:
    return "null" if value is None else f"{value:.3g}{unit}" if isinstance(value, float) else f"{value}{unit}"


def table(results: dict) -> str:
    """The human summary (stderr)."""
    alone, beside = results.get("job_alone") or {}, results.get("job_beside_cache") or {}
    warm, runs = results.get("warm_again") or {}, results.get("runs") or {}
    lines = [f"memory_pressure (scale {results['scale']}): the job's target {_gib(results['target_bytes'])} "
             f"= MemAvailable {_gib(results['available_before'])} - {_gib(results['margin_bytes'])}",
             f"  job beside no server:      got {_gib(alone.get('got'))} in {_num(alone.get('grow_seconds'), ' s')}, "
             f"min MemAvailable {_gib(alone.get('min_available'))}, stopped early: {alone.get('stopped_early')}",
             f"  job beside the full cache: got {_gib(beside.get('got'))} in {_num(beside.get('grow_seconds'), ' s')}, "
             f"min MemAvailable while the cache held {_gib(beside.get('min_available_while_cache_held'))}, "
             f"stopped early: {beside.get('stopped_early')}",
             f"  the cache let go: first pressure event {_num(beside.get('first_event_after_job_start'), ' s')} after "
             f"the job started, let go in {_num(beside.get('let_go_seconds'), ' s')}; its bytes were 0 after "
             f"{_num(beside.get('used_empty_seconds'), ' s')}",
             f"  warm again {_num(warm.get('seconds'), ' s')} after the job exited; the next overmind run "
             f"{_num(runs.get('next_run_exit'), ' s')}, over plain before the job "
             f"({_num(runs.get('plain_before_median'), ' s')}) {_num(runs.get('run_over_plain'))}"]
    for name, row in (results.get("targets") or {}).items():
        verdict = {True: "pass", False: "FAIL", None: "n/a"}[row["pass"]]
        show = _gib if "available" in name else _num
        lines.append(f"  {verdict:4} {name} = {show(row['value'])} (target {row['op']} {show(row['target'])})")
    return "\n".join(lines)


def main(argv: Optional[list] = None, command: Optional[list] = None) -> int:
    """``command``: the command as the document gives it (overmind-bench's, when it runs this)."""
    from overmind.bench import alone
    from overmind.bench.models import SCALES

    parser = argparse.ArgumentParser(prog="python -m overmind.bench.pressure", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenarios", default="memory_pressure", help=argparse.SUPPRESS)  # overmind-bench's
    parser.add_argument("--scale", choices=sorted(SCALES), default="base", help="model sizes (default base: SD1.5)")
    parser.add_argument("--margin", type=float, default=3.0, metavar="GIB",
                        help="the job's target is MemAvailable with no server less this (default 3 GiB)")
    parser.add_argument("--hold", type=float, default=5.0, metavar="S", help="seconds the job holds (default 5)")
    parser.add_argument("--pairs", type=int, default=3, metavar="N",
                        help="pairs of overmind run and plain python after the job (default 3)")
    parser.add_argument("--json", metavar="FILE", help="write the results here (default: stdout)")
    parser.add_argument("--about", metavar="TEXT", help="what the run is, said in its document")
    parser.add_argument("--job", type=int, metavar="BYTES", help=argparse.SUPPRESS)  # the child: job()
    args, _ = parser.parse_known_args(argv)
    if args.job is not None:
        return job(args.job, args.hold)
    if args.pairs < 1 or args.hold < 0 or args.margin < 0:
        parser.error("--pairs must be at least 1; --hold and --margin must not be negative")
    say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    try:
        doc = alone.measure("memory_pressure", lambda results: run(args.scale, args.margin, args.hold, args.pairs,
                                                                   say, results),
                            argv=command or alone.command("overmind.bench.pressure", argv), scale=args.scale,
                            about=args.about)
    except KeyboardInterrupt:
        say("interrupted")
        return 130
    results = doc["memory_pressure"]
    say(table(results) if results["status"] == "ok" else f"memory_pressure failed: {results['reason']}")
    alone.write(doc, args.json)
    return 0 if results["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
