"""Segments reach a client over SCM_RIGHTS when /proc/<server>/fd cannot be opened."""

from __future__ import annotations

import torch
from safetensors.torch import save_file

from ..conftest import age_files, run_python
from .conftest import last_json

CLIENT = """
import json, os
import overmind.api
overmind.api.monkey_patch_all()
import safetensors.torch
from overmind.client import connection as client
from overmind.shared import protocol as P
from overmind.shared.calls.keys import Target, encode_call
from overmind.shared.settings.config import Config
from overmind.shared.segments.reductions import unpack

safetensors.torch.load_file({path!r})  # strict + wait: the entry exists afterwards
config = Config.from_env()
call = encode_call(Target("module", "safetensors.torch", "load_file", None), ({path!r},), {{}}, lambda o: None)
with client.LoadingConnection.open(config) as conn:
    entry, skeleton = conn.load(P.Load(call.key, "t", "d", {{}}, lookup_only=True), b"")
    mappings = conn._map_received(entry)  # the SCM_RIGHTS path, as when /proc is refused
    state = unpack(skeleton, mappings)
print(json.dumps([float(state["w"].sum()), len(os.listdir("/proc/self/fd"))]))
"""


def test_segments_received_over_scm_rights_rebuild_the_same_tensors(server, tmp_path):
    path = tmp_path / "w.safetensors"
    w = torch.arange(4096, dtype=torch.float32)
    save_file({"w": w}, path)
    age_files(path)
    total, _ = last_json(run_python(CLIENT.format(path=str(path)),
                                    env=server.client_env(OVERMIND_STRICT="1")))
    assert total == float(w.sum())
    assert server.status()["hits"] >= 1


def _can_unshare() -> bool:
    import subprocess

    try:
        return subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True,
                              timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


NAMESPACED_CLIENT = """
import json, os, sys
held = [os.open("/dev/null", os.O_RDONLY) for _ in range(200)]  # fd numbers the server's segments also use
import overmind.api
overmind.api.monkey_patch_all()
import safetensors.torch
sums = [float(safetensors.torch.load_file(sys.argv[1])["w"].sum()) for _ in range(2)]
print(json.dumps([os.getpid(), sums]))
"""


def test_a_client_in_another_pid_namespace_gets_segments_over_the_socket(make_server, tmp_path):
    """Note [Segments across PID namespaces]: server and client are each pid 1 of their own
    namespace (a DaemonSet and a pod); /proc/1/fd/<n> in the client is the client itself."""
    import signal
    import subprocess
    import sys

    import pytest

    from ..conftest import REPO

    if not _can_unshare():
        pytest.skip("unshare --pid needs root or user namespaces")
    path = tmp_path / "w.safetensors"
    w = torch.arange(1 << 16, dtype=torch.float32)
    save_file({"w": w}, path)
    age_files(path)
    # Stopped by SIGKILL to unshare: its child (the server, pid 1 of its namespace) gets SIGKILL
    # too (--kill-child).
    server = make_server(under=("unshare", "--pid", "--fork", "--mount-proc", "--kill-child"),
                         stop_signal=signal.SIGKILL)
    client_env = server.client_env(OVERMIND_STRICT="1")
    outs = []
    for _ in range(2):  # a miss that fills the cache, then a hit
        proc = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c",
                               NAMESPACED_CLIENT, str(path)], env=client_env, capture_output=True, text=True,
                              timeout=180, cwd=REPO)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "overmind:" not in proc.stderr, proc.stderr[-3000:]
        outs.append(last_json(proc))
    assert [pid for pid, _ in outs] == [1, 1]
    assert outs[1][1] == [float(w.sum())] * 2
