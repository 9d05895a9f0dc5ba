"""Server side of warm interpreters: one per client context, for loads and runs. Standard library only.

    pool = LoaderPool(config)
    result, skeleton, fds = pool.run(key, context, cwd, sys_path, blob)   # a cold load
    pid = pool.fork_run(context, spec, [stdin, stdout, stderr, conn])      # overmind run

A *context* is the interpreter and the environment that can change an import. For each
the server keeps a warm interpreter (``overmind.zygote``, a "zygote") that imported torch
and the installed modules the context's earlier loads and runs imported, and forks one
child per cold load (``overmind.loader``) or run (``overmind.warm``). A cold load thus
pays neither interpreter start-up nor library imports, and a run starts in a fork. The
pool is bounded in count (``OVERMIND_WARM_MAX``), memory (``OVERMIND_WARM_MEMORY``, PSS)
and idle time (``OVERMIND_WARM_IDLE``); retiring an interpreter never kills a load or run
in progress (Note [Retiring never kills work] in overmind.zygote).

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
from dataclasses import dataclass, field

from overmind import protocol as P
from overmind.aoti import MAX_PACKAGES, refusal_name, spec_key
from overmind.config import Config, open_runtime_file, selecting_environment
from overmind.fill_priority import Fill, FillPriorities, can_lift_idle, every_thread, to_normal
from overmind.import_env import MAX_NAMES, MAX_PREFIXES, reads_from_wire, select

logger = logging.getLogger("overmind.server.loaders")

__all__ = ["Context", "Fill", "LoaderPool", "LoadFailure", "RunRefused", "context_from_wire", "run_from_wire"]

READY_TIMEOUT = 300.0
FORK_TIMEOUT = 30.0  # a Fork waits at most for one learned module's import (Note [Warm interpreters learn])
MAX_LEARNED = 10000


class LoadFailure(Exception):
    def __init__(self, code: int, message: str, traceback: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.traceback = traceback


@dataclass(frozen=True)
class Context:
    """Which warm interpreter serves a client: the interpreter and the environment that can
    change what an import does (Note [Environment that selects an interpreter] in overmind.config).
    Not the cwd or sys.path: a warm interpreter holds only installed code (Note [Warm
    interpreters] in overmind.zygote); each load or run brings its own."""

    python: str
    env: tuple  # sorted (name, value) pairs
    # The key of the context before the names its interpreters' imports read were added to env
    # (Note [Settings an import read] in overmind.import_env); "": this is that context.
    family: str = field(default="", compare=False)

    @property
    def lineage(self) -> str:
        """What this context's variants share: what to pre-import, what their imports read."""
        return self.family or self.key

    @property
    def key(self) -> str:
        # .venv/bin/python and .venv/bin/python3 are one interpreter with one venv: the folder
        # (where a venv is found) and the binary the name resolves to, not the name.
        python = [os.path.dirname(self.python), os.path.realpath(self.python)]
        raw = json.dumps([python, list(self.env)]).encode()
        return hashlib.sha256(raw).hexdigest()[:16]


