"""The overmind wire protocol: every byte that crosses the server's socket.

Standard library only (the server imports it). A frame is a fixed header, a JSON
object with the message's fields, and an optional binary blob (a pickled call or a
skeleton); file descriptors ride on the header's ``sendmsg`` as ``SCM_RIGHTS``::

    +-------+---------+------+----------+----------+------------+------------+
    | magic | version | type | json_len | blob_len | json bytes | blob bytes |
    | 4s    | u16     | u16  | u32      | u64      |            |            |
    +-------+---------+------+----------+----------+------------+------------+

    send_message(sock, Hello(version=PROTOCOL_VERSION, pid=os.getpid(), role="client"))
    message, blob, fds = recv_message(sock)

Note [Frames are untrusted]
The server reads frames from any process that passed the peer-credential check,
and a buggy or hostile one can send anything. Sizes are bounded before any
allocation, and a large blob is allocated as its bytes arrive, not as announced; a
frame that started must finish within the reader's ``frame_timeout``. JSON is parsed
only into the declared fields with their declared types, unknown message types are
refused, and every failure raises :class:`ProtocolError`, which closes that
connection only. Received fds that were not expected are closed at once.
"""

from __future__ import annotations

import array
import json
import os
import socket
import struct
import time
import typing
from typing import Any, ClassVar, Optional

__all__ = [
    "MAGIC", "PROTOCOL_VERSION", "HEADER", "MAX_JSON", "MAX_BLOB", "MAX_FDS", "ErrorCode", "ProtocolError",
    "Message", "MESSAGE_TYPES", "encode_frame", "decode_header", "decode_fields", "send_message", "recv_message",
    "Hello", "Welcome", "Error", "Load", "Entry", "LoadMeta", "Pending", "GetFds", "Fds", "GetContents", "Contents", "Status", "StatusReply", "ListEntries",
    "EntryList", "Evict", "Evicted", "Shutdown", "Ok", "Prepare", "JobResult", "JobFailed", "Job", "JobStarted", "LoaderReady",
    "Run", "RunRefused", "RunStarted", "RunExited", "Warm", "Fork", "Retire", "PlainLoaded", "Prefetch", "PrefetchReply",
    "FillProgress",
]

MAGIC = b"OVMD"
PROTOCOL_VERSION = 4
HEADER = struct.Struct("<4sHHIQ")
MAX_JSON = 1 << 20  # 1 MiB of fields
MAX_BLOB = 1 << 31  # 2 GiB: skeletons of very large pipelines (tokenizer vocabularies) stay well below
MAX_FDS = 64


class ErrorCode:
    """Numeric error codes shared by both ends of the socket."""

    BAD_REQUEST = 1
    VERSION_MISMATCH = 2
    NOT_FOUND = 3
    LOADER_FAILED = 4  # the original loader raised; the traceback travels along
    LOADER_CRASHED = 5  # the loader process died (signal, exit) before answering
    LOADER_TIMEOUT = 6
    PERMISSION_DENIED = 7
    SHUTTING_DOWN = 8
    TOO_LARGE = 9
    INTERNAL = 10
    BUSY = 11  # too many connections: Note [Every peer is bounded] in overmind.server
    NOT_FORKABLE = 12  # a warm interpreter that changed (stale modules, a new thread) refuses to fork
    CANNOT_CACHE = 13  # the original returned, but its result could not be cached (pickling, packing)
    # The result's weights are not in it (disk offload): callers load plainly, silently, and the
    # server remembers the key. Note [Results that cannot be rebuilt] in overmind.quirks.
    NOT_REBUILDABLE = 14
    # A run's environment differs from the one a warm interpreter's imports read (Note [Settings an
    # import read] in overmind.import_env): the run goes plain; the interpreter stays.
    ENV_DIFFERS = 15

    @classmethod
    def name(cls, code: int) -> str:
        for key, value in vars(cls).items():
            if value == code and key.isupper():
                return key
        return f"ERROR_{code}"


class ProtocolError(Exception):
    """A malformed, truncated or oversized frame: the connection cannot continue."""


class VersionMismatch(ProtocolError):
    """The peer speaks another protocol version (the server answers it with ErrorCode.VERSION_MISMATCH)."""


_REQUIRED = object()
_JSON_TYPES = {"int": (int,), "str": (str,), "bool": (bool,), "float": (int, float), "dict": (dict,), "list": (list,)}


