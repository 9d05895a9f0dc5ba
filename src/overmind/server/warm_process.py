"""One warm interpreter, as the server holds it: started, made ready, asked to fork a loader or a
run, told to retire. Server side, standard library only.

    interpreter = WarmProcess(context, config, modules)   # held by overmind.server.pool.WarmPool
    job, pid = interpreter.start_job(key, blob, modules, sys_path, cwd)   # a fill's loader
    pid = interpreter.fork_run(spec, fds)                                 # overmind run
    interpreter.retire()                                  # it exits once its children are done

The process itself is overmind.warm.interpreter (Note [Warm interpreters] there); the pool
decides which one serves what and when one retires.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import socket
import subprocess
import threading
import time

from overmind.shared import protocol as P
from overmind.shared.settings.config import Config, open_runtime_file
from overmind.shared.protocol.contexts import Context, RunSpec
from overmind.shared.settings.import_env import reads_from_wire
from overmind.shared.process.priority import can_lift_idle, every_thread, to_normal

logger = logging.getLogger(__name__)

__all__ = ["WarmProcess", "RunRefused", "READY_TIMEOUT", "FORK_TIMEOUT"]

READY_TIMEOUT = 300.0
FORK_TIMEOUT = 30.0  # a Fork waits at most for one learned module's import (Note [Warm interpreters learn])


class RunRefused(Exception):
    """No warm run now; the front end runs plainly (Note [Never worse than plain python] in overmind.frontend.run)."""


class WarmProcess:
    """One warm interpreter for a context (overmind.warm.interpreter); forks a child per load or run."""

    def __init__(self, context: Context, config: Config, modules: list, refused: list = (), on_reads=None,
                 packages: list = (), env: dict | None = None) -> None:
        self.context = context
        self.on_reads = on_reads  # called with (context, names, prefixes) its imports read
        # The environment its imports see: the context's, or a run's whole environment (Note [A run's
        # interpreter imports under the run's environment] in overmind.server.pool), never another process's settings.
        self.start_env = {**{k: v for k, v in (env or {}).items() if not k.startswith("OVERMIND_")},
                          **dict(context.env)}
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = dict(self.start_env)
        env["OVERMIND_DISABLE"] = "1"  # a warm interpreter calls originals; it never patches
        env["OVERMIND_RUNTIME_DIR"] = str(config.runtime_dir)
        env["OVERMIND_LOG_LEVEL"] = config.log_level  # its records and its loaders' join ours in the log
        code = f"from overmind.warm.interpreter import interpreter_main; interpreter_main({theirs.fileno()})"
        log = os.fdopen(open_runtime_file(config.log_path, os.O_WRONLY | os.O_APPEND), "ab")
        try:
            self.proc = subprocess.Popen(
                [context.python, "-c", code], cwd="/", env=env, pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
            )
        finally:
            log.close()
            theirs.close()
        self.sock = ours
        self.sock.settimeout(READY_TIMEOUT)
        try:
            P.send_message(self.sock, P.Warm(list(modules), refused=list(refused), packages=list(packages)))
        except OSError:  # it exited at once: the first job hears EOF and reports how it ended (exit_note)
            pass
        self.lock = threading.Lock()
        self.ready = False
        self.retired = False
        self.imported: list = []
        self.refused: list = []  # modules that started a thread in it (Note [Threads libraries start])
        self.unforkable = ""  # why it cannot fork, when it said so while starting a load (Note [A fill never waits for a fork])
        self.learned: list = []  # what its runs imported beyond its pre-imports
        self.modules = 0
        self.jobs = 0
        self.runs = 0
        self.started = time.time()
        self.last_used = time.time()
        logger.info("started warm interpreter pid %d for context %s (%s, %d modules to import)", self.proc.pid,
                    context.key, context.python, len(modules))

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def exit_note(self, wait: float = 1.0) -> str:
        """How its process ended, for an error message ("" while it runs)."""
        try:
            code = self.proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            return ""
        how = f"exit status {code}" if code >= 0 else f"signal {-code}"
        return f"{self.context.python} (pid {self.proc.pid}) ended with {how} before it was ready"

    def _wait_ready(self) -> None:
        self.sock.settimeout(READY_TIMEOUT)
        message, _, fds = P.recv_message(self.sock, max_blob=0)
        P.close_fds(fds)
        ready = P.expect(message, P.InterpreterReady, "from a warm interpreter")
        self._heard(ready.environ)
        self.imported = list(ready.imported)
        self.refused = list(ready.refused)
        self.ready = True
        logger.info("warm interpreter %d ready (imported %d modules)", self.proc.pid, len(self.imported))

    def _start(self, message: P.Message, blob: bytes, fds: list[int], timeout: float) -> P.JobStarted:
        """Send a Job or Fork and read its JobStarted (or a RemoteError)."""
        with self.lock:
            if self.retired:
                raise RunRefused("this warm interpreter is retiring")
            if not self.ready:
                self._wait_ready()
            P.send_message(self.sock, message, blob, fds=fds)
            if can_lift_idle():  # Note [Warming up yields the CPU] in overmind.warm.interpreter: never wait on a learned import
                every_thread(self.proc.pid, to_normal)
            self.sock.settimeout(timeout)
            reply, _, got = P.recv_message(self.sock, max_blob=0)
            P.close_fds(got)
            while isinstance(reply, P.Unforkable):  # said before our message reached it: the answer follows
                self._heard(reply.environ)
                self._cannot_fork(reply.why, reply.refused)
                reply, _, got = P.recv_message(self.sock, max_blob=0)
                P.close_fds(got)
            if isinstance(reply, (P.JobFailed, P.JobStarted)):
                self._heard(reply.environ)
            if isinstance(reply, P.JobFailed):
                self._add_refused(reply.refused)
                raise P.RemoteError(reply.code, reply.message, reply.traceback)
            started = P.expect(reply, P.JobStarted, "from a warm interpreter")
            if started.unforkable:  # its load runs in a fresh interpreter; it is replaced
                self._cannot_fork(started.unforkable, started.refused)
            self.modules = started.modules
            self.learned = list(started.learned)
            self.last_used = time.time()
            return started

    def _cannot_fork(self, why, refused: list) -> None:
        """It said it can fork no more: why, and the modules its successor keeps out."""
        self.unforkable = str(why)[:1000] or "it said it cannot fork"
        self._add_refused(refused)

    def _add_refused(self, names: list) -> None:
        """Modules that started a thread in it (Note [Threads libraries start]); untrusted: only names."""
        self.refused = sorted(set(self.refused) | {n for n in names if isinstance(n, str)})

    def take_notice(self) -> bool:
        """Whether it said, unasked, that it can fork no more (Note [A tainted interpreter says so at
        once] in overmind.warm.interpreter); never waits. The caller holds ``self.lock``."""
        if self.unforkable:
            return True
        if not self.ready or self.retired:
            return False
        try:
            if not select.select([self.sock], [], [], 0)[0]:
                return False
            self.sock.settimeout(READY_TIMEOUT)  # the rest of a message already begun
            message, _, fds = P.recv_message(self.sock, max_blob=0)
        except (OSError, EOFError, P.ProtocolError) as err:
            self.unforkable = f"its control socket failed: {err}"
            return True
        P.close_fds(fds)
        if not isinstance(message, P.Unforkable):
            self.unforkable = f"it sent {type(message).__name__} unasked"
            return True
        self._heard(message.environ)
        self._cannot_fork(message.why, message.refused)
        return True

    def _heard(self, environ) -> None:
        names, prefixes = reads_from_wire(environ)  # untrusted: validated, bounded
        if (names or prefixes) and self.on_reads is not None:
            self.on_reads(self.context, names, prefixes)

    def start_job(self, key: str, blob: bytes, modules: list, sys_path: list, cwd: str
                  ) -> tuple[socket.socket, int]:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            # READY_TIMEOUT: the interpreter may import the job's modules first
            started = self._start(P.Job(key, sys_path, cwd=cwd, modules=modules), blob, [theirs.fileno()],
                                  READY_TIMEOUT)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self.jobs += 1
        return ours, started.pid

    def fork_run(self, spec: RunSpec, fds: list[int]) -> int:
        started = self._start(P.Fork(spec.to_wire()), b"", fds, FORK_TIMEOUT)
        self.runs += 1
        return started.pid

    def pss(self) -> int:
        """Proportional set size in bytes (its share of pages shared with its children), 0 if unknown."""
        try:
            with open(f"/proc/{self.proc.pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        return int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            pass
        return 0

    def retire(self) -> None:
        """Note [Retiring never kills work] in overmind.warm.interpreter: no new forks; it exits when its
        loads and runs are done. Reaped in the background."""
        with self.lock:
            if self.retired:
                return
            self.retired = True
            try:
                self.sock.settimeout(1.0)
                P.send_message(self.sock, P.Retire())
            except OSError:
                pass
            self.sock.close()
        threading.Thread(target=self.proc.wait, daemon=True, name="overmind-reap").start()

    def kill(self) -> None:
        """Only for one that never became ready: nothing of the user's can be running in it."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.retire()
