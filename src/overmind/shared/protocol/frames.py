"""Frames on a socket: encoding, sending with fds, receiving within bounds. Standard library only.
See Note [Frames are untrusted] in ``overmind.shared.protocol``."""

from __future__ import annotations

import array
import json
import os
import socket
import struct
import time
import typing
from typing import Any, Optional

from overmind.shared.protocol.base import (HEADER, MAGIC, MAX_BLOB, MAX_FDS, MAX_JSON, PROTOCOL_VERSION, ErrorCode, Message,
                                    ProtocolError, VersionMismatch)
from overmind.shared.protocol.messages import MESSAGE_TYPES, Error

__all__ = ["encode_frame", "decode_header", "decode_fields", "send_message", "recv_message", "close_fds",
           "peer_credentials", "expect", "RemoteError"]


def encode_frame(message: Message, blob: bytes | memoryview = b"") -> bytes:
    if blob and not message.WITH_BLOB:
        raise ValueError(f"{type(message).__name__} carries no blob")
    fields = json.dumps(message.to_dict(), separators=(",", ":"), sort_keys=True).encode()
    if len(fields) > MAX_JSON:
        raise ValueError(f"{type(message).__name__} fields are {len(fields)} bytes, over the {MAX_JSON}-byte limit")
    return HEADER.pack(MAGIC, PROTOCOL_VERSION, message.TYPE, len(fields), len(blob)) + fields


def decode_header(header: bytes, max_blob: int = MAX_BLOB) -> tuple[int, int, int, int]:
    """(version, type, json_len, blob_len), or ProtocolError."""
    if len(header) != HEADER.size:
        raise ProtocolError(f"truncated header: {len(header)} of {HEADER.size} bytes")
    magic, version, mtype, json_len, blob_len = HEADER.unpack(header)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {magic!r}: not an overmind peer")
    if version != PROTOCOL_VERSION:
        raise VersionMismatch(
            f"protocol version mismatch: peer speaks {version}, this side speaks {PROTOCOL_VERSION}; "
            "restart overmind-server after upgrading overmind (overmind shutdown)"
        )
    if mtype not in MESSAGE_TYPES:
        raise ProtocolError(f"unknown message type {mtype}")
    if json_len > MAX_JSON:
        raise ProtocolError(f"fields of {json_len} bytes exceed the {MAX_JSON}-byte limit")
    if blob_len > max_blob:
        raise ProtocolError(f"blob of {blob_len} bytes exceeds the {max_blob}-byte limit")
    if blob_len and not MESSAGE_TYPES[mtype].WITH_BLOB:
        raise ProtocolError(f"{MESSAGE_TYPES[mtype].__name__} must not carry a blob")
    return version, mtype, json_len, blob_len


def decode_fields(mtype: Optional[int], raw: Any, cls: Optional[type] = None) -> Message:
    """The message of type ``mtype`` from its JSON bytes (or ``cls`` from an already parsed dict)."""
    return (cls or MESSAGE_TYPES[mtype]).from_fields(raw)


def send_message(sock: socket.socket, message: Message, blob: bytes | memoryview = b"",
                 fds: typing.Sequence[int] = ()) -> None:
    frame = encode_frame(message, blob)
    if len(fds) > MAX_FDS:
        raise ValueError(f"{len(fds)} fds exceed the limit of {MAX_FDS} a message")
    if fds:
        sent = sock.sendmsg([frame], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    else:
        sent = sock.send(frame)
    if sent < len(frame):
        sock.sendall(memoryview(frame)[sent:])
    if blob:
        sock.sendall(blob)


# Blobs up to this size are allocated at once; larger ones grow as their bytes arrive, so a
# peer announcing a large blob and sending nothing costs nothing (Note [Frames are untrusted]).
_PREALLOCATE = 1 << 20


def _recv_exact(sock: socket.socket, n: int, deadline: Optional[float] = None) -> bytearray:
    buf = bytearray(min(n, _PREALLOCATE))
    got = 0
    while got < n:
        if got == len(buf):
            buf.extend(bytes(min(n, 2 * len(buf)) - len(buf)))
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ProtocolError(f"frame not complete in time ({got} of {n} bytes)")
            sock.settimeout(left)
        try:
            k = sock.recv_into(memoryview(buf)[got:], len(buf) - got)
        except socket.timeout:
            raise ProtocolError(f"frame not complete in time ({got} of {n} bytes)") from None
        if k == 0:
            raise ProtocolError(f"connection closed mid-frame ({got} of {n} bytes)")
        got += k
    return buf


def close_fds(fds) -> None:
    """Close every fd of ``fds``, ignoring ones already closed (received fds nobody will use)."""
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def recv_message(sock: socket.socket, *, max_blob: int = MAX_BLOB, max_fds: int = MAX_FDS,
                 frame_timeout: Optional[float] = None) -> tuple[Message, bytes, list[int]]:
    """Read one frame. Raises EOFError on a clean close before a frame, ProtocolError on garbage.

    The socket's own timeout bounds the wait for a frame to start; ``frame_timeout``, if
    given, bounds the rest of the frame once its first bytes arrived (the socket's timeout is
    changed meanwhile and restored). The caller owns the returned fds.
    """
    fds = array.array("i")
    cmsg_space = socket.CMSG_SPACE(max_fds * fds.itemsize)
    data, ancdata, flags, _ = sock.recvmsg(HEADER.size, cmsg_space, getattr(socket, "MSG_CMSG_CLOEXEC", 0))
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - (len(payload) % fds.itemsize)])
    received = list(fds)
    try:
        if not data:
            raise EOFError("peer closed the connection")
        if flags & socket.MSG_CTRUNC:
            raise ProtocolError(f"more than {max_fds} fds in one message")
        deadline = None if frame_timeout is None else time.monotonic() + frame_timeout
        idle_timeout = sock.gettimeout()
        try:
            header = bytes(data)
            if len(header) < HEADER.size:
                header += bytes(_recv_exact(sock, HEADER.size - len(header), deadline))
            _, mtype, json_len, blob_len = decode_header(header, max_blob)
            message = decode_fields(mtype, bytes(_recv_exact(sock, json_len, deadline)))
            blob = bytes(_recv_exact(sock, blob_len, deadline)) if blob_len else b""
        finally:
            if deadline is not None:
                sock.settimeout(idle_timeout)
        return message, blob, received
    except BaseException:
        close_fds(received)
        raise


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a Unix socket (SO_PEERCRED)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", raw)


def expect(message: Message, cls: type, what: str = "") -> Any:
    """Return ``message`` if it is a ``cls``; turn an Error into RemoteError; else ProtocolError."""
    if isinstance(message, cls):
        return message
    if isinstance(message, Error):
        raise RemoteError(message.code, message.message, message.traceback)
    raise ProtocolError(f"expected {cls.__name__}{' ' + what if what else ''}, got {type(message).__name__}")


class RemoteError(Exception):
    """An Error message from the other side, with its code and (for loaders) traceback."""

    def __init__(self, code: int, message: str, traceback: str = "") -> None:
        super().__init__(f"{ErrorCode.name(code)}: {message}")
        self.code = code
        self.message = message
        self.remote_traceback = traceback

    def __str__(self) -> str:
        text = super().__str__()
        if self.remote_traceback:
            text += "\n--- traceback from the overmind loader ---\n" + self.remote_traceback.rstrip()
        return text
