"""overmind.server.fills (with overmind.server.failures, overmind.server.joins and
overmind.server.loaders), and the cold loads that use it, without a server: admission (single
flight, remembered failures, the cap), joining a fill and giving up on it, the CPU priority of a
fill's loader and who lends it theirs, an entry evicted while a fill runs, and the server's status
taken while a fill ends.

Real classes, real threads, real sockets (``socketpair``) and real processes standing in for a
loader or a caller (their scheduling policy is read from /proc). Note [Cold fills wait for their
caller] and Note [Cold fills yield to their caller] in overmind.server.fills, Note [Joining a
fill] in overmind.server.joins and Note [Only deterministic failures are remembered] in
overmind.server.failures.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from overmind.shared import protocol as P
from overmind.shared.process.priority import can_lift_idle
from overmind.shared.settings.config import Config
from overmind.shared.segments.memfd import Segment
from overmind.server import failures as FL
from overmind.server import fills as F
from overmind.server import joins as J
from overmind.server.loads import Loads
from overmind.server.fills import Fills
from overmind.server.joins import Joins
from overmind.server.pool import LoadFailure, WarmPool
from overmind.server.programs import ProgramHistory
from overmind.server.registry import CacheEntry, Registry

# Lifting a SCHED_IDLE loader back takes root, CAP_SYS_NICE or RLIMIT_NICE 20; a server without
# them fills at nice 10 instead (test_fills.test_where_idle_could_not_be_lifted_a_fill_takes_nice_10_instead).
lifts_idle = pytest.mark.skipif(not can_lift_idle(), reason="lifting SCHED_IDLE back needs root, "
                                "CAP_SYS_NICE or RLIMIT_NICE 20; without them fills take nice 10")

KEY, OTHER = "a" * 32, "b" * 32
MB = 1 << 20
LOG = "overmind.server"


def _config(tmp_path, **values) -> Config:
    return Config(tmp_path / "run", **values)


def _fills(tmp_path, max_fills: int = F.MAX_FILLS, **values) -> Fills:
    return Fills(_config(tmp_path, **values), Registry(budget=1 << 30), max_fills)


def _loads(tmp_path, **values) -> Loads:
    """Cold loads over a pool that starts nothing: each test starts its fills itself (``admit``),
    so no loader runs; what a loader would do, the test does."""
    config = _config(tmp_path, **values)
    return Loads(config, Registry(budget=1 << 30), WarmPool(config), ProgramHistory())


def _request(tmp_path, key: str = KEY, **fields) -> P.Load:
    context = {"python": sys.executable, "cwd": str(tmp_path), "sys_path": [], "env": {"HOME": "/x"}}
    return P.Load(**{"key": key, "target": "mod:load", "description": "load(...)", "context": context,
                     "wait": False, **fields})


def _entry(key: str = KEY, nbytes: int = 1 << 12) -> CacheEntry:
    """What a fill files: an entry over one sealed segment (the registry owns the fd)."""
    seg = Segment.create("test", nbytes)
    seg.write_at(0, b"\x01" * nbytes)
    seg.seal()
    try:
        return CacheEntry(key, "mod:load", "load(...)", b"skeleton", [[os.dup(seg.fd), seg.size]], nbytes, [],
                          P.LoadMeta())
    finally:
        seg.close()


class _Clock:
    """The fills' clock (``Fills.clock``), moved only by the test: a fill's pace is what the test says."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _packing(fills: Fills, fill: F.Fill, written: int, expected: int, original: float = 0.0,
             seconds: float = 1.0) -> None:
    """The fill's loader began its pack (its first report: nothing in place yet) unless it had,
    and ``seconds`` later reported ``written`` of ``expected`` bytes; the fills' clock then
    stands still."""
    if not isinstance(fills.clock, _Clock):
        fills.clock = _Clock()
    if not fill.packing_since:
        fills.clock.now += 0.01  # a moment after whoever looked last
        fills.progress(fill, 0, expected, original)
    fills.clock.now += seconds
    fills.progress(fill, written, expected, original)


def _filling(tmp_path, caplog, written: int, expected: int, plain: float) -> tuple[Loads, F.Fill]:
    """Cold loads with a background fill of KEY packing (``_packing``), whose caller loaded it
    plainly in ``plain`` seconds; the log captured."""
    caplog.set_level(logging.INFO, LOG)
    loads = _loads(tmp_path)
    fill = loads.fills.admit(KEY, background=True, caller=1).fill
    _packing(loads.fills, fill, written, expected)
    loads.joins.remember_plain_seconds(KEY, plain)
    return loads, fill


def _waiter(loads: Loads, sock: socket.socket, peer: socket.socket, tmp_path) -> threading.Thread:
    """Process 4242 loads KEY on ``sock`` and waits for the cache (``OVERMIND_COLD=wait``); its
    ``Pending(waiting=True)`` is read from ``peer``."""
    waiter = _start(loads.load, sock, _request(tmp_path, wait=True), b"call", 4242)
    assert P.recv_message(peer)[0] == P.Pending(KEY, True, "", waiting=True)
    return waiter


