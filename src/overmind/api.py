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
``OVERMIND_PATCH`` (extra ``module::Qualname.attr`` points); see ``overmind.config``.

Note [Never worse than no cache]
If anything on the cache path fails (no server, a timeout, a garbled reply, a result
that cannot be cached), the original loader runs in the calling process and one warning
per process says why. A call whose arguments cannot be keyed (``overmind.calls``) goes
straight to the original without a warning, and so does one whose original raised in the
loader: it most likely raises here as well, and the plain call would warn nothing. So does
one whose result cannot be rebuilt from the cache, even under ``OVERMIND_STRICT=1``: plain
python loads it fine (Note [Results that cannot be rebuilt] in overmind.quirks).
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import threading
import time
import weakref
TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (start-up budget)

from overmind import patching

if TYPE_CHECKING:  # kept out of start-up: `import overmind.api; monkey_patch_all()` costs < 50 ms
    from typing import Any, Callable, Iterable, Optional

    from overmind.calls import Target
    from overmind.config import Config

logger = logging.getLogger(__name__)

__all__ = ["load", "monkey_patch_all", "unpatch_all", "is_patched", "get_original", "OvermindError",
           "DEFAULT_PATCH_POINTS", "fetch_entry"]

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
)
CONFIG_FILE = "overmind.cfg"


class OvermindError(RuntimeError):
    """Raised instead of falling back when ``OVERMIND_STRICT=1``."""


class NotWorthCaching(Exception):
    """The call goes to the original, unfiled and without a warning: no later call could hit."""


# -- objects overmind returned: id -> (weakref, key), so they can travel as references ----------

_origins: dict[int, tuple[weakref.ref, str]] = {}


def origin_of(obj: Any) -> Optional[str]:
    item = _origins.get(id(obj))
    if item is not None and item[0]() is obj:
        return item[1]
    return None


def _remember(obj: Any, key: str) -> None:
    ident = id(obj)

    def forget(ref: weakref.ref, ident: int = ident) -> None:
        if _origins.get(ident, (None,))[0] is ref:
            del _origins[ident]

    try:
        _origins[ident] = (weakref.ref(obj, forget), key)
    except TypeError:
        pass  # dicts and lists cannot be weakly referenced; they just cannot travel as references


# -- the cache path ---------------------------------------------------------------------------

_local = threading.local()
_spare = None  # a connection the prestart thread opened, for the first load (see _prepare)
_spare_lock = threading.Lock()
_warmed = False
_warned = False
_warn_lock = threading.Lock()
# Note [A silent server is skipped for a while]
# A server that cannot be reached or does not answer within OVERMIND_REPLY_TIMEOUT costs one
# call that bound; the calls of the next SERVER_DOWN_BACKOFF seconds go straight to the
# original, so a script with many loads against a stopped server is not slowed at each one.
SERVER_DOWN_BACKOFF = 10.0
_server_down_until = 0.0


def _connection(config: "Config"):
    from overmind.client import Connection

    global _spare
    conn = getattr(_local, "conn", None)
    if conn is None or conn.config != config:
        with _spare_lock:
            conn, _spare = (_spare, None) if _spare is not None and _spare.config == config else (None, _spare)
        if conn is None:
            conn = Connection.open(config)
        _local.conn = conn
    return conn


def _drop_connection() -> None:
    conn = getattr(_local, "conn", None)
    _local.conn = None
    if conn is not None:
        conn.close()


def _warn_once(message: str) -> None:
    global _warned
    with _warn_lock:
        if _warned:
            logger.info("%s", message)
            return
        _warned = True
    import warnings

    warnings.warn(f"overmind: {message}; loading without the cache", RuntimeWarning, stacklevel=_user_stacklevel())


