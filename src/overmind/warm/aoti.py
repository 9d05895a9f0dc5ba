"""AOTInductor packages loaded, never run, in a warm interpreter: Note [AOTInductor packages are
handed over] in overmind.shared.packages::

    refused = preload_warm({"point": "torch._inductor::aoti_load_package", "path": "/models/block.pt2",
                            "kwargs": {"run_single_threaded": False, "device_index": -1}}, reads, refused)
"""

from __future__ import annotations

import logging

from overmind.shared.packages import fingerprint, forget, held, hold, refusal_name, spec_key

logger = logging.getLogger(__name__)

__all__ = ["preload", "preload_warm"]

_failed: set = set()  # (spec_key, fingerprint) that raised when preloaded


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
    found = fingerprint(spec["path"])
    if found is None:
        return "missing, unreadable or just written"
    holding = held(spec)
    if holding is not None and holding[1] == found:
        return ""
    if spec["point"] == "torch._inductor::aoti_load_package" and not _cpu_package(spec["path"], spec["kwargs"]):
        return "not a CPU package"
    attempt = (key, found)
    if attempt in _failed:
        return "it failed to load before"
    forget(spec)  # a changed file: its old runner goes
    _failed.add(attempt)  # until it loads: a package that raises is not tried again each run
    from overmind.warm.compiled import probe_vector_isas

    probe_vector_isas()  # what the load asks first, at once: Note [The ISA probes at once] in overmind.warm.compiled
    runner = _resolve(spec["point"])(spec["path"], **spec["kwargs"])
    _failed.discard(attempt)
    if fingerprint(spec["path"]) != found:
        return "changed while it loaded"
    hold(spec, runner, found)
    return ""


def preload_warm(spec: dict, reads, refused) -> list[str]:
    """:func:`preload` in a warm interpreter, the settings it reads recorded into ``reads``
    (Note [Settings an import read] in overmind.shared.import_env); the names to refuse: the
    package's, if loading it started a thread nobody vouches for (Note [Threads libraries start]
    in overmind.warm.fork_safety)."""
    from overmind.shared.import_env import recording
    from overmind.warm.fork_safety import started_since, thread_ids

    name = refusal_name(spec)
    if name in refused:
        return []
    before = thread_ids()
    try:
        with recording(reads):
            why = preload(spec)
    except Exception as err:  # noqa: BLE001 - the run's call loads it plainly
        why = repr(err)
    if why:
        logger.info("not preloading %s: %s", spec["path"], why)
    else:
        logger.info("preloaded %s", spec["path"])
    if started_since(before):
        logger.warning("loading %s started a thread: this interpreter will not fork again", spec["path"])
        return [name]
    return []


