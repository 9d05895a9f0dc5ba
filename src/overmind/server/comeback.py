"""What the cache let go while memory was short, owed back and brought back once there is room.
Stdlib only.

    comeback = Comeback(registry, pool, settler, restore, stopping, guard.room_for, guard.pressed)
    comeback.owe_entry(key)      # the guard let go of something (owe_interpreter, owe_unsettled, ...)
    if comeback.due(now):        # the guard's thread, after CALM seconds of calm
        comeback.start()         # a thread brings back what fits
    comeback.describe(calm)      # `overmind status`'s "memory"["comeback"]

The guard (overmind.server.pressure.Guard) decides when memory is short, lets go and says when
it is calm again; what it let go is owed here, and brought back in the order and under the rule
of Note [The cache gives way] in overmind.server.pressure: each only if the headroom and the
slack stay free after it (the guard's ``room_for``), what finds no room waiting for the next calm.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from typing import Callable, Optional

from overmind.shared.segments.memfd import RESIDENT, cached_share, hold_pages

logger = logging.getLogger("overmind.server.pressure")  # the guard's: an event and its comeback read as one

__all__ = ["Comeback", "read_back", "read_back_mapped_files", "RETRY"]

RETRY = 2.0  # seconds before what found no room to come back is tried again
SETTLE_WAIT = 120.0  # seconds the comeback waits for the settler to settle again what it served from files


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.2f} GiB"


class Comeback:
    """What was let go and is owed back, and the thread that brings it back (Note [The cache
    gives way] in overmind.server.pressure)."""

    def __init__(self, registry, pool, settler, restore, stopping: threading.Event,
                 room_for: Callable[[int], bool], pressed: Callable[[], bool],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.registry = registry  # overmind.server.registry.Registry
        self.pool = pool  # overmind.server.pool.WarmPool
        self.settler = settler  # overmind.server.settle.Settler
        self.restore = restore  # overmind.server.restore.Restore
        self.stopping = stopping
        self.room_for = room_for  # the guard's: may the cache take that many bytes more now?
        self.pressed = pressed  # the guard's: is memory short now?
        self.clock = clock
        self.lock = threading.Lock()  # the fields below; the guard's thread and this one write, status reads
        self._read_back_owed = False  # an event pushed pages out: Note [The cache gives way]
        self._interpreters: list = []  # (context, env, pss) retired under pressure, to start again
        self._entries: list = []  # keys evicted under pressure, to refill
        self._unsettled: list = []  # (dev, ino) of segments served from their files, to settle again
        self._thread: Optional[threading.Thread] = None
        self._bringing = 0  # interpreters and entries the thread is bringing back now
        self._retry_at = 0.0  # what found no room is tried again from then
        self._brought = 0  # what came back

    # -- what the guard let go -----------------------------------------------------------------

    def owe_read_back(self) -> None:
        """An event began: the pages it pushes out of the page cache are read back after."""
        with self.lock:
            self._read_back_owed = True

    def owe_interpreter(self, retired: tuple) -> None:
        """(context, environment, PSS) of a warm interpreter retired for memory: started again."""
        with self.lock:
            self._interpreters.append(retired)

    def owe_entry(self, key: str) -> None:
        """An entry evicted for memory: refilled (overmind.server.restore)."""
        with self.lock:
            self._entries.append(key)

    def owe_unsettled(self, ident: tuple) -> None:
        """(dev, ino) of a segment served from its file again: settled again."""
        with self.lock:
            self._unsettled.append(ident)

    # -- what others ask -----------------------------------------------------------------------

    def owed(self) -> bool:
        return bool(self._interpreters or self._entries or self._read_back_owed or self._unsettled)

    def due(self, now: float) -> bool:
        """Is something owed, and not waiting out RETRY after it last found no room?"""
        return now >= self._retry_at and self.owed()

    def may_settle(self, nbytes: int) -> bool:
        """May the settler copy ``nbytes`` into sealed memory now? Only where they fit, and not
        while pages an event pushed out are still owed: the read-back brings them back first, and
        the settler then copies them from the page cache, not from disk beside a user's run."""
        return not self._read_back_owed and self.room_for(nbytes)

    def describe(self, calm: bool) -> dict:
        """``calm``: memory was not short for the guard's CALM seconds."""
        with self.lock:
            pending = len(self._interpreters) + len(self._entries) + int(self._read_back_owed) + \
                len(self._unsettled) + self._bringing
            if self._thread is not None and self._thread.is_alive():
                state = "coming back"
            elif not pending:
                state = "idle"
            elif not calm:
                state = "waiting for calm"
            else:
                state = "waiting for room"
            return {"state": state, "pending": pending, "done": self._brought}

    # -- the thread ----------------------------------------------------------------------------

    def start(self) -> None:
        """Bring back what is owed, in a thread of its own, unless one runs already."""
        if self._thread is not None and self._thread.is_alive():
            return
        with self.lock:
            interpreters, self._interpreters = self._interpreters, []
            entries, self._entries = self._entries, []
            self._bringing = len(interpreters) + len(entries)  # the read-back and settling count as they stand
            self._thread = threading.Thread(target=self._bring_back, args=(interpreters, entries),
                                            daemon=True, name="overmind-comeback")
        self._thread.start()

    def _bring_back(self, interpreters: list, entries: list) -> None:
        """Interpreters first (a run's start is most of what a user waits for), then the entries,
        newest first, then the pages the event pushed out (the model files the cache serves from,
        the interpreters' libraries), then the segments it served from their files are settled
        again; what finds no room waits for the next calm."""
        left_interpreters: list = []
        try:
            for context, env, pss in reversed(interpreters):  # the most recently used first
                if self.room_for(pss):
                    logger.info("memory is free again: starting the warm interpreter of context %s", context.key)
                    self.pool.prepare(context, env=env)
                    self._brought_back(1)
                else:
                    left_interpreters.insert(0, (context, env, pss))
            refilled, left_entries = self.restore.bring_back(list(reversed(entries)), self.room_for) \
                if entries else (0, [])
            with self.lock:  # those left for room are pending again below; those that failed are gone
                self._brought += refilled
                self._bringing = max(0, self._bringing - len(entries))
            if self._read_back_owed:
                asked, complete = self._read_back_files()
                for pid in self.pool.pids():
                    more, whole = read_back_mapped_files(pid, self.room_for)
                    asked, complete = asked + more, complete and whole
                logger.info("read back %s of model files and warm interpreters' libraries%s", _gib(asked),
                            "" if complete else "; the rest waits for room")
                if complete:
                    with self.lock:
                        self._read_back_owed = False
                        self._brought += 1
            if not self._read_back_owed and self._unsettled:
                self._settle_again()
        finally:
            with self.lock:
                self._bringing = 0
                self._retry_at = self.clock() + RETRY
                self._interpreters[:0] = left_interpreters  # anything let go meanwhile comes after
                self._entries[:0] = list(reversed(left_entries))
        if interpreters or entries:
            logger.info("came back after memory was short: %d warm interpreters, %d entries refilled; %d wait for "
                        "room", len(interpreters) - len(left_interpreters), refilled,
                        len(left_interpreters) + len(left_entries))

    def _settle_again(self) -> None:
        """The segments it served from their files go back into sealed memory now, from the page
        cache the read-back filled, as they were before the event (the settler copies them; a hit
        then maps huge pages, not the file's 4 KiB pages); this thread waits, counting them pending."""
        wanted = set(self._unsettled)
        self.settler.settle_soon(wanted)
        deadline = self.clock() + SETTLE_WAIT
        while not self.stopping.is_set() and self.clock() < deadline:
            files = set()
            for ident, _, fd in self.registry.file_segments():
                os.close(fd)
                files.add(ident)
            left = wanted & files
            with self.lock:
                done = [ident for ident in self._unsettled if ident not in left]
                self._unsettled = [ident for ident in self._unsettled if ident in left]
                self._brought += len(done)
            if not left or self.pressed():
                break
            self.stopping.wait(0.2)
        self.settler.settle_soon(set())

    def _brought_back(self, n: int) -> None:
        with self.lock:
            self._brought += n
            self._bringing = max(0, self._bringing - n)

    def _read_back_files(self) -> tuple[int, bool]:
        """Read the model files the cache serves from back into the page cache (the most recently
        used entries' first), each where it fits: their next hits then cost no disk. (Bytes asked,
        whether all fitted.)"""
        asked, complete = 0, True
        for ident, size, fd in self.registry.file_segments():
            try:
                read = read_back(fd, size, self.room_for)
            finally:
                os.close(fd)
            asked, complete = asked + (read or 0), complete and read is not None
        return asked, complete


