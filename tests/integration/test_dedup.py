"""Stored once: identical contents share one segment region across entries.

Note [Stored once by content] in overmind.shared.segments.reductions; Note [Content index] in overmind.server.registry.
"""

from __future__ import annotations

import json
import shutil
import textwrap

import pytest

from ..conftest import age_files
from .conftest import last_json

BIG = 64 << 10  # overmind.shared.segments.reductions.DEDUP_MIN_BYTES: smaller storages are always copied


def _entries(server) -> dict[str, dict]:
    return {e["description"]: e for e in json.loads(server.cli("list", "--json").stdout)}


def _big_bytes(path) -> int:
    from safetensors.torch import load_file

    (weights,) = path.glob("*.safetensors")
    return sum(t.nbytes for t in load_file(weights).values() if t.nbytes >= BIG)


def test_two_copies_of_one_model_occupy_one_models_bytes(server, models, tmp_path):
    a, b = tmp_path / "lm-a", tmp_path / "lm-b"
    from overmind import modelgen

    modelgen.save_lm(a, "small", seed=11)
    shutil.copytree(a, b)
    age_files(a, b)
    code = f"""
        import json, overmind.api
        overmind.api.monkey_patch_all()
        from transformers import AutoModelForCausalLM
        from safetensors import safe_open  # not a patch point: reads the disk
        out = {{}}
        for name, path in (("a", {str(a)!r}), ("b", {str(b)!r})):
            model = AutoModelForCausalLM.from_pretrained(path)
            with safe_open(path + "/model.safetensors", "pt") as f:
                disk = {{k: f.get_tensor(k) for k in f.keys()}}
            state = model.state_dict()
            out[name] = all(state[k].equal(v) for k, v in disk.items())
        print(json.dumps(out))
    """
    env = server.client_env(OVERMIND_STRICT="1")  # wait for each entry, so b finds a's contents
    assert last_json(server.run(code, env=env)) == {"a": True, "b": True}
    first, second = sorted(_entries(server).values(), key=lambda e: e["created"])
    big = _big_bytes(a)
    assert big > 0.9 * first["bytes_owned"]
    assert second["meta"]["deduplicated"] == big
    assert second["refs"] == [first["key"]]
    # The copy writes only its small storages; what it shares is counted once, in `used`.
    assert second["bytes"] - second["bytes_shared"] < 0.1 * big, second
    assert server.status()["used"] < first["bytes"] + 0.1 * big
    # A fresh process gets both from the cache, with the weights on disk.
    assert last_json(server.run(code, env=env)) == {"a": True, "b": True}
    assert server.status()["hits"] == 2


EDIT_THEN_LOAD_COPY = """
    import json, sys, torch, overmind.api
    overmind.api.monkey_patch_all()
    from diffusers import UNet2DConditionModel
    from safetensors import safe_open  # not a patch point: reads the disk

    def matches_disk(model, path):
        with safe_open(path + "/diffusion_pytorch_model.safetensors", "pt") as f:
            disk = {k: f.get_tensor(k) for k in f.keys()}
        state = model.state_dict()
        return all(state[k].equal(v) for k, v in disk.items())

    first, second = sys.argv[1], sys.argv[2]
    edited = UNet2DConditionModel.from_pretrained(first)
    with torch.no_grad():
        for p in edited.parameters():
            p.mul_(3)
        edited.load_state_dict({k: torch.full_like(v, 7) for k, v in edited.state_dict().items()})
    edited.fuse_qkv_projections()
    copy = UNet2DConditionModel.from_pretrained(second)
    again = UNet2DConditionModel.from_pretrained(first)
    print(json.dumps({"copy": matches_disk(copy, second), "again": matches_disk(again, first),
                      "edited": all(bool((v == 7).all()) for k, v in edited.state_dict().items() if "to_qkv" not in k)}))
"""


@pytest.mark.slow
def test_writes_into_a_model_reach_no_other_key_with_identical_content(server, models, tmp_path):
    a, b = tmp_path / "unet-a", tmp_path / "unet-b"
    shutil.copytree(models["unet"], a)
    shutil.copytree(models["unet"], b)
    age_files(a, b)
    env = server.client_env(OVERMIND_STRICT="1")
    warm_up = f"""
        import overmind.api
        overmind.api.monkey_patch_all()
        from diffusers import UNet2DConditionModel
        UNet2DConditionModel.from_pretrained({str(a)!r}); UNet2DConditionModel.from_pretrained({str(b)!r})
    """
    server.run(warm_up, env=env)
    entries = _entries(server).values()
    assert sum(e["meta"]["deduplicated"] for e in entries) == _big_bytes(a)  # b's big storages are a's

    code = f"import sys; sys.argv[1:] = [{str(a)!r}, {str(b)!r}]\n" + textwrap.dedent(EDIT_THEN_LOAD_COPY)
    assert last_json(server.run(code, env=env)) == {"copy": True, "again": True, "edited": True}
    code = f"import sys; sys.argv[1:] = [{str(b)!r}, {str(a)!r}]\n" + textwrap.dedent(EDIT_THEN_LOAD_COPY)
    assert last_json(server.run(code, env=env)) == {"copy": True, "again": True, "edited": True}
    assert server.status()["misses"] == 2  # every later load was a hit on the shared segments


