"""overmind.warm.script: a child forked from a warm interpreter behaves as a fresh `python SCRIPT` would.

Real processes only. One driver interpreter per module plays the interpreter: it imports torch and
numpy, leaves behind the state an interpreter may have (seeded RNGs, signal handlers, a blocked
signal, umask, cwd "/", an extra environment variable, unflushed stdout, faulthandler), and
forks one child per run, which calls ``warm.become()`` with fds the test passes over a socket.
Each run is compared with the same command under a plain ``python`` with the same fds, cwd,
environment and umask.
"""

from __future__ import annotations

import json
import os
import py_compile
import random
import signal
import socket
import subprocess
import sys
import textwrap
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

from overmind.warm import script as warm

DRIVER = r"""
import gc, json, os, random, signal, socket, sys
os.chdir("/")                     # an interpreter's cwd, before torch imports multiprocessing
import numpy, torch               # what an interpreter has already imported
from overmind.warm import script as warm

# What an interpreter may leave behind; no run may inherit any of it.
random.seed(0); numpy.random.seed(0); torch.manual_seed(0)
os.environ["OVERMIND_INTERPRETER_ONLY"] = "1"
os.environ["TMPDIR"] = sys.argv[2]
import tempfile; tempfile.tempdir = None; tempfile.gettempdir()  # cached from the interpreter's TMPDIR
os.umask(0o077)
for sig, handler in [(signal.SIGTERM, lambda *a: None), (signal.SIGCHLD, lambda *a: None),
                     (signal.SIGINT, signal.SIG_IGN), (signal.SIGPIPE, signal.SIG_DFL),
                     (signal.SIGUSR1, signal.SIG_IGN)]:
    signal.signal(sig, handler)
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR2])
wake_r, wake_w = os.pipe(); os.set_blocking(wake_w, False); signal.set_wakeup_fd(wake_w)
import faulthandler; faulthandler.enable()
sys.stdout.write("INTERPRETER OUTPUT\n")    # left in the interpreter's stdout buffer, never flushed
import weakref
class Shared: pass
shared = Shared()                  # say, a temporary directory made at import, for all runs
weakref.finalize(shared, os.write, 2, b"INTERPRETER FINALIZER RAN\n")

ctl = socket.socket(fileno=int(sys.argv[1]))
gc.freeze()                       # what an interpreter does before forking (Note [Frozen before forking] in overmind.warm.interpreter)
ctl.send(b"ready")
while True:
    msg, fds, _, _ = socket.recv_fds(ctl, 1 << 20, 3)
    if not msg:
        break
    request = json.loads(msg)
    pid = os.fork()
    if pid == 0:
        ctl.close()
        if request["unfreeze"]:
            gc.unfreeze()
        if request["low_fds"]:    # stdin's source on fd 1, stdout's on fd 0
            os.dup2(fds[0], 1); os.dup2(fds[1], 0)
            fds = [1, 0, fds[2]]
        warm.become(request["spec"], *fds)
    for fd in fds:
        os.close(fd)
    _, status = os.waitpid(pid, 0)
    ctl.send(json.dumps(status).encode())
"""

# The environment every run gets, warm or cold. PYTHONUNBUFFERED and PYTHONDONTWRITEBYTECODE,
# set for the interpreter, are absent: runs must not inherit them.
RUN_ENV = {
    "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
    "HOME": os.environ.get("HOME", "/"),
    "LANG": "C.UTF-8",
    "TZ": "Asia/Tokyo",
    "OVERMIND_WARM_TEST": "only in the run's environment",
}
INTERPRETER_ENV = {**RUN_ENV, "TZ": "UTC", "PYTHONDONTWRITEBYTECODE": "1", "HF_HUB_OFFLINE": "1"}


class Interpreter:
    def __init__(self, workdir: Path):
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.log = workdir / "interpreter.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", DRIVER, str(theirs.fileno()), str(workdir)], pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log,
                env=INTERPRETER_ENV, start_new_session=True)
        theirs.close()
        self.sock.settimeout(120)
        if self.sock.recv(16) != b"ready":
            raise AssertionError(f"driver did not start:\n{self.log.read_text()}")

    def launch(self, spec: dict, fds: tuple[int, int, int], unfreeze: bool = False,
               low_fds: bool = False) -> Callable[[], int]:
        request = json.dumps({"spec": spec, "unfreeze": unfreeze, "low_fds": low_fds}).encode()
        socket.send_fds(self.sock, [request], list(fds))
        # The driver reports the raw wait status; this is subprocess's returncode for it.
        return lambda: os.waitstatus_to_exitcode(json.loads(self.sock.recv(64)))

    def close(self) -> None:
        self.sock.close()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def interpreter(tmp_path_factory):
    z = Interpreter(tmp_path_factory.mktemp("interpreter"))
    yield z
    z.close()


