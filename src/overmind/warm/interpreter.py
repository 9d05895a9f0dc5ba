"""A warm interpreter: imports installed modules once, then forks a child per load or run.

Started by the server (``overmind.server.warm_process``) as ``python -c "...interpreter_main(fd)"`` in
its own session, cwd ``/``, stdio on the server's log; never by users::

    interpreter_main(control_fd)   # Warm -> InterpreterReady, then Job | Fork | Retire, until retired

A ``Job`` child runs one cold load (``overmind.warm.loader.run_job``); a ``Fork`` child becomes
the user's script (``overmind.warm.script.become``) with the front end's stdio, and this process
reports its exit status to the front end (``RunExited``) when it reaps it.

Note [Warm interpreters]
A warm interpreter holds only code that cannot change under it: the standard library and
installed packages (``overmind.warm.installed.installed_modules``), never the user's own code (the
script's folder, the cwd, editable installs, ``PYTHONPATH`` outside site-packages), so an
edit to the user's code is seen by the next run. It records the size and mtime of every
file it imported from; before each fork it checks them, and one that changed (a ``pip
install -U``) makes it refuse (``NOT_FORKABLE``) and the server retire it: the run goes
plain this once, the next gets a fresh interpreter, and old code never runs.

Note [Forking only past what a fork keeps]
A fork copies only the calling thread, and a process that initialised CUDA cannot fork a
usable child. So before each fork the interpreter checks that no Python thread but its own
runs, that every native thread started since it was ready is one a fork keeps working (Note
[Threads libraries start] in overmind.warm.fork_safety: OpenBLAS's pools are stopped,
jemalloc's thread is forked past), and that CUDA was never initialised (Note [Warm
interpreters never touch CUDA] in overmind.server.pool). An import that started a thread
nobody vouches for gets its module kept out of the context's interpreters; this one refuses
to fork (``NOT_FORKABLE``) and is replaced (Note [A tainted interpreter says so at once]), and
meanwhile its loads run in a fresh process (Note [A fill never waits for a fork]).

Note [A tainted interpreter says so at once]
An import learned between forks that starts a thread nobody vouches for ends this
interpreter's use: it tells the server (``Unforkable``) at once and imports nothing more, so
the server starts its successor, which keeps the module out, while the run that taught it
still runs, not when the next run asks for a fork and would go plain beside the successor's
imports (measured: run 2 at 1.51 x plain under ``overmind run``, 1.15 x with
``monkey_patch_all()``, benchmarks/real_envs.sh stranger).

Note [A fill never waits for a fork]
A ``Job`` that comes while the interpreter cannot fork runs in a fresh interpreter instead
(``Children.spawn_job``), at the priority the server gives it: slower to start than a fork,
but the cache still fills, whatever threads the context's imports start.

Note [Warm interpreters learn]
Each run reports, at its exit, the installed modules it imported; a patched client reports
them while it imports (``Warm`` on a ready interpreter, from the server); and each Job names
the modules its call needs. The interpreter imports those it lacks, one at a time, between
forks (a Fork or Job waiting on the control socket goes first), so the next run of the same
script or load of the same library imports nothing; the server keeps the list per context
and hands it (``Warm``) to the context's next interpreter at start. Learning yields the CPU
(Note [Warming up yields the CPU]) instead of competing with the client that taught it. A
Job's own modules are imported here before its fork, at the priority the server gave us
for the Job: the first fill of a cold start is usually followed by three more (a pipeline's
components), and importing diffusers once here beats importing it in each loader child. A
Job's modules include what its caller's plain load imported (Note [Cold fills wait for their
caller] in overmind.server.fills).

Note [Frozen before forking]
Everything the interpreter holds is moved to the garbage collector's permanent generation
before each fork (``gc.freeze()``): a child's collections, and the exit-time sweep for open
files (Note [Exit like Py_RunMain] in overmind.warm.script), then scan only the run's own objects
(0.25 s less for a run of ``pass`` with torch imported), and never write to the shared pages
of the interpreter's objects (reference counts aside), so they stay shared.

Note [Retiring never kills work]
``Retire`` stops forking; the process exits once every load and run it started has ended,
still reporting run statuses. Only the server's death (EOF on the control socket) kills the
loads in flight (their results have nowhere to go); runs keep going even then.
"""

