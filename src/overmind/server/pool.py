"""Server side of warm interpreters: one per client context, for loads and runs. Standard library only.

    pool = WarmPool(config)
    job, pid, fresh = pool.start_loader(key, context, cwd, sys_path, blob)   # a fill's loader
    pid = pool.fork_run(context, spec, [stdin, stdout, stderr, conn])  # overmind run

A *context* is the interpreter and the environment that can change an import. For each
the server keeps a warm interpreter (``overmind.warm.interpreter``) that imported torch
and the installed modules the context's earlier loads and runs imported, and forks one
child per cold load (``overmind.warm.loader``) or run (``overmind.warm.script``). A cold load thus
pays neither interpreter start-up nor library imports, and a run starts in a fork. Each
interpreter is a ``WarmProcess`` (overmind.server.warm_process), kept by key in the pool's
``Interpreters`` (overmind.server.interpreters); the fill a loader serves, and all said on its
job socket, are overmind.server.fills's and overmind.server.loaders's. The pool is bounded in
count (``OVERMIND_WARM_MAX``), memory (``OVERMIND_WARM_MEMORY``, PSS) and idle time
(``OVERMIND_WARM_IDLE``); retiring an interpreter never kills a load or run in progress (Note
[Retiring never kills work] in overmind.warm.interpreter).

Note [Warm interpreters never touch CUDA]
A process that initialised CUDA cannot fork usable children, so the interpreter only
imports; the forked child may use the GPU (bitsandbytes quantisation, ``.to('cuda')``)
and exits afterwards, taking its CUDA context with it. The server itself never
imports torch at all.
"""

from __future__ import annotations

import logging
import select
import socket
import subprocess
import threading
import time
from typing import Callable, Optional

from overmind.shared import protocol as P
from overmind.shared.settings.config import Config
from overmind.shared.protocol.contexts import Context, RunSpec, load_context_from_wire
from overmind.server.interpreters import Interpreters
from overmind.server.lessons import Lessons
from overmind.server.warm_process import RunRefused, WarmProcess

logger = logging.getLogger(__name__)

__all__ = ["WarmPool", "LoadFailure", "context_from_wire", "run_from_wire"]

MAX_SAID_PLAIN = 1024  # (lineage, reason) pairs already logged at INFO (WarmPool.goes_plain)
NOTICE_POLL = 0.25  # seconds between looks for an interpreter's Unforkable (WarmPool.watch_notices)


