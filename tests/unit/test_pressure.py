"""overmind.server.pressure: the headroom rule, the budget under a cgroup limit, and the order in
which the cache lets go (Note [The cache gives way]). The memory the guard sees is a fixture tree
of /proc and /sys files (overmind.shared.settings.host_memory reads under any root); the registry, the
settler, their memfds and the model file are real."""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

import pytest

from overmind.server import pressure
from overmind.server.pool import WarmPool
from overmind.server.pressure import Guard, default_headroom
from overmind.server.registry import CacheEntry, Registry, default_budget
from overmind.server.settle import Settler
from overmind.shared import protocol as P
from overmind.shared.settings.config import Config
from overmind.shared.settings.host_memory import HostMemory
from overmind.shared.segments.memfd import Segment, is_sealed_memfd

GIB = 1 << 30


def _proc(root: Path, total: int, available: int, stall_us: int | None = None) -> Path:
    """A machine of ``total`` bytes with ``available`` of them available, in no memory cgroup."""
    (root / "proc/self").mkdir(parents=True, exist_ok=True)
    (root / "proc/meminfo").write_text(f"MemTotal: {total // 1024} kB\nMemAvailable: {available // 1024} kB\n")
    (root / "proc/self/cgroup").write_text("0::/\n")
    (root / "proc/self/mountinfo").write_text("")
    if stall_us is not None:
        (root / "proc/pressure").mkdir(exist_ok=True)
        (root / "proc/pressure/memory").write_text(
            f"some avg10=0.00 avg60=0.00 avg300=0.00 total={stall_us}\n"
            f"full avg10=0.00 avg60=0.00 avg300=0.00 total={stall_us // 2}\n")
    return root


def _guard(root: Path, registry: Registry | None = None, settler: Settler | None = None, clock=None) -> Guard:
    """A guard with a 2 GiB headroom over the machine of the fixture tree ``root``, its settler
    held back by it as the server's is; an empty registry and settler unless given."""
    config = Config.from_env({"OVERMIND_HEADROOM": "2G"})
    registry = registry if registry is not None else Registry(GIB)
    settler = settler if settler is not None else Settler(registry, None, threading.Event())
    guard = Guard(config, registry, WarmPool(config), settler, None, threading.Event(),
                  host=HostMemory.read(str(root)), clock=clock or time.monotonic)
    settler.pressed = guard.pressed
    return guard


def test_the_default_headroom_is_a_tenth_of_the_memory_between_1_and_8_gib():
    assert default_headroom(24 * GIB) == int(2.4 * GIB)
    assert default_headroom(4 * GIB) == GIB  # a tenth would leave a small container no room to breathe
    assert default_headroom(2 * GIB) == GIB // 2  # but never more than a quarter of it
    assert default_headroom(512 * GIB) == 8 * GIB


def test_under_a_12_gib_cgroup_limit_the_default_budget_is_at_most_6_gib(tmp_path):
    _proc(tmp_path, 64 * GIB, 60 * GIB)
    (tmp_path / "proc/self/cgroup").write_text("0::/pod/job\n")
    (tmp_path / "proc/self/mountinfo").write_text("30 20 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw\n")
    cgroup = tmp_path / "sys/fs/cgroup"
    (cgroup / "pod/job").mkdir(parents=True)
    (cgroup / "cgroup.controllers").write_text("cpu memory pids\n")
    (cgroup / "pod/memory.max").write_text(f"{12 * GIB}\n")  # the pod's limit binds the job under it
    (cgroup / "pod/job/memory.max").write_text("max\n")
    memory = HostMemory.read(str(tmp_path))
    assert memory.limit.bytes == 12 * GIB and "/pod" in memory.limit.source
    assert default_budget(memory.limit.bytes) <= 6 * GIB
    guard = Guard(Config.from_env({}), Registry(GIB), None, None, None, threading.Event(), host=memory)
    assert guard.headroom == default_headroom(12 * GIB)
    assert guard.describe()["limit_from"] == memory.limit.source


def _model_file(path: Path, nbytes: int) -> tuple[int, list]:
    path.write_bytes(os.urandom(nbytes))
    fd = os.open(path, os.O_RDONLY)
    st = os.fstat(fd)
    return fd, [str(path), st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev, st.st_ctime_ns]


def _sealed(nbytes: int) -> Segment:
    seg = Segment.create("test", nbytes)
    seg.write_at(0, b"\x02" * nbytes)
    seg.seal()
    return seg


