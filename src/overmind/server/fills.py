"""Cache fills in flight: a miss's load, from the request that starts it to the entry it files.
Server side, stdlib only.

    fills = Fills(config, registry)            # one per server (owned by overmind.server.loads.Loads)
    admission = fills.admit(key, background=True, caller=pid)   # a hit, a fill, a failure, or busy
    fill = admission.fill                      # admission.started: this request runs it
    fills.after_caller(fill)                   # waits while the caller's own load runs
    fills.forked(fill, loader_pid)             # SCHED_IDLE for every thread of the loader
    done = fills.wait(fill, waiter_pid)        # a waiter lends it normal priority
    fills.finish(fill, remember=True)          # fill.entry or fill.error set: its waiters wake

One ``Fill`` per key (single flight): its outcome, its loader's CPU priority and its progress.
``Fills`` is the table of them, with who waits for which and the failures they left (a
``Failures``, overmind.server.failures). Whether a caller joins a fill rather than load plainly
is overmind.server.joins's; the warm pool only forks the loader (``WarmPool.start_loader``), and
overmind.server.loaders hands it its references and reads its answer.

Note [Cold fills wait for their caller]
On a miss nobody waits for (Note [Cold loads run behind the caller] in overmind.server.loads)
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
find them still running. The word also names what the caller's load imported (``PlainLoaded.
modules``: transformers imports a model's own module inside ``from_pretrained``), and the
warm interpreter imports those before it forks the loader, as it does a Job's modules: the
LM's loader then called the original in 0.11 s instead of 0.79 s, and ``overmind run``'s run
2, forked from that interpreter with the model's module imported, took 0.13 x plain instead
of 0.17 in the minimal venv (``overmind-bench --scenarios warmup_curve --curve-scripts lm``).
It still came before the fill was packed, mostly, and loaded plainly beside it (Note [Joining
a fill]): a plain load is 0.1 s there, the rest of the pack 0.2 s, nearly all of it hashing.
Since the pack leaves that for after its answer (Note [Hashing a file's storages after the
answer] in overmind.warm.loader), run 2 finds the entry filed in the users' venv
(``benchmarks/real_envs.sh users``); in the minimal venv, whose run 1 is a second quicker, the
fill still forks after run 2 asks: the context's first interpreter is still importing what run 1
did (Note [Teaching the interpreter while importing] in overmind.client.prefetch).

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
from dataclasses import dataclass
from typing import Callable, Optional

from overmind.shared import protocol as P
from overmind.shared.settings.config import Config
from overmind.shared.process.priority import can_lift_idle, every_thread, to_idle, to_normal
from overmind.server.failures import Failures
from overmind.server.registry import CacheEntry, Registry, Reply

logger = logging.getLogger("overmind.server.fills")

__all__ = ["Fill", "Fills", "Admission", "MAX_FILLS"]

MAX_FILLS = 64  # fills in flight (waiting or running) past which a new key starts none: busy
FILL_NICE = 10  # Note [Cold fills yield to their caller]: where SCHED_IDLE could not be lifted
CALLER_POLL = 0.1  # seconds between two looks at the caller's CPU time
CALLER_QUIET = 2  # polls in a row under half a core: its load is over


class Fill:
    """One cache fill in flight; requests for its key wait on it (single flight). Its loader's CPU
    priority: Note [Cold fills yield to their caller]; its progress: Note [Joining a fill] in
    overmind.server.joins."""

    def __init__(self, key: str, background: bool, caller: int = 0) -> None:
        self.key = key
        # Its outcome, once ``done``: the entry it filed, or an overmind.shared.protocol.Error.
        self.done = threading.Event()
        self.entry: Optional[CacheEntry] = None
        self.error = None
        self.background = background  # nobody waits for it (yet): it may yield
        self.caller = caller  # pid of the process whose miss started it (0: unknown)
        self.wanted = threading.Event()  # someone waits for it: no more waiting for the caller
        if not background:
            self.wanted.set()
        self.caller_done = threading.Event()  # the caller said its own load of the key returned
        self.caller_imported: list = []  # what that load imported: its loader's interpreter imports them first
        self.slotted = False  # it holds a load slot, its references filed: its loader is being forked
        self.pid = 0  # its loader, once forked
        self.forked_at = 0.0
        self.fresh = False  # its loader is a fresh interpreter (Note [A fill never waits for a fork])
        self.idle = False  # under SCHED_IDLE now: a waiter lifts it
        self.yielded_at = 0.0
        # Its loader's progress reports (Note [Joining a fill] in overmind.server.joins).
        self.packing_since = 0.0  # when the pack began (its first report); 0: not yet
        self.reported_at = 0.0  # when its last report came
        self.written = 0
        self.expected = 0
        self.original_seconds = 0.0  # what the loader's call of the original took

    @property
    def warm_loader(self) -> bool:
        """Its loader runs, forked from a warm interpreter: it does what a plain load does, its
        imports done (Note [Joining a fill]); not one still to fork, nor a fresh interpreter."""
        return self.pid != 0 and not self.fresh

    @property
    def about_to_run(self) -> bool:
        """Nothing is left before its loader runs the original but the loader's fork (Note
        [Joining a fill]); it may yet turn out a fresh interpreter."""
        return self.slotted and self.pid == 0


@dataclass
class Admission:
    """What :meth:`Fills.admit` decided for a request."""

    reply: Optional[Reply] = None  # a hit
    fill: Optional[Fill] = None  # the fill in flight for the key (``started``: this request must run it)
    started: bool = False
    failure: object = None  # overmind.shared.protocol.Error of a remembered failure (overmind.server.failures)
    busy: bool = False  # too many fills in flight: nothing started, nothing remembered


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


class Fills:
    """The fills in flight by key, who waits for them, and the failures they left. Its lock is its
    own; it takes the registry's inside it, never the other way round."""

    def __init__(self, config: Config, registry: Registry, max_fills: int = MAX_FILLS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock  # what a fill's pace is timed by (overmind.server.joins); tests step their own
        self.registry = registry
        self.max_fills = max_fills
        self.lock = threading.Lock()
        self.fills: dict[str, Fill] = {}  # key -> the fill in flight for it
        self.waits: dict[str, str] = {}  # key of a fill waiting for another key's fill (a reference) -> that key
        self.lenders: dict[str, int] = {}  # key -> processes waiting for it that lend it their priority
        self.failures = Failures()  # under self.lock: Note [Only deterministic failures are remembered] in overmind.server.failures
        self.misses = 0  # clients' loads that started a fill
        self.plain_loads = 0  # clients' loads that neither hit nor started a fill: loads_plainly
        self.can_lift_idle = can_lift_idle()
        # True while memory is short: no fill starts (Note [The cache gives way] in overmind.server.pressure)
        self.holding_back: Callable[[], bool] = lambda: False

    def counters(self) -> dict:
        with self.lock:
            return {"misses": self.misses, "plain_loads": self.plain_loads, "loading": len(self.fills),
                    "remembered_failures": len(self.failures)}

    def packing(self) -> list[dict]:
        """The fills whose loader reports its pack (Note [Joining a fill] in overmind.server.joins): how
        far each is."""
        with self.lock:
            return [{"key": fill.key[:16], "written": fill.written, "expected": fill.expected,
                     "seconds": round(self.clock() - fill.packing_since, 3)}
                    for fill in self.fills.values() if fill.packing_since]

    # -- admission and outcome ----------------------------------------------------------------

    def admit(self, key: str, lookup_only: bool = False, count: bool = True, background: bool = False,
              caller: int = 0) -> Admission:
        """A hit, the fill to wait for (started by this request or another), or a remembered failure.

        Past ``max_fills`` fills in flight, a new key starts nothing and is answered as a failure
        that is not remembered: the caller loads plainly. A fill this request starts runs for
        process ``caller`` (0: none); ``background``: nobody waits for it (Note [Cold fills yield
        to their caller]). End it with ``finish``. ``count``: False for a restore's refill
        (overmind.server.restore), which is no client's hit or miss.
        """
        reply = self.registry.get(key, count)
        if reply is not None:
            return Admission(reply=reply)
        with self.lock:
            entry = self.registry.entry(key)  # a fill filed it since get()
            if entry is None:
                fill = self.fills.get(key)
                if fill is not None:
                    return Admission(fill=fill)
                failure = self.failures.get(key)
                if failure is not None:
                    return Admission(failure=failure)
                if lookup_only:
                    return Admission()
                if len(self.fills) >= self.max_fills or self.holding_back():
                    return Admission(busy=True)
                # a waiter that came first makes it wanted
                fill = self.fills[key] = Fill(key, background and not self.lenders.get(key), caller)
                self.misses += count
                return Admission(fill=fill, started=True)
        reply = self.registry.hit(entry, count)
        return Admission(reply=reply) if reply is not None else self.admit(key, lookup_only, count, background,
                                                                           caller)

    def loads_plainly(self) -> None:
        """A client's load that found no entry and starts no fill (its key filling or failing, or
        the server busy): it loads plainly. Hits + misses + these = a client's loads."""
        with self.lock:
            self.plain_loads += 1

    def finish(self, fill: Fill, *, remember: bool) -> None:
        """End ``fill``, its ``entry`` or ``error`` set: wake its waiters; remember its failure per
        Note [Only deterministic failures are remembered] in overmind.server.failures."""
        with self.lock:
            if self.fills.get(fill.key) is fill:
                del self.fills[fill.key]
            if fill.error is None:
                self.failures.forget(fill.key)
            else:
                self.failures.record(fill.key, fill.error, remember=remember)
        fill.done.set()

    def in_flight_besides(self, key: str) -> bool:
        """Is a fill other than ``key``'s in flight? (A restore lets clients' fills go first.)"""
        with self.lock:
            return any(k != key for k in self.fills)

    # -- before the loader: Note [Cold fills wait for their caller] ---------------------------

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

    def caller_loaded(self, key: str, imported: list = ()) -> None:
        """The caller whose miss started the fill of ``key`` finished its own plain load of it,
        which imported ``imported``."""
        with self.lock:
            fill = self.fills.get(key)
        if fill is not None:
            if not fill.caller_done.is_set():
                fill.caller_imported = list(imported)
            fill.caller_done.set()

    # -- its loader: Note [Cold fills yield to their caller] ----------------------------------

    def slot_taken(self, fill: Fill) -> None:
        """``fill`` holds a load slot, its references filed: its loader is being forked."""
        with self.lock:
            fill.slotted = True

    def forked(self, fill: Fill, pid: int, fresh: bool = False) -> None:
        """``fill``'s loader is process ``pid`` (``fresh``: an interpreter of its own, which imports
        first): it yields if nobody waits for the fill."""
        with self.lock:
            fill.pid, fill.forked_at, fill.fresh = pid, time.monotonic(), fresh
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

    def answer(self, job: socket.socket, fill: Fill, deadline: float) -> tuple[P.Message, bytes, list[int]]:
        """The first message on ``fill``'s job socket that is not a progress report (``FillProgress``,
        taken in by ``progress``), with its skeleton and fds: the loader's answer. socket.timeout
        past ``deadline``; P.ProtocolError for a malformed report."""
        while True:
            self._wait_answer(job, fill, deadline)
            job.settimeout(max(deadline - time.monotonic(), 0.001))
            message, skeleton, fds = P.recv_message(job)
            if not isinstance(message, P.FillProgress):
                return message, skeleton, fds
            if fds or message.key != fill.key or not 0 <= message.written <= 1 << 50 or \
                    not 0 <= message.expected <= 1 << 50 or not 0 <= message.original_seconds < 1e6:
                P.close_fds(fds)
                raise P.ProtocolError(f"malformed progress report {message!r}")
            self.progress(fill, message.written, message.expected, message.original_seconds)

    def _wait_answer(self, job: socket.socket, fill: Fill, deadline: float) -> None:
        """Until the loader's next message starts arriving; lifts a fill that yielded for
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
            with self.lock:
                if fill.idle and time.monotonic() >= fill.yielded_at + self.config.fill_yield:
                    self._lift(fill, f"it yielded for OVERMIND_FILL_YIELD={self.config.fill_yield:g}s")

    def progress(self, fill: Fill, written: int, expected: int, original_seconds: float) -> None:
        """Its loader's report (``FillProgress``): ``written`` of ``expected`` bytes in place."""
        with self.lock:
            first = not fill.packing_since
            fill.reported_at = self.clock()
            if first:
                fill.packing_since = fill.reported_at
            fill.written, fill.expected, fill.original_seconds = written, expected, original_seconds
        if first:
            logger.info("loader pid %d packs %s: %d MB expected; its call of the original took %.2fs",
                        fill.pid, fill.key[:16], expected >> 20, original_seconds)

    # -- who waits for it: Note [Cold fills yield to their caller] ------------------------------

    def wait(self, fill: Fill, waiter: int, timeout: float = 0.0) -> bool:
        """Process ``waiter`` waits for ``fill``, lending it normal priority: ``timeout`` seconds at
        most (a join's: Note [Joining a fill] in overmind.server.joins), else until the loader
        timeout. Whether it is done."""
        with self.waiting(fill.key, waiter):
            return fill.done.wait(timeout or self.config.loader_timeout + 60)

    @contextlib.contextmanager
    def waiting(self, key: str, waiter: int):
        """Process ``waiter`` waits for the fill of ``key`` in this block: lend it normal priority."""
        with self.lock:
            self._lend(key, f"pid {waiter} waits for it")
        try:
            yield
        finally:
            with self.lock:
                self._unlend(key)

    @contextlib.contextmanager
    def depends(self, fill: Fill, key: str):
        """``fill`` waits in this block, before its loader starts, for the fill of ``key`` (an
        entry its call refers to: Note [The loader is handed its references] in
        overmind.server.loaders). It lends that fill its priority only if someone waits for it in turn;
        otherwise a later lift passes on (``_hurry``)."""
        with self.lock:
            self.waits[fill.key] = key
            lends = not fill.background
            if lends:
                self._lend(key, f"{fill.key[:16]} refers to it and is waited for")
        try:
            yield
        finally:
            with self.lock:
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

    def _lift(self, fill: Fill, why: str) -> None:
        """Back to SCHED_OTHER; with the lock held."""
        if not fill.idle:
            return
        fill.idle = False
        if every_thread(fill.pid, to_normal):
            logger.info("loader pid %d fills %s at normal priority now: %s", fill.pid, fill.key[:16], why)
        else:
            logger.warning("loader pid %d filling %s stays at idle priority (%s): the kernel refused", fill.pid,
                           fill.key[:16], why)

