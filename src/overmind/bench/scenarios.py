"""What each benchmark scenario loads, and how (the code runs in the worker processes).

A scenario is a sequence of timed loader calls that ends with one object (a pipeline or a
model). The worker imports ``preload`` before its clock starts, then calls :func:`run`::

    obj = run("controlnet", paths, clock)      # clock("vae") etc. time each call

Nothing here imports torch or a model library at import time: the parent process reads
the specs, the workers run the loaders.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager

__all__ = ["Scenario", "SCENARIOS", "LOAD_SCENARIOS", "custom_scenario", "resolve_loader", "run"]

Clock = Callable[[str], ContextManager[None]]


@dataclass(frozen=True)
class Scenario:
    name: str
    title: str
    models: tuple[str, ...]  # overmind.bench.models names it loads (none for a user's model)
    components: tuple[str, ...]  # the timed calls, in order
    preload: tuple[str, ...]  # "module:attr" imported before the clock, in every mode
    calls: int  # overmind cache entries one run makes
    why: str = ""
    options: dict = field(default_factory=dict)  # the custom scenario's loader, model and dtype


SCENARIOS: dict[str, Scenario] = {s.name: s for s in (
    Scenario(
        "controlnet", "a ControlNet pipeline: AutoencoderKL + 2 x ControlNetModel + "
        "StableDiffusionControlNetPipeline(vae=vae, controlnet=[edge, depth]), fp16 safetensors",
        ("sd", "controlnet_a", "controlnet_b"), ("vae", "depth", "edge", "pipeline"),
        ("diffusers:AutoencoderKL", "diffusers:ControlNetModel", "diffusers:StableDiffusionControlNetPipeline"), 4),
    Scenario(
        "lm", "AutoModelForCausalLM.from_pretrained, Llama-style LM, bf16 safetensors",
        ("lm",), ("model",), ("transformers:AutoModelForCausalLM", "transformers:LlamaForCausalLM"), 1),
    Scenario(
        "fp32_as_fp16", "UNet2DConditionModel saved in fp32, loaded with torch_dtype=torch.float16",
        ("unet_fp32",), ("unet",), ("diffusers:UNet2DConditionModel",), 1,
        why="the cast makes a private copy: plain loads cannot map the page cache"),
    Scenario(
        "pickle_bin", "AutoModelForCausalLM.from_pretrained of the LM saved as pytorch_model.bin",
        ("lm_bin",), ("model",), ("transformers:AutoModelForCausalLM", "transformers:LlamaForCausalLM"), 1,
        why="a pickle (zip) checkpoint: transformers loads it with torch.load(mmap=True)"),
    Scenario(
        "single_file", "StableDiffusionPipeline.from_single_file of one LDM-layout checkpoint (config= a local "
        "folder), fp16", ("sd_single_file", "sd"), ("pipeline",),
        ("diffusers:StableDiffusionPipeline",), 1,
        why="the checkpoint is converted key by key into the diffusers layout on every plain load"),
)}
LOAD_SCENARIOS = tuple(SCENARIOS)


def custom_scenario(loader: str, model: str, dtype: str | None) -> Scenario:
    """A user's model: ``loader`` is ``module:Class`` with a ``from_pretrained``."""
    dtype_text = f", {dtype}" if dtype else ""
    return Scenario("custom", f"{loader}.from_pretrained({model!r}{dtype_text})", (), ("load",), (loader,), 1,
                    options={"loader": loader, "model": model, "dtype": dtype})


def resolve_loader(spec: str) -> Any:
    """``"diffusers:DiffusionPipeline"`` -> the class (``module:attr.attr`` works too)."""
    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"--loader {spec!r}: expected module:attr, e.g. diffusers:DiffusionPipeline")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


# -- loaders (worker side) -------------------------------------------------------------------


def _controlnet(paths: dict, clock: Clock, options: dict) -> Any:
    import torch
    from diffusers import AutoencoderKL, ControlNetModel, StableDiffusionControlNetPipeline

    with clock("vae"):
        vae = AutoencoderKL.from_pretrained(paths["sd"], subfolder="vae", torch_dtype=torch.float16)
    with clock("depth"):
        depth = ControlNetModel.from_pretrained(paths["controlnet_a"], torch_dtype=torch.float16)
    with clock("edge"):
        edge = ControlNetModel.from_pretrained(paths["controlnet_b"], torch_dtype=torch.float16)
    with clock("pipeline"):
        pipe = StableDiffusionControlNetPipeline.from_pretrained(
            paths["sd"], vae=vae, controlnet=[edge, depth], torch_dtype=torch.float16, safety_checker=None)
    if pipe.vae is not vae:
        raise AssertionError("the pipeline does not hold the vae it was given")
    return pipe


def _lm(key: str) -> Callable[[dict, Clock, dict], Any]:
    def load(paths: dict, clock: Clock, options: dict) -> Any:
        import torch
        from transformers import AutoModelForCausalLM

        with clock("model"):
            model = AutoModelForCausalLM.from_pretrained(paths[key], **{_dtype_keyword(): torch.bfloat16})
        if model.dtype != torch.bfloat16:
            raise AssertionError(f"loaded {model.dtype}, expected torch.bfloat16")
        return model
    return load


def _fp32_as_fp16(paths: dict, clock: Clock, options: dict) -> Any:
    import torch
    from diffusers import UNet2DConditionModel

    with clock("unet"):
        return UNet2DConditionModel.from_pretrained(paths["unet_fp32"], torch_dtype=torch.float16)


def _single_file(paths: dict, clock: Clock, options: dict) -> Any:
    import torch
    from diffusers import StableDiffusionPipeline

    with clock("pipeline"):
        return StableDiffusionPipeline.from_single_file(paths["sd_single_file"], config=paths["sd"],
                                                        torch_dtype=torch.float16)


def _custom(paths: dict, clock: Clock, options: dict) -> Any:
    import torch

    cls = resolve_loader(options["loader"])
    kwargs = {}
    if options.get("dtype"):
        keyword = _dtype_keyword() if cls.__module__.startswith("transformers") else "torch_dtype"
        kwargs[keyword] = getattr(torch, options["dtype"])
    with clock("load"):
        return cls.from_pretrained(options["model"], **kwargs)


def _dtype_keyword() -> str:
    # transformers 4.56 renamed torch_dtype to dtype and warns about the old name.
    import transformers

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"


LOADERS: dict[str, Callable[[dict, Clock, dict], Any]] = {
    "controlnet": _controlnet, "lm": _lm("lm"), "fp32_as_fp16": _fp32_as_fp16, "pickle_bin": _lm("lm_bin"),
    "single_file": _single_file, "custom": _custom,
}


def run(name: str, paths: dict, clock: Clock, options: dict | None = None) -> Any:
    return LOADERS[name](paths, clock, options or {})
