"""Library-specific fixes so loaded objects pickle, and unpickle in the client.

    check_rebuildable(result)      # loader: NotRebuildable if its weights are not in it
    prepare_for_pickle(result)     # loader: strip accelerate hooks and warning patches,
                                   # register reducers for loaded libraries (bitsandbytes)
    dynamic_module_paths()         # loader: sys.path entries the client needs for
                                   # diffusers_modules / transformers_modules classes

Everything here is about third-party objects; nothing is imported unless the
library is already loaded.

Note [Quantised parameters]
bitsandbytes keeps quantised weights in ``nn.Parameter`` subclasses whose Python
attributes carry what a forward pass needs: ``Params4bit`` its ``quant_state``
(absmax, code, blocksize, quant_type, dtype, shape, nested state) and ``module``,
``Int8Params`` its ``CB``/``SCB``. torch's ``Parameter.__reduce_ex__`` rebuilds them as
plain ``nn.Parameter`` objects, so the class is lost (and with it bitsandbytes' and
transformers' ``isinstance`` checks). Rebuilding through ``from_prequantized`` with
``QuantState.as_dict(packed=True)`` would keep the class but drop attributes outside that
serialisation format (``packing_format_for_cpu``) and copy the state tensors. Instead
the class and ``__dict__`` are kept exactly: the data travels as a plain tensor (a
table entry, so it is rebuilt zero-copy over the segment), the class is restored with
``Tensor._make_subclass`` (which aliases that storage), and the attributes are set
after the parameter is memoised, so the ``module`` back-reference and any other cycle
resolve to the same objects. The reducers are registered only once bitsandbytes is
in ``sys.modules``: importing it probes for CUDA, which a warm interpreter must never do
(Note [Warm interpreters never touch CUDA] in ``overmind.server.pool``).

Note [Results that cannot be rebuilt]
Some loads return a model whose weights are not in it: accelerate's offload (``device_map``
past ``max_memory``, ``offload_folder``) leaves parameters on the meta device and hooks whose
``weights_map`` reads them from the checkpoint or the offload folder at every forward pass.
Stripping the hooks (``prepare_for_pickle``) would leave an empty shell, and the hooks
themselves do not travel. So such a result is not cached: the loader answers NOT_REBUILDABLE
before packing, the server remembers the key (Note [Only deterministic failures are
remembered] in ``overmind.server.failures``) and counts its calls ``not_cacheable``, and callers load
plainly without a warning, under ``OVERMIND_STRICT=1`` too: plain python does this load
fine, and so do we, just not from the cache. The check looks at tensors' devices and the
hooks' settings only (no data is read), and must run while the hooks are still there.
"""

from __future__ import annotations

import itertools
import logging
import os
import pickle
import sys
from dataclasses import dataclass
from typing import Any, Iterator

logger = logging.getLogger(__name__)

__all__ = [
    "check_rebuildable", "NotRebuildable", "prepare_for_pickle", "dynamic_module_paths", "modules_of",
    "register_reducers",
    "ParameterSubclass", "rebuild_parameter_subclass", "set_parameter_state",
]

DYNAMIC_PACKAGES = ("diffusers_modules", "transformers_modules")

# (module, class) of Parameter subclasses kept by reduce_parameter_subclass once the module
# is imported; see Note [Quantised parameters].
PARAMETER_SUBCLASSES = (
    ("bitsandbytes.nn.modules", "Params4bit"),
    ("bitsandbytes.nn.modules", "Int8Params"),
)


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


class NotRebuildable(Exception):
    """A result whose weights are not in it: Note [Results that cannot be rebuilt]."""


def check_rebuildable(obj: Any) -> None:
    """Raise NotRebuildable if ``obj`` holds meta tensors or accelerate offload hooks."""
    torch = sys.modules.get("torch")
    if torch is None:
        return
    for module in modules_of(obj):
        for name, tensor in itertools.chain(module.named_parameters(), module.named_buffers()):
            if tensor.is_meta:
                raise NotRebuildable(f"{name} is on the meta device (offloaded)")
        for name, sub in module.named_modules():
            hook = getattr(sub, "_hf_hook", None)
            for one in getattr(hook, "hooks", None) or (hook,):  # a SequentialHook holds several
                if getattr(one, "offload", False) or getattr(one, "weights_map", None) is not None:
                    raise NotRebuildable(f"accelerate offloads the weights of {name or type(sub).__name__}")
    if isinstance(obj, dict):  # a state dict loaded onto the meta device
        for name, value in obj.items():
            if isinstance(value, torch.Tensor) and value.is_meta:
                raise NotRebuildable(f"{name} is on the meta device")


def prepare_for_pickle(obj: Any) -> None:
    """Remove what does not survive pickling but is not needed once loaded.

    accelerate's hooks (device placement, ``device_map`` dispatch) hold closures;
    transformers and accelerate also replace ``.to``/``.cuda`` on quantised models with
    instance attributes that only warn. The weights are already where the hooks put
    them, so the result works without them.

    Also registers the reducers of Note [Quantised parameters] for libraries already imported.
    """
    register_reducers()
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


# --- parameter subclasses (bitsandbytes); see Note [Quantised parameters] -----------------

PARAMETER_SUBCLASS_VERSION = 1


@dataclass(frozen=True)
class ParameterSubclass:
    """What :func:`rebuild_parameter_subclass` needs: named in stored skeletons, never rename or move.

    New fields get defaults, so records pickled by an older overmind still load; a change
    older code cannot read bumps ``version``.
    """

    cls: type  # the exact Parameter subclass
    data: Any  # a plain tensor over the parameter's storage
    requires_grad: bool = False
    version: int = PARAMETER_SUBCLASS_VERSION


def rebuild_parameter_subclass(record: ParameterSubclass) -> Any:
    """Unpickling: the parameter, of its own class, aliasing ``record.data``; attributes follow."""
    if getattr(record, "version", None) != PARAMETER_SUBCLASS_VERSION:
        raise pickle.UnpicklingError(
            f"parameter record version {getattr(record, 'version', None)!r} is not {PARAMETER_SUBCLASS_VERSION}; "
            "this cache entry was written by another overmind version. Run `overmind evict --all`."
        )
    import torch  # already imported: the record's data is a tensor

    return torch.Tensor._make_subclass(record.cls, record.data, record.requires_grad)


def set_parameter_state(param: Any, state: dict) -> None:
    """Unpickling: the parameter's Python attributes (a pickle ``state_setter``: ``Tensor.__setstate__``
    would refuse a dict)."""
    param.__dict__.update(state)


def reduce_parameter_subclass(param: Any) -> tuple:
    """Pickling: class, data and requires_grad as a record; ``__dict__`` as state (set after memoising)."""
    record = ParameterSubclass(type(param), param.data, bool(param.requires_grad))
    return (rebuild_parameter_subclass, (record,), dict(param.__dict__) or None, None, None, set_parameter_state)


def register_reducers() -> list[type]:
    """Register reducers for the Parameter subclasses of libraries already imported (idempotent).

    Imports nothing that is not loaded yet. Returns the classes registered.
    """
    classes = []
    for module_name, class_name in PARAMETER_SUBCLASSES:
        cls = getattr(sys.modules.get(module_name), class_name, None)
        if isinstance(cls, type):
            classes.append(cls)
    if classes:
        from overmind.shared.segments.reductions import register_reducer  # torch is loaded: the library imported it

        for cls in classes:
            register_reducer(cls, reduce_parameter_subclass)
    return classes
