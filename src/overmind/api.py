"""overmind's user API: one line makes every later model load near-instant.

    import overmind.api
    overmind.api.monkey_patch_all()

    from diffusers import StableDiffusionPipeline
    pipe = StableDiffusionPipeline.from_pretrained(path)   # the 2nd time, on any process: milliseconds

or, without patching, ``overmind.api.load(UNet2DConditionModel.from_pretrained, path)``.

``monkey_patch_all()`` imports none of the libraries it patches: each patch is applied
when the user's own code imports its module. ``unpatch_all()`` restores everything.
Environment: ``OVERMIND_DISABLE=1`` (patch nothing), ``OVERMIND_STRICT=1`` (raise
instead of falling back to a plain load), ``OVERMIND_TIMEOUT`` (seconds),
``OVERMIND_PATCH`` (extra ``module::Qualname.attr`` points); see ``overmind.shared.settings.config``.

Note [Never worse than no cache]
If anything on the cache path fails (no server, a timeout, a garbled reply, a result
that cannot be cached), the original load function runs in the calling process and one warning
per process says why. If patching itself fails, ``monkey_patch_all()`` undoes it, warns
and returns: the script runs as plain python. A call whose arguments cannot be keyed
(``overmind.shared.calls.keys``) goes straight to the original without a warning, and so does
one whose original raised in the loader: it most likely raises here as well, and the plain
call would warn nothing. So does one whose result cannot be rebuilt from the cache, even
under ``OVERMIND_STRICT=1``: plain python loads it fine (Note [Results that cannot be rebuilt]
in overmind.shared.segments.quirks).
"""

from __future__ import annotations

import functools
import logging
import os
import sys
TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (start-up budget)

from overmind.shared import patching
from overmind.client.cache import OvermindError, fetch_entry  # noqa: F401  (public API)

if TYPE_CHECKING:  # kept out of start-up: `import overmind.api; monkey_patch_all()` costs < 50 ms
    from typing import Any, Callable, Iterable, Optional

logger = logging.getLogger(__name__)

__all__ = ["load", "monkey_patch_all", "unpatch_all", "is_patched", "get_original", "OvermindError",
           "DEFAULT_PATCH_POINTS", "fetch_entry", "cache_key_of", "prepare_hit_path", "rehearse_program"]

DEFAULT_PATCH_POINTS = (
    "diffusers.pipelines.pipeline_utils::DiffusionPipeline.from_pretrained",
    "diffusers.models.modeling_utils::ModelMixin.from_pretrained",
    "diffusers.schedulers.scheduling_utils::SchedulerMixin.from_pretrained",
    "diffusers.loaders.single_file::FromSingleFileMixin.from_single_file",
    "diffusers.loaders.single_file_model::FromOriginalModelMixin.from_single_file",
    "transformers.modeling_utils::PreTrainedModel.from_pretrained",
    # AutoModel*: one keyed call instead of AutoConfig in the client, then the model class.
    "transformers.models.auto.auto_factory::_BaseAutoModelClass.from_pretrained",
    "transformers.tokenization_utils_base::PreTrainedTokenizerBase.from_pretrained",
    "transformers.models.auto.processing_auto::AutoProcessor.from_pretrained",
    "transformers.models.auto.image_processing_auto::AutoImageProcessor.from_pretrained",
    "transformers.models.auto.feature_extraction_auto::AutoFeatureExtractor.from_pretrained",
    "transformers.models.auto.tokenization_auto::AutoTokenizer.from_pretrained",
    "transformers.pipelines::pipeline",
    "torch::load",
    "torch.jit::load",
    "safetensors.torch::load_file",
    # Compiled models: handed over from the warm interpreter, never cached in segments (overmind.client.compiled).
    "torch._inductor::aoti_load_package",
    "torch._export::aot_load",
)
CONFIG_FILE = "overmind.cfg"
_AOTI_POINTS = DEFAULT_PATCH_POINTS[-2:]  # overmind.shared.calls.compiled.POINTS, without importing it at start-up


def load(fn: Callable, *args, **kwargs) -> Any:
    """Call ``fn(*args, **kwargs)`` through the cache (``fn`` must be importable by name)."""
    from overmind.shared.calls.keys import Target, Uncacheable

    fn = patching.get_original(*_point_of(fn)) if _is_wrapper(fn) else fn
    try:
        target = Target.of(fn)
    except Uncacheable:
        return fn(*args, **kwargs)
    from overmind.client.cache import load_target

    return load_target(target, args, kwargs)


