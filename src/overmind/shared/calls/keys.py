"""A loader call as it travels to a loader process, and the cache key it maps to.

    target = Target.of(UNet2DConditionModel.from_pretrained)
    call = encode_call(target, (path,), {"torch_dtype": torch.float16}, origin_of)
    call.key, call.blob, call.refs

The blob is a pickle of ``(target spec, args, kwargs, keyed state)`` followed by a pickle of
the caller's random generator states (``overmind.shared.calls.callstate``); objects that overmind
returned earlier (``vae=vae``) travel as ``("entry", key)`` persistent ids and the
loader rebuilds them from the cache. The key hashes (xxh3-128) the first pickle
(never the generator states: Note [Loads that draw random numbers]) together with a fingerprint of every local file the arguments name and of the
library versions, so a changed file or an upgraded library is a miss.

Note [What cannot be cached]
A call goes straight to the original load function when an argument has no stable
identity: a tensor, a file-like object, a function or other callable (a callable
``map_location``), a model that overmind did not load, or anything pickle cannot
reach by reference; or when the process is in a state the loader cannot reproduce
(Note [Process-global state of a load] in ``overmind.shared.calls.callstate``). Such a call raises
:class:`Uncacheable` here, never in the loader.

Note [Canonical arguments]
Spellings that load the same thing give one key: existing relative paths become
absolute, ``torch_dtype="float16"`` / ``"torch.float16"`` become ``torch.float16``, and
``torch.device("cpu")`` becomes ``"cpu"`` for device arguments. Only arguments named as
dtypes or devices are rewritten (a ``variant="float16"`` is a file suffix, not a dtype),
and the loader receives the canonical value, which every supported loader accepts.
``"cuda"`` and ``"cuda:0"`` stay apart: which GPU ``"cuda"`` means depends on the caller.
Defaults are not filled in: a call that spells out a default is one extra miss, never a
wrong hit.
"""

from __future__ import annotations

import importlib
import io
import os
import pickle
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

__all__ = ["Target", "EncodedCall", "DecodedCall", "Uncacheable", "encode_call", "decode_call", "fingerprint_paths",
           "file_fingerprint", "library_versions", "hub_snapshot"]

PICKLE_PROTOCOL = 5
KEY_VERSION = "overmind-key-3"  # 3: fingerprints hold the ctime
_LIBRARIES = ("torch", "diffusers", "transformers", "accelerate", "bitsandbytes", "safetensors", "overmind")


class Uncacheable(Exception):
    """The call cannot be keyed; call the original load function (Note [What cannot be cached])."""


@dataclass(frozen=True)
class Target:
    """The original load function: ``getattr(owner, attr)`` in a process where nothing is patched."""

    kind: str  # "class" (owner is a class) or "module" (owner is a module name)
    owner: Any
    attr: str
    original: Callable = field(compare=False, repr=False)

    @classmethod
    def of(cls, fn: Callable) -> "Target":
        """Best-effort target for ``overmind.api.load(fn, ...)`` with an arbitrary callable."""
        owner = getattr(fn, "__self__", None)
        if isinstance(owner, type):  # a classmethod bound to a class
            return cls("class", owner, fn.__name__, fn)
        module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
        if owner is not None or not module or not qualname or "<" in qualname:
            raise Uncacheable(f"{fn!r} is not importable by name")
        return cls("module", module, qualname, fn)

    @property
    def name(self) -> str:
        if self.kind == "class":
            return f"{self.owner.__module__}:{self.owner.__qualname__}.{self.attr}"
        return f"{self.owner}:{self.attr}"

    @property
    def modules(self) -> list[str]:
        return [self.owner.__module__ if self.kind == "class" else self.owner]

    def spec(self) -> tuple:
        return (self.kind, self.owner, self.attr)


def resolve_target(spec: tuple) -> Callable:
    kind, owner, attr = spec
    if kind == "module":
        obj: Any = importlib.import_module(owner)
    elif kind == "class":
        obj = owner
    else:
        raise ValueError(f"unknown target kind {kind!r}")
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


@dataclass
class EncodedCall:
    key: str
    blob: bytes
    refs: list[str]
    description: str
    paths: list[str]
    ref_objects: dict = field(default_factory=dict)  # key -> the caller's object, for ExternalRefs
    rng_state: dict = field(default_factory=dict)  # as in the blob: Note [Loads that draw random numbers]