def _joined_and_given_up(loads: Loads, tmp_path) -> float:
    """Process 4242 loads KEY, joins its fill and is told to load plainly after all (its
    ``Pending(waiting=True)``, then the give-up); the seconds that took."""
    a, b = socket.socketpair()
    with a, b:
        started = time.monotonic()
        loads.load(a, _request(tmp_path), b"call", 4242)
        waited = time.monotonic() - started
        assert P.recv_message(b)[0] == P.Pending(KEY, True, "", waiting=True)
        assert P.recv_message(b)[0] == P.Pending(KEY, True, "the fill took longer than a plain load")
    return waited


def _joined_and_served(loads: Loads, fill: F.Fill, tmp_path, meanwhile) -> P.Message:
    """Process 4242 loads KEY and joins its fill; ``meanwhile()`` runs while it waits, then the
    fill files its entry. What 4242 got after its ``Pending(waiting=True)``."""
    a, b = socket.socketpair()
    with a, b:
        joiner = _start(loads.load, a, _request(tmp_path), b"call", 4242)
        assert P.recv_message(b)[0] == P.Pending(KEY, True, "", waiting=True)
        _until(lambda: loads.fills.lenders.get(KEY) == 1)  # it waits, lending the fill its priority
        meanwhile()
        fill.entry = _entry()
        loads.registry.add(fill.entry)
        loads.fills.finish(fill, remember=False)
        served = P.recv_message(b)[0]
        joiner.join()
    return served


def _start(target, *args) -> threading.Thread:
    thread = threading.Thread(target=target, args=args, daemon=True)
    thread.start()
    return thread


def _until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.fixture
def loader():
    """A process standing in for a fill's loader: two threads, doing nothing."""
    proc = subprocess.Popen([sys.executable, "-c", "import threading, time\n"
                             "threading.Thread(target=time.sleep, args=(60,)).start()\nprint(flush=True)\n"
                             "time.sleep(60)"], stdout=subprocess.PIPE)
    proc.stdout.readline()  # both threads run
    yield proc.pid
    proc.kill()
    proc.wait()


def _policies(pid: int) -> set:
    return {os.sched_getscheduler(int(tid)) for tid in os.listdir(f"/proc/{pid}/task")}


def _nices(pid: int) -> set:
    return {os.getpriority(os.PRIO_PROCESS, int(tid)) for tid in os.listdir(f"/proc/{pid}/task")}


IDLE, NORMAL = {os.SCHED_IDLE}, {os.SCHED_OTHER}


# -- admission: single flight, the cap, remembered failures ----------------------------------------


def _fail(fills: Fills, key: str, code: int, remember: bool, text: str = "boom") -> None:
    admission = fills.admit(key)
    assert admission.started, admission
    admission.fill.error = P.Error(code, text, "tb" * 100_000)
    fills.finish(admission.fill, remember=remember)


def test_one_fill_per_key_and_the_cap_on_fills_answers_busy(tmp_path):
    fills = _fills(tmp_path, max_fills=3)
    started = [fills.admit(f"k{i}") for i in range(3)]
    assert all(a.started and a.fill is not None for a in started)
    busy = fills.admit("k3")
    assert busy.busy and not busy.started and busy.fill is None
    again = fills.admit("k0")
    assert again.fill is started[0].fill and not again.started  # single flight
    assert fills.counters() == {"misses": 3, "plain_loads": 0, "loading": 3, "remembered_failures": 0}
    assert fills.in_flight_besides("k0") and not _fills(tmp_path).in_flight_besides("k0")


def test_a_finished_fill_is_a_hit_and_a_refill_counts_no_hit_or_miss(tmp_path):
    fills = _fills(tmp_path)
    fill = fills.admit(KEY, count=False).fill  # a restore's refill
    fill.entry = _entry()
    fills.registry.add(fill.entry)
    fills.finish(fill, remember=False)
    assert fill.done.is_set() and fills.counters()["loading"] == 0
    assert fills.admit(KEY, count=False).reply is not None
    assert (fills.counters()["misses"], fills.registry.counters()["hits"]) == (0, 0)
    hit = fills.admit(KEY)
    assert hit.reply is not None and hit.reply.key == KEY and hit.fill is None
    assert fills.registry.counters()["hits"] == 1
    fills.registry.clear()


def test_a_lookup_starts_no_fill(tmp_path):
    fills = _fills(tmp_path)
    nothing = fills.admit(KEY, lookup_only=True)
    assert (nothing.reply, nothing.fill, nothing.failure, nothing.started) == (None, None, None, False)
    started = fills.admit(KEY)
    assert fills.admit(KEY, lookup_only=True).fill is started.fill


def test_a_raise_is_remembered_and_answered_without_a_new_load(tmp_path):
    fills = _fills(tmp_path)
    _fail(fills, "k", P.ErrorCode.LOADER_FAILED, remember=True)
    again = fills.admit("k")
    assert not again.started and again.failure is not None and again.failure.message == "boom"
    assert len(again.failure.traceback) <= FL.MAX_REMEMBERED_TEXT  # bounded text


def test_a_loader_death_is_retried_until_it_happens_max_deaths_times_in_a_row(tmp_path):
    fills = _fills(tmp_path)
    for _ in range(FL.MAX_DEATHS):
        _fail(fills, "k", P.ErrorCode.LOADER_CRASHED, remember=False)
    assert fills.counters()["misses"] == FL.MAX_DEATHS  # each death was tried again
    stop = fills.admit("k")
    assert not stop.started and stop.failure.code == P.ErrorCode.LOADER_CRASHED


