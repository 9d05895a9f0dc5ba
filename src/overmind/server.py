"""overmind-server: the daemon that owns the cache. Standard library only.

    overmind-server --foreground          # log to stderr and the runtime dir
    overmind-server --daemon              # detach; prints the readiness line, then returns
    python -m overmind.server

It listens on ``<runtime dir>/server.sock`` (a 0700 directory), checks every peer
with ``SO_PEERCRED``, keeps a registry of entries (sealed segment fds + skeleton),
and runs cold loads in loader processes (``overmind.loader``). It never imports
torch and never initialises CUDA: a CUDA context here would hold GPU memory for
the life of the daemon.

Note [Cold loads run behind the caller]
On a miss the server starts the load in a loader process and, unless the client
asked to wait (``OVERMIND_STRICT=1`` or ``OVERMIND_COLD=wait``), answers ``Pending``
at once: the client runs the original loader itself, exactly as without overmind,
while the loader fills the cache for every later call. A first load therefore
costs about a plain load, not a plain load plus a copy into shared memory. Loads
that wait, and loaders fetching ``vae=vae`` arguments (``lookup_only``), wait for
the flight instead. A failed load is remembered for ``FAILURE_TTL`` seconds.

Note [Server owns segment fds]
An entry's segments are the fds the loader sent over ``SCM_RIGHTS``; the server
holds them until eviction and closes them then. Clients open their own fds through
``/proc/<server pid>/fd/<n>`` (or receive duplicates), map ``MAP_PRIVATE`` and
close the fd at once, so eviction frees the pages when the last client unmaps
(DESIGN invariant 2). Nothing ever writes, punches or reuses a segment.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Optional

from overmind import __version__
from overmind import protocol as P
from overmind.config import Config, ConfigError, ensure_private_dir
from overmind.loader_pool import LoaderPool, LoadFailure, context_from_wire
from overmind.registry import CacheEntry, Registry, TooLarge, parse_size

logger = logging.getLogger("overmind.server")

__all__ = ["Server", "main"]

# A key whose load failed is not tried again for this long: every later request would
# otherwise pay a loader (and usually fail the same way).
FAILURE_TTL = 600.0

# A client's only blob is a pickled call (paths, configs, entry references): kilobytes. The
# protocol's MAX_BLOB is sized for skeletons; a client claiming that much must not make the
# server allocate it (Note [Frames are untrusted] in overmind.protocol).
MAX_REQUEST_BLOB = 64 << 20


class AlreadyRunning(ConfigError):
    """Another server owns this runtime dir (exit status EXIT_ALREADY_RUNNING)."""


EXIT_ALREADY_RUNNING = 75  # systemd: RestartPreventExitStatus=75


class Flight:
    def __init__(self) -> None:
        self.done = threading.Event()
        self.entry: Optional[CacheEntry] = None
        self.error: Optional[P.Error] = None


class Server:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.registry = Registry(config.max_memory)
        self.uid = os.getuid()
        self.started = time.time()
        self.stopping = threading.Event()
        self.listener: Optional[socket.socket] = None
        self.loaders = LoaderPool(config)
        self.load_slots = threading.BoundedSemaphore(config.workers)
        self.active = 0
        self.active_lock = threading.Lock()
        self.refused = 0

    # -- lifecycle: startup -> serve -> shutdown ------------------------------------

    def startup(self) -> None:
        ensure_private_dir(self.config.runtime_dir)
        path = self.config.socket_path
        # One server per runtime dir: held for the process's life, released by the kernel on death,
        # so a stale socket file can be replaced safely and shutdown never removes another's socket.
        self.instance_lock = open(self.config.runtime_dir / "server.instance.lock", "a")
        try:
            fcntl.flock(self.instance_lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.instance_lock.close()
            raise AlreadyRunning(f"another overmind-server is already running in {self.config.runtime_dir}") from None
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
            raise AlreadyRunning(f"another overmind-server is already listening on {path}")
        except (FileNotFoundError, ConnectionRefusedError):
            pass
        finally:
            probe.close()
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
        self.listener = listener
        self.config.pid_path.write_text(f"{os.getpid()}\n")

    def serve(self) -> None:
        assert self.listener is not None
        self.listener.settimeout(0.5)
        while not self.stopping.is_set():
            try:
                conn, _ = self.listener.accept()
            except socket.timeout:
                continue
            except OSError:
                if self.stopping.is_set():
                    break
                raise
            threading.Thread(target=self._handle, args=(conn,), daemon=True, name="overmind-conn").start()

    def shutdown(self, grace: float = 10.0) -> None:
        self.stopping.set()
        if self.listener is not None:
            try:
                self.listener.close()
            except OSError:
                pass
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            with self.active_lock:
                if self.active == 0:
                    break
            time.sleep(0.05)
        self.loaders.close()
        for key in self.registry.keys():
            self.registry.evict([key])
        for path in (self.config.socket_path, self.config.pid_path):
            try:
                if path == self.config.pid_path and path.read_text().strip() != str(os.getpid()):
                    continue
                path.unlink()
            except (FileNotFoundError, ValueError):
                pass
        logger.info("overmind-server stopped")

    # -- connections ---------------------------------------------------------------

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            try:
                pid, uid, _ = P.peer_credentials(conn)
            except OSError:
                return
            if uid != self.uid:
                self.refused += 1
                logger.warning("refused connection from pid %d uid %d (server uid %d)", pid, uid, self.uid)
                self._reply_error(conn, P.ErrorCode.PERMISSION_DENIED, "overmind-server serves only its own user")
                return
            conn.settimeout(60.0)
            try:
                hello, _, fds = P.recv_message(conn, max_blob=0)
                self._drop(fds)
                if not isinstance(hello, P.Hello):
                    raise P.ProtocolError(f"expected Hello, got {type(hello).__name__}")
                if hello.version != P.PROTOCOL_VERSION:
                    self._reply_error(conn, P.ErrorCode.VERSION_MISMATCH,
                                      f"client speaks protocol {hello.version}, server speaks {P.PROTOCOL_VERSION}")
                    return
                P.send_message(conn, P.Welcome(P.PROTOCOL_VERSION, os.getpid(), __version__, self.uid))
                conn.settimeout(None)
                while not self.stopping.is_set():
                    message, blob, fds = P.recv_message(conn, max_blob=MAX_REQUEST_BLOB)
                    self._drop(fds)  # clients never send fds
                    with self.active_lock:
                        self.active += 1
                    try:
                        self._dispatch(conn, message, blob, pid)
                    finally:
                        with self.active_lock:
                            self.active -= 1
            except EOFError:
                pass
            except P.VersionMismatch as err:
                logger.warning("closing connection from pid %d: %s", pid, err)
                self._reply_error(conn, P.ErrorCode.VERSION_MISMATCH, str(err))
            except (P.ProtocolError, socket.timeout) as err:
                logger.warning("closing connection from pid %d: %s", pid, err)
                self._reply_error(conn, P.ErrorCode.BAD_REQUEST, str(err))
            except (BrokenPipeError, ConnectionResetError):
                pass
            except Exception:  # never let one connection take the server down
                logger.exception("internal error serving pid %d", pid)

    @staticmethod
    def _drop(fds: list[int]) -> None:
        for fd in fds:
            os.close(fd)

    @staticmethod
    def _reply_error(conn: socket.socket, code: int, message: str, tb: str = "") -> None:
        try:
            P.send_message(conn, P.Error(code, message, tb))
        except OSError:
            pass

    def _dispatch(self, conn: socket.socket, message: P.Message, blob: bytes, pid: int) -> None:
        if isinstance(message, P.Load):
            self._load(conn, message, blob, pid)
        elif isinstance(message, P.GetFds):
            entry = self.registry.entries.get(message.key)
            if entry is None:
                return self._reply_error(conn, P.ErrorCode.NOT_FOUND, f"no entry {message.key}")
            live = [s for s in entry.slots if s is not None]
            P.send_message(conn, P.Fds(entry.key, [s[1] for s in live]), fds=[s[0] for s in live])
        elif isinstance(message, P.GetContents):
            index = self.registry.content_index()
            P.send_message(conn, P.Contents(len(index["regions"])), json.dumps(index).encode())
        elif isinstance(message, P.Status):
            P.send_message(conn, P.StatusReply(self.status()))
        elif isinstance(message, P.ListEntries):
            P.send_message(conn, P.EntryList(self.registry.summaries()))
        elif isinstance(message, P.Evict):
            keys = self.registry.keys() if message.all else self.registry.match(message.key) if message.key else []
            if not message.all and len(keys) > 1:
                return self._reply_error(conn, P.ErrorCode.BAD_REQUEST,
                                         f"{message.key!r} matches {len(keys)} entries; give more of the key")
            P.send_message(conn, P.Evicted(self.registry.evict(keys)))
        elif isinstance(message, P.Prepare):
            try:
                context = context_from_wire(message.context)
            except LoadFailure as failure:
                return self._reply_error(conn, failure.code, failure.message)
            threading.Thread(target=self.loaders.prepare, args=(context,), daemon=True,
                             name="overmind-prepare").start()
            P.send_message(conn, P.Ok())
        elif isinstance(message, P.Shutdown):
            P.send_message(conn, P.Ok())
            logger.info("shutdown requested by pid %d", pid)
            threading.Thread(target=lambda: os.kill(os.getpid(), signal.SIGTERM), daemon=True).start()
        else:
            raise P.ProtocolError(f"unexpected {type(message).__name__} from a client")

    def status(self) -> dict:
        with self.registry.lock:
            entries = list(self.registry.entries.values())
            info = {
                "pid": os.getpid(), "version": __version__, "uptime": time.time() - self.started,
                "entries": len(entries),
                "hits": self.registry.hits, "misses": self.registry.misses, "evictions": self.registry.evictions,
                "stale_misses": self.registry.stale, "budget": self.registry.budget,
                "loading": len(self.registry.flights), "refused_connections": self.refused,
                "socket": str(self.config.socket_path), "torch_imported": "torch" in sys.modules,
            }
        info["bytes"] = info["used"] = self.registry.used()
        info["loaders"] = self.loaders.describe()
        return info

    # -- loads ---------------------------------------------------------------------

    def _send_entry(self, conn: socket.socket, entry: CacheEntry, hit: bool) -> None:
        P.send_message(conn, P.Entry(entry.key, os.getpid(), [list(s) if s else None for s in entry.slots],
                                     entry.nbytes, hit, entry.meta), entry.skeleton)

    def _load(self, conn: socket.socket, request: P.Load, blob: bytes, pid: int) -> None:
        """Hit, or miss: see Note [Cold loads run behind the caller]."""
        entry = self.registry.get(request.key)
        if entry is not None:
            return self._send_entry(conn, entry, hit=True)
        with self.registry.lock:
            entry = self.registry.entries.get(request.key)
            flight = self.registry.flights.get(request.key) if entry is None else None
            failure = self.registry.failures.get(request.key)
            if failure is not None and time.monotonic() - failure[0] > FAILURE_TTL:
                del self.registry.failures[request.key]
                failure = None
            start = entry is None and flight is None and failure is None and not request.lookup_only
            if start:
                flight = self.registry.flights[request.key] = Flight()
                self.registry.misses += 1
        if entry is not None:
            return self._send_entry(conn, entry, hit=True)
        if flight is None:
            if request.lookup_only:
                return self._reply_error(conn, P.ErrorCode.NOT_FOUND, f"no entry {request.key}")
            assert failure is not None
            if request.wait:
                return P.send_message(conn, failure[1])
            return P.send_message(conn, P.Pending(request.key, False, failure[1].message))
        if start:
            threading.Thread(target=self._fly, args=(flight, request, blob, pid), daemon=True,
                             name="overmind-load").start()
        if not (request.wait or request.lookup_only):
            return P.send_message(conn, P.Pending(request.key, True, ""))
        if not flight.done.wait(self.config.loader_timeout + 60):
            return self._reply_error(conn, P.ErrorCode.LOADER_TIMEOUT, f"gave up waiting for {request.key}")
        if flight.entry is None:
            assert flight.error is not None
            return P.send_message(conn, flight.error)
        if not start:  # served by another request's load: a hit, so hits + misses = requests
            with self.registry.lock:
                self.registry.hits += 1
                flight.entry.hits += 1
        self._send_entry(conn, flight.entry, hit=not start)

    def _fly(self, flight: "Flight", request: P.Load, blob: bytes, pid: int) -> None:
        try:
            flight.entry = self._run_load(request, blob, pid)
        except LoadFailure as failure:
            flight.error = P.Error(failure.code, failure.message, failure.traceback)
        except Exception as err:  # pragma: no cover - reported, never fatal
            logger.exception("load of %s failed inside the server", request.key)
            flight.error = P.Error(P.ErrorCode.INTERNAL, f"server error: {err}")
        finally:
            with self.registry.lock:
                self.registry.flights.pop(request.key, None)
                if flight.error is not None:
                    self.registry.failures[request.key] = (time.monotonic(), flight.error)
                    logger.warning("load of %s failed: %s", request.key[:16], flight.error.message)
            flight.done.set()

    def _run_load(self, request: P.Load, blob: bytes, pid: int) -> CacheEntry:
        context = context_from_wire(request.context)
        started = time.monotonic()
        with self.load_slots:
            logger.info("miss %s: loading %s for pid %d", request.key[:16], request.description, pid)
            result, skeleton, fds = self.loaders.run(request.key, context, blob, self.config.socket_path,
                                                     request.modules)
        # The loader sends its new segments and, after them, those of other entries that hold some
        # of its storages already (Note [Stored once by content] in overmind.reductions).
        slots: list = [None] * result.nslots
        for fd, size, slot in zip(fds, result.sizes, result.slots):
            slots[slot] = [fd, size]
        meta = dict(result.meta, load_seconds=time.monotonic() - started)
        contents = meta.pop("contents", [])
        entry = CacheEntry(request.key, request.target, request.description, skeleton, slots, result.nbytes,
                           list(result.refs), meta, contents=contents if isinstance(contents, list) else [])
        try:
            evicted = self.registry.add(entry)
        except TooLarge as err:
            entry.close()
            logger.warning("not keeping %s (%s): %s; raise --max-memory to cache it", request.key[:16],
                           request.description, err)
            raise LoadFailure(P.ErrorCode.TOO_LARGE, f"not cached: {err}") from None
        for key in evicted:
            logger.info("evicted %s to stay within the %d-byte budget", key[:16], self.registry.budget)
        logger.info("cached %s: %d bytes in %.2fs", request.key[:16], result.nbytes, time.monotonic() - started)
        return entry


def _configure_logging(config: Config, foreground: bool) -> None:
    root = logging.getLogger("overmind")
    root.setLevel(config.log_level)
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s")
    handler = logging.FileHandler(config.log_path)
    handler.setFormatter(fmt)
    root.addHandler(handler)
    if foreground:
        stream = logging.StreamHandler(sys.stderr)
        stream.setFormatter(fmt)
        root.addHandler(stream)


def _install_signals(server: Server) -> None:
    def on_term(signum, frame):
        if server.stopping.is_set():
            logger.warning("second %s: exiting now", signal.Signals(signum).name)
            os._exit(1)
        logger.info("%s: shutting down (send it again to force)", signal.Signals(signum).name)
        server.stopping.set()

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)


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
    parser = argparse.ArgumentParser(prog="overmind-server", description="The overmind model cache daemon.")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--foreground", action="store_true", help="stay attached; log to stderr too (default)")
    mode.add_argument("--daemon", action="store_true", help="detach once ready")
    parser.add_argument("--runtime-dir", help="socket/log directory (default: OVERMIND_RUNTIME_DIR, "
                        "$XDG_RUNTIME_DIR/overmind, /tmp/overmind-<uid>)")
    parser.add_argument("--workers", type=int, help="loads that run at once for different keys")
    parser.add_argument("--max-memory", help="memory budget for cached models: 40G, 512M, 60%% (of RAM) or bytes; "
                        "default OVERMIND_MAX_MEMORY, else 50%% of RAM. Least recently used entries are evicted.")
    args = parser.parse_args(argv)
    env = dict(os.environ)
    if args.runtime_dir:
        env["OVERMIND_RUNTIME_DIR"] = args.runtime_dir
    if args.workers:
        env["OVERMIND_WORKERS"] = str(args.workers)
    if args.max_memory:
        env["OVERMIND_MAX_MEMORY"] = args.max_memory
    try:
        config = Config.from_env(env)
        ensure_private_dir(config.runtime_dir)
    except ConfigError as err:
        print(f"overmind-server: {err}", file=sys.stderr)
        return 2

    ready_read = ready_write = -1
    if args.daemon:
        ready_read, ready_write = os.pipe()
        pid = os.fork()
        if pid > 0:  # the launcher: wait for the daemon's readiness line, print it, return
            os.close(ready_write)
            with os.fdopen(ready_read) as pipe:
                line = pipe.read()
            if not line:
                print(f"overmind-server: failed to start; see {config.log_path}", file=sys.stderr)
                return 1
            print(line, end="", flush=True)
            return 0
        os.close(ready_read)
        _daemonize(ready_write)

    _configure_logging(config, foreground=not args.daemon)
    server = Server(config)
    try:
        server.startup()
    except (ConfigError, OSError) as err:
        logger.error("cannot start: %s", err)
        print(f"overmind-server: {err}", file=sys.stderr)
        return EXIT_ALREADY_RUNNING if isinstance(err, AlreadyRunning) else 1
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
