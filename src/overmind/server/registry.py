"""The server's cache entries, their memory accounting and budget. Standard library only.

    registry = Registry(budget=parse_size("40G"))
    evicted = registry.add(entry)        # least recently used entries go first
    registry.get(key)                    # counts a hit

Loads in flight (single flight) and the failures they leave are overmind.server.fills's.

Note [Memory is counted per segment]
An entry's slots are fds of sealed memfds; the same segment can sit in several entries
(an entry that references another's storages holds ``dup``\\ s of its fds). Memory is
therefore counted per distinct segment (device, inode), once however many entries hold
it; an entry *owns* the segments no other entry holds and *shares* the rest. Evicting
an entry only closes its fds (Note [Server owns segment fds] in overmind.server.daemon): the
kernel frees a segment when its last fd and last client mapping are gone.

Note [Content index]
Each entry lists the contents its loader hashed (Note [Stored once by content] in
overmind.shared.segments.reductions) as ``[digest, nbytes, slot, offset]``. :meth:`Registry.content_index`
turns them into regions of live segments, named by (device, inode) and by an entry that
holds the segment, with that entry's segment handles, so a loader can open the segment
through ``/proc/<server>/fd`` and check it is that file. The index is built per cold load
from the entries themselves and handed to its loader with the job: nothing to keep
consistent on eviction (a segment evicted meanwhile cannot be opened: its bytes are copied).
The records of storages left in their model files may come after the entry (Note [Hashing a
file's storages after the answer] in overmind.warm.loader).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

from overmind.shared import protocol as P
from overmind.shared.settings.config import memory_total
from overmind.shared.segments.memfd import is_sealed_memfd

logger = logging.getLogger("overmind.server.registry")

__all__ = ["CacheEntry", "Registry", "Reply", "TooLarge", "default_budget", "files_unchanged", "still_as_recorded"]


class TooLarge(Exception):
    """An entry that alone exceeds the whole memory budget."""


MAX_CONTENTS = 16000  # contents records kept per entry (a loader sends at most 8000 with its answer)
EVICT_WORTH = 16 << 20  # sealed bytes an entry frees for it to be evicted first under pressure
DEFAULT_BUDGET_SHARE = 0.5  # of memory_total() (RAM or the cgroup limit): room for the models, and for the processes that use them


def default_budget(total: Optional[int] = None) -> int:
    """A share of ``total``, by default the memory the server may use (RAM or the cgroup limit over it)."""
    return int((memory_total() if total is None else total) * DEFAULT_BUDGET_SHARE)


@dataclass
class CacheEntry:
    key: str
    target: str
    description: str
    skeleton: bytes
    slots: list  # per segment slot: [fd, size] or None; see Note [Server owns segment fds]
    nbytes: int  # bytes this entry's loader wrote
    refs: list  # keys of entries whose segments this one also maps
    meta: P.LoadMeta  # what its loader said of it, validated once (LoadMeta.from_wire)
    created: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.time)
    hits: int = 0
    contents: list = field(default_factory=list)  # [[digest hex, nbytes, slot, offset]]: Note [Content index]
    segments: list = field(default_factory=list)  # [(dev, ino, size)] of live slots: Note [Memory is counted per segment]
    slot_ids: list = field(default_factory=list)  # (dev, ino) per slot, None for an empty slot
    files: set = field(default_factory=set)  # (dev, ino) of slots that are model files: Note [File-backed segments]

    def __post_init__(self) -> None:
        self.contents = _valid_contents(self.contents)
        for slot in self.slots:
            if slot is None:
                self.slot_ids.append(None)
                continue
            st = os.fstat(slot[0])
            self.segments.append((st.st_dev, st.st_ino, st.st_size))
            self.slot_ids.append((st.st_dev, st.st_ino))
            if not is_sealed_memfd(slot[0]):  # Note [File-backed segments] in overmind.shared.segments.memfd
                self.files.add((st.st_dev, st.st_ino))

    def handles(self) -> list:
        """Per slot ``[server fd, size, st_dev, st_ino]`` or None: what a client needs to open each
        segment and to check it opened that segment (Note [A segment is opened by identity] in
        overmind.client.connection). Called under the registry's lock, so no eviction closes an fd meanwhile."""
        return [None if slot is None else [slot[0], slot[1], *ident] for slot, ident in zip(self.slots, self.slot_ids)]

    def close(self) -> None:
        for slot in self.slots:
            if slot is not None:
                try:
                    os.close(slot[0])
                except OSError:
                    pass
        self.slots = [None for _ in self.slots]

    def fresh(self) -> bool:
        """Do the files the loader read still have the size, mtime, inode, device and ctime it
        saw? The ctime catches a rewrite in place with the mtime put back (Note [What a
        fingerprint cannot see] in overmind.shared.calls.keys). A record of another shape is from a loader
        that is not ours: stale, so the call loads again rather than trusting it."""
        return files_unchanged(self.meta.files)


