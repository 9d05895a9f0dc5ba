"""Library-specific fixes so loaded objects pickle, and unpickle in the client.

    prepare_for_pickle(result)     # loader: strip accelerate hooks and warning patches
    dynamic_module_paths()         # loader: sys.path entries the client needs for
                                   # diffusers_modules / transformers_modules classes

Everything here is about third-party objects; nothing is imported unless the
library is already loaded.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Iterator

logger = logging.getLogger(__name__)

__all__ = ["prepare_for_pickle", "dynamic_module_paths", "modules_of"]

DYNAMIC_PACKAGES = ("diffusers_modules", "transformers_modules")


def modules_of(obj: Any) -> Iterator[Any]:
    """The torch modules inside a model or a pipeline (its components)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return
    if isinstance(obj, torch.nn.Module):
        yield obj
        return
    components = getattr(obj, "components", None)
    if isinstance(components, dict):
        for value in components.values():
            if isinstance(value, torch.nn.Module):
                yield value
    model = getattr(obj, "model", None)  # transformers.Pipeline
    if isinstance(model, torch.nn.Module):
        yield model


def prepare_for_pickle(obj: Any) -> None:
    """Remove what does not survive pickling but is not needed once loaded.

    accelerate's hooks (device placement, ``device_map`` dispatch) hold closures;
    transformers and accelerate also replace ``.to``/``.cuda`` on quantised models with
    instance attributes that only warn. The weights are already where the hooks put
    them, so the result works without them.
    """
    hooks = sys.modules.get("accelerate.hooks")
    for module in modules_of(obj):
        if hooks is not None:
            for sub in module.modules():
                if hasattr(sub, "_hf_hook"):
                    hooks.remove_hook_from_module(module, recurse=True)
                    break
        for name in ("to", "cuda", "half", "float"):
            if name in module.__dict__:
                del module.__dict__[name]


def dynamic_module_paths() -> list[str]:
    """sys.path entries that make this process's dynamic modules importable elsewhere."""
    paths = []
    for name in DYNAMIC_PACKAGES:
        package = sys.modules.get(name)
        for entry in getattr(package, "__path__", []) or []:
            parent = os.path.dirname(os.path.abspath(entry))
            if parent not in paths:
                paths.append(parent)
    return paths
