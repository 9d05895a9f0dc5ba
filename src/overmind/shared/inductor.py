"""Whether this process made Inductor's CPU probes: the mark a run reports among its modules, so
that the warm interpreters of its context make those probes ahead of the next run (Note
[Inductor's probes, made once] in overmind.warm.compiled). Standard library only::

    names.append(USED) if used() else None      # a run's report at exit

Importing ``torch._inductor`` says nothing: ``transformers`` and ``diffusers`` import it (its
``codecache``, ``compile_fx`` and ``cpu_vec_isa`` too) in every script that loads a model, and
priming for all of them would spend the CPU of the runs that follow on probes none of them
needs. A run that compiled (``torch.compile``) or loaded an AOTInductor package asked which
vector ISAs work, and that answer stays cached in its process.
"""

from __future__ import annotations

import sys

__all__ = ["USED", "used"]

# Reported like a module name; no interpreter can import it (``_installed`` finds no such module).
USED = "torch._inductor:probed"


def used() -> bool:
    isa = sys.modules.get("torch._inductor.cpu_vec_isa")
    info = getattr(getattr(isa, "valid_vec_isa_list", None), "cache_info", None)
    try:
        return bool(info is not None and info().currsize)
    except Exception:  # noqa: BLE001 - a torch of another shape: no mark
        return False
