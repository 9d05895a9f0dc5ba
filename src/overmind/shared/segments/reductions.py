"""Pickle with torch storages moved into sealed segments, and zero-copy unpickle.

    packed = pack(model, name="unet")          # loader side
    packed.segments, packed.skeleton           # fds handed to the server

    obj = unpack(packed.skeleton, [s.map_private() for s in segments])   # client side

The pickle (the *skeleton*) holds everything but tensor bytes. Each distinct storage
is copied once into a new sealed segment (by a fill thread of ``overmind.shared.segments.writer``,
where it goes: Notes [Parallel fill] and [Same alignment, same numbers] there) or found in
an existing one, and each
tensor or storage in the object graph becomes a persistent id: an index into a small
table of :class:`StorageRef` and :class:`TensorRef` records stored beside the pickle.
Unpickling maps each segment once, builds every table entry over that mapping with
:func:`overmind.shared.segments.native.make_untyped_storage`, then runs the pickle with
``persistent_load = table.__getitem__`` (``overmind.shared.segments.unpickler``).

Note [Skeleton format is versioned]
A skeleton may be read by a different overmind build than the one that wrote it
(several processes share one server). It is a pickled ``(FORMAT, storages, objects,
payload)`` tuple of plain values; ``FORMAT`` is bumped whenever a record changes and
an unknown format is a clear error. Nothing of overmind's is named inside the pickle
(except the fixed-path rebuild functions of Note [Extra reducers]), so modules can
move freely.

Note [Tensors as table entries]
Torch's own tensor reduction costs ~25 us a tensor to unpickle (fake-mode checks,
TypedStorage wrappers, a Python frame per tensor): most of a warm load. Plain strided
tensors and ``nn.Parameter``\\s (with at most simple attributes) are built in one loop
before unpickling, and the pickle refers to them by index, resolved in C by
``list.__getitem__``. Anything unusual (subclasses, hooks, conjugate bits, sparse or
quantized layouts) takes torch's path, with its storage still a table entry.

Note [One mapping per load]
``unpack`` maps every segment afresh, so two loads in one process never share pages
they can write: a ``mul_`` on one copy faults a private page and leaves the other
copy, and the sealed segment, untouched (Note [Sealed segments are immutable] in
``overmind.shared.segments.memfd``).

Note [Tied weights and views]
Storages are placed once per ``(data_ptr, nbytes)`` and tensors once per object, so
views, tied weights (``lm_head.weight is embed_tokens.weight``) and the ``vae=vae``
pattern keep sharing memory and identity after a round trip.

Note [Stored once by content]
Loaders pack with a :class:`ContentStore` (``overmind.warm.dedup``): every storage of at
least ``DEDUP_MIN_BYTES`` is hashed (xxh3-128) from the loader's own memory right
before it is written, and if a sealed segment already holds those bytes the storage
table points there instead of copying (``ControlNetModel.from_unet``, one model saved
under two paths). Each region is used by at most one storage of a pack, so two
storages that were distinct before pickling stay distinct after (Note [One mapping
per load] then keeps loads apart). Smaller storages are not worth a table record.
Every storage hashed is reported in ``Packed.contents`` for the server's index.

Note [Extra reducers]
Some third-party tensor subclasses lose their class through torch's own reduction
(``Parameter.__reduce_ex__`` rebuilds a plain ``nn.Parameter``). ``overmind.shared.segments.quirks``
registers reducers for such exact types with :func:`register_reducer`, once their
library is imported; the picklers consult them through ``dispatch_table`` (a C-level
lookup, so other objects pay nothing). Their rebuild functions are named inside stored
skeletons and therefore live at fixed import paths.
"""

from __future__ import annotations

import collections
import copyreg
import gc
import io
import logging
import mmap
import os
import pickle
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Optional, Protocol, Sequence

import torch