def test_a_fill_that_succeeds_forgets_the_deaths_before_it(tmp_path):
    fills = _fills(tmp_path)
    for _ in range(FL.MAX_DEATHS - 1):
        _fail(fills, "k", P.ErrorCode.LOADER_CRASHED, remember=False)
    fill = fills.admit("k").fill
    fill.entry = _entry("k")
    fills.finish(fill, remember=False)  # the entry was evicted at once: never filed
    for _ in range(FL.MAX_DEATHS - 1):
        _fail(fills, "k", P.ErrorCode.LOADER_CRASHED, remember=False)
    assert fills.admit("k").started  # not MAX_DEATHS in a row
    fill.entry.close()


def test_remembered_failures_are_bounded_however_many_keys_fail(tmp_path):
    fills = _fills(tmp_path)
    for i in range(FL.MAX_FAILURES + 500):
        _fail(fills, f"{i:032x}", P.ErrorCode.LOADER_FAILED, remember=True, text="x" * 100_000)
    assert fills.counters()["remembered_failures"] == FL.MAX_FAILURES
    assert fills.admit(f"{0:032x}").started  # the oldest was forgotten: it may be tried again


def test_a_failure_is_forgotten_after_its_ttl(tmp_path, monkeypatch):
    fills = _fills(tmp_path)
    _fail(fills, "k", P.ErrorCode.LOADER_FAILED, remember=True)
    monkeypatch.setattr(FL, "FAILURE_TTL", 0.0)
    assert fills.admit("k").started


def test_a_waiter_that_came_first_makes_the_fill_wanted(tmp_path):
    fills = _fills(tmp_path)
    with fills.waiting(KEY, 1234):
        fill = fills.admit(KEY, background=True, caller=1).fill
    assert not fill.background and fill.wanted.is_set()
    assert fills.admit(OTHER, background=True, caller=1).fill.background


def test_a_fills_waiters_get_its_failure_and_the_next_caller_the_remembered_one(tmp_path):
    loads = _loads(tmp_path)
    fill = loads.fills.admit(KEY, background=True).fill
    a, b = socket.socketpair()
    with a, b:
        waiter = _waiter(loads, a, b, tmp_path)
        fill.error = P.Error(P.ErrorCode.LOADER_FAILED, "it raised")
        loads.fills.finish(fill, remember=True)
        assert P.recv_message(b)[0] == P.Error(P.ErrorCode.LOADER_FAILED, "it raised")
        waiter.join()
        loads.load(a, _request(tmp_path), b"call", 4243)  # a caller that does not wait loads plainly at once
        assert P.recv_message(b)[0] == P.Pending(KEY, False, "it raised", code=P.ErrorCode.LOADER_FAILED)


# -- joining a fill: Note [Joining a fill] ----------------------------------------------------------


def test_a_fill_that_should_end_before_a_plain_load_is_joined_and_serves_its_waiter(tmp_path, caplog):
    loads, fill = _filling(tmp_path, caplog, 60 * MB, 64 * MB, plain=5.0)  # 4 MB to go at 60 MB/s

    def lifted() -> None:
        assert not fill.background and fill.wanted.is_set()

    served = _joined_and_served(loads, fill, tmp_path, lifted)
    assert isinstance(served, P.Entry) and served.key == KEY and served.hit
    assert loads.fills.lenders == {}
    assert loads.counters()["joined"] == 1 and loads.registry.counters()["hits"] == 1
    assert "pid 4242 joins the fill of" in caplog.text
    assert f"pid 4242 joined the fill of {KEY[:16]}: served" in caplog.text
    loads.registry.clear()


@pytest.mark.timeout(60)
def test_a_joined_fill_slower_than_a_plain_load_is_given_up_after_that_plain_loads_time(tmp_path, caplog):
    loads, fill = _filling(tmp_path, caplog, 60 * MB, 64 * MB, plain=0.5)
    waited = _joined_and_given_up(loads, tmp_path)  # the fill never ends
    assert 0.5 <= waited < 30, waited  # not the loader timeout
    assert loads.counters()["joined"] == 1 and not fill.done.is_set()
    assert f"pid 4242 joined the fill of {KEY[:16]}: gave up" in caplog.text
    assert "weighs the fill" not in caplog.text  # no news of the pack since: not weighed again


def _joining_the_original(tmp_path, caplog, loader, plain: float) -> tuple[Loads, F.Fill]:
    """Cold loads with a background fill of KEY whose loader (``loader``) runs the original, its
    caller's plain load ``plain`` seconds; the log captured."""
    caplog.set_level(logging.INFO, LOG)
    loads = _loads(tmp_path)
    loads.fills.clock = _Clock()
    fill = loads.fills.admit(KEY, background=True, caller=1).fill
    loads.fills.forked(fill, loader)
    loads.joins.remember_plain_seconds(KEY, plain)
    return loads, fill


def _renewed_and_served(loads: Loads, fill: F.Fill, tmp_path, caplog, news) -> None:
    """Process 4242 loads KEY and joins its fill; ``news()`` then comes of its pack during the
    wait; once the join ran out and was weighed again, the fill files its entry: 4242 is served
    it, as one join and one hit."""
    def meanwhile() -> None:
        news()
        _until(lambda: "weighs the fill" in caplog.text and loads.fills.lenders.get(KEY) == 1)  # it waits again

    served = _joined_and_served(loads, fill, tmp_path, meanwhile)
    assert isinstance(served, P.Entry) and served.key == KEY and served.hit
    assert f"pid 4242 joined the fill of {KEY[:16]} again: served" in caplog.text
    assert loads.counters()["joined"] == 1 and loads.registry.counters()["hits"] == 1
    loads.registry.clear()


