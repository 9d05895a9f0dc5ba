"""CPU priority of cache fills: a fill nobody waits for keeps out of its caller's way. Stdlib only.

    fills = FillPriorities(config)             # one per server (owned by overmind.server.pool.WarmPool)
    fill = fills.begin(key, background=True, caller=pid)
    fills.after_caller(fill)                   # waits while the caller's own load runs
    fills.forked(fill, loader_pid)             # SCHED_IDLE for every thread of the loader
    with fills.waiting(key, waiter_pid): ...   # a waiter lends it normal priority
    fills.end(fill)

Note [Cold fills wait for their caller]
On a miss nobody waits for (Note [Cold loads run behind the caller] in overmind.server.cold_loads)
the caller loads plainly while a loader would fill the cache with the same work. Run at
once, the fill shares the cores, the memory bandwidth and the page allocator with the
caller: a cast to fp16 made the caller's load 2-3.5 x plain on 2 cores, and still 2 x with
the fill at idle priority; started after the caller's load, 0.9 x. So a fill first waits
(holding no load slot) until its caller says its own load of the key returned
(``PlainLoaded``, ``Fill.caller_done``), or runs or waits for a CPU less than half the time
for ``CALLER_QUIET`` polls (its load is over; a client that says nothing), or exits, or
someone waits for the fill (``Fill.wanted``), or ``OVERMIND_FILL_YIELD`` seconds passed.
Waiting for the caller's word rather than its quiet matters for the next run: a script that
goes on computing, or only exits (1-2 s for a process holding torch), after its last load
would otherwise hold its fills back until then, and its next run, started at once, would
find them still running.

Note [Cold fills yield to their caller]
Once started, such a fill's loader runs under SCHED_IDLE, every thread of it (a ``Fill``):
it gets only the CPU time nobody else wants, and the caller's load runs as without
overmind. That priority is lent back (SCHED_OTHER) as soon as someone waits for the
fill: a load that waits (``OVERMIND_COLD=wait``, strict mode) starts at normal priority,
one that joins later lifts it, a fill that has not started yet (queued behind
``OVERMIND_WORKERS`` yielding fills) lifts those that hold the slots, and a fill that waits
for the fill of an entry its call refers to (a ``vae=vae`` argument) passes the lift on to
it. A yielding fill that waits on another yielding fill lends nothing: neither is wanted
yet. And after
``OVERMIND_FILL_YIELD`` seconds a fill competes normally, so a machine that stays busy
delays the cache but never starves it into the loader timeout. Only the loader child
yields: the server, warm interpreters and runs keep their priority. Lifting SCHED_IDLE
takes root, CAP_SYS_NICE or an RLIMIT_NICE of 20 (``LimitNICE=20`` in a systemd unit);
without them the kernel would keep a fill idle for good, so it takes nice 10 instead,
which it keeps: about a tenth of a contended core, never starved.

Note [Idle only inside the interpreter's autogroup]
Where the kernel groups processes by session (``CONFIG_SCHED_AUTOGROUP``,
``/proc/sys/kernel/sched_autogroup_enabled`` 1, the default of most distributions), it first
shares the CPU between the sessions' groups and only then between the threads of a group by
their policy. A loader is in its warm interpreter's session (with that interpreter's learning
and the runs it forks), so SCHED_IDLE makes a fill yield to those, but against a user's shell
session the group competes as any other: beside two spinners pinned to the two CPUs, a
SCHED_IDLE process of another session got 1.37 CPU-seconds in 2 s, one of the spinners' own
session 0.05. Tried: each loader a session of its own whose autogroup is at nice 19 while it
yields (0.12 CPU-seconds in 2 s). The fills then starved behind the interpreter's learning,
and runs 2 to 5 of ``overmind run`` of the ControlNet script found the pipeline still filling
and were slower for it, so that was taken back; OVERMIND_FILL_YIELD is the bound either way
(tests/integration/test_cold_priority.py keeps every CPU busy).
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
import threading
import time

from overmind.shared.config import Config
from overmind.shared.priority import can_lift_idle, every_thread, to_idle, to_normal

logger = logging.getLogger("overmind.server.loaders")

__all__ = ["Fill", "FillPriorities"]


class Fill:
    """One cache fill's loader and its CPU priority: Note [Cold fills yield to their caller]."""

    def __init__(self, key: str, background: bool, caller: int = 0) -> None:
        self.key = key
        self.background = background  # nobody waits for it (yet): it may yield
        self.caller = caller  # pid of the process whose miss started it (0: unknown)
        self.wanted = threading.Event()  # someone waits for it: no more waiting for the caller
        self.caller_done = threading.Event()  # the caller said its own load of the key returned
        self.pid = 0  # its loader, once forked
        self.forked_at = 0.0
        self.idle = False  # under SCHED_IDLE now: a waiter lifts it
        self.yielded_at = 0.0
        # Its loader's progress reports (Note [Joining a fill] in overmind.server.cold_loads).
        self.packing_since = 0.0  # when the pack began (its first report); 0: not yet
        self.written = 0
        self.expected = 0
        self.original_seconds = 0.0  # what the loader's call of the original took


