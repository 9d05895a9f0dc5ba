"""Filling one new sealed segment from a thread of its own: the packing side of
``overmind.shared.segments.reductions``.

    writer = SegmentWriter("unet.0", progress)        # one per fill thread
    offset = writer.reserve(nbytes, address)          # where the storage goes
    writer.write(offset, address, nbytes, keep)       # queued: the thread copies it
    segment = writer.finish()                         # sealed; None if nothing was written

Note [Parallel fill]
Filling shared memory is bound by the kernel allocating shmem pages, and two
threads writing into one memfd contend on its inode. Each fill thread therefore owns
its own segment: with two, filling runs ~2x faster here than with one
(``benchmarks/core_rebuild.py``). The pickler only reserves offsets and queues the
copies, so pickling overlaps the copying.

Note [Same alignment, same numbers]
CPU kernels (oneDNN convolutions, vectorised reductions) split their work by the
address of the data, so the same weights at a different offset within a cache line
can give different low-order bits. A plain ``from_pretrained`` leaves tensors where
safetensors put them in the file mapping (often 8 bytes past a 64-byte boundary).
Each storage is therefore placed at the same address modulo 64 as its source, and a
cached model computes bit-identical outputs to a plain load of the same files.

Note [Large storages on huge pages]
A storage of ``HUGE_PAGE`` (2 MiB) bytes or more starts on a 2 MiB offset of its segment
(plus its cache-line misalignment) where that skips at most 1/16 of its size, so its
pages are whole huge pages of its own where the kernel backs segments with them (Note
[Huge pages for segments] in ``overmind.shared.segments.memfd``); others start on a page, as before.
The gap left before an aligned storage is not wasted: smaller storages packed later
fill it first-fit (page- or cache-line-aligned as before). On overmind-bench's ``base``
models this aligns 72% of the large storages' bytes for 0.65% more segment size
(aligning every one: 4.5%, the gaps refilled). Offsets are the same whatever the
machine's huge-page setting; only how the segment is filled differs.
"""

from __future__ import annotations

from typing import Callable, Optional

from overmind.shared.segments.memfd import ALIGNMENT, HUGE_PAGE, Segment, align_up, buffer_at

__all__ = ["SegmentWriter"]

# Storages smaller than a page are packed at cache-line alignment; larger ones start on a page,
# and those of a huge page or more on a huge page: Note [Large storages on huge pages].
_SMALL_ALIGNMENT = 64
# A gap left before a huge-page-aligned storage is kept for later small storages if this large.
_MIN_GAP = ALIGNMENT
# A large storage moves to the next huge page only if that skips at most this share of its size.
_MAX_PADDING_SHARE = 16


class SegmentWriter:
    """One growing segment and the thread that fills it (Note [Parallel fill])."""

    def __init__(self, name: str, progress: Optional[Callable[[int], None]] = None) -> None:
        self.name = name
        self.progress = progress  # told the bytes of each storage once they are in the segment
        self.segment: Optional[Segment] = None
        self.end = 0
        self.gaps: list[list[int]] = []  # [start, end) left before huge-page-aligned storages
        self.pool = None  # a one-thread ThreadPoolExecutor, made on first use
        self.pending: list = []

    def reserve(self, nbytes: int, address: int) -> int:
        if self.segment is None:
            from concurrent.futures import ThreadPoolExecutor  # packing only: keep unpack's imports light

            self.segment = Segment.create(self.name, 0)
            self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"overmind-fill-{self.name}")
        # Keep the source's misalignment within a cache line: see Note [Same alignment, same numbers].
        misalignment = address % _SMALL_ALIGNMENT
        start = align_up(self.end, HUGE_PAGE)
        if nbytes >= HUGE_PAGE and start - self.end <= nbytes // _MAX_PADDING_SHARE:
            # Note [Large storages on huge pages]
            if start - self.end >= _MIN_GAP:
                self.gaps.append([self.end, start])
            offset = start + misalignment
        else:
            alignment = ALIGNMENT if nbytes >= ALIGNMENT else _SMALL_ALIGNMENT
            offset = self._from_gap(nbytes, alignment, misalignment)
            if offset is not None:
                return offset
            offset = align_up(self.end, alignment) + misalignment
        self.end = offset + nbytes
        self.segment.size = max(self.segment.size, self.end)
        return offset

    def _from_gap(self, nbytes: int, alignment: int, misalignment: int) -> Optional[int]:
        for i, gap in enumerate(self.gaps):
            offset = align_up(gap[0], alignment) + misalignment
            if offset + nbytes <= gap[1]:
                gap[0] = offset + nbytes
                if gap[1] - gap[0] < _SMALL_ALIGNMENT:
                    del self.gaps[i]
                return offset
        return None

    def write(self, offset: int, address: int, nbytes: int, keep: object) -> None:
        assert self.pool is not None and self.segment is not None
        # `keep` holds the source storage alive until its bytes are in the segment.
        self.pending.append(self.pool.submit(self._write, offset, address, nbytes, keep))

    def _write(self, offset: int, address: int, nbytes: int, keep: object) -> None:
        # See Notes [Filling by pwrite] and [Huge pages for segments] in overmind.shared.segments.memfd.
        self.segment.write_at(offset, buffer_at(address, nbytes))
        if self.progress is not None:
            self.progress(nbytes)

    def wait(self) -> None:
        try:
            for future in self.pending:
                future.result()
        finally:
            self.pending.clear()
            if self.pool is not None:
                self.pool.shutdown(wait=True)
                self.pool = None

    def finish(self) -> Optional[Segment]:
        self.wait()
        if self.segment is None:
            return None
        self.segment.finish(align_up(self.end, ALIGNMENT))
        return self.segment

    def abort(self) -> None:
        try:
            self.wait()
        except Exception:
            pass
        if self.segment is not None:
            self.segment.close()
            self.segment = None
