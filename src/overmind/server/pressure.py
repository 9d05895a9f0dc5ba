"""The cache gives way: memory let go when others need it, taken again once they are done. Stdlib only.

    guard = Guard(config, registry, pool, settler, restore, stopping)
    threading.Thread(target=guard.run).start()
    guard.pressed()              # True while memory is short: fills and new interpreters wait
    guard.room_for(nbytes)       # may a copy, a refill or an interpreter take that much now?
    guard.describe()             # `overmind status`'s "memory"

What was let go is owed to the comeback (overmind.server.comeback), which brings it back.

Note [The cache gives way]
The server is a guest on the user's machine. Its sealed memfds are shared memory the kernel
cannot reclaim without swap, and a write-sealed memfd cannot be hole-punched: killing the
user's job frees nothing of them. So the server must let go itself, before the job stalls or
is killed. One thread looks every POLL seconds at what is available to the server (the
smallest of MemAvailable and, under each cgroup limit over it, what that limit leaves: Note
[What is left under a limit] in overmind.shared.settings.host_memory) and at the kernel's memory stall
time (PSI, where the kernel keeps it). Memory is *short* when less than the headroom is
available (``OVERMIND_HEADROOM``; by default 10 % of the memory the server may use, at least
1 GiB and at most 8 GiB, as ComfyUI's RAM cache keeps 10 %), or when tasks stalled on memory
for STALL_SHARE of the last look while less than twice the headroom is available.

Then, once per event, it says so in the log and lets go, cheapest loss first, a step at a
time, looking again after each, until the headroom and SLACK more are free or nothing is left:

1. every copy into sealed memory stops, and the pages the settler held mapped are unmapped
   (Note [Settling file segments] in overmind.server.settle): under pressure, memory the kernel
   could reclaim is never turned into memory it cannot;
2. a settled segment whose model file is unchanged is served from that file again (least
   recently used entries' first): it stays a hit, and its pages become the page cache's, which
   the kernel takes as it needs;
3. a warm interpreter, least recently used first (retiring never kills work in progress: its
   runs go on, and it exits after them);
4. an entry that holds a sealed memfd, least recently used first (one served from its model
   files alone holds only page cache, which the kernel takes itself: it stays a hit).

Clients keep their mappings (Note [Server owns segment fds] in overmind.server.daemon): what
only clients still map is theirs, and is freed when they unmap. While memory is short, no fill
starts (the caller loads plainly, as when the server is busy) and no interpreter starts.

An event is one job's growth: it ends once nothing was short for END_AFTER. An entry is
evicted only for the sealed memory it alone holds: those that free less than EVICT_WORTH (a
model file's buffers) go last, and a retired interpreter is waited for (it exits at once
without a child) before the next step, so its memory is counted before more goes.

It comes back: once nothing was short for CALM seconds, the interpreters it retired start
again, the entries it evicted are refilled at idle priority, most recently used first, each
after those it refers to (overmind.server.restore), and the pages the event pushed out of the
page cache are read back (the model files the cache serves from, the interpreters' libraries:
a job that needed the memory leaves them on disk, and the next run would read them there).
Each only if the headroom and SLACK stay free after it: a job that keeps its memory keeps it,
and no refill fights it. ``overmind status`` counts what is still owed as pending.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Callable, Optional

from overmind.shared.settings.config import Config
from overmind.shared.settings.host_memory import HostMemory
from overmind.server.comeback import Comeback

logger = logging.getLogger("overmind.server.pressure")

__all__ = ["Guard", "default_headroom", "POLL", "CALM"]

POLL = 0.1  # seconds between looks: a job that takes 2.5 GB/s crosses a 2.4 GB headroom in a second
CALM = 5.0  # seconds with nothing short before anything comes back
STALL_SHARE = 0.10  # of STALL_WINDOW some task stalled on memory (PSI "some")
STALL_WINDOW = 1.0  # seconds stalls are summed over
END_AFTER = 1.0  # seconds nothing is short before an event ends (one job's growth is one event)
SLACK_SHARE, SLACK_MAX = 0.10, 512 << 20  # freed beyond the headroom, and kept free by a comeback
STEP_WAIT = 0.05  # seconds for a let-go to show in MemAvailable before the next look
KINDS = ("copies", "unsettled", "unsettled_bytes", "interpreters", "entries", "entry_bytes")


def default_headroom(limit: int) -> int:
    """10 % of ``limit``, at least 1 GiB (but a quarter of ``limit`` at most), at most 8 GiB."""
    return min(max(limit // 10, min(1 << 30, limit // 4)), 8 << 30)


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.2f} GiB"


class Guard:
    """The one thread that watches memory, lets the cache go and says when it may come back (Note [The
    cache gives way]); what was let go is its ``comeback``'s."""

    def __init__(self, config: Config, registry, pool, settler, restore, stopping: threading.Event,
                 host: Optional[HostMemory] = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.registry = registry  # overmind.server.registry.Registry
        self.pool = pool  # overmind.server.pool.WarmPool
        self.settler = settler  # overmind.server.settle.Settler
        self.stopping = stopping
        self.clock = clock  # what calm and stalls are timed by; tests step their own
        self.host = host or HostMemory.read()
        limit = self.host.limit.bytes
        self.headroom = min(config.headroom, limit) if config.headroom is not None else default_headroom(limit)
        self.slack = min(int(self.headroom * SLACK_SHARE), SLACK_MAX)
        self.lock = threading.Lock()  # the fields below; the thread writes, status and others read
        self._pressed = False
        self._calm_since = self.clock() - CALM  # a fresh server has seen no pressure
        self._available = self.host.available()
        self._stalls: deque = deque()  # (when, PSI "some" total µs) over the last STALL_WINDOW
        self._stall_step = 0.0  # when stalls last made it let go of one thing
        self._fine_since = 0.0  # since when, in an event, nothing was short
        self.events = 0
        self.last_event: Optional[dict] = None
        self.totals = dict.fromkeys(KINDS, 0)
        # What was let go and is owed back (overmind.server.comeback). Its lock is its own: taken
        # under this one's (describe, _begin), never the other way round.
        self.comeback = Comeback(registry, pool, settler, restore, stopping, self.room_for, self.pressed, clock)

    def holds_back(self, fills) -> None:
        """While memory is short, the settler copies nothing, the pool starts no interpreter and
        ``fills`` (overmind.server.fills.Fills) start no fill; the settler copies only where the
        comeback says it may (``Comeback.may_settle``)."""
        self.settler.pressed = self.pool.holding_back = fills.holding_back = self.pressed
        self.settler.may_copy = self.comeback.may_settle

    # -- what others ask -----------------------------------------------------------------------

    def pressed(self) -> bool:
        return self._pressed

    def room_for(self, nbytes: int) -> bool:
        """May the cache take ``nbytes`` more now, keeping the headroom and SLACK free after it?"""
        if self._pressed or self.clock() - self._calm_since < CALM:
            return False
        return self.host.available() - nbytes >= self.headroom + self.slack

    def describe(self) -> dict:
        with self.lock:
            return {**self.host.describe(), "available": self._available, "headroom": self.headroom,
                    "pressed": self._pressed, "events": self.events,
                    "last_event": None if self.last_event is None else
                    {**self.last_event, "let_go": dict(self.last_event["let_go"])},
                    "let_go": dict(self.totals),
                    "comeback": self.comeback.describe(not self._pressed and self.clock() - self._calm_since >= CALM)}

    # -- the thread ----------------------------------------------------------------------------

    def run(self) -> None:
        while not self.stopping.wait(POLL):
            try:
                self.tick()
            except Exception:  # pragma: no cover - reported; the next look tries again
                logger.exception("looking at memory failed")

    def tick(self) -> None:
        now, available = self.clock(), self.host.available()
        stalled = self._stalled(now)
        with self.lock:
            self._available = available
        low, target = available < 2 * self.headroom, self.headroom + self.slack
        if not self._pressed and (available < self.headroom or (stalled >= STALL_SHARE and low)):
            self._begin(available, stalled)
        if self._pressed:
            if available >= target and stalled < STALL_SHARE:
                if now - self._fine_since >= END_AFTER:
                    self._end(available)
                return
            self._fine_since = now
            if available < target:
                self._let_go(available)
            elif stalled >= STALL_SHARE and low and now - self._stall_step >= STALL_WINDOW:
                self._stall_step = now  # stalls with memory getting low: one step a window
                self._let_go(available, steps=1)
        elif now - self._calm_since >= CALM and self.comeback.due(now):
            self.comeback.start()

    def _stalled(self, now: float) -> float:
        """The share of the last STALL_WINDOW that some task stalled on memory (PSI), or 0."""
        stall = self.host.pressure()
        if stall is None:
            return 0.0
        self._stalls.append((now, stall.some_total_us))
        while len(self._stalls) > 2 and now - self._stalls[1][0] >= STALL_WINDOW:
            self._stalls.popleft()
        then, total = self._stalls[0]
        if now - then < STALL_WINDOW / 2:
            return 0.0
        return max(0, stall.some_total_us - total) / 1e6 / (now - then)

    def _begin(self, available: int, stalled: float) -> None:
        why = (f"{_gib(available)} available, under the headroom of {_gib(self.headroom)}"
               if available < self.headroom else f"tasks stalled on memory {stalled:.0%} of the time, "
                                                 f"{_gib(available)} available")
        logger.warning("memory is short (%s; %s): letting go of the cache", why, self.host.limit.source)
        with self.lock:
            self._pressed = True
            self.comeback.owe_read_back()  # the pages it pushes out come back after
            self._fine_since = self.clock()
            self.events += 1
            self.last_event = {"started": time.time(), "why": why, "available": available, "ended": None,
                               "seconds": None, "let_go": dict.fromkeys(KINDS, 0)}
            self._event_start = self.clock()
        if self.settler.copying is not None:
            self._count("copies", 1)  # the settler sees pressed() between chunks and drops its copy

    def _end(self, available: int) -> None:
        with self.lock:
            self._pressed = False
            self._calm_since = self.clock()
            event = self.last_event
            if event is not None:
                event["ended"] = time.time()
                if event["seconds"] is None:
                    event["seconds"] = round(self.clock() - self._event_start, 3)
        logger.info("memory is no longer short (%s available)%s", _gib(available),
                    f"; what was let go comes back after {CALM:g}s of calm" if self.comeback.owed() else "")

    def _count(self, kind: str, n: int) -> None:
        with self.lock:
            self.totals[kind] += n
            if self.last_event is not None:
                self.last_event["let_go"][kind] += n

    def _let_go(self, available: int, steps: int = 1 << 30) -> None:
        """Steps, cheapest loss first, until the headroom and slack are free (or ``steps`` were
        taken), or nothing is left."""
        target = self.headroom + self.slack
        while steps > 0 and not self.stopping.is_set():
            if not self._step():
                self._finished_letting_go(available, "nothing more to let go")
                return
            steps -= 1
            self.stopping.wait(STEP_WAIT)
            available = self.host.available()
            with self.lock:
                self._available = available
            if available >= target:
                break
        if available >= target:
            self._finished_letting_go(available, "the headroom is free again")

    def _finished_letting_go(self, available: int, how: str) -> None:
        with self.lock:
            event = self.last_event
            if event is None or event["seconds"] is not None:
                return
            event["seconds"] = round(self.clock() - self._event_start, 3)
            let_go = dict(event["let_go"])
        logger.warning("let go in %.2fs (%s; %s available): %d file segments (%s) served from their files again, "
                       "%d warm interpreters retired, %d entries (%s) evicted", event["seconds"], how,
                       _gib(available), let_go["unsettled"], _gib(let_go["unsettled_bytes"]), let_go["interpreters"],
                       let_go["entries"], _gib(let_go["entry_bytes"]))

    def _step(self) -> bool:
        """Let go of one thing, the cheapest first; False when there is nothing left."""
        order = self.registry.segments_least_recent_first()
        unsettled = self.settler.unsettle_one(order)
        if unsettled is not None:
            ident, nbytes = unsettled
            self.comeback.owe_unsettled(ident)
            self._count("unsettled", 1)
            self._count("unsettled_bytes", nbytes)
            return True
        retired = self.pool.retire_for_memory()
        if retired is not None:
            self.comeback.owe_interpreter(retired)
            self._count("interpreters", 1)
            return True
        evicted = self.registry.evict_least_recent()
        if evicted is not None:
            key, description, nbytes = evicted
            logger.info("evicted %s (%s, %s) for memory", key[:16], description, _gib(nbytes))
            self.comeback.owe_entry(key)
            self._count("entries", 1)
            self._count("entry_bytes", nbytes)
            return True
        return False