@dataclass
class Ran:
    status: int  # as subprocess's returncode: -N for death by signal N
    out: bytes
    err: bytes

    def facts(self) -> dict:
        assert self.status == 0, self
        return json.loads(self.out)


def _drain(fd: int) -> Callable[[], bytes]:
    chunks: list[bytes] = []

    def pump() -> None:
        with open(fd, "rb", buffering=0) as f:
            try:
                while chunk := f.read(65536):
                    chunks.append(chunk)
            except OSError:  # EIO: the last pty slave is closed
                pass

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()

    def result() -> bytes:
        reader.join(60)
        assert not reader.is_alive(), "output never reached EOF"
        return b"".join(chunks)
    return result


def run(launch: Callable[[tuple[int, int, int]], Callable[[], int]], *, stdin: bytes = b"",
        merged: bool = False, tty: bool = False, stdout_file: Path | None = None,
        stdout_closed: bool = False) -> Ran:
    """Give a run its stdio (pipes, a pty, a file or a pipe nobody reads) and collect it."""
    if tty:
        master, slave = os.openpty()
        read_out, read_err = _drain(master), (lambda: b"")
        fds, ours = (slave, slave, slave), [slave]
    else:
        in_r, in_w = os.pipe()
        os.write(in_w, stdin)
        os.close(in_w)
        err_r, err_w = os.pipe()
        read_err = _drain(err_r)
        ours = [in_r, err_w]
        if stdout_file is not None:
            out_w = os.open(stdout_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            read_out = stdout_file.read_bytes
        else:
            out_r, out_w = os.pipe()
            if stdout_closed:
                os.close(out_r)
                read_out = lambda: b""  # noqa: E731
            else:
                read_out = _drain(out_r)
        ours.append(out_w)
        fds = (in_r, out_w, out_w if merged else err_w)
    wait = launch(fds)
    for fd in set(ours):
        os.close(fd)
    status = wait()
    return Ran(status, read_out(), read_err())


def command(mode: str, target: str, args: tuple[str, ...]) -> list[str]:
    return {"script": [target], "module": ["-m", target], "code": ["-c", target]}[mode] + list(args)


def warm_run(interpreter: Interpreter, mode: str, target: str, *args: str, cwd: Path, env: dict | None = None,
             umask: int = 0o022, ignored: tuple[int, ...] = (), unfreeze: bool = False,
             low_fds: bool = False, **stdio) -> Ran:
    spec = {"mode": mode, "target": target, "argv": list(args), "cwd": str(cwd),
            "env": RUN_ENV if env is None else env, "umask": umask, "ignored_signals": list(ignored)}
    return run(lambda fds: interpreter.launch(spec, fds, unfreeze, low_fds), **stdio)


def cold_run(mode: str, target: str, *args: str, cwd: Path, env: dict | None = None,
             umask: int = 0o022, ignored: tuple[int, ...] = (), **stdio) -> Ran:
    def ignore() -> None:  # what nohup or a shell's background job does before exec
        for sig in (signal.SIGINT, signal.SIGQUIT, signal.SIGHUP):  # not what started pytest (a background job?)
            signal.signal(sig, signal.SIG_DFL)
        for sig in ignored:
            signal.signal(sig, signal.SIG_IGN)

    def launch(fds):
        proc = subprocess.Popen([sys.executable, *command(mode, target, args)], cwd=cwd,
                                env=RUN_ENV if env is None else env, umask=umask,
                                preexec_fn=ignore,
                                process_group=0, stdin=fds[0], stdout=fds[1], stderr=fds[2])
        return lambda: proc.wait(timeout=60)
    return run(launch, **stdio)


def both(interpreter: Interpreter, mode: str, target: str, *args: str, cwd: Path, **kw) -> tuple[Ran, Ran]:
    w = warm_run(interpreter, mode, target, *args, cwd=cwd, **kw)
    c = cold_run(mode, target, *args, cwd=cwd, **{k: v for k, v in kw.items() if k not in ("unfreeze", "low_fds")})
    assert b"INTERPRETER" not in w.out + w.err
    return w, c


def write(path: Path, source: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(source))
    return path


PROBE = """\
import faulthandler, gc, json, locale, os, signal, subprocess, sys, tempfile, time
import multiprocessing.process
main = sys.modules["__main__"]
def annotated(x: int): pass
umask = os.umask(0); os.umask(umask)
spec = main.__spec__
loader = main.__loader__
c_environ = subprocess.run(["env", "-0"], capture_output=True).stdout  # what children inherit
print(json.dumps({
    "argv": sys.argv, "orig_argv": sys.orig_argv, "path": sys.path,
    "main": list(vars(main)), "name": __name__, "file": main.__dict__.get("__file__"),
    "cached": main.__dict__.get("__cached__"), "package": main.__package__,
    "spec": spec and [spec.name, spec.origin],
    "loader": getattr(loader, "__name__", type(loader).__name__),
    "annotations": repr(annotated.__annotations__),
    "cwd": os.getcwd(), "umask": umask, "own_group": os.getpgrp() == os.getpid(),
    "signals": {s.name: repr(signal.getsignal(s)) for s in signal.Signals
                if s not in (signal.SIGKILL, signal.SIGSTOP)},
    "mask": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
    "wakeup_fd": signal.set_wakeup_fd(-1),
    "stdio": [[s.name, s.mode, s.encoding, s.errors, s.line_buffering, s.write_through,
               s.isatty(), type(s.buffer).__name__] for s in (sys.stdin, sys.stdout, sys.stderr)],
    "dunder_stdio": [sys.stdin is sys.__stdin__, sys.stdout is sys.__stdout__, sys.stderr is sys.__stderr__],
    "environ": dict(os.environ),
    "c_environ": sorted(e.decode() for e in c_environ.split(b"\\0") if e),
    "tzname": time.tzname, "ctype": locale.setlocale(locale.LC_CTYPE),
    "dont_write_bytecode": sys.dont_write_bytecode, "faulthandler": faulthandler.is_enabled(),
    "gc": gc.isenabled(), "mp_original_dir": multiprocessing.process.ORIGINAL_DIR,
    "int_max_str_digits": sys.get_int_max_str_digits(), "tempdir": tempfile.gettempdir(),
}))
"""


@pytest.fixture
def proj(tmp_path):
    write(tmp_path / "sub" / "probe.py", PROBE)
    write(tmp_path / "probe.py", PROBE)
    write(tmp_path / "app" / "__main__.py", PROBE)
    (tmp_path / "link.py").symlink_to(tmp_path / "sub" / "probe.py")
    py_compile.compile(str(tmp_path / "sub" / "probe.py"), cfile=str(tmp_path / "sub" / "compiled.pyc"))
    return tmp_path


@pytest.mark.parametrize("mode, target", [
    ("script", "./sub/../sub/probe.py"), ("script", "link.py"), ("script", "app"),
    ("script", "sub/compiled.pyc"), ("module", "probe"), ("code", PROBE)],
    ids=["script", "symlinked-script", "directory", "compiled-script", "module", "code"])
def test_a_warm_run_sees_what_plain_python_sees(interpreter, proj, mode, target):
    w, c = both(interpreter, mode, target, "a1", "--flag", cwd=proj)
    assert w.facts() == c.facts()
    facts = w.facts()
    assert facts["argv"][1:] == ["a1", "--flag"]
    path0 = {"./sub/../sub/probe.py": proj / "sub", "link.py": proj / "sub", "app": proj / "app",
             "sub/compiled.pyc": proj / "sub", "probe": proj}
    assert facts["path"][0] == str(path0.get(target, ""))
    assert facts["environ"] == RUN_ENV and "OVERMIND_INTERPRETER_ONLY" not in str(facts["c_environ"])
    assert facts["cwd"] == str(proj) and facts["umask"] == 0o022 and facts["own_group"]
    assert facts["annotations"] == "{'x': <class 'int'>}"  # no __future__ leaked from overmind/warm/script.py
    assert w.err == c.err == b""


@pytest.mark.parametrize("env", [
    {},  # C locale: PEP 538 coerces LC_CTYPE to C.UTF-8 and exports it, UTF-8 mode on
    {"LC_ALL": "C", "PYTHONCOERCECLOCALE": "warn"},
    {"LANG": "C.UTF-8", "PYTHONIOENCODING": "latin1", "PYTHONUNBUFFERED": "1"},
    {"LANG": "C.UTF-8", "PYTHONIOENCODING": ":replace", "PYTHONSAFEPATH": "1", "PYTHONDONTWRITEBYTECODE": "1",
     "PYTHONFAULTHANDLER": "1", "PYTHONINTMAXSTRDIGITS": "640", "PYTHONUTF8": "0"},
], ids=["c-locale", "lc-all-c", "ioencoding-unbuffered", "safepath-and-flags"])
def test_start_up_environment_variables_act_per_run(interpreter, proj, env):
    env = {"PATH": RUN_ENV["PATH"], **env}
    w, c = both(interpreter, "script", "sub/probe.py", cwd=proj, env=env)
    warm_facts, cold_facts = w.facts(), c.facts()
    if "PYTHONFAULTHANDLER" in env:
        # A fresh python enables faulthandler before its signal module starts, so getsignal()
        # says None for these; a run enables it later and getsignal() keeps saying SIG_DFL
        # (Note [What a warm run cannot make identical]).
        for name in ("SIGSEGV", "SIGFPE", "SIGABRT", "SIGBUS", "SIGILL"):
            assert cold_facts["signals"].pop(name) == "None"
            assert warm_facts["signals"].pop(name) == "<Handlers.SIG_DFL: 0>"
    assert warm_facts == cold_facts
    assert w.err == c.err


def test_signals_the_callers_shell_ignored_stay_ignored(interpreter, proj):
    ignored = (signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
    w, c = both(interpreter, "script", "sub/probe.py", cwd=proj, ignored=ignored)
    assert w.facts()["signals"] == c.facts()["signals"]
    assert w.facts()["signals"]["SIGINT"] == "<Handlers.SIG_IGN: 1>"


def test_stdout_and_stderr_on_one_pipe_interleave_as_in_plain_python(interpreter, tmp_path):
    # A pipe makes stdout block buffered and stderr line buffered: stderr lines come first.
    write(tmp_path / "mix.py", """\
        import sys
        for i in range(3):
            print("out", i)
            print("err", i, file=sys.stderr)
        sys.stdout.write("x" * 20000 + "\\n")
        print("last err", file=sys.stderr)
        """)
    w, c = both(interpreter, "script", "mix.py", cwd=tmp_path, merged=True)
    assert (w.status, w.out) == (c.status, c.out)
    assert w.out.startswith(b"err 0\nerr 1\nerr 2\n")


def test_stdout_to_a_file_and_stderr_to_a_pipe_match_plain_python(interpreter, tmp_path):
    write(tmp_path / "files.py", """\
        import sys
        print("to file", sys.stdout.isatty(), sys.stdout.line_buffering)
        print("to pipe", sys.stderr.isatty(), sys.stderr.line_buffering, file=sys.stderr)
        """)
    w = warm_run(interpreter, "script", "files.py", cwd=tmp_path, stdout_file=tmp_path / "w.txt")
    c = cold_run("script", "files.py", cwd=tmp_path, stdout_file=tmp_path / "c.txt")
    assert (w.status, w.out, w.err) == (c.status, c.out, c.err)
    assert w.out == b"to file False False\n"


def test_a_pty_is_a_tty_and_stdout_is_line_buffered(interpreter, tmp_path):
    write(tmp_path / "tty.py", """\
        import sys
        print("tty", sys.stdin.isatty(), sys.stdout.isatty(), sys.stderr.isatty(), sys.stdout.line_buffering)
        print("out 1"); print("err", file=sys.stderr); print("out 2")
        """)
    w, c = both(interpreter, "script", "tty.py", cwd=tmp_path, tty=True)
    assert (w.status, w.out) == (c.status, c.out)
    assert w.out == b"tty True True True True\r\nout 1\r\nerr\r\nout 2\r\n"


@pytest.mark.parametrize("low_fds", [False, True], ids=["fds-above-2", "fds-crossed-on-0-and-1"])
def test_stdin_is_read_as_in_plain_python(interpreter, tmp_path, low_fds):
    code = "name = input('name? '); import sys; rest = sys.stdin.read(); print(name.upper(), rest[::-1])"
    w, c = both(interpreter, "code", code, cwd=tmp_path, stdin="zoë\nabc\ndef".encode(), low_fds=low_fds)
    assert (w.status, w.out, w.err) == (c.status, c.out, c.err)
    assert w.out == "name? ZOË fed\ncba\n".encode()


@pytest.mark.parametrize("code, status", [
    ("print('out'); import sys; sys.exit(3)", 3),
    ("import sys; sys.exit(256 + 7)", 7),
    ("import sys; sys.exit('bye')", 1),
    ("import sys; sys.exit()", 0),
    ("print('x'); raise ValueError('boom')", 1),
    ("import sys; sys.excepthook = lambda t, v, tb: print('hooked', t.__name__, sys.last_value); 1/0", 1),
    ("raise KeyboardInterrupt", -2),
    ("import os, signal, time; os.kill(os.getpid(), signal.SIGINT); time.sleep(10)", -2),
    ("import os, signal, time; os.kill(os.getpid(), signal.SIGTERM); time.sleep(10)", -15),
    ("import os, signal, time; os.kill(os.getpid(), signal.SIGUSR2); time.sleep(10)", -12),
], ids=["exit-3", "exit-263", "exit-message", "exit-none", "exception", "excepthook",
        "keyboardinterrupt", "sigint", "sigterm", "sigusr2-unblocked"])
def test_exit_status_and_stderr_match_plain_python(interpreter, tmp_path, code, status):
    w, c = both(interpreter, "code", code, cwd=tmp_path)
    assert (w.status, w.out, w.err) == (c.status, c.out, c.err)
    assert w.status == status


def test_a_script_error_shows_the_same_traceback(interpreter, tmp_path):
    write(tmp_path / "boom.py", """\
        def inner():
            raise RuntimeError("deep")
        inner()
        """)
    write(tmp_path / "syntax.py", "x = (\n")
    for script in ("boom.py", "syntax.py"):
        w, c = both(interpreter, "script", script, cwd=tmp_path)
        assert (w.status, w.err) == (c.status, c.err) and w.status == 1
        assert b"warm/script.py" not in w.err  # its frames are cut from the traceback


@pytest.mark.parametrize("mode, target, status", [
    ("script", "missing.py", 2), ("module", "no_such_module", 1), ("script", "empty_dir", 1)])
def test_what_cannot_be_found_fails_as_in_plain_python(interpreter, tmp_path, mode, target, status):
    (tmp_path / "empty_dir").mkdir()
    w, c = both(interpreter, mode, target, cwd=tmp_path)
    assert (w.status, w.out, w.err) == (c.status, c.out, c.err)
    assert w.status == status


def test_a_stdout_nobody_reads_fails_the_final_flush_with_status_120(interpreter, tmp_path):
    # SIGPIPE must be ignored (the interpreter had it at SIG_DFL) and the flush error reported.
    w, c = both(interpreter, "code", "print('x' * 10)", cwd=tmp_path, stdout_closed=True)
    assert (w.status, w.err) == (c.status, c.err)
    assert w.status == 120 and b"BrokenPipeError" in w.err


def test_threads_atexit_and_finalizers_run_before_exit(interpreter, tmp_path):
    write(tmp_path / "late.py", """\
        import atexit, sys, threading, time
        atexit.register(lambda: print("atexit ran, __file__ kept:", hasattr(sys.modules["__main__"], "__file__")))
        def late():
            time.sleep(0.2)
            print("thread done")
        threading.Thread(target=late).start()
        left_open = open("left-open.txt", "w")
        left_open.write("written, never closed\\n")
        import keeper  # a module of the user's holding an open file of its own
        class Goodbye:
            def __del__(self):
                print("__del__ ran")
        goodbye = Goodbye()
        print("main done")
        """)
    write(tmp_path / "keeper.py", """\
        import sys
        kept = open("kept-open.txt", "w")
        kept.write("kept by a module\\n")
        sys.modules[__name__ + ".file"] = kept  # held past __main__'s teardown
        """)
    files = ("left-open.txt", "kept-open.txt")
    w = warm_run(interpreter, "script", "late.py", cwd=tmp_path)
    warm_files = [(tmp_path / name).read_bytes() for name in files]
    c = cold_run("script", "late.py", cwd=tmp_path)
    assert (w.status, w.out, w.err) == (c.status, c.out, c.err)
    assert w.out == b"main done\nthread done\natexit ran, __file__ kept: False\n__del__ ran\n"
    assert warm_files == [(tmp_path / name).read_bytes() for name in files]
    assert warm_files == [b"written, never closed\n", b"kept by a module\n"]


def test_the_interpreters_unflushed_output_never_reaches_a_run(interpreter, tmp_path):
    # Without gc.freeze() in the interpreter, the exit sweep sees the interpreter's own stdout too.
    w = warm_run(interpreter, "code", "print('run output')", cwd=tmp_path, unfreeze=True)
    assert (w.status, w.out, w.err) == (0, b"run output\n", b"")


def test_random_state_is_fresh_in_every_run(interpreter, tmp_path):
    code = ("import json, multiprocessing, random, numpy, torch; print(json.dumps([random.random(), "
            "float(numpy.random.rand()), torch.randn(3).tolist(), torch.initial_seed(), "
            "multiprocessing.current_process().authkey.hex()]))")
    first, second = (warm_run(interpreter, "code", code, cwd=tmp_path).facts() for _ in range(2))
    for a, b in zip(first, second):
        assert a != b
    random.seed(0)
    assert first[0] != random.random()
    assert 0 not in (first[3], second[3])  # the interpreter's torch.manual_seed(0) is gone


def test_multiprocessing_spawn_and_fork_work_from_a_warm_script(interpreter, tmp_path):
    write(tmp_path / "mp.py", """\
        import multiprocessing, os, pickle, sys
        class Point:
            def __init__(self, x):
                self.x = x
        def child(queue, point):
            queue.put((type(point).__module__, type(point).__qualname__, point.x * 2, sys.path[0]))
        if __name__ == "__main__":
            assert type(pickle.loads(pickle.dumps(Point(1)))) is Point
            for method in ("spawn", "fork"):
                ctx = multiprocessing.get_context(method)
                queue = ctx.Queue()
                proc = ctx.Process(target=child, args=(queue, Point(21)))
                proc.start()
                print(method, queue.get(timeout=60), flush=True)
                proc.join()
                print(method, "exit", proc.exitcode)
        """)
    w, c = both(interpreter, "script", "mp.py", cwd=tmp_path)
    assert (w.status, w.out, w.err) == (c.status, c.out, c.err)
    # A spawned child imports the script as __mp_main__ (plain python's too) and unpickles Point.
    assert b"spawn ('__mp_main__', 'Point', 42, " in w.out and b"fork ('__main__', 'Point', 42, " in w.out


def test_setup_failure_starts_a_cold_python_that_fails_as_plain_python_does(interpreter, tmp_path):
    env = {**RUN_ENV, "PYTHONIOENCODING": "no-such-codec"}
    w, c = both(interpreter, "code", "print('unreachable')", cwd=tmp_path, env=env)
    assert w.status == c.status == 1 and w.out == c.out == b""
    assert w.err.startswith(b"overmind: warm start failed (LookupError(")
    assert b"unknown encoding: no-such-codec" in c.err and b"unknown encoding: no-such-codec" in w.err


def test_a_bad_spec_is_reported_on_the_runs_stderr(interpreter, tmp_path):
    spec = {"mode": "script", "target": "x.py", "argv": "not a list", "cwd": str(tmp_path),
            "env": RUN_ENV, "umask": 0o022}
    w = run(lambda fds: interpreter.launch(spec, fds))
    assert w.status == 1 and b"run spec field 'argv' must be list" in w.err


# --------------------------------------------------------------------------- installed_modules

@pytest.fixture
def importable(tmp_path, monkeypatch):
    """Import modules from folders of tmp_path; forget them afterwards."""
    added: list[str] = []

    def load(name: str, *folders: Path):
        for folder in reversed(folders):
            if str(folder) not in sys.path:
                monkeypatch.syspath_prepend(str(folder))
        added.append(name)
        return __import__(name)

    yield load
    for name in added:
        sys.modules.pop(name, None)


def test_installed_modules_keeps_stdlib_and_site_packages_but_no_user_code(tmp_path, monkeypatch, importable):
    write(tmp_path / "proj" / "user_module.py", "")
    write(tmp_path / "elsewhere" / "pythonpath_module.py", "")
    monkeypatch.chdir(tmp_path / "proj")
    importable("user_module", tmp_path / "proj")
    importable("pythonpath_module", tmp_path / "elsewhere")
    names = warm.installed_modules()
    assert {"json", "sys", "_io", "pytest", "_pytest.python"} <= set(names)
    # overmind is installed editable from src/: by definition outside every installed prefix.
    assert not {"overmind", "overmind.warm.script", "user_module", "pythonpath_module", "__main__"} & set(names)
    assert names.index("_pytest") < names.index("_pytest.python")  # import order


def test_installed_modules_at_a_warm_runs_exit_never_lists_modules_beside_its_script(interpreter, tmp_path):
    # The script's folder lies inside the "installed" prefix; the cwd is elsewhere; and by the
    # time atexit callbacks run, __main__.__file__ is gone (as in plain python).
    write(tmp_path / "prefix" / "scripts" / "helper.py", "")
    write(tmp_path / "prefix" / "scripts" / "main.py", f"""\
        import atexit, helper, json
        from overmind.warm import script as warm
        atexit.register(lambda: print(json.dumps(warm.installed_modules(prefixes=({str(tmp_path / "prefix")!r},)))))
        """)
    (tmp_path / "cwd").mkdir()
    ran = warm_run(interpreter, "script", str(tmp_path / "prefix" / "scripts" / "main.py"), cwd=tmp_path / "cwd")
    names = ran.facts()
    assert "helper" not in names and "json" not in names  # json: outside the given prefix


def test_installed_modules_gives_a_file_to_the_deepest_folder_holding_it(tmp_path, monkeypatch, importable):
    proj, site = tmp_path / "proj", tmp_path / "proj" / ".venv" / "site-packages"
    write(site / "venv_module.py", "")
    write(proj / "beside_script.py", "")
    write(proj / "real_module.py", "")
    (site / "linked_module.py").symlink_to(proj / "real_module.py")
    write(site / "shared_ns" / "a.py", "")
    write(proj / "shared_ns" / "b.py", "")
    write(site / "site_ns" / "c.py", "")
    monkeypatch.chdir(proj)
    for name in ("venv_module", "beside_script", "linked_module", "shared_ns", "site_ns"):
        importable(name, site, proj)
    assert len(sys.modules["shared_ns"].__path__) == 2
    names = set(warm.installed_modules(prefixes=(str(site),)))
    assert {"venv_module", "site_ns"} <= names
    assert not {"beside_script", "linked_module", "shared_ns"} & names
    assert "venv_module" not in warm.installed_modules(prefixes=(str(site),), exclude=(str(site),))


# ------------------------------------------------------------------ a failed import's leftovers

FAILED_IMPORT = r"""
import json, sys
import overmind.warm.installed as installed
from overmind.warm.interpreter import Holdings

installed.installed_prefixes = lambda: [sys.argv[1]]  # the folder holding pkgx counts as installed
held = Holdings()
held.refused_modules.add("pkgx_blocked")  # kept out, as a module that started an unknown thread is
imported = held.import_(["pkgx"])
left = sorted(n for n in sys.modules if n.startswith("pkgx"))
sys.modules.pop("pkgx_blocked", None)
import pkgx  # what a run forked from this interpreter does: the watch is gone
print(json.dumps({"imported": imported, "left": left, "capi": getattr(pkgx, "capi", None)}))
"""


def test_a_package_whose_import_failed_part_way_is_imported_whole_by_a_run(tmp_path):
    """Note [A failed import leaves no orphans] in overmind.warm.interpreter: pandas' datetime
    extension hangs its C API on the package as it loads; a run that found it imported already
    failed with "partially initialized module 'pandas' has no attribute '_pandas_datetime_CAPI'"."""
    write(tmp_path / "pkgx" / "__init__.py", "from pkgx import part\nimport pkgx_blocked\n")
    write(tmp_path / "pkgx" / "part.py", "import sys\nsys.modules['pkgx'].capi = 'set by part'\n")
    write(tmp_path / "pkgx_blocked.py", "")
    proc = subprocess.run([sys.executable, "-c", FAILED_IMPORT, str(tmp_path)], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path.parent, env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result["imported"] == [] and result["left"] == []  # refused, and no submodule of it stays
    assert result["capi"] == "set by part"  # the run imported the package whole, as plain python does