@pytest.mark.timeout(60)
def test_a_join_that_runs_out_after_the_pack_began_is_renewed_and_served(tmp_path, caplog, loader):
    """Note [Joining a fill]: joined while the loader ran the original; its pack begins during the
    wait and ends just after it: the caller waits on, and is served, rather than load plainly."""
    loads, fill = _joining_the_original(tmp_path, caplog, loader, plain=0.5)
    started = time.monotonic()
    _renewed_and_served(loads, fill, tmp_path, caplog, lambda: _packing(loads.fills, fill, 60 * MB, 64 * MB))
    assert time.monotonic() - started >= 0.5
    assert f"pid 4242 joined the fill of {KEY[:16]}: gave up" in caplog.text
    assert f"pid 4242 weighs the fill of {KEY[:16]} again: it has begun to pack" in caplog.text


@pytest.mark.timeout(60)
def test_a_join_that_runs_out_while_its_pack_reports_it_nearly_done_is_renewed_and_served(tmp_path, caplog):
    """Note [Joining a fill]: joined while packing; by the time the wait runs out the pack has
    reported again, and says it ends sooner than a plain load: the caller waits on, is served."""
    loads, fill = _filling(tmp_path, caplog, 32 * MB, 64 * MB, plain=1.5)  # 32 MB to go at 32 MB/s: joined
    _renewed_and_served(loads, fill, tmp_path, caplog,  # news: 1 MB to go at 31.5 MB/s
                        lambda: _packing(loads.fills, fill, 63 * MB, 64 * MB, seconds=1.0))
    assert f"pid 4242 weighs the fill of {KEY[:16]} again: its pack reported how far it is" in caplog.text


@pytest.mark.timeout(60)
def test_a_join_is_renewed_at_most_max_renewals_times_however_good_the_news(tmp_path, caplog):
    """Note [Joining a fill]: a pack that keeps reporting it is nearly done, and never ends,
    costs the caller at most 1 + MAX_RENEWALS plain loads' time before it loads plainly."""
    loads, fill = _filling(tmp_path, caplog, 60 * MB, 64 * MB, plain=0.2)
    stop = threading.Event()

    def report() -> None:  # a report every 20 ms, each a little further on
        written = 60 * MB
        while not stop.wait(0.02):
            written = min(written + 1024, 64 * MB - 1)
            _packing(loads.fills, fill, written, 64 * MB, seconds=0.001)

    reporter = _start(report)
    try:
        waited = _joined_and_given_up(loads, tmp_path)
    finally:
        stop.set()
        reporter.join()
    assert 0.2 * (1 + J.MAX_RENEWALS) <= waited < 0.2 * (2 + J.MAX_RENEWALS), waited
    assert caplog.text.count(f"pid 4242 joined the fill of {KEY[:16]} again: gave up") == J.MAX_RENEWALS
    assert loads.counters()["joined"] == 1 and not fill.done.is_set()


@pytest.mark.timeout(60)
def test_a_join_that_runs_out_while_the_loader_still_runs_the_original_waits_once_more_then_loads_plainly(
        tmp_path, caplog, loader):
    """Note [Joining a fill]: with no news of a pack, the one renewal is for a loader still in the
    original; a fill that never packs costs two plain loads' time, not three."""
    loads, fill = _joining_the_original(tmp_path, caplog, loader, plain=0.3)
    waited = _joined_and_given_up(loads, tmp_path)  # the fill never packs
    assert 0.6 <= waited < 0.9, waited
    assert caplog.text.count(f"pid 4242 waits once more for the fill of {KEY[:16]}: its loader still runs the "
                             "original") == 1
    assert "weighs the fill" not in caplog.text and loads.counters()["joined"] == 1 and not fill.done.is_set()


@pytest.mark.timeout(60)
def test_a_join_that_runs_out_while_the_loader_still_runs_the_original_is_served_if_it_ends_soon_after(
        tmp_path, caplog, loader):
    """Note [Joining a fill]: ControlNet run 2's pipeline, whose pack began 58-107 ms after the
    caller gave up: the caller waits once more, and is served the entry rather than load plainly."""
    loads, fill = _joining_the_original(tmp_path, caplog, loader, plain=0.3)
    started = time.monotonic()
    served = _joined_and_served(loads, fill, tmp_path, lambda: _until(lambda: "waits once more" in caplog.text))
    assert isinstance(served, P.Entry) and served.key == KEY and served.hit
    assert time.monotonic() - started >= 0.3
    assert f"pid 4242 joined the fill of {KEY[:16]}: gave up" in caplog.text
    assert f"pid 4242 joined the fill of {KEY[:16]} again: served" in caplog.text
    assert loads.counters()["joined"] == 1 and loads.registry.counters()["hits"] == 1
    loads.registry.clear()