from overmind.shared.segments.memfd import Segment, buffer_at
from overmind.shared.segments.native import build_tensors, make_untyped_storage
from overmind.shared.segments.unpickler import table_unpickler
from overmind.shared.segments.writer import SegmentWriter

logger = logging.getLogger(__name__)

__all__ = ["FORMAT", "StorageRef", "TensorRef", "Packed", "pack", "unpack", "PICKLE_PROTOCOL", "ContentStore",
           "DEDUP_MIN_BYTES", "register_reducer", "hash_regions"]

PICKLE_PROTOCOL = 5
FORMAT = "overmind-skeleton-2"
_SIMPLE = (bool, int, float, str, type(None))
# Note [Objects persistent_id passes over]
# The pickler asks persistent_id about every object of the skeleton: 68,000 for the ControlNet
# pipeline, nearly all of them strings, tuples, classes and the OrderedDicts of its modules, and
# most of a file-backed pack's time went into asking. Immutable scalars and classes are never a
# reference, a tensor or a storage, so they are passed over first; containers only after the
# reference lookup, since a load may return a dict (torch.load) that a later call is handed back.
_NEVER_PERSISTENT = frozenset({bool, int, float, str, bytes, type(None), type})
_CONTAINERS = frozenset({tuple, list, dict, set, frozenset, collections.OrderedDict})


class StorageRef(NamedTuple):
    """Where one storage's bytes live (an entry of the skeleton's storage table)."""

    segment: int  # index into the entry's segment list
    offset: int
    nbytes: int
    device: str  # where the storage lived when pickled; rebuilt there


class TensorRef(NamedTuple):
    """A plain strided tensor or Parameter (an entry of the object table)."""

    storage: int  # index into the storage table
    dtype: str
    offset: int  # in elements
    size: tuple
    stride: tuple
    requires_grad: bool
    parameter: bool
    state: Optional[tuple] = None  # simple instance attributes, e.g. transformers' _is_hf_initialized


class TypedStorageRef(NamedTuple):
    storage: int
    dtype: Optional[str]  # None: an UntypedStorage


class ScriptModuleRef(NamedTuple):
    """A TorchScript module, stored as its ``torch.jit.save`` archive (it cannot be pickled)."""

    archive: bytes


class ExternalRef(NamedTuple):
    """An object the unpickling side already has (an argument it passed in, ``vae=vae``)."""

    key: str


# Exact type -> reducer(obj) returning a reduce tuple; see Note [Extra reducers].
_extra_reducers: dict[type, Callable] = {}


def register_reducer(cls: type, reducer: Callable) -> None:
    """Pickle instances of exactly ``cls`` with ``reducer(obj)`` in :func:`pack` (Note [Extra reducers])."""
    _extra_reducers[cls] = reducer


def _dispatch_table() -> Optional[dict]:
    return {**copyreg.dispatch_table, **_extra_reducers} if _extra_reducers else None


# Storages this large are hashed and stored once by content: Note [Stored once by content].
DEDUP_MIN_BYTES = 64 << 10


class ContentStore(Protocol):
    """Sealed segments that already hold some contents (Note [Stored once by content])."""

    def find(self, digest: bytes, nbytes: int) -> Optional[tuple[int, int]]:
        """``(external segment number, offset)`` of a region holding exactly these bytes, not
        returned before to this pack, or None."""

    def in_file(self, address: int, nbytes: int) -> Optional[tuple[int, int]]:
        """``(external segment number, offset)`` where the ``nbytes`` at ``address`` are a model
        file's own pages (Note [File-backed segments] in overmind.shared.segments.memfd), or None."""

    def may_hold(self, address: int, nbytes: int) -> bool:
        """Whether a region it could return may hold the ``nbytes`` at ``address``; False only when
        none can, so their hash may wait (Note [Hashing a file's storages after the answer] in
        overmind.warm.loader, Note [Probing before hashing] in overmind.warm.dedup)."""

