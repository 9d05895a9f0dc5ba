"""Explicit, idempotent and reversible monkey patching of model-loading functions.

overmind speeds up loads by wrapping entry points such as
``DiffusionPipeline.from_pretrained`` or ``torch.load``. This module is only the
mechanism: a :class:`PatchPoint` says *where* a wrapper goes, the caller's
:data:`WrapperFactory` says *what* it does, and :func:`patch` installs it::

    import functools
    from overmind.shared import patching

    def make_wrapper(point, original, is_classmethod):
        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            print("loading through", point)
            return original(*args, **kwargs)
        return wrapper

    patching.patch(patching.parse_patch_specs("torch::load"), make_wrapper)
    import torch            # patched right after torch finishes executing
    patching.unpatch_all()  # every original is back

Rules, after ``gevent.monkey``: importing this module does nothing; patching
never imports a target module (a patch on a module not imported yet waits for
the user's own import, through a ``sys.meta_path`` hook); the first original
saved wins; wrappers keep the original's name, docstring and signature; a patched
call made while another patched call is running on the same thread skips its
wrapper (see :func:`in_patched_call`); :func:`unpatch_all` restores everything.

A module-level function patched while its module is already imported also
replaces the names other imported modules bound to it earlier (peft's
``from safetensors.torch import load_file as safe_load_file``), so a warm
``overmind run`` child, which imported them before its patch, hits like plain
python does (Note [Names bound before patching] in overmind.shared.patching.bound_names,
which finds them). The defining module's own global (``torch.serialization.load``
behind ``torch::load``), class attributes, ``__main__`` and overmind's own
modules are left alone.
"""

from __future__ import annotations

import functools
import importlib
import keyword
import logging
import os
import sys
import threading
import types
TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (start-up budget)

from overmind.shared.patching import bound_names
from overmind.shared.settings import config

if TYPE_CHECKING:  # typing and dataclasses cost ~30 ms at start-up; see overmind.api's budget
    from typing import Any, Callable, Iterable, Optional, Union

__all__ = [
    "PatchPoint", "WrapperFactory", "env_patch_points", "get_original", "in_patched_call", "index_bound_names", "is_patched",
    "parse_patch_specs", "patch", "patched_points", "pending_points", "unpatch_all",
]

logger = logging.getLogger(__name__)

_SEP = "::"


def _check_dotted(kind: str, name: object) -> None:
    if not isinstance(name, str) or not name:
        raise ValueError(f"empty {kind}")
    for part in name.split("."):
        if not part.isidentifier() or keyword.iskeyword(part):
            raise ValueError(f"invalid {kind} {name!r}: {part!r} is not a Python identifier")


class PatchPoint:
    """An attribute reachable from an importable module, written ``module::Qualname.attr``.

    ``module`` should be the module that *defines* the target, so that the import
    hook fires when that module is executed; ``qualname`` is the dotted path inside
    it (``"DiffusionPipeline.from_pretrained"``, or ``"load"`` for a function).
    Immutable and hashable.
    """

    __slots__ = ("module", "qualname")
    module: str
    qualname: str

    def __init__(self, module: str, qualname: str) -> None:
        _check_dotted("module name", module)
        _check_dotted("qualname", qualname)
        object.__setattr__(self, "module", module)
        object.__setattr__(self, "qualname", qualname)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"PatchPoint is immutable: cannot set {name}")

    def __eq__(self, other: object) -> bool:
        return type(other) is PatchPoint and (self.module, self.qualname) == (other.module, other.qualname)

    def __hash__(self) -> int:
        return hash((self.module, self.qualname))

    def __repr__(self) -> str:
        return f"PatchPoint(module={self.module!r}, qualname={self.qualname!r})"

    @classmethod
    def parse(cls, spec: str) -> PatchPoint:
        """Parse ``"module::Qualname.attr"``; ValueError says what is wrong."""
        module, sep, qualname = spec.strip().partition(_SEP)
        if not sep or _SEP in qualname:
            raise ValueError(
                f"invalid patch spec {spec!r}: expected exactly one '::', as in "
                "'diffusers.pipelines.pipeline_utils::DiffusionPipeline.from_pretrained'"
            )
        try:
            return cls(module.strip(), qualname.strip())
        except ValueError as exc:
            raise ValueError(f"invalid patch spec {spec!r}: {exc}") from None

    def __str__(self) -> str:
        return f"{self.module}{_SEP}{self.qualname}"