def _is_wrapper(fn: Callable) -> bool:
    return getattr(getattr(fn, "__func__", fn), "__overmind_point__", None) is not None


def _point_of(fn: Callable) -> tuple[str, str]:
    point = getattr(getattr(fn, "__func__", fn), "__overmind_point__")
    return point.module, point.qualname


# -- patching ---------------------------------------------------------------------------------

_warmed = False  # the warm-up thread started (_make_wrapper)


def _make_wrapper(point: patching.PatchPoint, original: Callable, is_classmethod: bool) -> Callable:
    global _warmed
    if not _warmed and "torch" in sys.modules and _prestart_enabled() and not _in_warm_run():
        # torch just became importable: overlap our torch-side imports with the script's.
        _warmed = True
        from overmind.shared.process import teardown

        teardown.start_thread(_warm_up, "overmind-warm-up")  # Note [Our threads end before the teardown]
    if str(point) in _AOTI_POINTS:  # Note [AOTInductor packages are handed over] in overmind.shared.calls.compiled
        @functools.wraps(original)
        def aoti_wrapper(*args, **kwargs):
            from overmind.client.compiled import call

            return call(str(point), original, args, kwargs)

        aoti_wrapper.__overmind_point__ = point  # type: ignore[attr-defined]
        return aoti_wrapper
    attr = point.qualname.rsplit(".", 1)[-1]
    if is_classmethod:
        @functools.wraps(original)
        def classmethod_wrapper(cls, *args, **kwargs):
            from overmind.client.cache import load_target
            from overmind.shared.calls.keys import Target

            bound = original.__get__(cls, cls) if hasattr(original, "__get__") else functools.partial(original, cls)
            return load_target(Target("class", cls, attr, bound), args, kwargs)

        classmethod_wrapper.__overmind_point__ = point  # type: ignore[attr-defined]
        return classmethod_wrapper

    @functools.wraps(original)
    def function_wrapper(*args, **kwargs):
        from overmind.client.cache import load_target
        from overmind.shared.calls.keys import Target

        return load_target(Target("module", point.module, point.qualname, original), args, kwargs)

    function_wrapper.__overmind_point__ = point  # type: ignore[attr-defined]
    return function_wrapper


def _config_file_points(start: str) -> list[patching.PatchPoint]:
    """``overmind.cfg`` beside the calling module and beside each enclosing package."""
    points: list[patching.PatchPoint] = []
    directory = start
    while True:
        candidate = os.path.join(directory, CONFIG_FILE)
        if os.path.isfile(candidate):
            try:
                with open(candidate) as f:
                    points.extend(patching.parse_patch_specs(f.read()))
            except ValueError as err:
                raise ValueError(f"{candidate}: {err}") from None
        parent = os.path.dirname(directory)
        if not os.path.exists(os.path.join(directory, "__init__.py")) or parent == directory:
            break
        directory = parent
    return points


def _prestart_enabled() -> bool:
    from overmind.shared.settings.config import prestart_enabled

    return prestart_enabled()


def monkey_patch_all(extra: Iterable[str] = ()) -> None:
    """Patch every default load point, plus ``overmind.cfg`` and ``OVERMIND_PATCH`` points.

    Idempotent; imports none of the patched libraries (see the module docstring).
    """
    from overmind.shared.settings.config import (flag, patching_disabled, prestart_enabled, quick_exit_enabled,
                                                 warm_start_enabled)

    if patching_disabled():
        return
    if warm_start_enabled() and not is_patched():
        from overmind.client.warm_start import hand_off_script

        hand_off_script(sys._getframe(1))  # returns only if this process should run the script itself
    caller_file = sys._getframe(1).f_globals.get("__file__")
    start = os.path.dirname(os.path.realpath(caller_file)) if caller_file else os.getcwd()
    points = [patching.PatchPoint.parse(p) for p in DEFAULT_PATCH_POINTS]
    points += _config_file_points(start)
    extra_env = patching.env_patch_points()
    points += patching.parse_patch_specs(extra_env) if extra_env.strip() else []
    points += [patching.PatchPoint.parse(p) for p in extra]
    try:
        patching.patch(points, _make_wrapper)
    except Exception as err:  # Note [Never worse than no cache]: a fault of ours must not stop the script
        patching.unpatch_all()  # all or nothing: no loader half patched
        if flag("OVERMIND_STRICT"):
            raise
        import warnings

        warnings.warn(f"overmind: patching the loaders failed ({type(err).__name__}: {err}); running without "
                      "the cache", RuntimeWarning, stacklevel=2)
        return
    from overmind.shared.process import teardown

    if quick_exit_enabled():
        teardown.leave_quickly()  # Note [The drop-in leaves quickly]
    if prestart_enabled():
        teardown.start_thread(_prepare, "overmind-prepare")  # Note [Our threads end before the teardown]


