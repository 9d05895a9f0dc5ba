"""bitsandbytes LMs through a real server: a warm load's logits equal a plain quantized load's.

One client script loads a tiny Llama with ``BitsAndBytesConfig`` and prints the class of
its quantised weights, a digest of their quant state, and its logits. It runs plainly
(``OVERMIND_DISABLE=1``), cold (a miss: the loader quantises and packs) and warm (a hit:
zero-copy rebuild); all three must agree exactly.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("bitsandbytes")

from .conftest import last_json  # noqa: E402

CLIENT = r'''
import hashlib, json, sys
import overmind.api
overmind.api.monkey_patch_all()
import torch
from transformers import BitsAndBytesConfig, LlamaForCausalLM


def digest(t):
    return hashlib.sha256(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]

def quant_state(p):
    qs = getattr(p, "quant_state", None)
    if qs is not None:
        nested = qs.state2
        return [qs.quant_type, qs.blocksize, str(qs.dtype), list(qs.shape), digest(qs.absmax), digest(qs.code),
                None if nested is None else [nested.blocksize, digest(nested.absmax), digest(nested.code)]]
    return [p.has_fp16_weights, *(None if t is None else digest(t) for t in (p.CB, p.SCB))]

model = LlamaForCausalLM.from_pretrained(PATH, quantization_config=BitsAndBytesConfig(**QUANTIZATION))
weight = model.model.layers[0].self_attn.q_proj.weight
state = [type(weight).__name__, digest(weight), quant_state(weight)]
with torch.no_grad():
    logits = model(torch.tensor([[1, 7, 42, 3, 99, 250, 511, 0, 17, 64]], device=model.device)).logits
print(json.dumps({"weight": state, "device": str(weight.device), "logits": logits.flatten().tolist()}))
'''

CONFIGS = {
    "4bit": dict(load_in_4bit=True),
    "4bit-nf4-double-quant": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True),
    "8bit": dict(load_in_8bit=True),
}


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_warm_quantized_lm_logits_equal_a_plain_quantized_load(server, models, python, config):
    code = f"PATH = {str(models['lm'])!r}\nQUANTIZATION = {config!r}\n" + CLIENT
    strict = server.client_env(OVERMIND_STRICT="1")  # a fallback to a plain load would hide a cache failure

    def run(env):
        return last_json(python(code, env=env))

    plain = run(server.client_env(OVERMIND_DISABLE="1"))
    cold = run(strict)
    assert server.status()["hits"] == 0
    warm = run(strict)
    status = server.status()
    assert status["hits"] >= 1, (status, server.log()[-4000:])

    assert plain["weight"][0] == ("Int8Params" if config.get("load_in_8bit") else "Params4bit")
    for result in (cold, warm):
        assert result["weight"] == plain["weight"] and result["device"] == plain["device"]
        assert result["logits"] == plain["logits"]  # bit-identical, not close