from __future__ import annotations

import importlib
import logging
import os
import select
import signal
import socket
import sys
import time

from overmind.shared import protocol as P
from overmind.shared.settings.import_env import Reads, differs, recording
from overmind.shared.calls.compiled import USED as INDUCTOR_USED
from overmind.warm.children import Children
from overmind.warm.compiled import PRIMING, Priming, compile_stack_held, forget_isa_list
from overmind.warm.fork_safety import ThreadCensus, Refused, cuda_note
from overmind.warm.installed import installed_importable
from overmind.warm import oom, pytest_runs

logger = logging.getLogger(__name__)

__all__ = ["interpreter_main"]

PREIMPORT = ("torch",)
# Note [Warm interpreters never touch CUDA] in overmind.server.pool: imports that ask whether CUDA
# is there (torch.cuda.is_available()) ask NVML, which does not initialise CUDA; each child
# gets the caller's own value back.
NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"  # in INTERPRETERS_OWN: never compared with a run's (overmind.shared.settings.import_env)
# Seconds without a message from the server before a priming step starts: Note [Priming waits
# for a pause] in overmind.warm.compiled.
PRIME_AFTER_QUIET = 0.5
# Seconds of quiet after a run before its successor's child is forked ahead: Note [A run's child
# is forked ahead] in overmind.warm.children.
AHEAD_AFTER_QUIET = 0.05