class Message:
    """Base of the typed messages; subclasses declare fields as annotated class attributes.

    Not ``dataclasses``: generating 20 dataclasses costs ~10 ms, paid by every user
    process on its first cached load.
    """

    TYPE: ClassVar[int] = 0
    WITH_BLOB: ClassVar[bool] = False
    FIELDS: ClassVar[tuple] = ()  # (name, allowed JSON types, default or _REQUIRED)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        names = [f[0] for f in self.FIELDS]
        if len(args) > len(names):
            raise TypeError(f"{type(self).__name__} takes {len(names)} fields, got {len(args)}")
        values = dict(zip(names, args))
        for name, value in kwargs.items():
            if name not in names:
                raise TypeError(f"{type(self).__name__} has no field {name!r}")
            if name in values:
                raise TypeError(f"{type(self).__name__} got {name!r} twice")
            values[name] = value
        for name, _, default in self.FIELDS:
            if name not in values:
                if default is _REQUIRED:
                    raise TypeError(f"{type(self).__name__} is missing field {name!r}")
                values[name] = type(default)(default) if isinstance(default, (list, dict)) else default
            setattr(self, name, values[name])

    def to_dict(self) -> dict:
        return {name: getattr(self, name) for name, _, _ in self.FIELDS}

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.to_dict() == self.to_dict()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.to_dict().items())})"


def message(cls: type) -> type:
    """Class decorator: collect ``cls``'s annotated fields into ``FIELDS``."""
    fields = []
    for name, annotation in cls.__dict__.get("__annotations__", {}).items():
        if annotation.startswith("ClassVar"):
            continue
        fields.append((name, _JSON_TYPES[annotation], cls.__dict__.get(name, _REQUIRED)))
    cls.FIELDS = tuple(fields)
    return cls


@message
class Hello(Message):
    TYPE: ClassVar[int] = 1
    version: int
    pid: int
    role: str  # "client", "cli" or "run" (the `overmind run` front end)
    package_version: str = ""


@message
class Welcome(Message):
    TYPE: ClassVar[int] = 2
    version: int
    server_pid: int
    server_version: str
    uid: int


@message
class Error(Message):
    TYPE: ClassVar[int] = 3
    code: int
    message: str
    traceback: str = ""


@message
class Load(Message):
    """Get an entry, loading it on a miss. The blob is the pickled call (see overmind.client)."""

    TYPE: ClassVar[int] = 10
    WITH_BLOB: ClassVar[bool] = True
    key: str
    target: str  # "module:qualname" of the original loader, for logs and listings
    description: str  # a short human-readable form of the call
    context: dict  # python, cwd, sys_path, env: where a loader must run
    refs: list = []  # keys of entries the call refers to
    lookup_only: bool = False  # never start a loader: NOT_FOUND on a miss
    modules: list = []  # modules the call needs, learned by the warm interpreter for later loads
    wait: bool = True  # on a miss, wait for the load; False: answer Pending at once
    program: str = ""  # the calling program (script, cwd, interpreter): Note [Prefetch] in overmind.prefetch


@message
class PlainLoaded(Message):
    """A client that got ``Pending`` ran the original itself, in ``seconds``; no answer. The
    server weighs a later caller's wait for the fill against it (Note [Joining a fill] in overmind.cold_loads)."""

    TYPE: ClassVar[int] = 17
    key: str
    seconds: float


@message
class Prefetch(Message):
    """What ``program`` loaded last time: answered with ``PrefetchReply`` (Note [Prefetch])."""

    TYPE: ClassVar[int] = 18
    program: str


@message
class PrefetchReply(Message):
    TYPE: ClassVar[int] = 19
    server_pid: int
    entries: list  # [[key, segments as in Entry.segments], ...], in the order they were loaded


@message
class Entry(Message):
    """A cache entry: segment handles (server fds) and, in the blob, the skeleton."""

    TYPE: ClassVar[int] = 11
    WITH_BLOB: ClassVar[bool] = True
    key: str
    server_pid: int
    # [[server fd, size, st_dev, st_ino], ...]; null for an unused slot. The fd number names the
    # segment for opening; (st_dev, st_ino) is what it must turn out to be once opened
    # (Note [A segment is opened by identity] in overmind.client).
    segments: list
    nbytes: int
    hit: bool
    meta: dict = {}


@message
class Pending(Message):
    """A miss the server is loading in the background (or failed to load recently)."""

    TYPE: ClassVar[int] = 14
    key: str
    loading: bool
    reason: str = ""  # why the entry cannot be had (a recent failure), empty while loading
    code: int = 0  # that failure's ErrorCode
    # The request asked to wait: the Entry or Error follows when the load ends. A client
    # knows within its short reply bound that the server is alive, and waits long only now.
    waiting: bool = False