@dataclass
class Packed:
    skeleton: bytes
    # New sealed segments, one per fill thread; None where a thread wrote nothing. Storages
    # found in a ContentStore refer to segment len(segments) + (the store's segment number).
    segments: list[Optional[Segment]]
    nbytes: int  # bytes written into the new segments
    storages: int  # distinct storages referenced
    tensors: int  # table tensors
    pickler: str  # "pickle" or "dill"
    # (xxh3-128 hex digest, nbytes, segment, offset) of every hashed storage, written or found.
    contents: list = field(default_factory=list)
    deduplicated: int = 0  # bytes found in a ContentStore instead of written
    # (address, nbytes, segment, offset) of storages placed in a model file unhashed, for
    # hash_regions: Note [Hashing a file's storages after the answer] in overmind.warm.loader
    unhashed: list = field(default_factory=list)

    def map_private(self) -> list[Optional[mmap.mmap]]:
        """Map every new segment copy-on-write (for tests and in-process use)."""
        return [seg.map_private() if seg is not None else None for seg in self.segments]

    def handles(self) -> list[Optional[tuple[int, int]]]:
        return [(seg.fd, seg.size) if seg is not None else None for seg in self.segments]

    def close(self) -> None:
        for seg in self.segments:
            if seg is not None:
                seg.close()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise pickle.UnpicklingError(f"unknown dtype {name!r} in a skeleton")
    return dtype


class _Tables:
    """Pickling state: storage placement and the object table."""

    def __init__(self, name: str, store: Optional[ContentStore], writers: int,
                 references: Optional[dict[int, str]] = None, progress: Optional[Callable[[int], None]] = None,
                 hash_files_later: bool = False) -> None:
        self.store = store
        self.progress = progress
        self.hash_files_later = hash_files_later
        self.contents: list[tuple[str, int, int, int]] = []
        self.unhashed: list[tuple[int, int, int, int]] = []
        self.deduplicated = 0
        self.references = references or {}
        self.writers = [SegmentWriter(f"{name}.{i}", progress) for i in range(max(1, writers))]
        self.storages: list[StorageRef] = []
        self.storage_index: dict[tuple[int, int, str], int] = {}
        self.objects: list[tuple] = []
        self.object_index: dict[tuple, int] = {}
        self.keepalive: list[object] = []  # id() keys stay unique while pickling
        self.written = 0

    def storage(self, untyped: torch.UntypedStorage) -> int:
        device = untyped.device
        if device.type == "meta":
            raise pickle.PicklingError("cannot cache a tensor on the meta device: it has no data")
        nbytes = untyped.nbytes()
        key = (untyped.data_ptr(), nbytes, str(device))
        index = self.storage_index.get(key)
        if index is not None:
            return index
        # CUDA bytes are copied to host once; the client rebuilds them on their device.
        source = untyped if device.type == "cpu" else untyped.cpu()
        if self.store is not None and nbytes >= DEDUP_MIN_BYTES:
            where = self._place_by_content(source, nbytes)
        else:
            where = self._write(source, nbytes)
        index = len(self.storages)
        self.storages.append(StorageRef(where[0], where[1], nbytes, str(device)))
        self.storage_index[key] = index
        return index

    def _place_by_content(self, source: torch.UntypedStorage, nbytes: int) -> tuple[int, int]:
        """Find the bytes in the store, else write them: Note [Stored once by content]."""
        import xxhash  # packing only: keep unpack's imports light

        may_hold = getattr(self.store, "may_hold", None)
        if self.hash_files_later and may_hold is not None and not may_hold(source.data_ptr(), nbytes):
            found = self._in_file(source, nbytes)
            if found is not None:  # Note [Hashing a file's storages after the answer] in overmind.warm.loader
                self.unhashed.append((source.data_ptr(), nbytes, *found))
                return found
        digest = xxhash.xxh3_128_digest(buffer_at(source.data_ptr(), nbytes))
        found = self.store.find(digest, nbytes)
        if found is not None:
            where = (len(self.writers) + found[0], found[1])
            self.deduplicated += nbytes
            if self.progress is not None:
                self.progress(nbytes)
        else:
            where = self._write(source, nbytes)
        self.contents.append((digest.hex(), nbytes, where[0], where[1]))
        return where

    def _write(self, source: torch.UntypedStorage, nbytes: int) -> tuple[int, int]:
        if nbytes == 0:
            return 0, 0
        found = self._in_file(source, nbytes)
        if found is not None:
            return found
        number = min(range(len(self.writers)), key=lambda i: self.writers[i].end)
        writer = self.writers[number]
        offset = writer.reserve(nbytes, source.data_ptr())
        writer.write(offset, source.data_ptr(), nbytes, source)
        self.written += nbytes
        return number, offset

    def _in_file(self, source: torch.UntypedStorage, nbytes: int) -> Optional[tuple[int, int]]:
        """Where the store finds the storage's bytes as a model file's own pages (Note [File-backed
        segments] in overmind.shared.segments.memfd), as placed; None: they are to be written."""
        # Small storages are copied: a file segment for a few of them would hold the whole file.
        in_file = getattr(self.store, "in_file", None) if nbytes >= DEDUP_MIN_BYTES else None
        found = in_file(source.data_ptr(), nbytes) if in_file is not None else None
        if found is None:
            return None
        if self.progress is not None:
            self.progress(nbytes)
        return len(self.writers) + found[0], found[1]

    def add_object(self, key: tuple, record: tuple, keep: object) -> int:
        index = self.object_index.get(key)
        if index is None:
            index = len(self.objects)
            self.objects.append(record)
            self.object_index[key] = index
            self.keepalive.append(keep)
        return index

    def finish(self) -> list[Optional[Segment]]:
        return [writer.finish() for writer in self.writers]

    def abort(self) -> None:
        for writer in self.writers:
            writer.abort()


