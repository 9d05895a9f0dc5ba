"""A hub id resolves through the local Hugging Face cache: switching refs/main is a miss."""

from __future__ import annotations

import shutil

import pytest

from ..conftest import age_files, run_python
from .conftest import last_json

CLIENT = """
import json
import overmind.api
overmind.api.monkey_patch_all()
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained("acme/tiny-lm")
print(json.dumps(float(model.lm_head.weight.double().sum())))
"""


@pytest.mark.slow
def test_switching_refs_main_to_another_snapshot_loads_the_new_weights(server, tmp_path):
    from overmind.modelgen import save_lm

    repo = tmp_path / "hub" / "models--acme--tiny-lm"
    sums = {}
    for name, seed in (("a" * 40, 1), ("b" * 40, 2)):
        model_dir = save_lm(tmp_path / f"src-{seed}", seed=seed)
        shutil.copytree(model_dir, repo / "snapshots" / name)
        import torch
        from safetensors.torch import load_file

        sums[name] = float(load_file(model_dir / "model.safetensors")["model.embed_tokens.weight"].double().sum())
    (repo / "refs").mkdir()
    env = server.client_env(HF_HUB_CACHE=str(tmp_path / "hub"), OVERMIND_COLD="wait")
    for name in ("a" * 40, "b" * 40):
        (repo / "refs" / "main").write_text(name)
        age_files(tmp_path / "hub")
        for _ in range(2):  # a miss, then a hit, each in a fresh process
            assert last_json(run_python(CLIENT, env=env)) == sums[name]  # tied: lm_head is embed_tokens
    status = server.status()
    assert status["misses"] == 2 and status["hits"] == 2, status
