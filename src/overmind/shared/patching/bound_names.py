"""The names other modules bound to a function before :func:`overmind.shared.patching.patch`
wrapped it, found and pointed at the wrapper (Note [Names bound before patching]); a warm
interpreter indexes them before it forks. Standard library only; knows nothing of patch points::

    index(functions)   # a warm interpreter, before it forks
    rebind(records)    # patch(), under its lock: each record's .original -> .guard
"""

from __future__ import annotations

import itertools
import logging
import sys
import types
TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (start-up budget)

if TYPE_CHECKING:
    from typing import Any, Iterable, Optional

__all__ = ["index", "rebind"]

logger = logging.getLogger(__name__)


def rebind(records: list) -> None:
    """Note [Names bound before patching]
    ``from safetensors.torch import load_file as safe_load_file`` (peft, accelerate) copies the
    function into the importing module's globals. Imported after the patch, as under plain
    python, that copy is our guard; imported before it, as in a warm ``overmind run`` child
    whose interpreter learned peft, it is the original and every adapter load missed the cache.
    So when :func:`~overmind.shared.patching.patch` applies a module-level function to a module
    already imported, every module global that ``is`` the original becomes the same guard,
    recorded in the patch's record (``aliases``) so that
    :func:`~overmind.shared.patching.unpatch_all` puts the original back (only where the guard
    is still there). Not touched: the import-hook path (nobody can have bound a name the module
    had not defined yet), the function's defining module (its own global is the definition,
    which plain python leaves alone too: ``torch.serialization.load`` behind ``torch::load``),
    class attributes (looked up through the class; Note [Copies of a patched classmethod] in
    overmind.shared.patching covers copies), ``__main__`` (the caller's own names: it may keep
    ``original = torch.load`` on purpose) and overmind's own modules.

    Finding them is one pass over ``sys.modules``, each module's values matched by ``id`` in C:
    ~8 ms with torch, transformers, diffusers and peft imported (3,700 modules, 147,000
    globals). In a child forked from a frozen warm interpreter that pass would cost ~75 ms and
    ~70 MiB: iterating a value writes its refcount, which copies ~22,000 shared pages. So a warm
    interpreter makes the pass before it forks (:func:`index`), and a child reads the index,
    confirms each place by identity, and passes only over the modules imported since (the tail
    of ``sys.modules``, which keeps import order); when it cannot tell what is new (a module
    removed since) or a function was not indexed, it makes the whole pass.

    ``records`` are patching's records of module-level functions just patched: each has
    ``point``, ``original``, ``guard`` and the list ``aliases`` of (module globals, name)."""
    targets = {id(r.original): r for r in records}
    found = _from_index(targets)
    if found is None:
        found = _bound_in(list(sys.modules.values()), targets)
    for namespace, attr, record in found:
        # Write the globals dict: it is what the module's own functions look up, and a
        # module subclass's __setattr__ has no business running here.
        namespace[attr] = record.guard
        record.aliases.append((namespace, attr))
        logger.debug("overmind: patched %s.%s, bound to %s before patching", namespace.get("__name__"), attr,
                     record.point)


def _bound_in(modules: list, targets: dict) -> list:
    """(module globals, name, target) for each global of ``modules`` that is a target's original."""
    found = []
    for module in modules:
        if not isinstance(module, types.ModuleType):
            continue  # sys.modules may hold other objects; their __dict__ could be anything
        namespace = module.__dict__
        try:
            disjoint = targets.keys().isdisjoint(map(id, namespace.values()))
        except RuntimeError:  # another thread is executing this module (its import): read a copy
            disjoint = targets.keys().isdisjoint(map(id, namespace.copy().values()))
        if disjoint:
            continue
        modname = namespace.get("__name__")
        if not isinstance(modname, str) or modname in ("__main__", "__mp_main__") \
                or modname == "overmind" or modname.startswith("overmind."):
            continue
        for attr, value in list(namespace.items()):
            target = targets.get(id(value))
            if target is None or value is not target.original or namespace is getattr(value, "__globals__", None):
                continue  # not one, or the definition itself
            found.append((namespace, attr, target))
    return found


class _Target:
    """What :func:`_bound_in` needs of a function to look for (a record, or an index entry)."""

    def __init__(self, original: Any) -> None:
        self.original = original


# Note [Names bound before patching]: (len(sys.modules), its last key, {id(function): function},
# [(module globals, name, function), ...]) as a warm interpreter left them before forking.
_index: Optional[tuple] = None


def index(functions: Iterable[types.FunctionType]) -> None:
    """In a warm interpreter, before it forks: where imported modules bound ``functions``
    (Note [Names bound before patching]). Cheap when nothing was imported since the last call."""
    global _index
    if _index is not None and _index[0] == len(sys.modules):
        return
    by_id = {id(func): func for func in functions}
    loaded = dict(sys.modules)  # one copy: the count and the last name must agree (see _from_index)
    modules = list(loaded.values())
    found = _bound_in(modules, {ident: _Target(func) for ident, func in by_id.items()})
    _index = (len(modules), next(reversed(loaded), None), by_id,
              [(namespace, attr, target.original) for namespace, attr, target in found])


def _from_index(targets: dict) -> Optional[list]:
    """The places of ``targets`` from the warm interpreter's index, plus those in modules
    imported since; None where the index cannot tell."""
    if _index is None:
        return None
    count, last_key, functions, places = _index
    if any(functions.get(ident) is not target.original for ident, target in targets.items()):
        return None
    for _ in range(3):
        new = len(sys.modules) - count
        if new < 0:
            return None
        # The new names and one more. Another thread (the warm-up thread the first wrapper
        # starts, the user's own) may be importing: the copy runs in C, but the interpreter can
        # switch threads between making the iterator and reading it, and the read then raises;
        # try again. Only the tail: a reference to every name would copy their shared pages.
        try:
            names = list(itertools.islice(reversed(sys.modules), new + 1))
        except RuntimeError:  # "dictionary changed size during iteration"
            continue
        if count == 0 or names[new:] == [last_key]:
            tail = names[:new]
            break
    else:  # a module came during the reads each time, or one indexed was removed
        return None
    found = [(namespace, attr, targets[id(func)]) for namespace, attr, func in places
             if id(func) in targets and namespace.get(attr) is func]
    return found + _bound_in([sys.modules.get(name) for name in tail], targets)
