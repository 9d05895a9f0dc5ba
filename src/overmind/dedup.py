"""What sealed segments already hold: the loader's side of storing each content once.

    store = SegmentContents(connect)     # connect() -> an overmind.client.Connection
    packed = pack(model, store=store)    # overmind.reductions asks store.find(digest, nbytes)
    store.fds, store.holders             # sent with the job's result, after its own segments
    store.close()

See Note [Stored once by content] in overmind.reductions and Note [Content index] in
overmind.registry.

Note [Found regions are checked]
The index comes from the server and names regions by inode; before a region replaces a
copy, its bytes are hashed again here, from a mapping of the sealed segment itself. A
stale index, a reused inode number or a bug then costs a copy, never a wrong weight, and
no hash is ever taken over memory a client can write.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
from typing import Callable, Optional

import xxhash

from overmind import protocol as P
from overmind.memfd import Segment

logger = logging.getLogger(__name__)

__all__ = ["SegmentContents", "MAX_SEGMENTS"]

# A job's result carries its own segments and these in one message (protocol.MAX_FDS).
MAX_SEGMENTS = P.MAX_FDS - 16


class SegmentContents:
    """A :class:`overmind.reductions.ContentStore` over the server's content index."""

    def __init__(self, connect: Callable[[], "object"]) -> None:
        self._connect = connect
        self._index: Optional[dict[tuple[bytes, int], list[tuple[int, int, int, int]]]] = None
        self._keys: list[str] = []
        self.fds: list[int] = []  # external segments, in the store's numbering
        self.sizes: list[int] = []
        self.holders: list[str] = []  # entries whose segments these are
        self._numbers: dict[tuple[int, int], int] = {}
        self._unavailable: set[tuple[int, int]] = set()
        self._views: list[mmap.mmap] = []
        self._used: set[tuple[int, int]] = set()

    def _load_index(self) -> dict:
        if self._index is None:
            self._index = {}
            try:
                message, blob, fds = self._connect().request(P.GetContents())
                for fd in fds:
                    os.close(fd)
                P.expect(message, P.Contents, "for the content index")
                index = json.loads(blob)
                self._keys = [str(k) for k in index["keys"]]
                for digest, nbytes, holder, dev, ino, offset in index["regions"]:
                    self._index.setdefault((bytes.fromhex(digest), nbytes), []).append((holder, dev, ino, offset))
            except Exception as err:  # no index: every storage is written, as before dedup existed
                logger.warning("content index unavailable (%s); storing this load's bytes without dedup", err)
                self._index = {}
        return self._index

    def find(self, digest: bytes, nbytes: int) -> Optional[tuple[int, int]]:
        for holder, dev, ino, offset in self._load_index().get((digest, nbytes), ()):
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

    def _segment(self, holder: int, dev: int, ino: int) -> Optional[int]:
        """This store's number for segment (dev, ino), fetching its fd from the holding entry."""
        number = self._numbers.get((dev, ino))
        if number is not None or (dev, ino) in self._unavailable:
            return number
        if len(self.fds) >= MAX_SEGMENTS or not 0 <= holder < len(self._keys):
            self._unavailable.add((dev, ino))
            return None
        key = self._keys[holder]
        try:
            message, _, fds = self._connect().request(P.GetFds(key))
        except (OSError, P.ProtocolError) as err:
            logger.debug("cannot fetch segments of %s: %s", key[:16], err)
            self._unavailable.add((dev, ino))
            return None
        chosen = None
        try:
            if isinstance(message, P.Fds) and len(message.sizes) == len(fds):
                for fd, size in zip(fds, message.sizes):
                    st = os.fstat(fd)
                    if (st.st_dev, st.st_ino) == (dev, ino) and chosen is None:
                        # refuses unsealed memory and any other inode: DESIGN invariant 7
                        segment = Segment.from_fd(fd, size, f"{key[:12]}.shared", identity=(dev, ino))
                        chosen = (fd, size, segment.map_private())
        except (OSError, ValueError) as err:
            logger.warning("segment of %s refused: %s", key[:16], err)
            chosen = None
        finally:
            for fd in fds:
                if chosen is None or fd != chosen[0]:
                    os.close(fd)
        if chosen is None:  # evicted since the index was sent
            self._unavailable.add((dev, ino))
            return None
        number = len(self.fds)
        self.fds.append(chosen[0])
        self.sizes.append(chosen[1])
        self._views.append(chosen[2])
        self._numbers[(dev, ino)] = number
        if key not in self.holders:
            self.holders.append(key)
        return number

    def close(self) -> None:
        for view in self._views:
            view.close()
        for fd in self.fds:
            os.close(fd)
        self._views, self.fds = [], []
