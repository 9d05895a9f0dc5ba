"""Talking to overmind-server: connect (starting it if absent), load, map segments.

    with Connection.open(Config.from_env()) as conn:
        reply, skeleton = conn.load(request, blob)
        mappings = conn.map_segments(reply)

Used by ``overmind.api`` (user processes), ``overmind.loader`` (to rebuild
referenced entries) and ``overmind.cli``. Every socket operation is bounded by a
timeout, so a frozen server costs at most ``OVERMIND_TIMEOUT``.
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
from overmind.config import Config, ensure_private_dir
from overmind.memfd import Segment

logger = logging.getLogger(__name__)

__all__ = ["Connection", "ServerUnavailable", "CachePending", "start_server", "CONNECT_TIMEOUT"]

CONNECT_TIMEOUT = 5.0
START_TIMEOUT = 30.0


class ServerUnavailable(ConnectionError):
    """No server could be reached or started."""


class CachePending(Exception):
    """A miss being loaded in the background (Note [Cold loads run behind the caller])."""

    def __init__(self, key: str, loading: bool, reason: str) -> None:
        super().__init__(reason or f"{key} is loading in the background")
        self.key = key
        self.loading = loading
        self.reason = reason


def _connect(path: str, timeout: float) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(path)
    except BaseException:
        sock.close()
        raise
    return sock


def start_server(config: Config, timeout: float = START_TIMEOUT) -> None:
    """Start ``overmind-server --daemon`` unless one is up. Racing clients: the first starts it
    (under an flock), the others wait on the lock and then find it listening."""
    ensure_private_dir(config.runtime_dir)
    with open(config.lock_path, "a+") as lock:
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
                _connect(str(config.socket_path), CONNECT_TIMEOUT).close()
                return  # someone else started it while we waited
            except OSError:
                pass
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


class Connection:
    """One handshaken connection. Not thread-safe by itself: hold ``lock`` around a request."""

    def __init__(self, sock: socket.socket, welcome: P.Welcome, config: Config) -> None:
        self.sock = sock
        self.server_pid = welcome.server_pid
        self.server_version = welcome.server_version
        self.config = config
        self.lock = threading.Lock()

    @classmethod
    def open(cls, config: Config, role: str = "client", autostart: Optional[bool] = None,
             timeout: Optional[float] = None) -> "Connection":
        autostart = config.autostart if autostart is None else autostart
        connect_timeout = min(CONNECT_TIMEOUT, timeout or CONNECT_TIMEOUT)
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
            _, peer_uid, _ = P.peer_credentials(sock)
            if peer_uid != os.getuid():
                raise ServerUnavailable(f"refusing the server at {config.socket_path}: it runs as uid {peer_uid}, "
                                        f"not as you (uid {os.getuid()}); use a private OVERMIND_RUNTIME_DIR")
            sock.settimeout(connect_timeout)
            P.send_message(sock, P.Hello(P.PROTOCOL_VERSION, os.getpid(), role, __version__))
            message, _, fds = P.recv_message(sock, max_blob=0)
            for fd in fds:
                os.close(fd)
            welcome = P.expect(message, P.Welcome, "in the handshake")
            if welcome.uid != os.getuid():
                raise ServerUnavailable(f"the server at {config.socket_path} runs as uid {welcome.uid}, not as you")
        except BaseException:
            sock.close()
            raise
        return cls(sock, welcome, config)

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> "Connection":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def request(self, message: P.Message, blob: bytes = b"", timeout: Optional[float] = None
                ) -> tuple[P.Message, bytes, list[int]]:
        with self.lock:
            self.sock.settimeout(timeout if timeout is not None else self.config.timeout)
            P.send_message(self.sock, message, blob)
            return P.recv_message(self.sock)

    def load(self, request: P.Load, blob: bytes, timeout: Optional[float] = None) -> tuple[P.Entry, bytes]:
        message, skeleton, fds = self.request(request, blob, timeout)
        for fd in fds:
            os.close(fd)
        if isinstance(message, P.Pending):
            raise CachePending(message.key, message.loading, message.reason)
        return P.expect(message, P.Entry, "for a load"), skeleton

    def map_segments(self, entry: P.Entry) -> list[Optional[mmap.mmap]]:
        """Map every segment of ``entry`` MAP_PRIVATE; our fds are closed once mapped."""
        slots = entry.segments
        mappings: list[Optional[mmap.mmap]] = [None] * len(slots)
        try:
            for i, slot in enumerate(slots):
                if slot is None:
                    continue
                with Segment.open_proc(self.server_pid, slot[0], slot[1], f"{entry.key[:12]}.{i}") as seg:
                    mappings[i] = seg.map_private()
            return mappings
        except (PermissionError, FileNotFoundError) as err:
            # /proc/<pid>/fd refused (another PID namespace, a non-dumpable server): SCM_RIGHTS.
            logger.debug("opening segments through /proc failed (%s); asking for the fds", err)
            for m in mappings:
                if m is not None:
                    m.close()
            return self._map_received(entry)

    def _map_received(self, entry: P.Entry) -> list[Optional[mmap.mmap]]:
        message, _, fds = self.request(P.GetFds(entry.key))
        try:
            reply = P.expect(message, P.Fds, "for segment fds")
            live = [i for i, slot in enumerate(entry.segments) if slot is not None]
            if len(fds) != len(live) or reply.sizes != [entry.segments[i][1] for i in live]:
                raise P.ProtocolError(f"expected {len(live)} segment fds, got {len(fds)}")
            mappings: list[Optional[mmap.mmap]] = [None] * len(entry.segments)
            for i, fd in zip(live, fds):
                seg = Segment.from_fd(fd, entry.segments[i][1], f"{entry.key[:12]}.{i}")
                mappings[i] = seg.map_private()
            return mappings
        finally:
            for fd in fds:
                try:
                    os.close(fd)
                except OSError as err:
                    if err.errno != errno.EBADF:
                        raise

    def simple(self, message: P.Message, expected: type, timeout: float = CONNECT_TIMEOUT) -> P.Message:
        reply, _, fds = self.request(message, timeout=timeout)
        for fd in fds:
            os.close(fd)
        return P.expect(reply, expected)