class Holdings:
    """What a warm interpreter holds, and whether a fork may copy it: the modules it imported,
    each under watch (Note [Forking only past what a fork keeps]), the files they came from
    (Note [Warm interpreters]), the settings their imports read (Note [Settings an import read]
    in overmind.shared.settings.import_env: only news travels to the server), what it learned for its
    successor and the modules kept out of its context's interpreters."""

    def __init__(self) -> None:
        self.files: dict[str, tuple[int, int]] = {}  # Note [Warm interpreters]
        self.census = ThreadCensus()  # Note [Forking only past what a fork keeps]
        self.learned: list[str] = []  # what runs imported that we did not hold: for our successor
        self.refused_modules: set[str] = set()
        self.failed_modules: set[str] = set()  # Note [A failed import is not a refusal]
        self.tainted = False  # the last import_ started a thread nobody vouches for
        self.reads = Reads()  # Note [Settings an import read] in overmind.shared.settings.import_env
        self.told: tuple[set, set] = (set(), set())  # the names and prefixes the server has heard of

    def known(self, name: str) -> bool:
        """Held, kept out, or failed here: never imported (again) by this interpreter."""
        return name in sys.modules or name in self.refused_modules or name in self.failed_modules

    def import_(self, names) -> list[str]:
        """Import those of ``names`` installed and not yet held, under watch; the ones imported.
        ``self.tainted`` says whether one started a thread nobody vouches for."""
        done = []
        self.tainted = False
        for name in names:
            if self.known(name):
                continue
            self.reads.unbounded = ""
            failed, installed, before = None, False, set(sys.modules)
            # Note [Settings an import read] in overmind.shared.settings.import_env; find_spec imports the parent package
            with recording(self.reads), self.census.watching(self.refused_modules, name) as watch:
                try:
                    installed = installed_importable(name)
                    if installed:
                        importlib.import_module(name)
                except BaseException as err:  # noqa: BLE001 - a module that fails here costs the run an import
                    failed = err
            if self.reads.unbounded:  # Note [Settings an import read] in overmind.shared.settings.import_env: not followed
                logger.debug("importing %s read the environment untraced (%s)", name, self.reads.unbounded)
            culprits = self.census.culprits(watch) if self.census.own else {}
            for culprit, threads in culprits.items():
                # Note [Threads libraries start] in overmind.warm.fork_safety: kept out of this context's
                # interpreters from now on; a run imports it itself.
                logger.warning("importing %s started %d thread(s) nobody vouches for (%s) in %s: %s is kept out "
                               "of this context's warm interpreters; runs import it themselves", name,
                               len(threads), ", ".join(threads), culprit, culprit)
                self.refused_modules.add(culprit)
                self.tainted = True
            if not installed:
                continue
            if failed is not None:
                _drop_orphans(before)
            if failed is not None or culprits:
                if isinstance(failed, Refused):
                    logger.info("not importing %s: %s", name, failed)
                elif failed is not None:
                    logger.debug("pre-import of %s failed: %s", name, failed)
                if culprits or isinstance(failed, Refused):
                    self.refused_modules.add(name)
                else:  # Note [A failed import is not a refusal]
                    self.failed_modules.add(name)
                if name in self.learned:
                    self.learned.remove(name)
                continue
            done.append(name)
        return done

    def record_files(self, extra=()) -> None:
        from overmind.warm.installed import installed_modules

        paths = [getattr(sys.modules.get(name), "__file__", None) for name in installed_modules(exclude=())]
        for path in [*paths, *extra]:
            if isinstance(path, str) and path not in self.files:
                try:
                    st = os.stat(path)
                    self.files[path] = (st.st_mtime_ns, st.st_size)
                except OSError:
                    pass

    def why_not_forkable(self) -> str:
        """Note [Forking only past what a fork keeps], and Note [Warm interpreters]."""
        why = self.census.strangers_note() or cuda_note()
        if why:
            return why
        for path, (mtime_ns, size) in self.files.items():
            try:
                st = os.stat(path)
                if (st.st_mtime_ns, st.st_size) == (mtime_ns, size):
                    continue
            except OSError:
                pass
            return f"{path} changed since it was imported (Note [Warm interpreters])"
        return ""

    def news(self) -> dict:
        """The names and prefixes read since the server last heard: only news travels."""
        names = [n for n in self.reads.names if n not in self.told[0]]
        prefixes = [p for p in self.reads.prefixes if p not in self.told[1]]
        self.told[0].update(names)
        self.told[1].update(prefixes)
        return {"names": names, "prefixes": prefixes} if names or prefixes else {}


