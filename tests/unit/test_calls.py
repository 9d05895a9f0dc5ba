"""overmind.shared.calls.keys: what a key sees of the files a call names."""

from __future__ import annotations

import os
import time

import pytest

from overmind.shared.calls.keys import Uncacheable, fingerprint_paths


def test_a_file_written_just_now_is_racy_and_not_cached(tmp_path):
    path = tmp_path / "w.bin"
    path.write_bytes(b"x" * 16)
    with pytest.raises(Uncacheable, match="modified too recently"):
        fingerprint_paths([str(path)])
    old = time.time() - 60
    os.utime(path, (old, old))
    # utime itself changed the ctime just now: racy for one tick (Note [Racy files]), not after.
    with pytest.raises(Uncacheable, match="modified too recently"):
        fingerprint_paths([str(path)], now=os.stat(path).st_ctime_ns / 1e9)
    later = os.stat(path).st_ctime_ns / 1e9 + 1
    assert [entry[0] for entry in fingerprint_paths([str(path)], now=later)] == [str(path)]


def test_a_rewrite_in_place_with_the_mtime_put_back_changes_the_fingerprint(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"a" * 8192)
    old = time.time() - 60
    os.utime(path, (old, old))
    before = fingerprint_paths([str(path)], now=time.time() + 1)
    stat = os.stat(path)
    with open(path, "r+b") as f:  # same inode, same size: what rsync --inplace -t does
        f.seek(4096)
        f.write(b"b" * 4096)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    after = fingerprint_paths([str(path)], now=time.time() + 1)
    assert [entry[:5] for entry in after] == [entry[:5] for entry in before]  # path, size, mtime, inode, device
    assert after != before


def test_a_folder_fingerprint_ignores_bytecode_caches_and_sees_data_files(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"1")
    old = time.time() - 60
    os.utime(tmp_path / "weights.bin", (old, old))
    later = time.time() + 1  # past the ctime that utime just set (Note [Racy files])
    before = fingerprint_paths([str(tmp_path)], now=later)
    (tmp_path / "__pycache__").mkdir()
    (tmp_path / "__pycache__" / "mod.cpython-311.pyc").write_bytes(b"c")
    assert fingerprint_paths([str(tmp_path)], now=later) == before
    (tmp_path / "weights.bin").write_bytes(b"22")
    os.utime(tmp_path / "weights.bin", (old + 1, old + 1))
    assert fingerprint_paths([str(tmp_path)], now=time.time() + 1) != before


def _key(**kwargs) -> str:
    import torch

    from overmind.shared.calls.keys import Target, encode_call

    return encode_call(Target.of(torch.load), (), kwargs, lambda obj: None).key


def test_dtype_and_device_spellings_that_load_the_same_give_one_key():
    import torch

    assert _key(torch_dtype=torch.float16) == _key(torch_dtype="float16") == _key(torch_dtype="torch.float16")
    assert _key(torch_dtype=torch.float16) != _key(torch_dtype=torch.bfloat16)
    assert _key(map_location=torch.device("cpu")) == _key(map_location="cpu")
    assert _key(device_map=torch.device("cuda", 1)) == _key(device_map="cuda:1") != _key(device_map="cuda")
    # only arguments named as dtypes are dtypes: a variant is a file suffix
    assert _key(variant="float16") != _key(variant=torch.float16)
    assert _key(device_map="auto") != _key(device_map="cpu")


def test_the_loader_receives_the_canonical_arguments():
    import torch

    from overmind.shared.calls.keys import Target, decode_call, encode_call

    call = encode_call(Target.of(torch.load), (), {"torch_dtype": "bfloat16", "map_location": torch.device("cpu")},
                       lambda obj: None)
    kwargs = decode_call(call.blob, lambda key: None).kwargs
    assert kwargs == {"map_location": "cpu", "torch_dtype": torch.bfloat16}
