"""The wire protocol's vocabulary: constants, error codes, and the typed ``Message`` base.
Standard library only. See the package docstring (``overmind.shared.protocol``)."""

from __future__ import annotations

import json
import struct
from typing import Any, ClassVar

__all__ = ["MAGIC", "PROTOCOL_VERSION", "HEADER", "MAX_JSON", "MAX_BLOB", "MAX_FDS", "ErrorCode", "ProtocolError",
           "VersionMismatch", "Message", "message"]

MAGIC = b"OVMD"
PROTOCOL_VERSION = 8  # 8: rehearsals (Load, Prefetch) and a program in Prepare and Warm; 7: FileContents
HEADER = struct.Struct("<4sHHIQ")
MAX_JSON = 1 << 20  # 1 MiB of fields
MAX_BLOB = 1 << 31  # 2 GiB: skeletons of very large pipelines (tokenizer vocabularies) stay well below
MAX_FDS = 64


class ErrorCode:
    """Numeric error codes shared by both ends of the socket."""

    BAD_REQUEST = 1
    VERSION_MISMATCH = 2
    NOT_FOUND = 3
    LOADER_FAILED = 4  # the original load function raised; the traceback travels along
    LOADER_CRASHED = 5  # the loader process died (signal, exit) before answering
    LOADER_TIMEOUT = 6
    PERMISSION_DENIED = 7
    SHUTTING_DOWN = 8
    TOO_LARGE = 9
    INTERNAL = 10
    BUSY = 11  # too many connections: Note [Every peer is bounded] in overmind.server.connections
    NOT_FORKABLE = 12  # a warm interpreter that changed (stale modules, a new thread) refuses to fork
    CANNOT_CACHE = 13  # the original returned, but its result could not be cached (pickling, packing)
    # The result's weights are not in it (disk offload): callers load plainly, silently, and the
    # server remembers the key. Note [Results that cannot be rebuilt] in overmind.shared.segments.quirks.
    NOT_REBUILDABLE = 14
    # A run's environment differs from the one a warm interpreter's imports read (Note [Settings an
    # import read] in overmind.shared.settings.import_env): the run goes plain; the interpreter stays.
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

    Not ``dataclasses``: generating one per message type costs ~10 ms, paid by every user
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

    @classmethod
    def from_fields(cls, raw: Any) -> "Message":
        """This message from its JSON bytes or an already parsed dict, every field checked
        against its declared type (Note [Frames are untrusted] in overmind.shared.protocol)."""
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
                raise ProtocolError(f"{cls.__name__}.{name}: expected {allowed[0].__name__}, "
                                    f"got {type(value).__name__}")
        try:
            return cls(**data)
        except TypeError as err:
            raise ProtocolError(f"{cls.__name__}: {err}") from None

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
