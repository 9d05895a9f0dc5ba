"""Note [Results that cannot be rebuilt] in overmind.shared.segments.quirks: what the loader refuses to pack."""

from __future__ import annotations

import pytest
import torch

from overmind.shared.segments import quirks


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))


def test_a_model_with_its_weights_is_rebuildable():
    quirks.check_rebuildable(_model())
    quirks.check_rebuildable({"w": torch.ones(2)})


def test_a_weight_on_the_meta_device_is_not_rebuildable():
    model = _model()
    model[1].weight = torch.nn.Parameter(torch.empty(4, device="meta"))
    with pytest.raises(quirks.NotRebuildable, match="1.weight"):
        quirks.check_rebuildable(model)
    with pytest.raises(quirks.NotRebuildable):
        quirks.check_rebuildable({"w": torch.empty(2, device="meta")})


def test_an_accelerate_hook_that_offloads_is_not_rebuildable():
    hooks = pytest.importorskip("accelerate.hooks")
    model = _model()
    # Weights still in place, but read from a weights map at each forward: not ours to rebuild.
    hooks.add_hook_to_module(model[0], hooks.AlignDevicesHook(weights_map={"weight": torch.ones(4, 4)}))
    with pytest.raises(quirks.NotRebuildable, match="0"):
        quirks.check_rebuildable(model)


def test_an_accelerate_hook_that_only_places_inputs_is_rebuildable():
    hooks = pytest.importorskip("accelerate.hooks")
    model = _model()
    hooks.add_hook_to_module(model, hooks.AlignDevicesHook(execution_device="cpu", io_same_device=True))
    quirks.check_rebuildable(model)
