"""The one door to ``overmind._C``, with a pure-Python fallback.

    from overmind.shared.segments.native import make_untyped_storage
    storage = make_untyped_storage(memoryview(mapping)[offset:offset + nbytes])

``make_untyped_storage`` shares the buffer's memory (no copy) and keeps the buffer's
exporter alive for as long as the storage lives. Without the extension (installed
with ``OVERMIND_NO_EXT=1``) it uses ``torch.frombuffer``, which also shares memory
and keeps the buffer object alive; the argument checks are the same on both paths.
"""

from __future__ import annotations

import os

import torch  # must come before overmind._C: the extension links libtorch_python

try:
    if os.environ.get("OVERMIND_NO_EXT", "0") == "1":
        raise ImportError("disabled by OVERMIND_NO_EXT=1")
    from overmind import _C  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - exercised by the fallback tests in a subprocess
    _C = None

HAVE_EXTENSION = _C is not None

__all__ = ["HAVE_EXTENSION", "make_untyped_storage", "make_untyped_storage_fallback", "build_tensors",
           "build_tensors_fallback"]


def _check_buffer(buffer) -> memoryview:
    try:
        view = memoryview(buffer)
    except TypeError:
        raise TypeError(
            "make_untyped_storage: expected an object supporting the buffer protocol "
            f"(mmap, memoryview, bytearray), got {type(buffer).__name__}"
        ) from None
    if view.readonly:
        raise ValueError(
            "make_untyped_storage: buffer is read-only; torch would crash on the first in-place write. "
            "Map the segment MAP_PRIVATE read/write instead."
        )
    if view.ndim > 1:
        raise ValueError(f"make_untyped_storage: buffer has {view.ndim} dimensions; pass a flat 1-D byte buffer.")
    if view.itemsize != 1 or view.format not in ("B", "b", "c"):
        raise ValueError(
            f"make_untyped_storage: buffer must hold bytes (format 'B'), got format {view.format!r} "
            f"with itemsize {view.itemsize}; cast it with memoryview.cast('B')."
        )
    if not view.c_contiguous:
        raise ValueError(f"make_untyped_storage: buffer is not contiguous (strides {view.strides}); slice with step 1 only.")
    return view


def make_untyped_storage_fallback(buffer) -> torch.UntypedStorage:
    view = _check_buffer(buffer)
    if view.nbytes == 0:
        return torch.UntypedStorage(0)
    return torch.frombuffer(view, dtype=torch.uint8).untyped_storage()


def make_untyped_storage(buffer) -> torch.UntypedStorage:
    """A ``torch.UntypedStorage`` over ``buffer``'s memory, without copying."""
    if _C is None:
        return make_untyped_storage_fallback(buffer)
    return _C._make_untyped_storage(buffer)


def build_tensors_fallback(storages: list, records: list) -> list:
    empty = torch.empty
    make_subclass = torch.Tensor._make_subclass
    parameter = torch.nn.Parameter
    out = []
    for index, dtype, offset, size, stride, requires_grad, is_parameter in records:
        untyped = storages[index]
        tensor = empty(0, dtype=dtype, device=untyped.device).set_(untyped, offset, size, stride)
        if is_parameter:
            tensor = make_subclass(parameter, tensor, requires_grad)
        elif requires_grad:
            tensor.requires_grad_(True)
        out.append(tensor)
    return out


def build_tensors(storages: list, records: list) -> list:
    """Tensors over ``storages`` from ``(storage index, dtype, offset, size, stride, requires_grad,
    parameter)`` records, in one native call when the extension is built."""
    if _C is None:
        return build_tensors_fallback(storages, records)
    return _C._build_tensors(storages, records, torch.nn.Parameter)