def _check_context(data: dict) -> Context:
    try:
        python, env = data["python"], data["env"]
    except (KeyError, TypeError):
        raise LoadFailure(P.ErrorCode.BAD_REQUEST, "context needs python and env") from None
    if not (isinstance(python, str) and os.path.isabs(python) and os.access(python, os.X_OK)):
        raise LoadFailure(P.ErrorCode.BAD_REQUEST, f"context python {python!r} is not an executable absolute path")
    if not (isinstance(env, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
        raise LoadFailure(P.ErrorCode.BAD_REQUEST, "context env must map strings to strings")
    kept = selecting_environment(env)
    return Context(python, tuple(sorted(kept.items())))


def context_from_wire(data: dict) -> tuple[Context, str, list]:
    """A load's context, its cwd and sys.path, validated (Note [Frames are untrusted] in overmind.protocol)."""
    context = _check_context(data)
    cwd, sys_path = data.get("cwd"), data.get("sys_path")
    if not (isinstance(cwd, str) and os.path.isdir(cwd)):
        raise LoadFailure(P.ErrorCode.BAD_REQUEST, f"context cwd {cwd!r} is not a directory")
    if not (isinstance(sys_path, list) and all(isinstance(p, str) for p in sys_path)):
        raise LoadFailure(P.ErrorCode.BAD_REQUEST, "context sys_path must be a list of strings")
    return context, cwd, sys_path


def run_from_wire(context: dict, spec: dict) -> tuple[Context, dict]:
    """A run's context and spec, validated; the spec's details are overmind.warm's to check."""
    ctx = _check_context(context)
    if not isinstance(spec, dict) or spec.get("mode") not in ("script", "module", "code") or \
            not isinstance(spec.get("target"), str) or not isinstance(spec.get("cwd"), str) or \
            not isinstance(spec.get("argv"), list) or not isinstance(spec.get("env"), dict) or \
            not isinstance(spec.get("umask"), int):
        raise LoadFailure(P.ErrorCode.BAD_REQUEST, "a run needs mode, target, argv, cwd, env and umask")
    return ctx, spec


class RunRefused(Exception):
    """No warm run now; the front end runs plainly (Note [Never worse than plain python] in overmind.run)."""


class Zygote:
    """One warm interpreter for a context (overmind.zygote); forks a child per load or run."""

    def __init__(self, context: Context, config: Config, modules: list, refused: list = (), on_reads=None,
                 packages: list = ()) -> None:
        self.context = context
        self.on_reads = on_reads  # called with (context, names, prefixes) its imports read
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = dict(context.env)
        env["OVERMIND_DISABLE"] = "1"  # a warm interpreter calls originals; it never patches
        env["OVERMIND_RUNTIME_DIR"] = str(config.runtime_dir)
        code = f"from overmind.zygote import zygote_main; zygote_main({theirs.fileno()})"
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
        self.refused: list = []  # modules that started a thread in it (Note [Forking past torch's thread])
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
            if can_lift_idle():  # Note [Warming up yields the CPU] in overmind.zygote: never wait on a learned import
                every_thread(self.proc.pid, to_normal)
            self.sock.settimeout(timeout)
            reply, _, got = P.recv_message(self.sock, max_blob=0)
            P.close_fds(got)
            if isinstance(reply, (P.JobFailed, P.JobStarted)):
                self._heard(reply.environ)
            if isinstance(reply, P.JobFailed):
                self.refused = sorted(set(self.refused) | {n for n in reply.refused if isinstance(n, str)})
                raise P.RemoteError(reply.code, reply.message, reply.traceback)
            started = P.expect(reply, P.JobStarted, "from a warm interpreter")
            self.modules = started.modules
            self.learned = list(started.learned)
            self.last_used = time.time()
            return started

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

    def fork_run(self, spec: dict, fds: list[int]) -> int:
        started = self._start(P.Fork(spec), b"", fds, FORK_TIMEOUT)
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
        """Note [Retiring never kills work] in overmind.zygote: no new forks; it exits when its
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


class LoaderPool:
    """The warm interpreters, one per context, bounded in count, memory and idle time."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.lock = threading.Lock()
        self.fills = FillPriorities(config)  # Note [Cold fills yield to their caller] in overmind.fill_priority
        self.zygotes: "OrderedDict[str, Zygote]" = OrderedDict()
        self.learned: dict[str, list] = {}  # context key -> installed modules its runs and loads imported
        self.refused: dict[str, set] = {}  # context key -> modules that started a thread when imported
        self.packages: dict[str, list] = {}  # lineage -> AOTInductor packages to preload (overmind.aoti)
        # context lineage -> (names, prefixes) its interpreters' imports read: Note [Settings an import read]
        self.reads: dict[str, tuple[set, set]] = {}
        self.reads_lock = threading.Lock()
        self.retired = 0
        self.settling = 0  # loaders that answered and still rebuild their segments (see _settle)

    def _modules_for(self, context: Context) -> list:
        """What the lineage learned, its live interpreters' lessons included: a variant keyed on
        another value of a variable read at import starts as warm as they are."""
        known = list(self.learned.get(context.lineage, ()))
        refused = self.refused.get(context.lineage, set())
        for zygote in self.zygotes.values():
            if zygote.context.lineage == context.lineage:
                known += [n for n in [*zygote.imported, *zygote.learned] if n not in known and n not in refused]
        return known[:MAX_LEARNED]

    def _heard_reads(self, context: Context, names: list, prefixes: list) -> None:
        with self.reads_lock:
            known_names, known_prefixes = self.reads.setdefault(context.lineage, (set(), set()))
            known_names.update(names[:max(MAX_NAMES - len(known_names), 0)])
            known_prefixes.update(prefixes[:max(MAX_PREFIXES - len(known_prefixes), 0)])

    def with_reads(self, context: Context, env) -> Context:
        """``context`` with the caller's values (``env``, its whole environment) of the variables its
        lineage's imports read: a caller whose values differ from an interpreter's gets another,
        imported under its own (Note [Settings an import read] in overmind.import_env)."""
        with self.reads_lock:
            names, prefixes = self.reads.get(context.lineage, ((), ()))
            chosen = select(env, names, prefixes) if isinstance(env, dict) else {}
        merged = {**dict(context.env), **chosen}
        return Context(context.python, tuple(sorted(merged.items())), family=context.lineage)

    def _remember(self, zygote: Zygote) -> None:
        known = self.learned.setdefault(zygote.context.lineage, [])
        for name in [*zygote.imported, *zygote.learned]:
            if name not in known and len(known) < MAX_LEARNED:
                known.append(name)
        refused = self.refused.setdefault(zygote.context.lineage, set())
        refused.update(zygote.refused)
        known[:] = [name for name in known if name not in refused]

    def _zygote(self, context: Context, create: bool = True) -> Zygote | None:
        with self.lock:
            zygote = self.zygotes.get(context.key)
            if zygote is not None and not zygote.alive:
                logger.warning("warm interpreter %d for context %s died (exit %s); starting another",
                               zygote.proc.pid, context.key, zygote.proc.returncode)
                del self.zygotes[context.key]
                zygote.retire()
                zygote = None
            if zygote is None and create:
                zygote = self.zygotes[context.key] = Zygote(context, self.config, self._modules_for(context),
                                                            sorted(self.refused.get(context.lineage, ())),
                                                            on_reads=self._heard_reads,
                                                            packages=self._packages_for(context))
            if zygote is not None:
                self.zygotes.move_to_end(context.key)
            victims = []
            while len(self.zygotes) > self.config.warm_max:
                victims.append(self.zygotes.popitem(last=False)[1])
        for victim in victims:
            self._retire(victim, "over OVERMIND_WARM_MAX")
        return zygote

    def _retire(self, zygote: Zygote, why: str) -> None:
        with self.lock:
            if self.zygotes.get(zygote.context.key) is zygote:
                del self.zygotes[zygote.context.key]
            self._remember(zygote)
            self.retired += 1
        logger.info("retiring warm interpreter %d (%s)", zygote.proc.pid, why)
        zygote.retire()

    def _packages_for(self, context: Context) -> list:
        """The lineage's AOTInductor packages, but those that started a thread where loaded."""
        refused = self.refused.get(context.lineage, set())
        return [p for p in self.packages.get(context.lineage, ()) if refusal_name(p) not in refused]

    def _learn_packages(self, context: Context, packages: list) -> None:
        """Note [AOTInductor packages are handed over] in overmind.aoti: every interpreter of the
        lineage preloads them (a run may be forked from a variant keyed on what imports read)."""
        with self.lock:
            known = self.packages.setdefault(context.lineage, [])
            for spec in packages:
                known[:] = [k for k in known if spec_key(k) != spec_key(spec)] + [spec]
            del known[:-MAX_PACKAGES]
            zygotes = [z for z in self.zygotes.values() if z.context.lineage == context.lineage]
        for zygote in zygotes:
            with zygote.lock:
                if not zygote.retired and zygote.alive:
                    P.send_message(zygote.sock, P.Warm([], packages=list(packages)))

    def prepare(self, context: Context, modules: list = (), packages: list = ()) -> None:
        """Have a ready interpreter for ``context`` (clients ask right after monkey_patch_all()),
        and have it import ``modules``, which a client of it imported (Note [Warm interpreters
        learn] in overmind.zygote), and preload ``packages`` (overmind.aoti)."""
        try:
            if modules:
                with self.lock:
                    known = self.learned.setdefault(context.lineage, [])
                    seen = set(known)
                    known.extend(n for n in modules if n not in seen and len(known) < MAX_LEARNED)
            zygote = self._zygote(context)
            with zygote.lock:
                if not zygote.ready and not zygote.retired:
                    zygote._wait_ready()
                if modules and not zygote.retired:
                    P.send_message(zygote.sock, P.Warm(list(modules)))
            if packages:
                self._learn_packages(context, packages)
        except Exception as err:  # a later load retries and reports properly
            logger.warning("preparing a warm interpreter for context %s failed: %s", context.key, err)

    def run(self, key: str, context: Context, cwd: str, sys_path: list, blob: bytes, modules: list = (),
            fill: Fill | None = None, references: list = (), contents: dict | None = None
            ) -> tuple[P.JobResult, bytes, list[int]]:
        """Run one load; returns (result, skeleton, segment fds) or raises LoadFailure. ``fill``
        (from ``fills.begin``) sets its priority (Note [Cold fills yield to their caller] in
        overmind.fill_priority). ``references``: (registry Reply, segment fds) of the entries
        the call refers to, and ``contents`` the content index, handed to the loader (Note [The
        loader is handed its references] in overmind.cold_loads); the fds stay the caller's."""
        fill = fill or Fill(key, background=False)
        for attempt in (1, 2):
            try:
                zygote = self._zygote(context)
            except OSError as err:  # the interpreter cannot be executed at all
                raise LoadFailure(P.ErrorCode.LOADER_CRASHED,
                                  f"could not start a loader with {context.python}: {err}") from None
            try:
                job, pid = zygote.start_job(key, blob, list(modules), sys_path, cwd)
                break
            except (OSError, EOFError, P.ProtocolError, P.RemoteError, RunRefused) as err:
                logger.warning("warm interpreter %d could not start job %s: %s", zygote.proc.pid, key[:16], err)
                ended = "" if zygote.ready else zygote.exit_note()
                if zygote.ready:
                    self._retire(zygote, str(err))
                else:
                    self._discard(zygote)
                if attempt == 2:
                    raise LoadFailure(P.ErrorCode.LOADER_CRASHED,
                                      f"could not start a loader: {ended or f'{context.python}: {err}'}; "
                                      f"see {self.config.log_path}") from None
        self.fills.forked(fill, pid)
        answered = False
        try:
            deadline = time.monotonic() + self.config.loader_timeout
            try:
                job.settimeout(self.config.loader_timeout)  # a loader that stops reading is killed below
                for reply, fds in references:
                    P.send_message(job, P.Entry(reply.key, os.getpid(), reply.handles, reply.nbytes, True, reply.meta),
                                   reply.skeleton, fds=fds)
                index = {**(contents or {"keys": [], "handles": [], "regions": []}), "server_pid": os.getpid()}
                P.send_message(job, P.Contents(len(index["regions"])), json.dumps(index).encode())
                P.send_message(job, P.Ok())
                while True:
                    self.fills.wait_answer(job, fill, deadline)
                    job.settimeout(max(deadline - time.monotonic(), 0.001))
                    message, skeleton, fds = P.recv_message(job)
                    if not isinstance(message, P.FillProgress):
                        break
                    if fds or message.key != key or not 0 <= message.written <= 1 << 50 or \
                            not 0 <= message.expected <= 1 << 50 or not 0 <= message.original_seconds < 1e6:
                        P.close_fds(fds)
                        raise P.ProtocolError(f"malformed progress report {message!r}")
                    self.fills.progress(fill, message.written, message.expected, message.original_seconds)
            except socket.timeout:
                self._kill(pid)
                raise LoadFailure(P.ErrorCode.LOADER_TIMEOUT,
                                  f"loader pid {pid} exceeded OVERMIND_LOADER_TIMEOUT={self.config.loader_timeout:g}s "
                                  "and was killed") from None
            except (EOFError, P.ProtocolError, ConnectionResetError, BrokenPipeError) as err:
                self._kill(pid)
                raise LoadFailure(P.ErrorCode.LOADER_CRASHED,
                                  f"loader pid {pid} died before answering ({err}); a crash or a kill "
                                  f"(out of memory?); see {self.config.log_path}") from None
            if isinstance(message, P.JobResult):
                answered = True
                self._settle(job, pid)
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

    def _settle(self, job: socket.socket, pid: int) -> None:
        """A loader that answered may still rebuild its segments out of huge pages (Note [Huge
        pages for segments] in overmind.memfd); it is ``settling`` in the status until it exits
        (EOF on its job socket), so a benchmark can wait for the machine to be quiet."""
        with self.lock:
            self.settling += 1

        def wait_for_exit() -> None:
            try:
                job.settimeout(self.config.loader_timeout)
                while job.recv(4096):
                    pass  # a loader sends nothing more; whatever comes is dropped
            except OSError:
                pass
            finally:
                job.close()
                with self.lock:
                    self.settling -= 1

        threading.Thread(target=wait_for_exit, daemon=True, name=f"overmind-settle-{pid}").start()

    def fork_run(self, context: Context, spec: dict, fds: list[int]) -> int:
        """Fork a run from the context's ready interpreter; its pid, or RunRefused (and one is
        made ready for next time)."""
        base, context = context, self.with_reads(context, spec.get("env"))
        zygote = self._zygote(context, create=False)
        if zygote is None or not zygote.ready:
            if zygote is None:
                threading.Thread(target=self.prepare, args=(context,), daemon=True, name="overmind-prepare").start()
            raise RunRefused("no warm interpreter for this context yet; one is starting")
        try:
            return zygote.fork_run(spec, fds)
        except P.RemoteError as err:
            if err.code == P.ErrorCode.ENV_DIFFERS:  # it told us what its imports read: key on that now
                again = self.with_reads(base, spec.get("env"))
                if again.key != context.key:
                    threading.Thread(target=self.prepare, args=(again,), daemon=True, name="overmind-prepare").start()
                raise RunRefused(f"{err.message} (Note [Settings an import read]); an interpreter imported "
                                 "under this run's environment is starting") from None
            if err.code != P.ErrorCode.NOT_FORKABLE:
                raise RunRefused(err.message) from None
            self._retire(zygote, err.message)
            threading.Thread(target=self.prepare, args=(context,), daemon=True, name="overmind-prepare").start()
            raise RunRefused(f"the warm interpreter cannot fork ({err.message}); a fresh one is starting") from None
        except (OSError, EOFError, P.ProtocolError) as err:
            self._retire(zygote, str(err))
            raise RunRefused(f"the warm interpreter failed ({err})") from None

    def housekeeping(self) -> None:
        """Retire interpreters idle past OVERMIND_WARM_IDLE, then the least recently used while
        their memory exceeds OVERMIND_WARM_MEMORY."""
        now = time.time()
        with self.lock:
            zygotes = list(self.zygotes.values())
        for zygote in zygotes:
            if zygote.ready and now - zygote.last_used > self.config.warm_idle:
                self._retire(zygote, f"idle for {now - zygote.last_used:.0f}s")
        with self.lock:
            zygotes = list(self.zygotes.values())  # least recently used first
        sizes = {z.proc.pid: z.pss() for z in zygotes}
        total = sum(sizes.values())
        for zygote in zygotes[:-1]:  # the most recent one stays, whatever its size
            if total <= self.config.warm_memory:
                break
            total -= sizes[zygote.proc.pid]
            self._retire(zygote, "over OVERMIND_WARM_MEMORY")

    def _discard(self, zygote: Zygote) -> None:
        with self.lock:
            if self.zygotes.get(zygote.context.key) is zygote:
                del self.zygotes[zygote.context.key]
        zygote.kill()

    @staticmethod
    def _kill(pid: int) -> None:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def describe(self) -> list:
        now = time.time()
        with self.lock:
            zygotes = list(self.zygotes.items())
        return [{"pid": z.proc.pid, "context": k, "python": z.context.python, "ready": z.ready, "alive": z.alive,
                 "modules": z.modules or len(z.imported), "pss": z.pss(), "age": now - z.started,
                 "idle": now - z.last_used, "jobs": z.jobs, "runs": z.runs} for k, z in zygotes]

    def close(self) -> None:
        with self.lock:
            zygotes = list(self.zygotes.values())
            self.zygotes.clear()
        for zygote in zygotes:
            if zygote.ready:
                zygote.retire()
            else:
                zygote.kill()

