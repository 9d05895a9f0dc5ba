"""The patched ``aoti_load_package`` / ``aot_load``: a preloaded runner in a warm run, else the
plain call, which teaches the server (Note [AOTInductor packages are handed over] in
overmind.shared.calls.compiled)::

    runner = call("torch._inductor::aoti_load_package", original, args, kwargs)   # overmind.api's wrapper
"""

from __future__ import annotations

import logging
import os

from overmind.shared.calls.compiled import any_held, fingerprint, plain_value, take

logger = logging.getLogger(__name__)

__all__ = ["call"]


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
    if not isinstance(path, (str, os.PathLike)) or not all(plain_value(v) for v in arguments.values()):
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


def _teach(spec: dict, result) -> None:
    """Tell the server this context loads the package, so its warm interpreters preload it."""
    try:
        loader = getattr(result, "loader", None)
        if loader is not None and loader.get_metadata().get("AOTI_DEVICE_KEY") != "cpu":
            return
        if fingerprint(spec["path"]) is None:
            return
        from overmind.client.connection import LoadingConnection
        from overmind.shared import protocol as P
        from overmind.shared.settings.config import Config
        from overmind.shared.protocol.contexts import caller_context

        config = Config.from_env()
        with LoadingConnection.open(config) as conn:
            conn.simple(P.Prepare(caller_context(), packages=[spec]), P.Ok, timeout=config.reply_timeout)
    except Exception as err:  # noqa: BLE001 - teaching is a bonus: the caller has its runner
        logger.debug("could not report AOTInductor package %s: %s", spec.get("path"), err)


def call(point: str, original, args: tuple, kwargs: dict):
    """The patched ``aoti_load_package`` / ``aot_load`` (overmind.api's wrapper calls it): the
    preloaded runner, or the plain call (Note [AOTInductor packages are handed over])."""
    try:
        spec = _describe(point, original, args, kwargs)
        runner = take(spec) if spec is not None and any_held() else None
    except Exception as err:  # noqa: BLE001 - Note [Never worse than no cache] in overmind.api
        logger.debug("AOTInductor hand-over failed: %r", err)
        spec = runner = None
    if runner is not None:
        return runner
    result = original(*args, **kwargs)
    if spec is not None:
        _teach(spec, result)
    return result