@dataclass
class DecodedCall:
    """A call as a loader runs it."""

    fn: Callable
    args: tuple
    kwargs: dict
    references: dict  # entry key -> the rebuilt object
    keyed_state: dict  # overmind.shared.calls.callstate.keyed_state() of the caller
    rng: bytes  # the caller's encoded generator states


def _is_torch_data(obj) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, (torch.Tensor, torch.UntypedStorage, torch.storage.TypedStorage))


class _CallPickler(pickle.Pickler):
    def __init__(self, file, origin_of: Callable[[Any], Optional[str]]) -> None:
        super().__init__(file, protocol=PICKLE_PROTOCOL)
        self.origin_of = origin_of
        self.refs: list[str] = []
        self.ref_objects: dict[str, Any] = {}

    def persistent_id(self, obj):
        if obj is None or isinstance(obj, (str, int, float, bool, bytes)):
            return None
        key = self.origin_of(obj)
        if key is not None:
            if key not in self.refs:
                self.refs.append(key)
                self.ref_objects[key] = obj
            return ("entry", key)
        if _is_torch_data(obj):
            raise Uncacheable(f"a {type(obj).__name__} argument")
        if isinstance(obj, io.IOBase) or (hasattr(obj, "read") and hasattr(obj, "seek")):
            raise Uncacheable(f"a file-like argument ({type(obj).__name__})")
        if callable(obj) and not isinstance(obj, type):
            raise Uncacheable(f"a callable argument ({type(obj).__name__}) that overmind did not load")
        return None


def _normalise(value):
    """Relative paths that exist become absolute (the key must not depend on the cwd)."""
    if isinstance(value, Path):
        return Path(os.path.abspath(value)) if value.exists() else value
    if isinstance(value, str) and value and not os.path.isabs(value) and os.path.exists(value):
        return os.path.abspath(value)
    if isinstance(value, list):
        return [_normalise(v) for v in value]
    if isinstance(value, tuple) and type(value) is tuple:
        return tuple(_normalise(v) for v in value)
    return value


_DTYPE_ARGUMENTS = frozenset({"torch_dtype", "dtype"})
_DEVICE_ARGUMENTS = frozenset({"device", "map_location", "device_map"})


def _canonical(name: str, value):
    """See Note [Canonical arguments]."""
    torch = sys.modules.get("torch")
    if torch is None:
        return value
    if name in _DTYPE_ARGUMENTS and isinstance(value, str):
        dtype = getattr(torch, value.removeprefix("torch."), None)
        return dtype if isinstance(dtype, torch.dtype) else value
    if name in _DEVICE_ARGUMENTS:
        if isinstance(value, torch.device):
            return str(value)
        if isinstance(value, str) and value not in ("auto", "balanced", "balanced_low_0", "sequential"):
            try:
                return str(torch.device(value))
            except (RuntimeError, ValueError):
                return value
    return value


def _local_paths(values) -> list[str]:
    out: list[str] = []
    for value in values:
        if isinstance(value, (list, tuple)):
            out.extend(_local_paths(value))
        elif isinstance(value, (str, Path)) and str(value) and os.path.isabs(value) and os.path.exists(value):
            out.append(str(value))
    return out


