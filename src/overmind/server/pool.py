"""Server side of warm interpreters: one per client context, for loads and runs. Standard library only.

    pool = WarmPool(config)
    result, skeleton, fds = pool.load(key, context, cwd, sys_path, blob)   # a cold load
    pid = pool.fork_run(context, spec, [stdin, stdout, stderr, conn])      # overmind run

A *context* is the interpreter and the environment that can change an import. For each
the server keeps a warm interpreter (``overmind.warm.interpreter``) that imported torch
and the installed modules the context's earlier loads and runs imported, and forks one
child per cold load (``overmind.warm.loader``) or run (``overmind.warm.child``). A cold load thus
pays neither interpreter start-up nor library imports, and a run starts in a fork. The
pool is bounded in count (``OVERMIND_WARM_MAX``), memory (``OVERMIND_WARM_MEMORY``, PSS)
and idle time (``OVERMIND_WARM_IDLE``); retiring an interpreter never kills a load or run
in progress (Note [Retiring never kills work] in overmind.warm.interpreter).

Note [Warm interpreters never touch CUDA]
A process that initialised CUDA cannot fork usable children, so the interpreter only
imports; the forked child may use the GPU (bitsandbytes quantisation, ``.to('cuda')``)
and exits afterwards, taking its CUDA context with it. The server itself never
imports torch at all.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import socket
import subprocess
import threading
import time
import weakref
from collections import OrderedDict

from overmind.shared import protocol as P
from overmind.shared.config import Config, open_runtime_file
from overmind.shared.contexts import Context, RunSpec, load_context_from_wire
from overmind.server.fill_priority import Fill, FillPriorities
from overmind.shared.priority import can_lift_idle, every_thread, to_normal
from overmind.shared.import_env import reads_from_wire
from overmind.server.lessons import Lessons

logger = logging.getLogger("overmind.server.loaders")

__all__ = ["Context", "Fill", "WarmPool", "LoadFailure", "RunRefused", "context_from_wire", "run_from_wire"]

READY_TIMEOUT = 300.0
MAX_CANNOT_FORK = 3  # interpreters of a lineage retired in a row as unable to fork, before its runs go plain
NOTICE_POLL = 0.25  # seconds between looks for an interpreter's Unforkable (WarmPool.watch_notices)
FORK_TIMEOUT = 30.0  # a Fork waits at most for one learned module's import (Note [Warm interpreters learn])


class LoadFailure(Exception):
    def __init__(self, code: int, message: str, traceback: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.traceback = traceback


def context_from_wire(data: object) -> tuple[Context, str, list]:
    """A load's context, cwd and sys.path (overmind.shared.contexts), or LoadFailure."""
    try:
        return load_context_from_wire(data)
    except ValueError as err:
        raise LoadFailure(P.ErrorCode.BAD_REQUEST, str(err)) from None


def run_from_wire(context: object, spec: object) -> tuple[Context, RunSpec]:
    """A run's context and spec (overmind.shared.contexts), or LoadFailure."""
    try:
        return Context.from_wire(context), RunSpec.from_wire(spec)
    except ValueError as err:
        raise LoadFailure(P.ErrorCode.BAD_REQUEST, str(err)) from None


class RunRefused(Exception):
    """No warm run now; the front end runs plainly (Note [Never worse than plain python] in overmind.frontend.run)."""