class WarmInterpreter:
    def __init__(self, control: socket.socket) -> None:
        self.control = control
        self.children = Children()
        self.held = Holdings()
        self.nvml_check = os.environ.get(NVML_CHECK)  # the caller's: back in every child
        self.retiring = False
        self.to_learn: list[str] = []
        self.to_preload: list[dict] = []  # AOTInductor packages: Note [AOTInductor packages are handed over]
        self.compiles = False  # its context's runs made Inductor's probes (overmind.shared.calls.compiled)
        self.priming: Priming | None = None  # Note [Inductor's probes, made once] in overmind.warm.compiled
        self.last_message = time.monotonic()  # from the server, on the control socket
        self.unforkable = ""  # Note [A tainted interpreter says so at once]: why, once it said so
        self.wakeup_r, self.wakeup_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    # -- start ------------------------------------------------------------------------------

    def start(self) -> None:
        signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes select through the wakeup fd
        signal.set_wakeup_fd(self.wakeup_w, warn_on_full_buffer=False)
        if sys.path and sys.path[0] in ("", os.getcwd()):
            del sys.path[0]  # `python -c` put the cwd ("/") first; a run sets its own sys.path[0]
        message, _, fds = P.recv_message(self.control)
        P.close_fds(fds)
        warm = P.expect(message, P.Warm, "first, from the server")
        self.held.refused_modules.update(n for n in warm.refused if isinstance(n, str))
        yielding = _yield_cpu()  # Note [Warming up yields the CPU]
        os.environ[NVML_CHECK] = "1"
        imported = self.held.import_(PREIMPORT)
        with recording(self.held.reads):
            import overmind.shared.segments.quirks  # noqa: F401  (torch-side helpers before forking)
            import overmind.warm.script  # noqa: F401  (what every run imports first)
            import overmind.api  # and what every hit runs: Note [A hit imports nothing] in overmind.client.cache
            overmind.api.prepare_hit_path()

        self.held.census.take()  # Note [Forking only past what a fork keeps]: what runs now is its own
        self.compiles = INDUCTOR_USED in warm.modules
        imported += self.held.import_(warm.modules)
        tainted = self.held.tainted  # its own imports started a thread: said once it is ready
        self.held.record_files()
        self._index()
        self._prime()
        self._to_preload(warm.packages)
        if yielding:
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
        P.send_message(self.control, P.InterpreterReady(os.getpid(), imported, refused=sorted(self.held.refused_modules),
                                                   environ=self.held.news()))
        if tainted:
            self._say_unforkable()

    def _index(self) -> None:
        """_index_bound_names, recorded: looking names up may import (lazy modules)."""
        with recording(self.held.reads):
            _index_bound_names()

    def _prime(self) -> None:
        """Note [Inductor's probes, made once] in overmind.warm.compiled: once, if the compile stack was
        learned; made a probe at a time between forks (serve)."""
        if self.priming is None and self.compiles and PRIMING not in self.held.refused_modules \
                and compile_stack_held():
            self.priming = Priming()

    def _prime_step(self) -> None:
        yielding = _yield_cpu()
        try:
            self.priming.step(self.held.reads)
        finally:
            if yielding:
                os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
        if self.priming.done:
            self.held.record_files(self.priming.files)
            if self.priming.refuse:
                self.held.refused_modules.add(PRIMING)  # the context's next interpreters do not prime

    def _to_preload(self, packages) -> None:
        from overmind.shared.calls.compiled import packages_from_wire, spec_key

        queued = {spec_key(p) for p in self.to_preload}
        self.to_preload += [p for p in packages_from_wire(packages) if spec_key(p) not in queued]

    def _preload_one(self) -> None:
        """One AOTInductor package loaded, never run: Note [AOTInductor packages are handed over] in
        overmind.shared.calls.compiled."""
        from overmind.warm.compiled import preload_warm

        yielding = _yield_cpu()
        try:
            refused = preload_warm(self.to_preload.pop(0), self.held.reads, self.held.refused_modules)
        finally:
            if yielding:
                os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
        self.held.refused_modules.update(refused)
        self.held.record_files()  # what loading it imported (torch._inductor, if no run had)
        self._index()
        self._prime()

    # -- the loop -----------------------------------------------------------------------------

    def serve(self) -> None:
        while True:
            if self.retiring and not self.children.busy():
                os._exit(0)
            watched = [self.wakeup_r, *self.children.watched()]
            if not self.retiring:
                watched.append(self.control)
            priming = self.priming is not None and not self.priming.done
            pause_in = PRIME_AFTER_QUIET - (time.monotonic() - self.last_message)
            # Nothing more to learn once retiring or unforkable (Note [A tainted interpreter says so at once]).
            idle = self.retiring or bool(self.unforkable)
            busy = not idle and (self.to_learn or self.to_preload or (priming and pause_in <= 0))
            ahead = self.children.wants_spare() and not (idle or busy or priming or self.children.busy())
            timeout = None if idle else 0 if busy else pause_in if priming else AHEAD_AFTER_QUIET if ahead else None
            try:
                ready, _, _ = select.select(watched, [], [], timeout)
            except InterruptedError:
                continue
            if self.wakeup_r in ready:
                self._drain_wakeup()
            loads = len(self.children.loads)
            for names in self.children.reap():
                self._to_learn(names)
            if len(self.children.loads) < loads:  # a fill ended: the child forked ahead rehearsed without it
                self.children.drop_spare()
            self._to_learn(self.children.readable(ready))
            if self.control in ready:
                self._control()
            elif busy:
                self.children.drop_spare()  # Note [A run's child is forked ahead] in overmind.warm.children
                self._learn_one() if self.to_learn else self._preload_one() if self.to_preload else self._prime_step()
            elif ahead and not ready and not self.held.why_not_forkable():
                self.children.fork_spare(self._in_child)

    def _drain_wakeup(self) -> None:
        try:
            while os.read(self.wakeup_r, 512):
                pass
        except BlockingIOError:
            pass

    def _to_learn(self, names) -> None:
        self.compiles = self.compiles or INDUCTOR_USED in names  # the mark goes on as a name: overmind.shared.calls.compiled
        new = [n for n in pytest_runs.learnable(names)  # Note [pytest rewrites what it imports]
               if isinstance(n, str) and not self.held.known(n) and n not in self.to_learn]
        if not self.unforkable:  # Note [A tainted interpreter says so at once]: its successor learns them
            self.to_learn.extend(new)
        self.held.learned.extend(n for n in new if n not in self.held.learned)

    def _learn_now(self, names: list) -> None:
        """Import ``names``, and what was queued before them, now, at our current priority."""
        if not names:
            return
        self.children.drop_spare()  # Note [A run's child is forked ahead] in overmind.warm.children
        last = max(self.to_learn.index(n) for n in names)
        now, self.to_learn = self.to_learn[:last + 1], self.to_learn[last + 1:]
        started = time.monotonic()
        self.held.import_(now)
        logger.debug("imported %d learned modules for a job in %.2fs", len(now), time.monotonic() - started)
        self.held.record_files()
        self._index()
        self._prime()

    def _learn_one(self) -> None:
        """One learned module, then back to select: a Fork waiting goes first (Note [Warm interpreters learn])."""
        name = self.to_learn.pop(0)
        yielding = _yield_cpu()
        started = time.monotonic()
        try:
            self.held.import_([name])
        finally:
            if yielding:
                os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
        imported = time.monotonic()
        if self.held.tainted:
            self._say_unforkable()
            return
        logger.debug("learned %s in %.2fs", name, imported - started)
        if not self.to_learn:
            self.held.record_files()
            self._index()
            self._prime()
            logger.info("learned what its clients imported: %d modules held", len(sys.modules))

    def _say_unforkable(self) -> None:
        """Note [A tainted interpreter says so at once]."""
        why = self.held.why_not_forkable()
        if not why:
            return  # the thread ended meanwhile
        self.unforkable = why
        self.to_learn.clear()
        self.children.drop_spare()
        logger.info("cannot fork (%s): asking the server for a successor", why)
        P.send_message(self.control, P.Unforkable(why, refused=sorted(self.held.refused_modules),
                                                  environ=self.held.news()))

    def _control(self) -> None:
        self.last_message = time.monotonic()
        try:
            message, blob, fds = P.recv_message(self.control)
        except (EOFError, ConnectionResetError, P.ProtocolError):
            # The server died: loads have nowhere to send their result; runs go on (Note [Retiring never kills work]).
            self.children.kill_loads()
            self.children.drop_spare()
            self.retiring = True
            return
        if isinstance(message, P.Retire):
            P.close_fds(fds)
            self.children.drop_spare()
            self.retiring = True
            return
        if isinstance(message, P.Warm):  # a client's imports, as they happen: Note [Warm interpreters learn]
            P.close_fds(fds)
            self.held.refused_modules.update(n for n in message.refused if isinstance(n, str))
            self._to_learn(message.modules)
            self._to_preload(message.packages)
            self.children.expect(message.program)  # Note [A run's child is forked ahead] in overmind.warm.children
            return
        expected = 1 if isinstance(message, P.Job) else 4 if isinstance(message, P.Fork) else -1
        if len(fds) != expected:
            P.close_fds(fds)
            P.send_message(self.control, P.JobFailed("", P.ErrorCode.BAD_REQUEST,
                                                     f"unexpected {type(message).__name__} with {len(fds)} fds"))
            return
        if isinstance(message, P.Job):
            # Imported here, before the fork, so every later loader and run shares them (Note [Warm
            # interpreters learn]); the server lifted our priority when it sent the Job.
            self._to_learn(message.modules)
            if not self.unforkable:
                self._learn_now([n for n in message.modules if n in self.to_learn])
        why = self.held.why_not_forkable()
        if why and isinstance(message, P.Job):
            # Note [A fill never waits for a fork]: a fresh interpreter loads it instead.
            logger.info("cannot fork (%s): load %s runs in a fresh interpreter", why, message.key[:16])
            pid = self.children.spawn_job(message, blob, fds[0], self._child_environ())
            P.send_message(self.control, P.JobStarted(message.key, pid, modules=len(sys.modules),
                                                      learned=self.held.learned, environ=self.held.news(),
                                                      unforkable=why, refused=sorted(self.held.refused_modules)))
            return
        if why:
            P.close_fds(fds)
            P.send_message(self.control, P.JobFailed(getattr(message, "key", "run"), P.ErrorCode.NOT_FORKABLE, why,
                                                     refused=sorted(self.held.refused_modules),
                                                     environ=self.held.news()))
            return
        if isinstance(message, P.Fork):  # Note [Settings an import read] in overmind.shared.settings.import_env
            env = message.spec.get("env") if isinstance(message.spec, dict) else None
            reads = self.held.reads
            why = differs(env if isinstance(env, dict) else {}, os.environ, reads.names, reads.prefixes)
            if why:
                P.close_fds(fds)
                P.send_message(self.control, P.JobFailed("run", P.ErrorCode.ENV_DIFFERS, why,
                                                         environ=self.held.news()))
                return
        if isinstance(message, P.Job):
            pid = self.children.fork_job(message, blob, fds[0], self._in_child)
            key = message.key
        else:
            self._index()  # at once unless something was imported since the last time
            score = message.spec.get("oom_score_adj") if isinstance(message.spec, dict) else None
            try:
                with oom.as_caller(score if isinstance(score, int) else None):  # Note [The cache dies first]
                    pid = self.children.fork_run(message, fds, self._in_child)
            except oom.CannotMatch as err:  # not this interpreter's fault: BAD_REQUEST, so it is not retired
                P.close_fds(fds)
                P.send_message(self.control, P.JobFailed("run", P.ErrorCode.BAD_REQUEST, str(err)))
                return
            if pid < 0:  # not this interpreter's fault: BAD_REQUEST, so it is not retired
                P.send_message(self.control, P.JobFailed("run", P.ErrorCode.BAD_REQUEST,
                                                         "the front end left before its run started"))
                return
            key = "run"
        P.send_message(self.control, P.JobStarted(key, pid, modules=len(sys.modules), learned=self.held.learned,
                                                  environ=self.held.news()))

    def _child_environ(self) -> dict:
        """The environment a load runs under: ours, with the caller's NVML_CHECK back."""
        env = dict(os.environ)
        env.pop(NVML_CHECK, None)
        if self.nvml_check is not None:
            env[NVML_CHECK] = self.nvml_check
        return env

    def _in_child(self) -> None:
        forget_isa_list()  # Note [Inductor's probes, made once] in overmind.warm.compiled
        env = self._child_environ()
        os.environ.clear()
        os.environ.update(env)  # a run's child takes the caller's whole environment later
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in (self.wakeup_r, self.wakeup_w):
            os.close(fd)
        self.children.close_in_child()
        self.control.close()


