"""overmind.shared.segments.memfd: sealed segments refuse every write path; clients map copy-on-write."""

from __future__ import annotations

import errno
import mmap
import os
import socket

import pytest

from overmind.shared.segments import memfd
from overmind.shared.segments.memfd import RESIDENT, Segment, cached_share

from ..conftest import run_python


@pytest.fixture
def sealed():
    seg = Segment.create("test", 2 * mmap.PAGESIZE)
    seg.write_at(0, b"hello")
    seg.write_at(mmap.PAGESIZE, b"world")
    seg.seal()
    yield seg
    seg.close()


def test_sealed_segment_has_all_seals(sealed):
    assert sealed.sealed


def _assert_write_paths_refused(fd: int) -> None:
    with pytest.raises(PermissionError):
        os.pwrite(fd, b"x", 0)
    with pytest.raises(PermissionError):
        os.ftruncate(fd, 0)
    with pytest.raises(PermissionError):
        os.ftruncate(fd, 10 * mmap.PAGESIZE)
    with pytest.raises(PermissionError):
        mmap.mmap(fd, mmap.PAGESIZE, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def test_sealed_segment_refuses_write_truncate_and_shared_writable_map(sealed):
    _assert_write_paths_refused(sealed.fd)


def test_reopened_read_write_through_proc_is_still_sealed(sealed):
    fd = os.open(f"/proc/{os.getpid()}/fd/{sealed.fd}", os.O_RDWR)
    try:
        _assert_write_paths_refused(fd)
    finally:
        os.close(fd)


def test_private_mapping_is_writable_and_never_reaches_the_segment(sealed):
    first = sealed.map_private()
    first[:5] = b"HELLO"
    second = sealed.map_private()
    assert second[:5] == b"hello"
    assert os.pread(sealed.fd, 5, 0) == b"hello"
    first.close()
    second.close()


def test_another_process_opens_the_segment_through_proc(sealed):
    out = run_python(f"""
        from overmind.shared.segments.memfd import RESIDENT, Segment, cached_share
        seg = Segment.open_proc({os.getpid()}, {sealed.fd}, {sealed.size})
        m = seg.map_private()
        m[:5] = b"XXXXX"  # private: never seen by the parent
        print(bytes(m[{mmap.PAGESIZE}:{mmap.PAGESIZE} + 5]).decode())
    """).stdout
    assert out.strip() == "world"
    assert os.pread(sealed.fd, 5, 0) == b"hello"


def test_another_process_receives_the_segment_over_scm_rights(sealed):
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with parent, child:
        pid = os.fork()
        if pid == 0:  # child: receive the fd, read, report, exit without running pytest teardown
            try:
                parent.close()
                msg, fds, _, _ = socket.recv_fds(child, 16, 1)
                seg = Segment.from_fd(fds[0], int(msg.decode()), "received")
                m = seg.map_private()
                child.sendall(bytes(m[:5]))
            finally:
                os._exit(0)
        child.close()
        socket.send_fds(parent, [str(sealed.size).encode()], [sealed.fd])
        assert parent.recv(5) == b"hello"
        os.waitpid(pid, 0)


def test_open_proc_of_a_missing_fd_is_a_clear_oserror():
    with pytest.raises(OSError, match="cannot open segment"):
        Segment.open_proc(os.getpid(), 999_999, 10, "missing")


def test_unsealed_or_wrong_size_fd_is_refused():
    seg = Segment.create("unsealed", mmap.PAGESIZE)
    try:
        with pytest.raises(ValueError, match="not sealed"):
            Segment.from_fd(os.dup(seg.fd), mmap.PAGESIZE)
        seg.seal()
        with pytest.raises(ValueError, match="memfd"):
            Segment.from_fd(os.dup(seg.fd), 3 * mmap.PAGESIZE)
    finally:
        seg.close()


def test_a_regular_file_is_not_accepted_as_a_segment(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"x" * 10)
    fd = os.open(path, os.O_RDWR)
    with pytest.raises(ValueError, match="not a memfd"):
        Segment.from_fd(fd, 10)
    os.close(fd)


def _dropped(path) -> int:
    """``path`` opened read-only with its pages out of the page cache (what memory pressure does)."""
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)  # written just now: dirty pages would stay
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    return fd


