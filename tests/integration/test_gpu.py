"""CUDA through the real server (skipped without a GPU): a hit moved to the GPU computes what
plain python's model computes there, a checkpoint of CUDA tensors comes back on its device, and
`overmind run` of a diffusers script that uses the GPU forks from run 2."""

from __future__ import annotations

import pytest
import torch

from ..conftest import age_files
from .conftest import curve, last_json

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

UNET_ON_CUDA = """
import json, os, torch
if os.environ["MODE"] == "patched":
    import overmind.api
    overmind.api.monkey_patch_all()
from diffusers import UNet2DConditionModel
unet = UNet2DConditionModel.from_pretrained({path!r}).to("cuda")
cfg = unet.config
args = (torch.ones(1, cfg.in_channels, 16, 16, device="cuda"), torch.tensor([3], device="cuda"),
        torch.ones(1, 3, cfg.cross_attention_dim, device="cuda"))
with torch.no_grad():
    out = unet(*args).sample
hit = os.environ["MODE"] == "patched" and overmind.api.cache_key_of(unet) is not None
print(json.dumps({{"sum": float(out.double().sum()), "head": out.flatten()[:4].tolist(), "hit": hit}}))
"""

CUDA_CHECKPOINT = """
import json, os, torch
if os.environ["MODE"] == "patched":
    import overmind.api
    overmind.api.monkey_patch_all()
state = torch.load({path!r})
print(json.dumps({{k: [str(v.device), float(v.double().sum())] for k, v in state.items()}}))
"""


def _python(server, code: str, mode: str) -> dict:
    return last_json(server.run(code, env=server.client_env(MODE=mode, OVERMIND_STRICT="1")))


def test_a_hit_moved_to_cuda_computes_what_plain_computes_there(server, models):
    code = UNET_ON_CUDA.format(path=str(models["unet"]))
    plain = _python(server, code, "plain")
    _python(server, code, "patched")  # fills
    server.wait_idle()
    hit = _python(server, code, "patched")
    assert hit["hit"]
    assert (hit["sum"], hit["head"]) == (plain["sum"], plain["head"])


def test_a_checkpoint_of_cuda_tensors_comes_back_on_its_device(server, tmp_path):
    path = tmp_path / "cuda.pt"
    torch.save({"w": torch.randn(256, 256, device="cuda"), "b": torch.arange(64, device="cuda")}, path)
    code = CUDA_CHECKPOINT.format(path=str(path))
    plain = _python(server, code, "plain")
    _python(server, code, "patched")
    server.wait_idle()
    assert _python(server, code, "patched") == plain
    assert plain["w"][0].startswith("cuda")


def test_overmind_run_of_a_gpu_script_forks_from_run_2(server, models, tmp_path):
    """On a GPU machine the warm interpreter's imports ask whether CUDA is there; NVML's driver
    thread must not stop it forking (Note [NVML answered from outside] in overmind.warm.devices)."""
    script = tmp_path / "unet_cuda.py"
    script.write_text(UNET_ON_CUDA.format(path=str(models["unet"])))
    age_files(script)
    runs = curve(server, script, server.client_env(MODE="patched"))
    log = server.log()
    assert [forked for forked, _ in runs] == [False, True, True], log[-8000:]
    assert [out["hit"] for _, out in runs] == [False, True, True], log[-8000:]
    assert len({(out["sum"], tuple(out["head"])) for _, out in runs}) == 1
    assert "nobody vouches for" not in log, log[-8000:]
