"""``overmind run``: a script forked from a warm interpreter behaves as plain ``python`` would.

Real server, real front end (the ``overmind`` console script), real pipes, a real pty for the
terminal cases, real signals. The child side's finer points (stdio objects, __main__, exit
paths, multiprocessing) are pinned against plain python in tests/unit/test_warm.py; here each
behaviour is checked end to end, through the server and the warm interpreter.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import pytest

from ..conftest import child_env
from .conftest import (OVERMIND, overmind_run, plain_python, read_until, runs_forked, spawn_in_pty, started_warm_server,
                       wait_warm)

@pytest.fixture(scope="module")
def warm_server():
    yield from started_warm_server("om-run-")


def _warm_run(server, *args, **kwargs) -> subprocess.CompletedProcess:
    """A run that must have been forked from the warm interpreter (not the plain fallback)."""
    wait_warm(server)
    before = runs_forked(server)
    proc = overmind_run(server, *args, **kwargs)
    assert runs_forked(server) == before + 1, f"the run went plain: {proc.stderr[-2000:]}\n{server.log()[-3000:]}"
    return proc


REPORT = """
import json, os, sys
print(json.dumps({"argv": sys.argv, "path0": sys.path[0], "file": globals().get("__file__"), "name": __name__,
                  "cwd": os.getcwd(), "var": os.environ.get("OVERMIND_TEST_VAR"), "umask": os.umask(0),
                  "main_file": getattr(sys.modules["__main__"], "__file__", None),
                  "stdin_tty": sys.stdin.isatty(), "stdout_tty": sys.stdout.isatty()}))
