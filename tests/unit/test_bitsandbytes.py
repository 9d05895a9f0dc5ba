"""bitsandbytes models through pack/unpack: parameter classes, quant state and logits survive.

See Note [Quantised parameters] in ``overmind.shared.segments.quirks``.
"""

from __future__ import annotations

import pickle

import pytest

bnb = pytest.importorskip("bitsandbytes")

import torch  # noqa: E402

from overmind import modelgen  # noqa: E402
from overmind.shared.segments import quirks
from overmind.shared.segments.reductions import pack, unpack  # noqa: E402

from ..conftest import run_python  # noqa: E402
from ..helpers.mappings import inside, mapping_ranges  # noqa: E402

Params4bit = bnb.nn.Params4bit
Int8Params = bnb.nn.Int8Params

CONFIGS = {
    "4bit-fp4": dict(load_in_4bit=True),
    "4bit-nf4-double-quant": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True),
    "8bit": dict(load_in_8bit=True),
}
INPUT_IDS = torch.tensor([[1, 7, 42, 3, 99, 250, 511, 0, 17, 64]])


@pytest.fixture(scope="module")
def lm_path(tmp_path_factory):
    return modelgen.save_lm(tmp_path_factory.mktemp("bnb") / "lm", "tiny", seed=5)


def load(path, **quantization):
    from transformers import BitsAndBytesConfig, LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(path, quantization_config=BitsAndBytesConfig(**quantization))


def logits(model) -> torch.Tensor:
    with torch.no_grad():  # on a GPU, transformers puts a quantised model on it
        return model(INPUT_IDS.to(model.device)).logits


def round_trip(model):
    quirks.prepare_for_pickle(model)
    packed = pack(model)
    mappings = packed.map_private()
    return unpack(packed.skeleton, mappings), packed, mappings


def state_tensors(qs) -> list[torch.Tensor]:
    tensors = [v for v in vars(qs).values() if isinstance(v, torch.Tensor)]
    if getattr(qs, "state2", None) is not None:
        tensors += state_tensors(qs.state2)
    return tensors


def assert_same_quant_state(got, want) -> None:
    assert type(got) is type(want)
    assert set(vars(got)) == set(vars(want))
    for name, value in vars(want).items():
        if name == "state2" and value is not None:
            assert_same_quant_state(got.state2, value)
        elif isinstance(value, torch.Tensor):
            assert torch.equal(getattr(got, name), value) and getattr(got, name).dtype == value.dtype, name
        else:
            assert getattr(got, name) == value, name


def in_segment(ranges, tensor) -> bool:
    """A CPU tensor is rebuilt inside the segment; a CUDA one is copied back to its device."""
    return inside(ranges, tensor) if tensor.device.type == "cpu" else tensor.device.type == "cuda"