BUILDER = '''
import torch
from diffusers import ControlNetModel, UNet2DConditionModel


def controlnet_from_unet(path):
    unet = UNet2DConditionModel.from_pretrained(path)
    torch.manual_seed(0)
    return ControlNetModel.from_unet(unet)
'''


@pytest.mark.slow
def test_controlnet_from_unet_references_the_unets_segments(server, models, tmp_path):
    (tmp_path / "builder.py").write_text(BUILDER)
    unet = str(models["unet"])
    code = f"""
        import json, sys, torch
        sys.path.insert(0, {str(tmp_path)!r})
        import overmind.api
        overmind.api.monkey_patch_all()
        from diffusers import UNet2DConditionModel
        import builder
        unet = UNet2DConditionModel.from_pretrained({unet!r}).state_dict()
        cached = overmind.api.load(builder.controlnet_from_unet, {unet!r})
        plain = builder.controlnet_from_unet({unet!r})
        a, b = cached.state_dict(), plain.state_dict()
        copied = sum(v.nbytes for k, v in b.items() if v.nbytes >= {BIG} and k in unet and unet[k].equal(v))
        print(json.dumps({{"equal": a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a), "copied": copied}}))
    """
    env = server.client_env(OVERMIND_STRICT="1")
    result = last_json(server.run(code, env=env))
    assert result["equal"] and result["copied"] > 0
    entries = _entries(server)
    (controlnet,) = [e for d, e in entries.items() if "controlnet_from_unet" in d]
    (unet_entry,) = [e for d, e in entries.items() if "UNet2DConditionModel" in d]
    assert controlnet["refs"] == [unet_entry["key"]]
    # Down and mid blocks are copies of the UNet's: stored once, in the UNet's segments.
    assert controlnet["meta"]["deduplicated"] == result["copied"]
    # (the UNet's weights are its file's pages, its small storages a memfd of its own)
    assert controlnet["bytes_shared"] == unet_entry["bytes_shared"] >= result["copied"]
    assert last_json(server.run(code, env=env)) == result  # and a hit equals a plain build


def test_equal_tensors_found_in_another_entry_stay_distinct(server, tmp_path):
    import torch

    big = torch.randn(BIG // 4)
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    for path in (a, b):
        torch.save({"x": big, "twin": big.clone()}, path)
    age_files(a, b)
    code = f"""
        import json, torch, overmind.api
        overmind.api.monkey_patch_all()
        torch.load({str(a)!r}, weights_only=True)
        state = torch.load({str(b)!r}, weights_only=True)  # both of its tensors are found in a's entry
        state["x"].mul_(0)
        print(json.dumps({{"twin_kept": bool(state["twin"].abs().sum() > 0), "x_zero": bool((state["x"] == 0).all())}}))
    """
    result = last_json(server.run(code, env=server.client_env(OVERMIND_STRICT="1")))
    assert result == {"twin_kept": True, "x_zero": True}
    (second,) = [e for d, e in _entries(server).items() if "b.pt" in d]
    assert second["meta"]["deduplicated"] == 2 * big.nbytes


def test_a_large_files_contents_come_after_its_answer_and_a_copy_loaded_later_shares_them(server, tmp_path):
    """Note [Hashing a file's storages after the answer] in overmind.warm.loader: a pack of 40 MB
    (over the 32 MB from which a loader reports progress) leaves its file's storages unhashed,
    answers, then sends their contents; a copy of the file loaded afterwards finds them."""
    import torch
    from safetensors.torch import save_file

    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    torch.manual_seed(0)
    weights = {f"w{i}": torch.randn(5 << 20) for i in range(2)}  # 2 x 20 MiB
    save_file(weights, str(a))
    shutil.copyfile(a, b)
    age_files(a, b)
    code = """
        import json, overmind.api
        overmind.api.monkey_patch_all()
        from safetensors.torch import load_file
        from safetensors import safe_open  # not a patch point: reads the disk
        path = {path!r}
        loaded = load_file(path)
        with safe_open(path, "pt") as f:
            print(json.dumps(all(loaded[k].equal(f.get_tensor(k)) for k in f.keys())))
    """
    env = server.client_env(OVERMIND_STRICT="1")  # each load waits for its entry
    assert last_json(server.run(code.format(path=str(a)), env=env)) is True
    # its storages stayed in the file (Note [File-backed segments]): the case that hashes later
    assert server.wait_idle()["file_segments"]["bytes"] >= a.stat().st_size  # and what it sent later was heard
    assert last_json(server.run(code.format(path=str(b)), env=env)) is True
    first, second = sorted(_entries(server).values(), key=lambda e: e["created"])
    assert first["meta"]["deduplicated"] == 0
    assert second["meta"]["deduplicated"] == sum(t.nbytes for t in weights.values())
    assert second["refs"] == [first["key"]]
