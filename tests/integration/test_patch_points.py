"""Every patch point round-trips a real model through a real server.

One client script loads through each patch point and prints a fingerprint of every
result (weights and outputs). It runs three times in fresh processes: plainly
(OVERMIND_DISABLE=1), cold (misses) and warm (hits); all three must agree.
"""

from __future__ import annotations

import json

import pytest
import torch

from .conftest import last_json

CLIENT = r'''
import hashlib, json, sys, warnings
import overmind.api
overmind.api.monkey_patch_all()
import torch, safetensors.torch
import transformers
from diffusers import (AutoencoderKL, ControlNetModel, DDIMScheduler, StableDiffusionControlNetPipeline,
                       StableDiffusionPipeline, UNet2DConditionModel)
from transformers import (AutoFeatureExtractor, AutoImageProcessor, AutoModelForCausalLM, AutoProcessor,
                          AutoTokenizer, CLIPTokenizer, LlamaForCausalLM)

paths = json.loads(sys.argv[1])
torch.manual_seed(0)
out = {}

def digest(t):
    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]

def weights(m):
    return hashlib.sha256(b"".join(bytes.fromhex(digest(v)) for v in m.state_dict().values())).hexdigest()[:16]

with torch.no_grad():
    unet = UNet2DConditionModel.from_pretrained(paths["sd"], subfolder="unet")
    out["unet"] = [type(unet).__name__, weights(unet),
                   digest(unet(torch.ones(1, 4, 16, 16), 3, torch.ones(1, 3, 32)).sample)]
    vae = AutoencoderKL.from_pretrained(paths["sd"], subfolder="vae")
    out["vae"] = [type(vae).__name__, weights(vae), digest(vae(torch.ones(1, 3, 32, 32)).sample)]
    a = ControlNetModel.from_pretrained(paths["controlnet_a"])
    b = ControlNetModel.from_pretrained(paths["controlnet_b"])
    out["controlnets"] = [weights(a), weights(b)]
    sched = DDIMScheduler.from_pretrained(paths["sd"], subfolder="scheduler")
    out["scheduler"] = [type(sched).__name__, json.dumps(dict(sched.config), sort_keys=True, default=str)]
    pipe = StableDiffusionControlNetPipeline.from_pretrained(paths["sd"], vae=vae, controlnet=[a, b],
                                                             safety_checker=None)
    image = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    res = pipe("a cat", image=[image, image], num_inference_steps=2, height=32, width=32, output_type="pt",
               generator=torch.Generator().manual_seed(0)).images
    out["controlnet_pipeline"] = [type(pipe).__name__, pipe.vae is vae, pipe.controlnet.nets[0] is a, digest(res)]
    sd = StableDiffusionPipeline.from_pretrained(paths["sd"], safety_checker=None)
    res = sd("a dog", num_inference_steps=2, height=32, width=32, output_type="pt",
             generator=torch.Generator().manual_seed(0)).images
    out["sd_pipeline"] = [type(sd).__name__, type(sd.tokenizer).__name__, digest(res)]
    lm = AutoModelForCausalLM.from_pretrained(paths["lm"])
    ids = torch.arange(12).unsqueeze(0)
    out["lm"] = [type(lm).__name__, lm.lm_head.weight is lm.model.embed_tokens.weight, digest(lm(ids).logits)]
    lm2 = LlamaForCausalLM.from_pretrained(paths["lm"], torch_dtype=torch.bfloat16)
    out["lm_bf16"] = [str(lm2.dtype), digest(lm2(ids).logits)]
    tok = AutoTokenizer.from_pretrained(paths["sd"], subfolder="tokenizer")
    tok2 = CLIPTokenizer.from_pretrained(paths["sd"], subfolder="tokenizer")
    out["tokenizers"] = [type(tok).__name__, tok("a red cat").input_ids, type(tok2).__name__, tok2("a red cat").input_ids]
    pixels = torch.rand(3, 40, 40, generator=torch.Generator().manual_seed(2))
    for name, cls in (("image_processor", AutoImageProcessor), ("processor", AutoProcessor)):
        proc = cls.from_pretrained(paths["processor"])
        out[name] = [type(proc).__name__, digest(torch.as_tensor(proc(images=pixels, return_tensors="pt")["pixel_values"]))]
    fe = AutoFeatureExtractor.from_pretrained(paths["feature_extractor"])
    audio = torch.rand(1600, generator=torch.Generator().manual_seed(3)).numpy()
    out["feature_extractor"] = [type(fe).__name__, digest(torch.as_tensor(fe(audio, sampling_rate=16000, return_tensors="pt")["input_values"]))]
    gen = transformers.pipeline("text-generation", model=paths["lm"], tokenizer=paths["lm_tokenizer"])
    out["hf_pipeline"] = [type(gen).__name__, type(gen.model).__name__, weights(gen.model)]
    state = torch.load(paths["pt"], weights_only=True)
    out["torch_load"] = {k: digest(v) for k, v in state.items()}
    out["safetensors"] = {k: digest(v) for k, v in safetensors.torch.load_file(paths["safetensors"]).items()}
    scripted = torch.jit.load(paths["jit"])
    out["jit"] = [digest(scripted(torch.ones(2, 4)))]
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def paths(tmp_path_factory, models):
    root = tmp_path_factory.mktemp("points")
    from overmind import modelgen
    from transformers import CLIPImageProcessor, CLIPProcessor, CLIPTokenizer

    sd = modelgen.save_sd_pipeline(root / "sd", seed=7)
    image_processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    CLIPProcessor(image_processor=image_processor,
                  tokenizer=CLIPTokenizer.from_pretrained(sd / "tokenizer")).save_pretrained(root / "proc")
    image_processor.save_pretrained(root / "proc")  # preprocessor_config.json for AutoImageProcessor
    from transformers import Wav2Vec2FeatureExtractor

    Wav2Vec2FeatureExtractor(feature_size=1, sampling_rate=16000).save_pretrained(root / "fe")
    state = {"w": torch.randn(8, 4), "b": torch.arange(5), "h": torch.randn(3).half()}
    torch.save(state, root / "state.pt")
    from safetensors.torch import save_file

    save_file(state, root / "state.safetensors")
    torch.jit.script(torch.nn.Linear(4, 3)).save(str(root / "scripted.pt"))
    from ..conftest import age_files

    age_files(root)
    return {
        "sd": str(sd), "controlnet_a": str(models["controlnet_a"]), "controlnet_b": str(models["controlnet_b"]),
        "lm": str(models["lm"]), "lm_tokenizer": str(sd / "tokenizer"), "processor": str(root / "proc"),
        "feature_extractor": str(root / "fe"),
        "pt": str(root / "state.pt"), "safetensors": str(root / "state.safetensors"),
        "jit": str(root / "scripted.pt"),
    }


def run_client(server, paths, **env):
    from ..conftest import run_python

    code = CLIENT.replace("sys.argv[1]", repr(json.dumps(paths)))
    return run_python(code, env=server.client_env(**env), timeout=400)


@pytest.mark.slow
def test_every_patch_point_round_trips_and_warm_loads_hit(server, paths):
    plain = last_json(run_client(server, paths, OVERMIND_DISABLE="1"))
    assert server.status()["misses"] == 0
    cold = run_client(server, paths)
    assert "overmind:" not in cold.stderr, cold.stderr[-3000:]
    status = server.wait_idle()
    assert status["misses"] > 0 and status["entries"] == status["misses"], server.log()
    warm = run_client(server, paths)
    assert "overmind:" not in warm.stderr, warm.stderr[-3000:]
    after = server.status()
    assert after["misses"] == status["misses"], "the warm run loaded something again"
    # Each load of the cold run is one hit of the warm run; a loader's reference (vae=vae) is no hit.
    assert after["hits"] - status["hits"] == status["hits"] + status["misses"] + status["plain_loads"], (status, after)
    cold, warm = last_json(cold), last_json(warm)
    for name in plain:
        assert cold[name] == plain[name], (name, cold[name], plain[name])
        assert warm[name] == plain[name], (name, warm[name], plain[name])
    # the vae=vae pattern keeps identity, as a plain load does
    assert plain["controlnet_pipeline"][1:3] == [True, True]
    # ... and the pipeline entry stores none of their bytes: they travel as references.
    entries = json.loads(server.cli("list", "--json").stdout)
    (pipeline,) = [e for e in entries if ":StableDiffusionControlNetPipeline.from_pretrained(" in e["description"]]
    passed = {e["key"] for e in entries
              if ":AutoencoderKL.from_pretrained(" in e["description"] or ":ControlNetModel.from_pretrained(" in e["description"]}
    assert len(passed) == 3 and passed <= set(pipeline["meta"]["references"])
    assert not passed & set(pipeline["refs"])
    # their loaders were handed those entries: none connected back (Note [The loader is handed its
    # references] in overmind.server.loaders); "run": each script's one line asked for a hand-over
    assert set(server.status()["peers"]) <= {"client", "cli", "run"}, server.status()["peers"]