FILL_NICE = 10  # Note [Cold fills yield to their caller]: where SCHED_IDLE could not be lifted
CALLER_POLL = 0.1  # seconds between two looks at the caller's CPU time
CALLER_QUIET = 2  # polls in a row under half a core: its load is over


def _busy_seconds(pid: int) -> float | None:
    """Seconds the threads of process ``pid`` have run or waited for a CPU (schedstat): a
    caller starved by a busy machine still counts as busy. None once it is gone."""
    total, found = 0, False
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as f:
                running, waiting = f.read().split()[:2]
            total += int(running) + int(waiting)
            found = True
        except (OSError, ValueError):
            continue  # that thread ended
    return total / 1e9 if found else None


def to_nice(tid: int) -> None:
    os.setpriority(os.PRIO_PROCESS, tid, FILL_NICE)


class FillPriorities:
    """The fills in flight and who waits for them: Note [Cold fills yield to their caller]."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.fill_lock = threading.Lock()
        self.fills: dict[str, Fill] = {}  # key -> the fill in flight for it
        self.waits: dict[str, str] = {}  # key of a fill waiting for another key's fill (a reference) -> that key
        self.lenders: dict[str, int] = {}  # key -> processes waiting for it that lend it their priority
        self.can_lift_idle = can_lift_idle()

    def begin(self, key: str, background: bool, caller: int = 0) -> Fill:
        """A load of ``key`` for process ``caller`` starts; ``background``: nobody waits for it.
        End it with ``end``."""
        fill = Fill(key, background, caller)
        with self.fill_lock:
            fill.background = background and not self.lenders.get(key)  # a waiter came first
            if not fill.background:
                fill.wanted.set()
            self.fills[key] = fill
        return fill

    def after_caller(self, fill: Fill) -> None:
        """Note [Cold fills wait for their caller]: return once the caller's own load looks
        over (it ran or waited for a CPU less than half the time), it exited, someone waits
        for the fill, or OVERMIND_FILL_YIELD seconds passed."""
        if not fill.background or fill.caller <= 0 or self.config.fill_yield <= 0:
            return
        started = time.monotonic()
        last, quiet = _busy_seconds(fill.caller), 0
        while last is not None and quiet < CALLER_QUIET and time.monotonic() - started < self.config.fill_yield:
            if fill.wanted.wait(CALLER_POLL) or fill.caller_done.is_set():
                break
            now = _busy_seconds(fill.caller)
            if now is None:
                break
            quiet = quiet + 1 if 0 <= now - last < CALLER_POLL / 2 else 0  # less: a busy thread ended
            last = now
        logger.info("fill of %s starts %.1fs after its miss (caller pid %d)", fill.key[:16],
                    time.monotonic() - started, fill.caller)

    def in_flight_besides(self, key: str) -> bool:
        with self.fill_lock:
            return any(k != key for k in self.fills)

    def end(self, fill: Fill) -> None:
        with self.fill_lock:
            if self.fills.get(fill.key) is fill:
                del self.fills[fill.key]

    def forked(self, fill: Fill, pid: int) -> None:
        with self.fill_lock:
            fill.pid, fill.forked_at = pid, time.monotonic()
            if not fill.background or self.config.fill_yield <= 0:
                how = "normal priority" + (" (a caller waits for it)" if not fill.background else "")
            elif self.can_lift_idle and every_thread(pid, to_idle):
                fill.idle, fill.yielded_at = True, time.monotonic()
                how = "idle priority (SCHED_IDLE)"
            elif every_thread(pid, to_nice):
                how = f"nice {FILL_NICE}"
            else:
                how = "normal priority (could not lower it)"
        logger.info("loader pid %d fills %s at %s", pid, fill.key[:16], how)

    def caller_loaded(self, key: str) -> None:
        """The caller whose miss started the fill of ``key`` finished its own plain load of it."""
        with self.fill_lock:
            fill = self.fills.get(key)
        if fill is not None:
            fill.caller_done.set()

    def progress(self, fill: Fill, written: int, expected: int, original_seconds: float) -> None:
        """Its loader's report (``FillProgress``): ``written`` of ``expected`` bytes in place."""
        with self.fill_lock:
            if not fill.packing_since:
                fill.packing_since = time.monotonic()
            fill.written, fill.expected, fill.original_seconds = written, expected, original_seconds

    def remaining(self, key: str) -> tuple[float, Fill] | None:
        """(seconds the fill of ``key`` should still take at its pace so far, the fill); None
        while that cannot be told: no fill, or its loader still runs the original, or it
        reported nothing to go by."""
        with self.fill_lock:
            fill = self.fills.get(key)
            if fill is None or not fill.packing_since or not fill.written:
                return None
            if fill.written >= fill.expected:  # all in place: the answer is on its way
                return 0.0, fill
            rate = fill.written / max(time.monotonic() - fill.packing_since, 1e-3)
            return (fill.expected - fill.written) / rate, fill

    def _lift(self, fill: Fill, why: str) -> None:
        """Back to SCHED_OTHER; with fill_lock held."""
        if not fill.idle:
            return
        fill.idle = False
        if every_thread(fill.pid, to_normal):
            logger.info("loader pid %d fills %s at normal priority now: %s", fill.pid, fill.key[:16], why)
        else:
            logger.warning("loader pid %d filling %s stays at idle priority (%s): the kernel refused", fill.pid,
                           fill.key[:16], why)

    def wait_answer(self, job: socket.socket, fill: Fill, deadline: float) -> None:
        """Until the loader's answer starts arriving; lifts a fill that yielded for
        OVERMIND_FILL_YIELD seconds. socket.timeout past ``deadline``."""
        while True:
            now = time.monotonic()
            wait = deadline - now
            if fill.idle:
                wait = min(wait, fill.yielded_at + self.config.fill_yield - now)
            if select.select([job], [], [], max(wait, 0.0))[0]:
                return
            if time.monotonic() >= deadline:
                raise socket.timeout("loader timeout")
            with self.fill_lock:
                if fill.idle and time.monotonic() >= fill.yielded_at + self.config.fill_yield:
                    self._lift(fill, f"it yielded for OVERMIND_FILL_YIELD={self.config.fill_yield:g}s")

    @contextlib.contextmanager
    def waiting(self, key: str, waiter: int):
        """Process ``waiter`` waits for the fill of ``key`` in this block: lend it normal priority."""
        with self.fill_lock:
            self._lend(key, f"pid {waiter} waits for it")
        try:
            yield
        finally:
            with self.fill_lock:
                self._unlend(key)

    @contextlib.contextmanager
    def depends(self, fill: Fill, key: str):
        """``fill`` waits in this block, before its loader starts, for the fill of ``key`` (an
        entry its call refers to: Note [The loader is handed its references] in
        overmind.server.cold_loads). It lends that fill its priority only if someone waits for it in turn;
        otherwise a later lift passes on (``_hurry``)."""
        with self.fill_lock:
            self.waits[fill.key] = key
            lends = not fill.background
            if lends:
                self._lend(key, f"{fill.key[:16]} refers to it and is waited for")
        try:
            yield
        finally:
            with self.fill_lock:
                if self.waits.get(fill.key) == key:
                    del self.waits[fill.key]
                if lends:
                    self._unlend(key)

    def _lend(self, key: str, why: str) -> None:
        self.lenders[key] = self.lenders.get(key, 0) + 1
        self._hurry(key, set(), why)

    def _unlend(self, key: str) -> None:
        self.lenders[key] -= 1
        if not self.lenders[key]:
            del self.lenders[key]

    def _hurry(self, key: str, seen: set, why: str) -> None:
        fill = self.fills.get(key)
        if fill is None or key in seen:
            return
        seen.add(key)
        fill.background = False
        fill.wanted.set()
        if key in self.waits:  # it waits for the fill of an entry it refers to, before its loader starts
            self._hurry(self.waits[key], seen, f"{why}, through {key[:16]}")
            return
        if fill.pid:
            self._lift(fill, why)
            return
        # Not forked yet: queued behind the fills that hold the load slots.
        for other in list(self.fills.values()):
            if other.idle:
                self._lift(other, f"{key[:16]} waits for a load slot ({why})")