class _SkeletonPickling:
    """persistent_id, shared by the stdlib and the dill pickler."""

    _tables: _Tables

    def persistent_id(self, obj):  # pickle hook, called for every object: Note [Objects persistent_id passes over]
        cls = type(obj)
        if cls in _NEVER_PERSISTENT:
            return None
        if self._tables.references:
            key = self._tables.references.get(id(obj))
            if key is not None:
                return self._tables.add_object(("r", key), ExternalRef(key), obj)
        if cls in _CONTAINERS:
            return None
        if cls is torch.Tensor or cls is torch.nn.Parameter:
            return self._tensor(obj, cls is torch.nn.Parameter)
        if cls is torch.storage.TypedStorage:
            index = self._tables.storage(obj._untyped_storage)
            return self._tables.add_object(("s", index, obj.dtype), TypedStorageRef(index, _dtype_name(obj.dtype)), obj)
        if cls is torch.UntypedStorage:
            index = self._tables.storage(obj)
            return self._tables.add_object(("s", index, None), TypedStorageRef(index, None), obj)
        if isinstance(obj, torch.jit.ScriptModule):
            archive = io.BytesIO()
            torch.jit.save(obj, archive)
            return self._tables.add_object(("j", id(obj)), ScriptModuleRef(archive.getvalue()), obj)
        return None

    def _tensor(self, t: torch.Tensor, parameter: bool):
        if (
            t.layout != torch.strided
            or t.device.type not in ("cpu", "cuda")
            or t.is_quantized
            or t.is_conj()
            or t.is_neg()
            or (t.__dict__ and not all(type(v) in _SIMPLE for v in t.__dict__.values()))
            or getattr(t, "_backward_hooks", None)
            or (not parameter and t.grad_fn is not None)
        ):
            return None  # torch's reduction, see Note [Tensors as table entries]
        key = ("t", id(t))
        index = self._tables.object_index.get(key)
        if index is not None:
            return index
        storage = self._tables.storage(t.untyped_storage())
        record = TensorRef(storage, _dtype_name(t.dtype), t.storage_offset(), tuple(t.size()), tuple(t.stride()),
                           t.requires_grad, parameter, tuple(t.__dict__.items()) if t.__dict__ else None)
        return self._tables.add_object(key, record, t)


