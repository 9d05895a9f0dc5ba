"""Talking to overmind-server: connect (starting it if absent), load, map segments.

    with Connection.open(Config.from_env()) as conn:
        reply, skeleton = conn.load(request, blob)
        mappings = conn.map_segments(reply)

Used by ``overmind.api`` (user processes), ``overmind.loader`` (to rebuild
referenced entries) and ``overmind.cli``. Every socket operation is bounded: connecting,
the handshake and every answer by ``OVERMIND_REPLY_TIMEOUT`` (2 s), so a stopped or
stuck server costs a caller about that; only a cold load the caller chose to wait for
(``Pending.waiting``) waits up to ``OVERMIND_TIMEOUT``.

Note [A segment is opened by identity]
An ``Entry`` names each segment by the server's fd number, and fd numbers are reused the
moment one is closed: if the entry is evicted between the server's reply and our open of
``/proc/<server pid>/fd/<n>``, that number may already belong to another entry's segment,
of the same size when two fine-tunes share an architecture. So the reply also carries each
segment's (st_dev, st_ino), taken under the registry's lock, and every open by number is
checked against it before mapping (``Segment.check``); a mismatch raises
:class:`SegmentChanged` and the caller asks once more (by then a miss, or the new entry).
Fds received over ``SCM_RIGHTS`` are checked the same way. DESIGN invariant 7.

Note [Segments across PID namespaces]
The ``Welcome`` names the server's pid as the server sees it; in a container (a Kubernetes
pod beside a per-node DaemonSet) that is often 1, and ``/proc/1/fd/<n>`` is then the
client's own init, or the client itself. So ``/proc`` is opened with the pid ``SO_PEERCRED``
reports, which the kernel translates into our namespace, and when the server is in a
namespace we cannot see (the kernel reports 0) segments come over the socket with
``SCM_RIGHTS`` from the start.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import socket
import sys
import threading
import time
from typing import Optional

from overmind import __version__
from overmind import protocol as P
from overmind import prefetch
from overmind.config import Config, ensure_private_dir, open_runtime_file
from overmind.memfd import Segment

logger = logging.getLogger(__name__)

__all__ = ["Connection", "ServerUnavailable", "CachePending", "SegmentChanged", "StaleConnection", "start_server",
           "server_holding", "START_TIMEOUT", "unreadable"]

START_TIMEOUT = 30.0


class ServerUnavailable(ConnectionError):
    """No server could be reached or started."""


class SegmentChanged(Exception):
    """A segment opened by number is not the one the reply named: Note [A segment is opened by identity]."""


class StaleConnection(ConnectionError):
    """A reused connection turned out closed (the server dropped it while idle, or restarted)."""


class CachePending(Exception):
    """A miss being loaded in the background (Note [Cold loads run behind the caller] in overmind.cold_loads)."""

    def __init__(self, key: str, loading: bool, reason: str, code: int = 0) -> None:
        super().__init__(reason or f"{key} is loading in the background")
        self.key = key
        self.loading = loading
        self.reason = reason
        self.code = code  # the remembered failure's ErrorCode


def _connect(path: str, timeout: float) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(path)
    except BaseException:
        sock.close()
        raise
    return sock


def server_holding(config: Config) -> bool:
    """Does a live server hold this runtime dir (Note [One server per runtime directory] in
    overmind.server), whether or not its socket can be reached?"""
    try:
        fd = open_runtime_file(config.instance_lock_path, os.O_RDONLY)
    except Exception:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def _wait_for_socket(config: Config, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        try:
            _connect(str(config.socket_path), timeout).close()
            return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)


def start_server(config: Config, timeout: float = START_TIMEOUT) -> None:
    """Start ``overmind-server --daemon`` unless one is up. Racing clients: the first starts it
    (under an flock), the others wait on the lock and then find it listening. A server that
    runs but whose socket is gone is waited for (it binds a new one, Note [A lost socket is
    replaced]), never doubled."""
    ensure_private_dir(config.runtime_dir)
    lock = open_runtime_file(config.lock_path)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise ServerUnavailable(f"timed out waiting for another client to start the server "
                                            f"({config.lock_path})") from None
                time.sleep(0.02)
        try:
            try:
                _connect(str(config.socket_path), config.reply_timeout).close()
                return  # someone else started it while we waited
            except OSError:
                pass
            if server_holding(config):
                if _wait_for_socket(config, config.reply_timeout):
                    return
                raise ServerUnavailable(f"an overmind-server holds {config.runtime_dir} but does not answer on "
                                        f"{config.socket_path}; see {config.log_path} or run `overmind shutdown`")
            import subprocess

            env = dict(os.environ, OVERMIND_RUNTIME_DIR=str(config.runtime_dir))
            logger.info("starting overmind-server in %s", config.runtime_dir)
            proc = subprocess.run(
                [sys.executable, "-m", "overmind.server", "--daemon"], env=env, stdin=subprocess.DEVNULL,
                capture_output=True, text=True, timeout=timeout, cwd="/",
            )
            if proc.returncode != 0:
                # The last line (the exception) first: the fallback warning shows only a first line.
                lines = proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"]
                where = "" if str(config.log_path) in lines[-1] else f"; see {config.log_path}"
                raise ServerUnavailable(f"overmind-server failed to start: {lines[-1][:300]}{where}"
                                        + "".join(f"\n{line}" for line in lines[-20:-1]))
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    finally:
        os.close(lock)


class Connection:
    """One handshaken connection. Not thread-safe by itself: hold ``lock`` around a request."""

    def __init__(self, sock: socket.socket, welcome: P.Welcome, config: Config) -> None:
        self.sock = sock
        self.server_pid = welcome.server_pid
        # Note [Segments across PID namespaces]: the server's pid as the kernel names it to us;
        # None when it lives in a PID namespace we cannot see (the kernel reports 0).
        self.proc_pid: Optional[int] = welcome.server_pid
        self.server_version = welcome.server_version
        self.config = config
        self.lock = threading.Lock()
        self.used = False  # answered a request already: a failure now may just mean it went stale

    @classmethod
    def open(cls, config: Config, role: str = "client", autostart: Optional[bool] = None) -> "Connection":
        autostart = config.autostart if autostart is None else autostart
        connect_timeout = config.reply_timeout
        try:
            sock = _connect(str(config.socket_path), connect_timeout)
        except (FileNotFoundError, ConnectionRefusedError) as err:
            if not autostart:
                raise ServerUnavailable(f"no overmind-server at {config.socket_path} ({err.strerror})") from None
            start_server(config)
            sock = _connect(str(config.socket_path), connect_timeout)
        except OSError as err:
            raise ServerUnavailable(f"cannot connect to {config.socket_path}: {err}") from None
        try:
            # Note: the kernel's word, not the Welcome's. A server of another user (a squatted
            # /tmp/overmind-<uid>, a shared OVERMIND_RUNTIME_DIR) must never see our request and
            # its context, and its skeletons are pickles: unpickling one runs its code.
            peer_pid, peer_uid, _ = P.peer_credentials(sock)
            if peer_uid != os.getuid():
                raise ServerUnavailable(f"refusing the server at {config.socket_path}: it runs as uid {peer_uid}, "
                                        f"not as you (uid {os.getuid()}); use a private OVERMIND_RUNTIME_DIR")
            sock.settimeout(connect_timeout)
            P.send_message(sock, P.Hello(P.PROTOCOL_VERSION, os.getpid(), role, __version__))
            message, _, fds = P.recv_message(sock, max_blob=0, frame_timeout=connect_timeout)
            for fd in fds:
                os.close(fd)
            welcome = P.expect(message, P.Welcome, "in the handshake")
            if welcome.uid != os.getuid():
                raise ServerUnavailable(f"the server at {config.socket_path} runs as uid {welcome.uid}, not as you")
        except socket.timeout:
            sock.close()
            raise ServerUnavailable(f"the server at {config.socket_path} did not answer the handshake within "
                                    f"{connect_timeout:g}s (stopped or overloaded?)") from None
        except BaseException:
            sock.close()
            raise
        conn = cls(sock, welcome, config)
        conn.proc_pid = peer_pid or None
        return conn

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> "Connection":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def request(self, message: P.Message, blob: bytes = b"", timeout: Optional[float] = None
                ) -> tuple[P.Message, bytes, list[int]]:
        """Send ``message`` and read the answer, each bounded by ``timeout`` (default: the reply bound)."""
        with self.lock:
            timeout = timeout if timeout is not None else self.config.reply_timeout
            self.sock.settimeout(timeout)
            try:
                P.send_message(self.sock, message, blob)
                answer = P.recv_message(self.sock, frame_timeout=timeout)
            except (BrokenPipeError, ConnectionResetError, EOFError) as err:
                if self.used:
                    raise StaleConnection(f"the server closed this connection ({type(err).__name__})") from None
                raise
            except socket.timeout:
                raise TimeoutError(f"overmind-server did not answer within {timeout:g}s") from None
            self.used = True
            return answer

    def tell(self, message: P.Message) -> None:
        """Send a message the server does not answer (``PlainLoaded``)."""
        with self.lock:
            self.sock.settimeout(self.config.reply_timeout)
            P.send_message(self.sock, message)

    def load(self, request: P.Load, blob: bytes) -> tuple[P.Entry, bytes]:
        """An entry, or CachePending. The answer comes within the reply bound; a request that
        waits for a cold load then waits up to ``OVERMIND_TIMEOUT`` for the entry."""
        message, skeleton, fds = self.request(request, blob)
        if isinstance(message, P.Pending) and message.waiting:
            with self.lock:
                self.sock.settimeout(self.config.timeout)
                try:
                    message, skeleton, fds = P.recv_message(self.sock, frame_timeout=self.config.timeout)
                except socket.timeout:
                    raise TimeoutError(f"the cache did not load {request.key} within "
                                       f"OVERMIND_TIMEOUT={self.config.timeout:g}s") from None
        for fd in fds:
            os.close(fd)
        if isinstance(message, P.Pending):
            raise CachePending(message.key, message.loading, message.reason, message.code)
        return P.expect(message, P.Entry, "for a load"), skeleton

    def map_segments(self, entry: P.Entry) -> list[Optional[mmap.mmap]]:
        """Map every segment of ``entry`` MAP_PRIVATE; our fds are closed once mapped.
        Each is checked to be the segment the reply named: Note [A segment is opened by identity]."""
        slots = _slot_handles(entry)
        if self.proc_pid is None:
            return self._map_received(entry, slots)
        mappings: list[Optional[mmap.mmap]] = [None] * len(slots)
        try:
            for i, slot in enumerate(slots):
                if slot is None:
                    continue
                fd, size, dev, ino = slot
                mappings[i] = prefetch.take(dev, ino, size)  # Note [Prefetch] in overmind.prefetch
                if mappings[i] is not None:
                    continue
                with Segment.open_proc(self.proc_pid, fd, size, f"{entry.key[:12]}.{i}", identity=(dev, ino)) as seg:
                    mappings[i] = seg.map_private()
            return mappings
        except (PermissionError, FileNotFoundError) as err:
            # /proc/<pid>/fd refused (another PID namespace, a non-dumpable server): SCM_RIGHTS.
            logger.debug("opening segments through /proc failed (%s); asking for the fds", err)
            _close_all(mappings)
            return self._map_received(entry, slots)
        except Segment.Mismatch as err:
            _close_all(mappings)
            raise SegmentChanged(f"entry {entry.key[:16]} changed while we opened it: {err}") from None
        except OSError as err:  # the number now names something that cannot be opened (a socket: ENXIO)
            _close_all(mappings)
            raise SegmentChanged(f"entry {entry.key[:16]} changed while we opened it: {err}") from None
        except BaseException:
            _close_all(mappings)
            raise

    def _map_received(self, entry: P.Entry, slots: Optional[list] = None) -> list[Optional[mmap.mmap]]:
        slots = _slot_handles(entry) if slots is None else slots
        message, _, fds = self.request(P.GetFds(entry.key))
        mappings: list[Optional[mmap.mmap]] = [None] * len(slots)
        try:
            if isinstance(message, P.Error) and message.code == P.ErrorCode.NOT_FOUND:
                raise SegmentChanged(f"entry {entry.key[:16]} was evicted before its segments reached us")
            reply = P.expect(message, P.Fds, "for segment fds")
            live = [i for i, slot in enumerate(slots) if slot is not None]
            if len(fds) != len(live) or reply.sizes != [slots[i][1] for i in live]:
                raise SegmentChanged(f"entry {entry.key[:16]} changed: expected {len(live)} segment fds, got {len(fds)}")
            for i, fd in zip(live, fds):
                _, size, dev, ino = slots[i]
                seg = Segment(fd, size, f"{entry.key[:12]}.{i}")
                seg.check(size, identity=(dev, ino))
                mappings[i] = seg.map_private()
            return mappings
        except Segment.Mismatch as err:
            _close_all(mappings)
            raise SegmentChanged(f"entry {entry.key[:16]} changed while we opened it: {err}") from None
        except BaseException:
            _close_all(mappings)
            raise
        finally:
            for fd in fds:
                try:
                    os.close(fd)
                except OSError as err:
                    if err.errno != errno.EBADF:
                        raise

    def simple(self, message: P.Message, expected: type, timeout: Optional[float] = None) -> P.Message:
        reply, _, fds = self.request(message, timeout=timeout)
        for fd in fds:
            os.close(fd)
        return P.expect(reply, expected)


def _slot_handles(entry: P.Entry) -> list:
    """The reply's ``[fd, size, st_dev, st_ino]`` per slot, validated (a garbled reply is a ProtocolError)."""
    slots = entry.segments
    for slot in slots:
        if slot is not None and not (isinstance(slot, list) and len(slot) == 4
                                     and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in slot)):
            raise P.ProtocolError(f"malformed segment handle {str(slot)[:80]} in the entry for {entry.key[:16]}")
    return slots


