"""A cache fill nobody waits for yields the CPU to its caller; one somebody waits for does not.

Note [Cold fills yield to their caller] in overmind.server.fills. A custom patch point stands
in for a slow load: in the loader (a warm interpreter's child, ``OVERMIND_DISABLE=1``) it
starts a second thread, leaves a file named after its pid and waits for the test's ``go``;
in the caller it loads at once. The tests read the policy of every thread of that loader.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from overmind.shared.process.priority import can_lift_idle

from ..conftest import age_files
from .conftest import ServerProcess, last_json

# Lifting a SCHED_IDLE loader back takes root, CAP_SYS_NICE or RLIMIT_NICE 20; a server without
# them fills at nice 10 instead (test_fills.test_where_idle_could_not_be_lifted_a_fill_takes_nice_10_instead).
lifts_idle = pytest.mark.skipif(not can_lift_idle(), reason="lifting SCHED_IDLE back needs root, "
                                "CAP_SYS_NICE or RLIMIT_NICE 20; without them fills take nice 10")

LIBRARY = '''
import os, threading, time
import torch


class Gate:
    """Pickled by the loader's pack: waits there for the test's ``go``, the bytes before it in place."""

    def __init__(self, folder):
        self.folder = folder

    def __reduce__(self):
        open(os.path.join(self.folder, "gate-waits"), "w").close()
        deadline = time.monotonic() + 60
        while not os.path.exists(os.path.join(self.folder, "go")) and time.monotonic() < deadline:
            time.sleep(0.02)
        return str, ("gate",)


def load(path):
    folder = os.path.dirname(path)
    if os.environ.get("OVERMIND_DISABLE") == "1" and os.path.exists(os.path.join(folder, "pack")):
        # the loader: its original takes that many seconds, then its pack stops at the gate with
        # the MiB before it in place, then writes the MiB after it
        before, after, seconds = open(os.path.join(folder, "pack")).read().split()
        before, after = int(before), int(after)
        open(os.path.join(folder, f"loader-{os.getpid()}"), "w").close()
        time.sleep(float(seconds))
        result = {"before": torch.ones(before << 18), "gate": Gate(folder), "after": torch.ones(after << 18)}
        return {**result, **torch.load(path, weights_only=True)}
    if os.environ.get("OVERMIND_DISABLE") == "1":  # the loader: a second thread, then wait for the test
        threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
        open(os.path.join(folder, f"loader-{os.getpid()}"), "w").close()
        deadline = time.monotonic() + 60
        while not os.path.exists(os.path.join(folder, "go")) and time.monotonic() < deadline:
            time.sleep(0.02)
        if os.path.exists(os.path.join(folder, "work")):  # a fill that needs the CPU: that many seconds of it
            needed = time.process_time() + float(open(os.path.join(folder, "work")).read())
            while time.process_time() < needed:
                pass
    elif os.environ.get("SLOW_CALLER"):  # the caller's plain load takes that long
        time.sleep(float(os.environ["SLOW_CALLER"]))
    return torch.load(path, weights_only=True)
'''

APP = '''
import json, sys, time
import overmind.api
overmind.api.monkey_patch_all()
import slowlib
w = slowlib.load(sys.argv[1])["w"].tolist()
if len(sys.argv) > 2:  # keep a core busy after the load, as a load still running would
    print("busy", flush=True)
    started = time.monotonic()
    while time.monotonic() - started < float(sys.argv[2]):
        pass
print(json.dumps({"w": w}))
'''

WAIT = 60.0


@pytest.fixture
def slowlib(tmp_path):
    (tmp_path / "slowlib.py").write_text(textwrap.dedent(LIBRARY))
    (tmp_path / "app.py").write_text(textwrap.dedent(APP))
    weights = tmp_path / "w.pt"
    torch.save({"w": torch.arange(4.0)}, weights)
    age_files(weights)
    return tmp_path


def _env(server: ServerProcess, folder, **extra) -> dict:
    return server.client_env(OVERMIND_PATCH="slowlib::load", PYTHONPATH=str(folder), **extra)


def _app(folder) -> list:
    return [sys.executable, str(folder / "app.py"), str(folder / "w.pt")]


def _call(server: ServerProcess, folder, **env) -> dict:
    """Run the app to its end (a cold load nobody waits for: the caller loads plainly)."""
    return last_json(subprocess.run(_app(folder), env=_env(server, folder, **env), capture_output=True, text=True,
                                    timeout=WAIT, check=True))


def _loader_pid(server: ServerProcess, folder) -> int:
    """The loader's pid, once the server has set its priority (it logs that line after)."""
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        pids = [int(p.name.split("-")[1]) for p in folder.glob("loader-*")]
        if pids and f"loader pid {pids[0]} fills" in server.log():
            return pids[0]
        time.sleep(0.05)
    raise AssertionError(f"no loader started or logged its priority: {server.log()[-3000:]}")