def env_patch_points(env=None) -> str:
    """``OVERMIND_PATCH``: extra patch points, ``module::Qualname.attr``, comma separated. A bad
    item warns once and is left out (Note [A bad setting never stops a script]); the rest, comma
    separated, is returned."""
    raw = (os.environ if env is None else env).get("OVERMIND_PATCH", "")
    if not raw.strip():
        return raw
    good = []
    for item in raw.split(","):
        if not item.strip():
            continue
        try:
            PatchPoint.parse(item)
        except ValueError as err:
            config.tell(f"OVERMIND_PATCH: {err}; that item is ignored (accepted: module::Qualname.attr, "
                         "comma separated)")
            continue
        good.append(item.strip())
    return ",".join(good)


def parse_patch_specs(text: str) -> list[PatchPoint]:
    """Parse one spec a line (or comma-separated, as in an environment variable).

    Blank lines and ``#`` comments are ignored, duplicates are dropped (first kept);
    a bad spec raises ValueError naming its line number.
    """
    points: list[PatchPoint] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        for item in line.split("#", 1)[0].split(","):
            if not item.strip():
                continue
            try:
                point = PatchPoint.parse(item)
            except ValueError as exc:
                raise ValueError(f"line {lineno}: {exc}") from None
            if point not in points:
                points.append(point)
    return points


#: ``make_wrapper(point, original, is_classmethod) -> wrapper``. For a classmethod,
#: ``original`` is the underlying function (it takes ``cls`` first) and so does the
#: wrapper; patch() re-wraps it in classmethod (staticmethod likewise).
WrapperFactory = "Callable[[PatchPoint, Callable[..., Any], bool], Callable[..., Any]]"


class _Record:
    """One installed patch: enough to undo it exactly."""

    def __init__(self, point: PatchPoint, owner: Any, name: str, saved: Any, own: bool,
                 original: Callable[..., Any], guard: Optional[Callable[..., Any]] = None, active: bool = True) -> None:
        self.point = point
        self.owner = owner  # the module or class whose attribute was replaced
        self.name = name
        self.saved = saved  # the raw attribute as found (a classmethod object, a function, ...)
        self.own = own  # False: it was inherited, so undo by deleting ours from the subclass
        self.original = original  # descriptor-unwrapped; what the factory received
        self.guard = guard
        self.active = active
        self.copies: list[tuple[type, Any]] = []  # (subclass, raw attribute): Note [Copies of a patched classmethod]
        self.aliases: list[tuple[dict, str]] = []  # (module globals, name): bound_names.rebind


_lock = threading.RLock()
_local = threading.local()  # .depth: patched calls in progress; .finding: names being found
_records: dict[PatchPoint, _Record] = {}
_pending: dict[str, dict[PatchPoint, WrapperFactory]] = {}
_warned: set[PatchPoint] = set()
_finder: Optional[_PatchFinder] = None


def in_patched_call() -> bool:
    """True while the current thread is inside a wrapper installed by :func:`patch`."""
    return getattr(_local, "depth", 0) > 0


def _warn_once(point: PatchPoint, why: str) -> None:
    if point not in _warned:
        _warned.add(point)
        logger.warning("overmind: not patching %s: %s", point, why)


def _resolve(module: Any, point: PatchPoint) -> tuple[Any, str, Any, bool]:
    """(owner, attribute name, raw attribute, defined on owner itself); AttributeError if absent."""
    owner = module
    *path, name = point.qualname.split(".")
    for part in path:
        owner = getattr(owner, part)
    if isinstance(owner, type):
        # Read the class __dict__ along the MRO so descriptors stay raw (classmethod objects).
        for klass in owner.__mro__:
            if name in vars(klass):
                return owner, name, vars(klass)[name], klass is owner
        raise AttributeError(f"type object {owner.__qualname__!r} has no attribute {name!r}")
    raw = getattr(owner, name)  # modules: getattr also serves lazy modules
    own = isinstance(owner, types.ModuleType) or name in getattr(owner, "__dict__", {})
    return owner, name, raw, own


def _unwrap(raw: Any) -> tuple[Any, Optional[type]]:
    if isinstance(raw, classmethod):
        return raw.__func__, classmethod
    if isinstance(raw, staticmethod):
        return raw.__func__, staticmethod
    return raw, None


def _func_of(obj: Any) -> Any:
    """The plain function behind a bound method or classmethod/staticmethod object."""
    for _ in range(3):
        if isinstance(obj, (classmethod, staticmethod, types.MethodType)):
            obj = obj.__func__
    return obj


def _record_of(obj: Any) -> Optional[_Record]:
    func = _func_of(obj)
    for record in _records.values():
        if record.guard is func:
            return record
    return None


