"""What sealed segments already hold: the loader's side of storing each content once.

    store = SegmentContents(index)       # the server's content index, handed over with the job
    packed = pack(model, store=store)    # overmind.shared.segments.reductions asks store.find(digest, nbytes)
    store.fds, store.holders             # sent with the job's result, after its own segments
    store.close()

See Note [Stored once by content] in overmind.shared.segments.reductions and Note [Content index] in
overmind.server.registry.

Note [Found regions are checked]
The index comes from the server and names regions by inode; a segment is opened through
``/proc/<server>/fd/<n>`` and refused unless it is that very inode, a sealed memfd or the model
file the server named (ARCHITECTURE.md, invariant 7: A segment is what it claims to be), and
before a region replaces a copy, its bytes are hashed again here, from a private mapping of
that segment. A stale index, an evicted entry, a reused fd number, a server whose fds cannot
be opened this way, or a bug then costs a copy, never a wrong weight, and no hash is ever
taken over memory a client can write.

Note [Probing before hashing]
A pack may leave a storage in its model file unhashed only when no region of the index could
hold its bytes (Note [Hashing a file's storages after the answer] in overmind.warm.loader).
Regions of the same size are common among models that never share a byte: a ControlNet copies
the UNet's encoder, so the fill of the SD pipeline of ``overmind-bench``'s ControlNet script
found regions of the sizes of 267-354 of its storages in the ControlNets' and the VAE's entries,
and hashed them whole before it could answer: its pack took 0.30-0.34 s, half of it xxh3, while
``overmind run``'s run 2 waited for it. With probes it hashes none there and packs in
0.12-0.14 s (the loader's own timings, both rounds). So ``may_hold`` first compares the
xxh3-64 of the storage's first PROBE bytes with that of each region of its size (each region's
computed once, from the same private mapping ``find`` reads); only a storage whose probe matches
is hashed whole and looked up, and ``find`` still hashes the region again before using it. Equal
bytes have equal probes, so nothing a whole hash would have found is missed; a probe that
matches by chance only costs the hash. Probing opens a region's segment without making it one of
this pack's (no fd is sent and no holder is named for it) until ``find`` uses it.
"""

from __future__ import annotations

import logging
import mmap
import os
from typing import Optional

import xxhash

from overmind.shared import protocol as P
from overmind.shared.segments.memfd import Segment, buffer_at
from overmind.warm.file_backed import MappedFiles

logger = logging.getLogger(__name__)

__all__ = ["SegmentContents", "MAX_SEGMENTS"]

# A job's result carries its own segments and these in one message (protocol.MAX_FDS).
MAX_SEGMENTS = P.MAX_FDS - 16
PROBE = 64 << 10  # bytes compared before a storage is hashed whole: Note [Probing before hashing]