class WarmProcess:
    """One warm interpreter for a context (overmind.warm.interpreter); forks a child per load or run."""

    def __init__(self, context: Context, config: Config, modules: list, refused: list = (), on_reads=None,
                 packages: list = (), env: dict | None = None) -> None:
        self.context = context
        self.on_reads = on_reads  # called with (context, names, prefixes) its imports read
        # The environment its imports see: the context's, or a run's whole environment (Note [A run's
        # interpreter imports under the run's environment] in WarmPool), never another process's settings.
        self.start_env = {**{k: v for k, v in (env or {}).items() if not k.startswith("OVERMIND_")},
                          **dict(context.env)}
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = dict(self.start_env)
        env["OVERMIND_DISABLE"] = "1"  # a warm interpreter calls originals; it never patches
        env["OVERMIND_RUNTIME_DIR"] = str(config.runtime_dir)
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
        ready = P.expect(message, P.LoaderReady, "from a warm interpreter")
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
                self._heard_unforkable(reply)
                reply, _, got = P.recv_message(self.sock, max_blob=0)
                P.close_fds(got)
            if isinstance(reply, (P.JobFailed, P.JobStarted)):
                self._heard(reply.environ)
            if isinstance(reply, P.JobFailed):
                self.refused = sorted(set(self.refused) | {n for n in reply.refused if isinstance(n, str)})
                raise P.RemoteError(reply.code, reply.message, reply.traceback)
            started = P.expect(reply, P.JobStarted, "from a warm interpreter")
            if started.unforkable:  # its load runs in a fresh interpreter; it is replaced
                self.unforkable = str(started.unforkable)[:1000]
                self.refused = sorted(set(self.refused) | {n for n in started.refused if isinstance(n, str)})
            self.modules = started.modules
            self.learned = list(started.learned)
            self.last_used = time.time()
            return started

    def _heard_unforkable(self, notice: P.Unforkable) -> None:
        self._heard(notice.environ)
        self.unforkable = str(notice.why)[:1000] or "it said it cannot fork"
        self.refused = sorted(set(self.refused) | {n for n in notice.refused if isinstance(n, str)})

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
        self._heard_unforkable(message)
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


