"""Huge pages for segments: copy-on-write, seals and layout hold with them.

Note [Huge pages for segments] in overmind.shared.segments.memfd. Tests never change the machine's
``shmem_enabled``: where it gives no huge pages (``never``, the default here) the huge-page
specifics are skipped and what is checked is that they were asked for (``hg`` in the
mapping's VmFlags) and changed nothing else. Where it is ``advise`` (or another value that
gives huge pages) the same tests also check that segments are backed by huge pages and
mapped one PMD per 2 MiB.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import re
import textwrap

import pytest

from overmind.shared.segments.hugepages import read_setting
from overmind.shared.segments.memfd import HUGE_PAGE, SEAL_ALL, Segment, huge_pages_possible

from .conftest import last_json

HUGE = huge_pages_possible()
MiB = 1 << 20


def address_of(mapping: mmap.mmap) -> int:
    probe = ctypes.c_char.from_buffer(mapping)
    try:
        return ctypes.addressof(probe)
    finally:
        del probe


def smaps_of(address: int, pid: str = "self") -> dict:
    """The /proc/<pid>/smaps fields (kB) and VmFlags of the mapping that holds ``address``."""
    fields: dict = {}
    inside = False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
            if head:
                if inside:
                    break
                inside = int(head.group(1), 16) <= address < int(head.group(2), 16)
            elif inside:
                key, _, value = line.partition(":")
                fields[key] = value.split() if key == "VmFlags" else int(value.split()[0])
    assert fields, f"no mapping holds {address:#x}"
    return fields


def pattern(nbytes: int, seed: int) -> bytes:
    import random

    return random.Random(seed).randbytes(nbytes)


def filled(chunks: list[tuple[int, bytes]]) -> Segment:
    """Filled, sealed and collapsed into huge pages as the loader does (forced to be made as
    where huge pages are possible, so the layout is the same under every setting)."""
    seg = Segment.create("huge-test", 0)
    seg.huge = True
    for offset, data in chunks:
        seg.size = max(seg.size, offset + len(data))
        seg.write_at(offset, data)
    seg.finish(seg.size)
    seg.collapsed = seg.collapse_to_huge_pages()
    return seg


def read_every_page(mapping: mmap.mmap) -> int:
    return sum(mapping[i] for i in range(0, len(mapping), 4096))


@pytest.fixture
def big_segment():
    """Two runs of bytes with a hole of zeros between them."""
    first, second = pattern(6 * MiB + 123, 1), pattern(5 * MiB, 2)
    seg = filled([(0, first), (70 * MiB, second)])
    # Every 2 MiB that holds bytes (0-8 MiB, 70-76 MiB); the hole between stays a hole.
    assert seg.collapsed == (14 * MiB if HUGE else 0)
    yield seg, {0: first, 70 * MiB: second}
    seg.close()


def test_a_collapsed_segment_holds_its_bytes_and_is_sealed_at_whole_huge_pages(big_segment):
    seg, written = big_segment
    assert seg.size == 76 * MiB  # 75 MiB written, rounded up to a whole huge page
    assert os.fstat(seg.fd).st_size == seg.size
    assert seg.seals() & SEAL_ALL == SEAL_ALL
    m = seg.map_private()
    try:
        for offset, data in written.items():
            assert m[offset:offset + len(data)] == data
        assert m[6 * MiB + 123:70 * MiB] == bytes(70 * MiB - 6 * MiB - 123)  # the hole reads as zeros
    finally:
        m.close()


def test_a_collapsed_segment_still_refuses_writes_truncation_and_shared_writable_maps(
        big_segment):
    seg, _ = big_segment
    with pytest.raises(OSError) as err:
        seg.write_at(0, b"x")
    assert err.value.errno == errno.EPERM
    for new_size in (0, seg.size + HUGE_PAGE):
        with pytest.raises(PermissionError):
            os.ftruncate(seg.fd, new_size)
    with pytest.raises(PermissionError):
        mmap.mmap(seg.fd, seg.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    with pytest.raises(PermissionError):
        fcntl.fcntl(seg.fd, fcntl.F_ADD_SEALS, 0)  # F_SEAL_SEAL: no seal can be taken away or added
    # Reopened read-write through /proc: the same file, the same seals.
    fd = os.open(f"/proc/self/fd/{seg.fd}", os.O_RDWR)
    try:
        with pytest.raises(PermissionError):
            os.pwrite(fd, b"x", 0)
    finally:
        os.close(fd)


def test_every_private_mapping_asks_for_huge_pages_and_is_pmd_mapped_where_the_kernel_allows(big_segment):
    seg, written = big_segment
    m = seg.map_private()
    try:
        read_every_page(m)
        address = address_of(m)
        info = smaps_of(address)
        assert "hg" in info["VmFlags"]  # madvise(MADV_HUGEPAGE) was asked, whatever the setting
        if not HUGE:
            pytest.skip(f"shmem_enabled is {read_setting()!r}: no huge pages to check here")
        assert address % HUGE_PAGE == 0
        assert info["ShmemPmdMapped"] * 1024 >= 10 * MiB, info  # both runs of bytes, in whole huge pages
    finally:
        m.close()


def test_an_in_place_edit_of_a_huge_page_mapping_stays_private(big_segment):
    seg, written = big_segment
    edited = seg.map_private()
    other = seg.map_private()
    try:
        read_every_page(edited)
        if HUGE:
            assert smaps_of(address_of(edited))["ShmemPmdMapped"] > 0
        for at in (5, HUGE_PAGE + 4097, 70 * MiB + 3 * MiB + 11):  # inside huge pages, not on their start
            edited[at:at + 4] = b"EDIT"
        for at in (5, HUGE_PAGE + 4097, 70 * MiB + 3 * MiB + 11):
            assert edited[at:at + 4] == b"EDIT"
        # Another mapping of this process, another process and a later map see the original bytes.
        assert other[0:6 * MiB + 123] == written[0] and other[70 * MiB:75 * MiB] == written[70 * MiB]
        later = seg.map_private()
        try:
            assert later[0:6 * MiB + 123] == written[0]
        finally:
            later.close()
        assert os.pread(seg.fd, 4, 5) == written[0][5:9]
        # Copy-on-write copied small pages only: three edits, three 4 KiB private copies.
        info = smaps_of(address_of(edited))
        assert info["Anonymous"] == 3 * 4 and info.get("AnonHugePages", 0) == 0, info
    finally:
        edited.close()
        other.close()


def test_a_later_load_in_another_process_sees_the_original_bytes_after_an_edit(big_segment, python):
    seg, written = big_segment
    edited = seg.map_private()
    try:
        edited[0:4] = b"EDIT"
        out = python(f"""
            import hashlib
            from overmind.shared.segments.memfd import Segment
            seg = Segment.open_proc({os.getpid()}, {seg.fd}, {seg.size})
            m = seg.map_private()
            print(hashlib.sha256(m[0:{len(written[0])}]).hexdigest())
        """)
        import hashlib

        assert out.stdout.split()[-1] == hashlib.sha256(written[0]).hexdigest()
    finally:
        edited.close()


@pytest.fixture(scope="module")
def small_lm(tmp_path_factory):
    """An LM with storages of several MiB (its embedding and head), saved once."""
    import torch

    from overmind import modelgen

    from ..conftest import age_files

    path = modelgen.save_lm(tmp_path_factory.mktemp("huge") / "lm", "small", torch.float32, seed=7)
    age_files(path)
    return path


def test_a_warm_load_through_the_server_is_private_and_uses_huge_pages_where_allowed(server, small_lm):
    """The whole path: the loader fills the segments, a client edits its warm copy in place,
    a second process loads the original; where the setting allows, the large weights are
    PMD-mapped and start on 2 MiB boundaries of the address space."""
    code = textwrap.dedent(f"""
        import json, sys, torch, overmind.api
        overmind.api.monkey_patch_all()
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({str(small_lm)!r})
        weight = model.get_input_embeddings().weight
        first = float(weight.detach().double().sum())
        touched = sum(float(p.detach().double().sum()) for p in model.parameters())
        pmd = 0
        with open("/proc/self/smaps") as f:
            for line in f:
                if line.startswith("ShmemPmdMapped:"):
                    pmd += int(line.split()[1])
        if sys.argv[-1] == "edit":  # replaced by True in the run that edits
            with torch.no_grad():
                weight.mul_(2)
            assert float(weight.detach().double().sum()) != first
        print(json.dumps({{"first": first, "total": touched, "pmd_kb": pmd, "nbytes": weight.nbytes,
                           "misalignment": weight.data_ptr() % {HUGE_PAGE}}}))
    """)
    env = server.client_env(OVERMIND_STRICT="1")
    server.run(code, env=env)  # a miss: the loader fills the cache
    server.wait_idle()
    hits = server.status()["hits"]
    edited = last_json(server.run(code.replace('sys.argv[-1] == "edit"', "True"), env=env))
    later = last_json(server.run(code, env=env))
    assert server.status()["hits"] == hits + 2  # both were warm loads
    assert later["first"] == edited["first"] and later["total"] == edited["total"]
    assert edited["nbytes"] >= 2 * HUGE_PAGE
    if not HUGE:
        pytest.skip(f"shmem_enabled is {read_setting()!r}: no huge pages to check here")
    assert later["pmd_kb"] * 1024 >= edited["nbytes"], later
    assert later["misalignment"] < 64, later  # Note [Large storages on huge pages]
