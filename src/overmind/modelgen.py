"""Build real diffusers/transformers models with random weights, without a hub.

Tests and benchmarks never download weights: they construct models from explicit
configs and ``save_pretrained`` them. Construction happens on the meta device and
weights are then drawn directly in the target dtype, so a 1.7 GB UNet is made in
seconds rather than through a full fp32 init::

    path = save_unet(tmp_path / "unet", size="sd15", dtype=torch.float16)

Sizes: ``tiny`` (kilobytes, for tests), ``small`` (tens of MB), ``sd15`` (SD1.5: UNet
860 M parameters) and ``large`` (an SD1.5 layout 1.4x as wide: UNet 1.7 B); LMs ``tiny``,
``small``, ``1b`` (1.1 B) and ``3b`` (3.4 B). :func:`save_sd_single_file` writes a pipeline
folder as one checkpoint in the original (LDM) key layout, for ``from_single_file``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "UNET_CONFIGS", "VAE_CONFIGS", "LM_CONFIGS", "CONTROLNET_CONFIGS",
    "random_init", "build_unet", "build_vae", "build_lm", "build_controlnet",
    "save_unet", "save_vae", "save_lm", "save_controlnet", "save_sd_pipeline", "save_sd_single_file", "dir_nbytes",
    "age_files",
]

# SD1.5 UNet: ~860 M parameters (1.7 GB in fp16).
UNET_CONFIGS: dict[str, dict[str, Any]] = {
    "sd15": dict(sample_size=64, cross_attention_dim=768, attention_head_dim=8),
    "large": dict(sample_size=64, cross_attention_dim=768, attention_head_dim=8,
                  block_out_channels=(448, 896, 1792, 1792)),
    "small": dict(sample_size=32, cross_attention_dim=256, attention_head_dim=8,
                  block_out_channels=(64, 128, 256, 256)),
    "tiny": dict(
        sample_size=16, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32, attention_head_dim=4, norm_num_groups=8,
    ),
}
VAE_CONFIGS: dict[str, dict[str, Any]] = {
    "sd15": dict(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(128, 256, 512, 512), layers_per_block=2,
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4, sample_size=512,
    ),
    "small": dict(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(32, 64, 128, 128), layers_per_block=2,
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4, sample_size=256,
    ),
    "tiny": dict(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(16, 32), layers_per_block=1,
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2, norm_num_groups=8,
        sample_size=32,
    ),
}
VAE_CONFIGS["large"] = VAE_CONFIGS["sd15"]  # SD-family models share the SD1.5 VAE
CONTROLNET_CONFIGS: dict[str, dict[str, Any]] = {
    "sd15": dict(cross_attention_dim=768, attention_head_dim=8),
    # A ControlNet mirrors its UNet's down blocks.
    "large": dict(cross_attention_dim=768, attention_head_dim=8, block_out_channels=(448, 896, 1792, 1792)),
    "small": dict(cross_attention_dim=256, attention_head_dim=8, block_out_channels=(64, 128, 256, 256),
                  conditioning_embedding_out_channels=(16, 32, 96, 256)),
    "tiny": dict(
        in_channels=4, block_out_channels=(32, 64), layers_per_block=1, cross_attention_dim=32, attention_head_dim=4,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), norm_num_groups=8,
        conditioning_embedding_out_channels=(8, 16),
    ),
}
# Llama-style causal LMs. "1b": ~1.1 B parameters (TinyLlama's shape); "3b": ~3.4 B (OpenLLaMA-3B's).
LM_CONFIGS: dict[str, dict[str, Any]] = {
    "3b": dict(hidden_size=3200, intermediate_size=8640, num_hidden_layers=26, num_attention_heads=32,
               num_key_value_heads=32, vocab_size=32000, max_position_embeddings=2048, tie_word_embeddings=False),
    "1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
               num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048, tie_word_embeddings=False),
    "small": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4, vocab_size=4096, max_position_embeddings=512, tie_word_embeddings=False),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, max_position_embeddings=128, tie_word_embeddings=True),
}


def random_init(module: torch.nn.Module, dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    """Materialise a meta-device module on CPU with small random weights in ``dtype``."""
    # nn.Module.to, not ModelMixin.to: casting on meta is free and the override only warns.
    module = torch.nn.Module.to(module, dtype).to_empty(device="cpu")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in list(module.named_parameters()) + list(module.named_buffers()):
            if not tensor.is_floating_point():
                continue
            if tensor.dim() == 1:
                # Norm scales near one, biases near zero: activations stay finite in fp16.
                (tensor.normal_(1.0, 0.02, generator=gen) if "norm" in name or "weight" in name
                 else tensor.normal_(0.0, 0.02, generator=gen))
            else:
                tensor.normal_(0.0, tensor[0].numel() ** -0.5, generator=gen)
    return module.eval()


def _on_meta(factory):
    with torch.device("meta"):
        return factory()


def build_unet(size: str = "tiny", dtype: torch.dtype = torch.float32, seed: int = 0):
    from diffusers import UNet2DConditionModel

    return random_init(_on_meta(lambda: UNet2DConditionModel(**UNET_CONFIGS[size])), dtype, seed)


def build_vae(size: str = "tiny", dtype: torch.dtype = torch.float32, seed: int = 0):
    from diffusers import AutoencoderKL

    return random_init(_on_meta(lambda: AutoencoderKL(**VAE_CONFIGS[size])), dtype, seed)


def build_controlnet(size: str = "tiny", dtype: torch.dtype = torch.float32, seed: int = 0):
    from diffusers import ControlNetModel

    return random_init(_on_meta(lambda: ControlNetModel(**CONTROLNET_CONFIGS[size])), dtype, seed)


def build_lm(size: str = "tiny", dtype: torch.dtype = torch.float32, seed: int = 0, **overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**LM_CONFIGS[size], **overrides})
    model = random_init(_on_meta(lambda: LlamaForCausalLM(config)), dtype, seed)
    if config.tie_word_embeddings:
        model.tie_weights()
    # Rotary caches are computed buffers, not random weights.
    for module in model.modules():
        if hasattr(module, "inv_freq") and hasattr(module, "rope_init_fn"):
            inv_freq, _ = module.rope_init_fn(module.config, "cpu")
            module.inv_freq = inv_freq
            module.original_inv_freq = inv_freq
    return model


def _save(model, path: os.PathLike, variant=None, safe=True) -> Path:
    path = Path(path)
    model.save_pretrained(path, safe_serialization=safe, variant=variant)
    if not safe and not any(path.glob("*.bin")):
        _safetensors_to_bin(path)
    return path


def _safetensors_to_bin(path: Path) -> None:
    # transformers 5 writes safetensors whatever safe_serialization says; a pickle checkpoint
    # (the format plain loads cannot map from the page cache) has to be written by hand.
    from safetensors.torch import load_file

    shards = sorted(path.glob("*.safetensors"))
    state: dict = {}
    for shard in shards:
        state.update(load_file(shard))
    torch.save(state, path / "pytorch_model.bin")
    for leftover in [*shards, *path.glob("*.safetensors.index.json")]:
        leftover.unlink()


def save_unet(path, size="tiny", dtype=torch.float32, seed=0, variant=None) -> Path:
    return _save(build_unet(size, dtype, seed), path, variant)


def save_vae(path, size="tiny", dtype=torch.float32, seed=0, variant=None) -> Path:
    return _save(build_vae(size, dtype, seed), path, variant)


def save_controlnet(path, size="tiny", dtype=torch.float32, seed=0, variant=None) -> Path:
    return _save(build_controlnet(size, dtype, seed), path, variant)


def save_lm(path, size="tiny", dtype=torch.float32, seed=0, safe=True, **overrides) -> Path:
    return _save(build_lm(size, dtype, seed, **overrides), path, safe=safe)


def dir_nbytes(path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


CLIP_TEXT_CONFIGS: dict[str, dict[str, Any]] = {
    "sd15": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                 vocab_size=49408, max_position_embeddings=77, projection_dim=768),
    "small": dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
                  vocab_size=1000, max_position_embeddings=77, projection_dim=256),
    "tiny": dict(hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                 vocab_size=1000, max_position_embeddings=77, projection_dim=32),
}
CLIP_TEXT_CONFIGS["large"] = CLIP_TEXT_CONFIGS["sd15"]


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2/CLIP byte-level alphabet: every byte maps to a printable character.
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, n = keep[:], 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(keep, map(chr, chars)))


def save_clip_tokenizer(path) -> Path:
    """A minimal byte-level CLIP tokenizer (vocab.json + merges.txt), made locally."""
    import json

    from transformers import CLIPTokenizer

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    alphabet = list(_bytes_to_unicode().values())
    tokens = alphabet + [c + "</w>" for c in alphabet] + ["<|startoftext|>", "<|endoftext|>"]
    (path / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(tokens)}))
    (path / "merges.txt").write_text("#version: 0.2\n")
    tok = CLIPTokenizer(str(path / "vocab.json"), str(path / "merges.txt"), model_max_length=77)
    (path / "vocab.json").unlink()
    (path / "merges.txt").unlink()
    tok.save_pretrained(path)
    return path


def build_text_encoder(size: str = "tiny", dtype: torch.dtype = torch.float32, seed: int = 0):
    from transformers import CLIPTextConfig, CLIPTextModel

    config = CLIPTextConfig(**CLIP_TEXT_CONFIGS[size])
    model = random_init(_on_meta(lambda: CLIPTextModel(config)), dtype, seed)
    with torch.no_grad():  # position ids are a buffer of indices, not weights
        for name, buf in model.named_buffers():
            if name.endswith("position_ids"):
                buf.copy_(torch.arange(buf.shape[-1]).expand_as(buf))
    return model


def save_sd_pipeline(path, size: str = "tiny", dtype: torch.dtype = torch.float32, seed: int = 0,
                     variant: str | None = None) -> Path:
    """A StableDiffusionPipeline folder (unet, vae, text encoder, tokenizer, scheduler)."""
    from diffusers import DDIMScheduler, StableDiffusionPipeline

    path = Path(path)
    tokenizer_dir = path / "_tokenizer_src"
    save_clip_tokenizer(tokenizer_dir)
    from transformers import CLIPTokenizer

    pipe = StableDiffusionPipeline(
        unet=build_unet(size, dtype, seed), vae=build_vae(size, dtype, seed + 1),
        text_encoder=build_text_encoder(size, dtype, seed + 2), tokenizer=CLIPTokenizer.from_pretrained(tokenizer_dir),
        scheduler=DDIMScheduler(), safety_checker=None, feature_extractor=None, requires_safety_checker=False,
    )
    pipe.save_pretrained(path, safe_serialization=True, variant=variant)
    import shutil

    shutil.rmtree(tokenizer_dir)
    return path


def age_files(*paths, seconds: float = 60.0) -> None:
    """Backdate the files under ``paths``: overmind does not cache files modified in the last
    2 s (overmind.shared.calls.keys Note [Racy files]), and a model used right after it was saved is one."""
    import time

    stamp = time.time() - seconds
    for path in map(Path, paths):
        for p in [path, *path.rglob("*")] if path.is_dir() else [path]:
            os.utime(p, (stamp, stamp))


# -- single-file (original LDM layout) checkpoints ------------------------------------------
#
# Note [Writing an LDM checkpoint]: diffusers only reads the original layout
# (diffusers.loaders.single_file_utils: convert_ldm_unet_checkpoint, convert_ldm_vae_checkpoint,
# convert_ldm_clip_checkpoint); the writer lives in its scripts folder, which is not installed.
# The functions below are the inverse of those readers, for any layers_per_block and block
# count (so tiny models work too). tests/integration/test_bench.py checks the round trip:
# from_single_file of the written file gives back every tensor of the pipeline folder.

_LDM_RESNET = (("norm1", "in_layers.0"), ("conv1", "in_layers.2"), ("norm2", "out_layers.0"),
               ("conv2", "out_layers.3"), ("time_emb_proj", "emb_layers.1"), ("conv_shortcut", "skip_connection"))
_LDM_VAE_ATTENTION = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out": "proj_out"}


def _ldm_resnet(rest: str) -> str:
    head, _, tail = rest.partition(".")
    return dict(_LDM_RESNET).get(head, head) + "." + tail


def _unet_to_ldm(state: dict, layers_per_block: int) -> dict:
    from diffusers.loaders.single_file_utils import DIFFUSERS_TO_LDM_MAPPING

    top = DIFFUSERS_TO_LDM_MAPPING["unet"]["layers"]
    n = layers_per_block + 1  # LDM counts a down block's downsampler (and an up block's extra resnet) as a layer
    up_with_attention = {int(k.split(".")[1]) for k in state if k.startswith("up_blocks.") and ".attentions." in k}
    out = {}
    for key, tensor in state.items():
        parts = key.split(".")
        if key in top:
            new = top[key]
        elif parts[0] == "down_blocks" and parts[2] == "downsamplers":
            new = f"input_blocks.{(int(parts[1]) + 1) * n}.0.op.{parts[-1]}"
        elif parts[0] == "down_blocks":
            index, rest = 1 + int(parts[1]) * n + int(parts[3]), ".".join(parts[4:])
            new = (f"input_blocks.{index}.0.{_ldm_resnet(rest)}" if parts[2] == "resnets"
                   else f"input_blocks.{index}.1.{rest}")
        elif parts[0] == "mid_block":
            rest = ".".join(parts[3:])
            new = (f"middle_block.{2 * int(parts[2])}.{_ldm_resnet(rest)}" if parts[1] == "resnets"
                   else f"middle_block.1.{rest}")
        elif parts[0] == "up_blocks" and parts[2] == "upsamplers":
            block = int(parts[1])
            new = f"output_blocks.{block * n + n - 1}.{2 if block in up_with_attention else 1}.conv.{parts[-1]}"
        elif parts[0] == "up_blocks":
            index, rest = int(parts[1]) * n + int(parts[3]), ".".join(parts[4:])
            new = (f"output_blocks.{index}.0.{_ldm_resnet(rest)}" if parts[2] == "resnets"
                   else f"output_blocks.{index}.1.{rest}")
        else:
            raise ValueError(f"no LDM name for UNet tensor {key!r}")
        out["model.diffusion_model." + new] = tensor
    return out


def _ldm_vae_resnet(parts: list) -> str:
    return ".".join(parts).replace("conv_shortcut", "nin_shortcut")


def _vae_to_ldm(state: dict, num_blocks: int) -> dict:
    from diffusers.loaders.single_file_utils import DIFFUSERS_TO_LDM_MAPPING

    top = DIFFUSERS_TO_LDM_MAPPING["vae"]
    out = {}
    for key, tensor in state.items():
        parts = key.split(".")
        side = parts[0]
        if key in top:
            new = top[key]
        elif parts[1] == "down_blocks" and parts[3] == "resnets":
            new = f"{side}.down.{parts[2]}.block.{parts[4]}.{_ldm_vae_resnet(parts[5:])}"
        elif parts[1] == "down_blocks":
            new = f"{side}.down.{parts[2]}.downsample.conv.{parts[-1]}"
        elif parts[1] == "up_blocks" and parts[3] == "resnets":
            block = num_blocks - 1 - int(parts[2])  # LDM numbers decoder blocks from the bottom
            new = f"{side}.up.{block}.block.{parts[4]}.{_ldm_vae_resnet(parts[5:])}"
        elif parts[1] == "up_blocks":
            new = f"{side}.up.{num_blocks - 1 - int(parts[2])}.upsample.conv.{parts[-1]}"
        elif parts[1] == "mid_block" and parts[2] == "resnets":
            new = f"{side}.mid.block_{int(parts[3]) + 1}.{_ldm_vae_resnet(parts[4:])}"
        elif parts[1] == "mid_block" and parts[2] == "attentions":
            new = f"{side}.mid.attn_1.{_LDM_VAE_ATTENTION[parts[4]]}.{parts[-1]}"
            if tensor.dim() == 2:  # LDM's attention projections are 1x1 convolutions
                tensor = tensor[:, :, None, None]
        else:
            raise ValueError(f"no LDM name for VAE tensor {key!r}")
        out["first_stage_model." + new] = tensor
    return out


def save_sd_single_file(path, pipeline_dir) -> Path:
    """Write the SD pipeline folder ``pipeline_dir`` (see :func:`save_sd_pipeline`) as one
    safetensors checkpoint in the original layout, in the folder's dtype. Load it offline with
    ``StableDiffusionPipeline.from_single_file(path, config=pipeline_dir)``."""
    import json

    from safetensors.torch import load_file, save_file

    pipeline_dir, path = Path(pipeline_dir), Path(path)

    def component(name: str) -> tuple[dict, dict]:
        folder = pipeline_dir / name
        weights = next(p for p in sorted(folder.glob("*.safetensors")))
        return load_file(weights), json.loads((folder / "config.json").read_text())

    unet, unet_config = component("unet")
    vae, vae_config = component("vae")
    text, _ = component("text_encoder")
    state = {**_unet_to_ldm(unet, unet_config["layers_per_block"]),
             **_vae_to_ldm(vae, len(vae_config["down_block_types"])),
             # transformers 5 saves CLIPTextModel without its "text_model." prefix; LDM names carry it.
             **{"cond_stage_model.transformer." + ("" if k.startswith("text_model.") else "text_model.") + k: v
                for k, v in text.items()}}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, path)
    return path
