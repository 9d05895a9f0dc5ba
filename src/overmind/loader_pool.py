"""Server side of loader processes: one zygote per client context. Standard library only.

A *context* is where a client's load must run: its interpreter, working directory,
``sys.path`` and the environment variables that shape loading. For each context the
server keeps a zygote, ``python -m``-started in that context, which imports torch
(and, as jobs ask, diffusers/transformers) once and then forks one short-lived child
per load (``overmind.loader``). A cold load therefore pays neither interpreter
start-up nor library imports, and every load still runs in a fresh process that
exits when done.

Note [Zygotes never touch CUDA]
A process that initialised CUDA cannot fork usable children, so the zygote only
imports; the forked child may use the GPU (bitsandbytes quantisation, ``.to('cuda')``)
and exits afterwards, taking its CUDA context with it. The server itself never
imports torch at all.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from overmind import protocol as P
from overmind.config import ENV_NAMES, ENV_PREFIXES, Config, open_runtime_file

logger = logging.getLogger("overmind.server.loaders")

__all__ = ["Context", "LoaderPool", "LoadFailure", "context_from_wire", "ENV_PREFIXES", "ENV_NAMES"]

MAX_ZYGOTES = 4
READY_TIMEOUT = 300.0


class LoadFailure(Exception):
    def __init__(self, code: int, message: str, traceback: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.traceback = traceback


@dataclass(frozen=True)
class Context:
    python: str
    cwd: str
    sys_path: tuple
    env: tuple  # sorted (name, value) pairs

    @property
    def key(self) -> str:
        raw = json.dumps([self.python, self.cwd, list(self.sys_path), list(self.env)]).encode()
        return hashlib.sha256(raw).hexdigest()[:16]


def context_from_wire(data: dict) -> Context:
    """Validate a client's context (Note [Frames are untrusted] in overmind.protocol)."""
    try:
        python, cwd, sys_path, env = data["python"], data["cwd"], data["sys_path"], data["env"]
    except (KeyError, TypeError):
        raise LoadFailure(P.ErrorCode.BAD_REQUEST, "context needs python, cwd, sys_path and env") from None
    if not (isinstance(python, str) and os.path.isabs(python) and os.access(python, os.X_OK)):
        raise LoadFailure(P.ErrorCode.BAD_REQUEST, f"context python {python!r} is not an executable absolute path")
    if not (isinstance(cwd, str) and os.path.isdir(cwd)):
        raise LoadFailure(P.ErrorCode.BAD_REQUEST, f"context cwd {cwd!r} is not a directory")
    if not (isinstance(sys_path, list) and all(isinstance(p, str) for p in sys_path)):
        raise LoadFailure(P.ErrorCode.BAD_REQUEST, "context sys_path must be a list of strings")
    if not (isinstance(env, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
        raise LoadFailure(P.ErrorCode.BAD_REQUEST, "context env must map strings to strings")
    kept = {k: v for k, v in env.items() if k.startswith(ENV_PREFIXES) or k in ENV_NAMES}
    return Context(python, cwd, tuple(sys_path), tuple(sorted(kept.items())))


class Zygote:
    """One pre-imported loader process for a context; forks a child per job."""

    def __init__(self, context: Context, config: Config) -> None:
        self.context = context
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = dict(context.env)
        env["OVERMIND_DISABLE"] = "1"  # a loader calls originals; it never patches
        env["OVERMIND_RUNTIME_DIR"] = str(config.runtime_dir)
        code = (f"import sys; sys.path[:] = {list(context.sys_path)!r}; "
                f"from overmind.loader import zygote_main; zygote_main({theirs.fileno()})")
        log = os.fdopen(open_runtime_file(config.log_path, os.O_WRONLY | os.O_APPEND), "ab")
        try:
            self.proc = subprocess.Popen(
                [context.python, "-c", code], cwd=context.cwd, env=env, pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
            )
        finally:
            log.close()
            theirs.close()
        self.sock = ours
        self.lock = threading.Lock()
        self.ready = False
        self.imported: list = []
        self.jobs = 0
        self.last_used = time.time()
        logger.info("started zygote pid %d for context %s (cwd %s)", self.proc.pid, context.key, context.cwd)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def _wait_ready(self) -> None:
        self.sock.settimeout(READY_TIMEOUT)
        message, _, fds = P.recv_message(self.sock, max_blob=0)
        for fd in fds:
            os.close(fd)
        ready = P.expect(message, P.LoaderReady, "from a zygote")
        self.imported = list(ready.imported)
        self.ready = True
        logger.info("zygote %d ready (imported %s)", self.proc.pid, ", ".join(self.imported) or "nothing")

    def start_job(self, key: str, blob: bytes, modules: list) -> tuple[socket.socket, int]:
        with self.lock:
            if not self.ready:
                self._wait_ready()
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                P.send_message(self.sock, P.Job(key, list(self.context.sys_path), modules=modules), blob,
                               fds=[theirs.fileno()])
            finally:
                theirs.close()
            self.sock.settimeout(READY_TIMEOUT)  # the zygote may import the job's modules first
            message, _, fds = P.recv_message(self.sock, max_blob=0)
            for fd in fds:
                os.close(fd)
            started = P.expect(message, P.JobStarted, "from a zygote")
            self.jobs += 1
            self.last_used = time.time()
            return ours, started.pid

    def close(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the zygote and any job still running
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        self.sock.close()


class LoaderPool:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.lock = threading.Lock()
        self.zygotes: "OrderedDict[str, Zygote]" = OrderedDict()

    def _zygote(self, context: Context) -> Zygote:
        with self.lock:
            zygote = self.zygotes.get(context.key)
            if zygote is not None and not zygote.alive:
                logger.warning("zygote %d for context %s died (exit %s); starting another",
                               zygote.proc.pid, context.key, zygote.proc.returncode)
                zygote.close()
                zygote = None
            if zygote is None:
                zygote = self.zygotes[context.key] = Zygote(context, self.config)
            self.zygotes.move_to_end(context.key)
            while len(self.zygotes) > MAX_ZYGOTES:
                _, oldest = self.zygotes.popitem(last=False)
                oldest.close()
            return zygote

    def prepare(self, context: Context) -> None:
        """Have a ready zygote for ``context`` (clients ask right after monkey_patch_all())."""
        try:
            zygote = self._zygote(context)
            with zygote.lock:
                if not zygote.ready:
                    zygote._wait_ready()
        except Exception as err:  # a later load retries and reports properly
            logger.warning("preparing a loader for context %s failed: %s", context.key, err)

    def _discard(self, zygote: Zygote) -> None:
        with self.lock:
            if self.zygotes.get(zygote.context.key) is zygote:
                del self.zygotes[zygote.context.key]
        zygote.close()

    def run(self, key: str, context: Context, blob: bytes, modules: list = ()
            ) -> tuple[P.JobResult, bytes, list[int]]:
        """Run one load; returns (result, skeleton, segment fds) or raises LoadFailure."""
        for attempt in (1, 2):
            zygote = self._zygote(context)
            try:
                job, pid = zygote.start_job(key, blob, list(modules))
                break
            except (OSError, EOFError, P.ProtocolError, P.RemoteError) as err:
                logger.warning("zygote %d failed to start job %s: %s", zygote.proc.pid, key[:16], err)
                self._discard(zygote)
                if attempt == 2:
                    raise LoadFailure(P.ErrorCode.LOADER_CRASHED,
                                      f"could not start a loader in {context.cwd} with {context.python}: {err}; "
                                      f"see {self.config.log_path}") from None
        with job:
            job.settimeout(self.config.loader_timeout)
            try:
                message, skeleton, fds = P.recv_message(job)
            except socket.timeout:
                self._kill(pid)
                raise LoadFailure(P.ErrorCode.LOADER_TIMEOUT,
                                  f"loader pid {pid} exceeded OVERMIND_LOADER_TIMEOUT={self.config.loader_timeout:g}s "
                                  "and was killed") from None
            except (EOFError, P.ProtocolError, ConnectionResetError) as err:
                self._kill(pid)
                raise LoadFailure(P.ErrorCode.LOADER_CRASHED,
                                  f"loader pid {pid} died before answering ({err}); a crash or a kill "
                                  f"(out of memory?); see {self.config.log_path}") from None
        if isinstance(message, P.JobFailed):
            for fd in fds:
                os.close(fd)
            raise LoadFailure(message.code, message.message, message.traceback)
        if not isinstance(message, P.JobResult) or len(fds) != len(message.sizes) or \
                len(message.slots) != len(fds) or not all(0 <= s < message.nslots for s in message.slots):
            for fd in fds:
                os.close(fd)
            raise LoadFailure(P.ErrorCode.INTERNAL, f"malformed answer from loader pid {pid}")
        return message, skeleton, fds

    @staticmethod
    def _kill(pid: int) -> None:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def describe(self) -> list:
        with self.lock:
            return [{"pid": z.proc.pid, "context": k, "cwd": z.context.cwd, "ready": z.ready, "jobs": z.jobs,
                     "alive": z.alive} for k, z in self.zygotes.items()]

    def close(self) -> None:
        with self.lock:
            zygotes = list(self.zygotes.values())
            self.zygotes.clear()
        for zygote in zygotes:
            zygote.close()
