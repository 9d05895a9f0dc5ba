"""Our background threads end before the interpreter's teardown: Note [Our threads end before the
teardown] in overmind.shared.process.teardown.

A real python process with a real server. The script runs what the exit runs before the teardown
(``atexit._run_exitfuncs()``), looks at which threads are still alive, and leaves with
``os._exit`` as the teardown would begin: a thread of ours alive there could wake inside it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from ..conftest import REPO
from .conftest import last_json

OVERMIND = str(Path(sys.executable).parent / "overmind")

LOOK_AT_EXIT = r'''
import atexit, json, os, sys, threading, time
{before}
ours = sorted(t.name for t in threading.enumerate() if t.name.startswith("overmind"))
started = time.monotonic()
atexit._run_exitfuncs()  # what the exit runs before the interpreter's teardown
took = time.monotonic() - started
left = sorted(t.name for t in threading.enumerate() if t.name.startswith("overmind"))
print(json.dumps({{"ours": ours, "left": left, "took": took}}), flush=True)
os._exit(0)
'''


def test_the_drop_ins_threads_end_before_the_teardown(server, tmp_path):
    script = tmp_path / "patched.py"  # a file: its program has no history, so the thread reports imports
    script.write_text(LOOK_AT_EXIT.format(before="import overmind.api\novermind.api.monkey_patch_all()\n"
                                                 "import email.mime.text\ntime.sleep(0.6)"))
    proc = subprocess.run([sys.executable, str(script)], env=server.client_env(), capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = last_json(proc)
    assert "overmind-prepare" in seen["ours"], seen  # alive at the script's end: reporting its imports
    assert seen["left"] == [], seen  # woken and ended, not left behind when JOIN_FOR ran out


def test_the_first_runs_thread_ends_before_the_teardown(server, tmp_path):
    script = tmp_path / "first.py"
    script.write_text(LOOK_AT_EXIT.format(before="import email.mime.text\ntime.sleep(0.6)"))
    proc = subprocess.run([OVERMIND, "run", str(script)], env=server.client_env(), capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = last_json(proc)
    assert seen["ours"] == ["overmind-first-run"], seen  # run 1 runs plainly and teaches its imports
    assert seen["left"] == [], seen


def test_a_script_that_leaves_right_after_monkey_patch_all_does_not_wait_out_the_bound(server, tmp_path):
    """`python train.py --help` with the drop-in on top: the script leaves while the prepare thread
    still imports; the event it registers after the exit's wake pass is set at once, so the exit
    waits for those imports only, not all of JOIN_FOR while the thread waits on that event."""
    from overmind.shared.process import teardown

    script = tmp_path / "bare.py"
    script.write_text(LOOK_AT_EXIT.format(before="import overmind.api\novermind.api.monkey_patch_all()"))
    proc = subprocess.run([sys.executable, str(script)], env=server.client_env(), capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = last_json(proc)
    assert "overmind-prepare" in seen["ours"], seen  # still importing as the script ended
    assert seen["left"] == [] and seen["took"] < teardown.JOIN_FOR, seen


def test_an_event_registered_after_the_exit_began_is_set_at_once(tmp_path):
    """Note [Our threads end before the teardown]: a thread that registers its wake-up event only
    after the exit's wake pass (it was still importing) is woken all the same."""
    script = tmp_path / "late.py"
    script.write_text(LOOK_AT_EXIT.format(before="""
from overmind.shared.process import teardown

def late():
    while not teardown.exiting():
        time.sleep(0.001)
    event = threading.Event()
    teardown.wake_at_exit(event)
    event.wait(30)

teardown.start_thread(late, "overmind-late")
"""))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = last_json(proc)
    assert seen["ours"] == ["overmind-late"] and seen["left"] == [], seen
