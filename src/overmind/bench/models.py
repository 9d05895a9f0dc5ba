"""The benchmark's models: generated locally (random weights, no hub) into a reusable cache.

    paths = ensure_models(cache_dir, "small", ["sd", "controlnet_a", "lm"])   # {name: path}
    python -m overmind.bench.models CACHE_DIR SCALE NAME...         # the same, in a child

Every model lives in ``<cache>/<scale>/<folder>`` and is made once: generation writes into a
temporary folder, backdates its files and renames it into place, so an interrupted run
leaves nothing that looks complete. Sizes per scale come from :mod:`overmind.modelgen`.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

__all__ = ["SCALES", "MODELS", "Scale", "ModelSpec", "default_cache_dir", "ensure_models", "generate_in_child",
           "missing_models", "model_files", "model_paths"]

# Bumped when a model's recipe changes, so caches made by an older recipe are rebuilt.
RECIPE = 1


@dataclass(frozen=True)
class Scale:
    sd: str  # overmind.modelgen size of the SD-family models (UNet, VAE, ControlNet, CLIP)
    lm: str  # overmind.modelgen size of the causal LMs
    about: str


SCALES: dict[str, Scale] = {
    "tiny": Scale("tiny", "tiny", "kilobyte models, for tests"),
    "small": Scale("small", "small", "SD layout at 1/5 width (35 M UNet), 5 M parameter LM"),
    "base": Scale("sd15", "1b", "SD1.5 sizes (860 M UNet), 1.1 B parameter LM"),
    "large": Scale("large", "3b", "SD1.5 layout 1.4x as wide (1.7 B UNet), 3.4 B parameter LM"),
}


@dataclass(frozen=True)
class ModelSpec:
    name: str
    folder: str  # under <cache>/<scale>/
    about: str
    make: Callable[[Path, Scale, dict], None]  # (target folder, scale, paths of its dependencies)
    needs: tuple[str, ...] = ()
    file: str = ""  # the path a loader is given, when it is one file of the folder


def _make_sd(path: Path, scale: Scale, deps: dict) -> None:
    import torch

    from overmind import modelgen

    modelgen.save_sd_pipeline(path, scale.sd, torch.float16)


def _controlnet(seed: int) -> Callable[[Path, Scale, dict], None]:
    def make(path: Path, scale: Scale, deps: dict) -> None:
        import torch

        from overmind import modelgen

        modelgen.save_controlnet(path, scale.sd, torch.float16, seed=seed)
    return make


def _lm(safe: bool) -> Callable[[Path, Scale, dict], None]:
    def make(path: Path, scale: Scale, deps: dict) -> None:
        import torch

        from overmind import modelgen

        modelgen.save_lm(path, scale.lm, torch.bfloat16, safe=safe)
    return make


def _make_unet_fp32(path: Path, scale: Scale, deps: dict) -> None:
    import torch

    from overmind import modelgen

    modelgen.save_unet(path, scale.sd, torch.float32, seed=21)


def _make_single_file(path: Path, scale: Scale, deps: dict) -> None:
    from overmind import modelgen

    modelgen.save_sd_single_file(path / "model.safetensors", deps["sd"])


MODELS: dict[str, ModelSpec] = {spec.name: spec for spec in (
    ModelSpec("sd", "sd-fp16", "StableDiffusionPipeline folder, fp16 safetensors", _make_sd),
    ModelSpec("controlnet_a", "controlnet-a-fp16", "ControlNetModel, fp16 safetensors", _controlnet(11)),
    ModelSpec("controlnet_b", "controlnet-b-fp16", "ControlNetModel, fp16 safetensors", _controlnet(12)),
    ModelSpec("lm", "lm-bf16", "Llama-style causal LM, bf16 safetensors", _lm(safe=True)),
    ModelSpec("lm_bin", "lm-bf16-bin", "the same LM as a pytorch_model.bin (pickle)", _lm(safe=False)),
    ModelSpec("unet_fp32", "unet-fp32", "UNet2DConditionModel, fp32 safetensors", _make_unet_fp32),
    ModelSpec("sd_single_file", "sd-single-file", "the SD pipeline as one LDM-layout checkpoint", _make_single_file,
              needs=("sd",), file="model.safetensors"),
)}


def default_cache_dir() -> Path:
    if os.environ.get("OVERMIND_BENCH_CACHE"):
        return Path(os.environ["OVERMIND_BENCH_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "overmind-bench"


def _folder(cache_dir: Path, scale: str, name: str) -> Path:
    return Path(cache_dir) / scale / MODELS[name].folder


def _marker(folder: Path) -> Path:
    return folder.with_name(folder.name + ".done")


def _stamp(scale: str, name: str) -> dict:
    return {"recipe": RECIPE, "scale": scale, "model": name}


def _is_ready(cache_dir: Path, scale: str, name: str) -> bool:
    folder = _folder(cache_dir, scale, name)
    try:
        return folder.is_dir() and json.loads(_marker(folder).read_text()) == _stamp(scale, name)
    except (OSError, ValueError):
        return False


def _with_dependencies(names: Sequence[str]) -> list[str]:
    ordered: list[str] = []
    for name in names:
        for dep in (*MODELS[name].needs, name):
            if dep not in ordered:
                ordered.append(dep)
    return ordered


def missing_models(cache_dir: Path, scale: str, names: Sequence[str]) -> list[str]:
    return [n for n in _with_dependencies(names) if not _is_ready(cache_dir, scale, n)]


def model_files(path: Path) -> list[Path]:
    path = Path(path)
    return [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())


def model_paths(cache_dir: Path, scale: str, names: Sequence[str]) -> dict[str, Path]:
    """The path each loader is given (a folder, or the checkpoint file in it)."""
    out = {}
    for name in names:
        folder = _folder(Path(cache_dir), scale, name)
        out[name] = folder / MODELS[name].file if MODELS[name].file else folder
    return out


def ensure_models(cache_dir: Path, scale: str, names: Sequence[str], progress: bool = True) -> dict[str, Path]:
    """Generate whichever of ``names`` (and what they are made from) is not cached yet;
    return :func:`model_paths`."""
    if scale not in SCALES:
        raise ValueError(f"unknown scale {scale!r}; choose one of {', '.join(SCALES)}")
    todo = missing_models(Path(cache_dir), scale, names)
    if todo:
        _generate(Path(cache_dir), scale, todo, progress)
    return model_paths(cache_dir, scale, names)


def generate_in_child(cache_dir: Path, scale: str, names: Sequence[str], progress: bool = True) -> dict[str, Path]:
    """:func:`ensure_models` in a child process (``python -m overmind.bench.models``).

    The bench's own process then never imports torch and the model libraries: nothing it
    measures needs them, and an interpreter holding them takes over a second to exit."""
    import subprocess

    if scale not in SCALES:
        raise ValueError(f"unknown scale {scale!r}; choose one of {', '.join(SCALES)}")
    if missing_models(Path(cache_dir), scale, names):
        argv = [sys.executable, "-m", "overmind.bench.models", str(cache_dir), scale, *names]
        proc = subprocess.run(argv + ([] if progress else ["--no-progress"]), stdout=subprocess.DEVNULL,
                              stderr=None if progress else subprocess.PIPE, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(argv[1:4])} ... exited {proc.returncode}"
                               + (f": {proc.stderr.strip()[-3000:]}" if proc.stderr else " (its error is above)"))
    return model_paths(cache_dir, scale, names)


def _generate(cache_dir: Path, scale: str, todo: list[str], progress: bool) -> None:
    from tqdm import tqdm

    from overmind import modelgen

    with _quiet_libraries():
        bar = tqdm(todo, desc=f"generating {scale} models", unit="model", disable=not progress, file=sys.stderr,
                   bar_format="{desc}: {n_fmt}/{total_fmt} |{bar}| {elapsed} {postfix}")
        for name in bar:
            bar.set_postfix_str(MODELS[name].folder)
            folder = _folder(cache_dir, scale, name)
            tmp = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            deps = {dep: _folder(cache_dir, scale, dep) for dep in MODELS[name].needs}
            MODELS[name].make(tmp, SCALES[scale], deps)
            # overmind does not cache files modified in the last 2 s (Note [Racy files] in
            # overmind.shared.calls.keys); a benchmark right after generation would see only misses.
            modelgen.age_files(tmp)
            shutil.rmtree(folder, ignore_errors=True)
            _marker(folder).unlink(missing_ok=True)
            os.rename(tmp, folder)
            _marker(folder).write_text(json.dumps(_stamp(scale, name)))
            bar.set_postfix_str(f"{MODELS[name].folder} {modelgen.dir_nbytes(folder) / 1e9:.2f} GB")
        bar.close()


class _quiet_libraries:
    """Generation prints progress bars and config warnings of its own; the bench has one bar."""

    def __enter__(self):
        import warnings

        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.simplefilter("ignore")
        self._restore = []
        for lib in ("transformers", "diffusers"):
            try:
                logging = __import__(f"{lib}.utils.logging", fromlist=["logging"])
            except ImportError:
                continue
            level = logging.get_verbosity()
            logging.set_verbosity_error()
            logging.disable_progress_bar()
            self._restore.append((logging, level))
        return self

    def __exit__(self, *exc):
        for logging, level in self._restore:
            logging.set_verbosity(level)
            logging.enable_progress_bar()
        self._warnings.__exit__(*exc)
        return False


def _main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m overmind.bench.models",
                                     description="Generate the benchmark's models (random weights, no hub) into "
                                                 "CACHE_DIR/SCALE, each once.")
    parser.add_argument("cache_dir", metavar="CACHE_DIR")
    parser.add_argument("scale", metavar="SCALE", choices=list(SCALES), help=f"one of {', '.join(SCALES)}")
    parser.add_argument("names", metavar="NAME", nargs="+", choices=list(MODELS), help=f"any of {', '.join(MODELS)}")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    try:
        ensure_models(Path(args.cache_dir), args.scale, args.names, progress=not args.no_progress)
    except Exception as err:  # noqa: BLE001 -- the parent shows it
        import traceback

        traceback.print_exc()
        print(f"generating {', '.join(args.names)} in {args.cache_dir} failed: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    status = _main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)  # skip tearing torch down: the parent only waits for the files
