"""Where a rebuilt tensor's bytes are: inside the mappings of its segments, or copied out."""

from __future__ import annotations

import ctypes


def mapping_ranges(mappings) -> list[tuple[int, int]]:
    out = []
    for m in mappings:
        if m is not None:
            base = ctypes.addressof(ctypes.c_char.from_buffer(m))
            out.append((base, base + len(m)))
    return out


def inside(ranges, tensor) -> bool:
    return any(lo <= tensor.data_ptr() and tensor.data_ptr() + tensor.nbytes <= hi for lo, hi in ranges)