def assert_same_parameters(again, model, ranges) -> None:
    got = dict(again.named_parameters(remove_duplicate=False))
    want = dict(model.named_parameters(remove_duplicate=False))
    assert got.keys() == want.keys()
    quantized = 0
    for name, p in want.items():
        q = got[name]
        assert type(q) is type(p), name
        assert q.requires_grad == p.requires_grad, name
        assert q.dtype == p.dtype and q.shape == p.shape, name
        assert torch.equal(q.data, p.data) and q.device == p.device, name
        assert in_segment(ranges, q), f"{name} was copied out of the segment"
        assert set(q.__dict__) == set(p.__dict__), name
        if isinstance(p, Params4bit):
            quantized += 1
            for attr in ("blocksize", "compress_statistics", "quant_type", "quant_storage", "bnb_quantized"):
                assert getattr(q, attr) == getattr(p, attr), (name, attr)
            assert_same_quant_state(q.quant_state, p.quant_state)
            for t in state_tensors(q.quant_state):
                assert in_segment(ranges, t), f"{name}.quant_state tensor was copied out of the segment"
        elif isinstance(p, Int8Params):
            quantized += 1
            assert q.has_fp16_weights == p.has_fp16_weights
            for attr in ("CB", "SCB"):
                if getattr(p, attr) is None:
                    assert getattr(q, attr) is None, (name, attr)
                else:
                    assert torch.equal(getattr(q, attr), getattr(p, attr)), (name, attr)
                    assert in_segment(ranges, getattr(q, attr)), (name, attr)
            if p.CB is not None:
                assert q.CB.data_ptr() == q.data_ptr(), "CB and the weight share one storage"
    assert quantized == 14  # 7 linear layers in each of 2 decoder layers


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_quantized_lm_round_trip_keeps_classes_quant_state_and_logits(lm_path, config):
    model = load(lm_path, **config)
    again, packed, mappings = round_trip(model)  # packed as the loader does: before any forward
    assert packed.pickler == "pickle"
    assert_same_parameters(again, model, mapping_ranges(mappings))
    assert torch.equal(logits(again), logits(model))
    assert torch.equal(logits(again), logits(load(lm_path, **config)))  # a fresh plain quantized load


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_quantized_lm_round_trip_after_a_forward_pass(lm_path, config):
    # A forward pass moves state: Linear8bitLt moves CB/SCB into its MatmulLtState, and Linear4bit
    # repacks weights for AVX512-BF16 CPUs (extra QuantState attributes, state2 dropped).
    model = load(lm_path, **config)
    want = logits(model)
    again, _, mappings = round_trip(model)
    assert_same_parameters(again, model, mapping_ranges(mappings))
    for name, module in model.named_modules():
        if isinstance(module, bnb.nn.Linear8bitLt):
            rebuilt = again.get_submodule(name)
            for attr in ("CB", "SCB"):
                if getattr(module.state, attr) is not None:
                    assert torch.equal(getattr(rebuilt.state, attr), getattr(module.state, attr))
    assert torch.equal(logits(again), want)


def test_params4bit_module_back_reference_resolves_to_the_rebuilt_module(lm_path):
    model = load(lm_path, load_in_4bit=True)
    again, _, _ = round_trip(model)
    checked = 0
    for name, module in again.named_modules():
        if isinstance(module, bnb.nn.Linear4bit) and model.get_submodule(name).weight.module is not None:
            assert module.weight.module is module
            checked += 1
    if checked == 0:
        pytest.skip("this transformers version sets no Params4bit.module")


def test_quantized_parameters_survive_the_dill_fallback(lm_path):
    model = load(lm_path, load_in_4bit=True)
    model.postprocess = lambda x: x  # stdlib pickle refuses lambdas
    quirks.prepare_for_pickle(model)
    packed = pack(model)
    assert packed.pickler == "dill"
    again = unpack(packed.skeleton, packed.map_private())
    assert type(again.model.layers[0].self_attn.q_proj.weight) is Params4bit
    assert torch.equal(logits(again), logits(model))


def test_unpickling_a_parameter_record_of_another_version_is_a_clear_error():
    record = quirks.ParameterSubclass(Int8Params, torch.zeros(2, dtype=torch.int8), False, version=99)
    with pytest.raises(pickle.UnpicklingError, match="version 99"):
        quirks.rebuild_parameter_subclass(record)


def test_registering_reducers_imports_no_library_that_is_not_loaded():
    # A warm interpreter imports torch and overmind.shared.segments.quirks, then forks loaders: importing bitsandbytes there
    # would probe CUDA (Note [Warm interpreters never touch CUDA]).
    run_python("""
        import sys, torch
        from overmind.shared.segments import quirks
        assert quirks.register_reducers() == []
        quirks.prepare_for_pickle(torch.nn.Linear(2, 2))
        from overmind.shared.segments.reductions import pack
        pack({"w": torch.nn.Parameter(torch.ones(2))})
        assert "bitsandbytes" not in sys.modules, "bitsandbytes was imported"
    """)
