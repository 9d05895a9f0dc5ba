"""bitsandbytes LMs through a real server: a warm load's logits equal a plain quantized load's.

One client script loads a tiny Llama with ``BitsAndBytesConfig``, once per quantisation below,
and prints for each the class of its quantised weights, a digest of their quant state, and its
logits. It runs plainly (``OVERMIND_DISABLE=1``), cold (a miss per quantisation: the loader
quantises and packs) and warm (a hit per quantisation: zero-copy rebuild); all three must agree
exactly. The quantisations share one process per run (three processes, not nine: importing
transformers with bitsandbytes is most of each), so each is a key of its own in one server.
"""

from __future__ import annotations


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

results = {}
for name, quantization in QUANTIZATIONS.items():
    model = LlamaForCausalLM.from_pretrained(PATH, quantization_config=BitsAndBytesConfig(**quantization))
    weight = model.model.layers[0].self_attn.q_proj.weight
    state = [type(weight).__name__, digest(weight), quant_state(weight)]
    with torch.no_grad():
        logits = model(torch.tensor([[1, 7, 42, 3, 99, 250, 511, 0, 17, 64]], device=model.device)).logits
    results[name] = {"weight": state, "device": str(weight.device), "logits": logits.flatten().tolist()}
    del model, weight
print(json.dumps(results))
'''

CONFIGS = {
    "4bit": dict(load_in_4bit=True),
    "4bit-nf4-double-quant": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True),
    "8bit": dict(load_in_8bit=True),
}


@pytest.mark.slow
def test_warm_quantized_lm_logits_equal_a_plain_quantized_load(server, models, python):
    code = f"PATH = {str(models['lm'])!r}\nQUANTIZATIONS = {CONFIGS!r}\n" + CLIENT
    strict = server.client_env(OVERMIND_STRICT="1")  # a fallback to a plain load would hide a cache failure

    def run(env):
        return last_json(python(code, env=env))

    plain = run(server.client_env(OVERMIND_DISABLE="1"))
    cold = run(strict)
    assert server.status()["hits"] == 0
    warm = run(strict)
    status = server.status()
    assert status["hits"] >= len(CONFIGS), (status, server.log()[-4000:])

    for name, config in CONFIGS.items():
        assert plain[name]["weight"][0] == ("Int8Params" if config.get("load_in_8bit") else "Params4bit"), name
        for run_name, result in (("cold", cold), ("warm", warm)):
            assert result[name]["weight"] == plain[name]["weight"], (name, run_name)
            assert result[name]["device"] == plain[name]["device"], (name, run_name)
            assert result[name]["logits"] == plain[name]["logits"], (name, run_name)  # bit-identical, not close
