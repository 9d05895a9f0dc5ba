"""The one line is warm: ``monkey_patch_all()`` at a script's top hands the run to a warm child
by default, where that child is the process the user started, and nowhere else.

Note [When a warm start applies] in overmind.client.warm_start, Note [A hand-over is the same
process or none] in overmind.warm.match. Real server, real warm interpreter, real ``prlimit``,
``nice``, ``taskset``, ``strace``, ``unshare`` and a real pty; the script imports no torch, so
each case costs a fork or a small plain start.
"""

from __future__ import annotations

import json
import os
import pty
import shlex
import shutil
import subprocess
import sys
import termios
import time
import tty

import pytest

from .conftest import read_until, runs_forked, spawn_in_pty, started_warm_server, wait_warm

SCRIPT = '''"""The README's one line, then what a run can tell about its process."""
import overmind.api
overmind.api.monkey_patch_all()
import json, os, pathlib, resource, sys
from overmind.shared.protocol.contexts import in_warm_run
print(json.dumps({"warm": in_warm_run(), "argv": sys.argv[1:], "orig_argv": sys.orig_argv[1:],
                  "nofile": resource.getrlimit(resource.RLIMIT_NOFILE), "nice": os.getpriority(os.PRIO_PROCESS, 0),
                  "cpus": sorted(os.sched_getaffinity(0)), "cgroup": pathlib.Path("/proc/self/cgroup").read_text(),
                  "oom": int(pathlib.Path("/proc/self/oom_score_adj").read_text()),
                  "nnp": "NoNewPrivs:\\t1" in pathlib.Path("/proc/self/status").read_text(), "write_through": sys.stdout.write_through}))
sys.exit(6)
'''


@pytest.fixture(scope="module")
def warm_server():
    yield from started_warm_server("om-ws-")


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "one_line.py"
    path.write_text(SCRIPT)
    return path


def _start(server, argv: list, status: int = 6, **env) -> tuple[dict, int]:
    """(what the script printed, how many runs the server forked for it)."""
    wait_warm(server)
    before = runs_forked(server)
    environ = server.client_env(**env)
    environ.pop("PYTHONUNBUFFERED", None)
    proc = subprocess.run(argv, env=environ, capture_output=True, text=True, timeout=120)
    assert proc.returncode == status and proc.stderr == "", (proc.returncode, proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1]), runs_forked(server) - before


def test_by_default_the_one_line_hands_the_run_to_a_warm_child(warm_server, script):
    seen, forked = _start(warm_server, [sys.executable, str(script), "a", "b"])
    assert (seen["warm"], forked, seen["argv"]) == (True, 1, ["a", "b"])
    assert seen["orig_argv"] == [str(script), "a", "b"]
    assert seen["cgroup"] == open("/proc/self/cgroup").read()
    assert seen["oom"] == int(open("/proc/self/oom_score_adj").read()) and not seen["nnp"]


def test_warm_start_0_keeps_the_run_in_its_own_process_and_1_is_the_default(warm_server, script):
    assert _start(warm_server, [sys.executable, str(script)], OVERMIND_WARM_START="0")[0]["warm"] is False
    assert _start(warm_server, [sys.executable, str(script)], OVERMIND_WARM_START="1")[0]["warm"] is True


@pytest.mark.parametrize("wrap, check", [
    (["prlimit", "--nofile=256:512"], lambda seen: seen["nofile"] == [256, 512]),
    (["nice", "-n", "7"], lambda seen: seen["nice"] == os.getpriority(os.PRIO_PROCESS, 0) + 7),
    (["taskset", "-c", "0"], lambda seen: seen["cpus"] == [0]),
    (["setpriv", "--no-new-privs"], lambda seen: seen["nnp"]),
], ids=["lower-rlimit", "nice", "affinity", "no-new-privs"])
def test_the_child_takes_on_the_callers_limits_nice_and_cpus(warm_server, script, wrap, check):
    if shutil.which(wrap[0]) is None:
        pytest.skip(f"{wrap[0]} is not installed")
    seen, forked = _start(warm_server, [*wrap, sys.executable, str(script)])
    assert seen["warm"] and forked == 1 and check(seen), seen


def test_python_u_is_handed_over_unbuffered_as_torchrun_starts_its_ranks(warm_server, script):
    seen, forked = _start(warm_server, [sys.executable, "-u", str(script)])
    assert seen["warm"] and seen["write_through"] and seen["orig_argv"] == ["-u", str(script)]
    assert _start(warm_server, [sys.executable, str(script)])[0]["write_through"] is False


def _never(server, argv: list, says: str, **env) -> None:
    # cProfile and trace catch the script's SystemExit and exit 0, as without overmind
    seen, forked = _start(server, argv, 0 if argv[1:3] in (["-m", "cProfile"], ["-m", "trace"]) else 6, **env)
    assert (seen["warm"], forked) == (False, 0), seen
    log = server.log()
    assert says in log, log[-3000:]