class _StdlibPickler(_SkeletonPickling, pickle.Pickler):
    def __init__(self, file, tables: _Tables) -> None:
        table = _dispatch_table()
        if table is not None:
            self.dispatch_table = table  # read once by the C pickler's __init__
        super().__init__(file, protocol=PICKLE_PROTOCOL)
        self._tables = tables


def _dill_pickler(file, tables: _Tables):
    import dill

    class _DillPickler(_SkeletonPickling, dill.Pickler):
        pass

    pickler = _DillPickler(file, protocol=PICKLE_PROTOCOL, recurse=True)
    pickler._tables = tables
    table = _dispatch_table()
    if table is not None:
        pickler.dispatch_table = table
    return pickler


def default_writers() -> int:
    return max(1, min(2, os.cpu_count() or 1))


def pack(obj, name: str = "overmind", store: Optional[ContentStore] = None, writers: Optional[int] = None,
         references: Optional[dict[int, str]] = None, progress: Optional[Callable[[int], None]] = None,
         hash_files_later: bool = False) -> Packed:
    """Pickle ``obj`` with its storages copied into new sealed segments.

    Stdlib pickle first; if it cannot handle an object (local functions, lambdas),
    the whole object is pickled again with dill, reusing the storages already copied.
    ``references`` maps ``id(object)`` to a key for objects the unpickling side will
    supply itself (``unpack(..., references={key: object})``). With a ``store``, large
    storages whose bytes it already holds are not copied: Note [Stored once by content].
    ``progress`` is called with the bytes of each storage once they are in place (from the
    fill threads too), for a loader's progress reports. ``hash_files_later``: storages the
    store places in a model file and could not find by content are left unhashed, in
    ``Packed.unhashed`` (Note [Hashing a file's storages after the answer] in overmind.warm.loader).
    """
    tables = _Tables(name, store, writers or default_writers(), references, progress, hash_files_later)
    payload = io.BytesIO()
    used = "pickle"
    try:
        try:
            _StdlibPickler(payload, tables).dump(obj)
        except (pickle.PicklingError, TypeError, AttributeError) as err:
            logger.debug("stdlib pickle failed (%s); retrying with dill", err)
            payload = io.BytesIO()
            used = "dill"
            _dill_pickler(payload, tables).dump(obj)
        segments = tables.finish()
    except BaseException:
        tables.abort()
        raise
    skeleton = pickle.dumps(
        (FORMAT, [tuple(s) for s in tables.storages], [(type(o).__name__, tuple(o)) for o in tables.objects],
         payload.getvalue()),
        protocol=PICKLE_PROTOCOL,
    )
    tensors = sum(1 for o in tables.objects if type(o) is TensorRef)
    return Packed(skeleton, segments, tables.written, len(tables.storages), tensors, used, tables.contents,
                  tables.deduplicated, tables.unhashed)


def hash_regions(unhashed: list) -> list[tuple[str, int, int, int]]:
    """The ``Packed.contents`` records of ``Packed.unhashed``: their bytes hashed now, while the
    packed object keeps them alive (Note [Hashing a file's storages after the answer] in overmind.warm.loader)."""
    import xxhash

    return [(xxhash.xxh3_128_digest(buffer_at(address, nbytes)).hex(), nbytes, segment, offset)
            for address, nbytes, segment, offset in unhashed]