class WarmPool:
    """The warm interpreters, one per context, bounded in count, memory and idle time."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.lock = threading.Lock()
        self._fills = FillPriorities(config)  # Note [Cold fills yield to their caller] in overmind.server.fill_priority
        self.interpreters: "OrderedDict[str, WarmProcess]" = OrderedDict()
        self.lessons = Lessons()  # what each lineage learned (overmind.server.lessons)
        self.retired = 0
        self._settling = _Settling()
        self._cannot_fork: dict[str, int] = {}  # lineage -> interpreters retired as unable to fork
        self._counted_unforkable: "weakref.WeakSet[WarmProcess]" = weakref.WeakSet()

    def _interpreter(self, context: Context, create: bool = True, env: dict | None = None) -> WarmProcess | None:
        with self.lock:
            interpreter = self.interpreters.get(context.key)
            if interpreter is not None and not interpreter.alive:
                logger.warning("warm interpreter %d for context %s died (exit %s); starting another",
                               interpreter.proc.pid, context.key, interpreter.proc.returncode)
                del self.interpreters[context.key]
                interpreter.retire()
                interpreter = None
            if interpreter is None and create:
                modules, refused = self.lessons.for_new(context, list(self.interpreters.values()))
                interpreter = self.interpreters[context.key] = WarmProcess(
                    context, self.config, modules, refused, on_reads=self.lessons.heard_reads,
                    packages=self.lessons.packages_for(context), env=env)
            if interpreter is not None:
                self.interpreters.move_to_end(context.key)
            victims = []
            while len(self.interpreters) > self.config.warm_max:
                victims.append(self.interpreters.popitem(last=False)[1])
        for victim in victims:
            self._retire(victim, "over OVERMIND_WARM_MAX")
        return interpreter

    def _retire(self, interpreter: WarmProcess, why: str) -> None:
        with self.lock:
            if self.interpreters.get(interpreter.context.key) is interpreter:
                del self.interpreters[interpreter.context.key]
            self.lessons.remember(interpreter)
            self.retired += 1
        logger.info("retiring warm interpreter %d (%s)", interpreter.proc.pid, why)
        interpreter.retire()

    def _retire_unforkable(self, interpreter: WarmProcess, why: str) -> bool:
        """Retire one that cannot fork; whether its lineage may have another (Note [Threads libraries
        start] in overmind.warm.fork_safety): each successor keeps out the modules that started
        threads, so it forks; after MAX_CANNOT_FORK in a row that did not, its runs go plain, never
        in a loop of interpreters started and retired."""
        lineage = interpreter.context.lineage
        with self.lock:
            if interpreter in self._counted_unforkable:  # found so by another path too: counted once
                return self._cannot_fork.get(lineage, 0) < MAX_CANNOT_FORK
            self._counted_unforkable.add(interpreter)
            count = self._cannot_fork[lineage] = self._cannot_fork.get(lineage, 0) + 1
        self._retire(interpreter, why)
        if count == MAX_CANNOT_FORK:
            logger.warning("%d warm interpreters of context %s in a row could not fork; its runs go plain (its "
                           "loads still fill, each in a fresh interpreter)", count, interpreter.context.key)
        return count < MAX_CANNOT_FORK

    def _learn_packages(self, context: Context, packages: list) -> None:
        """Note [AOTInductor packages are handed over] in overmind.shared.packages: every interpreter
        of the lineage preloads them (a run may be forked from a variant keyed on what imports read)."""
        self.lessons.add_packages(context, packages)
        with self.lock:
            interpreters = [i for i in self.interpreters.values() if i.context.lineage == context.lineage]
        for interpreter in interpreters:
            with interpreter.lock:
                if not interpreter.retired and interpreter.alive:
                    P.send_message(interpreter.sock, P.Warm([], packages=list(packages)))

    def prepare(self, context: Context, modules: list = (), packages: list = (), env: dict | None = None) -> None:
        """Have a ready interpreter for ``context`` (clients ask right after monkey_patch_all()),
        and have it import ``modules``, which a client of it imported (Note [Warm interpreters
        learn] in overmind.warm.interpreter), and preload ``packages`` (Note [AOTInductor packages
        are handed over] in overmind.shared.packages). ``env``: a run's whole environment, for a
        new interpreter to import under (Note [A run's interpreter imports under the run's environment])."""
        try:
            if packages and not modules and env is None:
                # A run that loaded a package says so (overmind.client.aoti): the lineage's interpreters
                # preload it, and its next ones; it asks for no interpreter (a forked run has one).
                return self._learn_packages(context, packages)
            if modules:
                self.lessons.add(context, modules)
            for _ in range(2):
                interpreter = self._interpreter(context, env=env)
                with interpreter.lock:
                    if not interpreter.ready and not interpreter.retired:
                        interpreter._wait_ready()
                    tainted = interpreter.take_notice()
                    if modules and not interpreter.retired and not tainted:
                        P.send_message(interpreter.sock, P.Warm(list(modules)))
                # Note [A tainted interpreter says so at once] in overmind.warm.interpreter: its successor
                # starts now, under the same environment, and learns what it learned but the refused.
                if not tainted or not self._retire_unforkable(interpreter, interpreter.unforkable):
                    break
                env = interpreter.start_env
            if packages:
                self._learn_packages(context, packages)
        except Exception as err:  # a later load retries and reports properly
            logger.warning("preparing a warm interpreter for context %s failed: %s", context.key, err)

    def load(self, key: str, context: Context, cwd: str, sys_path: list, blob: bytes, modules: list = (),
            fill: Fill | None = None, references: list = (), contents: dict | None = None
            ) -> tuple[P.JobResult, bytes, list[int]]:
        """Run one load; returns (result, skeleton, segment fds) or raises LoadFailure. ``fill``
        (from ``begin_fill``) sets its priority (Note [Cold fills yield to their caller] in
        overmind.server.fill_priority). ``references``: (registry Reply, segment fds) of the entries
        the call refers to, and ``contents`` the content index, handed to the loader (Note [The
        loader is handed its references] in overmind.server.cold_loads); the fds stay the caller's."""
        fill = fill or Fill(key, background=False)
        for attempt in (1, 2):
            try:
                interpreter = self._interpreter(context)
                if self._said_unforkable(interpreter):  # its successor forks the Job once ready
                    interpreter = self._interpreter(context)
            except OSError as err:  # the interpreter cannot be executed at all
                raise LoadFailure(P.ErrorCode.LOADER_CRASHED,
                                  f"could not start a loader with {context.python}: {err}") from None
            try:
                job, pid = interpreter.start_job(key, blob, list(modules), sys_path, cwd)
                if interpreter.unforkable and self._retire_unforkable(interpreter, interpreter.unforkable):
                    self._prepare_soon(context, None)  # its successor keeps out what started the threads
                break
            except (OSError, EOFError, P.ProtocolError, P.RemoteError, RunRefused) as err:
                logger.warning("warm interpreter %d could not start job %s: %s", interpreter.proc.pid, key[:16], err)
                ended = "" if interpreter.ready else interpreter.exit_note()
                if interpreter.ready:
                    self._retire(interpreter, str(err))
                else:
                    self._discard(interpreter)
                if attempt == 2:
                    raise LoadFailure(P.ErrorCode.LOADER_CRASHED,
                                      f"could not start a loader: {ended or f'{context.python}: {err}'}; "
                                      f"see {self.config.log_path}") from None
        self._fills.forked(fill, pid)
        answered = False
        try:
            deadline = time.monotonic() + self.config.loader_timeout
            try:
                job.settimeout(self.config.loader_timeout)  # a loader that stops reading is killed below
                for reply, fds in references:
                    P.send_message(job, P.Entry(reply.key, os.getpid(), reply.handles, reply.nbytes, True, reply.meta.to_dict()),
                                   reply.skeleton, fds=fds)
                index = {**(contents or {"keys": [], "handles": [], "regions": []}), "server_pid": os.getpid()}
                P.send_message(job, P.Contents(len(index["regions"])), json.dumps(index).encode())
                P.send_message(job, P.Ok())
                while True:
                    self._fills.wait_answer(job, fill, deadline)
                    job.settimeout(max(deadline - time.monotonic(), 0.001))
                    message, skeleton, fds = P.recv_message(job)
                    if not isinstance(message, P.FillProgress):
                        break
                    if fds or message.key != key or not 0 <= message.written <= 1 << 50 or \
                            not 0 <= message.expected <= 1 << 50 or not 0 <= message.original_seconds < 1e6:
                        P.close_fds(fds)
                        raise P.ProtocolError(f"malformed progress report {message!r}")
                    self._fills.progress(fill, message.written, message.expected, message.original_seconds)
            except socket.timeout:
                _kill(pid)
                raise LoadFailure(P.ErrorCode.LOADER_TIMEOUT,
                                  f"loader pid {pid} exceeded OVERMIND_LOADER_TIMEOUT={self.config.loader_timeout:g}s "
                                  "and was killed") from None
            except (EOFError, P.ProtocolError, ConnectionResetError, BrokenPipeError) as err:
                _kill(pid)
                raise LoadFailure(P.ErrorCode.LOADER_CRASHED,
                                  f"loader pid {pid} died before answering ({err}); a crash or a kill "
                                  f"(out of memory?); see {self.config.log_path}") from None
            if isinstance(message, P.JobResult):
                answered = True
                self._settling.add(job, pid, self.config.loader_timeout)
        finally:
            if not answered:
                job.close()
        if isinstance(message, P.JobFailed):
            P.close_fds(fds)
            raise LoadFailure(message.code, message.message, message.traceback)
        if not isinstance(message, P.JobResult) or len(fds) != len(message.sizes) or \
                len(message.slots) != len(fds) or not all(0 <= s < message.nslots for s in message.slots):
            P.close_fds(fds)
            raise LoadFailure(P.ErrorCode.INTERNAL, f"malformed answer from loader pid {pid}")
        return message, skeleton, fds

    # Its fills, as cold loads ask for them: Note [Cold fills yield to their caller] in
    # overmind.server.fill_priority, Note [Joining a fill] in overmind.server.cold_loads.

    def begin_fill(self, key: str, background: bool, caller: int) -> Fill:
        return self._fills.begin(key, background, caller)

    def end_fill(self, fill: Fill) -> None:
        self._fills.end(fill)

    def after_caller(self, fill: Fill) -> None:
        """Until the caller that missed is done with its own load: Note [Cold fills wait for their caller]."""
        self._fills.after_caller(fill)

    def caller_loaded(self, key: str) -> None:
        self._fills.caller_loaded(key)

    def fill_remaining(self, key: str) -> tuple[float, Fill] | None:
        return self._fills.remaining(key)

    def lend_to_fill(self, key: str, waiter: int):
        """A block in which process ``waiter`` waits for the fill of ``key``: it runs at normal priority."""
        return self._fills.waiting(key, waiter)

    def fill_depends(self, fill: Fill, key: str):
        """A block in which ``fill`` waits for the fill of ``key``, an entry its call refers to."""
        return self._fills.depends(fill, key)

    def filling_besides(self, key: str) -> bool:
        """Is a fill other than ``key``'s in flight? (A restore lets clients' fills go first.)"""
        return self._fills.in_flight_besides(key)

    def settling(self) -> int:
        """Loaders that answered and still rebuild their segments (``_Settling``)."""
        return self._settling.count

    def _rekey(self, lineage: str) -> None:
        """Note [A run's interpreter imports under the run's environment]."""
        with self.lock:
            kept, extra = _filed_by_own_values(self.interpreters, lineage, self.lessons.with_reads)
            if kept is None:
                return
            self.interpreters = kept
            for interpreter in extra:
                self.lessons.remember(interpreter)
                self.retired += 1
        for interpreter in extra:
            logger.info("retiring warm interpreter %d (another imported under the same settings)", interpreter.proc.pid)
            interpreter.retire()

    def _prepare_soon(self, context: Context, env: dict) -> None:
        """``prepare`` in the background, for the next run after one that was refused (``env``: its own)."""
        threading.Thread(target=self.prepare, args=(context,), kwargs={"env": env}, daemon=True,
                         name="overmind-prepare").start()

    def fork_run(self, context: Context, spec: RunSpec, fds: list[int]) -> int:
        """Fork a run from the context's ready interpreter; its pid, or RunRefused (and one is
        made ready for next time)."""
        self._rekey(context.lineage)
        base, context = context, self.lessons.with_reads(context, spec.env)
        interpreter = self._interpreter(context, create=False)
        with self.lock:
            given_up = self._cannot_fork.get(context.lineage, 0) >= MAX_CANNOT_FORK
        if interpreter is None or not interpreter.ready:
            if given_up:
                raise RunRefused("this context's warm interpreters cannot fork (see the server log): runs go plain")
            if interpreter is None:
                self._prepare_soon(context, spec.env)
            raise RunRefused("no warm interpreter for this context yet; one is starting")
        try:
            pid = interpreter.fork_run(spec, fds)
            with self.lock:
                self._cannot_fork.pop(context.lineage, None)
            return pid
        except P.RemoteError as err:
            if err.code == P.ErrorCode.ENV_DIFFERS:  # it told us what its imports read: key on that now
                self._rekey(base.lineage)
                again = self.lessons.with_reads(base, spec.env)
                if self._interpreter(again, create=False) is None:
                    self._prepare_soon(again, spec.env)
                raise RunRefused(f"{err.message} (Note [Settings an import read]); an interpreter imported "
                                 "under this run's environment is starting") from None
            if err.code != P.ErrorCode.NOT_FORKABLE:
                raise RunRefused(err.message) from None
            if not self._retire_unforkable(interpreter, err.message):
                raise RunRefused(f"the warm interpreter cannot fork ({err.message}); this context's runs go "
                                 "plain until the server restarts") from None
            self._prepare_soon(context, spec.env)
            raise RunRefused(f"the warm interpreter cannot fork ({err.message}); a fresh one is starting") from None
        except (OSError, EOFError, P.ProtocolError) as err:
            self._retire(interpreter, str(err))
            raise RunRefused(f"the warm interpreter failed ({err})") from None

    def housekeeping(self) -> None:
        """Retire interpreters idle past OVERMIND_WARM_IDLE, then the least recently used while
        their memory exceeds OVERMIND_WARM_MEMORY."""
        now = time.time()
        with self.lock:
            interpreters = list(self.interpreters.values())
        self.take_notices()
        for interpreter in interpreters:
            if interpreter.ready and now - interpreter.last_used > self.config.warm_idle:
                self._retire(interpreter, f"idle for {now - interpreter.last_used:.0f}s")
        with self.lock:
            interpreters = list(self.interpreters.values())  # least recently used first
        sizes = {z.proc.pid: z.pss() for z in interpreters}
        total = sum(sizes.values())
        for interpreter in interpreters[:-1]:  # the most recent one stays, whatever its size
            if total <= self.config.warm_memory:
                break
            total -= sizes[interpreter.proc.pid]
            self._retire(interpreter, "over OVERMIND_WARM_MEMORY")

    def watch_notices(self, stopping: threading.Event) -> None:
        """The server's thread that hears an interpreter say it cannot fork as soon as it says so
        (Note [A tainted interpreter says so at once] in overmind.warm.interpreter)."""
        while not stopping.is_set():
            socks = [i.sock for i in self.live() if i.ready and not i.retired]
            try:
                readable = select.select(socks, [], [], NOTICE_POLL)[0] if socks else []
            except (OSError, ValueError):  # one was closed meanwhile (retired): look again
                readable = []
            if not socks:
                stopping.wait(NOTICE_POLL)
            elif readable:
                self.take_notices()
                stopping.wait(0.02)  # what stays readable is a reply its Job or Fork reads

    def take_notices(self) -> None:
        """Retire each interpreter that said, unasked, that it cannot fork, and start its successor
        (Note [A tainted interpreter says so at once] in overmind.warm.interpreter); never waits."""
        for interpreter in self.live():
            if self._said_unforkable(interpreter):
                self._prepare_soon(interpreter.context, interpreter.start_env)

    def _said_unforkable(self, interpreter: WarmProcess) -> bool:
        """Retire ``interpreter`` if it said it cannot fork; True when its lineage may have a successor."""
        if not interpreter.lock.acquire(blocking=False):  # busy: whoever holds it hears the notice
            return False
        try:
            tainted = interpreter.take_notice()
        finally:
            interpreter.lock.release()
        return tainted and self._retire_unforkable(interpreter, interpreter.unforkable)

    def _discard(self, interpreter: WarmProcess) -> None:
        with self.lock:
            if self.interpreters.get(interpreter.context.key) is interpreter:
                del self.interpreters[interpreter.context.key]
        interpreter.kill()

    def live(self) -> list:
        """Every warm interpreter (``WarmProcess``), least recently used first."""
        with self.lock:
            return list(self.interpreters.values())

    def describe(self) -> list:
        self.take_notices()  # what status shows is what a run would find
        now = time.time()
        with self.lock:
            interpreters = list(self.interpreters.items())
        return [{"pid": z.proc.pid, "context": k, "python": z.context.python, "ready": z.ready, "alive": z.alive,
                 "modules": z.modules or len(z.imported), "pss": z.pss(), "age": now - z.started,
                 "idle": now - z.last_used, "jobs": z.jobs, "runs": z.runs} for k, z in interpreters]

    def close(self) -> None:
        with self.lock:
            interpreters = list(self.interpreters.values())
            self.interpreters.clear()
        for interpreter in interpreters:
            if interpreter.ready:
                interpreter.retire()
            else:
                interpreter.kill()