class LoadFailure(Exception):
    def __init__(self, code: int, message: str, traceback: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.traceback = traceback


def context_from_wire(data: object) -> tuple[Context, str, list]:
    """A load's context, cwd and sys.path (overmind.shared.protocol.contexts), or LoadFailure."""
    try:
        return load_context_from_wire(data)
    except ValueError as err:
        raise LoadFailure(P.ErrorCode.BAD_REQUEST, str(err)) from None


def run_from_wire(context: object, spec: object) -> tuple[Context, RunSpec]:
    """A run's context and spec (overmind.shared.protocol.contexts), or LoadFailure."""
    try:
        return Context.from_wire(context), RunSpec.from_wire(spec)
    except ValueError as err:
        raise LoadFailure(P.ErrorCode.BAD_REQUEST, str(err)) from None


class WarmPool:
    """The warm interpreters, one per context, bounded in count, memory and idle time: each prepared,
    asked for a loader or a run, retired (idle, over memory, unable to fork). Which one serves a
    context, and the table of them, is its ``interpreters``'."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.lock = threading.Lock()  # runs_plain and _said_plain
        self.lessons = Lessons()  # what each lineage learned (overmind.server.lessons)
        # the interpreters by key, each lineage's last environment and fork failures (overmind.server.interpreters)
        self.interpreters = Interpreters(config, self.lessons)
        self._said_plain: set[tuple[str, str]] = set()
        self.runs_plain = 0  # runs refused, and scripts whose one line declined: each in its own process
        self.closed = False  # the server is stopping: close() was called
        # True while memory is short: no interpreter starts (Note [The cache gives way] in overmind.server.pressure)
        self.holding_back: Callable[[], bool] = lambda: False

    def _learn_packages(self, context: Context, packages: list) -> None:
        """Note [AOTInductor packages are handed over] in overmind.shared.calls.compiled: every interpreter
        of the lineage preloads them (a run may be forked from a variant keyed on what imports read)."""
        self.lessons.add_packages(context, packages)
        interpreters = [i for i in self.interpreters.live() if i.context.lineage == context.lineage]
        for interpreter in interpreters:
            with interpreter.lock:
                if not interpreter.retired and interpreter.alive:
                    P.send_message(interpreter.sock, P.Warm([], packages=list(packages)))

    def prepare(self, context: Context, modules: list = (), packages: list = (), env: dict | None = None,
                program: str = "") -> None:
        """Have a ready interpreter for ``context`` (clients ask right after monkey_patch_all()),
        and have it import ``modules``, which a client of it imported (Note [Warm interpreters
        learn] in overmind.warm.interpreter), and preload ``packages`` (Note [AOTInductor packages
        are handed over] in overmind.shared.calls.compiled). ``env``: a run's whole environment, for a
        new interpreter to import under (Note [A run's interpreter imports under the run's environment]).
        ``program``: the client's, whose next run the interpreter forks ahead (Note [A run's child is
        forked ahead] in overmind.warm.children)."""
        if self.holding_back():
            return logger.info("not starting a warm interpreter for context %s: memory is short", context.key)
        try:
            if packages and not modules and env is None:
                # A run that loaded a package says so (overmind.client.compiled): the lineage's interpreters
                # preload it, and its next ones; it asks for no interpreter (a forked run has one).
                return self._learn_packages(context, packages)
            if modules:
                self.lessons.add(context, modules)
            for _ in range(2):
                interpreter = self.interpreters.get(context, env=env)
                with interpreter.lock:
                    if not interpreter.ready and not interpreter.retired:
                        interpreter._wait_ready()
                    tainted = interpreter.take_notice()
                    if (modules or program) and not interpreter.retired and not tainted:
                        P.send_message(interpreter.sock, P.Warm(list(modules), program=program))
                # Note [A tainted interpreter says so at once] in overmind.warm.interpreter: its successor
                # starts now, under the same environment, and learns what it learned but the refused.
                if not tainted or not self.interpreters.retire_unforkable(interpreter, interpreter.unforkable):
                    break
                env = interpreter.start_env
            if packages:
                self._learn_packages(context, packages)
        except Exception as err:  # a later load retries and reports properly
            if self.closed:  # the server stops: close() ended the interpreter this waited for
                return logger.debug("preparing a warm interpreter for context %s ended by shutdown: %s",
                                    context.key, err)
            logger.warning("preparing a warm interpreter for context %s failed: %s", context.key, err)

    def start_loader(self, key: str, context: Context, cwd: str, sys_path: list, blob: bytes, modules: list = ()
                     ) -> tuple[socket.socket, int, bool]:
        """Fork the loader of one fill (the load of ``key``) from the context's warm interpreter,
        started if need be: (its job socket, its pid, whether it is a fresh interpreter because
        the warm one could not fork), or LoadFailure. What is said on the job socket is
        overmind.server.loaders's (Note [The loader is handed its references] there)."""
        for attempt in (1, 2):
            try:
                interpreter = self.interpreters.get(context)
                if self._said_unforkable(interpreter):  # its successor forks the Job once ready
                    interpreter = self.interpreters.get(context)
            except OSError as err:  # the interpreter cannot be executed at all
                raise LoadFailure(P.ErrorCode.LOADER_CRASHED,
                                  f"could not start a warm interpreter with {context.python}: {err}") from None
            try:
                job, pid = interpreter.start_job(key, blob, list(modules), sys_path, cwd)
                fresh = bool(interpreter.unforkable)  # it said so as it took the job
                if interpreter.unforkable and self.interpreters.retire_unforkable(interpreter, interpreter.unforkable):
                    self.prepare_soon(context, None)  # its successor keeps out what started the threads
                break
            except (OSError, EOFError, P.ProtocolError, P.RemoteError, RunRefused) as err:
                logger.warning("warm interpreter %d could not start job %s: %s", interpreter.proc.pid, key[:16], err)
                ended = "" if interpreter.ready else interpreter.exit_note()
                if interpreter.ready:
                    self.interpreters.retire(interpreter, str(err))
                else:
                    self.interpreters.discard(interpreter)
                if attempt == 2:
                    raise LoadFailure(P.ErrorCode.LOADER_CRASHED,
                                      f"could not start a loader: {ended or f'{context.python}: {err}'}; "
                                      f"see {self.config.log_path}") from None
        return job, pid, fresh

    def prepare_soon(self, context: Context, env: dict | None) -> None:
        """``prepare`` in the background, for the next run after one that was refused (``env``: its
        own), or for the run that started this server (overmind.server.daemon)."""
        threading.Thread(target=self.prepare, args=(context,), kwargs={"env": env}, daemon=True,
                         name="overmind-prepare").start()

    def goes_plain(self, context: Optional[Context], pid: int, reason: str) -> None:
        """A run that runs in its own process: the log says why, once per context and reason."""
        said = (context.lineage if context is not None else "", reason)
        with self.lock:
            self.runs_plain += 1
            first = said not in self._said_plain
            if first and len(self._said_plain) < MAX_SAID_PLAIN:
                self._said_plain.add(said)
        logger.log(logging.INFO if first else logging.DEBUG, "pid %d runs in its own process: %s", pid, reason)

    def fork_run(self, context: Context, spec: RunSpec, fds: list[int]) -> int:
        """Fork a run from the context's ready interpreter; its pid, or RunRefused (and one is
        made ready for next time)."""
        self.interpreters.remember_environment(context, spec.env)
        self.interpreters.rekey(context.lineage)  # Note [A run's interpreter imports under the run's environment]
        base, context = context, self.lessons.with_reads(context, spec.env)
        interpreter = self.interpreters.get(context, create=False)
        given_up = self.interpreters.given_up(context.lineage)
        if interpreter is None or not interpreter.ready:
            if given_up:
                raise RunRefused("this context's warm interpreters cannot fork (see the server log): runs go plain")
            if interpreter is None:
                self.prepare_soon(context, spec.env)
            raise RunRefused("no warm interpreter for this context yet; one is starting")
        try:
            pid = interpreter.fork_run(spec, fds)
            self.interpreters.forked(context.lineage)
            return pid
        except P.RemoteError as err:
            if err.code == P.ErrorCode.ENV_DIFFERS:  # it told us what its imports read: key on that now
                self.interpreters.rekey(base.lineage)
                again = self.lessons.with_reads(base, spec.env)
                if self.interpreters.get(again, create=False) is None:
                    self.prepare_soon(again, spec.env)
                raise RunRefused(f"{err.message} (Note [Settings an import read]); an interpreter imported "
                                 "under this run's environment is starting") from None
            if err.code != P.ErrorCode.NOT_FORKABLE:
                raise RunRefused(err.message) from None
            if not self.interpreters.retire_unforkable(interpreter, err.message):
                raise RunRefused(f"the warm interpreter cannot fork ({err.message}); this context's runs go "
                                 "plain until the server restarts") from None
            self.prepare_soon(context, spec.env)
            raise RunRefused(f"the warm interpreter cannot fork ({err.message}); a fresh one is starting") from None
        except (OSError, EOFError, P.ProtocolError) as err:
            self.interpreters.retire(interpreter, str(err))
            raise RunRefused(f"the warm interpreter failed ({err})") from None

    def housekeeping(self) -> None:
        """Retire interpreters idle past OVERMIND_WARM_IDLE, then the least recently used while
        their memory exceeds OVERMIND_WARM_MEMORY."""
        now = time.time()
        interpreters = self.interpreters.live()
        self.take_notices()
        for interpreter in interpreters:
            if interpreter.ready and now - interpreter.last_used > self.config.warm_idle:
                self.interpreters.retire(interpreter, f"idle for {now - interpreter.last_used:.0f}s")
        interpreters = self.interpreters.live()  # least recently used first
        sizes = {z.proc.pid: z.pss() for z in interpreters}
        total = sum(sizes.values())
        for interpreter in interpreters[:-1]:  # the most recent one stays, whatever its size
            if total <= self.config.warm_memory:
                break
            total -= sizes[interpreter.proc.pid]
            self.interpreters.retire(interpreter, "over OVERMIND_WARM_MEMORY")

    def retire_for_memory(self, wait: float = 2.0) -> tuple | None:
        """Retire the least recently used interpreter that is not being asked to fork right now, for
        memory (Note [The cache gives way] in overmind.server.pressure): its (context, the
        environment it imported under, its PSS), to start it again later; None if there is none.
        Its runs and loads go on (Note [Retiring never kills work] in overmind.warm.interpreter)."""
        for interpreter in self.live():
            if not interpreter.lock.acquire(blocking=False):
                continue  # a fork is being asked for: it is in use
            interpreter.lock.release()
            pss = interpreter.pss()
            if interpreter.ready:
                self.interpreters.retire(interpreter, "memory is short")
            else:  # still importing: it has no child yet, and takes more memory every second
                logger.info("stopping warm interpreter %d, still importing (memory is short)", interpreter.proc.pid)
                self.interpreters.discard(interpreter)
            try:  # its memory is back only once it exited (at once, unless a run or load of it goes on)
                interpreter.proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                pass
            return interpreter.context, interpreter.start_env, pss
        return None

    def pids(self) -> list[int]:
        return [interpreter.proc.pid for interpreter in self.live() if interpreter.alive]

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
                self.prepare_soon(interpreter.context, interpreter.start_env)

    def _said_unforkable(self, interpreter: WarmProcess) -> bool:
        """Retire ``interpreter`` if it said it cannot fork; True when its lineage may have a successor."""
        if not interpreter.lock.acquire(blocking=False):  # busy: whoever holds it hears the notice
            return False
        try:
            tainted = interpreter.take_notice()
        finally:
            interpreter.lock.release()
        return tainted and self.interpreters.retire_unforkable(interpreter, interpreter.unforkable)

    def live(self) -> list:
        """Every warm interpreter (``WarmProcess``), least recently used first."""
        return self.interpreters.live()

    def describe(self) -> list:
        self.take_notices()  # what status shows is what a run would find
        now = time.time()
        interpreters = self.interpreters.by_key()
        return [{"pid": z.proc.pid, "context": k, "python": z.context.python, "ready": z.ready, "alive": z.alive,
                 "modules": z.modules or len(z.imported), "pss": z.pss(), "age": now - z.started,
                 "idle": now - z.last_used, "jobs": z.jobs, "runs": z.runs} for k, z in interpreters]

    def close(self) -> None:
        self.closed = True
        for interpreter in self.interpreters.take_all():
            if interpreter.ready:
                interpreter.retire()
            else:
                interpreter.kill()


# Note [A run's interpreter imports under the run's environment]
# The first ``overmind run`` of a context goes plain while an interpreter starts for it. That
# interpreter imports under the run's whole environment (its own OVERMIND_* settings aside),
# not only the context's: what its imports read is learned only as they read it (Note
# [Settings an import read] in overmind.shared.settings.import_env), and one started without, say,
# the TORCHINDUCTOR_CACHE_DIR the user's shell sets would be refused by the very next run of
# the same shell, which would go plain again while yet another interpreter imports (measured:
# a torch.compile script's run 2 at 1.1 x plain, an AOTInductor script's at 1.2-2.2 x). Once
# its lineage knows what imports read, an interpreter belongs under the key of its own values
# of those (``Interpreters.rekey`` in overmind.server.interpreters): a run with the same values
# is forked from it, and one with other values gets an interpreter of its own instead of being
# refused by this one for good.
