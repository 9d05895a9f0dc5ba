"""overmind.server.registry: memory counted once per segment, and the content index loaders read."""

from __future__ import annotations

import os

from overmind.shared import protocol as P
from overmind.shared.segments.memfd import Segment
from overmind.server.registry import CacheEntry, Registry


def _sealed(nbytes: int) -> Segment:
    seg = Segment.create("test", nbytes)
    seg.write_at(0, b"\x01" * nbytes)
    seg.seal()
    return seg


def _entry(key: str, segments: list, contents: list) -> CacheEntry:
    slots = [[os.dup(seg.fd), seg.size] for seg in segments]
    return CacheEntry(key, "t", key, b"skeleton", slots, 0, [], P.LoadMeta(), contents=contents)


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
    assert registry.content_index() == {"keys": [], "handles": [], "regions": []}
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


def test_segment_fds_are_duplicates_of_that_entrys_segments():
    seg = _sealed(1 << 12)
    registry = Registry(budget=1 << 30)
    registry.add(_entry("a", [seg], []))
    sizes, fds = registry.segment_fds("a")
    registry.evict(["a"])  # closing the entry's fds leaves ours working
    assert sizes == [seg.size] and len(fds) == 1
    st, mine = os.fstat(fds[0]), os.fstat(seg.fd)
    assert (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)
    os.close(fds[0])
    assert registry.segment_fds("a") is None
    seg.close()


def test_a_hit_reply_names_each_segment_by_number_and_identity():
    seg = _sealed(1 << 12)
    registry = Registry(budget=1 << 30)
    registry.add(_entry("a", [seg], []))
    reply = registry.get("a")
    st = os.fstat(seg.fd)
    assert len(reply.handles) == 1 and reply.handles[0][1:] == [seg.size, st.st_dev, st.st_ino]
    registry.evict(["a"])
    seg.close()


def test_thousands_of_entries_list_over_a_real_socket():
    import json
    import socket

    registry = Registry(budget=1 << 30)
    for i in range(5000):
        registry.add(CacheEntry(f"{i:032x}", "mod:fn", f"fn('/models/{i:05d}/a/rather/long/path')", b"s", [], 0, [],
                                P.LoadMeta(files=[[f"/models/{i:05d}/config.json", 1, 2, 3, 4]])))
    entries = registry.summaries()
    assert len(json.dumps(entries)) > P.MAX_JSON  # as fields this would not fit in one frame
    a, b = socket.socketpair()
    with a, b:
        sender = __import__("threading").Thread(
            target=P.send_message, args=(a, P.EntryList(len(entries)), json.dumps(entries).encode()))
        sender.start()
        message, blob, _ = P.recv_message(b)
        sender.join()
    assert message.count == 5000 and len(json.loads(blob)) == 5000


def test_a_programs_last_process_is_what_its_next_process_is_told():
    from overmind.server.programs import MAX_KEYS, ProgramHistory

    history = ProgramHistory()
    for key in ("a", "b", "a"):
        history.record("prog", 100, key)
    assert history.last("prog", 101) == ["a", "b"]  # the next process asks before it loads
    history.record("prog", 101, "c")
    assert history.last("prog", 102) == ["c"]
    assert history.last("prog", 101) == ["a", "b"]  # asking again from 101: its predecessor's
    assert history.last("other", 1) == []
    for i in range(MAX_KEYS + 10):
        history.record("big", 7, f"k{i}")
    assert len(history.last("big", 8)) == MAX_KEYS


def test_contents_a_loader_sends_after_its_answer_join_its_entry_while_it_is_filed():
    seg = _sealed(1 << 13)
    entry = _entry("a", [seg], [["aa" * 16, 4096, 0, 0]])
    registry = Registry(budget=1 << 30)
    registry.add(entry)
    later = [["bb" * 16, 4096, 0, 4096], ["cc" * 16, -1, 0, 0], "garbage", ["dd" * 16, 4096, 0, 1.5]]
    assert registry.add_contents(entry, later) == 1  # the malformed ones are dropped
    assert sorted(r[0] for r in registry.content_index()["regions"]) == ["aa" * 16, "bb" * 16]
    assert registry.add_contents(entry, {"not": "a list"}) == 0
    # An entry evicted (or replaced by another of its key) meanwhile takes nothing.
    registry.evict(["a"])
    assert registry.add_contents(entry, [["ee" * 16, 4096, 0, 0]]) == 0
    assert registry.content_index()["regions"] == []
    seg.close()