def _close_all(mappings: list) -> None:
    for m in mappings:
        if m is not None:
            m.close()


# Note [A hit needs the caller's read permission]
# The server checks that an entry's files are unchanged, not that this caller may read them:
# it stats them with its own credentials, and the entry may have been filled for an earlier
# caller. A hit must not hand over the bytes of a file the caller could not read itself: a
# model chmod-ed 000 after caching, a folder of a group the caller has left, a process that
# dropped CAP_DAC_OVERRIDE beside a root server. So before mapping anything, the client opens
# for reading, with its own credentials, every file the plain call would read: the entry's
# observed files (Note [Observed files] in overmind.loader) and the paths its arguments name.
# Opening rather than access(2): the kernel decides as for the plain call's own open (modes,
# ACLs, capabilities, LSMs, a network filesystem's server), where access(2) judges by the
# real uid and glibc's faccessat(AT_EACCESS) fallback lets uid 0 through whatever its
# capabilities. If one open fails the hit is declined and the caller runs the original, which
# raises plain's own exception; no overmind warning, since plain raises too. Nothing is read:
# one open and close per file. A folder argument must be listable, which a plain load that only
# looks names up in it does not need: that rare caller pays a plain load, never a wrong hit.
_PROBE_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY  # a FIFO or tty must not block or attach


def unreadable(files: list, paths: list) -> Optional[str]:
    """The first of an entry's observed ``files`` (``LoadMeta.files`` records) and argument
    ``paths`` this process cannot open for reading now, or None: Note [A hit needs the
    caller's read permission]."""
    for path in [record[0] if isinstance(record, list) and record else record for record in files] + list(paths):
        if not isinstance(path, str):
            return repr(path)[:200]
        try:
            os.close(os.open(path, _PROBE_FLAGS))
        except (OSError, ValueError):  # ValueError: a NUL in the path
            return path
    return None