def _cache(tmp_path: Path) -> tuple[Registry, Settler, tuple[int, int]]:
    """A registry with "old" (a model file, settled into a sealed memfd) and, used later, "new" (a memfd)."""
    registry = Registry(budget=GIB)
    fd, record = _model_file(tmp_path / "model.safetensors", 1 << 20)
    registry.add(CacheEntry("old", "t", "old", b"s", [[fd, record[1]]], 0, [], P.LoadMeta(files=[record])))
    seg = _sealed(1 << 16)
    registry.add(CacheEntry("new", "t", "new", b"s", [[os.dup(seg.fd), seg.size]], 0, [], P.LoadMeta()))
    seg.close()
    registry.entry("old").last_used -= 10
    settler = Settler(registry, idle_after=0, stopping=threading.Event())
    (ident, size, source), = registry.file_segments()
    settler._settle_one(ident, size, source, pause=False)  # noqa: SLF001 - the copy an idle server makes
    os.close(source)
    assert not registry.entry("old").files and is_sealed_memfd(registry.entry("old").slots[0][0])
    return registry, settler, ident


def test_memory_short_lets_go_cheapest_first_settled_files_then_entries_that_hold_memfds(tmp_path, caplog):
    registry, settler, file_ident = _cache(tmp_path)
    root = _proc(tmp_path / "root", 24 * GIB, GIB)
    guard = _guard(root, registry, settler)
    with caplog.at_level(logging.INFO, logger="overmind.server"):
        guard.tick()
    assert guard.pressed() and settler.pressed()
    event = guard.describe()["last_event"]
    assert event["let_go"] == {"copies": 0, "unsettled": 1, "unsettled_bytes": 1 << 20, "interpreters": 0,
                               "entries": 1, "entry_bytes": 1 << 16}
    # "old" now holds only its model file's pages, which the kernel reclaims itself: it stays, a hit
    assert registry.keys() == ["old"] and registry.get("old") is not None and event["seconds"] is not None
    steps = [r.getMessage() for r in caplog.records if "serving file segment" in r.getMessage()
             or r.getMessage().startswith("evicted")]
    # the settled copy goes back to its file first (still a hit), then the entries that hold memfds
    assert [s.split()[0] + " " + s.split()[1] for s in steps] == ["serving file", "evicted new"], steps
    assert sum(r.getMessage().startswith("memory is short") for r in caplog.records) == 1
    guard.tick()  # still short, nothing left: the same event, said once
    assert guard.describe()["events"] == 1 and sum(r.getMessage().startswith("memory is short") for r in caplog.records) == 1


def test_a_settled_segment_goes_back_to_its_unchanged_file_and_stays_a_hit(tmp_path):
    registry, settler, file_ident = _cache(tmp_path)
    memfd_ident = registry.entry("old").slot_ids[0]
    assert settler.unsettle_one(registry.segments_least_recent_first()) == (file_ident, 1 << 20)
    entry = registry.entry("old")
    assert entry.slot_ids == [file_ident] and entry.files == {file_ident} and not is_sealed_memfd(entry.slots[0][0])
    assert registry.get("old") is not None and memfd_ident not in registry.segments_least_recent_first()
    assert settler.unsettle_one(registry.segments_least_recent_first()) is None  # nothing settled is left


def test_a_settled_segment_whose_file_changed_stays_settled(tmp_path):
    registry, settler, _ = _cache(tmp_path)
    memfd_ident = registry.entry("old").slot_ids[0]
    path = tmp_path / "model.safetensors"
    os.utime(path, ns=(0, 0))  # the same inode, another mtime: not the bytes that were copied
    assert settler.unsettle_one(registry.segments_least_recent_first()) is None
    assert registry.entry("old").slot_ids == [memfd_ident]


def test_the_guard_waits_for_the_headroom_and_slack_then_calm_before_room_for_more(tmp_path):
    clock = _Clock()
    root = _proc(tmp_path, 24 * GIB, GIB)
    guard = _guard(root, clock=clock)
    guard.tick()
    assert guard.pressed() and not guard.room_for(0)
    _proc(tmp_path, 24 * GIB, 2 * GIB + (100 << 20))  # past the headroom, not past its slack (0.2 GiB)
    guard.tick()
    assert guard.pressed()
    _proc(tmp_path, 24 * GIB, 4 * GIB)
    guard.tick()
    assert guard.pressed()  # one job's growth is one event: it ends once nothing was short for a while
    clock.now += pressure.END_AFTER
    guard.tick()
    assert not guard.pressed() and guard.describe()["last_event"]["ended"] is not None
    assert not guard.room_for(0)  # calm first
    clock.now += pressure.CALM
    assert guard.room_for(GIB) and not guard.room_for(2 * GIB)  # what stays free must keep the headroom and slack