def _make_guard(record: _Record, wrapper: Callable[..., Any]) -> Callable[..., Any]:
    original = record.original

    @functools.wraps(original)
    def guard(*args: Any, **kwargs: Any) -> Any:
        # A pipeline loading its sub-models (or torch.load called by a patched
        # loader) must not run wrapper logic twice; stale references kept past
        # unpatch_all() behave like the original too.
        if not record.active or getattr(_local, "depth", 0):
            return original(*args, **kwargs)
        _local.depth = getattr(_local, "depth", 0) + 1
        try:
            return wrapper(*args, **kwargs)
        finally:
            _local.depth -= 1

    return guard


def _apply(point: PatchPoint, make_wrapper: WrapperFactory) -> Optional[_Record]:
    """Install one patch now; the module is in sys.modules. Caller holds _lock."""
    if point in _records:
        return None  # first patch wins: never double-wrap
    try:
        owner, name, raw, own = _resolve(sys.modules[point.module], point)
    except AttributeError as exc:
        _warn_once(point, f"attribute not found ({exc})")
        return None
    func, kind = _unwrap(raw)
    if not callable(func):
        _warn_once(point, f"{type(raw).__name__} object is not callable")
        return None
    if _record_of(func) is not None:
        # Same attribute reached through another point (a re-export or a subclass).
        logger.debug("overmind: %s is already patched through another point", point)
        return None
    record = _Record(point, owner, name, raw, own, func)
    record.guard = _make_guard(record, make_wrapper(point, func, kind is classmethod))
    try:
        setattr(owner, name, kind(record.guard) if kind else record.guard)
    except (AttributeError, TypeError) as exc:  # e.g. attributes of built-in types
        _warn_once(point, f"attribute cannot be replaced ({exc})")
        return None
    _records[point] = record
    if isinstance(owner, type) and kind is classmethod:
        record.copies = _patch_copies(owner, name, func, record.guard)
    logger.debug("overmind: patched %s", point)
    return record


def _patch_copies(owner: type, name: str, func: Any, guard: Callable[..., Any]) -> list[tuple[type, Any]]:
    """Note [Copies of a patched classmethod]
    transformers gives each Auto class its own copy of ``_BaseAutoModelClass.from_pretrained``
    (``copy_func``: a new function object over the same code) when the class is created. A
    class created after patching copies our guard; one created before (transformers imported
    before ``monkey_patch_all()``, as in every warm interpreter) keeps a copy of the original
    and would bypass the patch. So subclasses whose own attribute is a classmethod over the
    original's code object are patched too, and restored by :func:`unpatch_all`."""
    code = getattr(func, "__code__", None)
    if code is None:
        return []
    copies, seen, todo = [], set(), list(owner.__subclasses__())
    while todo:
        klass = todo.pop()
        if klass in seen:
            continue
        seen.add(klass)
        todo.extend(klass.__subclasses__())
        raw = vars(klass).get(name)
        if isinstance(raw, classmethod) and getattr(raw.__func__, "__code__", None) is code:
            try:
                setattr(klass, name, classmethod(guard))
                copies.append((klass, raw))
            except (AttributeError, TypeError):
                pass
    return copies


def index_bound_names(points: Iterable[PatchPoint]) -> None:
    """In a warm interpreter, before it forks: where imported modules bound the module-level
    functions of ``points`` (Note [Names bound before patching] in overmind.shared.patching.bound_names).
    Cheap when nothing was imported since the last call."""
    functions = []
    for point in points:
        module = sys.modules.get(point.module)
        if module is None or "." in point.qualname:
            continue
        func = getattr(module, point.qualname, None)
        if isinstance(func, types.FunctionType):
            functions.append(func)
    bound_names.index(functions)


def _apply_pending(module_name: str) -> None:
    with _lock:
        todo = _pending.pop(module_name, {})
        for point, make_wrapper in todo.items():
            try:
                _apply(point, make_wrapper)
            except Exception:  # never break the user's own import
                logger.warning("overmind: failed to patch %s", point, exc_info=True)


class _PatchingLoader:
    """Delegates to the real loader and applies pending patches after exec_module."""

    def __init__(self, loader: Any, name: str) -> None:
        self._loader = loader
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        if attr in ("_loader", "_name"):  # not set yet (copy, pickle): avoid recursion
            raise AttributeError(attr)
        return getattr(self._loader, attr)

    def create_module(self, spec: Any) -> Any:
        create = getattr(self._loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module: types.ModuleType) -> None:
        try:
            self._loader.exec_module(module)
        finally:
            # Hand the real loader back so that nothing sees this wrapper afterwards.
            if getattr(module, "__loader__", None) is self:
                module.__loader__ = self._loader
            spec = getattr(module, "__spec__", None)
            if spec is not None and spec.loader is self:
                spec.loader = self._loader
        _apply_pending(self._name)


