"""A real overmind-server subprocess in a private temp runtime dir, and small real models."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ..conftest import REPO, age_files, child_env, run_python


# A server that leaves its file segments to the page cache, so that a test can lose one as
# memory pressure would (Note [File segments stay mapped] in overmind.server.settle).
LEFT_TO_PAGE_CACHE = {"OVERMIND_KEEP_FILE_PAGES": "0"}


def lose_from_page_cache(path: Path) -> None:
    """Evict ``path`` from the page cache, as another workload's memory needs do, and check it
    is lost (``cachestat``); skip where the kernel cannot tell (Linux < 6.5)."""
    from overmind.shared.segments.memfd import RESIDENT, cached_share

    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # written just now: dirty pages would stay
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        share = cached_share(fd, path.stat().st_size)
        if share is None:
            pytest.skip("this kernel has no cachestat (Linux 6.5): nothing can tell a lost file")
        assert share < RESIDENT
    finally:
        os.close(fd)


class ServerProcess:
    """A real overmind-server in the foreground, started and stopped by ``running_server`` (the
    ``server`` and ``make_server`` fixtures): tests never construct one themselves."""

    def __init__(self, runtime_dir: Path, extra_env: dict | None = None, args: tuple = (), *,
                 under: tuple = (), code: str | None = None, stop_signal: int = signal.SIGTERM) -> None:
        self.runtime_dir = runtime_dir
        self.env = child_env(OVERMIND_RUNTIME_DIR=str(runtime_dir), OVERMIND_NO_AUTOSTART="1", **(extra_env or {}))
        self.stop_signal = stop_signal
        server = ["-c", code] if code is not None else ["-m", "overmind.server", "--foreground"]
        self.proc = subprocess.Popen(
            [*under, sys.executable, *server, *args],
            env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
        )
        line = self.proc.stdout.readline()  # the readiness line; blocks until listening
        if "ready" not in line:
            self.proc.kill()
            _, err = self.proc.communicate(timeout=30)  # reaped, its pipes closed
            raise RuntimeError(f"server did not start: {line!r} {err[-2000:]}")
        self.pid = self.proc.pid

    @property
    def socket_path(self) -> Path:
        return self.runtime_dir / "server.sock"

    def client_env(self, **extra: str) -> dict:
        return {**self.env, **extra}

    def run(self, code: str, **kwargs) -> subprocess.CompletedProcess:
        env = kwargs.pop("env", None) or self.client_env()
        return run_python(code, env=env, **kwargs)

    def cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run([sys.executable, "-m", "overmind.frontend.cli", *args], env=self.env, capture_output=True,
                              text=True, timeout=60, cwd=REPO)
        if check and proc.returncode != 0:
            raise AssertionError(f"overmind {' '.join(args)} exited {proc.returncode}: {proc.stderr}")
        return proc

    def status(self) -> dict:
        from overmind.shared import protocol as P
        from overmind.client.connection import LoadingConnection
        from overmind.shared.settings.config import Config

        with LoadingConnection.open(Config.from_env(self.env), role="cli", autostart=False) as conn:
            return conn.simple(P.Status(), P.StatusReply).info

    def wait_idle(self, timeout: float = 180.0) -> dict:
        """Wait until no load is in flight (cold loads finish behind the caller) and no loader
        still rebuilds its segments out of huge pages."""
        deadline = time.monotonic() + timeout
        while True:
            status = self.status()
            if (status["loading"] == 0 and status["loaders_exiting"] == 0) or time.monotonic() > deadline:
                return status
            time.sleep(0.1)

    def wait_settled(self, timeout: float = 180.0) -> dict:
        """Wait until idle and every file segment is copied into sealed memory (a server started
        with OVERMIND_SETTLE_AFTER=0: Note [Settling file segments] in overmind.server.settle)."""
        deadline = time.monotonic() + timeout
        while True:
            status = self.wait_idle(timeout)
            files = status["file_segments"]
            if (files["bytes"] == 0 and files["copying"] is None) or time.monotonic() > deadline:
                return status
            time.sleep(0.1)

    def log(self) -> str:
        try:
            return (self.runtime_dir / "server.log").read_text()
        except FileNotFoundError:
            return ""

    def stop(self) -> None:
        """Stop it with its ``stop_signal`` (woken first: a test may have stopped it); a no-op once
        it is gone, so a test may stop it early (a restart) and the finalizer again."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.send_signal(self.stop_signal)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream:
                stream.close()


