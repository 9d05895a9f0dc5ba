"""Never stale: a changed file is a miss, whether an argument names it or the loader found it."""

from __future__ import annotations

import json
import os
import textwrap
import time

from ..conftest import run_python
from .conftest import last_json

# One process saves each version and loads it twice (the second load of a version is a hit once
# its fill is in: OVERMIND_COLD=wait), so nothing it kept of an earlier version may answer.
RESAVE_AND_LOAD = """
import hashlib, json, os, time
import torch
import overmind.api
from overmind.shared.calls.keys import CTIME_RACY_SECONDS
overmind.api.monkey_patch_all()
import safetensors.torch
stale = []
for version in range({versions}):
    weights = torch.randn(64, 64, generator=torch.Generator().manual_seed(version))
    safetensors.torch.save_file({{"w": weights}}, {path!r})
    # A distinct mtime in the past, and a ctime older than CTIME_RACY_SECONDS: not 'racy'
    # (overmind.shared.calls.keys Note [Racy files]), as a real save a while ago would be; the mtime
    # never equals an earlier version's.
    stamp = time.time() - 1000 + version
    os.utime({path!r}, (stamp, stamp))
    time.sleep(1.5 * CTIME_RACY_SECONDS)
    expected = hashlib.sha256(weights.numpy().tobytes()).hexdigest()
    for _ in range(2):
        state = safetensors.torch.load_file({path!r})
        if hashlib.sha256(state["w"].numpy().tobytes()).hexdigest() != expected:
            stale.append(version)
print(json.dumps(stale))
"""


def test_resaving_a_model_20_times_never_serves_stale_weights(server, tmp_path):
    path = tmp_path / "model.safetensors"
    env = server.client_env(OVERMIND_COLD="wait")
    stale = last_json(run_python(RESAVE_AND_LOAD.format(versions=20, path=str(path)), env=env))
    assert stale == []
    status = server.status()
    assert status["misses"] == 20 and status["hits"] == 20


INDEXED = '''
import json, torch
INDEX = {index!r}


def load_indexed(name):
    with open(INDEX) as f:  # a file no argument names
        return torch.tensor(json.load(f)[name])
'''

CLIENT = """
import json, sys
sys.path.insert(0, {lib!r})
import overmind.api
overmind.api.monkey_patch_all()
import mylib_indexed
print(json.dumps(mylib_indexed.load_indexed("w").tolist()))
"""


def test_a_changed_file_the_loader_read_is_a_stale_miss(server, tmp_path):
    index = tmp_path / "index.json"
    (tmp_path / "mylib_indexed.py").write_text(textwrap.dedent(INDEXED.format(index=str(index))))
    old = time.time() - 100
    os.utime(tmp_path / "mylib_indexed.py", (old, old))
    env = server.client_env(OVERMIND_COLD="wait", OVERMIND_PATCH="mylib_indexed::load_indexed")
    code = CLIENT.format(lib=str(tmp_path))
    for version, values in enumerate([[1, 2], [3, 4], [5, 6]]):
        index.write_text(json.dumps({"w": values}))
        os.utime(index, (old + version, old + version))
        assert last_json(run_python(code, env=env)) == values  # miss (or stale), from the loader
        assert last_json(run_python(code, env=env)) == values  # hit
    status = server.status()
    assert status["stale_misses"] == 2, status
    assert status["hits"] == 3 and status["entries"] == 1


def _rewrite_in_place_keeping_the_mtime(path, change) -> None:
    """What ``rsync --inplace -t`` leaves: new bytes in the same inode, same size, the old mtime."""
    before = os.stat(path)
    with open(path, "r+b") as f:
        data = f.read()
        f.seek(0)
        f.write(change(data))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns)
    assert after.st_ctime_ns != before.st_ctime_ns  # what the kernel sets, whatever utime says


LM_DIGEST = """
import hashlib, json
import overmind.api
overmind.api.monkey_patch_all()
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained({path!r})
digest = hashlib.sha256()
for name, tensor in sorted(model.state_dict().items()):
    digest.update(name.encode() + tensor.detach().numpy().tobytes())
print(json.dumps(digest.hexdigest()))
"""


def test_a_rewrite_in_place_with_the_mtime_put_back_is_never_served_stale(server, tmp_path):
    from overmind import modelgen

    from ..conftest import age_files

    folder = modelgen.save_lm(tmp_path / "lm", seed=7)
    age_files(folder)
    code = LM_DIGEST.format(path=str(folder))
    env = server.client_env(OVERMIND_COLD="wait")
    old = last_json(run_python(code, env=env))
    assert last_json(run_python(code, env=env)) == old  # a hit
    assert server.status()["hits"] == 1

    def flip_4_kib_near_the_end(data: bytes) -> bytes:
        at = len(data) - 8192
        return data[:at] + bytes(b ^ 0x55 for b in data[at:at + 4096]) + data[at + 4096:]

    _rewrite_in_place_keeping_the_mtime(folder / "model.safetensors", flip_4_kib_near_the_end)
    plain = last_json(run_python(code, env=server.client_env(OVERMIND_DISABLE="1")))
    assert plain != old
    assert last_json(run_python(code, env=env)) == plain  # a miss: the ctime is in the fingerprint
    assert last_json(run_python(code, env=env)) == plain  # and the new version is cached
    assert server.status()["hits"] == 2


def test_a_file_the_loader_read_rewritten_in_place_with_the_mtime_put_back_is_a_stale_miss(server, tmp_path):
    index = tmp_path / "index.json"
    (tmp_path / "mylib_indexed.py").write_text(textwrap.dedent(INDEXED.format(index=str(index))))
    old = time.time() - 100
    os.utime(tmp_path / "mylib_indexed.py", (old, old))
    index.write_text(json.dumps({"w": [1, 2]}))
    os.utime(index, (old, old))
    env = server.client_env(OVERMIND_COLD="wait", OVERMIND_PATCH="mylib_indexed::load_indexed")
    code = CLIENT.format(lib=str(tmp_path))
    assert last_json(run_python(code, env=env)) == [1, 2]
    assert last_json(run_python(code, env=env)) == [1, 2]  # a hit
    # No argument names the index: only the server's check of the observed files can see this.
    _rewrite_in_place_keeping_the_mtime(index, lambda data: data.replace(b"[1, 2]", b"[3, 4]"))
    assert last_json(run_python(code, env=env)) == [3, 4]
    status = server.status()
    assert status["stale_misses"] == 1 and status["hits"] == 1, status