# Note [A run's interpreter imports under the run's environment]
# The first ``overmind run`` of a context goes plain while an interpreter starts for it. That
# interpreter imports under the run's whole environment (its own OVERMIND_* settings aside),
# not only the context's: what its imports read is learned only as they read it (Note
# [Settings an import read] in overmind.shared.import_env), and one started without, say,
# the TORCHINDUCTOR_CACHE_DIR the user's shell sets would be refused by the very next run of
# the same shell, which would go plain again while yet another interpreter imports (measured:
# a torch.compile script's run 2 at 1.1 x plain, an AOTInductor script's at 1.2-2.2 x). Once
# its lineage knows what imports read, an interpreter belongs under the key of its own values
# of those (``_rekey``): a run with the same values is forked from it, and one with other values
# gets an interpreter of its own instead of being refused by this one for good.

def _filed_by_own_values(interpreters: "OrderedDict[str, WarmProcess]", lineage: str, with_reads):
    """(the interpreters with those of ``lineage`` filed under their own values of what their imports
    read, each in its place among the least recently used; those that lost their key to another), or
    (None, []) when each is filed so already. Of two that end up with one key, the ready, more
    recently used one stays."""
    owned = {key: with_reads(interpreter.context, interpreter.start_env) for key, interpreter in interpreters.items()
             if interpreter.context.lineage == lineage}
    if all(own.key == key for key, own in owned.items()):
        return None, []
    kept: "OrderedDict[str, WarmProcess]" = OrderedDict()
    extra = []
    for key, interpreter in interpreters.items():  # least recently used first
        own = owned.get(key)
        if own is not None:
            interpreter.context = own
            key = own.key
        other = kept.get(key)
        if other is not None:  # the later one is the more recently used
            stays, goes = (interpreter, other) if interpreter.ready or not other.ready else (other, interpreter)
            extra.append(goes)
            kept.pop(key)
            interpreter = stays
        kept[key] = interpreter
    return kept, extra


class _Settling:
    """A loader that answered may still rebuild its segments out of huge pages (Note [Huge
    pages for segments] in overmind.shared.memfd); it counts here until it exits (EOF on its
    job socket), so a benchmark can wait for the machine to be quiet (``settling`` in the status)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.count = 0

    def add(self, job: socket.socket, pid: int, timeout: float) -> None:
        with self.lock:
            self.count += 1

        def wait_for_exit() -> None:
            try:
                job.settimeout(timeout)
                while job.recv(4096):
                    pass  # a loader sends nothing more; whatever comes is dropped
            except OSError:
                pass
            finally:
                job.close()
                with self.lock:
                    self.count -= 1

        threading.Thread(target=wait_for_exit, daemon=True, name=f"overmind-settle-{pid}").start()


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
