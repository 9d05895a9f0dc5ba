"""pytest rewrites the modules of its plugins' packages as it imports them: a warm interpreter
never imports them ahead of it.

    names = learnable(names)        # a run's report, before the interpreter imports what it names
    why = refuses(spec)             # before forking a run: "" or why a pytest run must go plain

Note [pytest rewrites what it imports]
pytest rewrites the ``assert`` statements of test modules, conftest files and every top-level
package of a distribution that declares a pytest plugin (entry point group ``pytest11``:
anyio, pytest-xdist, pytest-timeout...), as its import hook imports them. A package imported
before pytest marks it is left as it is, and pytest prints ``PytestAssertRewriteWarning:
Module already imported so cannot be rewritten``. A pre-imported plugin would change what
pytest does, so:
- a warm interpreter never learns such a package from a run's report: the plugins, which only
  pytest imports, stay out of every interpreter;
- a pytest run (``-m pytest``, ``-m py.test``, a script named ``pytest`` or ``py.test``) is
  forked only from an interpreter that holds none of them. Where another installed module
  imports one (transformers imports anyio), the run goes plain and the server's log says
  which: its loads are still warm, its imports are plain python's.
The names are found as pytest finds them (each such distribution's top-level modules and
packages, from its file list), once per interpreter: about 20 ms.
"""

from __future__ import annotations

import functools
import os
import sys

__all__ = ["learnable", "refuses", "rewritten_by_pytest"]

PYTEST_MODULES = ("pytest", "py.test")


@functools.lru_cache(maxsize=1)
def rewritten_by_pytest() -> frozenset[str]:
    """Top-level names pytest marks for rewriting in this environment."""
    try:
        import importlib.metadata as metadata

        dists = {ep.dist.name: ep.dist for ep in metadata.entry_points(group="pytest11") if ep.dist is not None}
    except Exception:  # noqa: BLE001 - broken metadata: pytest would mark nothing either
        return frozenset()
    names = set()
    for dist in dists.values():
        for file in dist.files or []:
            path = str(file)
            if "/" not in path and path.endswith(".py") and path[:-3] != "setup" \
                    and not path.startswith("__editable__"):
                names.add(path[:-3])
            elif path.count("/") == 1 and path.endswith("/__init__.py"):
                names.add(path.split("/")[0])
    return frozenset(names)


def learnable(names: list) -> list:
    """``names`` without the modules of packages pytest rewrites."""
    marked = rewritten_by_pytest()
    return [n for n in names if not (isinstance(n, str) and n.partition(".")[0] in marked)]


def _is_pytest_run(spec: dict) -> bool:
    mode, target = spec.get("mode"), spec.get("target")
    if mode == "module":
        return target in PYTEST_MODULES
    return mode == "script" and isinstance(target, str) and os.path.basename(target) in PYTEST_MODULES


def refuses(spec: object) -> str:
    """Why this run must not be forked from this interpreter (Note [pytest rewrites what it imports]); ""."""
    if not isinstance(spec, dict) or not _is_pytest_run(spec):
        return ""
    held = sorted(name for name in rewritten_by_pytest() if name in sys.modules)
    if not held:
        return ""
    return (f"pytest would rewrite {', '.join(held)}, which this warm interpreter imported "
            "(Note [pytest rewrites what it imports])")
