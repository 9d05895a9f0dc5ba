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
from overmind import client, protocol as P
from overmind.calls import Target, encode_call
from overmind.config import Config
from overmind.reductions import unpack

safetensors.torch.load_file({path!r})  # strict + wait: the entry exists afterwards
config = Config.from_env()
call = encode_call(Target("module", "safetensors.torch", "load_file", None), ({path!r},), {{}}, lambda o: None)
with client.Connection.open(config) as conn:
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
