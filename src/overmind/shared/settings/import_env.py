"""What a warm interpreter's imports read from the environment. Standard library only.

The warm interpreter (overmind.warm.interpreter) records while it imports; the server (overmind.server.pool)
keys interpreters on the caller's values of what was read::

    with recording() as reads:
        import torch._inductor.config
    reads.names       # {"TORCHINDUCTOR_FX_GRAPH_CACHE": None, ...}: name -> value seen (None: unset)
    reads.prefixes    # {"TQDM_"}: an iteration of os.environ kept the names starting so
    reads.unbounded   # "" or where an iteration or copy used names in a way not followed
    differs(run_env, os.environ, reads.names, reads.prefixes)   # "" or the variable that differs

Note [Settings an import read]
A module reads settings from the environment while it is imported (torch._inductor.config reads
~300 TORCHINDUCTOR_*/TORCHDYNAMO_* names, tqdm every TQDM_*, diffusers any COLAB_*) and keeps
them in module state; a run forked from an interpreter that imported it sees the interpreter's
settings, not its own. No list of prefixes names them all (libraries pick any name), so while
the interpreter imports, ``os.environ``'s class is swapped for one that records:
- a keyed read (``[]``, ``get``, ``in``, ``os.getenv``, ``setdefault``, ``pop``): the name and
  the value it saw, unset included;
- an iteration (``for``, ``keys``, ``items``, ``copy``, ``dict(os.environ)``): each name it hands
  out is a ``str`` subclass that follows what is done with it. ``name.startswith(p)`` records the
  prefix ``p`` (every variable starting so counts, present or not), ``name == "X"`` records X;
  anything else done to a name no prefix selected (a regex, ``lower()``, a lookup in a copy,
  never looking at it) cannot be followed (``unbounded`` says where, for the log). That is not
  taken as depending on the whole environment: fsspec copies ``os.environ`` when diffusers
  imports it (and only looks for ``FSSPEC_*`` in the copy), so every warm run of a diffusers
  script would go plain; a setting read that way is not part of the context.
A run is forked only where its values of every recorded name and prefix equal the interpreter's;
the server keys interpreters on the caller's values of the names its context's interpreters
reported, so a caller with other values gets an interpreter imported under its own
(Note [Environment that selects an interpreter] in overmind.shared.settings.config). Not seen: ``os.environb``,
``os.environ._data`` and C ``getenv`` (torch's C++ reads TORCH_*, OpenMP reads OMP_*): those
stay covered by ENV_PREFIXES. ``OVERMIND_*`` is never recorded: the server sets the
interpreter's own, and overmind reads its settings when called, not when imported.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager

__all__ = ["Reads", "recording", "differs", "select", "reads_from_wire", "MAX_NAMES", "MAX_PREFIXES", "INTERPRETERS_OWN"]

MAX_NAMES = 20000  # names one context's interpreters may report (torch + inductor read ~400)
MAX_PREFIXES = 256
MAX_NAME_LEN = 256
_OWN = "OVERMIND_"
# Set by the warm interpreter itself for its own imports, the caller's value given back to each
# child (Note [Warm interpreters never touch CUDA] in overmind.server.pool): never a reason to refuse
# a run, whatever the run's value.
INTERPRETERS_OWN = frozenset({"PYTORCH_NVML_BASED_CUDA_CHECK"})

_active: "Reads | None" = None


class Reads:
    def __init__(self) -> None:
        self.names: dict[str, str | None] = {}  # first value seen: what the import decided on
        self.prefixes: set[str] = set()
        self.unbounded = ""
        self.keys: list[_Key] = []  # names handed out by iterations now recording

    def read(self, name: str, value: str | None) -> None:
        if not _ours(name):
            self.names.setdefault(name, value)

    def lose(self, why: str) -> None:
        if not self.unbounded:
            try:
                frame = sys._getframe(3)
                why += f" at {frame.f_code.co_filename}:{frame.f_lineno}"
            except ValueError:
                pass
            self.unbounded = why

    def close(self) -> None:
        """Names an iteration handed out and nobody looked at: what became of them is unknown."""
        for key in self.keys:
            if not _state(key).get("used"):
                self.lose(f"os.environ iterated and {str.__str__(key)!r} used untraced")
                break
        self.keys.clear()


def _state(key: "_Key") -> dict:
    return object.__getattribute__(key, "__dict__")


def _plain(name) -> str:
    return str.__getitem__(name, slice(None)) if isinstance(name, _Key) else name


class _Key(str):
    """A name handed out by iterating os.environ while recording (Note [Settings an import read])."""

    def __getattribute__(self, attr: str):
        if _active is not None and attr == "startswith":
            return lambda prefix, *args: _startswith(self, prefix, *args)
        if _active is not None and not attr.startswith("__"):
            _other(self)
        return str.__getattribute__(self, attr)

    def __eq__(self, other):
        reads = _active
        if reads is not None:
            state = _state(self)
            if isinstance(other, str) and not isinstance(other, _Key):
                os.environ.get(other)  # recorded: the import looked for that name
                state["used"] = True
                state["matched"] = state.get("matched") or str.__eq__(self, other)
            else:
                _other(self)
        return str.__eq__(self, other)

    def __ne__(self, other):
        return not self.__eq__(other)


def _startswith(key: _Key, prefix, *args) -> bool:
    result = str.startswith(key, prefix, *args)
    reads = _active
    if reads is not None:
        state = _state(key)
        prefixes = prefix if isinstance(prefix, tuple) else (prefix,)
        if args or not all(isinstance(p, str) and p for p in prefixes):  # "" would be every name
            _other(key)
        else:
            reads.prefixes.update(_plain(p) for p in prefixes)
            state["used"] = True
            state["matched"] = state.get("matched") or result
    return result


def _other(key: _Key) -> None:
    state = _state(key)
    state["used"] = True
    if _active is not None and not state.get("matched"):
        _active.lose(f"os.environ iterated and {str.__str__(key)!r} used other than by startswith or ==")


def _opaque(name: str):
    method = getattr(str, name)

    def traced(self, *args):
        if _active is not None:
            _other(self)
        return method(self, *args)

    traced.__name__ = name
    return traced


for _name in ("__hash__", "__getitem__", "__contains__", "__len__", "__iter__", "__add__", "__mul__", "__rmul__",
              "__mod__", "__format__", "__str__", "__repr__", "__lt__", "__le__", "__gt__", "__ge__"):
    setattr(_Key, _name, _opaque(_name))


class _RecordingEnviron(os._Environ):  # type: ignore[name-defined]  # same layout: __class__ can be swapped
    def __getitem__(self, key):
        name = _plain(key)  # an iteration's own read of a name it handed out: its filter decides
        if isinstance(key, _Key):
            return os._Environ.__getitem__(self, name)  # type: ignore[attr-defined]
        try:
            value = os._Environ.__getitem__(self, name)  # type: ignore[attr-defined]
        except KeyError:
            if _active is not None and isinstance(name, str):
                _active.read(name, None)
            raise
        if _active is not None:
            _active.read(name, value)
        return value

    def __iter__(self):
        for name in os._Environ.__iter__(self):  # type: ignore[attr-defined]
            reads = _active
            if reads is None:
                yield name
                continue
            key = _Key(name)
            reads.keys.append(key)
            yield key

    def __repr__(self) -> str:
        if _active is not None:
            _active.lose("os.environ printed")
        return os._Environ.__repr__(self)  # type: ignore[attr-defined]


@contextmanager
def recording(reads: Reads):
    """Record into ``reads`` what os.environ is asked while the block runs (not nested: an inner
    block records into the outer one's ``reads``)."""
    global _active
    if _active is not None:
        yield _active
        return
    original = type(os.environ)
    _active = reads
    os.environ.__class__ = _RecordingEnviron
    try:
        yield reads
    finally:
        os.environ.__class__ = original
        _active = None
        reads.close()


def _ours(name: str) -> bool:
    return name.startswith(_OWN) or name in INTERPRETERS_OWN


def differs(run_env, own_env, names, prefixes) -> str:
    """The first variable whose value in ``run_env`` is not the one the imports read, or ""."""
    def show(value):
        return "unset" if value is None else repr(value[:80])

    for name, value in names.items():
        if run_env.get(name) != value:
            return f"{name} is {show(run_env.get(name))} here but was {show(value)} when the interpreter imported"
    for prefix in prefixes:
        for name in {*run_env, *own_env}:
            if name.startswith(prefix) and not _ours(name) and run_env.get(name) != own_env.get(name):
                return (f"{name} is {show(run_env.get(name))} here but {show(own_env.get(name))} in the interpreter, "
                        f"whose imports read every {prefix}* variable")
    return ""


def select(env: dict, names, prefixes) -> dict:
    """The caller's values of ``names`` and of every variable starting with one of ``prefixes``."""
    chosen = {n: env[n] for n in names if n in env}
    if prefixes:
        prefixes = tuple(prefixes)
        chosen.update((n, v) for n, v in env.items() if n.startswith(prefixes) and not _ours(n))
    return {n: v for n, v in chosen.items() if isinstance(n, str) and isinstance(v, str)}


def reads_from_wire(data) -> tuple[list, list]:
    """(names, prefixes) a warm interpreter reported, validated: Note [Frames are untrusted] in
    overmind.shared.protocol. Anything malformed is dropped, never fatal."""
    if not isinstance(data, dict):
        return [], []

    def strings(value, limit: int) -> list:
        if not isinstance(value, list):
            return []
        return [s for s in value[:limit] if isinstance(s, str) and 0 < len(s) <= MAX_NAME_LEN and "=" not in s
                and "\0" not in s]

    return strings(data.get("names"), MAX_NAMES), strings(data.get("prefixes"), MAX_PREFIXES)
