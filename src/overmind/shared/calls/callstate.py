"""The caller's process-global state that can change what a load returns, and what a load does to it.

    reason = bypass_reason()        # not None: call the original, the cache cannot reproduce this
    keyed = keyed_state()           # in the key; the loader applies it before the original runs
    rng = rng_state()               # not in the key; see Note [Loads that draw random numbers]

A hit must behave as the plain call would have, in the caller's process. The cached object is
built in a loader process, so whatever the caller's process would have contributed to the
result has to reach the loader, be part of the key, or keep the call away from the cache.

Note [Process-global state of a load]
What a plain ``from_pretrained`` / ``torch.load`` / ``load_file`` reads from the process, and
how each is handled (found by reading the load paths of torch 2.13, transformers 5.23 and
diffusers 0.42, and by the HF test-suite harness ``benchmarks/hf_suites.py``):

- Random number generators (torch's default CPU generator, ``random``, numpy's global one):
  weights a checkpoint lacks (a new head, ``ignore_mismatched_sizes``, ``state_dict={}``) are
  drawn from them. Handled by Note [Loads that draw random numbers].
- Default dtype (``torch.set_default_dtype``): keyed when not float32; the loader sets it.
- Grad mode (``torch.no_grad()``): keyed when off; the loader loads under ``no_grad``.
- Deterministic algorithms (``torch.use_deterministic_algorithms``, ``warn_only``,
  ``torch.utils.deterministic.fill_uninitialized_memory``, which fills ``torch.empty`` with
  NaN): keyed when on; the loader sets them.
- ``torch.serialization`` safe globals (whether a ``weights_only`` load raises): those the
  user added are keyed and added in the loader; those a library registers when imported
  (transformers registers ten) are not: the loader has imported the libraries, so a caller
  that had not may see a ``weights_only`` load succeed that would have raised.
- Default device (``with torch.device("meta")``, ``torch.set_default_device``), any other
  ``TorchFunctionMode`` or ``TorchDispatchMode`` (``FakeTensorMode``), inference mode: the
  call goes to the original. A loader cannot build on the caller's device, and transformers
  raises under ``meta``.
- Initialisation patches active around the call (accelerate's ``init_empty_weights``, which
  replaces ``nn.Module.register_parameter``; transformers' and diffusers' ``no_init_weights``,
  which replace ``torch.nn.init`` functions and ``PreTrainedModel.init_weights``; a DeepSpeed
  ZeRO-3 config): the call goes to the original.
- Warnings and log records the load emits, and the caller's filters and levels for them:
  recorded at fill time and replayed on every hit (``overmind.shared.calls.replay``).
- Environment variables that shape a load (``HF_*``, ``TRANSFORMERS_*``, ...): part of the
  loader's context (``overmind.shared.settings.config.ENV_PREFIXES``), so a different value is another loader.
- Not handled: CUDA generators (loaders never initialise CUDA, Note [Warm interpreters never touch
  CUDA]); a terminal-width-dependent log layout is the loader's (80 columns).

Note [Loads that draw random numbers]
The key never includes generator states: most loads draw nothing, and keying them on the
caller's seed would make every script that used a random number before loading miss. Instead
the request carries the caller's states (outside the key); the loader sets them before the
original runs and compares after. A load that drew nothing is shared by every caller. A load
that drew is filed with the names of the generators it drew from, the digest of their states
when it started and their states when it ended: a caller whose own digest of those generators
matches (the others do not matter: Python's ``random`` is seeded from the OS in every process,
and ``torch.manual_seed`` leaves it alone) gets the object and its generators set to those end states,
exactly where a plain load would have left them; any other caller asks again under a key
derived from its own digest (``rng_key``), a miss that the loader fills from its states.
So ``set_seed(42)`` followed by a fine-tuning script's ``from_pretrained(base, num_labels=2)``
hits on every restart with the head that seed gives, and each other seed gets its own entry
(its base weights deduplicated by content, Note [Content index] in ``overmind.server.registry``).
A process whose torch generator was never seeded (torch seeds it from OS entropy) will
never meet its state again: such a caller loads plainly and files nothing (``seeded``).

A generator the load itself created, by first importing its module (transformers imports
``numpy.random`` while loading; torch, for a caller that had not imported it), is one the plain
call would have seeded from OS entropy in the caller's process, as its import does. It counts as
drawn from only when the load moved it from where its own seed put it (``drawn``); left there, it
is neither filed nor compared, and a hit leaves the caller's generator alone: one the caller has
imported keeps its state (the plain load would not touch it), one it has not starts from fresh
entropy when something imports it (the hit's rebuild or the caller's own code), as plain's
import would. So the key, and the entry, never depend on whether the caller imported numpy.
A load that draws from a generator the caller has not imported draws from OS entropy in the
plain call: no process can meet that state, so such a caller loads plainly too (``seeded``).
"""

