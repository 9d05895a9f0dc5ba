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
from collections import OrderedDict
from typing import Optional

from overmind import __version__
from overmind import protocol as P
from overmind.config import (Config, ConfigError, ensure_private_dir, open_runtime_file, read_runtime_file,
                             write_runtime_file)
from overmind.fill_priority import Fill
from overmind.loader_pool import LoaderPool, LoadFailure, RunRefused, context_from_wire, run_from_wire
from overmind.programs import ProgramHistory
from overmind.registry import CacheEntry, Flight, Registry, Reply, TooLarge

logger = logging.getLogger("overmind.server")

__all__ = ["Server", "main"]

# A client's only blob is a pickled call (paths, configs, entry references): kilobytes. The
# protocol's MAX_BLOB is sized for skeletons; a client claiming that much must not make the
# server allocate it (Note [Frames are untrusted] in overmind.protocol).
MAX_REQUEST_BLOB = 64 << 20

# Note [Every peer is bounded]
# A peer of our own uid can still be buggy or hostile; none may make the server grow
# without bound or stop serving others. Connections are capped (past the cap a new one gets
# BUSY and is closed); the handshake must arrive within HANDSHAKE_TIMEOUT; a frame, once
# started, must be complete within FRAME_TIMEOUT and its blob is allocated as its bytes
# arrive; a connection idle for IDLE_TIMEOUT is closed (clients reconnect transparently);
# request fields are bounded (keys, descriptions, lists); loads in flight are capped by the
# registry, and remembered failures are few and short (Note [Only deterministic failures are
# remembered] in overmind.registry).
MAX_CONNECTIONS = 256
HANDSHAKE_TIMEOUT = 5.0
FRAME_TIMEOUT = 30.0
IDLE_TIMEOUT = 600.0
MAX_KEY = 64  # keys are xxh3-128 hex digests (overmind.calls): 32 characters
MAX_TEXT = 1000
MAX_LIST = 256
SOCKET_CHECK_INTERVAL = 0.5
HOUSEKEEPING_INTERVAL = 10.0  # warm interpreters: idle time and memory (LoaderPool.housekeeping)
MAX_MODULES = 20000  # module names one Prepare may teach (a big script imports ~4000)
MAX_PLAIN_SECONDS = 1024  # keys whose plain load time we remember
PEER_ROLES = ("client", "cli", "run")  # what Hello.role says; a loader never connects (Note [The loader is handed its references])

# Note [The loader is handed its references]
# A call may pass objects that came from the cache (``vae=vae``, ``controlnet=[a, b]``): the
# client sends their keys (``Load.refs``) and the loader must rebuild the same objects. Before
# the loader starts (and before it takes a load slot), the server waits for those entries to be
# cached (a fill still running lends it our priority: FillPriorities.depends), then hands them
# to the loader on its job socket, each an ``Entry`` with its skeleton and the fds of its
# segments, the entries they refer to in turn included, then the content index (``Contents``,
# Note [Content index] in overmind.registry) and ``Ok``. So a loader never calls the server
# back: the server never waits on a loader that waits on the server, and the loader imports
# nothing of the client side (tests/unit/test_layers.py).

