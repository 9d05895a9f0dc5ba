"""Copying the model files the server serves from into sealed memory, when it is idle. Stdlib only.

    settler = Settler(registry, idle_after=config.settle_after, stopping=server.stopping)
    threading.Thread(target=settler.run).start()
    settler.touch()                      # every request but a status or a list: the machine is in use

Note [Settling file segments]
An entry whose weights were a model file's own pages is served from that file (Note
[File-backed segments] in overmind.shared.segments.memfd): ready the moment its loader has loaded, and
costing no fresh memory while the user's next runs start. While the page cache holds the file,
a hit from it costs what a hit from a sealed memfd does (``benchmarks/file_segments.py``, its
ControlNet script with ``monkey_patch_all()``, 5 interleaved triples, twice, 2026-11-26: 5.51
and 5.95 s from the files, 5.71 and 5.75 s from memfds, 6.80 and 6.97 s plain).

But those pages are the page cache's: a workload that needs the memory evicts them, and a hit
then reads them from disk as plain python would, where a sealed memfd would have kept them. So
one thread copies file segments into new memfds (``sendfile``, at idle CPU priority, 32 MiB at
a time):

- once the server had no request for ``OVERMIND_SETTLE_AFTER`` seconds (30 by default: longer
  than any gap between requests of runs back to back, so those are left alone; set empty:
  never, not even as below), every file segment, most recently used entry first, pausing
  whenever a request comes, until the next such quiet (``0``: at once, which the tests use to
  see hits in memfds). A status or a listing is no request here: a tool that polls them (the
  tests do, every 0.2 s) would otherwise keep the copy from ever starting. It was 5 s, which a run's imports (its ``Prefetch`` to its first
  ``Load``) and the gap to the next run's start both came close to on this machine: the copy
  crept into the later runs of a back-to-back loop of the ControlNet script with
  ``monkey_patch_all()`` and slowed them (seen by hand, ``overmind status`` after each run);
  at 30 s it leaves such a loop alone;
- at once, without pausing, one of which the page cache holds less than RESIDENT (90 %,
  ``cachestat``, looked at every 0.5 s): its pages are going, and the next hit would read them
  from disk; but not one just handed to a prefetching client that still imports
  (``Prefetch.importing``) in the last READ_BACK_HOLD seconds: that client reads it back itself
  while it imports (Note [Reading back a lost file] in overmind.client.prefetch), and a copy
  beside it read the same disk at the same time and took the core its imports leave idle (the
  server used 3.4-4.6 s of CPU during such a run 2). A copy under way stops when its file is
  handed out so, and starts over later. A forked ``overmind run`` child imports nothing, so its
  run ends in a second or two and the next one gains most from sealed copies: its ``Prefetch``
  ends the hold (held for every run, its runs 3-5 read the files from disk each time and took
  1.7-2.4 s, 0.13-0.18 x plain).

Note [File segments stay mapped]
Until it is copied, the settler keeps each file segment the page cache holds mapped here,
read-only and shared, its page tables filled (``hold_pages`` in overmind.shared.segments.memfd). The
kernel drops only unmapped pages when asked to (``/proc/sys/vm/drop_caches``, ``POSIX_FADV_
DONTNEED``) and reclaims mapped ones after those it can take more cheaply, so the pages a hit
serves stay when the client that read them has exited, as a sealed copy's would, at no memory
beyond the page cache's own. ``OVERMIND_KEEP_FILE_PAGES=0`` leaves them to the page cache.
Measured with the whole page cache dropped before every run of the ControlNet script
(``overmind-bench --scenarios warmup_curve --drop-caches``): without it, run 2 of ``overmind
run`` read 3.4 GB back from disk and took 0.35 x plain. Memory the kernel must have still takes
them (then the copy above starts at once); a segment copied, evicted, or whose file changed
is unmapped at the next look.

After the copy it checks the file did not change meanwhile (size, mtime and ctime of the very
fd it copied from), seals the memfd and puts it in every slot that held the file. Clients
answered before the swap find the old handle gone and ask again; mappings made before keep
the file's pages.

Why not copy at once, as fills did: on this machine fresh memory fills at 0.4 GB/s per core
(``benchmarks/fresh_memory.py``), so the ControlNet workload's 3.58 GB take 9 core-seconds, and
that copy beside the user's next run slowed it from 0.82 to 1.02 x plain (``overmind-bench
--scenarios warmup_curve``, run 2, ``OVERMIND_SETTLE_AFTER=0``). The price: with the page cache
emptied between runs back to back, run 2 finds the files gone before any copy could start and
reads them back while it imports (``overmind-bench --scenarios warmup_curve --drop-page-cache``
measures that run 2); tried by hand, leaving the lost files to that client did better than
copying them beside it, or never copying them.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from typing import Callable, Optional

from overmind.server.registry import Registry, still_as_recorded
from overmind.shared.segments.memfd import RESIDENT, Segment, cached_share, hold_pages
from overmind.shared.process.priority import to_idle

logger = logging.getLogger("overmind.server.settle")

__all__ = ["Settler", "CHUNK"]

CHUNK = 32 << 20  # bytes copied between looks at whether a request came
_POLL = 0.5  # seconds between looks for work
READ_BACK_HOLD = 30.0  # seconds a lost file handed to a prefetching client is left to it


def _open_unchanged(record: list) -> int:
    """An fd of the file of ``record`` ([path, size, mtime_ns, ino, dev, ctime_ns]) if the file it
    opened is still that one, as recorded (checked on the fd: no swap between check and use); else -1."""
    try:
        fd = os.open(record[0], os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except (OSError, ValueError):
        return -1
    st = os.fstat(fd)
    if stat.S_ISREG(st.st_mode) and still_as_recorded(st, record):
        return fd
    os.close(fd)
    return -1


def _evicted(fd: int, size: int) -> bool:
    share = cached_share(fd, size)
    return share is not None and share < RESIDENT  # None: the kernel cannot say, so only idleness counts


class Settler:
    """The one thread that settles file segments (Note [Settling file segments])."""

    def __init__(self, registry: Registry, idle_after: Optional[float], stopping: threading.Event,
                 keep_pages: bool = True) -> None:
        self.registry = registry
        self.keep_pages = keep_pages  # OVERMIND_KEEP_FILE_PAGES: Note [File segments stay mapped]
        self.idle_after = idle_after
        self.stopping = stopping
        self._last_request = time.monotonic()
        self.settled = 0  # file segments copied and swapped in
        self.settled_bytes = 0
        self.copying: Optional[tuple[int, int]] = None  # (bytes done, size) of the copy under way
        self._given_up: set = set()  # segments that changed or failed: left to the page cache
        self._read_back: dict = {}  # (dev, ino) -> until when a client is reading it back
        self._mapped: dict = {}  # (dev, ino) -> its mapping: Note [File segments stay mapped]
        # Note [The cache gives way] in overmind.server.pressure: no copy and no held pages while memory
        # is short; a copy only where it leaves room. Set by the server to its Guard's.
        self.pressed: Callable[[], bool] = lambda: False
        self.may_copy: Callable[[int], bool] = lambda size: True
        self._lock = threading.Lock()
        self._settled_from: dict = {}  # (dev, ino) of a settled memfd -> (dev, ino) of the file it copies
        self._unsettled = 0  # settled segments served from their files again
        self._soon: set = set()  # (dev, ino) of file segments to settle at once: settle_soon

    def describe(self) -> dict:
        """The status's ``file_segments``, less their bytes (the registry's)."""
        return {"settled": self.settled, "settled_bytes": self.settled_bytes, "copying": self.copying,
                "unsettled": self._unsettled}

    def settle_soon(self, idents: set) -> None:
        """Settle these file segments ((dev, ino)) first and at once, where ``may_copy`` lets it:
        they were settled before memory was short (overmind.server.pressure)."""
        self._soon = set(idents)  # one assignment: the settler thread reads it without a lock

    def unsettle_one(self, order: list) -> Optional[tuple[tuple[int, int], int]]:
        """Serve the first settled segment of ``order`` ((dev, ino), the cache's least recently used
        first) whose model file is unchanged from that file again, closing the memfd (Note [The cache
        gives way] in overmind.server.pressure): its (dev, ino) as a file segment and the memfd's
        bytes, or None when there is none. The file is opened by the path its loader read and
        checked to be that very file, as it was (ARCHITECTURE.md, invariant 7: A segment is what it
        claims to be); one that changed is left settled (eviction takes it)."""
        for memfd in order:
            with self._lock:
                file = self._settled_from.get(memfd)
            if file is None:
                continue
            record = self.registry.file_record(file)
            fd = _open_unchanged(record) if record is not None else -1  # file_record matched its (dev, ino)
            if fd < 0:
                with self._lock:
                    self._settled_from.pop(memfd, None)
                continue
            try:
                changed = self.registry.replace_segment(memfd, fd, record[1], is_file=True)
            finally:
                os.close(fd)
            with self._lock:
                self._settled_from.pop(memfd, None)
            if changed:
                self._unsettled += 1
                logger.info("serving file segment %d:%d from its file again (memory is short)", *file)
                return file, record[1]  # the memfd held the file's bytes
        return None

    def touch(self) -> None:
        self._last_request = time.monotonic()

    def handed_to_prefetch(self, idents: list, importing: bool) -> None:
        """A client was just handed these segments to prefetch. One that still imports reads back
        any it finds lost (Note [Reading back a lost file] in overmind.client.prefetch), so a copy
        of those here would only slow it down; one that does not (a forked run) gains little from
        its own read, and the next run gains from the copy (Note [Settling file segments])."""
        now, handed = time.monotonic(), set(idents)
        held = {ident: until for ident, until in self._read_back.items() if until > now and ident not in handed}
        if importing:
            held.update(dict.fromkeys(handed, now + READ_BACK_HOLD))
        self._read_back = held  # one assignment: the settler thread reads it without a lock

    def _held(self, ident: tuple[int, int]) -> bool:
        return self._read_back.get(ident, 0.0) > time.monotonic()

    def _quiet(self) -> bool:
        return self.idle_after is not None and time.monotonic() - self._last_request >= self.idle_after

    def _wait_idle(self) -> bool:
        """Block until no request came for ``idle_after`` seconds; False once the server stops."""
        assert self.idle_after is not None
        while not self.stopping.is_set():
            if self._quiet():
                return True
            self.stopping.wait(max(self.idle_after - (time.monotonic() - self._last_request), 0.05))
        return False

    def run(self) -> None:
        try:
            to_idle(threading.get_native_id())
        except OSError:
            pass  # normal priority: still only when idle or evicted
        while not self.stopping.wait(_POLL):
            segments = self.registry.file_segments(skip=self._given_up)
            try:
                self._keep_mapped(segments)
                # settle_after None: never a second copy, not even of a file the page cache lost
                evicted = [s for s in segments if not self._held(s[0]) and _evicted(s[2], s[1])] \
                    if self.idle_after is not None else []
                soon = [s for s in segments if s[0] in self._soon]
                chosen = soon[0] if soon else evicted[0] if evicted else \
                    segments[0] if segments and self._quiet() else None
                if chosen is not None and (self.pressed() or not self.may_copy(chosen[1])):
                    chosen = None  # Note [The cache gives way] in overmind.server.pressure
                if chosen is not None:
                    logger.info("copying file segment %d:%d into sealed memory: %s", *chosen[0],
                                "it was before memory was short" if soon else
                                "the page cache lost it" if evicted else "the server is idle")
                    self._settle_one(*chosen, pause=not (evicted or soon))
            finally:
                for _, _, fd in segments:
                    os.close(fd)

    def _keep_mapped(self, segments: list) -> None:
        """Note [File segments stay mapped]: map those the page cache holds, unmap those gone."""
        current = {ident for ident, _, _ in segments} if not self.pressed() else set()
        for ident in [i for i in self._mapped if i not in current]:
            self._mapped.pop(ident).close()
        for ident, size, fd in segments if self.keep_pages and not self.pressed() else ():
            if ident not in self._mapped and not _evicted(fd, size):
                started = time.monotonic()
                mapping = hold_pages(fd, size)
                if mapping is not None:
                    self._mapped[ident] = mapping
                    logger.debug("holding the pages of file segment %d:%d (%d MB) after %.2fs", *ident, size >> 20,
                                 time.monotonic() - started)

    def _settle_one(self, ident: tuple[int, int], size: int, source: int, pause: bool) -> None:
        try:
            if not self._settle(ident, size, source, pause):
                self._given_up.add(ident)
        except Exception:  # a file that cannot be copied stays served from the page cache
            logger.exception("copying file segment %d:%d into memory failed", *ident)
            self._given_up.add(ident)
        finally:
            self.copying = None

    def _settle(self, ident: tuple[int, int], size: int, source: int, pause: bool) -> bool:
        """Copy, check, seal and swap in one file segment; False if the file changed meanwhile."""
        before = os.fstat(source)
        started = time.monotonic()
        with Segment.create(f"settled.{ident[1]}", size) as segment:
            done = 0
            while done < size:
                if self.stopping.is_set() or (pause and not self._wait_idle()):
                    return True  # stopping
                if self.pressed():
                    logger.info("copy of file segment %d:%d stopped: memory is short", *ident)
                    return True  # the memfd goes with this block; the file stays served as it was
                if not pause and self._held(ident):
                    return True  # a client reads it back now: the copy waits for a quiet time
                n = min(CHUNK, size - done)
                segment.copy_from(source, done, n)
                done += n
                self.copying = (done, size)
            after = os.fstat(source)
            if (after.st_size, after.st_mtime_ns, after.st_ctime_ns) != (before.st_size, before.st_mtime_ns,
                                                                         before.st_ctime_ns):
                logger.info("file segment %d:%d changed while copied; its entries will be stale", *ident)
                return False
            segment.finish(size)  # sealed; at whole huge pages where they are possible
            entries = self.registry.replace_segment(ident, segment.fd, segment.size)
            st = os.fstat(segment.fd)
            with self._lock:
                self._settled_from[(st.st_dev, st.st_ino)] = ident
            segment.collapse_to_huge_pages()  # Note [Huge pages for segments] in overmind.shared.segments.memfd
        self.settled += 1
        self.settled_bytes += size
        logger.info("settled file segment %d:%d (%d bytes) into sealed memory for %d entries in %.1fs",
                    ident[0], ident[1], size, entries, time.monotonic() - started)
        return True