@contextlib.contextmanager
def running_server(runtime_dir: Path | None = None, env: dict | None = None, *, args: tuple = (), under: tuple = (),
                   code: str | None = None, stop_signal: int = signal.SIGTERM,
                   prefix: str = "om-") -> Iterator[ServerProcess]:
    """The one place the tests start a real overmind-server subprocess: ready when entered (it
    printed its readiness line), stopped on leaving, whatever the test did to it.

    ``runtime_dir``: where it runs; by default a new short one in /tmp whose name starts with
    ``prefix``, removed after.
    ``env``: settings of its own (``OVERMIND_*``, ``LD_PRELOAD``), also in its ``client_env()``.
    ``args``: command-line flags (``--max-memory``). ``under``: the command it runs under
    (``unshare --pid ...``, ``prlimit ...``, ``setpriv ...``). ``code``: the Python it runs in
    place of ``-m overmind.server --foreground`` (a server patched to act as an older one).
    ``stop_signal``: what the finalizer sends it (SIGKILL where a clean shutdown would hang, or to
    take a wrapper down with it).

    Function-scoped tests use the ``server`` and ``make_server`` fixtures; a module's fixture
    enters this itself."""
    own = runtime_dir is None
    if own:
        runtime_dir = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))  # AF_UNIX paths: short
    try:
        server = ServerProcess(runtime_dir, env, args, under=under, code=code, stop_signal=stop_signal)
        try:
            yield server
        finally:
            server.stop()
    finally:
        if own:
            shutil.rmtree(runtime_dir, ignore_errors=True)


_STARTED = pytest.StashKey[list]()  # the servers a test started, for its report


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test that ran a server reports the end of its log: on a lent GPU machine, or in
    CI, the log is gone with the runtime dir once the test is."""
    report = (yield).get_result()
    if report.when == "call" and report.failed:
        logs = {server.runtime_dir: server for server in item.stash.get(_STARTED, [])}  # one log per runtime dir
        for runtime_dir, server in logs.items():
            where = "" if len(logs) == 1 else f" ({runtime_dir})"
            report.sections.append((f"overmind-server log{where}, last 6000 characters", server.log()[-6000:]))


@pytest.fixture
def runtime_dir(tmp_path_factory) -> Path:
    # AF_UNIX paths are limited to 108 bytes: keep the runtime dir short.
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="om-", dir="/tmp"))
    yield path
    subprocess.run(["rm", "-rf", str(path)])


@pytest.fixture
def make_server(request, runtime_dir) -> Iterator[Callable[..., ServerProcess]]:
    """``make_server(env=None, *, runtime_dir=None, **options)``: a real server started now, in
    the test's ``runtime_dir`` unless given another, with ``running_server``'s options; every one
    the test started is stopped at its teardown, the last first. For settings of its own, a
    restart (stop the first, start again on the same directories), several servers, or a server
    the test kills or stops itself."""
    started = request.node.stash.setdefault(_STARTED, [])
    tests_dir = runtime_dir
    with contextlib.ExitStack() as finalizers:
        def start(env: dict | None = None, *, runtime_dir: Path | None = None, **options) -> ServerProcess:
            server = finalizers.enter_context(running_server(runtime_dir or tests_dir, env, **options))
            started.append(server)
            return server

        yield start


@pytest.fixture
def server(make_server) -> ServerProcess:
    """A real server with the default settings, in the test's ``runtime_dir``."""
    return make_server()


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> dict[str, Path]:
    """Small real models saved once per session (fresh random weights, fixed seeds)."""
    root = tmp_path_factory.mktemp("models")
    from overmind import modelgen

    out = {
        "unet": modelgen.save_unet(root / "unet", seed=1),
        "vae": modelgen.save_vae(root / "vae", seed=2),
        "controlnet_a": modelgen.save_controlnet(root / "controlnet_a", seed=3),
        "controlnet_b": modelgen.save_controlnet(root / "controlnet_b", seed=4),
        "lm": modelgen.save_lm(root / "lm", seed=5),
    }
    age_files(root)
    return out


