"""overmind-server: the daemon that owns the cache. Standard library only.

    overmind-server --foreground          # log to stderr and the runtime dir
    overmind-server --daemon              # detach; prints the readiness line, then returns
    python -m overmind.server

It listens on ``<runtime dir>/server.sock`` (a 0700 directory), checks every peer
with ``SO_PEERCRED``, keeps a registry of entries (sealed segment fds + skeleton),
and runs cold loads in loader processes (``overmind.warm.loader``). It never imports
torch and never initialises CUDA: a CUDA context here would hold GPU memory for
the life of the daemon.

Note [Server owns segment fds]
An entry's segments are the fds the loader sent over ``SCM_RIGHTS``; the server
holds them until eviction and closes them then. Clients open their own fds through
``/proc/<server pid>/fd/<n>`` (or receive duplicates), map ``MAP_PRIVATE`` and
close the fd at once, so eviction frees the pages when the last client unmaps
(ARCHITECTURE.md, invariant 2: Eviction is safe). Nothing ever writes, punches or reuses a segment.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from typing import Optional

from overmind import __version__
from overmind.shared import protocol as P
from overmind.shared.settings.config import (LOG_FORMAT, PREPARE_VARIABLE, Config, ConfigError, ensure_private_dir,
                                    lock_within, open_runtime_file, read_runtime_file, write_runtime_file)
from overmind.server.connections import Connections
from overmind.server.loads import MAX_KEY, MAX_TEXT, Loads, check_modules, check_request, reply_error
from overmind.server.options import parse as parse_options
from overmind.server.pool import WarmPool, LoadFailure, context_from_wire, run_from_wire
from overmind.server.pressure import Guard
from overmind.server.programs import ProgramHistory
from overmind.server.registry import Registry
from overmind.server.restore import Restore
from overmind.server.settle import Settler
from overmind.server.state import StateKeeper
from overmind.server.warm_process import RunRefused
from overmind.shared.calls.compiled import packages_from_wire
from overmind.shared.protocol.contexts import Context, environment_from_wire
from overmind.shared.protocol.connect import EXIT_ALREADY_RUNNING

logger = logging.getLogger("overmind.server.daemon")

__all__ = ["Server", "main"]

LOCK_WAIT = 2.0  # seconds a starting server waits for the lock of a server still exiting: Note [One server per runtime directory]
SOCKET_CHECK_INTERVAL = 0.5
HOUSEKEEPING_INTERVAL = 10.0  # warm interpreters: idle time and memory (WarmPool.housekeeping)

class AlreadyRunning(ConfigError):
    """Another server owns this runtime dir (exit status EXIT_ALREADY_RUNNING)."""




class Server:
    """The daemon: its parts, its lifecycle, the listening socket and what each request asks; the
    peers and their connections are its ``connections`` (overmind.server.connections)."""

    def __init__(self, config: Config, prepare_python: str = "") -> None:
        self.config = config
        self.registry = Registry(config.max_memory)
        self.started = time.time()
        self.stopping = threading.Event()
        self.listener: Optional[socket.socket] = None
        self.pool = WarmPool(config)
        # the peers, each connection's thread and its requests: Note [Every peer is bounded] in overmind.server.connections
        self.connections = Connections(self.stopping, self._request)
        self.socket_rebinds = self.runs = 0
        self.socket_id: Optional[tuple[int, int]] = None
        self.history = ProgramHistory()  # Note [Prefetch] in overmind.client.prefetch
        self.loads = Loads(config, self.registry, self.pool, self.history)
        # Note [The state file] in overmind.server.state; Note [Restore after a restart] in overmind.server.restore
        self.state = StateKeeper(config, self.registry, self.pool, self.history, self.loads.joins.plain_seconds_of)
        self.loads.on_cached = self.state.record
        self.restore = Restore(config, self.registry, self.loads, self.state, self.stopping)
        # Note [Settling file segments] in overmind.server.settle
        self.settler = Settler(self.registry, config.settle_after, self.stopping, config.keep_file_pages)
        self.prepare_python = prepare_python  # Note [The server a first run starts prepares its interpreter]
        self.guard = Guard(config, self.registry, self.pool, self.settler, self.restore, self.stopping)
        self.guard.holds_back(self.loads.fills)  # Note [The cache gives way] in overmind.server.pressure

    # -- lifecycle: startup -> serve -> shutdown ------------------------------------

    def startup(self) -> None:
        ensure_private_dir(self.config.runtime_dir)
        path = self.config.socket_path
        # Note [One server per runtime directory]
        # The instance lock is held for the process's life and released by the kernel on death,
        # so a stale socket file can be replaced safely, shutdown never removes another's socket,
        # and a client or the CLI can tell "a server runs here" even when its socket is gone.
        # The kernel releases it when the last of the process's threads is gone, which can be
        # after the process looks gone (its first thread a zombie while another still unmaps
        # gigabytes of segments): a server started right after `overmind shutdown` once found it
        # still held. So a starting server waits up to LOCK_WAIT for a lock whose holder no longer
        # accepts connections; one that serves is refused at once.
        fd = open_runtime_file(self.config.instance_lock_path)
        if not lock_within(fd, LOCK_WAIT, 0.05, give_up=lambda: _serving(str(path))):
            os.close(fd)
            raise AlreadyRunning(f"another overmind-server is already running in {self.config.runtime_dir}")
        self.instance_lock = fd
        if _serving(str(path)):
            raise AlreadyRunning(f"another overmind-server is already listening on {path}")
        self._bind()
        write_runtime_file(self.config.pid_path, f"{os.getpid()}\n")
        # Only now, holding the instance lock: one server per runtime directory, so one writer per state file.
        state = self.state.open(check_request, context_from_wire, check_modules)
        if self.prepare_python:  # after the state: the interpreter imports what its lineage learned
            self._prepare_first_run(self.prepare_python)
        threading.Thread(target=self.state.run, args=(self.stopping,), daemon=True, name="overmind-state").start()
        threading.Thread(target=self.settler.run, daemon=True, name="overmind-settle").start()
        threading.Thread(target=self.guard.run, daemon=True, name="overmind-memory").start()
        threading.Thread(target=self.pool.watch_notices, args=(self.stopping,), daemon=True, name="overmind-notices").start()
        self.restore.start(state)

    # Note [The server a first run starts prepares its interpreter]
    # An ``overmind run`` that finds no server starts one and runs plainly (Note [Never worse than
    # plain python] in overmind.frontend.run); the fills its loads start fork from the context's
    # warm interpreter, which imports what the run imports as the run reports it (Note [The first
    # run teaches] in overmind.client.teach). Started by that report, once this
    # server listened, the interpreter began 0.25-0.33 s after the run's first line and finished
    # the ControlNet script's imports 0.55-0.85 s after the run did (users' venv, 2 cores), so
    # the run's first fill waited that long for a fork and its run 2, started as run 1 exited,
    # loaded the pipeline plainly in about half the rounds; with a server already running (which
    # starts the interpreter on the run's refused Run), run 2 hit every load. So the front end
    # names the run's interpreter in PREPARE_VARIABLE, and this server starts the warm interpreter
    # of that context as it starts, under its own environment, which is the run's. From a thread,
    # as for a client's Prepare: spawning blocks the spawning thread's signals for a moment. The
    # interpreter now starts 0.10-0.16 s after the run's first line, and run 2 hit all 4 models in
    # 9 rounds of 12 (6 of ``overmind-bench --scenarios warmup_curve --curve-scripts controlnet
    # --curve-modes run --imports pandas``, 2 each of ``benchmarks/real_envs.sh users``,
    # ``many-cpus`` and ``minimal``); the lag left is the interpreter's own import of diffusers'
    # autoencoders (3 s of one import, which a fill's fork waits out), 0.3-0.8 s behind the run.
    def _prepare_first_run(self, python: str) -> None:
        env = dict(os.environ)
        try:
            context = Context.from_wire({"python": python, "env": env})
        except ValueError as err:  # its run goes on plainly; a later one asks again
            logger.warning("not starting a warm interpreter for %s=%s: %s", PREPARE_VARIABLE, python, err)
            return
        logger.info("starting the warm interpreter of the `overmind run` that started this server")
        self.pool.prepare_soon(context, env)

    def _bind(self) -> None:
        """Listen on a new socket file at the socket path (replacing whatever is there)."""
        old, (self.listener, self.socket_id) = self.listener, _listen(self.config.socket_path)
        if old is not None:
            old.close()

    def _check_socket(self) -> None:
        """Note [A lost socket is replaced]: someone deleted or replaced our socket file (a tmp
        cleaner, a careless ``rm``). Unreachable, we would hold the cache while every client
        loads plainly and tries to start another server; so we bind a new one."""
        try:
            st = os.lstat(self.config.socket_path)
            if (st.st_dev, st.st_ino) == self.socket_id:
                return
        except FileNotFoundError:
            pass
        except OSError as err:
            logger.warning("cannot check %s: %s", self.config.socket_path, err)
            return
        logger.warning("socket %s was removed or replaced; listening on a new one", self.config.socket_path)
        try:
            self._bind()
            self.socket_rebinds += 1
        except OSError as err:
            logger.error("cannot listen on %s again: %s", self.config.socket_path, err)

    def serve(self) -> None:
        assert self.listener is not None
        last_check = last_housekeeping = time.monotonic()
        while not self.stopping.is_set():
            if time.monotonic() - last_check >= SOCKET_CHECK_INTERVAL:
                last_check = time.monotonic()
                self._check_socket()
                if time.monotonic() - last_housekeeping >= HOUSEKEEPING_INTERVAL:
                    last_housekeeping = time.monotonic()
                    threading.Thread(target=self.pool.housekeeping, daemon=True, name="overmind-housekeeping").start()
            try:
                conn, _ = self.listener.accept()
            except socket.timeout:
                continue
            except OSError:
                if self.stopping.is_set():
                    break
                raise
            self.connections.accept(conn)

    def shutdown(self, grace: float = 10.0) -> None:
        self.stopping.set()
        if self.listener is not None:
            try:
                self.listener.close()
            except OSError:
                pass
        self.connections.wait_idle(grace)
        self.state.save_if_changed()  # Note [Atomic, rate-limited saves] in overmind.server.state
        self.state.close()
        self.pool.close()
        self.registry.clear()
        try:
            st = os.lstat(self.config.socket_path)
            if (st.st_dev, st.st_ino) == self.socket_id:
                self.config.socket_path.unlink()
        except FileNotFoundError:
            pass
        if read_runtime_file(self.config.pid_path).strip() == str(os.getpid()):
            try:
                self.config.pid_path.unlink()
            except FileNotFoundError:
                pass
        logger.info("overmind-server stopped")

    # -- requests --------------------------------------------------------------------

    def _request(self, conn: socket.socket, message: P.Message, blob: bytes, fds: list[int], pid: int) -> bool:
        """One request of a connection (overmind.server.connections); True once the connection is
        handed over (a run's, to a warm interpreter)."""
        if not isinstance(message, (P.Status, P.ListEntries)):  # looking on is no use of the machine
            self.settler.touch()
        if isinstance(message, P.Run):
            return self._run(conn, message, fds, pid)
        self._dispatch(conn, message, blob, pid)
        return False

    def _dispatch(self, conn: socket.socket, message: P.Message, blob: bytes, pid: int) -> None:
        if isinstance(message, P.Load):
            self.loads.load(conn, message, blob, pid)
        elif isinstance(message, P.GetFds):
            self.loads.send_fds(conn, message)
        elif isinstance(message, P.Status):
            P.send_message(conn, P.StatusReply(self.status()))
        elif isinstance(message, P.ListEntries):
            entries = self.registry.summaries()
            P.send_message(conn, P.EntryList(len(entries)), json.dumps(entries).encode())
        elif isinstance(message, P.Evict):
            keys = self.registry.keys() if message.all else self.registry.match(message.key) if message.key else []
            if not message.all and len(keys) > 1:
                return reply_error(conn, P.ErrorCode.BAD_REQUEST,
                                         f"{message.key!r} matches {len(keys)} entries; give more of the key")
            P.send_message(conn, P.Evicted(self.registry.evict(keys)))
        elif isinstance(message, P.Prepare):
            try:
                context, _, _ = context_from_wire(message.context)
                modules = check_modules(message.modules)
                env = environment_from_wire(message.env) if message.env else None
            except LoadFailure as failure:
                return reply_error(conn, failure.code, failure.message)
            except ValueError as err:
                return reply_error(conn, P.ErrorCode.BAD_REQUEST, str(err))
            packages = packages_from_wire(message.packages)  # Note [AOTInductor packages are handed over]
            if message.plain:  # Note [When a warm start applies] in overmind.client.warm_start
                self.pool.goes_plain(context, pid, message.plain[:MAX_TEXT])
            program = message.program if isinstance(message.program, str) and len(message.program) <= MAX_KEY \
                and message.program.isalnum() else ""  # Note [A run's child is forked ahead] in overmind.warm.children
            threading.Thread(target=self.pool.prepare, args=(context, modules, packages, env, program), daemon=True,
                             name="overmind-prepare").start()
            P.send_message(conn, P.Ok())
        elif isinstance(message, P.PlainLoaded):  # no answer: the client does not wait for one
            self.loads.plain_loaded(message)
        elif isinstance(message, P.Prefetch):
            handed = self.loads.prefetch(conn, message, pid)
            if message.rehearsal is not True:  # Note [A run's child is forked ahead] in overmind.warm.children
                self.settler.handed_to_prefetch(handed, message.importing)
        elif isinstance(message, P.Shutdown):
            P.send_message(conn, P.Ok())
            logger.info("shutdown requested by pid %d", pid)
            self.stopping.set()  # not a signal to ourselves: one we inherited blocked would never arrive
        else:
            raise P.ProtocolError(f"unexpected {type(message).__name__} from a client")

    def _run(self, conn: socket.socket, message: P.Run, fds: list[int], pid: int) -> bool:
        """``overmind run``: hand the connection and the caller's stdio to a warm interpreter.
        True once handed over; else the front end got RunRefused and runs plainly."""
        context = None
        try:
            if len(fds) != 3:
                raise RunRefused(f"a run brings its stdin, stdout and stderr, not {len(fds)} fds")
            context, spec = run_from_wire(message.context, message.spec)
            child = self.pool.fork_run(context, spec, [*fds, conn.fileno()])
        except (RunRefused, LoadFailure) as why:
            reason = why.message if isinstance(why, LoadFailure) else str(why)
            self.pool.goes_plain(context, pid, reason)
            P.send_message(conn, P.RunRefused(reason[:MAX_TEXT]))
            return False
        finally:
            P.close_fds(fds)
        self.runs += 1
        logger.info("run for pid %d forked as pid %d", pid, child)
        return True

    def status(self) -> dict:
        info = {"pid": os.getpid(), "version": __version__, "uptime": time.time() - self.started,
                **self.loads.counters(), **self.connections.counters(),  # Note [Joining a fill] in overmind.server.joins
                "socket": str(self.config.socket_path), "socket_rebinds": self.socket_rebinds, "runs": self.runs,
                "runs_plain": self.pool.runs_plain, "torch_imported": "torch" in sys.modules}
        info["bytes"] = info["used"] = self.registry.used()
        info["interpreters"] = self.pool.describe()
        info["warm_retired"] = self.pool.interpreters.retired
        info["loaders_exiting"] = self.loads.loaders.exiting()  # Note [Huge pages for segments] in overmind.shared.segments.memfd
        info["packing"] = self.loads.fills.packing()  # Note [Joining a fill] in overmind.server.joins
        info.update(self.registry.counters())  # after the fills': one no longer "loading" has its entry counted
        info["file_segments"] = {"bytes": self.registry.file_bytes(), **self.settler.describe()}  # Note [Settling file segments]
        info["memory"] = self.guard.describe()  # Note [The cache gives way] in overmind.server.pressure
        info["restore"] = self.restore.describe()  # Note [Restore after a restart] in overmind.server.restore
        info["ready"] = info["restore"]["ready"]
        info["state"] = self.state.describe()
        return info

def _listen(path) -> tuple[socket.socket, tuple[int, int]]:
    """A listening socket at ``path`` (a stale socket, or a planted file or link there is removed,
    never followed), 0600, and its file's identity (st_dev, st_ino)."""
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)  # the socket file itself is 0600 too
    try:
        listener.bind(str(path))
    finally:
        os.umask(old_umask)
    listener.listen(128)
    listener.settimeout(SOCKET_CHECK_INTERVAL)
    st = os.lstat(path)
    return listener, (st.st_dev, st.st_ino)