@message
class GetFds(Message):
    """Ask for an entry's segment fds over SCM_RIGHTS (when /proc/<pid>/fd is refused)."""

    TYPE: ClassVar[int] = 12
    key: str


@message
class Fds(Message):
    TYPE: ClassVar[int] = 13
    key: str
    sizes: list  # one size per fd sent, in order


@message
class GetContents(Message):
    """A loader asks which contents sealed segments already hold (Note [Stored once by content]
    in overmind.reductions)."""

    TYPE: ClassVar[int] = 15


@message
class Contents(Message):
    """The content index, as JSON in the blob: ``{"keys": [entry key, ...], "regions":
    [[xxh3-128 hex, nbytes, key index, st_dev, st_ino, offset], ...]}``."""

    TYPE: ClassVar[int] = 16
    WITH_BLOB: ClassVar[bool] = True
    regions: int


@message
class Status(Message):
    TYPE: ClassVar[int] = 20


@message
class StatusReply(Message):
    TYPE: ClassVar[int] = 21
    info: dict


@message
class ListEntries(Message):
    TYPE: ClassVar[int] = 22


@message
class EntryList(Message):
    """The entries, as a JSON array in the blob (thousands of them exceed MAX_JSON as fields)."""

    TYPE: ClassVar[int] = 23
    WITH_BLOB: ClassVar[bool] = True
    count: int


@message
class Evict(Message):
    TYPE: ClassVar[int] = 24
    key: str = ""  # a key or a unique prefix of one
    all: bool = False


@message
class Evicted(Message):
    TYPE: ClassVar[int] = 25
    keys: list


@message
class Shutdown(Message):
    TYPE: ClassVar[int] = 26


@message
class Ok(Message):
    TYPE: ClassVar[int] = 27


@message
class Prepare(Message):
    """Start a loader for this context now, so the first load does not wait for one."""

    TYPE: ClassVar[int] = 28
    context: dict
    modules: list = []  # installed modules this client imported since it last said (Note [Warm interpreters learn])


# -- overmind run: front end <-> server <-> warm interpreter ----------------------


@message
class Run(Message):
    """Run a script in a child of a warm interpreter (``overmind run``). Carries three fds: the
    front end's stdin, stdout and stderr. The server answers RunRefused, or hands the
    connection to the warm interpreter, which answers RunStarted and, at the end, RunExited."""

    TYPE: ClassVar[int] = 30
    context: dict  # python, env: which warm interpreter (overmind.loader_pool.Context)
    spec: dict  # mode, target, argv, cwd, env, umask: what the child becomes (overmind.warm.become)


@message
class RunRefused(Message):
    """No warm run now (none ready yet, a stale or unsafe interpreter): run plainly."""

    TYPE: ClassVar[int] = 31
    reason: str


@message
class RunStarted(Message):
    TYPE: ClassVar[int] = 32
    pid: int


@message
class RunExited(Message):
    TYPE: ClassVar[int] = 33
    status: int  # the raw wait status (os.waitstatus_to_exitcode reads it)


# -- server <-> loader ---------------------------------------------------------


@message
class Warm(Message):
    """The server's first message to a new warm interpreter: the installed modules to import
    before it is ready (Note [Warm interpreters learn] in overmind.loader)."""

    TYPE: ClassVar[int] = 45
    modules: list
    refused: list = []  # never to import: they started a thread (Note [Forking past torch's thread])


@message
class Fork(Message):
    """Fork a run. Carries four fds: stdin, stdout, stderr and the front end's connection."""

    TYPE: ClassVar[int] = 46
    spec: dict


@message
class Retire(Message):
    """Stop forking; exit once every load and run in progress has finished."""

    TYPE: ClassVar[int] = 47


@message
class LoaderReady(Message):
    """A zygote loader finished importing and waits for jobs."""

    TYPE: ClassVar[int] = 40
    pid: int
    imported: list
    refused: list = []  # modules that started a thread when imported: never to be pre-imported again
    environ: dict = {}  # names and prefixes its imports read (Note [Settings an import read] in overmind.import_env)


@message
class Job(Message):
    """Run one load in a forked child. Carries one fd: the child's end of the job socket."""

    TYPE: ClassVar[int] = 41
    WITH_BLOB: ClassVar[bool] = True
    key: str
    sys_path: list
    cwd: str = "/"
    modules: list = []  # the loader child imports them; the zygote learns them after the fork, for later jobs


@message
class JobStarted(Message):
    TYPE: ClassVar[int] = 42
    key: str
    pid: int
    modules: int = 0  # installed modules the interpreter holds now
    learned: list = []  # installed modules runs imported that it did not hold (for its successor)
    environ: dict = {}  # names and prefixes its imports read since it last said (overmind.import_env)