def _valid_contents(records) -> list:
    """The well-formed ``[digest hex, nbytes, slot, offset]`` records of a loader's list, at most
    MAX_CONTENTS of them (a loader's word is bounded like any frame's)."""
    if not isinstance(records, list):
        return []
    return [c for c in records if isinstance(c, list) and len(c) == 4 and isinstance(c[0], str)
            and all(type(v) is int and v >= 0 for v in c[1:])][:MAX_CONTENTS]


def files_unchanged(records) -> bool:
    """Do the files of ``records`` (``LoadMeta.files``: [path, size, mtime_ns, ino, dev,
    ctime_ns] each) still have that size, mtime, inode, device and ctime? A record of another
    shape is not ours: False. Also what a restore checks before a refill (overmind.server.restore)."""
    for record in records:
        if not isinstance(record, list) or len(record) != 6 or not isinstance(record[0], str):
            return False
        try:
            st = os.stat(record[0])
        except (OSError, ValueError):  # ValueError: a NUL in the path
            return False
        if not still_as_recorded(st, record):
            return False
    return True


def still_as_recorded(st: os.stat_result, record: list) -> bool:
    """Has the file of ``st`` the size, mtime, inode, device and ctime of ``record`` ([path, size,
    mtime_ns, ino, dev, ctime_ns], as ``LoadMeta.files`` holds it)?"""
    _, size, mtime_ns, ino, dev, ctime_ns = record
    return (st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev, st.st_ctime_ns) == (size, mtime_ns, ino, dev, ctime_ns)


@dataclass(frozen=True)
class Reply:
    """What a hit sends, copied under the registry's lock: the entry may be evicted right after."""

    key: str
    handles: list
    nbytes: int
    meta: P.LoadMeta
    skeleton: bytes