class SegmentContents:
    """A :class:`overmind.shared.segments.reductions.ContentStore` over the server's content index
    (``Registry.content_index`` and the server's pid, as ``LoaderJob`` hands them over)."""

    def __init__(self, index: dict, server_pid: int, files: Optional[MappedFiles] = None) -> None:
        self._server_pid = server_pid
        self._files = files
        self._index: dict[tuple[bytes, int], list[tuple[int, int, int, int]]] = {}
        self._keys: list[str] = []
        self._handles: list[list] = []
        try:
            self._keys = [str(k) for k in index["keys"]]
            self._handles = [list(h) for h in index["handles"]]
            for digest, nbytes, holder, dev, ino, offset in index["regions"]:
                self._index.setdefault((bytes.fromhex(digest), nbytes), []).append((holder, dev, ino, offset))
        except (KeyError, TypeError, ValueError) as err:  # no index: every storage is written, as before dedup
            logger.warning("malformed content index (%s); storing this load's bytes without dedup", err)
            self._index = {}
        self._by_size: dict[int, list[tuple[int, int, int, int]]] = {}
        for (_, nbytes), regions in self._index.items():
            self._by_size.setdefault(nbytes, []).extend(regions)
        self._probes: dict[int, set[int]] = {}  # nbytes -> PROBE digests of the regions of that size
        self._opened: dict[tuple[int, int], tuple[int, int, mmap.mmap]] = {}  # probed, not yet a segment of ours
        self.fds: list[int] = []  # external segments, in the store's numbering
        self.sizes: list[int] = []
        self.holders: list[str] = []  # entries whose segments these are
        self._numbers: dict[tuple[int, int], int] = {}
        self._unavailable: set[tuple[int, int]] = set()
        self._views: list[mmap.mmap] = []
        self._used: set[tuple[int, int]] = set()

    def find(self, digest: bytes, nbytes: int) -> Optional[tuple[int, int]]:
        for holder, dev, ino, offset in self._index.get((digest, nbytes), ()):
            number = self._segment(holder, dev, ino)
            if number is None or (number, offset) in self._used:
                continue
            view = self._views[number]
            if offset + nbytes > len(view):
                continue
            if xxhash.xxh3_128_digest(memoryview(view)[offset:offset + nbytes]) != digest:
                logger.warning("region %d:%d+%d does not hold the indexed bytes; copying instead", ino, offset, nbytes)
                continue
            self._used.add((number, offset))
            return number, offset
        return None

    def may_hold(self, address: int, nbytes: int) -> bool:
        """Note [Probing before hashing]."""
        probes = self._probes.get(nbytes)
        if probes is None:
            probes = self._probes[nbytes] = set()
            for holder, dev, ino, offset in self._by_size.get(nbytes, ()):
                view = self._view(holder, dev, ino)
                if view is not None and offset + nbytes <= len(view):
                    probes.add(xxhash.xxh3_64_intdigest(memoryview(view)[offset:offset + min(nbytes, PROBE)]))
        return bool(probes) and xxhash.xxh3_64_intdigest(buffer_at(address, min(nbytes, PROBE))) in probes

    def in_file(self, address: int, nbytes: int) -> Optional[tuple[int, int]]:
        """Where a storage is a model file's own pages, that file as one more segment of this
        store (Note [File-backed segments] in overmind.shared.segments.memfd)."""
        if self._files is None or len(self.fds) >= MAX_SEGMENTS:
            return None
        found = self._files.locate(address, nbytes)
        if found is None:
            return None
        fd, size, dev, ino, offset = found
        number = self._numbers.get((dev, ino))
        if number is None:
            number = len(self.fds)
            self.fds.append(os.dup(fd))
            self.sizes.append(size)
            self._views.append(mmap.mmap(self.fds[-1], size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ))
            self._numbers[(dev, ino)] = number
        return number, offset

    def _segment(self, holder: int, dev: int, ino: int) -> Optional[int]:
        """This store's number for segment (dev, ino), opened through the holding entry's handle."""
        number = self._numbers.get((dev, ino))
        if number is not None or (dev, ino) in self._unavailable:
            return number
        if len(self.fds) >= MAX_SEGMENTS or not 0 <= holder < min(len(self._keys), len(self._handles)):
            self._unavailable.add((dev, ino))
            return None
        chosen = self._opened.pop((dev, ino), None) or self._open(holder, dev, ino)
        if chosen is None:
            return None
        key = self._keys[holder]
        number = len(self.fds)
        self.fds.append(chosen[0])
        self.sizes.append(chosen[1])
        self._views.append(chosen[2])
        self._numbers[(dev, ino)] = number
        if key not in self.holders:
            self.holders.append(key)
        return number

    def _view(self, holder: int, dev: int, ino: int) -> Optional[mmap.mmap]:
        """A private mapping of segment (dev, ino) to read, without making it one of ours."""
        number = self._numbers.get((dev, ino))
        if number is not None:
            return self._views[number]
        if (dev, ino) in self._unavailable or len(self.fds) + len(self._opened) >= MAX_SEGMENTS:
            return None
        if not 0 <= holder < min(len(self._keys), len(self._handles)):
            return None
        opened = self._opened.get((dev, ino)) or self._open(holder, dev, ino)
        if opened is None:
            return None
        self._opened[(dev, ino)] = opened
        return opened[2]

    def _open(self, holder: int, dev: int, ino: int) -> Optional[tuple[int, int, mmap.mmap]]:
        """(fd, size, private mapping) of segment (dev, ino), opened through the holding entry's handle."""
        key = self._keys[holder]
        handle = next((h for h in self._handles[holder] if isinstance(h, list) and len(h) == 4
                       and (h[2], h[3]) == (dev, ino)), None)
        try:
            if handle is None:
                raise ValueError("not among the holder's segments")
            # refuses unsealed memory and any other inode (ARCHITECTURE.md, invariant 7: A segment is
            # what it claims to be)
            segment = Segment.open_proc(self._server_pid, handle[0], handle[1], f"{key[:12]}.shared",
                                        identity=(dev, ino))
            try:
                return segment.fd, handle[1], segment.map_private()
            except BaseException:
                segment.close()
                raise
        except (OSError, ValueError, TypeError) as err:  # evicted since, /proc refused, unmappable: copy instead
            logger.debug("segment %d:%d of %s not opened: %s", dev, ino, key[:16], err)
            self._unavailable.add((dev, ino))
            return None

    def close(self) -> None:
        for view in self._views:
            view.close()
        for fd in self.fds:
            os.close(fd)
        for fd, _, view in self._opened.values():
            view.close()
            os.close(fd)
        self._views, self.fds, self._opened = [], [], {}