@pytest.mark.timeout(60)
def test_a_join_of_a_packing_fill_that_runs_out_without_news_loads_plainly(tmp_path, caplog, loader):
    """Note [Joining a fill]: waiting once more without news is for a loader still in the original;
    a pack that reported nothing since the caller joined is given up after one plain load's time."""
    loads, fill = _joining_the_original(tmp_path, caplog, loader, plain=0.3)
    _packing(loads.fills, fill, 60 * MB, 64 * MB)  # 4 MB to go at 60 MB/s: joined
    waited = _joined_and_given_up(loads, tmp_path)
    assert 0.3 <= waited < 0.6, waited
    assert "waits once more" not in caplog.text and "weighs the fill" not in caplog.text


def test_a_fill_with_far_to_go_is_not_joined(tmp_path, caplog):
    loads, fill = _filling(tmp_path, caplog, 1 * MB, 65 * MB, plain=1.0)  # 64 MB to go at 1 MB/s
    a, b = socket.socketpair()
    with a, b:
        loads.load(a, _request(tmp_path), b"call", 4242)
        assert P.recv_message(b)[0] == P.Pending(KEY, True, "")  # load plainly
    assert "pid 4242 loads plainly beside the fill" in caplog.text and "1 of 65 MB in place" in caplog.text
    assert loads.counters()["joined"] == 0 and loads.fills.lenders == {} and fill.background


def test_a_plain_load_is_weighed_at_what_the_loaders_original_took_when_less(tmp_path, caplog):
    caplog.set_level(logging.INFO, LOG)
    fills = _fills(tmp_path)
    joins = Joins(fills)  # Note [Joining a fill] in overmind.server.joins
    fill = fills.admit(KEY, background=True).fill
    _packing(fills, fill, 64 * MB, 80 * MB)  # 1/4 to go: 0.25 s at 64 MB/s
    assert joins.join(KEY, 1.0, 4242) == 1.0  # sooner than the caller's plain load
    assert "0.25s left against a plain load of 1.00s (the last plain load)" in caplog.text
    _packing(fills, fill, 64 * MB, 80 * MB, original=0.2, seconds=0.0)
    assert joins.join(KEY, 1.0, 4242) == 0.0  # not sooner than the loader's own call of the original
    assert "0.25s left against a plain load of 0.20s (the loader's call of the original)" in caplog.text
    assert fills.packing() == [{"key": KEY[:16], "written": 64 * MB, "expected": 80 * MB, "seconds": 1.0}]


def test_a_join_waits_at_least_the_floor_however_quick_a_plain_load(tmp_path, caplog, loader):
    """Note [Joining a fill]: ControlNet run 2 gave up the VAE's fill after a plain load's 0.03 s,
    twice, 1 ms before it was filed. Below JOIN_FLOOR a join waits JOIN_FLOOR, and a pack with
    less than that to go is joined."""
    caplog.set_level(logging.INFO, LOG)
    fills = _fills(tmp_path)
    joins = Joins(fills)  # Note [Joining a fill] in overmind.server.joins
    fill = fills.admit(KEY, background=True).fill
    fills.forked(fill, loader)
    assert joins.join(KEY, 0.03, 4242) == J.JOIN_FLOOR  # it runs the original
    _packing(fills, fill, 60 * MB, 64 * MB)  # 4 MB to go at 60 MB/s: 0.067 s
    assert joins.join(KEY, 0.03, 4242) == J.JOIN_FLOOR
    assert "0.07s left against a plain load of 0.03s" in caplog.text
    _packing(fills, fill, 30 * MB, 64 * MB)  # 34 MB to go at 30 MB/s: more than the floor
    assert joins.join(KEY, 0.03, 4242) == 0.0


def test_a_fills_pace_goes_on_from_its_last_report_until_its_reports_stop(tmp_path):
    """Note [Joining a fill]: a report is up to 0.1 s old; what the pack did since counts, at its
    pace up to that report, until reports are late (LATE_REPORT): then its pace is timed to now."""
    fills = _fills(tmp_path)
    joins = Joins(fills)  # Note [Joining a fill] in overmind.server.joins
    fill = fills.admit(KEY, background=True).fill
    _packing(fills, fill, 60 * MB, 64 * MB)  # 4 MB to go at 60 MB/s
    assert joins.remaining(KEY)[0] == pytest.approx(4 / 60)
    fills.clock.now += 0.05
    assert joins.remaining(KEY)[0] == pytest.approx(4 / 60 - 0.05)
    fills.clock.now += 0.05
    assert joins.remaining(KEY)[0] == 0.0  # it should have ended: nothing left to wait for at that pace
    fills.clock.now += J.LATE_REPORT  # no report since: stalled, its pace to now
    assert joins.remaining(KEY)[0] == pytest.approx(4 / 60 * (1.1 + J.LATE_REPORT))