class _Clock:
    """Seconds that pass only when the test says so."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_stalls_on_memory_press_only_when_memory_is_also_getting_low(tmp_path):
    clock = _Clock()
    root = _proc(tmp_path, 24 * GIB, 3 * GIB, stall_us=0)
    guard = _guard(root, clock=clock)
    guard.tick()  # the first look has nothing to compare with
    _proc(tmp_path, 24 * GIB, 3 * GIB, stall_us=300_000)  # 30 % of the last second stalled, under 2 x headroom
    clock.now += 1
    guard.tick()
    assert guard.pressed() and "stalled" in guard.describe()["last_event"]["why"]


def test_stalls_with_plenty_of_memory_available_are_not_ours_to_answer(tmp_path):
    clock = _Clock()
    root = _proc(tmp_path, 24 * GIB, 12 * GIB, stall_us=0)
    guard = _guard(root, clock=clock)
    guard.tick()
    _proc(tmp_path, 24 * GIB, 12 * GIB, stall_us=500_000)
    clock.now += 1
    guard.tick()
    assert not guard.pressed()


@pytest.mark.parametrize("value", ["2G", "5%"])
def test_the_headroom_setting_is_a_size_or_a_share(value, tmp_path):
    root = _proc(tmp_path, 24 * GIB, 20 * GIB)
    guard = Guard(Config.from_env({"OVERMIND_HEADROOM": value}), Registry(GIB), None, None, None, threading.Event(),
                  host=HostMemory.read(str(root)))
    assert 0 < guard.headroom <= 24 * GIB


def test_entries_go_least_recently_used_first_and_a_file_only_entry_not_at_all(tmp_path):
    registry = Registry(budget=GIB)
    fd, record = _model_file(tmp_path / "weights.bin", 1 << 16)
    registry.add(CacheEntry("file", "t", "file", b"s", [[fd, record[1]]], 0, [], P.LoadMeta(files=[record])))
    for key in ("newer", "older"):
        seg = _sealed(1 << 12)
        registry.add(CacheEntry(key, "t", key, b"s", [[os.dup(seg.fd), seg.size]], 0, [], P.LoadMeta()))
        seg.close()
    registry.entry("older").last_used -= 10
    registry.entry("file").last_used -= 20  # the least recent of all, and still not evicted
    assert registry.evict_least_recent()[0] == "older"
    assert registry.evict_least_recent()[0] == "newer"
    assert registry.evict_least_recent() is None and registry.keys() == ["file"]


def test_an_evicted_pipeline_is_refilled_after_the_entries_it_refers_to():
    """Restore.bring_back's order: newest first, each after its references (a pipeline's vae=vae),
    else the pipeline's refill finds them missing and the pipeline does not come back."""
    from types import SimpleNamespace

    from overmind.server.restore import _refs_first

    def record(key: str, refs=()) -> dict:
        return {"request": SimpleNamespace(key=key, refs=list(refs))}

    newest_first = [record("pipeline", ["vae", "controlnet"]), record("lm"), record("controlnet"), record("vae")]
    assert [r["request"].key for r in _refs_first(newest_first)] == ["vae", "controlnet", "pipeline", "lm"]


def test_stalls_that_go_on_let_go_one_thing_a_window(tmp_path):
    registry, settler, _ = _cache(tmp_path)
    clock = _Clock()
    root = _proc(tmp_path / "root", 24 * GIB, 3 * GIB, stall_us=0)
    guard = _guard(root, registry, settler, clock)
    guard.tick()
    for second in (1, 2):  # 30 % of each second stalled, 3 GiB available: under 2 x headroom, over the headroom
        _proc(tmp_path / "root", 24 * GIB, 3 * GIB, stall_us=300_000 * second)
        clock.now += 1
        guard.tick()
        guard.tick()  # a second look in the same window takes nothing more
        let_go = guard.describe()["last_event"]["let_go"]
        assert let_go["unsettled"] + let_go["entries"] == second, let_go
    assert guard.pressed()
