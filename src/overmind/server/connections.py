"""The server's end of its connections: who may connect, how many at once, the handshake, and
every request read under its bounds. Standard library only.

    connections = Connections(stopping, serve_request)   # one per overmind.server.daemon.Server
    connections.accept(conn)        # a peer the listening socket accepted: served in a thread, or BUSY
    connections.wait_idle(grace)    # at shutdown: the requests being served end first
    connections.counters()          # `overmind status`'s refused_connections, connections, peers

What a request asks is the server's: ``serve_request(conn, message, blob, fds, pid)`` answers
one, and says whether it handed the connection on (a run's, to a warm interpreter).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Callable

from overmind import __version__
from overmind.shared import protocol as P
from overmind.server.loads import MAX_TEXT, reply_error

logger = logging.getLogger("overmind.server.daemon")  # the server's: its log reads as before

__all__ = ["Connections", "MAX_CONNECTIONS", "MAX_REQUEST_BLOB"]

# A client's only blob is a pickled call (paths, configs, entry references): kilobytes. The
# protocol's MAX_BLOB is sized for skeletons; a client claiming that much must not make the
# server allocate it (Note [Frames are untrusted] in overmind.shared.protocol).
MAX_REQUEST_BLOB = 64 << 20

# Note [Every peer is bounded]
# A peer of our own uid can still be buggy or hostile; none may make the server grow
# without bound or stop serving others. Connections are capped (past the cap a new one gets
# BUSY and is closed); the handshake must arrive within HANDSHAKE_TIMEOUT; a frame, once
# started, must be complete within FRAME_TIMEOUT and its blob is allocated as its bytes
# arrive; a connection idle for IDLE_TIMEOUT is closed (clients reconnect transparently);
# request fields are bounded (keys, descriptions, lists); loads in flight are capped by the
# fills' table, and remembered failures are few and short (Note [Only deterministic failures are
# remembered] in overmind.server.failures).
MAX_CONNECTIONS = 256
HANDSHAKE_TIMEOUT = 5.0
FRAME_TIMEOUT = 30.0
IDLE_TIMEOUT = 600.0
PEER_ROLES = ("client", "cli", "run")  # what Hello.role says; a loader never connects (Note [The loader is handed its references] in overmind.server.loaders)

ServeRequest = Callable[[socket.socket, P.Message, bytes, list, int], bool]


class Connections:
    """Every connection's thread, the peers by role, and the requests being served."""

    def __init__(self, stopping: threading.Event, serve_request: ServeRequest) -> None:
        self.stopping = stopping
        self.serve_request = serve_request  # the server's: answers one request (see the module's docstring)
        self.uid = os.getuid()  # the only peer served: Note [Every peer is bounded]
        self.lock = threading.Lock()  # the counts below
        self.alive = 0  # connection threads alive: Note [Every peer is bounded]
        self.active = 0  # requests being served
        self.peers: dict[str, int] = {}  # handshakes by the role the peer gave (one of PEER_ROLES, or "other")
        self.refused = self.busy_refusals = 0

    def counters(self) -> dict:
        return {"refused_connections": self.refused, "busy_refusals": self.busy_refusals, "connections": self.alive,
                "peers": dict(self.peers)}

    def accept(self, conn: socket.socket) -> None:
        """Serve ``conn`` in a thread of its own; past MAX_CONNECTIONS, say BUSY and close it."""
        with self.lock:
            admitted = self.alive < MAX_CONNECTIONS
            if admitted:
                self.alive += 1
            else:
                self.busy_refusals += 1
        if not admitted:
            with conn:
                conn.settimeout(1.0)
                reply_error(conn, P.ErrorCode.BUSY, f"more than {MAX_CONNECTIONS} connections")
            return
        try:
            threading.Thread(target=self._handle, args=(conn,), daemon=True, name="overmind-conn").start()
        except RuntimeError:  # cannot start a thread: out of resources; this peer goes unserved
            conn.close()
            with self.lock:
                self.alive -= 1

    def wait_idle(self, grace: float) -> None:
        """Until no request is being served, ``grace`` seconds at most."""
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            with self.lock:
                if self.active == 0:
                    break
            time.sleep(0.05)

    def _handle(self, conn: socket.socket) -> None:
        try:
            self._serve_connection(conn)
        finally:
            with self.lock:
                self.alive -= 1

    def _serve_connection(self, conn: socket.socket) -> None:
        with conn:
            try:
                pid, uid, _ = P.peer_credentials(conn)
            except OSError:
                return
            if uid != self.uid:
                self.refused += 1
                logger.warning("refused connection from pid %d uid %d (server uid %d)", pid, uid, self.uid)
                reply_error(conn, P.ErrorCode.PERMISSION_DENIED, "overmind-server serves only its own user")
                return
            conn.settimeout(HANDSHAKE_TIMEOUT)  # Note [Every peer is bounded]
            try:
                hello, _, fds = P.recv_message(conn, max_blob=0, frame_timeout=HANDSHAKE_TIMEOUT)
                P.close_fds(fds)
                if not isinstance(hello, P.Hello):
                    raise P.ProtocolError(f"expected Hello, got {type(hello).__name__}")
                role = hello.role if hello.role in PEER_ROLES else "other"
                with self.lock:
                    self.peers[role] = self.peers.get(role, 0) + 1
                if hello.version != P.PROTOCOL_VERSION:
                    reply_error(conn, P.ErrorCode.VERSION_MISMATCH,
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
                        P.close_fds(fds)  # only a run brings fds: its stdio
                        fds = []
                    conn.settimeout(FRAME_TIMEOUT)  # replies to a peer that stopped reading give up too
                    with self.lock:
                        self.active += 1
                    try:
                        if self.serve_request(conn, message, blob, fds, pid):
                            return  # the warm interpreter has the connection now
                    finally:
                        del blob
                        with self.lock:
                            self.active -= 1
            except EOFError:
                pass
            except P.VersionMismatch as err:
                logger.warning("closing connection from pid %d: %s", pid, err)
                reply_error(conn, P.ErrorCode.VERSION_MISMATCH, str(err))
            except (P.ProtocolError, socket.timeout) as err:
                logger.warning("closing connection from pid %d: %s", pid, str(err)[:300])
                reply_error(conn, P.ErrorCode.BAD_REQUEST, str(err)[:MAX_TEXT])
            except (BrokenPipeError, ConnectionResetError):
                pass
            except Exception:  # never let one connection take the server down
                logger.exception("internal error serving pid %d", pid)