def _policies(pid: int) -> set:
    """The scheduling policy of every thread of ``pid``."""
    tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    assert len(tids) >= 2, "the slow loader starts a second thread"
    return {os.sched_getscheduler(tid) for tid in tids}


def _until_policies(pid: int, expected: set) -> set:
    deadline = time.monotonic() + 10
    while _policies(pid) != expected and time.monotonic() < deadline:
        time.sleep(0.05)
    return _policies(pid)


def _go(server: ServerProcess, folder) -> dict:
    (folder / "go").touch()
    return server.wait_idle()


@lifts_idle
def test_a_fill_nobody_waits_for_runs_at_idle_priority(server, slowlib):
    caller = _call(server, slowlib)
    assert caller["w"] == [0.0, 1.0, 2.0, 3.0]  # the caller loaded plainly, without waiting for the fill
    pid = _loader_pid(server, slowlib)
    assert _policies(pid) == {os.SCHED_IDLE}, server.log()[-2000:]
    assert server.status()["loading"] == 1
    status = _go(server, slowlib)
    assert status["entries"] == 1, status
    again = _call(server, slowlib)
    assert again == caller and server.status()["hits"] == 1
    assert os.sched_getscheduler(server.pid) == os.SCHED_OTHER  # only the loader yields


def test_a_fill_its_caller_waits_for_runs_at_normal_priority(server, slowlib):
    caller = subprocess.Popen(_app(slowlib), env=_env(server, slowlib, OVERMIND_COLD="wait"),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        pid = _loader_pid(server, slowlib)
        assert _policies(pid) == {os.SCHED_OTHER}, server.log()[-2000:]
        _go(server, slowlib)
        out, err = caller.communicate(timeout=WAIT)
    finally:
        caller.kill()
    assert caller.returncode == 0, err
    assert out.strip().splitlines()[-1] == '{"w": [0.0, 1.0, 2.0, 3.0]}'


@lifts_idle
def test_a_waiting_load_lifts_the_fill_it_joins(server, slowlib):
    _call(server, slowlib)
    pid = _loader_pid(server, slowlib)
    assert _policies(pid) == {os.SCHED_IDLE}
    waiter = subprocess.Popen(_app(slowlib), env=_env(server, slowlib, OVERMIND_COLD="wait"),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert _until_policies(pid, {os.SCHED_OTHER}) == {os.SCHED_OTHER}, server.log()[-2000:]
        assert f"loader pid {pid} fills" in server.log() and "at normal priority now" in server.log()
        _go(server, slowlib)
        out, err = waiter.communicate(timeout=WAIT)
    finally:
        waiter.kill()
    assert waiter.returncode == 0, err
    assert server.status()["misses"] == 1  # the waiter joined the fill; it started no load of its own


@lifts_idle
def test_a_fill_competes_normally_after_fill_yield_seconds(make_server, slowlib):
    server = make_server({"OVERMIND_FILL_YIELD": "2"})
    _call(server, slowlib)
    pid = _loader_pid(server, slowlib)
    assert _policies(pid) == {os.SCHED_IDLE}
    assert _until_policies(pid, {os.SCHED_OTHER}) == {os.SCHED_OTHER}, server.log()[-2000:]
    assert "OVERMIND_FILL_YIELD=2s" in server.log()
    _go(server, slowlib)


@lifts_idle
def test_a_loader_past_the_loader_timeout_is_killed_whatever_its_priority(make_server, slowlib):
    server = make_server({"OVERMIND_FILL_YIELD": "1", "OVERMIND_LOADER_TIMEOUT": "3"})
    _call(server, slowlib)
    pid = _loader_pid(server, slowlib)  # it waits for a go that never comes
    status = server.wait_idle(timeout=WAIT)
    assert status["loading"] == 0 and status["entries"] == 0, status
    log = server.log()
    assert "OVERMIND_FILL_YIELD=1s" in log and f"loader pid {pid} exceeded OVERMIND_LOADER_TIMEOUT=3s" in log, log
    assert _gone(pid), f"loader {pid} still runs after it was killed"


def _gone(pid: int, within: float = 10.0) -> bool:
    """Ended (or a zombie) within ``within`` seconds: a killed process still frees its memory
    in state R for a moment after SIGKILL."""
    deadline = time.monotonic() + within
    while True:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


@lifts_idle
def test_a_fill_starts_once_its_callers_own_load_returned_even_while_the_caller_stays_busy(server, slowlib):
    caller = subprocess.Popen([*_app(slowlib), "30"], env=_env(server, slowlib), stdout=subprocess.PIPE, text=True)
    try:
        assert caller.stdout.readline() == "busy\n"  # its plain load returned; it computes for 30 s
        pid = _loader_pid(server, slowlib)
        assert caller.poll() is None, "the fill waited for its caller to end"
        assert _policies(pid) == {os.SCHED_IDLE}
    finally:
        caller.kill()
    assert f"after its miss (caller pid {caller.pid})" in server.log()
    assert _go(server, slowlib)["entries"] == 1


def _packing(server: ServerProcess, folder, before_mib: int, after_mib: int, original: float = 1.0,
             caller: str = "1.0") -> None:
    """A fill whose pack stops with ``before_mib`` in place and ``after_mib`` to go, once the
    server heard so (Note [Progress of a pack] in overmind.warm.loader); the caller loaded plainly
    in ``caller`` seconds, the loader's original took ``original`` seconds or more."""
    (folder / "pack").write_text(f"{before_mib} {after_mib} {original}")
    _call(server, folder, SLOW_CALLER=caller)
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:  # the loader reports at its own (idle) priority: wait for it
        packing = server.status()["packing"]
        if packing and packing[0]["written"] >= before_mib << 20:
            return
        time.sleep(0.05)
    raise AssertionError(f"the server never heard of {before_mib} MiB in place: {server.log()[-3000:]}")


LAZY = """
import os, sys, torch


def load(path):
    if os.environ.get("OVERMIND_DISABLE") == "1":  # the loader: had its interpreter imported what the load imports?
        with open(os.path.join(os.path.dirname(path), "loader-saw"), "w") as f:
            f.write(str("colorsys" in sys.modules))
    import colorsys  # noqa: F401 - the load's own import, as transformers imports a model's module
    return torch.load(path, weights_only=True)
"""

LAZY_APP = """
import json, sys
import overmind.api
overmind.api.monkey_patch_all()
import lazylib
print(json.dumps({"w": lazylib.load(sys.argv[1])["w"].tolist()}))
"""


def test_a_fills_loader_starts_with_what_its_callers_plain_load_imported(server, tmp_path):
    """Note [Cold fills wait for their caller]: the caller's word names what its plain load
    imported, and the warm interpreter imports it before it forks the loader (and every later run)."""
    (tmp_path / "lazylib.py").write_text(LAZY)
    (tmp_path / "app.py").write_text(LAZY_APP)
    torch.save({"w": torch.arange(4.0)}, tmp_path / "w.pt")
    age_files(tmp_path / "w.pt")
    env = server.client_env(OVERMIND_PATCH="lazylib::load", PYTHONPATH=str(tmp_path))
    out = subprocess.run([sys.executable, str(tmp_path / "app.py"), str(tmp_path / "w.pt")], env=env,
                         capture_output=True, text=True, timeout=WAIT, check=True)
    assert last_json(out) == {"w": [0.0, 1.0, 2.0, 3.0]}
    assert server.wait_idle()["entries"] == 1
    assert (tmp_path / "loader-saw").read_text() == "True", server.log()[-3000:]


@lifts_idle
def test_a_caller_joins_a_fill_whose_pack_should_end_before_a_plain_load_would(server, slowlib):
    _packing(server, slowlib, 64, 0)  # all but the small weights in place: it should end at once
    second = subprocess.Popen(_app(slowlib), env=_env(server, slowlib, SLOW_CALLER="1.5"),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + WAIT
        while "waits for it" not in server.log() and time.monotonic() < deadline:
            time.sleep(0.02)  # it joined: its wait lifted the fill's priority
        (slowlib / "go").touch()
        out, err = second.communicate(timeout=WAIT)
    finally:
        second.kill()
    assert second.returncode == 0, err
    assert out.strip().splitlines()[-1] == '{"w": [0.0, 1.0, 2.0, 3.0]}'
    status = server.wait_idle()
    assert (status["misses"], status["hits"], status["joined"]) == (1, 1, 1), server.log()[-3000:]
    assert "joins the fill" in server.log() and ": served" in server.log()


def test_a_caller_loads_plainly_beside_a_fill_whose_pack_has_far_to_go(server, slowlib):
    _packing(server, slowlib, 1, 64)  # 1 MiB in place after a second or more: 64 more would take a minute
    assert re.search(r"filling +\w{16}: 1\.0 MB of 6\d\.\d MB in place after \d", server.cli("status").stdout)
    started = time.monotonic()
    second = _call(server, slowlib, SLOW_CALLER="1.0")
    assert second == {"w": [0.0, 1.0, 2.0, 3.0]} and time.monotonic() - started < WAIT / 2
    log = server.log()
    assert "loads plainly beside the fill" in log and "1 of 65 MB in place" in log, log[-3000:]
    assert server.status()["joined"] == 0
    assert _go(server, slowlib)["entries"] == 1


def test_a_plain_load_is_weighed_at_what_the_loaders_original_took_when_less(server, slowlib):
    """The first caller's plain load took 2 s (imports inside it, say); the loader's call of
    the same original 0.05 s or a little more. The second caller weighs the fill against the
    second: which way it then goes is the clock's (decided on a stepped clock in
    tests/unit/test_fills.py), but it must go the way the figures it logged say."""
    _packing(server, slowlib, 64, 4, original=0.05, caller="2.0")
    assert _call(server, slowlib, SLOW_CALLER="1.0") == {"w": [0.0, 1.0, 2.0, 3.0]}
    log = server.log()
    original = float(re.search(r"its call of the original took ([\d.]+)s", log)[1])
    decision = re.search(r"pid \d+ (joins|loads plainly beside) the fill of \w+: 64 of 68 MB in place, "
                         r"([\d.]+)s left against a plain load of ([\d.]+)s \((.*?)\)", log)
    assert decision, log[-3000:]
    joins, left, plain, weighed = decision[1] == "joins", float(decision[2]), float(decision[3]), decision[4]
    assert (plain, weighed) == (original, "the loader's call of the original"), log[-3000:]
    if left != plain:  # the log rounds both to 0.01 s: where they print equal, either way is the clock's
        assert joins == (left < plain), log[-3000:]
    assert server.status()["joined"] == joins
    assert _go(server, slowlib)["entries"] == 1


def test_a_fill_still_running_the_original_is_joined_for_one_plain_loads_time(server, slowlib):
    _call(server, slowlib, SLOW_CALLER="1.0")
    _loader_pid(server, slowlib)  # its original waits for go: it never ends meanwhile
    started = time.monotonic()
    assert _call(server, slowlib, SLOW_CALLER="1.0") == {"w": [0.0, 1.0, 2.0, 3.0]}
    assert time.monotonic() - started >= 1.0  # waited a plain load's time (the first caller's), then loaded
    log = server.log()
    assert "its loader runs the original, against a plain load of 1.0" in log and "gave up" in log, log[-3000:]
    assert server.status()["joined"] == 1
    assert _go(server, slowlib)["entries"] == 1


def test_a_joined_fill_that_runs_late_is_left_after_one_plain_load_time(server, slowlib):
    _packing(server, slowlib, 64, 0)
    second = _call(server, slowlib, SLOW_CALLER="1.0")  # the fill never ends meanwhile (no go)
    assert second == {"w": [0.0, 1.0, 2.0, 3.0]}
    assert "gave up" in server.log() and server.status()["joined"] == 1
    assert _go(server, slowlib)["entries"] == 1


@lifts_idle
def test_on_a_machine_kept_busy_a_fill_still_ends_once_it_yielded_its_bound(make_server, slowlib):
    """Every core spinning at normal priority: SCHED_IDLE alone would hold the fill (3 CPU-seconds
    of work) back for as long as they spin (Note [Idle only inside the interpreter's autogroup]). After OVERMIND_FILL_YIELD seconds it competes normally and is cached while they
    still spin (the decision is asserted, not a time: how soon it ends is the machine's)."""
    server = make_server({"OVERMIND_FILL_YIELD": "2"})
    # One spinner pinned to each CPU this test may use: none is left free for the balancer to find.
    spin = "import os, sys, time\nos.sched_setaffinity(0, {int(sys.argv[1])})\nend = time.monotonic() + 120\n" \
           "while time.monotonic() < end: pass"
    spinners = [subprocess.Popen([sys.executable, "-c", spin, str(cpu)]) for cpu in sorted(os.sched_getaffinity(0))]
    try:
        (slowlib / "go").touch()  # the loader does not wait for the test,
        (slowlib / "work").write_text("3.0")  # but needs 3 CPU-seconds: still running at the bound
        _call(server, slowlib)
        status = server.wait_idle(timeout=WAIT)
        assert all(s.poll() is None for s in spinners), "the spinners stopped before the fill ended"
        assert status["entries"] == 1 and status["loading"] == 0, status
        log = server.log()
        assert "idle priority (SCHED_IDLE)" in log and "OVERMIND_FILL_YIELD=2s" in log, log[-3000:]
    finally:
        for s in spinners:
            s.kill()