def _build_storages(storages: list, views: Sequence[Optional[memoryview]], map_location) -> list:
    built = []
    for segment, offset, nbytes, device in storages:
        if nbytes == 0:
            storage = torch.UntypedStorage(0)
        else:
            if not 0 <= segment < len(views) or views[segment] is None:
                raise pickle.UnpicklingError(f"skeleton names segment {segment}, but {len(views)} were mapped")
            view = views[segment]
            if offset < 0 or offset + nbytes > view.nbytes:
                raise pickle.UnpicklingError(
                    f"storage [{offset}, {offset + nbytes}) is outside segment {segment} of {view.nbytes} bytes"
                )
            storage = make_untyped_storage(view[offset : offset + nbytes])
        target = map_location or device
        if target != "cpu":
            storage = storage.to(device=torch.device(target))
        built.append(storage)
    return built


def _build_objects(objects: list, storages: list, references: dict) -> list:
    dtypes: dict[str, torch.dtype] = {}

    def dtype_of(name: str) -> torch.dtype:
        dtype = dtypes.get(name)
        if dtype is None:
            dtype = dtypes[name] = _dtype_from_name(name)
        return dtype

    tensor_slots, tensor_records, states = [], [], []
    built: list = [None] * len(objects)
    for slot, (kind, record) in enumerate(objects):
        if kind == "TensorRef":
            storage, dtype_name, offset, size, stride, requires_grad, parameter = record[:7]
            if len(record) > 7 and record[7]:
                states.append((len(tensor_slots), record[7]))
            tensor_slots.append(slot)
            tensor_records.append((storage, dtype_of(dtype_name), offset, size, stride, requires_grad, parameter))
        elif kind == "TypedStorageRef":
            storage, dtype_name = record
            untyped = storages[storage]
            built[slot] = untyped if dtype_name is None else torch.storage.TypedStorage(
                wrap_storage=untyped, dtype=dtype_of(dtype_name), _internal=True)
        elif kind == "ScriptModuleRef":
            built[slot] = torch.jit.load(io.BytesIO(record[0]), map_location="cpu")
        elif kind == "ExternalRef":
            try:
                built[slot] = references[record[0]]
            except KeyError:
                raise pickle.UnpicklingError(f"skeleton refers to object {record[0]!r}, which was not supplied") from None
        else:
            raise pickle.UnpicklingError(f"unknown object record {kind!r} in a skeleton")
    try:
        tensors = build_tensors(storages, tensor_records)
    except (RuntimeError, ValueError, TypeError, IndexError) as err:
        raise pickle.UnpicklingError(f"corrupt tensor table in skeleton: {err}") from err
    for position, state in states:
        tensors[position].__dict__.update(state)
    for slot, tensor in zip(tensor_slots, tensors):
        built[slot] = tensor
    return built


def unpack(skeleton: bytes, mappings: Sequence[Optional[mmap.mmap]], map_location: Optional[str] = None,
           references: Optional[dict] = None):
    """Rebuild the object pickled by :func:`pack`. See Note [One mapping per load]."""
    if not isinstance(skeleton, (bytes, bytearray, memoryview)):
        raise TypeError(f"unpack: skeleton must be bytes, got {type(skeleton).__name__}")
    header = pickle.loads(skeleton)
    if not (isinstance(header, tuple) and len(header) == 4 and header[0] == FORMAT):
        found = header[0] if isinstance(header, tuple) and header else type(header).__name__
        raise pickle.UnpicklingError(
            f"skeleton format {found!r} is not {FORMAT!r}; this cache entry was written by another overmind version. "
            "Run `overmind evict --all` or restart overmind-server."
        )
    _, storage_table, object_table, payload = header
    views = [memoryview(m) if m is not None else None for m in mappings]
    # Tens of thousands of fresh containers would trigger full collections mid-load.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        objects = _build_objects(object_table, _build_storages(storage_table, views, map_location), references or {})
        # C-level lookup (Note [Tensors as table entries]), on every Python: Note [Persistent ids
        # across Pythons] in overmind.shared.segments.unpickler
        unpickler = table_unpickler(io.BytesIO(payload), objects)
        return unpickler.load()
    finally:
        if gc_was_enabled:
            gc.enable()
