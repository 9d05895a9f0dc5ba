"""File-backed segments: a hit maps the model file's own pages until the server settles them
into sealed memory (Notes [File-backed segments] in overmind.shared.segments.memfd and [Settling file
segments] in overmind.server.settle)."""

from __future__ import annotations

import hashlib
import os
import time

import pytest
import torch
from safetensors.torch import save

from .conftest import LEFT_TO_PAGE_CACHE, LOAD_AND_LOOK, ServerProcess, last_json, lose_from_page_cache


def _status_until(server: ServerProcess, done, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        status = server.status()
        if done(status) or time.monotonic() > deadline:
            return status
        time.sleep(0.2)


def _filled(make_server, models, settle_after: str, env: dict | None = None) -> tuple[ServerProcess, str, dict]:
    """A server with ``OVERMIND_SETTLE_AFTER=settle_after`` (and ``env``) whose cache holds the LM
    (the filling run waited for it: its answer is the first hit's), the code that loads it, that answer."""
    server = make_server({"OVERMIND_SETTLE_AFTER": settle_after, **(env or {})})
    code = LOAD_AND_LOOK.format(path=str(models["lm"]))
    return server, code, last_json(server.run(code, env=server.client_env(OVERMIND_STRICT="1")))


def test_a_hit_maps_the_model_file_and_equals_it(make_server, models):
    server, code, first = _filled(make_server, models, "600")
    assert first["equal"] and first["maps_file"], first
    status = server.wait_idle()
    assert status["file_segments"]["bytes"] >= os.path.getsize(models["lm"] / "model.safetensors")
    assert status["file_segments"]["settled"] == 0
    second = last_json(server.run(code))
    assert second == {"equal": True, "maps_file": True, "hit": True}


def test_an_idle_server_settles_file_segments_into_sealed_memory(make_server, models):
    server, code, _ = _filled(make_server, models, "0.5")
    status = _status_until(server, lambda s: s["file_segments"]["bytes"] == 0)
    assert status["file_segments"]["bytes"] == 0 and status["file_segments"]["settled"] >= 1, status
    after = last_json(server.run(code))
    # the same weights, now from a sealed memfd: the model file is no longer mapped
    assert after == {"equal": True, "maps_file": False, "hit": True}


def test_a_file_segments_pages_stay_when_the_page_cache_is_dropped(make_server, models):
    """Note [File segments stay mapped]: the server keeps them mapped, so a drop (here of the one
    file, as /proc/sys/vm/drop_caches does of all) leaves them, and nothing needs copying."""
    from overmind.shared.segments.memfd import cached_share

    path = models["lm"] / "model.safetensors"
    server, code, _ = _filled(make_server, models, "600")
    assert server.wait_idle()["file_segments"]["settled"] == 0
    deadline = time.monotonic() + 30
    while str(path) not in open(f"/proc/{server.proc.pid}/maps").read() and time.monotonic() < deadline:
        time.sleep(0.1)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        share = cached_share(fd, path.stat().st_size)
    finally:
        os.close(fd)
    if share is None:
        pytest.skip("this kernel has no cachestat (Linux 6.5)")
    assert share == 1.0
    time.sleep(1.5)  # three of the settler's looks
    assert server.status()["file_segments"]["settled"] == 0, server.log()[-3000:]
    assert last_json(server.run(code)) == {"equal": True, "maps_file": True, "hit": True}


def test_a_file_segment_the_page_cache_lost_is_settled_at_once(make_server, models):
    server, code, _ = _filled(make_server, models, "600", LEFT_TO_PAGE_CACHE)
    if server.wait_idle()["file_segments"]["settled"] == 0:
        lose_from_page_cache(models["lm"] / "model.safetensors")
    # else the machine's own memory needs took the unmapped pages first (seen in CI while
    # other tests filled the page cache): the same case, and the log below says so
    status = _status_until(server, lambda s: s["file_segments"]["settled"] >= 1)
    assert status["file_segments"]["settled"] >= 1 and status["file_segments"]["bytes"] == 0, (status["file_segments"], server.log()[-3000:])
    # settle_after 600 s: only the loss can have started the copy
    assert "the page cache lost it" in server.log(), server.log()[-3000:]
    assert last_json(server.run(code)) == {"equal": True, "maps_file": False, "hit": True}


REWRITE_IN_PLACE = """
import hashlib, json, os, overmind.api
overmind.api.monkey_patch_all()
import safetensors.torch
state = safetensors.torch.load_file({path!r})
print(json.dumps(hashlib.sha256(state["w"].numpy().tobytes()).hexdigest()))
"""


def _write_in_place(path, version: int) -> str:
    """Rewrite ``path`` in place (same inode, same size), its mtime put back to the old one."""
    weights = torch.randn(512, 512, generator=torch.Generator().manual_seed(version))  # 1 MiB: file-backed
    old = os.stat(path) if os.path.exists(path) else None
    with open(path, "r+b" if old else "wb") as f:  # not save_file: it writes a new inode
        f.write(save({"w": weights}))
    stamp = (old.st_atime, old.st_mtime) if old else (time.time() - 1000,) * 2
    os.utime(path, stamp)
    return hashlib.sha256(weights.numpy().tobytes()).hexdigest()


def test_a_model_file_rewritten_in_place_is_never_served_from_its_old_entry(make_server, tmp_path):
    server = make_server({"OVERMIND_SETTLE_AFTER": "600"})
    path = str(tmp_path / "w.safetensors")
    first = _write_in_place(path, 1)
    code = REWRITE_IN_PLACE.format(path=path)
    env = server.client_env(OVERMIND_STRICT="1")
    assert last_json(server.run(code, env=env)) == first
    assert last_json(server.run(code, env=env)) == first
    inode = os.stat(path).st_ino
    second = _write_in_place(path, 2)
    assert os.stat(path).st_ino == inode
    assert last_json(server.run(code, env=env)) == second
