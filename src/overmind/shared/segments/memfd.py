"""Sealed memfd segments: the only module that calls memfd/fcntl/mmap.

A segment is anonymous shared memory (``memfd_create``) that the loader fills once,
seals, and hands to the server; clients map it copy-on-write::

    seg = Segment.create("unet", nbytes)
    seg.write_at(0, memoryview_of_bytes)
    seg.seal()
    mapping = seg.map_private()          # writable, never shared back

    # in another process of the same user
    seg = Segment.open_proc(server_pid, server_fd, nbytes)

Note [Sealed segments are immutable]
``seal()`` adds ``F_SEAL_WRITE|F_SEAL_SHRINK|F_SEAL_GROW|F_SEAL_SEAL``. After it,
the kernel refuses ``write(2)``, ``ftruncate`` and any writable ``MAP_SHARED``
mapping, for every fd of the file, including one reopened through ``/proc``.
Clients map ``MAP_PRIVATE`` read/write: a write copies the touched page into the
writer's private memory, so an in-place edit (``weight.mul_()``, LoRA fusing) can
never reach the server, another process or a later load. Every part of overmind
that hands out a storage relies on this.

Note [Filling by pwrite]
Where shmem gets no huge pages (``shmem_enabled`` is ``never``, the usual default),
filling by ``pwrite`` beats ``ftruncate`` + ``mmap`` + ``memcpy`` (with or without
``fallocate`` or ``MADV_POPULATE_WRITE``) here by 1.6-2x: the kernel allocates
shmem pages inside the write, with no page-table faults. Measured by
``benchmarks/segment_fill.py``.

Note [Huge pages for segments]
A warm load's first pass over the weights is page faults: one per 4 KiB of a
``MAP_PRIVATE`` mapping. Where the segment's file pages are 2 MiB huge pages and the
mapping is 2 MiB aligned in both file offset and address, the kernel maps them one PMD
per 2 MiB: reading every page of 1 GiB then takes ~6 ms here instead of ~75 ms. So,
where ``shmem_enabled`` may give huge pages (``advise``, ``within_size``, ``always``,
``force``; :func:`huge_pages_possible`):

- Filling stays ``pwrite`` (Note [Filling by pwrite]), which allocates small pages, and
  the entry is published as soon as it is sealed. Then the loader, at idle priority,
  asks the kernel to rebuild the sealed file out of huge pages: ``MADV_COLLAPSE`` over a
  read-only shared mapping (:meth:`Segment.collapse_to_huge_pages`). The kernel copies
  each 2 MiB into a new huge page and swaps it into the file's page cache: same bytes,
  same inode, same seals; mappings that already faulted the small pages refault the huge
  one. ``MADV_COLLAPSE`` obeys ``never``/``deny`` (EINVAL), so nothing changes there.
- Sizes: such a segment is sealed at a whole number of 2 MiB, so its last 2 MiB can be
  a huge page too (a huge page must lie inside the file).
- Mapping: every ``map_private`` asks ``madvise(MADV_HUGEPAGE)`` (harmless where the
  kernel gives none). The kernel places shmem mappings on 2 MiB boundaries itself
  whenever the setting may give huge pages (``shmem_get_unmapped_area``), so no
  address reservation is needed.
- Copy-on-write is unchanged: a write into a PMD-mapped private page splits the PMD
  and copies one 4 KiB page (Note [Sealed segments are immutable] still holds; tests
  check both).

Storages of 2 MiB or more start on 2 MiB offsets where that costs little (Note [Large
storages on huge pages] in ``overmind.shared.segments.writer``).

Why collapse after the fill rather than fill huge pages directly (a writable
``MAP_SHARED`` ``MADV_HUGEPAGE`` mapping, unmapped before sealing: tried and measured):
``benchmarks/fill_rate.py``, the pack of overmind-bench's ``controlnet`` workload
(3.58 GB), filled 1.9 GB/s by ``pwrite`` and 0.31 GB/s through a huge-page mapping
under ``advise`` on this machine, a guest that reports free 2 MiB blocks back to its
host (``page_reporting``), so each fresh huge page costs ~3-6 ms of first touch by the
hypervisor. Collapsing afterwards pays that too (~0.3-1.2 GB/s), but behind a
published entry and at idle priority, so the cold load fills at the ``pwrite`` rate
and warm loads get huge pages once it is done.

Note [File-backed segments]
A model loaded from safetensors leaves its weights in the file's own mapping: the storages
of a plain ``from_pretrained`` are views of the file's pages in the page cache (overmind-bench's
``controlnet`` workload: nearly all of its 3.58 GB). A loader therefore hands the server the
model *file* as the segment of such storages (``overmind.warm.file_backed``), at the
storage's offset in the file, instead of copying its bytes into a new memfd. The entry
costs no fresh memory and is ready as soon as the loader has loaded: on this machine,
a guest whose fresh memory fills at 0.4 GB/s, copying 3.58 GB took 9 core-seconds, longer
than the run that started it (Note [Joining a fill] in ``overmind.server.joins``).
What this gives up, and how it is held:

- A file is not sealed. Its entry's key holds the file's fingerprint (size, mtime, ctime,
  inode), so a file changed in place or replaced is a miss for every later load, and the
  server retires an entry whose file segment's ``fstat`` no longer matches what the loader
  saw before it serves a hit. A process that mapped it earlier sees a later in-place
  rewrite as a plain ``from_pretrained`` would (it maps the same pages).
- Only the owner of the bytes gets in: a client opens a file segment through
  ``/proc/<server>/fd/<n>``, which the kernel allows only where the caller may read the file
  itself, and checks it is that inode (ARCHITECTURE.md, invariant 7: A segment is what it claims
  to be), as for a memfd.
- Mappings stay ``MAP_PRIVATE``: a write copies the page, the file is never written.
- The pages are the page cache's: another workload can evict them, and the next hit reads
  them from disk as plain python would. The server copies a file segment into a sealed
  memfd when it is idle (Note [Settling file segments] in ``overmind.server.settle``).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import stat
from typing import Optional

from overmind.shared.segments.hugepages import ALLOWING, read_setting

__all__ = ["Segment", "SEAL_ALL", "ALIGNMENT", "HUGE_PAGE", "align_up", "buffer_at", "cached_share",
           "huge_pages_possible", "is_sealed_memfd"]

SEAL_ALL = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
# Storage offsets are page aligned so every tensor starts where the kernel maps a page.
ALIGNMENT = mmap.PAGESIZE
# The PMD size of x86-64 and arm64 with 4 KiB pages: Note [Huge pages for segments].
HUGE_PAGE = 2 << 20
# Linux caps one write(2) at 0x7ffff000 bytes.
_MAX_WRITE = 1 << 30
# madvise(2) advice that rebuilds a range out of huge pages (Linux 6.1); Python names it only
# where its headers did.
MADV_COLLAPSE = getattr(mmap, "MADV_COLLAPSE", 25)


_SYS_CACHESTAT = 451  # Linux 6.5, the same number on every architecture


class _CachestatRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Cachestat(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in
                ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")]


# A file segment with less of it in the page cache than this has lost it: Note [Settling file
# segments] in overmind.server.settle, Note [Reading back a lost file] in overmind.client.prefetch.
RESIDENT = 0.9
READ_BACK_CHUNK = 32 << 20  # bytes of the buffer each read of a lost file copies into, over and over
# One read fills the buffer this many times (the iovecs all name it): 2016 MiB, under Linux's
# 2 GiB cap on one read, so the thread gives up and takes back the GIL once per 2 GiB, not per
# 32 MiB; each take waits out the importing main thread's switch interval (5 ms) while the disk
# idles.
READ_BACK_VECTORS = 63


def cached_share(fd: int, size: int) -> Optional[float]:
    """The share of the file ``fd``'s ``size`` bytes in the page cache (``cachestat``, Linux
    6.5), or None where the kernel cannot say."""
    if size <= 0:
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    found = _Cachestat()
    if libc.syscall(_SYS_CACHESTAT, ctypes.c_uint(fd), ctypes.byref(_CachestatRange(0, size)),
                    ctypes.byref(found), ctypes.c_uint(0)) != 0:
        return None
    return min(1.0, found.nr_cache * mmap.PAGESIZE / size)


def is_sealed_memfd(fd: int) -> bool:
    """Is ``fd`` a memfd with every seal of :data:`SEAL_ALL`? False for a regular file (a file
    segment: Note [File-backed segments])."""
    try:
        return fcntl.fcntl(fd, fcntl.F_GET_SEALS) & SEAL_ALL == SEAL_ALL
    except OSError:  # EINVAL: no memfd
        return False


def align_up(value: int, alignment: int = ALIGNMENT) -> int:
    return (value + alignment - 1) // alignment * alignment


def buffer_at(address: int, nbytes: int) -> memoryview:
    """A writable byte view of memory we do not own (a torch storage), without copying."""
    if nbytes == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")


def huge_pages_possible() -> bool:
    """May the kernel back a memfd with huge pages (Note [Huge pages for segments])? The
    setting is read and judged where ``overmind status`` reads it (:mod:`overmind.shared.segments.hugepages`)."""
    return read_setting() in ALLOWING


def hold_pages(fd: int, size: int) -> Optional[mmap.mmap]:
    """A read-only shared mapping of the file ``fd``'s ``size`` bytes with its page tables filled
    (``MADV_POPULATE_READ``, Linux 5.14), so that its page cache pages count as mapped (Note [File
    segments stay mapped] in overmind.server.settle); None where the kernel refused. Only madvise
    touches it: reading the bytes of a file truncated meanwhile would raise SIGBUS."""
    if size <= 0:
        return None
    try:
        mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    except (OSError, ValueError):
        return None
    try:
        mapping.madvise(getattr(mmap, "MADV_POPULATE_READ", 22))
    except (OSError, ValueError):
        mapping.close()
        return None
    return mapping


def _advise_huge(mapping: mmap.mmap) -> None:
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, AttributeError, ValueError):
        pass  # a kernel without transparent huge pages: small pages, as before


def _oserror(err: OSError, what: str, name: str, hint: str) -> OSError:
    return OSError(err.errno, f"{what} failed for segment {name!r}: {os.strerror(err.errno or 0)}. {hint}")


class Segment:
    """One memfd. Owns ``fd`` until ``close()``; mappings it returns own themselves."""

    class Mismatch(ValueError):
        """The fd is not the segment it was named as (another inode): ARCHITECTURE.md, invariant 7:
        A segment is what it claims to be."""

    def __init__(self, fd: int, size: int, name: str = "overmind", huge: bool = False) -> None:
        if fd < 0:
            raise ValueError(f"invalid file descriptor {fd} for segment {name!r}")
        if size < 0:
            raise ValueError(f"segment size must be >= 0, got {size}")
        self.fd = fd
        self.size = size
        self.name = name
        # Made where the kernel may give huge pages: sealed at whole 2 MiB and collapsed
        # after publishing (Note [Huge pages for segments]).
        self.huge = huge
        # A model file rather than a memfd: Note [File-backed segments]. Set by check().
        self.file_backed = False

    # -- creation (loader side) -------------------------------------------------

    @classmethod
    def create(cls, name: str, size: int) -> "Segment":
        """A new unsealed memfd of ``size`` bytes."""
        if not isinstance(size, int) or size < 0:
            raise ValueError(f"segment size must be a non-negative int, got {size!r}")
        try:
            fd = os.memfd_create(f"overmind:{name}"[:249], os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except OSError as err:
            raise _oserror(err, "memfd_create", name, "Check RLIMIT_NOFILE and that /proc/sys/fs is not exhausted.") from None
        try:
            os.ftruncate(fd, size)
        except OSError as err:
            os.close(fd)
            raise _oserror(err, f"ftruncate to {size} bytes", name, "The machine may be out of memory; evict entries or lower the budget.") from None
        return cls(fd, size, name, huge_pages_possible())

    def write_at(self, offset: int, data) -> None:
        """Copy ``data`` (any contiguous buffer) into the segment at ``offset`` (Note [Filling by pwrite])."""
        view = memoryview(data).cast("B")
        if offset < 0 or offset + view.nbytes > self.size:
            raise ValueError(
                f"write of {view.nbytes} bytes at offset {offset} is outside segment {self.name!r} of {self.size} bytes"
            )
        done = 0
        while done < view.nbytes:
            chunk = view[done : done + _MAX_WRITE]
            try:
                n = os.pwrite(self.fd, chunk, offset + done)
            except OSError as err:
                hint = "The segment is sealed; create a new one." if err.errno == errno.EPERM else "The machine may be out of memory."
                raise _oserror(err, f"pwrite at offset {offset + done}", self.name, hint) from None
            if n <= 0:
                raise OSError(errno.EIO, f"short write into segment {self.name!r} at offset {offset + done}")
            done += n

    def copy_from(self, source_fd: int, offset: int, nbytes: int) -> None:
        """Copy ``nbytes`` of the file ``source_fd`` at ``offset`` to the same offset here, in
        the kernel (``sendfile``: no pass through user memory). Sequential calls only: it writes
        at the segment's file position, which each call moves on."""
        if offset < 0 or offset + nbytes > self.size:
            raise ValueError(f"copy of {nbytes} bytes at offset {offset} is outside segment {self.name!r} of {self.size} bytes")
        if os.lseek(self.fd, 0, os.SEEK_CUR) != offset:
            os.lseek(self.fd, offset, os.SEEK_SET)
        done = 0
        while done < nbytes:
            try:
                n = os.sendfile(self.fd, source_fd, offset + done, min(nbytes - done, _MAX_WRITE))
            except OSError as err:
                raise _oserror(err, f"sendfile at offset {offset + done}", self.name, "The machine may be out of memory.") from None
            if n <= 0:
                raise OSError(errno.EIO, f"the source of segment {self.name!r} ended at offset {offset + done}")
            done += n

    def finish(self, size: int) -> None:
        """End filling: give the file its final ``size`` (rounded up to whole huge pages where
        they are possible: Note [Huge pages for segments]) and seal it."""
        if self.huge and size >= HUGE_PAGE:
            size = align_up(size, HUGE_PAGE)
        self.size = size
        self.seal()

    def seal(self) -> None:
        """Seal at ``size`` bytes: the file is cut (or grown) to it first, as writes may have
        grown it."""
        try:
            if os.fstat(self.fd).st_size != self.size:
                os.ftruncate(self.fd, self.size)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, SEAL_ALL)
        except OSError as err:
            raise _oserror(err, "sealing (F_ADD_SEALS)", self.name, "Was the segment created with MFD_ALLOW_SEALING and is no writable MAP_SHARED mapping alive?") from None

    def collapse_to_huge_pages(self) -> int:
        """Rebuild the sealed segment's pages as huge pages, where the kernel allows
        (Note [Huge pages for segments]). Slow (it copies, and fresh huge pages may be slow to
        touch): run it off the load's path. Returns the bytes rebuilt: 0 where the setting
        gives no huge pages or the kernel predates ``MADV_COLLAPSE`` (6.1)."""
        whole = self.size // HUGE_PAGE * HUGE_PAGE
        if whole == 0 or not huge_pages_possible():
            return 0
        try:
            mapping = mmap.mmap(self.fd, whole, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        except OSError:
            return 0
        done = 0
        try:
            # One huge page per call: the kernel reports one error for a whole range, and a
            # range that is all hole (storage padding) is refused with EINVAL on its own.
            for start in range(0, whole, HUGE_PAGE):
                for attempt in (1, 2):
                    try:
                        mapping.madvise(MADV_COLLAPSE, start, HUGE_PAGE)
                        done += HUGE_PAGE
                        break
                    except OSError as err:
                        if err.errno == errno.ENOMEM:
                            return done  # no huge page to be had: the small pages stay
                        if err.errno != errno.EAGAIN or attempt == 2:
                            break  # a hole, or still busy: that range stays small pages
        finally:
            mapping.close()
        return done

    def seals(self) -> int:
        return fcntl.fcntl(self.fd, fcntl.F_GET_SEALS)

    @property
    def sealed(self) -> bool:
        return self.seals() & SEAL_ALL == SEAL_ALL

    # -- opening (client side) --------------------------------------------------

    @classmethod
    def open_proc(cls, pid: int, fd: int, size: int, name: str = "overmind",
                  identity: Optional[tuple[int, int]] = None) -> "Segment":
        """Reopen another process's memfd through ``/proc/<pid>/fd/<fd>``.

        Raises PermissionError when the kernel refuses (other PID namespace, a
        non-dumpable owner); callers then ask for the fd over the socket instead.
        ``identity``: the (st_dev, st_ino) the segment must have; fd numbers are reused, so
        whoever opens by number passes it (:class:`Segment.Mismatch` otherwise).
        """
        path = f"/proc/{int(pid)}/fd/{int(fd)}"
        try:
            # Read-only is enough for a writable MAP_PRIVATE mapping, and all a model file's
            # reader may have (Note [File-backed segments]).
            local = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as err:
            raise type(err)(err.errno, f"cannot open segment {name!r} through {path}: {os.strerror(err.errno or 0)}. "
                            "Falling back to SCM_RIGHTS is expected here.") from None
        seg = cls(local, size, name)
        try:
            seg.check(size, identity)
        except Exception:
            seg.close()
            raise
        return seg

    @classmethod
    def from_fd(cls, fd: int, size: int, name: str = "overmind",
                identity: Optional[tuple[int, int]] = None) -> "Segment":
        """Adopt an fd received over a Unix socket (SCM_RIGHTS); checks it is a sealed segment
        (and, given ``identity``, that very one)."""
        seg = cls(fd, size, name)
        seg.check(size, identity)
        return seg

    def check(self, size: int, identity: Optional[tuple[int, int]] = None) -> None:
        """Refuse anything but a sealed memfd of the announced size (a wrong fd would map garbage)
        and, given ``identity``, anything but that very file. Given ``identity``, a regular file
        that is no memfd is taken as a file-backed segment (Note [File-backed segments])."""
        st = os.fstat(self.fd)
        if identity is not None and (st.st_dev, st.st_ino) != tuple(identity):
            raise Segment.Mismatch(f"fd {self.fd} for segment {self.name!r} is inode {st.st_dev}:{st.st_ino}, "
                                   f"not {identity[0]}:{identity[1]}")
        if not stat.S_ISREG(st.st_mode) or st.st_size != size:
            raise ValueError(f"fd {self.fd} for segment {self.name!r} is not a {size}-byte memfd (size {st.st_size})")
        try:
            seals = fcntl.fcntl(self.fd, fcntl.F_GET_SEALS)
        except OSError as err:
            if err.errno == errno.EINVAL and identity is not None:
                self.file_backed = True  # a model file the server named by inode
                return
            raise ValueError(f"fd {self.fd} for segment {self.name!r} is not a memfd: {os.strerror(err.errno or 0)}") from None
        if seals == fcntl.F_SEAL_SEAL and identity is not None:
            self.file_backed = True  # a model file on tmpfs: shmem, but never sealable
            return
        if seals & SEAL_ALL != SEAL_ALL:
            raise ValueError(f"segment {self.name!r} is not sealed (seals 0x{seals:x}); refusing to map mutable memory")

    def read_back(self) -> int:
        """If this is a file segment the page cache lost (less than RESIDENT of it there), read
        the file whole on this thread, so its pages are in memory again before a hit touches
        them (Note [Reading back a lost file] in overmind.client.prefetch); the bytes read, 0 if
        there was nothing to do or the kernel cannot say."""
        if not self.file_backed:
            return 0
        share = cached_share(self.fd, self.size)
        if share is None or share >= RESIDENT:
            return 0
        buffer = bytearray(READ_BACK_CHUNK)  # reused: the copy out of the page cache touches each page
        vectors = [buffer] * READ_BACK_VECTORS
        done = 0
        while done < self.size:
            n = os.preadv(self.fd, vectors, done)
            if n <= 0:
                break
            done += n
        return done

    def map_private(self) -> mmap.mmap:
        """Map the whole segment copy-on-write (see Note [Sealed segments are immutable])."""
        if self.size == 0:
            raise ValueError(f"segment {self.name!r} is empty; there is nothing to map")
        try:
            mapping = mmap.mmap(self.fd, self.size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as err:
            raise _oserror(err, "mmap(MAP_PRIVATE)", self.name, "Check the address-space limit (ulimit -v).") from None
        _advise_huge(mapping)  # Note [Huge pages for segments]
        return mapping

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "Segment":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Segment(name={self.name!r}, fd={self.fd}, size={self.size})"