def _configure_logging(level: str, log_fd: int, foreground: bool) -> None:
    """``level`` is one of overmind.shared.settings.config.LOG_LEVELS, checked by Config.from_env."""
    root = logging.getLogger("overmind")
    root.setLevel(level)
    fmt = logging.Formatter(LOG_FORMAT)
    handler = logging.StreamHandler(os.fdopen(log_fd, "a", buffering=1))
    handler.setFormatter(fmt)
    root.addHandler(handler)
    if foreground:
        stream = logging.StreamHandler(sys.stderr)
        stream.setFormatter(fmt)
        root.addHandler(stream)


def _refuse_to_start(err: ConfigError, log_fd: int) -> None:
    """A bad setting or runtime directory: say so on stderr (whoever started us reads it: a
    client that autostarts us, a unit's journal) and in the log when it could be opened (where
    clients point), then exit: Note [A bad setting never stops a script] in overmind.shared.settings.config."""
    print(f"overmind-server: not starting: {err}", file=sys.stderr)
    if log_fd >= 0:
        _configure_logging("INFO", log_fd, foreground=False)
        logger.error("not starting: %s", err)


def _limit_malloc_arenas() -> None:
    """Note [Few malloc arenas]: glibc gives each busy thread an arena of its own and keeps
    what it freed there, so a burst of connection threads (Note [Every peer is bounded] in
    overmind.server.connections) leaves tens of MiB behind for good. The server's threads mostly
    wait on sockets; two arenas serve them as fast. A no-op where mallopt is missing (musl)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        libc.mallopt(-8, 2)  # M_ARENA_MAX
    except (OSError, AttributeError):
        pass


def _clean_signals() -> None:
    """Note [A server's signals are its own]
    A server is started by whoever came first: a shell, systemd, or a client that autostarted it
    from inside a warm start, whose signal mask blocked HUP, INT, TERM and more while it handed
    its run over. A process inherits the mask and ignored signals across exec, so such a server
    could not be stopped by SIGTERM (kill, systemctl stop). It starts with an empty mask and the
    default disposition of every signal its starter ignored; its warm interpreters inherit that."""
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    for number in signal.valid_signals():
        if number in (signal.SIGKILL, signal.SIGSTOP, signal.SIGPIPE):  # SIGPIPE: Python ignores it itself
            continue
        try:
            if signal.getsignal(number) is signal.SIG_IGN:
                signal.signal(number, signal.SIG_DFL)
        except (OSError, ValueError):
            pass


def _install_signals(server: Server) -> None:
    def on_term(signum, frame):
        if server.stopping.is_set():
            logger.warning("second %s: exiting now", signal.Signals(signum).name)
            os._exit(1)
        logger.info("%s: shutting down (send it again to force)", signal.Signals(signum).name)
        server.stopping.set()

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)


def _serving(path: str) -> bool:
    """Does a server accept connections on ``path``? (Other errors than none there are raised.)"""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
        return True
    except (FileNotFoundError, ConnectionRefusedError):
        return False
    finally:
        probe.close()


def _daemonize(ready_write: int) -> None:
    """Double fork; the grandchild keeps ``ready_write`` to report readiness."""
    if os.fork() > 0:
        os._exit(0)
    os.setsid()
    if os.fork() > 0:
        os._exit(0)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    os.close(devnull)


def main(argv: Optional[list[str]] = None) -> int:
    prepare = os.environ.pop(PREPARE_VARIABLE, "")  # never inherited by an interpreter, a loader or a run
    args, env = parse_options(argv)  # each flag in its OVERMIND_* variable's place (overmind.server.options)
    _clean_signals()  # Note [A server's signals are its own]
    from overmind.shared.settings.config import default_runtime_dir

    paths = Config(default_runtime_dir(env))  # the runtime dir and log, before the settings are read
    log_fd = -1
    notes: list[str] = []  # bad yes/no values: logged once logging is set up
    try:
        ensure_private_dir(paths.runtime_dir)
        # Note [Runtime files are opened, never followed] in overmind.shared.settings.config; opened before
        # detaching, so a refusal reaches the one who started us.
        log_fd = open_runtime_file(paths.log_path, os.O_WRONLY | os.O_APPEND)
        config = Config.from_env(env, notes=notes)
    except ConfigError as err:
        _refuse_to_start(err, log_fd)
        return 2

    ready_read = ready_write = -1
    if args.daemon:
        ready_read, ready_write = os.pipe()
        pid = os.fork()
        if pid > 0:  # the launcher: wait for the daemon's readiness line, print it, return
            os.close(ready_write)
            with os.fdopen(ready_read) as pipe:
                line = pipe.read()
            if line.startswith("error "):  # "error <exit status> <message>" from the daemon
                _, status, message = line.rstrip("\n").split(" ", 2)
                print(f"overmind-server: {message}", file=sys.stderr)
                return int(status)
            if not line:
                print(f"overmind-server: failed to start; see {config.log_path}", file=sys.stderr)
                return 1
            print(line, end="", flush=True)
            return 0
        os.close(ready_read)
        _daemonize(ready_write)

    _configure_logging(config.log_level, log_fd, foreground=not args.daemon)
    for note in notes:
        logger.warning("%s", note)
    _limit_malloc_arenas()
    server = Server(config, prepare)
    try:
        server.startup()
    except (ConfigError, OSError) as err:
        if isinstance(err, AlreadyRunning):  # a lost race between two starters: nothing went wrong
            logger.info("not starting: %s", err)
        else:
            logger.error("cannot start: %s", err)
        status = EXIT_ALREADY_RUNNING if isinstance(err, AlreadyRunning) else 1
        if ready_write >= 0:
            os.write(ready_write, f"error {status} {err}\n".encode())
        else:
            print(f"overmind-server: {err}", file=sys.stderr)
        return status
    _install_signals(server)
    line = f"overmind-server ready: pid {os.getpid()}, socket {config.socket_path}, version {__version__}\n"
    logger.info(line.strip())
    if ready_write >= 0:
        os.write(ready_write, line.encode())
        os.close(ready_write)
    else:
        print(line, end="", flush=True)
    try:
        server.serve()
    finally:
        server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
