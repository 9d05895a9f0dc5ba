"""Compiled code across the processes, standard library only (the server validates packages
with it): AOTInductor packages a warm interpreter preloads and a run's call takes over, and the
mark a run reports when it made Inductor's CPU probes::

    packages = packages_from_wire(message.packages)     # the server: what a client reported
    hold(spec, runner, fingerprint(spec["path"]))       # a warm interpreter (overmind.warm.compiled)
    runner = take(spec)                                 # a run forked from it (overmind.client.compiled)
    names.append(USED) if used() else None              # a run's report at exit

    packages = packages_from_wire(message.packages)     # the server: what a client reported
    hold(spec, runner, fingerprint(spec["path"]))       # a warm interpreter (overmind.warm.compiled)
    runner = take(spec)                                 # a run forked from it (overmind.client.compiled)

Note [AOTInductor packages are handed over]
``aoti_load_package`` costs a fresh process about 2.8 s (measured on 2 cores): importing
``torch._inductor`` (1.3 s), the vector ISA probes (0.95 s: Note [Inductor's probes, made
once] in overmind.warm.compiled), then unpacking the package into a temporary folder and
``dlopen``-ing its library (0.2 s). None of it depends on the run, so a warm interpreter
whose context loaded the package before does it once, and a run forked from it gets the
loaded model back from its call. What keeps that the plain call:
- Never stale: the call is keyed by the package's real path, its file fingerprint (size,
  mtime_ns, inode, device, ctime_ns: Note [What a fingerprint cannot see] in overmind.shared.calls.keys)
  and the call's other arguments, bound to the original's signature with its defaults. The
  fingerprint is taken again at the run's call; a package changed since it was preloaded is
  a miss (the plain call), and a file changed too recently to fingerprint (Note [Racy files]
  in overmind.shared.calls.keys) is never preloaded.
- Never run before a fork: the warm interpreter constructs the loader and calls nothing on
  it (Note [No thread pool before a fork] in overmind.warm.compiled); only CPU packages are
  preloaded (their metadata is read from the archive first), so CUDA is never initialised
  there (Note [Warm interpreters never touch CUDA] in overmind.server.pool). ``aot_load`` likewise,
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

Note [Only a run that probed marks itself]
Whether a process made Inductor's CPU probes is what a run reports among its modules (``USED``),
so that the warm interpreters of its context make those probes ahead of the next run (Note
[Inductor's probes, made once] in overmind.warm.compiled). Importing ``torch._inductor`` says nothing: ``transformers`` and ``diffusers`` import it (its
``codecache``, ``compile_fx`` and ``cpu_vec_isa`` too) in every script that loads a model, and
priming for all of them would spend the CPU of the runs that follow on probes none of them
needs. A run that compiled (``torch.compile``) or loaded an AOTInductor package asked which
vector ISAs work, and that answer stays cached in its process.
"""

from __future__ import annotations

import os
import sys

__all__ = ["POINTS", "MAX_PACKAGES", "packages_from_wire", "spec_key", "refusal_name", "fingerprint", "hold",
           "held", "forget", "take", "any_held", "USED", "used"]



POINTS = ("torch._inductor::aoti_load_package", "torch._export::aot_load")
MAX_PACKAGES = 16  # per context: what a warm interpreter holds loaded
MAX_PATH = 4096
MAX_KWARGS = 8

# In a warm interpreter, spec_key -> (runner, fingerprint); inherited by each forked run.
_loaded: dict = {}
_handed: list = []  # runners a run took: never destroyed in the run (see the Note)


def plain_value(value) -> bool:
    """A value a package's call may take to be preloaded: a short string, a number, a flag or None."""
    return value is None or isinstance(value, (bool, int)) or (isinstance(value, str) and len(value) <= 256)


def packages_from_wire(data) -> list:
    """Packages a client reported, validated (Note [Frames are untrusted] in overmind.shared.protocol):
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
        if all(isinstance(k, str) and len(k) <= 64 and plain_value(v) for k, v in kwargs.items()):
            out.append({"point": point, "path": path, "kwargs": dict(kwargs)})
    return out


def spec_key(spec: dict) -> tuple:
    return spec["point"], spec["path"], tuple(sorted(spec["kwargs"].items()))


def refusal_name(spec: dict) -> str:
    """The name a package that started a thread is refused under (Note [Threads libraries start] in
    overmind.warm.fork_safety): the server then never hands it to this context again."""
    return f"aoti:{spec['path']}"


def fingerprint(path: str):
    """The file's fingerprint now, or None (missing, unreadable, or changed too recently)."""
    from overmind.shared.calls.keys import Uncacheable, fingerprint_paths

    if not os.access(path, os.R_OK):
        return None
    try:
        found = fingerprint_paths([path])
    except (Uncacheable, OSError):
        return None
    return tuple(found)


def held(spec: dict):
    """(runner, fingerprint) this process holds for ``spec``, or None."""
    return _loaded.get(spec_key(spec))


def hold(spec: dict, runner, fingerprint: tuple) -> None:
    """A warm interpreter loaded ``spec``'s package (overmind.warm.compiled): runs forked from now take it."""
    _loaded.pop(spec_key(spec), None)
    _loaded[spec_key(spec)] = (runner, fingerprint)
    while len(_loaded) > MAX_PACKAGES:
        _loaded.pop(next(iter(_loaded)))


def forget(spec: dict) -> None:
    _loaded.pop(spec_key(spec), None)


def take(spec: dict):
    """The preloaded runner for ``spec`` if its file is unchanged (taken: once per run), or None."""
    key = spec_key(spec)
    found = _loaded.get(key)
    if found is None:
        return None
    if fingerprint(spec["path"]) != found[1]:
        return None
    del _loaded[key]
    _handed.append(found[0])
    return found[0]


def any_held() -> bool:
    return bool(_loaded)


# Reported like a module name; no interpreter can import it (``overmind.warm.installed.installed_importable`` finds no such module).
USED = "torch._inductor:probed"


def used() -> bool:
    isa = sys.modules.get("torch._inductor.cpu_vec_isa")
    info = getattr(getattr(isa, "valid_vec_isa_list", None), "cache_info", None)
    try:
        return bool(info is not None and info().currsize)
    except Exception:  # noqa: BLE001 - a torch of another shape: no mark
        return False
