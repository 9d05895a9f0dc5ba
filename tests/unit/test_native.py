"""overmind.shared.segments.native / overmind._C: zero-copy storages over Python buffers."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys

import pytest
import torch

from overmind.shared.segments import native
from overmind.shared.segments.native import make_untyped_storage, make_untyped_storage_fallback

BUILDERS = [pytest.param(make_untyped_storage, id="extension"), pytest.param(make_untyped_storage_fallback, id="fallback")]


def as_bytes_tensor(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def test_extension_is_built():
    # CI installs with the compiler present; a silent fallback would hide a broken build.
    assert native.HAVE_EXTENSION


@pytest.mark.parametrize("build", BUILDERS)
def test_storage_shares_the_buffer_memory_both_ways(build):
    buf = bytearray(range(64))
    storage = build(buf)
    assert storage.nbytes() == 64
    view = as_bytes_tensor(storage)
    view.add_(1)
    assert buf[:3] == bytearray([1, 2, 3])
    buf[10] = 200
    assert int(view[10]) == 200


@pytest.mark.parametrize("build", BUILDERS)
def test_storage_keeps_the_mapping_alive_and_releases_it(build):
    m = mmap.mmap(-1, mmap.PAGESIZE)
    m[:4] = b"abcd"
    storage = build(memoryview(m)[:4])
    with pytest.raises(BufferError):
        m.close()  # exported: the storage still points into it
    assert bytes(as_bytes_tensor(storage).numpy()) == b"abcd"
    del storage
    import gc

    gc.collect()
    m.close()  # released with the storage


@pytest.mark.parametrize("build", BUILDERS)
def test_storage_is_not_resizable(build):
    storage = build(bytearray(16))
    with pytest.raises(RuntimeError):
        storage.resize_(32)


@pytest.mark.parametrize("build", BUILDERS)
def test_empty_buffer_gives_empty_storage(build):
    assert build(bytearray()).nbytes() == 0


@pytest.mark.parametrize("build", BUILDERS)
@pytest.mark.parametrize(
    "bad, exc, words",
    [
        (b"read only", ValueError, "read-only"),
        (memoryview(bytearray(16)).cast("i"), ValueError, "format"),
        (memoryview(bytearray(16))[::2], ValueError, "contiguous"),
        (memoryview(bytearray(16)).cast("B", (4, 4)), ValueError, "dimensions"),
        (12345, TypeError, "buffer protocol"),
        ("text", TypeError, "buffer protocol"),
    ],
    ids=["readonly", "not-bytes", "strided", "2d", "int", "str"],
)
def test_bad_buffers_are_refused_with_a_clear_error(build, bad, exc, words):
    with pytest.raises(exc, match=words):
        build(bad)


def test_build_tensors_rejects_bad_records():
    storages = [make_untyped_storage(bytearray(64))]
    with pytest.raises((ValueError, TypeError)):
        native.build_tensors(storages, [(5, torch.float32, 0, (4,), (1,), False, False)])
    with pytest.raises(RuntimeError):  # view larger than its storage
        native.build_tensors(storages, [(0, torch.float32, 0, (100,), (1,), False, False)])
    with pytest.raises((ValueError, TypeError)):
        native.build_tensors(storages, [(0, "float32", 0, (4,), (1,), False, False)])


@pytest.mark.parametrize("build", [native.build_tensors, native.build_tensors_fallback], ids=["extension", "fallback"])
def test_build_tensors_makes_parameters_and_views(build):
    storages = [make_untyped_storage(bytearray(64))]
    a, b = build(storages, [(0, torch.float32, 0, (2, 2), (2, 1), True, True), (0, torch.float32, 4, (4,), (1,), False, False)])
    assert type(a) is torch.nn.Parameter and a.requires_grad
    assert type(b) is torch.Tensor and not b.requires_grad
    assert b.data_ptr() == a.data_ptr() + 16


def test_fallback_installation_gives_the_same_model(tmp_path):
    """OVERMIND_NO_EXT=1 (torch.frombuffer) rebuilds the same bytes as the extension."""
    code = f"""
import hashlib, torch
from overmind.shared.segments import native
from overmind.shared.segments.reductions import pack, unpack
from overmind.modelgen import build_lm
model = build_lm("tiny")
packed = pack(model)
again = unpack(packed.skeleton, packed.map_private())
h = hashlib.sha256()
for k, v in again.state_dict().items():
    h.update(k.encode()); h.update(v.contiguous().view(torch.uint8).numpy().tobytes())
print(native.HAVE_EXTENSION, h.hexdigest(), again.lm_head.weight is again.model.embed_tokens.weight)
"""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    with_ext = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    without = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env={**env, "OVERMIND_NO_EXT": "1"}, check=True)
    ext_flag, ext_hash, ext_tied = with_ext.stdout.split()
    fb_flag, fb_hash, fb_tied = without.stdout.split()
    assert (ext_flag, fb_flag) == ("True", "False")
    assert ext_hash == fb_hash
    assert ext_tied == fb_tied == "True"