def test_a_fill_with_no_loader_yet_or_a_key_with_no_plain_time_is_not_joined(tmp_path, loader, caplog):
    caplog.set_level(logging.INFO, LOG)
    fills = _fills(tmp_path)
    joins = Joins(fills)  # Note [Joining a fill] in overmind.server.joins
    fill = fills.admit(KEY, background=True).fill
    assert joins.join(KEY, 1.0, 4242) == 0.0  # waiting for a load slot or for the fills it refers to
    assert "pid 4242 loads aaaaaaaaaaaaaaaa plainly: its fill has no loader yet" in caplog.text
    fills.slot_taken(fill)  # all that is left is its loader's fork: joined as if it ran the original
    assert joins.join(KEY, 1.0, 4242) == 1.0
    assert "pid 4242 joins the fill of aaaaaaaaaaaaaaaa: its loader is being forked" in caplog.text
    fills.forked(fill, loader, fresh=True)  # an interpreter of its own, importing everything first
    assert joins.join(KEY, 1.0, 4242) == 0.0
    assert "plainly: its fill has a fresh interpreter for loader, still importing" in caplog.text
    fills.forked(fill, loader)
    assert joins.join(KEY, None, 4242) == 0.0
    assert joins.join(KEY, 1.0, 4242) == 1.0  # its loader runs the original: joined, for a plain load's time
    assert "pid 4242 joins the fill of aaaaaaaaaaaaaaaa: its loader runs the original" in caplog.text
    _packing(fills, fill, 64 * MB, 64 * MB)  # all in place
    assert joins.remaining(KEY) == (0.0, fill)
    assert joins.join(KEY, None, 4242) == 0.0  # no plain load to weigh it against
    assert joins.join(KEY, 0.1, 4242) == 0.1


def test_a_fill_whose_loader_is_being_forked_is_joined(tmp_path, caplog, monkeypatch):
    """Note [Joining a fill]: once a fill holds its load slot, all that is left before its loader
    runs the original is the fork: a caller that comes then joins it (ControlNet run 2 asked for
    the pipeline 8 ms before its loader was forked, and loaded it plainly)."""
    caplog.set_level(logging.INFO, LOG)
    loads = _loads(tmp_path)
    forking, fork_done = threading.Event(), threading.Event()

    def start_loader(*args, **kwargs):  # the warm interpreter takes its time to fork the loader
        forking.set()
        fork_done.wait(10)
        raise LoadFailure(P.ErrorCode.NOT_FORKABLE, "no loader in this test")

    monkeypatch.setattr(loads.pool, "start_loader", start_loader)
    fill = loads.fills.admit(KEY, background=True).fill
    assert loads.joins.join(KEY, 1.0, 4242) == 0.0  # no slot yet: nothing says it is close
    def fly() -> None:
        with pytest.raises(LoadFailure):
            loads.loaders.run(_request(tmp_path), b"call", 0, fill)

    flying = _start(fly)
    try:
        assert forking.wait(10)
        assert loads.joins.join(KEY, 1.0, 4242) == 1.0
        assert f"pid 4242 joins the fill of {KEY[:16]}: its loader is being forked" in caplog.text
    finally:
        fork_done.set()
        flying.join(10)


def test_a_caller_that_waits_for_the_cache_never_joins_it_but_waits_for_the_fill_to_end(tmp_path):
    loads = _loads(tmp_path)
    fill = loads.fills.admit(KEY, background=True).fill
    _packing(loads.fills, fill, 64 * MB, 64 * MB)  # all in place: a caller that may join would
    loads.joins.remember_plain_seconds(KEY, 0.2)
    a, b = socket.socketpair()
    with a, b:
        waiter = _waiter(loads, a, b, tmp_path)
        time.sleep(0.5)  # past its plain load's time: it still waits
        assert waiter.is_alive()
        fill.entry = _entry()
        loads.registry.add(fill.entry)
        loads.fills.finish(fill, remember=False)
        assert isinstance(P.recv_message(b)[0], P.Entry)
        waiter.join()
    assert loads.counters()["joined"] == 0
    loads.registry.clear()


# -- the loader's priority: Note [Cold fills yield to their caller] ---------------------------------


@lifts_idle
def test_a_fill_nobody_waits_for_yields_until_a_waiter_lends_it_normal_priority(tmp_path, loader, caplog):
    caplog.set_level(logging.INFO, LOG)
    fills = _fills(tmp_path)
    fills.can_lift_idle = True  # as for root, CAP_SYS_NICE or RLIMIT_NICE 20
    fill = fills.admit(KEY, background=True, caller=1).fill
    fills.forked(fill, loader)
    assert _policies(loader) == IDLE and fill.idle
    assert f"loader pid {loader} fills {KEY[:16]} at idle priority (SCHED_IDLE)" in caplog.text
    with fills.waiting(KEY, 4242):
        assert _policies(loader) == NORMAL and not fill.idle and fill.wanted.is_set()
    assert _policies(loader) == NORMAL  # lent for good
    assert "at normal priority now: pid 4242 waits for it" in caplog.text


def test_where_idle_could_not_be_lifted_a_fill_takes_nice_10_instead(tmp_path, loader, caplog):
    caplog.set_level(logging.INFO, LOG)
    fills = _fills(tmp_path)
    fills.can_lift_idle = False
    fill = fills.admit(KEY, background=True, caller=1).fill
    fills.forked(fill, loader)
    assert _policies(loader) == NORMAL and _nices(loader) == {F.FILL_NICE} and not fill.idle
    assert f"fills {KEY[:16]} at nice 10" in caplog.text


@pytest.mark.parametrize("wait, fill_yield", [(True, 120.0), (False, 0.0)])
def test_a_fill_someone_waits_for_or_with_yielding_off_runs_at_normal_priority(tmp_path, loader, caplog, wait,
                                                                               fill_yield):
    caplog.set_level(logging.INFO, LOG)
    fills = _fills(tmp_path, fill_yield=fill_yield)
    fills.can_lift_idle = True
    fill = fills.admit(KEY, background=not wait, caller=1).fill
    fills.forked(fill, loader)
    assert _policies(loader) == NORMAL and _nices(loader) == {0} and not fill.idle
    assert ("at normal priority (a caller waits for it)" in caplog.text) == wait


