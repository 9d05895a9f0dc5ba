"""Processes the benchmark drives: workers, a private overmind-server, the page cache, /proc.

    with BenchServer.start() as server:             # its own runtime dir: never the user's cache
        worker = Worker(server.client_env(), ["diffusers:AutoencoderKL"], log_dir, "cold-1")
        reply = worker.request({"op": "load", ...})
        server.wait_idle()

Note [The bench's own server]
The benchmark evicts entries and restarts its server between runs; doing that to the
user's server would throw away their cache. It therefore starts an ``overmind-server`` in
a private temporary runtime directory, points every overmind worker at it with
``OVERMIND_RUNTIME_DIR`` (and ``OVERMIND_NO_AUTOSTART=1``, so a worker never starts one
elsewhere), and shuts it down at the end. Workers inherit no other ``OVERMIND_*`` setting
of the user's but ``OVERMIND_LOG_LEVEL``, so a run measures the defaults.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterable, Optional

from overmind.bench.worker import REPLY_PREFIX

__all__ = ["BenchError", "Worker", "BenchServer", "base_env", "drop_page_cache", "pss", "tree_pss",
           "used_memory", "startup_overhead", "summary"]


def summary(values: list[float]) -> dict:
    """Median, min, max and count of one figure's runs: every scenario's JSON uses this shape."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}

# A cold load of a 3.5 GB pipeline takes tens of seconds here; hours mean something hangs.
JOB_TIMEOUT = 1800.0
READY_TIMEOUT = 600.0


class BenchError(RuntimeError):
    pass


