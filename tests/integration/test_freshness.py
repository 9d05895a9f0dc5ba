"""Never stale: a changed file is a miss, whether an argument names it or the loader found it."""

from __future__ import annotations

import json
import os
import textwrap
import time

import torch
from safetensors.torch import save_file

from ..conftest import run_python
from .conftest import last_json

LOAD_TWICE = """
import hashlib, json
import overmind.api
overmind.api.monkey_patch_all()
import safetensors.torch
digests = []
for _ in range(2):
    state = safetensors.torch.load_file({path!r})
    digests.append(hashlib.sha256(state["w"].numpy().tobytes()).hexdigest())
print(json.dumps(digests))
"""


def _save_version(path, version: int) -> str:
    weights = torch.randn(64, 64, generator=torch.Generator().manual_seed(version))
    save_file({"w": weights}, path)
    # A distinct mtime in the past: not 'racy' (overmind.calls Note [Racy files]) and never equal
    # to an earlier version's, as a real save a while ago would be.
    stamp = time.time() - 1000 + version
    os.utime(path, (stamp, stamp))
    import hashlib

    return hashlib.sha256(weights.numpy().tobytes()).hexdigest()


def test_resaving_a_model_20_times_never_serves_stale_weights(server, tmp_path):
    path = tmp_path / "model.safetensors"
    env = server.client_env(OVERMIND_COLD="wait")
    stale = 0
    for version in range(20):
        expected = _save_version(path, version)
        got = last_json(run_python(LOAD_TWICE.format(path=str(path)), env=env))
        stale += sum(d != expected for d in got)
    assert stale == 0
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