def read_back(fd: int, size: int, room_for: Callable[[int], bool]) -> Optional[int]:
    """Read the file ``fd``'s first ``size`` bytes into the page cache now, unless it holds them
    (RESIDENT) or ``room_for`` what is missing says no (None); the bytes it read. Nothing is
    copied to us: the pages are mapped with their tables filled, then unmapped."""
    share = cached_share(fd, size)
    missing = size if share is None else int(size * (1 - share))
    if missing <= 0 or (share is not None and share >= RESIDENT):
        return 0
    if not room_for(missing):
        return None
    mapping = hold_pages(fd, size)
    if mapping is not None:
        mapping.close()
    return missing


def read_back_mapped_files(pid: int, room_for: Callable[[int], bool]) -> tuple[int, bool]:
    """Read back the files process ``pid`` maps (a warm interpreter's libraries, which a job that
    needed the memory pushed out of the page cache): (bytes asked, whether all fitted)."""
    paths: dict = {}
    try:
        with open(f"/proc/{pid}/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].startswith("/") and fields[4] != "0":
                    paths[fields[5].rstrip("\n")] = None
    except OSError:
        return 0, True
    asked, complete = 0, True
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue  # deleted, or not ours to read
        try:
            st = os.fstat(fd)
            read = read_back(fd, st.st_size, room_for) if stat.S_ISREG(st.st_mode) and st.st_size > 0 else 0
        except OSError:
            continue
        finally:
            os.close(fd)
        asked, complete = asked + (read or 0), complete and read is not None
    return asked, complete