@pytest.mark.parametrize("how, says", [
    (lambda s: [sys.executable, "-X", "dev", s], "started with options"),
    (lambda s: [sys.executable, "-m", "cProfile", "-o", os.devnull, s], "not called at the top level"),
    (lambda s: [sys.executable, "-m", "trace", "--count", "--missing", "-C", os.path.dirname(s), s],
     "not called at the top level"),
    (lambda s: ["prlimit", "--as=68719476736", sys.executable, s], "RLIMIT_AS"),
    (lambda s: ["strace", "-f", "-o", os.devnull, sys.executable, s], "traces this process"),
    (lambda s: ["unshare", "--uts", sys.executable, s], "the uts namespace"),
], ids=["option", "cProfile", "trace", "address-space-limit", "strace", "namespace"])
def test_never_handed_over_where_the_child_would_differ(warm_server, script, how, says):
    argv = how(str(script))
    if shutil.which(argv[0]) is None and not os.path.isabs(argv[0]):
        pytest.skip(f"{argv[0]} is not installed")
    if argv[0] == "unshare" and os.geteuid() != 0:
        pytest.skip("a new namespace needs root here")
    _never(warm_server, argv, says)


def test_never_handed_over_when_code_ran_before_the_call(warm_server, tmp_path):
    late = tmp_path / "late.py"
    late.write_text("import os\n" + SCRIPT)
    _never(warm_server, [sys.executable, str(late)], "code ran before monkey_patch_all()")


def test_never_handed_over_from_a_terminal_in_raw_mode(warm_server, script):
    """A pty in raw mode, as a program that drives a terminal leaves it; the run answers on it."""
    wait_warm(warm_server)
    before = runs_forked(warm_server)
    master, slave = pty.openpty()
    tty.setraw(slave)
    try:
        env = warm_server.client_env()
        proc = subprocess.run([sys.executable, str(script)], env=env, stdin=slave, capture_output=True, text=True,
                              timeout=120)
    finally:
        os.close(slave)
        os.close(master)
    assert proc.returncode == 6 and json.loads(proc.stdout.splitlines()[-1])["warm"] is False, proc.stderr
    assert runs_forked(warm_server) == before
    assert "stdin is a terminal in raw mode" in warm_server.log()
    # and a terminal left as a shell leaves it is handed over
    master, slave = pty.openpty()
    try:
        assert termios.tcgetattr(slave)[3] & termios.ICANON
        proc = subprocess.run([sys.executable, str(script)], env=env, stdin=slave, capture_output=True, text=True,
                              timeout=120)
    finally:
        os.close(slave)
        os.close(master)
    assert json.loads(proc.stdout.splitlines()[-1])["warm"] is True, proc.stderr


def test_the_server_says_why_once_per_context(warm_server, script):
    for _ in range(2):
        _start(warm_server, [sys.executable, "-X", "dev", str(script)])
    lines = [line for line in warm_server.log().splitlines() if "started with options (" in line
             and f"-X dev {script})" in line and " INFO " in line]
    assert len(lines) == 1, lines


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def _wait_state(pid: int, state: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while _state(pid) != state:
        assert time.monotonic() < deadline, f"pid {pid} is {_state(pid)}, not {state}"
        time.sleep(0.02)


def test_in_a_terminal_ctrl_z_stops_and_ctrl_c_interrupts_the_handed_over_script(warm_server, tmp_path):
    """In an interactive shell's terminal: Ctrl-Z stops the job (the command and its warm child),
    ``fg`` continues it, Ctrl-C raises KeyboardInterrupt in the script, ``$?`` is its status."""
    script = tmp_path / "wait.py"
    script.write_text("import overmind.api\novermind.api.monkey_patch_all()\nimport os, sys, time\n"
                      "from overmind.shared.protocol.contexts import in_warm_run\n"
                      "try:\n    print('child', os.getpid(), in_warm_run(), sys.stdin.isatty(), flush=True)\n"
                      "    for _ in range(1200):\n        time.sleep(0.05)\n"
                      "except KeyboardInterrupt:\n    print('caught', flush=True)\n    sys.exit(4)\n")
    wait_warm(warm_server)
    shell, master = spawn_in_pty(["bash", "--norc", "--noprofile", "-i"], {**warm_server.client_env(), "PS1": "$ "})
    try:
        os.write(master, f"{shlex.quote(sys.executable)} {shlex.quote(str(script))}\n".encode())
        out = read_until(master, b"True True").decode()
        child = int(out.split("child ", 1)[1].split()[0])
        os.write(master, b"\x1a")  # Ctrl-Z
        read_until(master, b"Stopped")
        _wait_state(child, "T")
        os.write(master, b"fg\n")
        _wait_state(child, "S")
        os.write(master, b"\x03")  # Ctrl-C
        read_until(master, b"caught")
        os.write(master, b"echo status=$?\n")
        read_until(master, b"status=4")
        os.write(master, b"exit\n")
        assert shell.wait(timeout=30) == 0
    finally:
        shell.kill()
        os.close(master)