class Registry:
    """Entries by key, LRU under a memory budget.

    Owns every piece of entry state; its lock is its own (no caller takes it).
    """

    def __init__(self, budget: Optional[int] = None) -> None:
        self._lock = threading.Lock()
        self.budget = budget if budget is not None else default_budget()
        self._entries: dict[str, CacheEntry] = {}
        self.hits = 0
        self.evictions = 0
        self.stale = 0  # hits refused because a file the entry was loaded from changed

    # -- lookups ---------------------------------------------------------------------------

    def _fresh_entry(self, key: str) -> Optional[CacheEntry]:
        """The entry for ``key`` if its files are unchanged; a stale one is evicted. The files
        are stat-ed outside the lock: a slow filesystem must not stall every other request."""
        with self._lock:
            entry = self._entries.get(key)
        if entry is None:
            return None
        if entry.fresh():
            return entry
        with self._lock:
            if self._entries.get(key) is not entry:
                return self._entries.get(key)  # replaced meanwhile by a new load: that one is fresh
            del self._entries[key]
            self.stale += 1
            self.evictions += 1
        logger.info("stale %s: a file it read changed; loading again", key[:16])
        entry.close()
        return None

    def hit(self, entry: CacheEntry, count: bool = True) -> Optional[Reply]:
        """Count a hit (``count``) and copy what the reply needs; None if ``entry`` left the
        registry (evicted already). A request that waited for another's fill counts as a hit,
        so hits + misses + plain loads (overmind.server.fills) = a client's loads."""
        with self._lock:
            if self._entries.get(entry.key) is not entry:
                return None
            if count:
                entry.hits += 1
                self.hits += 1
            entry.last_used = time.time()
            return Reply(entry.key, entry.handles(), entry.nbytes, entry.meta, entry.skeleton)

    def get(self, key: str, count: bool = True) -> Optional[Reply]:
        """A hit for ``key``, or None (Note [Observed files] in overmind.warm.loader). ``count``:
        False for a restore's refill (overmind.server.restore), which is no client's hit."""
        entry = self._fresh_entry(key)
        return None if entry is None else self.hit(entry, count)

    def entry(self, key: str) -> Optional[CacheEntry]:
        """``key``'s entry as it is, its files not checked (one a fill filed a moment ago)."""
        with self._lock:
            return self._entries.get(key)

    def peek(self, key: str) -> Optional[list]:
        """The segment handles of ``key``'s fresh entry, counting no hit (Note [Prefetch] in
        overmind.client.prefetch: what a program is about to load)."""
        entry = self._fresh_entry(key)
        reply = None if entry is None else self.hit(entry, count=False)
        return None if reply is None else reply.handles

    def pinned(self, key: str) -> Optional[tuple[Reply, list[int]]]:
        """A hit for ``key`` with duplicates of its live segments' fds, in slot order (the caller
        closes them): what a loader gets of an entry its call refers to (Note [The loader is
        handed its references] in overmind.server.loaders). None if there is no fresh entry."""
        entry = self._fresh_entry(key)
        if entry is None:
            return None
        with self._lock:
            if self._entries.get(key) is not entry:
                return None
            entry.last_used = time.time()  # a loader's reference is no client's hit
            reply = Reply(entry.key, entry.handles(), entry.nbytes, entry.meta, entry.skeleton)
            return reply, [os.dup(slot[0]) for slot in entry.slots if slot is not None]

    def segment_fds(self, key: str) -> Optional[tuple[list[int], list[int]]]:
        """(sizes, fds) of ``key``'s live segments; the fds are duplicates the caller must close,
        taken under the lock so none of them can be another segment's by the time it is sent."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            live = [s for s in entry.slots if s is not None]
            return [s[1] for s in live], [os.dup(s[0]) for s in live]

    def file_segments(self, skip: set = frozenset()) -> list[tuple[tuple[int, int], int, int]]:
        """``((dev, ino), size, fd duplicate)`` of every file segment, the most recently used
        entry's first (Note [Settling file segments] in overmind.server.settle). The caller
        closes the fds."""
        found: dict = {}
        with self._lock:
            for entry in sorted(self._entries.values(), key=lambda e: e.last_used, reverse=True):
                for slot, ident in zip(entry.slots, entry.slot_ids):
                    if slot is not None and ident in entry.files and ident not in skip and ident not in found:
                        found[ident] = (ident, slot[1], os.dup(slot[0]))
        return list(found.values())

    def replace_segment(self, ident: tuple[int, int], fd: int, size: int, is_file: bool = False) -> int:
        """Every slot that holds segment ``ident`` holds a duplicate of ``fd`` (the same bytes: a
        sealed memfd of ``size`` bytes, or with ``is_file`` the model file they were copied from)
        from now on; the fds it held are closed. Returns how many entries changed. A client that
        was answered with the old handles finds them gone and asks again (SegmentChanged)."""
        st = os.fstat(fd)
        new = (st.st_dev, st.st_ino)
        replaced, changed = [], 0
        with self._lock:
            for entry in self._entries.values():
                if ident not in entry.slot_ids:
                    continue
                for i, slot in enumerate(entry.slots):
                    if slot is not None and entry.slot_ids[i] == ident:
                        replaced.append(slot[0])
                        entry.slots[i] = [os.dup(fd), size]
                        entry.slot_ids[i] = new
                entry.segments = [(st.st_dev, st.st_ino, size) if (d, n) == ident else (d, n, sz)
                                  for d, n, sz in entry.segments]
                entry.files.discard(ident)
                if is_file:
                    entry.files.add(new)
                changed += 1
        for old in replaced:
            os.close(old)
        return changed

    def file_record(self, ident: tuple[int, int]) -> Optional[list]:
        """The ``LoadMeta.files`` record ([path, size, mtime_ns, ino, dev, ctime_ns]) of the model
        file ``ident`` (dev, ino) as a loader that read it saw it, or None."""
        with self._lock:
            for entry in self._entries.values():
                for record in entry.meta.files:
                    if isinstance(record, list) and len(record) == 6 and (record[4], record[3]) == ident:
                        return list(record)
        return None

    def segments_least_recent_first(self) -> list[tuple[int, int]]:
        """(dev, ino) of every live segment, those of the least recently used entries first: the order
        in which the cache lets go under memory pressure (overmind.server.pressure)."""
        with self._lock:
            order: dict = {}
            for entry in sorted(self._entries.values(), key=lambda e: e.last_used):
                for ident in entry.slot_ids:
                    if ident is not None:
                        order.setdefault(ident, None)
            return list(order)

    def evict_least_recent(self) -> Optional[tuple[str, str, int]]:
        """Evict the least recently used entry that holds a sealed memfd: its (key, description, sealed
        bytes it alone held), or None when there is none (overmind.server.pressure). One served from
        model files alone holds only page cache, which the kernel reclaims itself: it stays a hit."""
        with self._lock:
            holders = self._holders()
            sealed = {e.key: sum(size for dev, ino, size in e.segments if (dev, ino) not in e.files
                                 and len(holders[(dev, ino)][1]) == 1) for e in self._entries.values()}
            holding = [e for e in self._entries.values() if any((d, n) not in e.files for d, n, _ in e.segments)]
            if not holding:
                return None
            # Least recently used first, but an entry that would free little of it (its file's buffers,
            # memfds another entry shares) goes only after those that free EVICT_WORTH each.
            victim = min(holding, key=lambda e: (sealed[e.key] < EVICT_WORTH, e.last_used))
            owned = sealed[victim.key]
            del self._entries[victim.key]
            self.evictions += 1
        victim.close()
        return victim.key, victim.description, owned

    def file_bytes(self) -> int:
        """Bytes of the distinct file segments still served from the page cache."""
        with self._lock:
            files = set().union(*(entry.files for entry in self._entries.values()))
            return sum(size for ident, (size, _) in self._holders().items() if ident in files)

    # -- membership ------------------------------------------------------------------------

    def _holders(self) -> dict:
        holders: dict = {}
        for entry in self._entries.values():
            for dev, ino, size in entry.segments:
                holders.setdefault((dev, ino), [size, set()])[1].add(entry.key)
        return holders

    def used(self) -> int:
        with self._lock:
            return sum(size for size, _ in self._holders().values())

    def add(self, entry: CacheEntry) -> list[str]:
        """Insert ``entry``, evicting least recently used entries to stay within the budget.

        Raises TooLarge (leaving the registry as it was) if the entry's own new bytes
        exceed the whole budget.
        """
        with self._lock:
            holders = self._holders()
            new_bytes = sum(size for dev, ino, size in entry.segments if (dev, ino) not in holders)
            if new_bytes > self.budget:
                raise TooLarge(f"{new_bytes} bytes is more than the whole memory budget of {self.budget} bytes")
            old = self._entries.pop(entry.key, None)
            self._entries[entry.key] = entry
            victims = []
            while sum(size for size, _ in self._holders().values()) > self.budget:
                candidates = [e for e in self._entries.values() if e is not entry]
                if not candidates:
                    break
                victim = min(candidates, key=lambda e: e.last_used)
                victims.append(self._entries.pop(victim.key))
            self.evictions += len(victims)
        if old is not None:
            old.close()
        for victim in victims:
            victim.close()
        return [v.key for v in victims]

    def evict(self, keys: list[str]) -> list[str]:
        with self._lock:
            dropped = [self._entries.pop(k) for k in keys if k in self._entries]
            self.evictions += len(dropped)
        for entry in dropped:
            entry.close()
        return [e.key for e in dropped]

    def clear(self) -> None:
        self.evict(self.keys())

    def match(self, prefix: str) -> list[str]:
        with self._lock:
            if prefix in self._entries:
                return [prefix]
            return [k for k in self._entries if k.startswith(prefix)]

    def recency(self) -> dict[str, float]:
        """key -> when it was last used, for every entry (what overmind.server.state keeps)."""
        with self._lock:
            return {key: entry.last_used for key, entry in self._entries.items()}

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._entries)

    def counters(self) -> dict:
        with self._lock:
            return {"entries": len(self._entries), "hits": self.hits, "evictions": self.evictions,
                    "stale_misses": self.stale, "budget": self.budget}

    def add_contents(self, entry: CacheEntry, records) -> int:
        """Contents records its loader sent after its answer (Note [Hashing a file's storages after
        the answer] in overmind.warm.loader), for ``entry`` if it is still the one filed; how many were kept."""
        with self._lock:
            if self._entries.get(entry.key) is not entry:
                return 0
            valid = _valid_contents(records)[:MAX_CONTENTS - len(entry.contents)]
            entry.contents.extend(valid)
            return len(valid)

    def content_index(self) -> dict:
        """Regions of live segments by content, for loaders: Note [Content index]."""
        with self._lock:
            keys: list[str] = []
            handles: list[list] = []
            regions: list[list] = []
            seen: set = set()
            for entry in sorted(self._entries.values(), key=lambda e: e.last_used, reverse=True):
                number, added = len(keys), False
                for digest, nbytes, slot, offset in entry.contents:
                    if not 0 <= slot < len(entry.slot_ids) or entry.slot_ids[slot] is None:
                        continue
                    dev, ino = entry.slot_ids[slot]
                    if (dev, ino, offset) not in seen:
                        seen.add((dev, ino, offset))
                        regions.append([digest, nbytes, number, dev, ino, offset])
                        added = True
                if added:
                    keys.append(entry.key)
                    handles.append(entry.handles())
            return {"keys": keys, "handles": handles, "regions": regions}

    def summaries(self) -> list[dict]:
        """Per entry: bytes owned and shared (Note [Memory is counted per segment]), hits, last use."""
        with self._lock:
            holders = self._holders()
            out = []
            for e in self._entries.values():
                owned = sum(size for dev, ino, size in e.segments if len(holders[(dev, ino)][1]) == 1)
                shared = sum(size for dev, ino, size in e.segments if len(holders[(dev, ino)][1]) > 1)
                out.append({
                    "key": e.key, "target": e.target, "description": e.description, "bytes": owned + shared,
                    "bytes_owned": owned, "bytes_shared": shared, "skeleton_bytes": len(e.skeleton),
                    "segments": len(e.segments), "hits": e.hits, "created": e.created, "last_used": e.last_used,
                    "refs": e.refs, "meta": e.meta.to_dict(),
                })
            return out