# Note [Joining a fill]
# A caller that finds its key filling (run 2 of a script, started while run 1's fill still
# runs) either loads plainly or waits for the fill, lending it normal priority. It waits when
# the fill should end sooner than a plain load would. A plain load's seconds: what the last
# caller that loaded plainly reported (PlainLoaded), or what the loader's own call of the
# original took if less. The first caller's figure includes the imports its load did
# (transformers imports the model's module inside from_pretrained: 1.55 s for the LM's load
# in a fresh process, 0.1-0.3 s in a loader or an `overmind run` child, which imported it
# already); a hit pays those imports too, when it unpickles, so they are no reason to wait.
# The loader, once it packs, reports the bytes in place and the bytes it expects every 0.1 s
# (FillProgress, Note [Progress of a pack] in overmind.loader), so the fill's remaining
# seconds are the bytes left at its rate since the pack began (a rate at idle priority:
# lifted, it goes faster). A fill still running the original, or one that
# reports nothing (small, or a result whose bytes cannot be counted), is not joined: nothing
# says it is close. The wait is bounded by the plain load's seconds: past them the caller loads
# plainly after all, so a wrong guess costs at most one extra plain load's time, and a fill
# nobody joins still ends within its own bounds.
#
# What this cannot fix, measured on this machine (benchmarks/fresh_memory.py): a fill writes
# its result into memory the kernel must hand out fresh, and on a guest that reports free
# memory back to its host (virtio-balloon free page reporting) fresh memory past the last
# 1.5-3.5 GB freed is filled at 0.4 GB/s instead of 2.4 GB/s, so the seed's 1.97 GB pipeline
# takes 3-5 s to fill, longer than its 0.5 s plain load, and a run that comes sooner loads it
# plainly.


class AlreadyRunning(ConfigError):
    """Another server owns this runtime dir (exit status EXIT_ALREADY_RUNNING)."""


