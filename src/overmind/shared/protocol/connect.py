"""Reaching overmind-server: connect, check who answers, say hello; start it when it is absent.

    with Connection.open(Config.from_env(), role="cli") as conn:
        status = conn.simple(P.Status(), P.StatusReply)

    sock, welcome, peer_pid = handshake(config, role="run")    # a bare socket (overmind run)
    start_server(config)                    # blocks until it answers; wait=False: detached

The one place that connects and starts the server, for every side: the client's cache path
(``overmind.client.connection.LoadingConnection`` adds loading to :class:`Connection`), the ``overmind`` command
and its light ``run`` front end, and the first plain run that reports its modules. Standard
library only, and light: the protocol is imported only by what talks (Note [A light front end]
in overmind.frontend.run). Every socket operation is bounded by ``OVERMIND_REPLY_TIMEOUT``.
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import sys
import threading
import time
from typing import TYPE_CHECKING, Optional

from overmind import __version__
from overmind.shared.settings.config import PREPARE_VARIABLE, Config, ensure_private_dir, lock_within, open_runtime_file

if TYPE_CHECKING:
    from overmind.shared import protocol as P

logger = logging.getLogger(__name__)

__all__ = ["Connection", "ServerUnavailable", "StaleConnection", "handshake", "start_server", "server_holding",
           "START_TIMEOUT"]

START_TIMEOUT = 30.0
# overmind-server's exit status when another server holds the runtime dir (systemd: RestartPreventExitStatus=75)
EXIT_ALREADY_RUNNING = 75


class ServerUnavailable(ConnectionError):
    """No server could be reached or started."""


class StaleConnection(ConnectionError):
    """A reused connection turned out closed (the server dropped it while idle, or restarted)."""


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
    overmind.server.daemon), whether or not its socket can be reached?"""
    try:
        # Only looked at: a command never creates a file in a runtime dir it has not checked.
        fd = open_runtime_file(config.instance_lock_path, os.O_RDONLY, create=False)
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


def _server_command(config: Config) -> tuple[list[str], dict]:
    return ([sys.executable, "-m", "overmind.server", "--daemon"],
            dict(os.environ, OVERMIND_RUNTIME_DIR=str(config.runtime_dir)))


def start_server(config: Config, timeout: float = START_TIMEOUT, wait: bool = True, prepare: Optional[str] = None
                 ) -> None:
    """Start ``overmind-server --daemon`` unless one is up. Racing clients: the first starts it
    (under an flock), the others wait on the lock and then find it listening. A server that
    runs but whose socket is gone is waited for (it binds a new one, Note [A lost socket is
    replaced]), never doubled.

    ``wait=False`` (``overmind run`` going plain): start it for next time, detached, and return
    at once; a second server started this way finds the first holding the runtime directory
    and leaves (Note [One server per runtime directory] in overmind.server.daemon). ``prepare``:
    the run's interpreter, whose warm interpreter the server starts as it starts (Note [The
    server a first run starts prepares its interpreter] in overmind.server.daemon)."""
    if not wait:
        argv, env = _server_command(config)
        if prepare:
            env[PREPARE_VARIABLE] = os.path.abspath(prepare)
        _start_detached(argv, env)
        return
    ensure_private_dir(config.runtime_dir)
    lock = open_runtime_file(config.lock_path)
    try:
        if not lock_within(lock, timeout, 0.02):
            raise ServerUnavailable(f"timed out waiting for another client to start the server ({config.lock_path})")
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

            argv, env = _server_command(config)
            logger.info("starting overmind-server in %s", config.runtime_dir)
            proc = subprocess.run(argv, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                  timeout=timeout, cwd="/")
            if proc.returncode == EXIT_ALREADY_RUNNING and _wait_for_socket(config, timeout):
                return  # a server started without the lock (``wait=False``) won the race: it is ours too
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


def _start_detached(argv: list[str], env: dict) -> None:
    """A grandchild in its own session, so that whoever called us (a python about to exec into
    the user's script) never has a child it did not make; not waited for."""
    try:
        pid = os.fork()
    except OSError:
        return
    if pid == 0:
        try:
            os.setsid()
            devnull = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(devnull, fd)
            os.chdir("/")
            if os.fork() == 0:
                os.execve(argv[0], argv, env)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


def handshake(config: Config, role: str, timeout: Optional[float] = None) -> tuple[socket.socket, P.Welcome, int]:
    """Connect and say hello: (socket, the server's Welcome, its pid as our kernel names it, 0 when
    it is in a PID namespace we cannot see). ``FileNotFoundError`` / ``ConnectionRefusedError``
    when nothing listens (the caller decides whether to start a server); ``ServerUnavailable``
    when what answers is not our server or does not answer in time."""
    from overmind.shared import protocol as P

    timeout = config.reply_timeout if timeout is None else timeout
    sock = _connect(str(config.socket_path), timeout)
    try:
        # The kernel's word, not the Welcome's. A server of another user (a squatted
        # /tmp/overmind-<uid>, a shared OVERMIND_RUNTIME_DIR) must never see our request and
        # its context, and its skeletons are pickles: unpickling one runs its code.
        peer_pid, peer_uid, _ = P.peer_credentials(sock)
        if peer_uid != os.getuid():
            raise ServerUnavailable(f"refusing the server at {config.socket_path}: it runs as uid {peer_uid}, "
                                    f"not as you (uid {os.getuid()}); use a private OVERMIND_RUNTIME_DIR")
        P.send_message(sock, P.Hello(P.PROTOCOL_VERSION, os.getpid(), role, __version__))
        message, _, fds = P.recv_message(sock, max_blob=0, frame_timeout=timeout)
        for fd in fds:
            os.close(fd)
        welcome = P.expect(message, P.Welcome, "in the handshake")
        if welcome.uid != os.getuid():
            raise ServerUnavailable(f"the server at {config.socket_path} runs as uid {welcome.uid}, not as you")
    except socket.timeout:
        sock.close()
        raise ServerUnavailable(f"the server at {config.socket_path} did not answer the handshake within "
                                f"{timeout:g}s (stopped or overloaded?)") from None
    except BaseException:
        sock.close()
        raise
    return sock, welcome, peer_pid


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
        try:
            sock, welcome, peer_pid = handshake(config, role)
        except (FileNotFoundError, ConnectionRefusedError) as err:
            if not autostart:
                raise ServerUnavailable(f"no overmind-server at {config.socket_path} ({err.strerror})") from None
            start_server(config)
            sock, welcome, peer_pid = handshake(config, role)
        except ServerUnavailable:
            raise
        except OSError as err:
            raise ServerUnavailable(f"cannot connect to {config.socket_path}: {err}") from None
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
        from overmind.shared import protocol as P

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
        from overmind.shared import protocol as P

        with self.lock:
            self.sock.settimeout(self.config.reply_timeout)
            P.send_message(self.sock, message)

    def simple(self, message: P.Message, expected: type, timeout: Optional[float] = None) -> P.Message:
        from overmind.shared import protocol as P

        reply, _, fds = self.request(message, timeout=timeout)
        for fd in fds:
            os.close(fd)
        return P.expect(reply, expected)