sys.exit(7)
"""


@pytest.mark.parametrize("mode", ["script", "module", "code"])
def test_argv_path_main_cwd_environment_umask_and_exit_status_are_plain_pythons(warm_server, tmp_path, mode):
    work = tmp_path / "work"
    work.mkdir()
    (tmp_path / "report_mod.py").write_text(REPORT)
    (tmp_path / "report_script.py").write_text(REPORT)
    args = {"script": [str(tmp_path / "report_script.py")], "module": ["-m", "report_mod"],
            "code": ["-c", REPORT]}[mode] + ["a", "b c"]
    env = warm_server.client_env(OVERMIND_TEST_VAR="only-in-this-run")
    if mode == "module":  # a PYTHONPATH selects another interpreter: warm one up for it
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tmp_path), env.get("PYTHONPATH", "")) if p)
        overmind_run(warm_server, "-c", "pass", env=env, cwd=work)
        _wait_until_forked(warm_server, env, work)
    warm = _warm_run(warm_server, *args, env=env, cwd=work, preexec_fn=lambda: os.umask(0o027))
    plain = plain_python(*args, env=env, cwd=work, umask=0o027)
    assert warm.returncode == plain.returncode == 7, warm.stderr
    assert json.loads(warm.stdout) == json.loads(plain.stdout)
    assert warm.stderr == plain.stderr == ""


def _wait_until_forked(server, env, cwd, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        before = runs_forked(server)
        overmind_run(server, "-c", "pass", env=env, cwd=cwd)
        if runs_forked(server) > before:
            return
        time.sleep(0.3)
    raise AssertionError("the new context never got a warm interpreter")


def test_an_uncaught_exception_prints_its_traceback_on_the_callers_stderr_and_exits_1(warm_server, tmp_path):
    script = tmp_path / "boom.py"
    script.write_text("print('before', flush=True)\nraise ValueError('boom')\n")
    warm = _warm_run(warm_server, str(script))
    plain = plain_python(str(script), env=warm_server.client_env(), cwd=tmp_path)
    assert warm.returncode == plain.returncode == 1
    assert warm.stdout == "before\n" and warm.stderr == plain.stderr
    assert "ValueError: boom" in warm.stderr and 'File "' + str(script) in warm.stderr


def test_death_by_a_signal_is_reported_as_a_shell_would(warm_server, tmp_path):
    script = tmp_path / "die.py"
    script.write_text("import os, signal\nos.kill(os.getpid(), signal.SIGTERM)\n")
    assert _warm_run(warm_server, str(script)).returncode == -signal.SIGTERM
    shell = subprocess.run(["sh", "-c", f"{shlex.quote(OVERMIND)} run {shlex.quote(str(script))}; echo status=$?"], env=warm_server.client_env(),
                           capture_output=True, text=True, timeout=60)
    assert shell.stdout.strip() == f"status={128 + signal.SIGTERM}"


def test_stdin_is_the_callers_and_output_is_never_lost_at_exit(warm_server, tmp_path):
    script = tmp_path / "echo.py"
    script.write_text("import sys\ndata = sys.stdin.read()\nsys.stdout.write(data.upper() * 2000)\n"
                      "sys.stderr.write('done')\n")
    warm = _warm_run(warm_server, str(script), input="abc\n")
    assert warm.returncode == 0 and warm.stdout == "ABC\n" * 2000 and warm.stderr == "done"
    with open(tmp_path / "out.txt", "w") as out:  # a file, not a pipe
        _warm_run(warm_server, str(script), input="xy", stdout=out)
    assert (tmp_path / "out.txt").read_text() == "XY" * 2000


# A script that waits for the test's signal. Not one long time.sleep: CPython runs a Python
# signal handler only between bytecodes, so a signal that lands after its last check and before
# clock_nanosleep starts waits for the sleep to end (plain python too). The test signals right
# after reading the script's first line, which hit that window in about 2% of runs here.
WAIT_FOR_A_SIGNAL = "for _ in range(1200):\n    time.sleep(0.05)"


def test_in_a_terminal_isatty_is_true_and_ctrl_c_raises_keyboard_interrupt(warm_server, tmp_path):
    script = tmp_path / "wait.py"
    # The line the test waits for is printed inside the try: a Ctrl-C that came between the print
    # and the try (a busy machine can hold the script there) would escape it.
    script.write_text("import sys, time\n"
                      "try:\n"
                      "    print('tty', sys.stdin.isatty(), sys.stdout.isatty(), sys.stderr.isatty(), flush=True)\n"
                      "    " + WAIT_FOR_A_SIGNAL.replace("\n", "\n    ") + "\nexcept KeyboardInterrupt:\n"
                      "    print('caught', flush=True)\n"
                      "    sys.exit(4)\n")
    before = runs_forked(warm_server)
    proc, master = spawn_in_pty([OVERMIND, "run", str(script)], warm_server.client_env())
    try:
        out = read_until(master, b"tty True True True")
        os.write(master, b"\x03")  # Ctrl-C: the terminal signals its foreground group, the front end
        out += read_until(master, b"caught")
        assert proc.wait(timeout=30) == 4
    finally:
        proc.kill()
        os.close(master)
    assert runs_forked(warm_server) == before + 1


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_and_sighup_reach_the_script(warm_server, tmp_path, sig):
    script = tmp_path / "handler.py"
    script.write_text("import signal, sys, time\n"
                      "signal.signal(signal.SIGTERM, lambda *a: sys.exit(10))\n"
                      "signal.signal(signal.SIGHUP, lambda *a: sys.exit(11))\n"
                      "print('ready', flush=True)\n" + WAIT_FOR_A_SIGNAL + "\n")
    before = runs_forked(warm_server)
    proc = subprocess.Popen([OVERMIND, "run", str(script)], env=warm_server.client_env(), stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "ready\n"
        proc.send_signal(sig)
        assert proc.wait(timeout=30) == (10 if sig == signal.SIGTERM else 11)
    finally:
        proc.kill()
        proc.stdout.close()
    assert runs_forked(warm_server) == before + 1


def test_when_the_front_end_dies_the_script_is_killed(warm_server, tmp_path):
    script = tmp_path / "sleeper.py"
    pid_file = tmp_path / "pid"
    script.write_text(f"import os, time\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\ntime.sleep(120)\n")
    proc = subprocess.Popen([OVERMIND, "run", str(script)], env=warm_server.client_env())
    deadline = time.monotonic() + 60
    while not (pid_file.exists() and pid_file.read_text()):
        assert time.monotonic() < deadline, "the script never started"
        time.sleep(0.05)
    child = int(pid_file.read_text())
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 10
    while _alive(child):
        assert time.monotonic() < deadline, f"script pid {child} outlived its front end"
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def test_random_state_is_fresh_in_every_run(warm_server, tmp_path):
    script = tmp_path / "rand.py"
    script.write_text("import random, numpy, torch\nprint(random.random(), numpy.random.rand(), torch.rand(1).item())\n")
    first, second = (_warm_run(warm_server, str(script)).stdout.split() for _ in range(2))
    assert all(a != b for a, b in zip(first, second)), (first, second)


def test_the_users_own_code_is_never_preimported_and_an_edit_is_seen(warm_server, tmp_path):
    (tmp_path / "mylib.py").write_text("VALUE = 1\n")
    script = tmp_path / "use.py"
    script.write_text("import sys\nwas = 'mylib' in sys.modules\nimport mylib\nprint(was, mylib.VALUE)\n")
    assert _warm_run(warm_server, str(script)).stdout == "False 1\n"
    time.sleep(1.0)  # the interpreter learns what the run imported
    (tmp_path / "mylib.py").write_text("VALUE = 2\n")
    assert _warm_run(warm_server, str(script)).stdout == "False 2\n"


def test_the_second_run_imports_nothing_the_first_imported(warm_server, tmp_path):
    script = tmp_path / "learn.py"
    script.write_text("import sys\nprint('xml.dom.minidom' in sys.modules)\nimport xml.dom.minidom\n")
    assert _warm_run(warm_server, str(script)).stdout == "False\n"
    deadline = time.monotonic() + 30
    while True:  # learning happens after the run, between forks
        out = _warm_run(warm_server, str(script)).stdout
        if out == "True\n" or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert out == "True\n"


def test_overminds_logging_in_a_run_is_plain_pythons_and_the_interpreters_reaches_the_server_log(warm_server, tmp_path):
    script = tmp_path / "logs.py"
    script.write_text("import json, logging, overmind\nours = logging.getLogger('overmind')\n"
                      "print(json.dumps([len(ours.handlers), ours.level, ours.propagate]))\n")
    plain = plain_python(str(script), env=warm_server.client_env(), cwd=tmp_path).stdout
    assert _warm_run(warm_server, str(script)).stdout == plain == "[0, 0, true]\n"
    # The warm interpreter's own records go to the server's log, in the server's format.
    deadline = time.monotonic() + 30
    while "overmind.warm.interpreter[" not in warm_server.log() and time.monotonic() < deadline:
        _warm_run(warm_server, "-c", "import xml.dom.pulldom")  # learned afterwards, which it says at INFO
        time.sleep(0.5)
    assert " INFO overmind.warm.interpreter[" in warm_server.log() and "learned what its clients imported" in warm_server.log()


@pytest.fixture
def installed_module():
    """A module file under site-packages: installed code a warm interpreter may hold."""
    name = f"overmind_test_installed_{os.getpid()}"
    path = Path(sysconfig.get_paths()["purelib"]) / f"{name}.py"
    path.write_text("VERSION = 1\n")
    os.utime(path, (time.time() - 60, time.time() - 60))
    yield name, path
    path.unlink()


def test_a_changed_installed_module_is_never_run_from_the_old_interpreter(warm_server, tmp_path, installed_module):
    name, path = installed_module
    script = tmp_path / "ver.py"
    script.write_text(f"import sys\nwas = {name!r} in sys.modules\nimport {name}\nprint(was, {name}.VERSION)\n")
    _warm_run(warm_server, str(script))
    deadline = time.monotonic() + 30
    while _warm_run(warm_server, str(script)).stdout != "True 1\n":  # learned: held by the interpreter
        assert time.monotonic() < deadline
        time.sleep(0.2)
    path.write_text("VERSION = 22\n")  # a `pip install -U`
    after = overmind_run(warm_server, str(script))
    assert after.stdout.endswith(" 22\n"), after.stdout  # plain this once, or a fresh interpreter
    assert "changed since it was imported" in warm_server.log()


def test_retiring_the_interpreter_never_kills_a_run_in_progress(server, tmp_path):
    overmind_run(server, "-c", "pass")
    wait_warm(server)
    script = tmp_path / "long.py"
    script.write_text("import time\nprint('start', flush=True)\ntime.sleep(3)\nprint('end')\n")
    proc = subprocess.Popen([OVERMIND, "run", str(script)], env=server.client_env(), stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "start\n"
    server.cli("shutdown")  # retires every warm interpreter
    assert proc.stdout.read() == "end\n" and proc.wait(timeout=30) == 0
    proc.stdout.close()


def test_without_a_server_the_run_is_plain_python(tmp_path):
    runtime = Path(tempfile.mkdtemp(prefix="om-none-", dir="/tmp"))
    env = child_env(OVERMIND_RUNTIME_DIR=str(runtime), OVERMIND_NO_AUTOSTART="1")
    script = tmp_path / "hello.py"
    script.write_text("import os, sys\nprint('hello', sys.argv[1:])\nsys.exit(3)\n")
    proc = subprocess.run([OVERMIND, "run", str(script), "x"], env=env, capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stdout, proc.stderr) == (3, "hello ['x']\n", "")
    subprocess.run(["rm", "-rf", str(runtime)])


WARM_START = '''"""A script that opts in with OVERMIND_WARM_START=1."""
import overmind.api
overmind.api.monkey_patch_all()
import os, sys
print(os.getppid(), sys.argv[1:], flush=True)
sys.exit(6)
'''


def test_overmind_warm_start_hands_the_script_to_a_warm_child(warm_server, tmp_path):
    script = tmp_path / "opt_in.py"
    script.write_text(WARM_START)
    env = warm_server.client_env(OVERMIND_WARM_START="1")
    wait_warm(warm_server)
    before = runs_forked(warm_server)
    proc = subprocess.run([sys.executable, str(script), "q"], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 6 and proc.stdout.split(" ", 1)[1] == "['q']\n", proc.stderr
    assert runs_forked(warm_server) == before + 1
    assert int(proc.stdout.split()[0]) != os.getpid()  # its parent is the warm interpreter, not pytest


def test_overmind_warm_start_refuses_when_code_ran_before_the_call(warm_server, tmp_path):
    script = tmp_path / "late.py"
    script.write_text("import os\n" + WARM_START)
    env = warm_server.client_env(OVERMIND_WARM_START="1")
    before = runs_forked(warm_server)
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 6 and int(proc.stdout.split()[0]) == os.getpid()  # ran here, a child of pytest
    assert runs_forked(warm_server) == before


def test_status_lists_the_warm_interpreters(warm_server):
    out = warm_server.cli("status").stdout
    line = next(line for line in out.splitlines() if line.startswith("WARM PID"))
    assert "MODULES" in line and "PSS" in line and "AGE" in line
    info = warm_server.status()["interpreters"][0]
    assert info["ready"] and info["modules"] > 100 and info["pss"] > 0 and info["runs"] >= 1


def test_a_module_that_starts_a_thread_is_never_forked_past(warm_server, tmp_path):
    # Note [Threads libraries start]: an installed module whose import starts a thread makes
    # its interpreter refuse to fork; the context settles on interpreters without it.
    name = f"overmind_test_threader_{os.getpid()}"
    path = Path(sysconfig.get_paths()["purelib"]) / f"{name}.py"
    path.write_text("import threading, time\nthreading.Thread(target=time.sleep, args=(3600,), daemon=True).start()\n")
    os.utime(path, (time.time() - 60, time.time() - 60))
    try:
        script = tmp_path / "threads.py"
        script.write_text(f"import sys\nprint({name!r} in sys.modules)\nimport {name}\n")
        outputs = []
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline:
            wait_warm(warm_server)
            before = runs_forked(warm_server)
            proc = overmind_run(warm_server, str(script))
            forked = runs_forked(warm_server) > before
            outputs.append((forked, proc.stdout))
            assert proc.returncode == 0 and proc.stdout in ("False\n",), outputs  # never forked with it held
            if len(outputs) >= 4 and all(f for f, _ in outputs[-2:]):
                break
            time.sleep(0.5)
        assert all(f for f, _ in outputs[-2:]), outputs  # settled: forked again, without the module
        assert f"in {name}: {name} is kept out of this context's warm interpreters" in warm_server.log()
    finally:
        path.unlink()
