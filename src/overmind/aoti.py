"""AOTInductor packages warm: loaded, never run, in the warm interpreter; handed to a run's call.

Standard library only at import (the server validates packages with it; torch is imported
by the functions that load)::

    # a patched call (overmind.api.monkey_patch_all()), in any process:
    runner = torch._inductor.aoti_load_package("/models/block.pt2")
    #   in a run forked from a warm interpreter that preloaded it, its file unchanged: that runner;
    #   otherwise the plain call, and the server is told (the next interpreter preloads it)

    # the warm interpreter (overmind.zygote), between forks:
    aoti.preload({"point": "torch._inductor::aoti_load_package", "path": "/models/block.pt2",
                  "kwargs": {"run_single_threaded": False, "device_index": -1}})

Note [AOTInductor packages are handed over]
``aoti_load_package`` costs a fresh process about 2.8 s (issue 24): importing
``torch._inductor`` (1.3 s), the vector ISA probes (0.95 s: Note [Inductor's probes, made
once] in overmind.compiled), then unpacking the package into a temporary folder and
``dlopen``-ing its library (0.2 s). None of it depends on the run, so a warm interpreter
whose context loaded the package before does it once, and a run forked from it gets the
loaded model back from its call. What keeps that the plain call:
- Never stale: the call is keyed by the package's real path, its file fingerprint (size,
  mtime_ns, inode, device, ctime_ns: Note [What a fingerprint cannot see] in overmind.calls)
  and the call's other arguments, bound to the original's signature with its defaults. The
  fingerprint is taken again at the run's call; a package changed since it was preloaded is
  a miss (the plain call), and a file changed too recently to fingerprint (Note [Racy files]
  in overmind.calls) is never preloaded.
- Never run before a fork: the warm interpreter constructs the loader and calls nothing on
  it (Note [No thread pool before a fork] in overmind.compiled); only CPU packages are
  preloaded (their metadata is read from the archive first), so CUDA is never initialised
  there (Note [Zygotes never touch CUDA] in overmind.loader_pool). ``aot_load`` likewise,
  for ``device="cpu"`` only.
- One hand-over per preload and run: the first matching call of a run takes the preloaded
  runner; a second call of the same package loads plainly, so two calls give two independent
  runners, as in plain python. The runner shares the loaded code and constants with the
  warm interpreter (copy-on-write pages), and is what plain returns
  (``AOTICompiledModel``, or ``aot_load``'s function).
- The run keeps its runner to the end: the loader deletes its unpacked folder when it is
  destroyed, and that folder is the warm interpreter's, shared by every run; so a run holds
  a reference it never drops (a forked run does not tear its modules down at exit).
- Only the original is ever called: a file-like argument, an unexpected argument, or any
  failure on the way is the plain call, whose errors are the caller's as they would be.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

__all__ = ["POINTS", "MAX_PACKAGES", "call", "preload", "preload_warm", "packages_from_wire", "spec_key",
           "refusal_name"]

POINTS = ("torch._inductor::aoti_load_package", "torch._export::aot_load")
MAX_PACKAGES = 16  # per context: what a warm interpreter holds loaded
MAX_PATH = 4096
MAX_KWARGS = 8

# In a warm interpreter, spec_key -> (runner, fingerprint); inherited by each forked run.
_loaded: dict = {}
_handed: list = []  # runners a run took: never destroyed in the run (see the Note)
_failed: set = set()  # (spec_key, fingerprint) that raised when preloaded


# -- the wire: what a client teaches and the server hands on ------------------------------------

def _scalar(value) -> bool:
    return value is None or isinstance(value, (bool, int)) or (isinstance(value, str) and len(value) <= 256)


def packages_from_wire(data) -> list:
    """Packages a client reported, validated (Note [Frames are untrusted] in overmind.protocol):
    anything malformed is dropped, never fatal."""
    if not isinstance(data, list):
        return []
    out = []
    for item in data[:MAX_PACKAGES]:
        if not isinstance(item, dict) or set(item) != {"point", "path", "kwargs"}:
            continue
        point, path, kwargs = item["point"], item["path"], item["kwargs"]
        if point not in POINTS or not isinstance(path, str) or not os.path.isabs(path) or len(path) > MAX_PATH \
                or "\0" in path or not isinstance(kwargs, dict) or len(kwargs) > MAX_KWARGS:
            continue
        if all(isinstance(k, str) and len(k) <= 64 and _scalar(v) for k, v in kwargs.items()):
            out.append({"point": point, "path": path, "kwargs": dict(kwargs)})
    return out


def spec_key(spec: dict) -> tuple:
    return spec["point"], spec["path"], tuple(sorted(spec["kwargs"].items()))


def refusal_name(spec: dict) -> str:
    """The name a package that started a thread is refused under (Note [Forking past torch's
    thread] in overmind.zygote): the server then never hands it to this context again."""
    return f"overmind.aoti:{spec['path']}"


# -- both sides ----------------------------------------------------------------------------------

def _fingerprint(path: str):
    """The file's fingerprint now, or None (missing, unreadable, or changed too recently)."""
    from overmind.calls import Uncacheable, fingerprint_paths

    if not os.access(path, os.R_OK):
        return None
    try:
        found = fingerprint_paths([path])
    except (Uncacheable, OSError):
        return None
    return tuple(found)


