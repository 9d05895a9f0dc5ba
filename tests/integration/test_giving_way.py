"""The cache gives way (Note [The cache gives way] in overmind.server.pressure): a real server
whose headroom is set just under what this machine has available, a job of this test's that takes
real memory past it, and the cache let go, cheapest first, then back once the job is gone.
Also the OOM killer's order (Note [The cache dies first] in overmind.warm.oom).

The headroom is set HEADROOM_BELOW under the memory available when the server starts, and the
job takes enough to leave it JOB_PAST under the headroom: the other test worker's swings (a
torch import, a small model) stay well inside both, and the machine keeps most of its memory."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from overmind.shared.settings.host_memory import mem_available

from .conftest import LOAD_AND_LOOK, ServerProcess, last_json

GIB = 1 << 30
HEADROOM_BELOW = 4 * GIB
JOB_PAST = 2 * GIB


# A user's job: takes NBYTES of memory and touches every page, says so, holds it until stdin closes.
JOB = """
import mmap, sys
n = int(sys.argv[1])
buf = mmap.mmap(-1, n)
for offset in range(0, n, mmap.PAGESIZE):
    buf[offset] = 1
print("held", flush=True)
sys.stdin.read()
"""


def _equal_and_hit(proc) -> tuple[bool, bool]:
    out = last_json(proc)
    return out["equal"], out["hit"]


def _until(server: ServerProcess, done, timeout: float, what: str) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        status = server.status()
        if done(status):
            return status
        if time.monotonic() > deadline:
            raise AssertionError(f"not {what} after {timeout:.0f}s: {json.dumps(status.get('memory'))}\n"
                                 f"{server.log()[-4000:]}")
        time.sleep(0.2)


def test_a_job_that_needs_the_memory_gets_it_and_the_cache_comes_back_after(make_server, models):
    headroom = mem_available() - HEADROOM_BELOW
    server = make_server({"OVERMIND_SETTLE_AFTER": "0", "OVERMIND_HEADROOM": str(headroom)})
    job = None
    try:
        code = LOAD_AND_LOOK.format(path=str(models["lm"]))
        assert _equal_and_hit(server.run(code, env=server.client_env(OVERMIND_STRICT="1"))) == (True, True)
        filled = server.wait_settled()
        assert filled["entries"] >= 1 and filled["file_segments"]["settled"] >= 1, filled
        assert [i for i in filled["interpreters"] if i["ready"]], filled["interpreters"]
        assert filled["memory"]["events"] == 0 and filled["memory"]["headroom"] == headroom

        job = subprocess.Popen([sys.executable, "-c", JOB, str(mem_available() - headroom + JOB_PAST)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert job.stdout.readline().strip() == "held"
        pressed = _until(server, lambda s: (s["memory"]["last_event"] or {}).get("seconds") is not None, 30,
                         "let go")
        event = pressed["memory"]["last_event"]
        # The job takes more than the whole cache holds: everything goes, the cheapest first.
        assert event["let_go"]["unsettled"] >= 1 and event["let_go"]["interpreters"] >= 1, event
        assert event["let_go"]["entries"] >= 1 and pressed["entries"] == 0, event
        assert pressed["memory"]["pressed"]  # the job holds on: under the headroom and its slack still
        log = server.log()
        order = [log.index("from its file again"), log.index("(memory is short)\n", log.index("retiring warm")),
                 log.index("for memory")]
        assert order == sorted(order), log[-3000:]
        assert log.count("WARNING overmind.server.pressure") >= 1
        assert sum(line.split("]: ", 1)[-1].startswith("memory is short") for line in log.splitlines()) == 1

        # While memory is short, a load is plain and starts no fill: nothing new is held.
        assert _equal_and_hit(server.run(code)) == (True, False)
        assert server.status()["entries"] == 0

        job.stdin.close()
        job.wait(timeout=30)
        job = None
        back = _until(server, lambda s: s["entries"] >= 1 and s["memory"]["comeback"]["pending"] == 0
                      and any(i["ready"] for i in s["interpreters"]), 120, "back")
        assert not back["memory"]["pressed"] and back["memory"]["comeback"]["done"] >= 2, back["memory"]
        assert _equal_and_hit(server.run(code)) == (True, True)
    finally:
        if job is not None:
            job.kill()
            job.wait()


OOM_OF = "print(open('/proc/self/oom_score_adj').read().strip())"


def test_warm_interpreters_are_the_oom_killers_first_pick_and_a_run_gets_its_callers_score(server):
    # The caller's score as a user's shell may have it: not ours, and lower than the cache's.
    front = ["sh", "-c", 'echo 300 > /proc/self/oom_score_adj && exec "$@"', "sh",
             str(Path(sys.executable).parent / "overmind"), "run", "-c", OOM_OF]
    scores = []
    for _ in range(60):  # the first run is plain while the context's interpreter starts
        runs = server.status()["runs"]
        proc = subprocess.run(front, env=server.client_env(), capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        scores.append(proc.stdout.strip())
        if server.status()["runs"] > runs:
            break
        time.sleep(0.5)
    else:
        raise AssertionError(f"no run was forked: {server.log()[-3000:]}")
    assert scores[-1] == "300", scores  # the forked child has its caller's score, not the cache's
    interpreters = [i for i in server.status()["interpreters"] if i["alive"]]
    assert interpreters
    for interpreter in interpreters:
        with open(f"/proc/{interpreter['pid']}/oom_score_adj") as f:
            assert f.read().strip() == "1000"