def _in_warm_run() -> bool:
    """Whether this is a run forked from a warm interpreter, which imported the hit path and whose
    script loads within milliseconds: the warm-up thread would only compete with the loads (Note
    [A hit imports nothing] in overmind.client.cache). Read without importing the
    protocol package: a process that has not imported it is no warm run (overmind.warm.script
    marks one before the script starts)."""
    contexts = sys.modules.get("overmind.shared.protocol.contexts")
    return contexts is not None and contexts.in_warm_run()


def _prepare() -> None:
    """Background: reach (or start) the server and have it start a warm interpreter for this
    context, overlapping the interpreter's start-up with the script's own imports."""
    try:
        from overmind.client import cache
        from overmind.client.connection import LoadingConnection
        from overmind.shared import protocol as P
        from overmind.shared.process import teardown
        from overmind.shared.settings.config import Config
        from overmind.shared.protocol.contexts import caller_context, in_warm_run
        from overmind.client import prefetch  # Note [Prefetch] in overmind.client.prefetch

        if teardown.exiting():  # the script left while we imported (`--help`): nothing to prepare for
            return
        config = Config.from_env()
        conn = LoadingConnection.open(config)
        if not in_warm_run():  # a forked run's interpreter serves its context already
            # Note [A run's interpreter imports under the run's environment] in overmind.server.pool:
            # an interpreter this starts imports under this process's environment, as the run's would.
            conn.simple(P.Prepare(caller_context(), env=dict(os.environ), program=prefetch.program_id()), P.Ok,
                        timeout=config.reply_timeout)

        server_pid, entries = prefetch.plan(conn)
    except Exception as err:  # the first load reports problems; this is only a head start
        logger.debug("prestart failed: %s", err)
        return
    cache.keep_spare(conn)
    prefetch.background(config, server_pid, entries)


def prepare_hit_path() -> None:
    """Import what a hit runs (its key, connection, rebuild and replay) and list the folders whose
    dist-infos its key names, without loading anything. Once torch is imported,
    ``monkey_patch_all()`` does this on a thread of its own; a warm interpreter does it before it
    forks (Note [A hit imports nothing] in overmind.client.cache)."""
    from overmind.shared.calls import callstate, keys, replay  # noqa: F401
    from overmind.shared.segments import reductions  # noqa: F401
    from overmind.client import connection, prefetch, rehearsal  # noqa: F401
    import xxhash  # noqa: F401

    keys.library_versions()


def rehearse_program(program: str) -> bool:
    """Rebuild and drop what ``program`` loaded in its last process, counted as no hit; whether
    nothing spoke meanwhile. A warm interpreter's child forked ahead of its run does this (Note [A
    run's child is forked ahead] in overmind.warm.children)."""
    from overmind.client.rehearsal import rehearse

    return rehearse(program)


def _warm_up() -> None:
    """Background, once torch is imported: what the first load needs (~8 ms of it)."""
    try:
        prepare_hit_path()
    except Exception as err:  # the first load does it itself
        logger.debug("warm-up failed: %s", err)


def unpatch_all() -> None:
    patching.unpatch_all()


def is_patched(point_or_obj: Any = None) -> bool:
    """True if ``point_or_obj`` (a patch point or function) is patched; without an argument, if any is."""
    if point_or_obj is None:
        return bool(patching.patched_points() or patching.pending_points())
    if isinstance(point_or_obj, str):
        point_or_obj = patching.PatchPoint.parse(point_or_obj)
    return patching.is_patched(point_or_obj)


def get_original(module: str, qualname: Optional[str] = None) -> Callable:
    """The unpatched function: ``get_original("torch", "load")`` or ``get_original("torch::load")``."""
    if qualname is None:
        point = patching.PatchPoint.parse(module)
        module, qualname = point.module, point.qualname
    return patching.get_original(module, qualname)


def cache_key_of(obj: Any) -> Optional[str]:
    """The key of the cache entry ``obj`` was rebuilt from or filed under by a patched loader in
    this process, or None: it came from no entry (a plain load the cache could not take)."""
    from overmind.client.cache import origin_of

    return origin_of(obj)