def base_env(extra: Optional[dict] = None) -> dict:
    """The environment of every child: the user's, minus their OVERMIND_* settings but the log
    level (it changes what the kept logs say, nothing else), offline."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OVERMIND_") or k == "OVERMIND_LOG_LEVEL"}
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    env.update(extra or {})
    return env


class Worker:
    """One fresh ``python -m overmind.bench.worker``; stderr goes to ``<log_dir>/<label>.log``."""

    def __init__(self, env: dict, preload: Iterable[str], log_dir: Path, label: str, cwd: Optional[str] = None):
        self.label = label
        self.log_path = Path(log_dir) / f"{label}.log"
        self._log = open(self.log_path, "w")
        start = time.monotonic()
        env = {**env, "OVERMIND_BENCH_T0": repr(start), "OVERMIND_BENCH_PRELOAD": ",".join(preload)}
        self.proc = subprocess.Popen([sys.executable, "-m", "overmind.bench.worker"], env=env, cwd=cwd,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
                                     bufsize=1)
        self.pid = self.proc.pid
        self.ready: dict = {}

    def wait_ready(self) -> dict:
        if not self.ready:
            self.ready = self._read(READY_TIMEOUT)
        if not self.ready.get("ready"):
            raise BenchError(f"worker {self.label} did not start: {self.ready.get('error')}\n{self.stderr_tail()}")
        return self.ready

    def send(self, job: dict) -> None:
        try:
            self.proc.stdin.write(json.dumps(job) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise BenchError(f"worker {self.label} exited\n{self.stderr_tail()}") from None

    def receive(self, timeout: float = JOB_TIMEOUT) -> dict:
        reply = self._read(timeout)
        if not reply.get("ok"):
            raise BenchError(f"{self.label}: {reply.get('error')}\n{reply.get('traceback', '')}")
        return reply

    def request(self, job: dict, timeout: float = JOB_TIMEOUT) -> dict:
        self.send(job)
        return self.receive(timeout)

    def _read(self, timeout: float) -> dict:
        # A watchdog, not select(): the pipe is line-buffered text and libraries print too.
        timer = threading.Timer(timeout, self.proc.kill)
        timer.start()
        try:
            while True:
                line = self.proc.stdout.readline()
                if not line:
                    self.proc.wait()
                    raise BenchError(f"worker {self.label} exited with status {self.proc.returncode}"
                                     f"{' (timed out)' if not timer.is_alive() else ''}\n{self.stderr_tail()}")
                at = line.find(REPLY_PREFIX)  # after whatever a library printed without a newline
                if at >= 0:
                    return json.loads(line[at + len(REPLY_PREFIX):])
        finally:
            timer.cancel()

    def stderr(self) -> str:
        if not self._log.closed:
            self._log.flush()
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def stderr_tail(self, chars: int = 4000) -> str:
        text = self.stderr()
        return f"--- {self.log_path} (last {chars} characters)\n{text[-chars:]}" if text else ""

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send({"op": "exit"})
                self.proc.wait(timeout=30)
            except (BenchError, OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass
        self._log.close()

    def __enter__(self) -> "Worker":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class BenchServer:
    """A private overmind-server (Note [The bench's own server])."""

    def __init__(self, runtime_dir: Path) -> None:
        self.runtime_dir = runtime_dir
        # Its state (overmind.server.state) lives and dies with its runtime directory: a restart keeps it
        # (restart(), the warm-up curve's run after a restart), stop() removes it.
        self.env = base_env({"OVERMIND_RUNTIME_DIR": str(runtime_dir), "OVERMIND_NO_AUTOSTART": "1",
                             "OVERMIND_STATE_DIR": str(runtime_dir / "state")})
        self.pid = 0

    @classmethod
    def start(cls, extra_env: Optional[dict] = None) -> "BenchServer":
        # AF_UNIX socket paths are limited to 108 bytes: a short directory under /tmp.
        server = cls(Path(tempfile.mkdtemp(prefix="om-bench-", dir="/tmp")))
        server.env.update(extra_env or {})
        server.launch()
        return server

    @classmethod
    def autostart(cls, extra_env: Optional[dict] = None) -> "BenchServer":
        """One that the first client run starts, as a user's first run does (Note [A run's
        interpreter imports under the run's environment] in overmind.server.pool): nothing runs
        until then, and :meth:`status` says ``{}``."""
        server = cls(Path(tempfile.mkdtemp(prefix="om-bench-", dir="/tmp")))
        del server.env["OVERMIND_NO_AUTOSTART"]
        server.env.update(extra_env or {})
        return server

    def launch(self) -> None:
        proc = subprocess.run([sys.executable, "-m", "overmind.server", "--daemon"], env=self.env,
                              capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise BenchError(f"overmind-server did not start (status {proc.returncode}): {proc.stderr.strip()}\n"
                             f"{self.log()[-3000:]}")
        self.pid = int((self.runtime_dir / "server.pid").read_text().split()[0])

    def client_env(self, extra: Optional[dict] = None) -> dict:
        return {**self.env, **(extra or {})}

    def cli(self, *args: str) -> str:
        """``overmind --runtime-dir DIR ARGS...``, in this process: a subprocess per poll would
        take a CPU core's worth of interpreter start-ups from the load it waits for."""
        import contextlib
        import io

        from overmind.frontend.cli import main as cli_main

        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            status = cli_main(["--runtime-dir", str(self.runtime_dir), *args])
        if status != 0:
            raise BenchError(f"overmind {' '.join(args)} exited {status}: {err.getvalue().strip()}")
        return out.getvalue()

    def status(self) -> dict:
        if not self.pid:  # autostart(): started by a run, or not yet
            try:
                self.pid = int((self.runtime_dir / "server.pid").read_text().split()[0])
            except (OSError, ValueError, IndexError):
                return {}
        return json.loads(self.cli("status", "--json"))

    def evict_all(self) -> None:
        self.cli("evict", "--all")

    def wait_idle(self, timeout: float = JOB_TIMEOUT) -> dict:
        """Cold loads finish behind the caller (Note [Cold loads run behind the caller] in
        overmind.server.loads): the next run must not share the machine with a cache fill, nor with
        a loader still rebuilding its segments out of huge pages (Note [Huge pages for segments]
        in overmind.shared.segments.memfd), and a warm load measures the segments as they stay."""
        deadline = time.monotonic() + timeout
        while True:
            status = self.status()
            if status.get("loading", 0) == 0 and status.get("loaders_exiting", 0) == 0:
                return status
            if time.monotonic() > deadline:
                raise BenchError(f"the server is still loading after {timeout:.0f} s: {status}")
            time.sleep(0.1)

    def restart(self, keep_state: bool = True) -> None:
        """Stopped and started again on the same runtime directory. ``keep_state``: on its state
        directory too, returning once its restore is done, as the systemd unit does (``overmind
        status --wait-ready``); else as a server that never ran before."""
        self.stop(remove=False)
        if not keep_state:
            shutil.rmtree(self.runtime_dir / "state", ignore_errors=True)
        self.launch()
        if keep_state:
            self.cli("status", "--wait-ready", "--timeout", "600")

    def log(self) -> str:
        try:
            return (self.runtime_dir / "server.log").read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def stop(self, remove: bool = True) -> None:
        try:
            self.cli("shutdown")
        except BenchError:
            if self.pid:
                try:
                    os.kill(self.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if remove:
            shutil.rmtree(self.runtime_dir, ignore_errors=True)

    def __enter__(self) -> "BenchServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


# -- the page cache ---------------------------------------------------------------------------


def drop_all_caches() -> str:
    """The whole machine's page cache, dentries and inodes (``overmind-bench --drop-caches``):
    root only. Raises :class:`BenchError` where it is not permitted."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError as err:
        raise BenchError(f"--drop-caches: cannot write /proc/sys/vm/drop_caches ({err}); it needs root") from None
    return "drop_caches"


def drop_page_cache(files: Iterable[Path]) -> str:
    """Evict ``files`` from the page cache; returns the method used.

    ``posix_fadvise(POSIX_FADV_DONTNEED)`` per file needs no privilege and leaves the rest of
    a shared machine's cache alone; it drops clean pages that no process maps, hence the
    ``fdatasync`` first. ``/proc/sys/vm/drop_caches`` (root only, the whole machine) is the
    fallback. Raises :class:`BenchError` when neither is permitted."""
    files = list(files)
    try:
        for path in files:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        return "posix_fadvise"
    except (OSError, AttributeError) as fadvise_error:
        try:
            os.sync()
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("1\n")
            return "drop_caches"
        except OSError as drop_error:
            raise BenchError(f"cannot drop the page cache: posix_fadvise: {fadvise_error}; "
                             f"/proc/sys/vm/drop_caches: {drop_error}") from None


# -- memory -----------------------------------------------------------------------------------


def pss(pid: int) -> int:
    """Proportional set size of ``pid`` in bytes (shared pages divided among their users)."""
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    return 0


def tree_pss(pid: int) -> int:
    """PSS of ``pid`` and its descendants (the server, its warm interpreters and loaders)."""
    import psutil

    total = 0
    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    for proc in procs:
        try:
            total += pss(proc.pid)
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            pass
    return total


def _used_now() -> int:
    info = {}
    with open("/proc/meminfo") as f:
        for line in f:
            name, _, rest = line.partition(":")
            info[name] = int(rest.split()[0]) * 1024
    return info["MemTotal"] - info["MemAvailable"]


def used_memory(patience: float = 10.0, interval: float = 0.2, window: int = 3, tolerance: int = 32 << 20) -> int:
    """The machine's used memory: MemTotal - MemAvailable (what the kernel cannot reclaim;
    shared memory counts, page cache does not), once it holds still.

    Freed memory reaches MemAvailable with a lag (seconds, on this VM, after processes let
    go of gigabytes), and on a shared machine other processes come and go: wait until
    ``window`` readings ``interval`` apart agree within ``tolerance``, at most ``patience``
    seconds, and return their median."""
    readings = [_used_now()]
    deadline = time.monotonic() + patience
    while time.monotonic() < deadline:
        time.sleep(interval)
        readings.append(_used_now())
        last = readings[-window:]
        if len(last) == window and max(last) - min(last) <= tolerance:
            break
    return int(statistics.median(readings[-window:]))


# -- start-up ---------------------------------------------------------------------------------


def startup_overhead(repeats: int) -> dict:
    """What ``import overmind.api; monkey_patch_all()`` adds to a fresh interpreter.

    The runtime dir is empty: the background prestart request finds no server (and starts
    none), so this neither reaches the user's server nor adds a warm interpreter to the bench's."""
    empty = tempfile.mkdtemp(prefix="om-bench-empty-", dir="/tmp")
    env = base_env({"OVERMIND_NO_AUTOSTART": "1", "OVERMIND_RUNTIME_DIR": empty})

    def times(code: str) -> list[float]:
        out = []
        for _ in range(repeats):
            start = time.perf_counter()
            subprocess.run([sys.executable, "-c", code], check=True, env=env)
            out.append(time.perf_counter() - start)
        return out

    try:
        bare = times("pass")
        patched = times("import overmind.api; overmind.api.monkey_patch_all()")
    finally:
        shutil.rmtree(empty, ignore_errors=True)
    return {"bare_s": bare, "patched_s": patched,
            "added_s": statistics.median(patched) - statistics.median(bare)}