@lifts_idle
def test_a_fill_waiting_for_a_load_slot_lifts_the_fills_that_hold_them(tmp_path, loader, caplog):
    caplog.set_level(logging.INFO, LOG)
    fills = _fills(tmp_path)
    fills.can_lift_idle = True
    holder = fills.admit(OTHER, background=True, caller=1).fill
    fills.forked(holder, loader)
    queued = fills.admit(KEY, background=True, caller=1).fill  # not forked: waits for a slot
    assert _policies(loader) == IDLE
    with fills.waiting(KEY, 4242):
        assert _policies(loader) == NORMAL
    assert f"{KEY[:16]} waits for a load slot (pid 4242 waits for it)" in caplog.text and not queued.background


@lifts_idle
def test_a_fill_lends_the_fill_it_refers_to_its_priority_only_when_someone_waits_for_it(tmp_path, loader, caplog):
    caplog.set_level(logging.INFO, LOG)
    fills = _fills(tmp_path)
    fills.can_lift_idle = True
    referred = fills.admit(OTHER, background=True, caller=1).fill
    fills.forked(referred, loader)
    yielding = fills.admit(KEY, background=True, caller=1).fill
    with fills.depends(yielding, OTHER):  # neither is wanted: nothing lent
        assert _policies(loader) == IDLE and fills.waits == {KEY: OTHER}
        with fills.waiting(KEY, 4242):  # now the fill is wanted: the lift passes on
            assert _policies(loader) == NORMAL
    assert fills.waits == {} and fills.lenders == {}
    assert f"pid 4242 waits for it, through {KEY[:16]}" in caplog.text


@lifts_idle
def test_a_wanted_fill_that_refers_to_another_lends_it_its_priority(tmp_path, loader):
    fills = _fills(tmp_path)
    fills.can_lift_idle = True
    referred = fills.admit(OTHER, background=True, caller=1).fill
    fills.forked(referred, loader)
    wanted = fills.admit(KEY, background=False, caller=1).fill
    with fills.depends(wanted, OTHER):
        assert _policies(loader) == NORMAL and fills.lenders == {OTHER: 1}
    assert fills.lenders == {}


@lifts_idle
def test_a_yielding_fill_competes_normally_after_fill_yield_seconds_and_its_progress_is_read(tmp_path, loader,
                                                                                            caplog):
    caplog.set_level(logging.INFO, LOG)
    fills = _fills(tmp_path, fill_yield=0.3)
    fills.can_lift_idle = True
    fill = fills.admit(KEY, background=True, caller=1).fill
    fills.forked(fill, loader)
    ours, theirs = socket.socketpair()
    with ours, theirs:
        P.send_message(theirs, P.FillProgress(KEY, 3 * MB, 8 * MB, 0.25))

        def answer_later() -> None:
            _until(lambda: _policies(loader) == NORMAL)
            P.send_message(theirs, P.Ok())

        later = _start(answer_later)
        message, _, fds = fills.answer(ours, fill, time.monotonic() + 30)
        later.join()
        assert message == P.Ok() and fds == []
        assert (fill.written, fill.expected, fill.original_seconds) == (3 * MB, 8 * MB, 0.25) and fill.packing_since
        assert "at normal priority now: it yielded for OVERMIND_FILL_YIELD=0.3s" in caplog.text

        P.send_message(theirs, P.FillProgress(OTHER, 1, 2, 0.0))  # another key's: not ours
        with pytest.raises(P.ProtocolError, match="malformed progress report"):
            fills.answer(ours, fill, time.monotonic() + 30)
        with pytest.raises(socket.timeout):
            fills.answer(ours, fill, time.monotonic() + 0.1)


# -- before the loader: Note [Cold fills wait for their caller] ------------------------------------


@pytest.fixture
def caller():
    """A process standing in for the caller whose miss started a fill, busy with its own load."""
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    yield proc
    proc.kill()
    proc.wait()


def _after_caller(fills: Fills, fill: F.Fill) -> threading.Thread:
    return _start(fills.after_caller, fill)


@pytest.mark.timeout(60)
def test_a_fill_waits_while_its_caller_loads_until_the_caller_says_it_loaded(tmp_path, caller, caplog):
    caplog.set_level(logging.INFO, LOG)
    fills = _fills(tmp_path)
    fill = fills.admit(KEY, background=True, caller=caller.pid).fill
    waiting = _after_caller(fills, fill)
    waiting.join(1.0)
    assert waiting.is_alive()  # the caller still runs (or waits for a CPU): its load is not over
    fills.caller_loaded(KEY)  # PlainLoaded
    waiting.join(10.0)
    assert not waiting.is_alive() and fill.caller_done.is_set()
    assert f"fill of {KEY[:16]} starts" in caplog.text and f"after its miss (caller pid {caller.pid})" in caplog.text


