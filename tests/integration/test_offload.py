"""What cannot be rebuilt is not cached (ARCHITECTURE.md, invariant 9): a model offloaded to disk.

``device_map="auto"`` with too little memory leaves weights on the meta device and accelerate
hooks that read them from the checkpoint or an offload folder on every forward pass. Nothing
of that survives a trip through shared memory, so the loader says so, the server remembers
the key as not cacheable, and every caller loads plainly and silently, as plain python would
(Note [Results that cannot be rebuilt] in overmind.shared.segments.quirks).
"""

from __future__ import annotations

import json

import pytest

from .conftest import last_json

SCRIPT = r'''
import hashlib, json, os, sys
if os.environ.get("OVERMIND_DISABLE") != "1":
    import overmind.api
    overmind.api.monkey_patch_all()
import torch
from transformers import AutoModelForCausalLM

model = AutoModelForCausalLM.from_pretrained(os.environ["TEST_MODEL"], device_map="auto",
                                             max_memory={"cpu": "150KB"}, offload_folder=os.environ["TEST_OFFLOAD"])
with torch.no_grad():
    logits = model(torch.arange(12).reshape(1, 12)).logits
print(json.dumps({"logits": hashlib.sha256(logits.float().numpy().tobytes()).hexdigest(),
                  "meta": sum(p.is_meta for p in model.parameters())}))
'''


@pytest.mark.slow
def test_a_disk_offloaded_model_loads_plainly_and_silently_and_is_counted_not_cacheable(server, models, tmp_path):
    def run(offload: str, **env: str) -> dict:
        proc = server.run(SCRIPT, env=server.client_env(TEST_MODEL=str(models["lm"]), TEST_OFFLOAD=offload, **env))
        assert "overmind" not in proc.stderr, proc.stderr[-3000:]  # no warning, no OvermindError
        server.wait_idle()
        return last_json(proc)

    folder = str(tmp_path / "offload")
    plain = run(folder, OVERMIND_DISABLE="1")
    assert plain["meta"] > 0  # the premise: this load does offload
    # Cold, warm, and warm under OVERMIND_STRICT=1 (which waits for the cache, then raises on
    # anything but this verdict); then a new key cold under OVERMIND_STRICT=1.
    runs = [run(folder), run(folder), run(folder, OVERMIND_STRICT="1"),
            run(str(tmp_path / "other"), OVERMIND_STRICT="1")]
    assert runs == [plain] * 4
    status = server.status()
    # Each key went to a loader once; no call was served from the cache.
    assert (status["hits"], status["misses"], status["entries"]) == (0, 2, 0), json.dumps(status)
    assert status["not_cacheable"] == 4, json.dumps(status)
    assert "overmind" not in server.cli("status").stderr