from __future__ import annotations

import pickle
import random
import sys
from typing import Any, Optional

__all__ = ["bypass_reason", "keyed_state", "apply_keyed", "rng_state", "set_rng_state", "drawn", "rng_digest",
           "rng_key", "seeded", "encode_rng", "decode_rng"]

def _patched_init(torch: Any) -> Optional[str]:
    """An initialisation patch active around the call, or None."""
    for name in ("register_parameter", "register_buffer"):
        if getattr(getattr(torch.nn.Module, name), "__module__", None) != "torch.nn.modules.module":
            return f"nn.Module.{name} is replaced (accelerate's init_empty_weights?)"
    init = torch.nn.init
    for name in ("normal_", "uniform_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_",
                 "xavier_normal_", "constant_", "zeros_", "ones_", "orthogonal_"):
        if getattr(getattr(init, name, None), "__module__", "torch.nn.init") != "torch.nn.init":
            return f"torch.nn.init.{name} is replaced (a no_init_weights context?)"
    modeling = sys.modules.get("transformers.modeling_utils")
    if modeling is not None:
        for name in ("init_weights", "tie_weights"):
            fn = getattr(modeling.PreTrainedModel, name, None)
            if fn is not None and getattr(fn, "__qualname__", "") != f"PreTrainedModel.{name}":
                return f"PreTrainedModel.{name} is replaced (a no_init_weights context?)"
    deepspeed = sys.modules.get("transformers.integrations.deepspeed")
    if deepspeed is not None and deepspeed.is_deepspeed_zero3_enabled():
        return "DeepSpeed ZeRO-3 is enabled"
    return None


def bypass_reason() -> Optional[str]:
    """Why the cache cannot reproduce a plain load in this state, or None."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    device = torch.get_default_device()
    if device.type != "cpu":
        return f"the default device is {device} (a torch.device context?)"
    stack = torch.overrides._get_current_function_mode_stack()
    if stack:
        return f"a torch function mode is active ({type(stack[-1]).__name__})"
    if torch._C._len_torch_dispatch_stack():
        return "a torch dispatch mode is active"
    if torch.is_inference_mode_enabled():
        return "inference mode is on"
    return _patched_init(torch)


def keyed_state() -> dict:
    """The state that is part of the key, only where it differs from a fresh process's."""
    torch = sys.modules.get("torch")
    if torch is None:
        return {}
    state: dict = {}
    if torch.get_default_dtype() != torch.float32:
        state["default_dtype"] = torch.get_default_dtype()
    if not torch.is_grad_enabled():
        state["grad"] = False
    if torch.are_deterministic_algorithms_enabled():
        from torch.utils import deterministic

        state["deterministic"] = (torch.is_deterministic_algorithms_warn_only_enabled(),
                                  bool(deterministic.fill_uninitialized_memory))
    extra = sorted((g for g in torch.serialization.get_safe_globals() if _root(g) not in _LIBRARY_ROOTS), key=_name)
    if extra:
        state["safe_globals"] = extra
    return state


# Libraries register their own safe globals when imported; the key has their versions.
_LIBRARY_ROOTS = frozenset({"torch", "transformers", "diffusers", "accelerate", "safetensors", "bitsandbytes",
                            "numpy", "peft", "builtins", "collections"})


def _name(entry: Any) -> str:
    obj, alias = (entry if isinstance(entry, tuple) else (entry, ""))
    return f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', repr(obj))}:{alias}"


def _root(entry: Any) -> str:
    obj = entry[0] if isinstance(entry, tuple) else entry
    return str(getattr(obj, "__module__", "") or "").partition(".")[0]


def apply_keyed(state: dict) -> Any:
    """In a loader: make this process's state what the caller's was. Returns a context manager
    for the original call (grad mode is a context, not a setting)."""
    import contextlib

    torch = sys.modules["torch"]
    if "default_dtype" in state:
        torch.set_default_dtype(state["default_dtype"])
    if "deterministic" in state:
        warn_only, fill = state["deterministic"]
        torch.use_deterministic_algorithms(True, warn_only=warn_only)
        from torch.utils import deterministic

        deterministic.fill_uninitialized_memory = fill
    if "safe_globals" in state:
        torch.serialization.add_safe_globals(state["safe_globals"])
    return torch.no_grad() if state.get("grad") is False else contextlib.nullcontext()


