"""CUDA paths (skipped without a GPU): CUDA storages are cached on the host and rebuilt on their device."""

from __future__ import annotations

import pytest
import torch

from overmind.shared.segments.reductions import pack, unpack

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_cuda_tensors_round_trip_onto_their_device():
    src = {"w": torch.randn(64, 64, device="cuda"), "b": torch.arange(8, device="cuda")}
    packed = pack(src)
    again = unpack(packed.skeleton, packed.map_private())
    for key, value in src.items():
        assert again[key].device == value.device
        assert torch.equal(again[key], value)


def test_a_rebuilt_model_moves_to_cuda_and_matches_a_plain_model():
    from overmind.modelgen import build_unet

    model = build_unet("tiny")
    packed = pack(model)
    rebuilt = unpack(packed.skeleton, packed.map_private()).to("cuda")
    plain = model.to("cuda")
    args = (torch.ones(1, 4, 16, 16, device="cuda"), torch.tensor([3], device="cuda"), torch.ones(1, 3, 32, device="cuda"))
    with torch.no_grad():
        assert torch.equal(rebuilt(*args).sample, plain(*args).sample)