def _user_stacklevel() -> int:
    """The stacklevel of the first frame outside overmind: the user's load call."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] == "overmind":
        frame, level = frame.f_back, level + 1
    return level


def _add_sys_path(paths: Iterable[str]) -> None:
    for path in paths:
        if isinstance(path, str) and path not in sys.path:
            sys.path.append(path)


def _rebuild(conn, reply, skeleton: bytes, references: dict) -> Any:
    from overmind.reductions import unpack

    _add_sys_path(_meta(reply).sys_path_extra)
    mappings = conn.map_segments(reply)
    return unpack(skeleton, mappings, references=references)


def fetch_entry(key: str, holder: Optional[list] = None, _seen: Optional[dict] = None) -> Any:
    """Rebuild an existing entry by key: an entry a hit refers to (its ``vae=vae`` arguments)."""
    from overmind import protocol as P
    from overmind.client import Connection
    from overmind.config import Config

    config = Config.from_env()
    if holder is not None and holder:
        conn = holder[0]
    else:
        conn = Connection.open(config, role="loader", autostart=False)
        if holder is not None:
            holder.append(conn)
    seen = {} if _seen is None else _seen
    if key in seen:
        return seen[key]
    reply, skeleton = conn.load(P.Load(key, "", "reference", {}, lookup_only=True), b"")
    references = {k: fetch_entry(k, [conn], seen) for k in _meta(reply).references}
    obj = _rebuild(conn, reply, skeleton, references)
    seen[key] = obj
    _remember(obj, key)
    return obj


def _meta(reply):
    from overmind import protocol as P

    return P.LoadMeta.from_wire(reply.meta)


def _context() -> dict:
    from overmind.config import ENV_NAMES, ENV_PREFIXES

    env = {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIXES) or k in ENV_NAMES}
    return {"python": sys.executable, "cwd": os.getcwd(), "sys_path": list(sys.path), "env": env}


def _load_target(target: "Target", args: tuple, kwargs: dict) -> Any:
    """Note [Never worse than no cache]: every step before the original runs is guarded, and
    the original itself always runs outside the guard, so its own exceptions reach the caller
    unchanged and it never runs twice."""
    from overmind.config import Config, flag, patching_disabled

    if patching_disabled():
        return target.original(*args, **kwargs)
    from overmind import prefetch

    prefetch.loading()  # Note [Teaching the interpreter while importing] in overmind.prefetch
    description = target.name
    remember = None  # the key a plain result is filed under (a miss that the server is loading)
    meta = rng_end = None  # a hit's LoadMeta, and the generator states it leaves
    global _server_down_until
    if _server_down_until and time.monotonic() < _server_down_until and not flag("OVERMIND_STRICT"):
        return target.original(*args, **kwargs)  # Note [A silent server is skipped for a while]
    from overmind import protocol as P

    try:
        config = Config.from_env()
        from overmind.calls import Uncacheable, encode_call
        from overmind.client import CachePending

        try:
            call = encode_call(target, args, kwargs, origin_of)
        except Uncacheable as why:
            logger.debug("not caching %s: %s", target.name, why)
            call = None
        if call is not None:
            description = call.description
            try:
                obj, meta, key = _fetch(config, target, call)
                rng_end = _rng_end(meta)
                _remember(obj, key)
            except CachePending as pending:  # a miss: load here while the server caches it
                if pending.loading:
                    remember = pending.key
                elif pending.code == P.ErrorCode.LOADER_FAILED:
                    # The original raised in the loader: it most likely raises here too, and a
                    # plain call warns nothing (Note [Process-global state of a load]).
                    logger.info("the cache's loader raised for %s: %s", description, pending.reason)
                elif pending.code == P.ErrorCode.NOT_REBUILDABLE:
                    logger.debug("not caching %s: %s", description, pending.reason)
                else:
                    _warn_once(f"the cache cannot load this call ({pending.reason})")
            except NotWorthCaching as why:
                logger.debug("not caching %s: %s", description, why)
            except P.RemoteError as err:  # a caller that waited (OVERMIND_STRICT=1) gets the verdict itself
                if err.code != P.ErrorCode.NOT_REBUILDABLE:
                    raise
                logger.debug("not caching %s: %s", description, err.message)
    except Exception as err:
        _drop_connection()
        from overmind.client import ServerUnavailable

        if isinstance(err, (ServerUnavailable, TimeoutError)) and not flag("OVERMIND_STRICT"):
            _server_down_until = time.monotonic() + SERVER_DOWN_BACKOFF
        if flag("OVERMIND_STRICT"):
            raise OvermindError(f"overmind could not load {description}: {err}") from err
        if isinstance(err, P.RemoteError) and err.code == P.ErrorCode.LOADER_FAILED:
            logger.info("the cache's loader raised for %s: %s", description, err)  # as for a Pending above
        else:
            _warn_once(f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''} ({description})")
    else:
        if meta is not None:
            _as_plain_call_left_it(rng_end, meta.events)
            return obj
    started = time.monotonic()
    obj = target.original(*args, **kwargs)
    if remember is not None:
        _remember(obj, remember)
        _tell_plain_seconds(remember, time.monotonic() - started)
    return obj


def _tell_plain_seconds(key: str, seconds: float) -> None:
    """What our plain load of a filling key took: the server weighs a later caller's wait for
    the fill against it (Note [Joining a fill] in overmind.server)."""
    conn = getattr(_local, "conn", None)
    if conn is None:
        return
    from overmind import protocol as P

    try:
        conn.tell(P.PlainLoaded(key, seconds))
    except Exception as err:  # noqa: BLE001 - only a hint for the server
        logger.debug("could not tell the server our plain load's time: %s", err)
        _drop_connection()


def _fetch(config: "Config", target: "Target", call) -> tuple[Any, Any, str]:
    """(object, its LoadMeta, the key it is filed under), or CachePending."""
    from overmind import protocol as P
    from overmind.callstate import rng_digest, rng_key, seeded
    from overmind.prefetch import program_id

    request = P.Load(call.key, target.name, call.description, _context(), call.refs, modules=target.modules,
                     wait=config.cold_wait, program=program_id())
    retry = _retry_once_errors()
    attempt = 0
    while True:
        conn = _connection(config)
        try:
            reply, skeleton = conn.load(request, call.blob)
            meta = _meta(reply)
            drew = meta.rng.get("drew", []) if meta.rng else []
            if any(name not in call.rng_state for name in drew):
                # Note [Loads that draw random numbers]: plain would import that generator and draw
                # from OS entropy; the entry's draws are one such, not ours.
                raise NotWorthCaching("the load draws from a generator it imports, seeded from OS entropy")
            digest = rng_digest(call.rng_state, drew) if drew else ""
            if digest and meta.rng.get("start") != digest:
                # Note [Loads that draw random numbers]: filed for callers starting from other states.
                if request.key != call.key:
                    raise P.ProtocolError(f"the entry for {request.key[:16]} started from other generator states")
                if not seeded(drew, call.rng_state):
                    raise NotWorthCaching("the load draws from a generator seeded from OS entropy")
                request = P.Load(rng_key(call.key, digest), target.name, call.description, _context(),
                                 call.refs, modules=target.modules, wait=config.cold_wait, program=program_id())
                continue
            from overmind.client import unreadable  # Note [A hit needs the caller's read permission]
            if (denied := unreadable(meta.files, call.paths)) is not None:
                raise NotWorthCaching(f"this process cannot read {denied}")
            references = dict(call.ref_objects)
            for key in meta.references:
                if key not in references:
                    references[key] = fetch_entry(key, [conn])
            return _rebuild(conn, reply, skeleton, references), meta, request.key
        except retry as err:
            # A connection the server closed while idle, or an entry evicted between its reply and
            # our open of its segments (Note [A segment is opened by identity] in overmind.client):
            # ask again once, on a new connection.
            _drop_connection()
            attempt += 1
            if attempt == 2:
                raise
            logger.debug("retrying %s once: %s", call.description, err)


def _rng_end(meta) -> Optional[dict]:
    if not meta.rng:
        return None
    import base64

    from overmind.callstate import decode_rng

    return decode_rng(base64.b64decode(meta.rng["end"]))


def _as_plain_call_left_it(rng_end: Optional[dict], events: list) -> None:
    """After a hit: the caller's generators where the plain load would have left them, and the
    warnings and log records it would have emitted (Note [Process-global state of a load] in
    overmind.callstate). Outside the fallback guard: an ``error`` filter raises here, as in the
    plain call."""
    if rng_end:
        from overmind.callstate import set_rng_state

        set_rng_state(rng_end)
    if events:
        from overmind.replay import replay

        replay(events)


def _retry_once_errors() -> tuple:
    from overmind.client import SegmentChanged, StaleConnection

    return (SegmentChanged, StaleConnection)


def load(fn: Callable, *args, **kwargs) -> Any:
    """Call ``fn(*args, **kwargs)`` through the cache (``fn`` must be importable by name)."""
    from overmind.calls import Target, Uncacheable

    fn = patching.get_original(*_point_of(fn)) if _is_wrapper(fn) else fn
    try:
        target = Target.of(fn)
    except Uncacheable:
        return fn(*args, **kwargs)
    return _load_target(target, args, kwargs)


def _is_wrapper(fn: Callable) -> bool:
    return getattr(getattr(fn, "__func__", fn), "__overmind_point__", None) is not None


def _point_of(fn: Callable) -> tuple[str, str]:
    point = getattr(getattr(fn, "__func__", fn), "__overmind_point__")
    return point.module, point.qualname


# -- patching ---------------------------------------------------------------------------------


def _make_wrapper(point: patching.PatchPoint, original: Callable, is_classmethod: bool) -> Callable:
    global _warmed
    if not _warmed and "torch" in sys.modules and _prestart_enabled():
        # torch just became importable: overlap our torch-side imports with the script's.
        _warmed = True
        threading.Thread(target=_warm_up, daemon=True, name="overmind-warm-up").start()
    attr = point.qualname.rsplit(".", 1)[-1]
    if is_classmethod:
        @functools.wraps(original)
        def classmethod_wrapper(cls, *args, **kwargs):
            from overmind.calls import Target

            bound = original.__get__(cls, cls) if hasattr(original, "__get__") else functools.partial(original, cls)
            return _load_target(Target("class", cls, attr, bound), args, kwargs)

        classmethod_wrapper.__overmind_point__ = point  # type: ignore[attr-defined]
        return classmethod_wrapper

    @functools.wraps(original)
    def function_wrapper(*args, **kwargs):
        from overmind.calls import Target

        return _load_target(Target("module", point.module, point.qualname, original), args, kwargs)

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
    from overmind.config import prestart_enabled

    return prestart_enabled()


def monkey_patch_all(extra: Iterable[str] = ()) -> None:
    """Patch every default load point, plus ``overmind.cfg`` and ``OVERMIND_PATCH`` points.

    Idempotent; imports none of the patched libraries (see the module docstring).
    """
    from overmind.config import extra_patch_points, patching_disabled, prestart_enabled, quick_exit_enabled

    if patching_disabled():
        return
    if os.environ.get("OVERMIND_WARM_START", "").strip() == "1":
        from overmind.warm_start import hand_off_script

        hand_off_script(sys._getframe(1))  # returns only if this process should run the script itself
    caller_file = sys._getframe(1).f_globals.get("__file__")
    start = os.path.dirname(os.path.realpath(caller_file)) if caller_file else os.getcwd()
    points = [patching.PatchPoint.parse(p) for p in DEFAULT_PATCH_POINTS]
    points += _config_file_points(start)
    extra_env = extra_patch_points()
    points += patching.parse_patch_specs(extra_env) if extra_env.strip() else []
    points += [patching.PatchPoint.parse(p) for p in extra]
    patching.patch(points, _make_wrapper)
    if quick_exit_enabled():
        from overmind import teardown

        teardown.leave_quickly()  # Note [The drop-in leaves quickly]
    if prestart_enabled():
        threading.Thread(target=_prepare, daemon=True, name="overmind-prepare").start()


def _prepare() -> None:
    """Background: reach (or start) the server and have it start a loader for this context,
    overlapping the loader's start-up with the script's own imports."""
    try:
        from overmind import protocol as P
        from overmind.client import Connection
        from overmind.config import Config

        config = Config.from_env()
        conn = Connection.open(config)
        conn.simple(P.Prepare(_context()), P.Ok, timeout=config.reply_timeout)
        from overmind import prefetch  # Note [Prefetch] in overmind.prefetch

        server_pid, entries = prefetch.plan(conn)
    except Exception as err:  # the first load reports problems; this is only a head start
        logger.debug("prestart failed: %s", err)
        return
    global _spare
    with _spare_lock:
        if _spare is None:
            _spare, conn = conn, None
    if conn is not None:
        conn.close()
    prefetch.background(config, server_pid, entries)


def _warm_up() -> None:
    """Background, once torch is imported: import what the first load needs (~8 ms of it)."""
    try:
        from overmind import calls, client, reductions  # noqa: F401

        calls.library_versions()
        import xxhash  # noqa: F401
    except Exception as err:  # the first load imports them itself
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
