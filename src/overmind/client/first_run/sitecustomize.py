"""Imported by ``site`` in a run that ``overmind run`` had to execute plainly (no warm
interpreter for its context yet): teach that interpreter, while the run imports, what it
imports. Standard library and overmind's light modules only.

The first run of ``overmind run`` teaches its context's warm interpreter (Note [The first run
teaches] in overmind.client.teach): the front end puts this folder first on ``PYTHONPATH``
(keeping the caller's value in ``OVERMIND_FIRST_RUN_PYTHONPATH``) and execs python as it would
have. Here, before any of the user's code, the environment and ``sys.path`` are put back as plain
python has them, a ``sitecustomize`` of the caller's own is imported in our place, and
``teach()`` starts. What stays different from plain python, besides what ``teach()`` leaves: a
``sitecustomize`` module where there was none. ``-I``, ``-E`` and ``-S`` runs never import this
file, and learn nothing.
"""

import os
import sys

SAVED = "OVERMIND_FIRST_RUN_PYTHONPATH"  # "=" and the caller's PYTHONPATH, or "" when it had none


def _restore() -> bool:
    saved = os.environ.pop(SAVED, None)
    if saved is None:
        return False
    if saved.startswith("="):
        os.environ["PYTHONPATH"] = saved[1:]
    else:
        os.environ.pop("PYTHONPATH", None)
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    sys.path_importer_cache.pop(here, None)
    return True


def _import_theirs() -> None:
    """The caller's own sitecustomize, which this module shadowed (site imports only one)."""
    import importlib.util

    mine = sys.modules.pop("sitecustomize", None)
    try:
        spec = importlib.util.find_spec("sitecustomize")
    except (ImportError, ValueError):
        spec = None
    if spec is None or spec.origin == __file__:
        if mine is not None:
            sys.modules["sitecustomize"] = mine
        return
    import importlib

    try:
        importlib.import_module("sitecustomize")  # importlib's bookkeeping keeps theirs in sys.modules
    except Exception:  # noqa: BLE001 - as site.py does: print and go on
        import traceback

        traceback.print_exc()


if _restore():
    _import_theirs()
    from overmind.client.teach import teach

    teach()
