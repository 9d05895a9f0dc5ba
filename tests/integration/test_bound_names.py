"""Names a library bound before ``monkey_patch_all()`` are hits under a warm ``overmind run``.

peft does ``from safetensors.torch import load_file as safe_load_file`` when it is imported. Under
plain python that import follows the patch, so peft binds the wrapper; a warm interpreter that
learned peft imported it before the run's patch, so the name held the original and adapter loads
missed the cache (Note [Names bound before patching] in overmind.shared.patching.bound_names). Real server, a real
LoRA adapter made with peft for the session's small LM, real ``overmind run``.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from ..conftest import age_files
from .conftest import last_json

pytest.importorskip("peft")

OVERMIND = str(Path(sys.executable).parent / "overmind")

MAKE_ADAPTER = """
import sys, torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM
torch.manual_seed(11)
base = AutoModelForCausalLM.from_pretrained(sys.argv[1])
config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
get_peft_model(base, config).save_pretrained(sys.argv[2])
"""

LOAD_ADAPTER = """
import sys
preloaded = "peft" in sys.modules  # a warm interpreter imported it before the patch below
import overmind.api
overmind.api.monkey_patch_all()
import hashlib, json
from peft import PeftModel
from transformers import AutoModelForCausalLM
base = AutoModelForCausalLM.from_pretrained(sys.argv[1])
model = PeftModel.from_pretrained(base, sys.argv[2])
lora = {k: hashlib.sha256(v.detach().contiguous().numpy().tobytes()).hexdigest()
        for k, v in model.state_dict().items() if "lora_" in k}
print(json.dumps({"preloaded": preloaded, "lora": lora}))
"""


@pytest.fixture
def adapter(tmp_path, models) -> Path:
    out = tmp_path / "adapter"
    proc = subprocess.run([sys.executable, "-c", MAKE_ADAPTER, str(models["lm"]), str(out)], capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert any(out.glob("*.safetensors")), list(out.iterdir())
    age_files(out)
    return out


def _counted(server, argv: list[str]) -> tuple[dict, int, bool]:
    """(the script's report, how many hits it got, whether it was forked from a warm interpreter)."""
    server.wait_idle()
    before = server.status()
    proc = subprocess.run(argv, env=server.client_env(), capture_output=True, text=True, timeout=180,
                          cwd=Path(argv[-3]).parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Warning: overmind" not in proc.stderr, proc.stderr[-3000:]
    after = server.wait_idle()
    return last_json(proc), after["hits"] - before["hits"], after["runs"] == before["runs"] + 1


@pytest.mark.slow
def test_an_adapter_loaded_by_peft_imported_before_the_patch_is_a_hit(server, models, adapter, tmp_path):
    script = tmp_path / "load_adapter.py"
    script.write_text(LOAD_ADAPTER)
    args = [str(script), str(models["lm"]), str(adapter)]
    _counted(server, [sys.executable, *args])  # fills the base model and the adapter
    plain, plain_hits, _ = _counted(server, [sys.executable, *args])
    assert not plain["preloaded"]
    assert plain_hits >= 2, plain_hits  # the base model and the adapter's load_file

    deadline = time.monotonic() + 240
    tries = []
    while True:  # until a run is forked from an interpreter that learned peft
        warm, warm_hits, forked = _counted(server, [OVERMIND, "run", *args])
        tries.append((forked, warm["preloaded"], warm_hits))
        if (forked and warm["preloaded"]) or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert forked and warm["preloaded"], (tries, server.log()[-3000:])
    assert warm_hits == plain_hits, tries  # before the fix: the adapter's load_file missed
    assert warm["lora"] == plain["lora"] and len(plain["lora"]) == 8
