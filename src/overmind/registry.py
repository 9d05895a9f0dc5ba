"""The server's cache entries, their memory accounting and budget. Standard library only.

    registry = Registry(budget=parse_size("40G"))
    evicted = registry.add(entry)        # least recently used entries go first
    registry.get(key)                    # counts a hit

Note [Memory is counted per segment]
An entry's slots are fds of sealed memfds; the same segment can sit in several entries
(an entry that references another's storages holds ``dup``\\ s of its fds). Memory is
therefore counted per distinct segment (device, inode), once however many entries hold
it; an entry *owns* the segments no other entry holds and *shares* the rest. Evicting
an entry only closes its fds (Note [Server owns segment fds] in overmind.server): the
kernel frees a segment when its last fd and last client mapping are gone.

Note [Content index]
Each entry lists the contents its loader hashed (Note [Stored once by content] in
overmind.reductions) as ``[digest, nbytes, slot, offset]``. :meth:`Registry.content_index`
turns them into regions of live segments, named by (device, inode) and by an entry that
holds the segment, so a loader can ask that entry for the fd. The index is built per
request from the entries themselves: nothing to keep consistent on eviction.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

logger = logging.getLogger("overmind.server.registry")

__all__ = ["CacheEntry", "Registry", "TooLarge", "parse_size", "default_budget", "memory_total"]


class TooLarge(Exception):
    """An entry that alone exceeds the whole memory budget."""


def memory_total() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise OSError("MemTotal missing from /proc/meminfo")


DEFAULT_BUDGET_SHARE = 0.5  # of RAM: room for the models, and for the processes that use them


def default_budget() -> int:
    return int(memory_total() * DEFAULT_BUDGET_SHARE)


_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """``40G``, ``512MB``, ``1.5T``, ``60%`` (of RAM) or plain bytes."""
    raw = str(text).strip().upper()
    if raw.endswith("%"):
        share = float(raw[:-1])
        if not 0 < share <= 100:
            raise ValueError(f"memory share {text!r} must be in (0, 100]%")
        return int(memory_total() * share / 100)
    match = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([KMGT]?)(I?B)?", raw)
    if not match:
        raise ValueError(f"cannot read {text!r} as a size: use 40G, 512M, 60% or a number of bytes")
    value = int(float(match.group(1)) * _UNITS[match.group(2)])
    if value <= 0:
        raise ValueError(f"size {text!r} must be positive")
    return value


@dataclass
class CacheEntry:
    key: str
    target: str
    description: str
    skeleton: bytes
    slots: list  # per segment slot: [fd, size] or None; see Note [Server owns segment fds]
    nbytes: int  # bytes this entry's loader wrote
    refs: list  # keys of entries whose segments this one also maps
    meta: dict
    created: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.time)
    hits: int = 0
    contents: list = field(default_factory=list)  # [[digest hex, nbytes, slot, offset]]: Note [Content index]
    segments: list = field(default_factory=list)  # [(dev, ino, size)] of live slots: Note [Memory is counted per segment]
    slot_ids: list = field(default_factory=list)  # (dev, ino) per slot, None for an empty slot

    def __post_init__(self) -> None:
        self.contents = [c for c in self.contents if isinstance(c, list) and len(c) == 4 and isinstance(c[0], str)
                         and all(isinstance(v, int) for v in c[1:])]
        for slot in self.slots:
            if slot is None:
                self.slot_ids.append(None)
                continue
            st = os.fstat(slot[0])
            self.segments.append((st.st_dev, st.st_ino, st.st_size))
            self.slot_ids.append((st.st_dev, st.st_ino))

    def close(self) -> None:
        for slot in self.slots:
            if slot is not None:
                try:
                    os.close(slot[0])
                except OSError:
                    pass
        self.slots = [None for _ in self.slots]

    def fresh(self) -> bool:
        """Do the files the loader read still have the size, mtime, inode and device it saw?"""
        for path, size, mtime_ns, ino, dev in self.meta.get("files", ()):
            try:
                st = os.stat(path)
            except OSError:
                return False
            if (st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev) != (size, mtime_ns, ino, dev):
                return False
        return True


class Registry:
    """Entries by key, LRU under a memory budget, with single-flight bookkeeping."""

    def __init__(self, budget: Optional[int] = None) -> None:
        self.lock = threading.Lock()
        self.budget = budget if budget is not None else default_budget()
        self.entries: dict[str, CacheEntry] = {}
        self.flights: dict = {}  # key -> overmind.server.Flight
        self.failures: dict = {}  # key -> (when, error): not retried for a while
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.stale = 0  # hits refused because a file the entry was loaded from changed

    def get(self, key: str) -> Optional[CacheEntry]:
        """The entry for ``key`` (a hit), or None. An entry whose files changed since it was
        loaded (Note [Observed files] in overmind.loader) is evicted and counted as stale."""
        with self.lock:
            entry = self.entries.get(key)
            if entry is None:
                return None
            if entry.fresh():
                entry.hits += 1
                entry.last_used = time.time()
                self.hits += 1
                return entry
            del self.entries[key]
            self.stale += 1
            self.evictions += 1
        logger.info("stale %s: a file it read changed; loading again", key[:16])
        entry.close()
        return None

    def _holders(self) -> dict:
        holders: dict = {}
        for entry in self.entries.values():
            for dev, ino, size in entry.segments:
                holders.setdefault((dev, ino), [size, set()])[1].add(entry.key)
        return holders

    def used(self) -> int:
        with self.lock:
            return sum(size for size, _ in self._holders().values())

    def add(self, entry: CacheEntry) -> list[str]:
        """Insert ``entry``, evicting least recently used entries to stay within the budget.

        Raises TooLarge (leaving the registry as it was) if the entry's own new bytes
        exceed the whole budget.
        """
        with self.lock:
            holders = self._holders()
            new_bytes = sum(size for dev, ino, size in entry.segments if (dev, ino) not in holders)
            if new_bytes > self.budget:
                raise TooLarge(f"{new_bytes} bytes is more than the whole memory budget of {self.budget} bytes")
            old = self.entries.pop(entry.key, None)
            self.entries[entry.key] = entry
            victims = []
            while sum(size for size, _ in self._holders().values()) > self.budget:
                candidates = [e for e in self.entries.values() if e is not entry]
                if not candidates:
                    break
                victim = min(candidates, key=lambda e: e.last_used)
                victims.append(self.entries.pop(victim.key))
            self.evictions += len(victims)
        if old is not None:
            old.close()
        for victim in victims:
            victim.close()
        return [v.key for v in victims]

    def evict(self, keys: list[str]) -> list[str]:
        with self.lock:
            dropped = [self.entries.pop(k) for k in keys if k in self.entries]
            self.evictions += len(dropped)
        for entry in dropped:
            entry.close()
        return [e.key for e in dropped]

    def match(self, prefix: str) -> list[str]:
        with self.lock:
            if prefix in self.entries:
                return [prefix]
            return [k for k in self.entries if k.startswith(prefix)]

    def keys(self) -> list[str]:
        with self.lock:
            return list(self.entries)

    def content_index(self) -> dict:
        """Regions of live segments by content, for loaders: Note [Content index]."""
        with self.lock:
            keys: list[str] = []
            regions: list[list] = []
            seen: set = set()
            for entry in sorted(self.entries.values(), key=lambda e: e.last_used, reverse=True):
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
            return {"keys": keys, "regions": regions}

    def summaries(self) -> list[dict]:
        """Per entry: bytes owned and shared (Note [Memory is counted per segment]), hits, last use."""
        with self.lock:
            holders = self._holders()
            out = []
            for e in self.entries.values():
                owned = sum(size for dev, ino, size in e.segments if len(holders[(dev, ino)][1]) == 1)
                shared = sum(size for dev, ino, size in e.segments if len(holders[(dev, ino)][1]) > 1)
                out.append({
                    "key": e.key, "target": e.target, "description": e.description, "bytes": owned + shared,
                    "bytes_owned": owned, "bytes_shared": shared, "skeleton_bytes": len(e.skeleton),
                    "segments": len(e.segments), "hits": e.hits, "created": e.created, "last_used": e.last_used,
                    "refs": e.refs, "meta": e.meta,
                })
            return out