@message
class JobResult(Message):
    """The loader's answer: the skeleton in the blob, the new segments as fds."""

    TYPE: ClassVar[int] = 43
    WITH_BLOB: ClassVar[bool] = True
    key: str
    sizes: list  # one per fd sent, in order
    slots: list  # segment slot of each fd (unused slots have no fd)
    nslots: int
    nbytes: int
    refs: list  # keys of entries whose segments this one also maps (their fds come after its own)
    meta: dict = {}


@message
class LoadMeta(Message):
    """What a loader says about its result (``JobResult.meta``, ``Entry.meta``): versioned and
    typed like a message, so the server, the registry, the client and the CLI read one schema.
    Not a message type of its own (no ``TYPE``); :meth:`from_wire` validates it."""

    VERSION: ClassVar[int] = 2
    version: int = 2
    type: str = ""  # module.qualname of the result
    pickler: str = ""
    storages: int = 0
    tensors: int = 0
    original_seconds: float = 0.0
    pack_seconds: float = 0.0
    load_seconds: float = 0.0  # set by the server: the whole fill, queueing included
    sys_path_extra: list = []  # dynamic-module folders the client must add to sys.path
    references: list = []  # keys of entries passed in and handed back unchanged
    files: list = []  # [[path, size, mtime_ns, ino, dev, ctime_ns]]: Note [Observed files] in overmind.loader
    deduplicated: int = 0  # bytes referenced in other entries' segments instead of written
    contents: list = []  # [[digest hex, nbytes, slot, offset]]: Note [Content index] in overmind.registry
    # Note [Loads that draw random numbers] in overmind.callstate: {} when the load drew none,
    # else {"start": digest of the states it started from, "end": base64 of the states it left}.
    rng: dict = {}
    events: list = []  # warnings and log records to replay: Note [Replayed warnings and log records]

    @classmethod
    def from_wire(cls, data: dict) -> "LoadMeta":
        if not isinstance(data, dict) or data.get("version") != cls.VERSION:
            raise ProtocolError(f"load metadata of version {data.get('version') if isinstance(data, dict) else None}, "
                                f"expected {cls.VERSION}")
        return decode_fields(None, data, cls)


@message
class FillProgress(Message):
    """A loader packing its result says how far it is, now and then, before its answer
    (Note [Joining a fill] in overmind.cold_loads): bytes in place and the bytes it expects."""

    TYPE: ClassVar[int] = 48
    key: str
    written: int
    expected: int
    original_seconds: float = 0.0  # its call of the original loader


@message
class JobFailed(Message):
    TYPE: ClassVar[int] = 44
    key: str
    code: int
    message: str
    traceback: str = ""
    refused: list = []  # a warm interpreter's modules that started a thread, for its successor
    environ: dict = {}  # names and prefixes its imports read since it last said (overmind.import_env)


MESSAGE_TYPES: dict[int, type[Message]] = {
    cls.TYPE: cls
    for cls in (Hello, Welcome, Error, Load, Entry, Pending, GetFds, Fds, GetContents, Contents, Status, StatusReply,
                ListEntries, EntryList, Evict, Evicted, Shutdown, Ok, Prepare, Run, RunRefused, RunStarted, RunExited,
                LoaderReady, Job, JobStarted, JobResult, FillProgress, JobFailed, Warm, Fork, Retire, PlainLoaded, Prefetch,
                PrefetchReply)
}

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
    cls = cls or MESSAGE_TYPES[mtype]
    try:
        data = json.loads(raw) if isinstance(raw, (bytes, bytearray, str)) else raw
    except (ValueError, RecursionError) as err:  # also ints over 4300 digits and deep nesting, not just syntax
        raise ProtocolError(f"{cls.__name__}: fields are not JSON ({str(err)[:200]})") from None
    if not isinstance(data, dict):
        raise ProtocolError(f"{cls.__name__}: fields must be a JSON object")
    types = {name: allowed for name, allowed, _ in cls.FIELDS}
    unknown = set(data) - set(types)
    if unknown:
        raise ProtocolError(f"{cls.__name__}: unknown fields {sorted(unknown)}")
    for name, value in data.items():
        allowed = types[name]
        if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
            raise ProtocolError(f"{cls.__name__}.{name}: expected {allowed[0].__name__}, got {type(value).__name__}")
    try:
        return cls(**data)
    except TypeError as err:
        raise ProtocolError(f"{cls.__name__}: {err}") from None


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


__all__ += ["peer_credentials", "expect", "RemoteError", "VersionMismatch", "close_fds"]
