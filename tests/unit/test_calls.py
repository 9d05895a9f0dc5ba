"""overmind.calls: what a key sees of the files a call names."""

from __future__ import annotations

import os
import time

import pytest

from overmind.calls import Uncacheable, fingerprint_paths


def test_a_file_written_just_now_is_racy_and_not_cached(tmp_path):
    path = tmp_path / "w.bin"
    path.write_bytes(b"x" * 16)
    with pytest.raises(Uncacheable, match="modified less than"):
        fingerprint_paths([str(path)])
    old = time.time() - 60
    os.utime(path, (old, old))
    assert [entry[0] for entry in fingerprint_paths([str(path)])] == [str(path)]


def test_a_folder_fingerprint_ignores_bytecode_caches_and_sees_data_files(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"1")
    old = time.time() - 60
    os.utime(tmp_path / "weights.bin", (old, old))
    before = fingerprint_paths([str(tmp_path)])
    (tmp_path / "__pycache__").mkdir()
    (tmp_path / "__pycache__" / "mod.cpython-311.pyc").write_bytes(b"c")
    assert fingerprint_paths([str(tmp_path)]) == before
    (tmp_path / "weights.bin").write_bytes(b"22")
    os.utime(tmp_path / "weights.bin", (old + 1, old + 1))
    assert fingerprint_paths([str(tmp_path)]) != before