def _index_bound_names() -> None:
    """The pass over every module that a run's ``monkey_patch_all()`` would make, made here
    once, before forking: Note [Names bound before patching] in overmind.shared.patching.bound_names."""
    from overmind.shared import patching
    from overmind.api import DEFAULT_PATCH_POINTS

    try:
        patching.index_bound_names(patching.PatchPoint.parse(p) for p in DEFAULT_PATCH_POINTS)
    except Exception:  # noqa: BLE001 - a run then makes the pass itself
        logger.debug("indexing bound names failed", exc_info=True)


def _yield_cpu() -> bool:
    """Note [Warming up yields the CPU]
    A new interpreter is usually started by a run that went plain for want of one, and its
    imports would compete with that very run for the CPU (1.2 x plain measured on 2 cores).
    So it imports under SCHED_IDLE, running only on CPU time nobody else wants, and returns
    to SCHED_OTHER when ready, before any fork; so does each learned import (Note [Warm
    interpreters learn]), and the server lifts it to SCHED_OTHER when it sends a Fork or Job,
    so no run or load waits on an idle import. Only where the kernel will let it return
    (root, or RLIMIT_NICE of 20): otherwise its children would inherit the idle policy."""
    import resource

    try:
        if os.geteuid() != 0 and resource.getrlimit(resource.RLIMIT_NICE)[0] < 20:
            return False
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        return True
    except (OSError, AttributeError):
        return False