@pytest.mark.timeout(60)
def test_a_fill_waits_for_its_caller_until_someone_waits_for_the_fill_or_the_caller_exits(tmp_path, caller):
    fills = _fills(tmp_path)
    fill = fills.admit(KEY, background=True, caller=caller.pid).fill
    waiting = _after_caller(fills, fill)
    time.sleep(0.3)
    assert waiting.is_alive()
    with fills.waiting(KEY, 4242):
        waiting.join(10.0)
        assert not waiting.is_alive()
    other = fills.admit(OTHER, background=True, caller=caller.pid).fill
    waiting = _after_caller(fills, other)
    time.sleep(0.3)
    assert waiting.is_alive()
    caller.kill()
    caller.wait()
    waiting.join(10.0)
    assert not waiting.is_alive()


@pytest.mark.timeout(60)
def test_a_fill_waits_for_its_caller_at_most_fill_yield_seconds_and_not_at_all_for_a_quiet_one(tmp_path, caller):
    fills = _fills(tmp_path, fill_yield=0.5)
    fill = fills.admit(KEY, background=True, caller=caller.pid).fill
    started = time.monotonic()
    fills.after_caller(fill)
    assert 0.5 <= time.monotonic() - started < 20  # not its fill_yield of 120 s
    quiet = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        fills = _fills(tmp_path)
        fill = fills.admit(KEY, background=True, caller=quiet.pid).fill
        started = time.monotonic()
        fills.after_caller(fill)  # CALLER_QUIET polls under half a core
        assert time.monotonic() - started < 20  # not its fill_yield of 120 s
    finally:
        quiet.kill()
        quiet.wait()
    wanted = _fills(tmp_path).admit(KEY, background=False, caller=caller.pid).fill
    started = time.monotonic()
    fills.after_caller(wanted)  # someone waits for it from the start
    assert time.monotonic() - started < 20


# -- eviction while a fill runs -------------------------------------------------------------------


def test_a_waiter_whose_fill_was_evicted_right_after_filing_is_told_to_load_plainly(tmp_path):
    loads = _loads(tmp_path)
    fill = loads.fills.admit(KEY, background=True).fill
    a, b = socket.socketpair()
    with a, b:
        waiter = _waiter(loads, a, b, tmp_path)
        fill.entry = _entry()
        loads.registry.add(fill.entry)
        loads.registry.evict([KEY])  # budget pressure from another load
        loads.fills.finish(fill, remember=False)
        answer = P.recv_message(b)[0]
        waiter.join()
    assert answer == P.Error(P.ErrorCode.NOT_FOUND, f"{KEY} was evicted right after loading")
    assert loads.fills.admit(KEY).started  # nothing remembered: the next caller fills it again


def test_a_fill_whose_referred_entry_is_evicted_while_it_waits_for_it_fails_not_found(tmp_path):
    loads = _loads(tmp_path)
    referred = loads.fills.admit(OTHER, background=True).fill
    fill = loads.fills.admit(KEY, background=False).fill
    failed: list = []

    def references() -> None:
        try:
            loads.loaders._references(_request(tmp_path, refs=[OTHER]), fill)
        except LoadFailure as failure:
            failed.append(failure)

    waiting = _start(references)
    _until(lambda: loads.fills.waits == {KEY: OTHER})  # it waits for the fill it refers to, lending it priority
    assert loads.fills.lenders == {OTHER: 1} and not referred.background
    referred.entry = _entry(OTHER)
    loads.registry.add(referred.entry)
    loads.registry.evict([OTHER])
    loads.fills.finish(referred, remember=False)
    waiting.join(10)
    assert [f.code for f in failed] == [P.ErrorCode.NOT_FOUND], failed
    assert "is not cached" in failed[0].message and loads.fills.waits == {} and loads.fills.lenders == {}


def test_a_fill_is_handed_the_entry_it_refers_to_once_that_fill_files_it(tmp_path):
    loads = _loads(tmp_path)
    referred = loads.fills.admit(OTHER, background=True).fill
    fill = loads.fills.admit(KEY, background=True).fill
    handed: list = []
    waiting = _start(lambda: handed.extend(loads.loaders._references(_request(tmp_path, refs=[OTHER]), fill)))
    _until(lambda: loads.fills.waits == {KEY: OTHER})
    assert loads.fills.lenders == {}  # nobody waits for the fill that refers to it: nothing lent
    referred.entry = _entry(OTHER)
    loads.registry.add(referred.entry)
    loads.fills.finish(referred, remember=False)
    waiting.join(10)
    ((reply, fds),) = handed
    assert reply.key == OTHER and len(fds) == 1 and os.fstat(fds[0]).st_size == 1 << 12
    P.close_fds(fds)
    loads.registry.clear()


def test_the_server_status_never_counts_a_fill_ended_before_its_entry_is_counted(tmp_path):
    """What ``wait_idle`` relies on: "loading" 0 means the fill's entry is among "entries". The fill
    files its entry and ends right after the first of the two counters is read, the worst moment."""
    from overmind.server.daemon import Server

    server = Server(_config(tmp_path, state_dir=tmp_path / "state"))
    fill = server.loads.fills.admit(KEY, background=True).fill

    def end_fill() -> None:
        if not fill.done.is_set():
            fill.entry = _entry()
            server.registry.add(fill.entry)
            server.loads.fills.finish(fill, remember=False)

    for owner in (server.loads, server.registry):
        def counters(read=owner.counters) -> dict:
            counted = read()
            end_fill()
            return counted
        owner.counters = counters
    status = server.status()
    assert status["loading"] == 1 or status["entries"] == 1, status
    server.registry.clear()
