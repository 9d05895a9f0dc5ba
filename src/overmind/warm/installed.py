"""Which imported modules are installed code, never the user's: what a warm interpreter may hold.

    installed_modules()                  # in a finished run: names to pre-import next time
    installed_modules(skip=held)         # only those the warm interpreter did not hold

See Note [Warm interpreters] in overmind.warm.interpreter; used by overmind.warm.script (the child side of a
run) and overmind.warm.interpreter. Standard library only.
"""

from __future__ import annotations

import importlib.util
import os
import site
import sys
import sysconfig
from typing import Iterable

__all__ = ["installed_modules", "installed_prefixes", "installed_importable", "RUN_FOLDERS"]

# The folder a run put at sys.path[0] (its script's, or the cwd): the user's, set by overmind.warm.script.
RUN_FOLDERS: list[str] = []


def installed_prefixes() -> list[str]:
    """The standard library's and site-packages' folders."""
    paths = sysconfig.get_paths()
    found = [paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths]
    try:
        found += [*site.getsitepackages(), site.getusersitepackages()]
    except AttributeError:  # an old virtualenv's site module
        pass
    return found


def _module_paths(name: str, module: object) -> list[str] | None:
    """The files a module came from; None for a built-in or frozen module (stdlib)."""
    file = getattr(module, "__file__", None)
    if isinstance(file, str) and file:
        return [file]
    origin = getattr(getattr(module, "__spec__", None), "origin", None)
    if origin in ("built-in", "frozen") or name in sys.builtin_module_names:
        return None
    try:
        return [p for p in getattr(module, "__path__", None) or () if isinstance(p, str)]
    except Exception:  # noqa: BLE001 - a broken namespace path: nothing to pre-import
        return []


def installed_modules(prefixes: tuple[str, ...] | None = None, *, exclude: Iterable[str] = (),
                      skip: "frozenset[str] | set[str]" = frozenset()) -> list[str]:
    """Names of modules in sys.modules whose file lies under an installed location (stdlib, site-packages, dist-packages), never the user's own code (the script's folder, the cwd, editable installs / anything else on PYTHONPATH outside site-packages). Used to learn what to pre-import.

    In import order, the order to import them in. ``prefixes`` replaces the installed
    locations; ``exclude`` adds user folders to the cwd and the running script's folder
    (a warm run's script folder is known even after CPython-style cleanup dropped __file__).
    ``skip``: names not to look at (those a warm interpreter held when it forked the run).

    Note [Installed means found under an installed prefix]
    Each file is resolved (realpath) and given to the deepest folder holding it among the
    installed prefixes and the user's folders; it counts only if that is an installed prefix (a
    tie goes to the user). So a venv inside the project (cwd ~/proj, packages in ~/proj/.venv)
    counts, a module beside the script never does, and an editable install (a .pth path or a
    finder pointing into ~/proj/src, a symlink into the project) lies outside every prefix. A
    namespace package counts only if all its portions do.
    """
    installed = [os.path.realpath(p) for p in (installed_prefixes() if prefixes is None else prefixes)]
    users = [*exclude, *RUN_FOLDERS]  # a run's script folder, even once __file__ is gone
    try:
        users.append(os.getcwd())
    except OSError:
        pass
    main = sys.modules.get("__main__")
    if isinstance(getattr(main, "__file__", None), str) and getattr(main, "__spec__", None) is None:
        users.append(os.path.dirname(main.__file__))  # a script's (-m puts the cwd first)
    users = [os.path.realpath(p) for p in users]
    real_dirs: dict[str, str] = {}

    def real(path: str) -> str:  # realpath, with one lookup per folder rather than per file
        folder, base = os.path.split(path)
        if folder not in real_dirs:
            real_dirs[folder] = os.path.realpath(folder)
        joined = os.path.join(real_dirs[folder], base)
        return os.path.realpath(joined) if os.path.islink(joined) else joined

    def depth(path: str, folders: list[str]) -> int:
        return max((len(f) for f in folders if path == f or path.startswith(f.rstrip("/") + "/")), default=-1)

    def is_installed(path: str) -> bool:
        path = real(path)
        return depth(path, installed) > depth(path, users)

    names = []
    for name, module in list(sys.modules.items()):
        if name in ("__main__", "__mp_main__") or module is None or name in skip:
            continue
        paths = _module_paths(name, module)
        if paths is None or (paths and all(is_installed(p) for p in paths)):
            names.append(name)
    return names


def installed_importable(name: str) -> bool:
    """Is ``name`` importable from an installed location (never the user's code)?"""
    top = name.partition(".")[0]
    if top != name and top not in sys.modules and not installed_importable(top):
        return False  # find_spec of a submodule imports its package: never one of the user's
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError, AttributeError):
        return False
    if spec is None:
        return False
    if spec.origin in ("built-in", "frozen"):
        return True
    paths = [spec.origin] if spec.origin else list(spec.submodule_search_locations or [])
    prefixes = [os.path.join(os.path.realpath(p), "") for p in installed_prefixes()]
    return bool(paths) and all(os.path.realpath(p).startswith(tuple(prefixes)) for p in paths)