def _hub_cache() -> Path:
    env = os.environ
    if env.get("HF_HUB_CACHE"):
        return Path(env["HF_HUB_CACHE"])
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]) / "hub"
    return Path(env.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "huggingface" / "hub"


def hub_snapshot(repo_id: str, revision: Optional[str] = None) -> Optional[Path]:
    """The local snapshot folder a hub id resolves to, or None if it is not cached."""
    if repo_id.count("/") != 1 or os.path.exists(repo_id):
        return None
    repo = _hub_cache() / ("models--" + repo_id.replace("/", "--"))
    revision = revision or "main"
    ref = repo / "refs" / revision
    try:
        commit = ref.read_text().strip() if ref.is_file() else revision
    except OSError:
        return None
    snapshot = repo / "snapshots" / commit
    return snapshot if snapshot.is_dir() else None


# Note [Racy files]
# File timestamps advance with the kernel's coarse clock (a few ms), so a file rewritten
# in place twice within one tick keeps its size, inode, mtime and ctime. A call whose files
# changed too recently is therefore not cached (as git treats racy index entries): it could
# not be told apart from the next version of those files. Either timestamp makes a file racy:
# - an mtime less than RACY_SECONDS ago (or in the future). Generous, because the mtime need
#   not come from this machine's clock (`rsync -t`, `tar x`, `os.utime` copy it from elsewhere)
#   and some filesystems keep it in whole or even two seconds (FAT).
# - a ctime less than one timestamp tick ago. The kernel stamps the ctime itself, from its own
#   clock, on every change of the inode, and no user can set it: a rewrite in place with the
#   mtime put back (`rsync --inplace -t`) has an old mtime but a fresh ctime. A filesystem that
#   keeps nanoseconds stamps from a clock that moves every jiffy (at most 10 ms), so
#   CTIME_RACY_SECONDS covers a tick; one that keeps whole seconds (a ctime without
#   nanoseconds) gets RACY_SECONDS. A file saved, backdated and loaded by the next process is
#   thus still cached, as a file saved a while ago is.
RACY_SECONDS = 2.0
CTIME_RACY_SECONDS = 0.1
# A path argument that names a huge tree (a home folder, "/") is not a model: do not walk it.
MAX_FILES = 20_000


def file_fingerprint(path: str, st: os.stat_result) -> tuple:
    """(path, size, mtime_ns, inode, device, ctime_ns): Note [What a fingerprint cannot see]."""
    return (path, st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev, st.st_ctime_ns)


# Note [What a fingerprint cannot see]
# A file's fingerprint is its path, size, mtime_ns, inode, device and ctime_ns. The ctime is
# what catches a rewrite in place (same inode, same size) whose mtime was put back, since
# only the kernel sets it. It also moves on chmod, chown, a new hard link or an xattr change,
# which leave the bytes alone: such a file is one miss (a new load), never a wrong hit.
# Still not caught:
# - a change that keeps the ctime: the system clock set back (CAP_SYS_TIME) and a rewrite at
#   the same instant, bytes written under the filesystem (the block device, debugfs), or a
#   filesystem that reports no real ctime (some FUSE and network filesystems);
# - a change on a network filesystem that this machine's attribute cache has not seen yet
#   (NFS keeps attributes for up to acregmax, 60 s by default; opening the file would
#   revalidate them, a stat does not), and a ctime stamped by a file server whose clock
#   lags ours, which can pass the racy check within one of its ticks;
# - a file read by neither an argument path nor an open or mapping the loader saw (Note
#   [Observed files] in overmind.warm.loader); and observed files are not checked for racy
#   timestamps: one rewritten twice within one tick, around the load, looks unchanged.


def _racy(entry: tuple, now_ns: int) -> bool:
    """Note [Racy files]."""
    mtime_ns, ctime_ns = entry[2], entry[5]
    ctime_window = RACY_SECONDS if ctime_ns % 1_000_000_000 == 0 else CTIME_RACY_SECONDS
    return mtime_ns > now_ns - int(RACY_SECONDS * 1e9) or ctime_ns > now_ns - int(ctime_window * 1e9)


def fingerprint_paths(paths: list[str], now: Optional[float] = None) -> list[tuple]:
    """:func:`file_fingerprint` of every file under ``paths`` (symlinks followed).

    Raises Uncacheable if a file changed too recently to be fingerprinted (Note [Racy files]).
    """
    import time

    now_ns = int((time.time() if now is None else now) * 1e9)
    out: list[tuple] = []
    for path in sorted(set(paths)):
        try:
            st = os.stat(path)
        except OSError:
            continue
        if not os.path.isdir(path):
            out.append(file_fingerprint(path, st))
        else:  # the files below say what changed; the folder's own mtime moves with any cache file
            for root, dirs, files in os.walk(path):
                # Bytecode caches change when anything imports from the folder; they are not data.
                dirs[:] = sorted(d for d in dirs if d != "__pycache__")
                for name in sorted(files):
                    if name.endswith(".pyc"):
                        continue
                    full = os.path.join(root, name)
                    if len(out) >= MAX_FILES:
                        raise Uncacheable(f"{path} holds more than {MAX_FILES} files")
                    try:
                        st = os.stat(full)
                    except OSError:
                        continue
                    out.append(file_fingerprint(full, st))
    for entry in out:
        if _racy(entry, now_ns):
            raise Uncacheable(f"{entry[0]} was modified too recently to be told from its next version")
    return out


_versions: Optional[tuple] = None


def library_versions() -> tuple:
    """Versions of the libraries that shape a load, from their dist-info folder names.

    A directory listing per ``sys.path`` entry; ``importlib.metadata`` parses every
    METADATA file and costs ~10 ms, on the warm path of every process. Each entry's listing is
    kept while the folder's mtime stays (installing or removing a package changes it), so a run
    forked from a warm interpreter, which computed them, lists only its own script's folder.
    """
    global _versions
    path = tuple(sys.path)
    if _versions is None or _versions[0] != path:
        found: dict[str, str] = {}
        for entry in path:
            for name, version in _dist_infos(entry or "."):
                found.setdefault(name, version)
        _versions = (path, (sys.version_info[:3], tuple((n, found.get(n)) for n in _LIBRARIES)))
    return _versions[1]


_listings: dict[str, tuple[int, list]] = {}  # sys.path entry -> (its mtime_ns, [(name, version)])


def _dist_infos(entry: str) -> list:
    """The (name, version) of each of _LIBRARIES' dist-info or egg-info folders in ``entry``."""
    try:
        mtime = os.stat(entry).st_mtime_ns
    except OSError:
        return []
    known = _listings.get(entry)
    if known is not None and known[0] == mtime:
        return known[1]
    try:
        names = os.listdir(entry)
    except OSError:
        return []
    found = []
    for fname in names:
        for suffix in (".dist-info", ".egg-info"):
            if fname.endswith(suffix):
                name, _, version = fname[: -len(suffix)].partition("-")
                name = name.lower().replace("_", "-")
                if name in _LIBRARIES:
                    found.append((name, version))
    _listings[entry] = (mtime, found)
    return found


def _describe(target: Target, args: tuple, kwargs: dict) -> str:
    def short(v) -> str:
        if v is None or isinstance(v, (str, int, float, bool, Path)):
            text = repr(v)
        elif isinstance(v, (list, tuple)):
            text = "[" + ", ".join(short(x) for x in v[:4]) + (", ..." if len(v) > 4 else "") + "]"
        elif type(v).__module__ == "torch" and type(v).__name__ == "dtype":
            text = str(v)
        else:
            text = f"<{type(v).__name__}>"  # repr of a model costs milliseconds
        if len(text) <= 80:
            return text
        return "..." + text[-77:] if isinstance(v, (str, Path)) else text[:77] + "..."  # a path's tail says most

    parts = [short(a) for a in args] + [f"{k}={short(v)}" for k, v in kwargs.items()]
    return f"{target.name}({', '.join(parts)})"[:300]


def encode_call(target: Target, args: tuple, kwargs: dict, origin_of: Callable[[Any], Optional[str]]) -> EncodedCall:
    import xxhash

    from overmind.shared.calls import callstate

    reason = callstate.bypass_reason()
    if reason is not None:
        raise Uncacheable(reason)
    args = tuple(_normalise(a) for a in args)
    kwargs = {k: _canonical(k, _normalise(v)) for k, v in sorted(kwargs.items())}
    buf = io.BytesIO()
    pickler = _CallPickler(buf, origin_of)
    try:
        pickler.dump((target.spec(), args, kwargs, callstate.keyed_state()))
    except Uncacheable:
        raise
    except (pickle.PicklingError, TypeError, AttributeError) as err:
        raise Uncacheable(f"arguments are not picklable by reference ({err})") from None
    keyed = buf.getvalue()
    rng_state = callstate.rng_state()
    rng = callstate.encode_rng(rng_state)
    paths = _local_paths(list(args) + list(kwargs.values()))
    hub = []
    for value in list(args[:1]) + [kwargs.get("pretrained_model_name_or_path")]:
        if isinstance(value, str) and value not in paths:
            snapshot = hub_snapshot(value, kwargs.get("revision"))
            if snapshot is not None:
                hub.append(str(snapshot))
    digest = xxhash.xxh3_128()
    digest.update(KEY_VERSION.encode())
    digest.update(keyed)
    digest.update(repr((fingerprint_paths(paths + hub), library_versions())).encode())
    return EncodedCall(digest.hexdigest(), keyed + rng, pickler.refs, _describe(target, args, kwargs), paths + hub,
                       pickler.ref_objects, rng_state)


def decode_call(blob: bytes, resolve_entry: Callable[[str], Any]) -> DecodedCall:
    """The call an ``encode_call`` blob holds, in a loader process."""
    resolved: dict[str, Any] = {}

    class _Unpickler(pickle.Unpickler):
        def persistent_load(self, pid):
            if not (isinstance(pid, tuple) and len(pid) == 2 and pid[0] == "entry"):
                raise pickle.UnpicklingError(f"unknown persistent id {pid!r} in a call")
            key = pid[1]
            if key not in resolved:
                resolved[key] = resolve_entry(key)
            return resolved[key]

    buf = io.BytesIO(blob)
    spec, args, kwargs, keyed = _Unpickler(buf).load()
    return DecodedCall(resolve_target(spec), args, kwargs, resolved, keyed, buf.read())
