"""The memory budget: least recently used entries go, and clients holding them keep working."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from ..conftest import REPO, age_files, run_python
from .conftest import last_json

HOLDER = """
import hashlib, sys
import overmind.api
overmind.api.monkey_patch_all()
import safetensors.torch
state = safetensors.torch.load_file(sys.argv[1])
def digest():
    return hashlib.sha256(state["w"].numpy().tobytes()).hexdigest()
print("loaded", digest(), flush=True)
for line in sys.stdin:
    print("check", digest(), flush=True)
"""

LOAD = """
import overmind.api
overmind.api.monkey_patch_all()
import safetensors.torch
safetensors.torch.load_file({path!r})
"""


@pytest.fixture
def budget_server(make_server):
    return make_server(args=("--max-memory", "1.5M"))


def _model(path, seed: int) -> str:
    w = torch.randn(256, 1024, generator=torch.Generator().manual_seed(seed))  # 1 MiB
    save_file({"w": w}, path)
    age_files(path)
    return hashlib.sha256(w.numpy().tobytes()).hexdigest()


def test_lru_eviction_keeps_clients_of_the_evicted_entry_working(budget_server, tmp_path):
    server = budget_server
    paths = [tmp_path / f"m{i}.safetensors" for i in range(3)]
    digests = [_model(p, i) for i, p in enumerate(paths)]
    env = server.client_env(OVERMIND_COLD="wait", OVERMIND_STRICT="1")
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(paths[0])], env=env, cwd=REPO, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline().split() == ["loaded", digests[0]]
        for path in paths[1:]:
            run_python(LOAD.format(path=str(path)), env=env)
        status = server.status()
        assert status["budget"] == int(1.5 * (1 << 20))
        assert status["entries"] == 1 and status["evictions"] == 2, status  # each new entry evicts the older
        listed = [e["description"] for e in last_json(server.cli("list", "--json"))]
        assert len(listed) == 1 and "m2.safetensors" in listed[0]
        assert status["used"] <= status["budget"]
        holder.stdin.write("check\n")
        holder.stdin.flush()
        assert holder.stdout.readline().split() == ["check", digests[0]]
        server.cli("shutdown")
        server.proc.wait(timeout=20)
        holder.stdin.write("check\n")
        holder.stdin.flush()
        assert holder.stdout.readline().split() == ["check", digests[0]]  # pages live while mapped
    finally:
        holder.kill()
        holder.wait()


def test_an_entry_larger_than_the_budget_is_returned_once_and_not_kept(budget_server, tmp_path):
    server = budget_server
    path = tmp_path / "big.safetensors"
    w = torch.randn(1024, 1024)  # 4 MiB: more than the whole budget
    save_file({"w": w}, path)
    age_files(path)
    code = """
import json, warnings
warnings.simplefilter("always")
import overmind.api
overmind.api.monkey_patch_all()
import safetensors.torch
s = safetensors.torch.load_file({path!r})
print(json.dumps(float(s["w"].double().sum())))
"""
    first = run_python(code.format(path=str(path)), env=server.client_env())
    assert last_json(first) == pytest.approx(float(w.double().sum()))
    status = server.wait_idle()
    assert status["entries"] == 0 and status["misses"] == 1
    assert "more than the whole memory budget" in server.log()
    second = run_python(code.format(path=str(path)), env=server.client_env())
    assert last_json(second) == pytest.approx(float(w.double().sum()))
    assert "overmind:" in second.stderr and "budget" in second.stderr  # one clear warning
    assert server.status()["misses"] == 1  # remembered: no second loader for it
