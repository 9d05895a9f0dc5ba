"""overmind.registry: memory counted once per segment, and the content index loaders read."""

from __future__ import annotations

import os

from overmind.memfd import Segment
from overmind.registry import CacheEntry, Registry


def _sealed(nbytes: int) -> Segment:
    seg = Segment.create("test", nbytes)
    seg.write_at(0, b"\x01" * nbytes)
    seg.seal()
    return seg


def _entry(key: str, segments: list, contents: list) -> CacheEntry:
    slots = [[os.dup(seg.fd), seg.size] for seg in segments]
    return CacheEntry(key, "t", key, b"skeleton", slots, 0, [], {}, contents=contents)


def test_shared_segments_are_counted_once_and_indexed_by_inode():
    own, other = _sealed(1 << 16), _sealed(1 << 12)
    registry = Registry(budget=1 << 30)
    registry.add(_entry("a", [own], [["aa" * 16, 4096, 0, 0], ["bb" * 16, 4096, 0, 4096]]))
    # b wrote `other` and maps a's segment as its slot 1, where it found content "aa"
    registry.add(_entry("b", [other, own], [["cc" * 16, 4096, 0, 0], ["aa" * 16, 4096, 1, 0]]))
    assert registry.used() == own.size + other.size
    summaries = {s["key"]: s for s in registry.summaries()}
    assert (summaries["a"]["bytes_owned"], summaries["a"]["bytes_shared"]) == (0, own.size)
    assert (summaries["b"]["bytes_owned"], summaries["b"]["bytes_shared"]) == (other.size, own.size)

    index = registry.content_index()
    st_own, st_other = os.fstat(own.fd), os.fstat(other.fd)
    regions = {(r[0], r[5]): (index["keys"][r[2]], r[3], r[4]) for r in index["regions"]}
    # one region per (segment, offset), however many entries list it
    assert len(index["regions"]) == 3
    assert regions[("aa" * 16, 0)][1:] == regions[("bb" * 16, 4096)][1:] == (st_own.st_dev, st_own.st_ino)
    assert regions[("cc" * 16, 0)] == ("b", st_other.st_dev, st_other.st_ino)

    registry.evict(["b"])
    assert {r[0] for r in registry.content_index()["regions"]} == {"aa" * 16, "bb" * 16}
    registry.evict(["a"])
    assert registry.content_index() == {"keys": [], "regions": []}
    own.close()
    other.close()


def test_malformed_content_records_from_a_loader_are_dropped():
    seg = _sealed(1 << 12)
    entry = _entry("a", [seg], [["aa" * 16, 4096, 0, 0], ["x"], "y", [1, 2, 3, 4], ["bb" * 16, 4096, 7, 0]])
    registry = Registry(budget=1 << 30)
    registry.add(entry)
    assert [r[0] for r in registry.content_index()["regions"]] == ["aa" * 16]  # slot 7 does not exist
    registry.evict(["a"])
    seg.close()