def last_json(proc: subprocess.CompletedProcess):
    return json.loads(proc.stdout.strip().splitlines()[-1])


# The LM of ``models`` loaded with monkey_patch_all(), compared with its file: equal weights, the
# file mapped (a file segment), a hit.
LOAD_AND_LOOK = """
import json, overmind.api
overmind.api.monkey_patch_all()
from safetensors import safe_open
from transformers import AutoModelForCausalLM
path = {path!r}
model = AutoModelForCausalLM.from_pretrained(path)
with safe_open(path + "/model.safetensors", "pt") as f:
    equal = all(model.state_dict()[k].equal(f.get_tensor(k)) for k in f.keys())
maps = open("/proc/self/maps").read()
print(json.dumps({{"equal": equal, "maps_file": path + "/model.safetensors" in maps, "hit": overmind.api.cache_key_of(model) is not None}}))
"""


# -- runs handed to a warm interpreter (``overmind run``, and a script's warm start) ------------

OVERMIND = str(Path(sys.executable).parent / "overmind")


def overmind_run(server: ServerProcess, *args, env=None, **kwargs) -> subprocess.CompletedProcess:
    """``overmind run ARGS`` against ``server``; stdout and stderr captured unless given."""
    kwargs.setdefault("stdout", subprocess.PIPE)
    kwargs.setdefault("stderr", subprocess.PIPE)
    kwargs.setdefault("timeout", 120)
    return subprocess.run([OVERMIND, "run", *args], env=env or server.client_env(), text=True, **kwargs)


def runs_forked(server: ServerProcess) -> int:
    return server.status()["runs"]


def wait_warm(server: ServerProcess, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(z["ready"] for z in server.status()["interpreters"]):
            return
        time.sleep(0.1)
    raise AssertionError(f"no warm interpreter after {timeout}s: {server.status()['interpreters']}")


def started_warm_server(prefix: str):
    """A real server whose warm interpreter is ready, for a module's fixture to ``yield from``."""
    with running_server(prefix=prefix) as server:
        overmind_run(server, "-c", "pass")  # refused: starts the warm interpreter
        wait_warm(server)
        yield server


def plain_python(*args, env, cwd, umask=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=120, cwd=cwd,
                          preexec_fn=(lambda: os.umask(umask)) if umask is not None else None)


def curve(server: ServerProcess, script: Path, env: dict, runs: int = 3) -> list[tuple[bool, dict]]:
    """Runs 1..``runs`` of ``overmind run script``, each after the last one's fill: (forked, output)."""
    outputs = []
    for _ in range(runs):
        before = runs_forked(server)
        proc = overmind_run(server, str(script), env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        outputs.append((runs_forked(server) > before, last_json(proc)))
        server.wait_idle()
        try:
            wait_warm(server)
        except AssertionError as err:
            raise AssertionError(f"{err}\n{server.log()[-20000:]}") from None
    return outputs


def spawn_in_pty(argv, env):
    """Start ``argv`` as a session leader with a new pty as its controlling terminal."""
    import fcntl
    import pty
    import termios

    master, slave = pty.openpty()

    def take_terminal():
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)
        # As a terminal's shell starts a foreground job, whatever started these tests (a
        # background job ignores SIGINT and SIGQUIT, and exec keeps an ignored signal).
        for sig in (signal.SIGINT, signal.SIGQUIT):
            signal.signal(sig, signal.SIG_DFL)

    proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env, start_new_session=True,
                            preexec_fn=take_terminal)
    os.close(slave)
    return proc, master


def read_until(fd: int, marker: bytes, timeout: float = 60) -> bytes:
    import select

    data = b""
    deadline = time.monotonic() + timeout
    while marker not in data:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise AssertionError(f"no {marker!r} in {data!r}")
        try:
            chunk = os.read(fd, 4096)
        except OSError:
            break
        if not chunk:
            break
        data += chunk
    return data