# -- random number generators: Note [Loads that draw random numbers] ---------------------------


def rng_state() -> dict:
    """Every global generator a load may draw from, as plain comparable values."""
    state: dict = {"random": random.getstate()}
    torch = sys.modules.get("torch")
    if torch is not None:
        state["torch"] = torch.get_rng_state().numpy().tobytes()
    # Only a numpy.random someone imported: importing it costs ~10 ms on every first load, and
    # one imported later starts from OS entropy, a state no other process will share.
    np_random = sys.modules.get("numpy.random")
    if np_random is not None:
        name, keys, pos, has_gauss, gauss = np_random.get_state()
        state["numpy"] = (name, keys.tobytes(), int(pos), int(has_gauss), float(gauss))
    return state


# torch seeds its default generator from 64 bits of OS entropy; a seed a script chose
# (``set_seed(42)``, ``manual_seed(1234)``) is almost always smaller.
_CHOSEN_SEED_LIMIT = 1 << 32


def seeded(names: list, state: dict) -> bool:
    """Could a later process start from the same state of the generators ``names``, as this
    caller (whose ``rng_state()`` is ``state``) would? Not when torch's was seeded from OS
    entropy (no ``manual_seed``), nor when the caller has not imported one of them (the plain
    load would import it, seeded from OS entropy, and draw from that): filing or serving that
    load would only give a draw no plain process reproduces."""
    if any(name not in state for name in names):
        return False
    torch = sys.modules.get("torch")
    return not ("torch" in names and torch is not None and torch.initial_seed() >= _CHOSEN_SEED_LIMIT)


def drawn(start: dict, end: dict) -> dict:
    """The generators a load drew from, name -> end state, given ``rng_state()`` before and
    after it: those whose state changed, and those the load created (``end`` has them, ``start``
    does not) and moved from where their own seed put them."""
    return {name: state for name, state in end.items()
            if (start[name] != state if name in start else not _as_seeded(name))}


def _as_seeded(name: str) -> bool:
    """Is the generator ``name`` still where its own seed put it (nothing drew from it since)?
    False where that cannot be told: the load then counts as drawing from it."""
    if name == "torch":
        torch = sys.modules["torch"]
        fresh = torch.Generator()
        fresh.manual_seed(torch.initial_seed())
        return bool(torch.equal(fresh.get_state(), torch.get_rng_state()))
    if name == "numpy":
        np_random = sys.modules["numpy.random"]
        # The global RandomState's MT19937, seeded at import from a SeedSequence of OS entropy.
        bit_generator = getattr(getattr(np_random.mtrand, "_rand", None), "_bit_generator", None)
        seed_seq = getattr(bit_generator, "seed_seq", None) or getattr(bit_generator, "_seed_seq", None)
        if seed_seq is None:
            return False
        fresh = np_random.MT19937(seed_seq).state
        name_, keys, pos, has_gauss, _ = np_random.get_state()
        return (name_ == fresh["bit_generator"] and pos == fresh["state"]["pos"] and not has_gauss
                and bool((keys == fresh["state"]["key"]).all()))
    return False


def set_rng_state(state: dict) -> None:
    if "random" in state:
        random.setstate(state["random"])
    torch = sys.modules.get("torch")
    if torch is not None and "torch" in state:
        torch.set_rng_state(torch.frombuffer(bytearray(state["torch"]), dtype=torch.uint8))
    if "numpy" in state:
        import numpy

        name, keys, pos, has_gauss, gauss = state["numpy"]
        numpy.random.set_state((name, numpy.frombuffer(keys, dtype=numpy.uint32).copy(), pos, has_gauss, gauss))


def encode_rng(state: dict) -> bytes:
    return pickle.dumps(state, protocol=5)


def decode_rng(data: bytes) -> dict:
    state = pickle.loads(data)
    if not isinstance(state, dict):
        raise ValueError("generator states must be a dict")
    return state


def rng_digest(state: dict, names: list) -> str:
    """The digest of the states of the generators ``names`` (those a load drew from): two
    processes that agree on these get the same draws, whatever their other generators hold."""
    import xxhash

    return xxhash.xxh3_128_hexdigest(encode_rng({name: state.get(name) for name in sorted(names)}))


def rng_key(key: str, digest: str) -> str:
    """The key of a load that draws random numbers, for callers starting from ``digest``."""
    import xxhash

    return xxhash.xxh3_128_hexdigest(f"{key}:rng:{digest}".encode())