EXIT_ALREADY_RUNNING = 75  # systemd: RestartPreventExitStatus=75


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
        self.active = 0  # requests being served
        self.connections = 0  # connection threads alive: Note [Every peer is bounded]
        self.peers: dict[str, int] = {}  # handshakes by the role the peer gave (one of PEER_ROLES, or "other")
        self.active_lock = threading.Lock()
        self.refused = 0
        self.busy_refusals = 0
        self.socket_id: Optional[tuple[int, int]] = None
        self.socket_rebinds = 0
        self.runs = 0
        self.history = ProgramHistory()  # Note [Prefetch] in overmind.prefetch
        self.plain_seconds: "OrderedDict[str, float]" = OrderedDict()  # Note [Joining a fill]
        self.joined = 0
        self.not_cacheable = 0  # calls told their result cannot be rebuilt: Note [Results that cannot be rebuilt]

    # -- lifecycle: startup -> serve -> shutdown ------------------------------------

    def startup(self) -> None:
        ensure_private_dir(self.config.runtime_dir)
        path = self.config.socket_path
        # Note [One server per runtime directory]
        # The instance lock is held for the process's life and released by the kernel on death,
        # so a stale socket file can be replaced safely, shutdown never removes another's socket,
        # and a client or the CLI can tell "a server runs here" even when its socket is gone.
        fd = open_runtime_file(self.config.instance_lock_path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise AlreadyRunning(f"another overmind-server is already running in {self.config.runtime_dir}") from None
        self.instance_lock = fd
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
            raise AlreadyRunning(f"another overmind-server is already listening on {path}")
        except (FileNotFoundError, ConnectionRefusedError):
            pass
        finally:
            probe.close()
        self._bind()
        write_runtime_file(self.config.pid_path, f"{os.getpid()}\n")

    def _bind(self) -> None:
        """Listen on a new socket file at the socket path (replacing whatever is there)."""
        path = self.config.socket_path
        try:
            path.unlink()  # a stale socket, or a planted file or link: removed, never followed
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
        old, self.listener, self.socket_id = self.listener, listener, (st.st_dev, st.st_ino)
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
                    threading.Thread(target=self.loaders.housekeeping, daemon=True, name="overmind-housekeeping").start()
            try:
                conn, _ = self.listener.accept()
            except socket.timeout:
                continue
            except OSError:
                if self.stopping.is_set():
                    break
                raise
            with self.active_lock:
                admitted = self.connections < MAX_CONNECTIONS
                if admitted:
                    self.connections += 1
                else:
                    self.busy_refusals += 1
            if not admitted:
                with conn:
                    conn.settimeout(1.0)
                    self._reply_error(conn, P.ErrorCode.BUSY, f"more than {MAX_CONNECTIONS} connections")
                continue
            try:
                threading.Thread(target=self._handle, args=(conn,), daemon=True, name="overmind-conn").start()
            except RuntimeError:  # cannot start a thread: out of resources; this peer goes unserved
                conn.close()
                with self.active_lock:
                    self.connections -= 1

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

    # -- connections ---------------------------------------------------------------

    def _handle(self, conn: socket.socket) -> None:
        try:
            self._serve_connection(conn)
        finally:
            with self.active_lock:
                self.connections -= 1

    def _serve_connection(self, conn: socket.socket) -> None:
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
            conn.settimeout(HANDSHAKE_TIMEOUT)  # Note [Every peer is bounded]
            try:
                hello, _, fds = P.recv_message(conn, max_blob=0, frame_timeout=HANDSHAKE_TIMEOUT)
                self._drop(fds)
                if not isinstance(hello, P.Hello):
                    raise P.ProtocolError(f"expected Hello, got {type(hello).__name__}")
                role = hello.role if hello.role in PEER_ROLES else "other"
                with self.active_lock:
                    self.peers[role] = self.peers.get(role, 0) + 1
                if hello.version != P.PROTOCOL_VERSION:
                    self._reply_error(conn, P.ErrorCode.VERSION_MISMATCH,
                                      f"client speaks protocol {hello.version}, server speaks {P.PROTOCOL_VERSION}")
                    return
                P.send_message(conn, P.Welcome(P.PROTOCOL_VERSION, os.getpid(), __version__, self.uid))
                while not self.stopping.is_set():
                    conn.settimeout(IDLE_TIMEOUT)
                    try:
                        message, blob, fds = P.recv_message(conn, max_blob=MAX_REQUEST_BLOB,
                                                            frame_timeout=FRAME_TIMEOUT)
                    except socket.timeout:
                        return  # idle: the client reconnects when it needs us again
                    if not isinstance(message, P.Run):
                        self._drop(fds)  # only a run brings fds: its stdio
                        fds = []
                    conn.settimeout(FRAME_TIMEOUT)  # replies to a peer that stopped reading give up too
                    with self.active_lock:
                        self.active += 1
                    try:
                        if isinstance(message, P.Run):
                            if self._run(conn, message, fds, pid):
                                return  # the warm interpreter has the connection now
                        else:
                            self._dispatch(conn, message, blob, pid)
                    finally:
                        del blob
                        with self.active_lock:
                            self.active -= 1
            except EOFError:
                pass
            except P.VersionMismatch as err:
                logger.warning("closing connection from pid %d: %s", pid, err)
                self._reply_error(conn, P.ErrorCode.VERSION_MISMATCH, str(err))
            except (P.ProtocolError, socket.timeout) as err:
                logger.warning("closing connection from pid %d: %s", pid, str(err)[:300])
                self._reply_error(conn, P.ErrorCode.BAD_REQUEST, str(err)[:MAX_TEXT])
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
            found = self.registry.segment_fds(message.key)
            if found is None:
                return self._reply_error(conn, P.ErrorCode.NOT_FOUND, f"no entry {message.key[:MAX_KEY]}")
            sizes, fds = found
            try:
                P.send_message(conn, P.Fds(message.key, sizes), fds=fds)
            finally:
                self._drop(fds)
        elif isinstance(message, P.GetContents):
            index = self.registry.content_index()
            P.send_message(conn, P.Contents(len(index["regions"])), json.dumps(index).encode())
        elif isinstance(message, P.Status):
            P.send_message(conn, P.StatusReply(self.status()))
        elif isinstance(message, P.ListEntries):
            entries = self.registry.summaries()
            P.send_message(conn, P.EntryList(len(entries)), json.dumps(entries).encode())
        elif isinstance(message, P.Evict):
            keys = self.registry.keys() if message.all else self.registry.match(message.key) if message.key else []
            if not message.all and len(keys) > 1:
                return self._reply_error(conn, P.ErrorCode.BAD_REQUEST,
                                         f"{message.key!r} matches {len(keys)} entries; give more of the key")
            P.send_message(conn, P.Evicted(self.registry.evict(keys)))
        elif isinstance(message, P.Prepare):
            try:
                context, _, _ = context_from_wire(message.context)
                modules = self._check_modules(message.modules)
            except LoadFailure as failure:
                return self._reply_error(conn, failure.code, failure.message)
            threading.Thread(target=self.loaders.prepare, args=(context, modules), daemon=True,
                             name="overmind-prepare").start()
            P.send_message(conn, P.Ok())
        elif isinstance(message, P.PlainLoaded):  # no answer: the client does not wait for one
            if isinstance(message.key, str) and len(message.key) <= MAX_KEY and 0 <= message.seconds < 1e6:
                self.plain_seconds.pop(message.key, None)
                self.plain_seconds[message.key] = float(message.seconds)
                self.loaders.fills.caller_loaded(message.key)  # Note [Cold fills wait for their caller]
                while len(self.plain_seconds) > MAX_PLAIN_SECONDS:
                    self.plain_seconds.popitem(last=False)
        elif isinstance(message, P.Prefetch):
            if not isinstance(message.program, str) or len(message.program) > MAX_KEY:
                return self._reply_error(conn, P.ErrorCode.BAD_REQUEST, "malformed program")
            entries = []
            for key in self.history.last(message.program, pid):
                handles = self.registry.peek(key)
                if handles is not None:
                    entries.append([key, handles])
            P.send_message(conn, P.PrefetchReply(os.getpid(), entries))
        elif isinstance(message, P.Shutdown):
            P.send_message(conn, P.Ok())
            logger.info("shutdown requested by pid %d", pid)
            threading.Thread(target=lambda: os.kill(os.getpid(), signal.SIGTERM), daemon=True).start()
        else:
            raise P.ProtocolError(f"unexpected {type(message).__name__} from a client")

    def _run(self, conn: socket.socket, message: P.Run, fds: list[int], pid: int) -> bool:
        """``overmind run``: hand the connection and the caller's stdio to a warm interpreter.
        True once handed over; else the front end got RunRefused and runs plainly."""
        try:
            if len(fds) != 3:
                raise RunRefused(f"a run brings its stdin, stdout and stderr, not {len(fds)} fds")
            context, spec = run_from_wire(message.context, message.spec)
            child = self.loaders.fork_run(context, spec, [*fds, conn.fileno()])
        except (RunRefused, LoadFailure) as why:
            reason = why.message if isinstance(why, LoadFailure) else str(why)
            logger.info("run for pid %d goes plain: %s", pid, reason)
            P.send_message(conn, P.RunRefused(reason[:MAX_TEXT]))
            return False
        finally:
            self._drop(fds)
        self.runs += 1
        logger.info("run for pid %d forked as pid %d", pid, child)
        return True

    def status(self) -> dict:
        info = {"pid": os.getpid(), "version": __version__, "uptime": time.time() - self.started,
                **self.registry.counters(), "refused_connections": self.refused,
                "busy_refusals": self.busy_refusals, "connections": self.connections, "peers": dict(self.peers),
                "socket": str(self.config.socket_path), "socket_rebinds": self.socket_rebinds, "runs": self.runs,
                "torch_imported": "torch" in sys.modules}
        info["bytes"] = info["used"] = self.registry.used()
        info["loaders"] = self.loaders.describe()
        info["settling"] = self.loaders.settling  # Note [Huge pages for segments] in overmind.memfd
        info["joined"] = self.joined  # Note [Joining a fill]
        info["not_cacheable"] = self.not_cacheable
        return info

    # -- loads ---------------------------------------------------------------------

    @staticmethod
    def _send_entry(conn: socket.socket, reply: Reply, hit: bool) -> None:
        P.send_message(conn, P.Entry(reply.key, os.getpid(), reply.handles, reply.nbytes, hit, reply.meta),
                       reply.skeleton)

    @staticmethod
    def _check_load(request: P.Load) -> None:
        """Note [Every peer is bounded]: refuse what no client of ours sends."""
        keys = [request.key, *request.refs]
        if not all(isinstance(k, str) and 0 < len(k) <= MAX_KEY and k.isalnum() and k.isascii() for k in keys):
            raise LoadFailure(P.ErrorCode.BAD_REQUEST, f"malformed key (at most {MAX_KEY} letters and digits)")
        if len(request.refs) > MAX_LIST or len(request.modules) > MAX_LIST:
            raise LoadFailure(P.ErrorCode.BAD_REQUEST, f"more than {MAX_LIST} references or modules")
        if not all(isinstance(m, str) and len(m) <= MAX_TEXT for m in request.modules):
            raise LoadFailure(P.ErrorCode.BAD_REQUEST, "modules must be names")
        if len(request.target) > MAX_TEXT or len(request.description) > MAX_TEXT:
            raise LoadFailure(P.ErrorCode.BAD_REQUEST, f"target or description over {MAX_TEXT} characters")
        if not request.lookup_only:
            context_from_wire(request.context)

    @staticmethod
    def _check_modules(modules) -> list:
        if not isinstance(modules, list) or len(modules) > MAX_MODULES or \
                not all(isinstance(m, str) and 0 < len(m) <= MAX_TEXT for m in modules):
            raise LoadFailure(P.ErrorCode.BAD_REQUEST, f"modules must be at most {MAX_MODULES} names")
        return modules

    def _joins(self, request: P.Load, pid: int) -> float:
        """Note [Joining a fill]: how long a caller that found ``request.key`` filling should
        wait for it rather than load plainly; 0: not at all."""
        plain = self.plain_seconds.get(request.key)
        if request.wait or request.lookup_only or plain is None:
            return 0.0
        progress = self.loaders.fills.remaining(request.key)
        if progress is None:
            logger.info("pid %d loads %s plainly: its fill has not begun to pack", pid, request.key[:16])
            return 0.0
        left, fill = progress
        if fill.original_seconds:  # the imports the first caller's load did are done here too
            plain = min(plain, fill.original_seconds)
        joins = left <= plain
        logger.info("pid %d %s the fill of %s: %d of %d MB in place, %.2fs left against a plain load of %.2fs",
                    pid, "joins" if joins else "loads plainly beside", request.key[:16], fill.written >> 20,
                    fill.expected >> 20, left, plain)
        return plain if joins else 0.0

    def _load(self, conn: socket.socket, request: P.Load, blob: bytes, pid: int) -> None:
        """Hit, or miss: see Note [Cold loads run behind the caller]."""
        try:
            self._check_load(request)
        except LoadFailure as failure:
            return self._reply_error(conn, failure.code, failure.message)
        if request.program and not request.lookup_only:
            self.history.record(request.program, pid, request.key)  # Note [Prefetch] in overmind.prefetch
        admission = self.registry.begin(request.key, lookup_only=request.lookup_only)
        if admission.reply is not None:
            return self._send_entry(conn, admission.reply, hit=True)
        if admission.busy:
            return P.send_message(conn, P.Pending(request.key, False, "the server is busy with other loads"))
        if admission.failure is not None:
            if admission.failure.code == P.ErrorCode.NOT_REBUILDABLE:
                self.not_cacheable += 1  # Note [Results that cannot be rebuilt] in overmind.quirks
            if request.wait or request.lookup_only:
                return P.send_message(conn, admission.failure)
            return P.send_message(conn, P.Pending(request.key, False, admission.failure.message[:MAX_TEXT],
                                                  code=admission.failure.code))
        flight = admission.flight
        if flight is None:  # lookup_only and nothing there
            return self._reply_error(conn, P.ErrorCode.NOT_FOUND, f"no entry {request.key}")
        if admission.started:
            # Note [Cold fills yield to their caller] in overmind.fill_priority
            fill = self.loaders.fills.begin(request.key, background=not request.wait, caller=pid)
            threading.Thread(target=self._fly, args=(flight, request, blob, pid, fill), daemon=True,
                             name="overmind-load").start()
        join = 0.0 if admission.started else self._joins(request, pid)
        if not (request.wait or request.lookup_only or join):
            return P.send_message(conn, P.Pending(request.key, True, ""))
        # Answer at once that we are alive and loading; the entry follows (Pending.waiting).
        P.send_message(conn, P.Pending(request.key, True, "", waiting=True))
        with self.loaders.fills.waiting(request.key, pid):  # it lends the fill its priority
            done = flight.done.wait(join or self.config.loader_timeout + 60)
        if join:
            self.joined += 1
            logger.info("pid %d joined the fill of %s: %s", pid, request.key[:16], "served" if done else "gave up")
            if not done:  # slower than we thought: the caller loads plainly after all
                return P.send_message(conn, P.Pending(request.key, True, "the fill took longer than a plain load"))
        if not done:
            return self._reply_error(conn, P.ErrorCode.LOADER_TIMEOUT, f"gave up waiting for {request.key}")
        if flight.entry is None:
            assert flight.error is not None
            return P.send_message(conn, flight.error)
        reply = self.registry.served_by_flight(flight, count=not admission.started)
        if reply is None:  # evicted already (budget pressure from another load): a plain load it is
            return P.send_message(conn, P.Error(P.ErrorCode.NOT_FOUND, f"{request.key} was evicted right after loading"))
        self._send_entry(conn, reply, hit=not admission.started)

    def _fly(self, flight: Flight, request: P.Load, blob: bytes, pid: int, fill: Fill) -> None:
        remember = False
        try:
            flight.entry = self._run_load(request, blob, pid, fill)
        except LoadFailure as failure:
            flight.error = P.Error(failure.code, failure.message, failure.traceback)
            # Note [Only deterministic failures are remembered] in overmind.registry
            remember = failure.code in (P.ErrorCode.LOADER_FAILED, P.ErrorCode.TOO_LARGE, P.ErrorCode.BAD_REQUEST,
                                        P.ErrorCode.NOT_REBUILDABLE)
        except Exception as err:  # pragma: no cover - reported, never fatal
            logger.exception("load of %s failed inside the server", request.key)
            flight.error = P.Error(P.ErrorCode.INTERNAL, f"server error: {err}")
        finally:
            self.loaders.fills.end(fill)
            if flight.error is not None and flight.error.code == P.ErrorCode.NOT_REBUILDABLE:
                self.not_cacheable += 1  # not a fault: Note [Results that cannot be rebuilt] in overmind.quirks
                logger.info("not caching %s: %s", request.key[:16], flight.error.message[:300])
            elif flight.error is not None:
                logger.warning("load of %s failed: %s", request.key[:16], flight.error.message[:300])
            self.registry.finish(request.key, flight, remember=remember)

    def _references(self, request: P.Load, fill: Fill) -> list:
        """Note [The loader is handed its references]: (Reply, segment fds) of every entry the
        call refers to, and of those they refer to; waits for those still filling."""
        handed: list = []
        try:
            pending, seen = list(request.refs), set()
            deadline = time.monotonic() + self.config.loader_timeout
            while pending:
                key = pending.pop(0)
                if key in seen:
                    continue
                seen.add(key)
                if len(seen) > MAX_LIST:
                    raise LoadFailure(P.ErrorCode.BAD_REQUEST, f"more than {MAX_LIST} entries referred to")
                reply, fds = self._reference(key, fill, deadline)
                handed.append((reply, fds))
                pending += P.LoadMeta.from_wire(reply.meta).references
            return handed
        except BaseException:
            for _, fds in handed:
                self._drop(fds)
            raise

    def _reference(self, key: str, fill: Fill, deadline: float) -> tuple:
        while True:
            found = self.registry.pinned(key)
            if found is not None:
                return found
            admission = self.registry.begin(key, lookup_only=True)
            if admission.flight is not None:
                with self.loaders.fills.depends(fill, key):  # it lends the fill our priority, if we have it
                    if not admission.flight.done.wait(max(deadline - time.monotonic(), 0.0)):
                        raise LoadFailure(P.ErrorCode.LOADER_TIMEOUT, f"gave up waiting for {key[:16]}, "
                                          "an entry this load refers to")
            elif admission.reply is None:  # failed, or evicted since the caller named it
                raise LoadFailure(P.ErrorCode.NOT_FOUND, f"the entry {key[:16]} this load refers to is not cached")

    def _run_load(self, request: P.Load, blob: bytes, pid: int, fill: Fill) -> CacheEntry:
        context, cwd, sys_path = context_from_wire(request.context)
        self.loaders.fills.after_caller(fill)  # Note [Cold fills wait for their caller] in overmind.fill_priority
        references = self._references(request, fill)
        started = time.monotonic()
        try:
            with self.load_slots:
                logger.info("miss %s: loading %s for pid %d", request.key[:16], request.description, pid)
                result, skeleton, fds = self.loaders.run(request.key, context, cwd, sys_path, blob, request.modules,
                                                         fill=fill, references=references,
                                                         contents=self.registry.content_index())
        finally:
            for _, handed in references:
                self._drop(handed)
        # The loader sends its new segments and, after them, those of other entries that hold some
        # of its storages already (Note [Stored once by content] in overmind.reductions).
        slots: list = [None] * result.nslots
        for fd, size, slot in zip(fds, result.sizes, result.slots):
            slots[slot] = [fd, size]
        try:
            meta = P.LoadMeta.from_wire(result.meta)
        except P.ProtocolError as err:
            for slot in slots:
                if slot is not None:
                    os.close(slot[0])
            raise LoadFailure(P.ErrorCode.INTERNAL, f"loader sent malformed metadata: {err}") from None
        meta.load_seconds = time.monotonic() - started
        contents, meta.contents = meta.contents, []  # kept by the registry, not sent to every client
        entry = CacheEntry(request.key, request.target, request.description, skeleton, slots, result.nbytes,
                           list(result.refs), meta.to_dict(), contents=contents)
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


def _configure_logging(level: str, log_fd: int, foreground: bool) -> None:
    """``level`` is one of overmind.config.LOG_LEVELS, checked by Config.from_env."""
    root = logging.getLogger("overmind")
    root.setLevel(level)
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s")
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
    clients point), then exit: Note [A bad setting never stops a script] in overmind.config."""
    print(f"overmind-server: not starting: {err}", file=sys.stderr)
    if log_fd >= 0:
        _configure_logging("INFO", log_fd, foreground=False)
        logger.error("not starting: %s", err)


def _limit_malloc_arenas() -> None:
    """Note [Few malloc arenas]: glibc gives each busy thread an arena of its own and keeps
    what it freed there, so a burst of connection threads (Note [Every peer is bounded])
    leaves tens of MiB behind for good. The server's threads mostly wait on sockets; two
    arenas serve them as fast. A no-op where mallopt is missing (musl)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        libc.mallopt(-8, 2)  # M_ARENA_MAX
    except (OSError, AttributeError):
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
    from overmind.config import default_runtime_dir

    paths = Config(default_runtime_dir(env))  # the runtime dir and log, before the settings are read
    log_fd = -1
    notes: list[str] = []  # bad yes/no values: logged once logging is set up
    try:
        ensure_private_dir(paths.runtime_dir)
        # Note [Runtime files are opened, never followed] in overmind.config; opened before
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
    server = Server(config)
    try:
        server.startup()
    except (ConfigError, OSError) as err:
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