# Note [A failed import is not a refusal]
# A run reports the names in its sys.modules, and a module is there while it imports: a report
# can name one whose import then failed, which the run's own code caught (transformers tries
# torch.utils._cxx_pytree, which needs optree). The interpreter's import of that name fails too.
# Kept out as a module that started a thread is, every later import of it here raised Refused,
# a BaseException no `except ImportError` catches: torch._dynamo then failed part-way, after it
# had registered its artifacts with torch's mega-cache, and a run forked from that interpreter
# imported torch._dynamo again and died ("Artifact of type=pgo already registered", the LM's run 2
# in `make test-slow`). So a failed import is only not tried again: later imports of it fail as
# they do in plain python, where the code that catches that catches it.

# Note [A failed import leaves no orphans]
# A package whose import fails part-way (it imports a module kept out: Note [Threads libraries
# start] in overmind.warm.fork_safety) is taken out of sys.modules, but the submodules it had
# imported stay, and some of them set state on the package as they load: pandas' datetime
# extension hangs its C API on the ``pandas`` module. A run forked from that interpreter then
# imports pandas afresh, finds those submodules imported already, and fails as plain python
# never does ("partially initialized module 'pandas' has no attribute '_pandas_datetime_CAPI'",
# `overmind run` of the LM script beside a module that starts an unknown thread). So after a
# failed import, every module it added whose package is no longer in sys.modules goes too, and
# the run imports the whole package as plain python does. Complete packages it added stay:
# some extensions (numpy's) cannot be loaded twice in one process.


def _drop_orphans(before: set) -> None:
    """Note [A failed import leaves no orphans]: forget the modules added since ``before`` whose
    package (or any package above it) is not in sys.modules."""
    for name in set(sys.modules) - before:
        parts = name.split(".")
        if any(".".join(parts[:i]) not in sys.modules for i in range(1, len(parts))):
            del sys.modules[name]


def interpreter_main(control_fd: int) -> None:
    _log_to_server()
    oom.cache_first()  # Note [The cache dies first] in overmind.warm.oom
    interpreter = WarmInterpreter(socket.socket(fileno=control_fd))
    interpreter.start()
    interpreter.serve()


def _log_to_server() -> None:
    """Our records and our loaders' go to stderr, the server's log; a run's child takes it back (overmind.warm.script)."""
    from overmind.shared.settings.config import LOG_FORMAT, LOG_LEVELS

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    ours = logging.getLogger("overmind")
    ours.addHandler(handler)
    ours.setLevel(level if (level := os.environ.get("OVERMIND_LOG_LEVEL", "").upper()) in LOG_LEVELS else "INFO")
    ours.propagate = False