# (buffer bytes, buffers per read): the default reads 8 MiB in one call; the second needs
# several reads, the last of them ending inside a vector
@pytest.mark.parametrize("chunk, vectors", [(None, None), (1 << 20, 3)])
def test_a_file_segment_the_page_cache_lost_is_read_back_whole_and_a_cached_one_is_left(
        tmp_path, monkeypatch, chunk, vectors):
    if chunk is not None:
        monkeypatch.setattr(memfd, "READ_BACK_CHUNK", chunk)
        monkeypatch.setattr(memfd, "READ_BACK_VECTORS", vectors)
    path = tmp_path / "model.safetensors"
    path.write_bytes(os.urandom((8 << 20) + 4096))
    st = os.stat(path)
    seg = Segment(_dropped(path), st.st_size, "file")
    try:
        seg.check(st.st_size, identity=(st.st_dev, st.st_ino))
        assert seg.file_backed
        if cached_share(seg.fd, seg.size) is None:
            pytest.skip("this kernel has no cachestat (Linux 6.5): nothing can tell a lost file")
        assert cached_share(seg.fd, seg.size) < RESIDENT
        assert seg.read_back() == seg.size
        assert cached_share(seg.fd, seg.size) >= RESIDENT
        assert seg.read_back() == 0  # back in the page cache: nothing to read
    finally:
        seg.close()


def test_a_memfd_segment_is_never_read_back(sealed):
    assert sealed.read_back() == 0


@pytest.mark.parametrize("size", [-1, 1.5, "10"])
def test_bad_sizes_are_refused(size):
    with pytest.raises(ValueError):
        Segment.create("bad", size)


def test_write_outside_the_segment_is_refused():
    seg = Segment.create("small", 8)
    with pytest.raises(ValueError, match="outside"):
        seg.write_at(4, b"123456789")
    seg.close()


def test_write_after_seal_is_a_clear_oserror(sealed):
    with pytest.raises(OSError) as info:
        sealed.write_at(0, b"x")
    assert info.value.errno == errno.EPERM and "sealed" in str(info.value)


def test_mapping_an_empty_segment_is_refused():
    seg = Segment.create("empty", 0)
    with pytest.raises(ValueError, match="empty"):
        seg.map_private()
    seg.close()


def test_a_segment_made_where_huge_pages_are_possible_is_sealed_at_whole_huge_pages(monkeypatch):
    """Note [Huge pages for segments]: its last 2 MiB can then be a huge page too. Forced here,
    whatever this machine's setting; the bytes past the written end read as zeros."""
    from overmind.shared.segments import memfd

    monkeypatch.setattr(memfd, "huge_pages_possible", lambda: True)
    seg = Segment.create("huge", 0)
    try:
        seg.size = memfd.HUGE_PAGE + 5
        seg.write_at(memfd.HUGE_PAGE, b"world")
        seg.finish(memfd.HUGE_PAGE + 5)
        assert seg.size == os.fstat(seg.fd).st_size == 2 * memfd.HUGE_PAGE and seg.sealed
        m = seg.map_private()
        assert m[memfd.HUGE_PAGE:memfd.HUGE_PAGE + 7] == b"world\0\0" and m[-1] == 0
        m.close()
    finally:
        seg.close()


def test_a_small_segment_is_not_rounded_and_collapsing_it_asks_nothing(monkeypatch):
    from overmind.shared.segments import memfd

    monkeypatch.setattr(memfd, "huge_pages_possible", lambda: True)
    seg = Segment.create("small", 3 * mmap.PAGESIZE)
    try:
        seg.write_at(0, b"x")
        seg.finish(3 * mmap.PAGESIZE)
        assert seg.size == 3 * mmap.PAGESIZE and seg.collapse_to_huge_pages() == 0
    finally:
        seg.close()


def test_collapsing_a_sealed_segment_keeps_its_bytes_and_seals_and_does_nothing_under_never():
    """MADV_COLLAPSE swaps pages under a sealed file; where the setting is ``never`` the kernel
    refuses it (EINVAL) and the segment is as it was."""
    from overmind.shared.segments import memfd

    data = os.urandom(memfd.HUGE_PAGE) * 3
    seg = Segment.create("collapse", len(data))
    try:
        seg.write_at(0, data)
        seg.seal()
        done = seg.collapse_to_huge_pages()
        if not memfd.huge_pages_possible():
            assert done == 0
        assert seg.sealed and os.pread(seg.fd, len(data), 0) == data
        with pytest.raises(OSError) as err:
            seg.write_at(0, b"x")
        assert err.value.errno == errno.EPERM
    finally:
        seg.close()