class _PatchFinder:
    """``sys.meta_path`` entry that arms the loader of modules with pending patches."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in _pending:
            return None
        finding = getattr(_local, "finding", None)
        if finding is None:
            finding = _local.finding = set()
        if fullname in finding:
            return None  # a finder below us looked the same name up again
        finding.add(fullname)
        try:
            spec = None
            for finder in list(sys.meta_path):
                find_spec = getattr(finder, "find_spec", None)
                if finder is self or find_spec is None:
                    continue
                spec = find_spec(fullname, path, target)
                if spec is not None:
                    break
        finally:
            finding.discard(fullname)
        if spec is None:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            logger.debug("overmind: loader of %s has no exec_module; patches stay pending", fullname)
            return spec
        spec.loader = _PatchingLoader(spec.loader, fullname)
        return spec


def patch(points: Iterable[PatchPoint], make_wrapper: WrapperFactory) -> None:
    """Wrap every point with ``make_wrapper``, now or right after its module is imported.

    Never imports a target module. Idempotent: a point patched (or pending)
    already is left alone. A missing attribute logs one warning and is skipped.
    Errors raised by ``make_wrapper`` propagate when applied here, and are
    logged when applied from the import hook (the user's import must not fail).
    ``make_wrapper`` runs under this module's lock, possibly inside an import:
    it should build a closure and nothing more (no imports, no I/O).
    """
    global _finder
    with _lock:
        applied: list[_Record] = []  # module-level functions patched here: their aliases next
        for point in points:
            if point in _records:
                continue
            if sys.modules.get(point.module) is not None:
                record = _apply(point, make_wrapper)
                if record is not None and isinstance(record.owner, types.ModuleType) \
                        and isinstance(record.saved, types.FunctionType):
                    applied.append(record)
                continue
            _pending.setdefault(point.module, {}).setdefault(point, make_wrapper)
            if _finder is None:
                _finder = _PatchFinder()
                # Kept until unpatch_all(): removing meta_path entries while an
                # import may be iterating over the list would skip a finder.
                sys.meta_path.insert(0, _finder)
        if applied:
            bound_names.rebind(applied)


def unpatch_all() -> None:
    """Restore every original, drop pending patches and remove the import hook."""
    global _finder
    with _lock:
        for point, record in reversed(list(_records.items())):
            record.active = False
            owner, name = record.owner, record.name
            # Look at the object we patched, even if sys.modules now holds another.
            current = vars(owner).get(name) if isinstance(owner, type) else getattr(owner, name, None)
            if _func_of(current) is not record.guard:
                logger.warning("overmind: %s was replaced since it was patched; leaving it", point)
            elif record.own:
                setattr(owner, name, record.saved)
            else:
                delattr(owner, name)
            for klass, raw in record.copies:
                if _func_of(vars(klass).get(name)) is record.guard:
                    setattr(klass, name, raw)
            # Note [Names bound before patching] in overmind.shared.patching.bound_names
            for namespace, attr in record.aliases:
                if namespace.get(attr) is record.guard:
                    namespace[attr] = record.original
        _records.clear()
        _pending.clear()
        _warned.clear()
        if _finder is not None:
            if _finder in sys.meta_path:
                sys.meta_path.remove(_finder)
            _finder = None


def is_patched(point_or_obj: Union[PatchPoint, Any]) -> bool:
    """Whether a point's attribute currently holds our wrapper, or ``obj`` is a
    wrapper installed by :func:`patch` or an original it replaced.
    """
    with _lock:
        if isinstance(point_or_obj, PatchPoint):
            module = sys.modules.get(point_or_obj.module)
            if module is None:
                return False
            try:
                current = _resolve(module, point_or_obj)[2]
            except AttributeError:
                return False
            return _record_of(current) is not None
        func = _func_of(point_or_obj)
        return any(func is r.guard or func is r.original for r in _records.values())


def get_original(module: str, qualname: str) -> Callable[..., Any]:
    """The original callable behind ``module::qualname``, descriptor-unwrapped.

    For a classmethod this is the plain function taking ``cls`` first. If the
    point was never patched, the current attribute is returned (importing the
    module if needed), as ``gevent.monkey.get_original`` does.
    """
    point = PatchPoint(module, qualname)
    with _lock:
        record = _records.get(point)
        if record is not None:
            return record.original
    mod = importlib.import_module(module)
    func = _unwrap(_resolve(mod, point)[2])[0]
    with _lock:
        record = _record_of(func)  # patched through another point
    return record.original if record is not None else func


def patched_points() -> list[PatchPoint]:
    """Points whose wrapper is installed, in the order they were applied."""
    with _lock:
        return list(_records)


def pending_points() -> list[PatchPoint]:
    """Points waiting for their module to be imported."""
    with _lock:
        return [point for todo in _pending.values() for point in todo]