def _describe(point: str, original, args: tuple, kwargs: dict) -> dict | None:
    """The call as a package spec (real path, the other arguments bound with their defaults),
    or None when it is not one to preload (a file-like object, arguments that are not plain)."""
    import inspect

    try:
        bound = inspect.signature(original).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return None
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    first = next(iter(arguments))
    path = arguments.pop(first)
    if not isinstance(path, (str, os.PathLike)) or not all(_scalar(v) for v in arguments.values()):
        return None
    try:
        path = os.path.realpath(os.fspath(path))
    except (TypeError, ValueError):
        return None
    if not isinstance(path, str):
        return None
    if point == "torch._export::aot_load" and arguments.get("device") != "cpu":
        return None
    return {"point": point, "path": path, "kwargs": arguments}


# -- the warm interpreter ------------------------------------------------------------------------

def _cpu_package(path: str, kwargs: dict) -> bool:
    """Whether every model of the package runs on the CPU, from its metadata: loading a CUDA one
    would initialise CUDA in the warm interpreter."""
    import json
    import zipfile

    try:
        with zipfile.ZipFile(path) as archive:
            devices = [json.loads(archive.read(name)).get("AOTI_DEVICE_KEY") for name in archive.namelist()
                       if "/data/aotinductor/" in name and name.endswith("_metadata.json")]
    except (OSError, ValueError, zipfile.BadZipFile, KeyError):
        return False
    return bool(devices) and all(d == "cpu" for d in devices)


def _resolve(point: str):
    import importlib

    module, _, name = point.partition("::")
    return getattr(importlib.import_module(module), name)


def preload(spec: dict) -> str:
    """Load the package of ``spec`` here, without running it; "" or why not. In a warm
    interpreter only (it never patches, so the attribute is the original)."""
    key = spec_key(spec)
    fingerprint = _fingerprint(spec["path"])
    if fingerprint is None:
        return "missing, unreadable or just written"
    held = _loaded.get(key)
    if held is not None and held[1] == fingerprint:
        return ""
    if spec["point"] == "torch._inductor::aoti_load_package" and not _cpu_package(spec["path"], spec["kwargs"]):
        return "not a CPU package"
    attempt = (key, fingerprint)
    if attempt in _failed:
        return "it failed to load before"
    _loaded.pop(key, None)  # a changed file: its old runner goes
    _failed.add(attempt)  # until it loads: a package that raises is not tried again each run
    runner = _resolve(spec["point"])(spec["path"], **spec["kwargs"])
    _failed.discard(attempt)
    from overmind.compiled import forget_isa_list

    forget_isa_list()  # loading asked for it: Note [Inductor's probes, made once] in overmind.compiled
    if _fingerprint(spec["path"]) != fingerprint:
        return "changed while it loaded"
    _loaded[key] = (runner, fingerprint)
    while len(_loaded) > MAX_PACKAGES:
        _loaded.pop(next(iter(_loaded)))
    return ""


def preload_warm(spec: dict, reads, refused) -> list[str]:
    """:func:`preload` in a warm interpreter, the settings it reads recorded into ``reads``
    (Note [Settings an import read] in overmind.import_env); the names to refuse: the
    package's, if loading it started a thread (Note [No thread pool before a fork] in
    overmind.compiled)."""
    from overmind.compiled import native_threads
    from overmind.import_env import recording

    name = refusal_name(spec)
    if name in refused:
        return []
    before = native_threads()
    try:
        with recording(reads):
            why = preload(spec)
    except Exception as err:  # noqa: BLE001 - the run's call loads it plainly
        why = repr(err)
    if why:
        logger.info("not preloading %s: %s", spec["path"], why)
    else:
        logger.info("preloaded %s", spec["path"])
    if native_threads() != before:
        logger.warning("loading %s started a thread: this interpreter will not fork again", spec["path"])
        return [name]
    return []


# -- the run: the patched call -------------------------------------------------------------------

def _take(spec: dict):
    """The preloaded runner for ``spec`` if its file is unchanged (taken: once per run), or None."""
    key = spec_key(spec)
    held = _loaded.get(key)
    if held is None:
        return None
    if _fingerprint(spec["path"]) != held[1]:
        return None
    del _loaded[key]
    _handed.append(held[0])
    return held[0]


def _teach(spec: dict, result) -> None:
    """Tell the server this context loads the package, so its warm interpreters preload it."""
    try:
        loader = getattr(result, "loader", None)
        if loader is not None and loader.get_metadata().get("AOTI_DEVICE_KEY") != "cpu":
            return
        if _fingerprint(spec["path"]) is None:
            return
        from overmind import protocol as P
        from overmind.cache import context
        from overmind.client import Connection
        from overmind.config import Config

        config = Config.from_env()
        with Connection.open(config) as conn:
            conn.simple(P.Prepare(context(), packages=[spec]), P.Ok, timeout=config.reply_timeout)
    except Exception as err:  # noqa: BLE001 - teaching is a bonus: the caller has its runner
        logger.debug("could not report AOTInductor package %s: %s", spec.get("path"), err)


def call(point: str, original, args: tuple, kwargs: dict):
    """The patched ``aoti_load_package`` / ``aot_load`` (overmind.api's wrapper calls it): the
    preloaded runner, or the plain call (Note [AOTInductor packages are handed over])."""
    try:
        spec = _describe(point, original, args, kwargs)
        runner = _take(spec) if spec is not None and _loaded else None
    except Exception as err:  # noqa: BLE001 - Note [Never worse than no cache] in overmind.api
        logger.debug("AOTInductor hand-over failed: %r", err)
        spec = runner = None
    if runner is not None:
        return runner
    result = original(*args, **kwargs)
    if spec is not None:
        _teach(spec, result)
    return result
