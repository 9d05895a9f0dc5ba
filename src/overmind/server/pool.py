"""Server side of warm interpreters: one per client context, for loads and runs. Standard library only.

    pool = WarmPool(config)
    job, pid, fresh = pool.start_loader(key, context, cwd, sys_path, blob)   # a fill's loader
    pid = pool.fork_run(context, spec, [stdin, stdout, stderr, conn])  # overmind run

A *context* is the interpreter and the environment that can change an import. For each
the server keeps a warm interpreter (``overmind.warm.interpreter``) that imported torch
and the installed modules the context's earlier loads and runs imported, and forks one
child per cold load (``overmind.warm.loader``) or run (``overmind.warm.script``). A cold load thus
pays neither interpreter start-up nor library imports, and a run starts in a fork. Each
interpreter is a ``WarmProcess`` (overmind.server.warm_process); the fill a loader serves,
and all said on its job socket, are overmind.server.fills's and overmind.server.loads's. The
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

import logging
import select
import socket
import subprocess
import threading
import time
import weakref
from collections import OrderedDict
from typing import Callable, Optional

from overmind.shared import protocol as P
from overmind.shared.settings.config import Config
from overmind.shared.protocol.contexts import Context, RunSpec, load_context_from_wire
from overmind.server.lessons import Lessons
from overmind.server.warm_process import RunRefused, WarmProcess

logger = logging.getLogger(__name__)

__all__ = ["WarmPool", "LoadFailure", "context_from_wire", "run_from_wire"]

MAX_CANNOT_FORK = 3  # interpreters of a lineage retired in a row as unable to fork, before its runs go plain
MAX_ENVIRONMENTS = 64  # lineages whose last environment given is kept (Note [One interpreter per lineage])
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
    """The warm interpreters, one per context, bounded in count, memory and idle time."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.lock = threading.Lock()
        self.interpreters: "OrderedDict[str, WarmProcess]" = OrderedDict()
        self.lessons = Lessons()  # what each lineage learned (overmind.server.lessons)
        self._said_plain: set[tuple[str, str]] = set()
        self.runs_plain = 0  # runs refused, and scripts whose one line declined: each in its own process
        self.retired = 0
        self.closed = False  # the server is stopping: close() was called
        self._cannot_fork: dict[str, int] = {}  # lineage -> interpreters retired as unable to fork
        # lineage -> the whole environment its last run or client gave: what an interpreter started
        # for a load imports under (Note [One interpreter per lineage]); never written to disk
        self._environments: "OrderedDict[str, dict]" = OrderedDict()
        self._counted_unforkable: "weakref.WeakSet[WarmProcess]" = weakref.WeakSet()
        # True while memory is short: no interpreter starts (Note [The cache gives way] in overmind.server.pressure)
        self.holding_back: Callable[[], bool] = lambda: False

    def _interpreter(self, context: Context, create: bool = True, env: dict | None = None) -> WarmProcess | None:
        """The interpreter that serves ``context``, started if ``create`` (Note [One interpreter per
        lineage]); ``env``: the whole environment of the run or client asking."""
        with self.lock:
            if env is not None:
                self._remember_environment(context, env)
            key = self._serving(context)
            interpreter = self.interpreters.get(key)
            if interpreter is not None and not interpreter.alive:
                logger.warning("warm interpreter %d for context %s died (exit %s); starting another",
                               interpreter.proc.pid, key, interpreter.proc.returncode)
                del self.interpreters[key]
                interpreter.retire()
                interpreter = None
            if interpreter is None and create:
                key = context.key
                modules, refused = self.lessons.for_new(context, list(self.interpreters.values()))
                interpreter = self.interpreters[key] = WarmProcess(
                    context, self.config, modules, refused, on_reads=self.lessons.heard_reads,
                    packages=self.lessons.packages_for(context),
                    env=env if env is not None else self._environments.get(context.lineage))
            if interpreter is not None:
                self.interpreters.move_to_end(key)
            victims = []
            while len(self.interpreters) > self.config.warm_max:
                victims.append(self.interpreters.popitem(last=False)[1])
        for victim in victims:
            self._retire(victim, "over OVERMIND_WARM_MAX")
        return interpreter

    def _serving(self, context: Context) -> str:
        """The key of the interpreter that serves ``context`` (Note [One interpreter per lineage]):
        its own; for a context as a client sent it (a load's, a Prepare's), the most recently used
        interpreter of its lineage when none has its key. Under self.lock."""
        if context.key in self.interpreters or context.family:
            return context.key
        for key in reversed(self.interpreters):
            if self.interpreters[key].context.lineage == context.lineage:
                return key
        return context.key

    def _remember_environment(self, context: Context, env: dict) -> None:
        """Under self.lock."""
        self._environments[context.lineage] = env
        self._environments.move_to_end(context.lineage)
        while len(self._environments) > MAX_ENVIRONMENTS:
            self._environments.popitem(last=False)

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
        """Note [AOTInductor packages are handed over] in overmind.shared.calls.compiled: every interpreter
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
        are handed over] in overmind.shared.calls.compiled). ``env``: a run's whole environment, for a
        new interpreter to import under (Note [A run's interpreter imports under the run's environment])."""
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
            if self.closed:  # the server stops: close() ended the interpreter this waited for
                return logger.debug("preparing a warm interpreter for context %s ended by shutdown: %s",
                                    context.key, err)
            logger.warning("preparing a warm interpreter for context %s failed: %s", context.key, err)

    def start_loader(self, key: str, context: Context, cwd: str, sys_path: list, blob: bytes, modules: list = ()
                     ) -> tuple[socket.socket, int, bool]:
        """Fork the loader of one fill (the load of ``key``) from the context's warm interpreter,
        started if need be: (its job socket, its pid, whether it is a fresh interpreter because
        the warm one could not fork), or LoadFailure. What is said on the job socket is
        overmind.server.loads's (Note [The loader is handed its references])."""
        for attempt in (1, 2):
            try:
                interpreter = self._interpreter(context)
                if self._said_unforkable(interpreter):  # its successor forks the Job once ready
                    interpreter = self._interpreter(context)
            except OSError as err:  # the interpreter cannot be executed at all
                raise LoadFailure(P.ErrorCode.LOADER_CRASHED,
                                  f"could not start a warm interpreter with {context.python}: {err}") from None
            try:
                job, pid = interpreter.start_job(key, blob, list(modules), sys_path, cwd)
                fresh = bool(interpreter.unforkable)  # it said so as it took the job
                if interpreter.unforkable and self._retire_unforkable(interpreter, interpreter.unforkable):
                    self.prepare_soon(context, None)  # its successor keeps out what started the threads
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
        return job, pid, fresh

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
        with self.lock:
            self._remember_environment(context, spec.env)
        self._rekey(context.lineage)
        base, context = context, self.lessons.with_reads(context, spec.env)
        interpreter = self._interpreter(context, create=False)
        with self.lock:
            given_up = self._cannot_fork.get(context.lineage, 0) >= MAX_CANNOT_FORK
        if interpreter is None or not interpreter.ready:
            if given_up:
                raise RunRefused("this context's warm interpreters cannot fork (see the server log): runs go plain")
            if interpreter is None:
                self.prepare_soon(context, spec.env)
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
                    self.prepare_soon(again, spec.env)
                raise RunRefused(f"{err.message} (Note [Settings an import read]); an interpreter imported "
                                 "under this run's environment is starting") from None
            if err.code != P.ErrorCode.NOT_FORKABLE:
                raise RunRefused(err.message) from None
            if not self._retire_unforkable(interpreter, err.message):
                raise RunRefused(f"the warm interpreter cannot fork ({err.message}); this context's runs go "
                                 "plain until the server restarts") from None
            self.prepare_soon(context, spec.env)
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
                self._retire(interpreter, "memory is short")
            else:  # still importing: it has no child yet, and takes more memory every second
                logger.info("stopping warm interpreter %d, still importing (memory is short)", interpreter.proc.pid)
                self._discard(interpreter)
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
        self.closed = True
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
# [Settings an import read] in overmind.shared.settings.import_env), and one started without, say,
# the TORCHINDUCTOR_CACHE_DIR the user's shell sets would be refused by the very next run of
# the same shell, which would go plain again while yet another interpreter imports (measured:
# a torch.compile script's run 2 at 1.1 x plain, an AOTInductor script's at 1.2-2.2 x). Once
# its lineage knows what imports read, an interpreter belongs under the key of its own values
# of those (``_rekey``): a run with the same values is forked from it, and one with other values
# gets an interpreter of its own instead of being refused by this one for good.

# Note [One interpreter per lineage]
# A load or a Prepare names its context as the client sent it, without the values of what the
# imports read; the lineage's interpreter may be filed under the key of its own values
# (``_rekey``). Such a client is served by the lineage's most recently used interpreter, not by a
# second one that would import the same thousands of modules again (seconds of CPU, as much
# memory again); a loader keeps only what selects the context (overmind.warm.loader), so which
# one it forks from does not change a fill. An interpreter started without a whole environment
# (by a load, after its predecessor retired; by a Prepare that got there before its
# predecessor's successor) imports under the last one a run or a client of the lineage gave
# (``overmind run``, ``monkey_patch_all()``, a first run's report). Under only the context's, it
# would not see the shell's other settings its imports read (CI, COLUMNS, a library's own), be
# filed under a key no run of that shell has, and the next runs would go plain while yet
# another interpreter imported (seen once in CI: runs 2 and 3 of a curve plain).

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
