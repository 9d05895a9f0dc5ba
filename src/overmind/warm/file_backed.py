"""Storages that are a model file's own pages: the loader's side of file-backed segments.

    files = MappedFiles(fingerprints)        # the files the load read, as its key names them
    files.locate(address, nbytes)            # -> (fd, size, dev, ino, offset in the file) or None
    files.close()                            # closes the files' fds

See Note [File-backed segments] in overmind.shared.segments.memfd.

Note [A storage is the file's only where its pages are]
A storage's bytes are the file's bytes at an offset only if (1) its whole range lies in one
mapping of that file, (2) none of its pages was written since (a written page of a
``MAP_PRIVATE`` mapping is an anonymous copy: ``/proc/self/pagemap`` shows it present and not
file-backed, or swapped), and (3) the file is one the load's key fingerprints, unchanged since
the fingerprint was taken (same inode, size, mtime and ctime), so a later change is a miss.
The file is opened by the path ``/proc/self/maps`` names and kept only if it is that very
inode. Anything else (a storage safetensors converted to another dtype, a buffer the model
made, a file rewritten meanwhile) is copied into a memfd as before.
"""

from __future__ import annotations

import logging
import os
import stat
import sys
from bisect import bisect_right
from typing import Optional

from overmind.shared.segments.memfd import ALIGNMENT

logger = logging.getLogger(__name__)

__all__ = ["MappedFiles"]

# pagemap entry bits (Documentation/admin-guide/mm/pagemap.rst), in an entry's top byte
_PRESENT = 1 << 7  # bit 63
_SWAPPED = 1 << 6  # bit 62
_FILE_OR_SHARED = 1 << 5  # bit 61
# 1 for a top byte whose page is not the file's own: swapped, or present and anonymous
_TOP = 7 if sys.byteorder == "little" else 0  # the top byte's place in an entry
_WRITTEN = bytes(int(bool(b & _SWAPPED or (b & _PRESENT and not b & _FILE_OR_SHARED))) for b in range(256))


class MappedFiles:
    """Which of this process's storages are clean pages of a fingerprinted file (Note [A storage
    is the file's only where its pages are]). ``fingerprints``: the load's observed files, as
    ``overmind.shared.calls.keys.file_fingerprint`` records them ``[path, size, mtime_ns, ino, dev?, ctime_ns?]``."""

    def __init__(self, fingerprints: list) -> None:
        self._wanted = {}
        for record in fingerprints:
            if isinstance(record, (list, tuple)) and len(record) >= 6:
                path, size, mtime_ns, ino, dev, ctime_ns = record[:6]
                self._wanted[(dev, ino)] = (path, size, mtime_ns, ctime_ns)
        self._maps: list[tuple[int, int, int, int, int, str]] = []  # start, end, offset, dev, ino, path
        self._starts: list[int] = []
        self._numbers: dict[tuple[int, int], int] = {}
        self._refused: set[tuple[int, int]] = set()
        self.fds: list[int] = []
        self.sizes: list[int] = []
        self._pagemap: Optional[int] = None
        if self._wanted:
            self._read_maps()

    def _read_maps(self) -> None:
        try:
            with open("/proc/self/maps") as maps:
                for line in maps:
                    parts = line.split(None, 5)
                    if len(parts) < 6 or not parts[5].startswith("/") or parts[1][0] != "r":
                        continue
                    start, end = (int(x, 16) for x in parts[0].split("-"))
                    major, minor = (int(x, 16) for x in parts[3].split(":"))
                    ino = int(parts[4])
                    if (os.makedev(major, minor), ino) in self._wanted:
                        self._maps.append((start, end, int(parts[2], 16), os.makedev(major, minor), ino,
                                           parts[5].rstrip("\n")))
            self._pagemap = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
        except (OSError, ValueError) as err:  # no maps to read: every storage is copied, as before
            logger.debug("cannot read this process's mappings (%s); copying every storage", err)
            self._maps = []
        self._maps.sort()
        self._starts = [m[0] for m in self._maps]

    def locate(self, address: int, nbytes: int) -> Optional[tuple[int, int, int, int, int]]:
        """``(fd, size, st_dev, st_ino, offset in the file)`` where the ``nbytes`` at ``address``
        are a fingerprinted file's own clean pages, or None. The fd stays this object's."""
        if not self._maps or nbytes <= 0:
            return None
        i = bisect_right(self._starts, address) - 1
        if i < 0:
            return None
        start, end, offset, dev, ino, path = self._maps[i]
        if address + nbytes > end or (dev, ino) in self._refused:
            return None
        number = self._file(dev, ino, path)
        if number is None or not self._clean(address, nbytes):
            return None
        return self.fds[number], self.sizes[number], dev, ino, offset + (address - start)

    def _clean(self, address: int, nbytes: int) -> bool:
        first, last = address // ALIGNMENT, (address + nbytes - 1) // ALIGNMENT
        try:
            entries = os.pread(self._pagemap, (last - first + 1) * 8, first * 8)
        except OSError:
            return False
        # A page this process wrote is an anonymous copy, not the file's. The flags are each
        # native-endian entry's top byte; one translate over those bytes looks at them all.
        return len(entries) == (last - first + 1) * 8 and 1 not in entries[_TOP::8].translate(_WRITTEN)

    def _file(self, dev: int, ino: int, path: str) -> Optional[int]:
        number = self._numbers.get((dev, ino))
        if number is not None:
            return number
        _, size, mtime_ns, ctime_ns = self._wanted[(dev, ino)]
        fd = -1
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns) \
                    != (dev, ino, size, mtime_ns, ctime_ns):
                raise ValueError("changed since the load read it")
        except (OSError, ValueError) as err:
            if fd >= 0:
                os.close(fd)
            logger.debug("not serving %s from its file (%s); copying its storages", path, err)
            self._refused.add((dev, ino))
            return None
        number = len(self.fds)
        self.fds.append(fd)
        self.sizes.append(st.st_size)
        self._numbers[(dev, ino)] = number
        return number

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds, self.sizes = [], []
        if self._pagemap is not None:
            os.close(self._pagemap)
            self._pagemap = None
