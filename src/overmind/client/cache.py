"""The client's cache path: what a patched load call does between the wrapper and the object.

    obj = load_target(Target.of(fn), args, kwargs)   # overmind.api's wrappers call this

Reads top to bottom as a warm hit runs: key the call (``overmind.shared.calls.keys``), ask the server over
this thread's connection (``overmind.client.connection``), rebuild the object over the mapped segments
(``overmind.shared.segments.reductions``), leave the process as the plain call would have (``overmind.shared.calls.callstate``,
``overmind.shared.calls.replay``), and remember which objects came from the cache so a later call can pass
them as references (``vae=vae``). Every failure falls back to the original:
Note [Never worse than no cache] in ``overmind.api``.
"""

from __future__ import annotations

import gc
import logging
import sys
import threading
import time
import weakref
TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (start-up budget)

if TYPE_CHECKING:
    from typing import Any, Iterable, Optional

    from overmind.shared.calls.keys import Target
    from overmind.shared.settings.config import Config

logger = logging.getLogger(__name__)

__all__ = ["OvermindError", "load_target", "fetch_entry", "origin_of", "keep_spare"]


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
_warned = False
_warn_lock = threading.Lock()
# Note [A hit imports nothing]
# A hit costs what the fastest hit of its entry costs, whatever else the process is doing, and
# a run forked from a warm interpreter is where that is hardest: its loads begin within
# milliseconds of the fork, and everything they touch for the first time is a page fault.
# So the warm interpreter imports the hit path and lists the folders whose dist-infos the key
# names before it forks (overmind.api.prepare_hit_path; keys.library_versions keeps each listing
# while the folder's mtime stays); a warm run starts no warm-up thread (api._in_warm_run), which
# only competed with its first loads for the GIL and the import lock (its prepare thread still
# tells the server which files it was handed: Note [Reading back a lost file] in
# overmind.client.prefetch); a replayed warning finds its module by name rather than by a pass
# over every module (replay._module_of); and the run's child was forked ahead and rehearsed its
# program's rebuilds (Note [A run's child is forked ahead] in overmind.warm.children).
# tests/integration/test_steady_hits.py times the ControlNet pattern's hits over fresh processes
# in a row; the bench's load-call scenarios show each warm scenario's slowest run beside its median.
# Note [A silent server is skipped for a while]
# A server that cannot be reached or does not answer within OVERMIND_REPLY_TIMEOUT costs one
# call that bound; the calls of the next SERVER_DOWN_BACKOFF seconds go straight to the
# original, so a script with many loads against a stopped server is not slowed at each one.
SERVER_DOWN_BACKOFF = 10.0
MAX_IMPORTED = 4096  # module names one plain load reports
_server_down_until = 0.0


def _connection(config: "Config"):
    from overmind.client.connection import LoadingConnection

    global _spare
    conn = getattr(_local, "conn", None)
    if conn is None or conn.config != config:
        with _spare_lock:
            conn, _spare = (_spare, None) if _spare is not None and _spare.config == config else (None, _spare)
        if conn is None:
            conn = LoadingConnection.open(config)
        _local.conn = conn
    return conn


def keep_spare(conn) -> None:
    """Keep ``conn`` (opened by monkey_patch_all's prestart thread) for this process's first load."""
    global _spare
    with _spare_lock:
        if _spare is None:
            _spare, conn = conn, None
    if conn is not None:
        conn.close()


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


# Note [A rebuild is not collected as it grows]
# A rebuild makes tens of thousands of container objects (a module's dicts, its parameters) in
# a few milliseconds. With the collector on, each 700 of them start a young collection and each
# tenth of those scans everything the earlier loads of the process made: a ControlNet pipeline's
# hit, after its VAE and ControlNets, spent a third of its time in one such collection. So the
# collector pauses while an entry is rebuilt (if it was on); the objects are scanned once, by the
# first young collection after it, as plain python's own slower load would have them scanned.


def _rebuild(conn, reply, skeleton: bytes, references: dict, meta) -> Any:
    """The object of an entry (``reply``, and ``meta``, its LoadMeta, read once by the caller)."""
    from overmind.shared.segments.reductions import unpack

    _add_sys_path(meta.sys_path_extra)
    mappings = conn.map_segments(reply)
    paused = gc.isenabled()  # Note [A rebuild is not collected as it grows]
    if paused:
        gc.disable()
    try:
        return unpack(skeleton, mappings, references=references)
    finally:
        if paused:
            gc.enable()


def fetch_entry(key: str, holder: Optional[list] = None, _seen: Optional[dict] = None, rehearsal: bool = False) -> Any:
    """Rebuild an existing entry by key: an entry a hit refers to (its ``vae=vae`` arguments);
    ``rehearsal``: one counted as no hit (overmind.client.rehearsal)."""
    from overmind.shared import protocol as P
    from overmind.client.connection import LoadingConnection
    from overmind.shared.settings.config import Config

    config = Config.from_env()
    if holder is not None and holder:
        conn = holder[0]
    else:
        conn = LoadingConnection.open(config, role="client", autostart=False)
        if holder is not None:
            holder.append(conn)
    seen = {} if _seen is None else _seen
    if key in seen:
        return seen[key]
    reply, skeleton = conn.load(P.Load(key, "", "reference", {}, lookup_only=True, rehearsal=rehearsal), b"")
    meta = _meta(reply)
    references = {k: fetch_entry(k, [conn], seen, rehearsal) for k in meta.references}
    obj = _rebuild(conn, reply, skeleton, references, meta)
    seen[key] = obj
    _remember(obj, key)
    return obj


def _meta(reply):
    from overmind.shared import protocol as P

    return P.LoadMeta.from_wire(reply.meta)


def load_target(target: "Target", args: tuple, kwargs: dict) -> Any:
    """Note [Never worse than no cache] in overmind.api: every step before the original runs is
    guarded, and the original itself always runs outside the guard, so its own exceptions reach
    the caller unchanged and it never runs twice."""
    from overmind.shared.settings.config import Config, flag, patching_disabled

    if patching_disabled():
        return target.original(*args, **kwargs)
    from overmind.client import prefetch

    prefetch.loading()  # Note [Teaching the interpreter while importing] in overmind.client.prefetch
    description = target.name
    remember = None  # the key a plain result is filed under (a miss that the server is loading)
    meta = rng_end = None  # a hit's LoadMeta, and the generator states it leaves
    global _server_down_until
    if _server_down_until and time.monotonic() < _server_down_until and not flag("OVERMIND_STRICT"):
        return target.original(*args, **kwargs)  # Note [A silent server is skipped for a while]
    from overmind.shared import protocol as P

    try:
        config = Config.from_env()
        from overmind.shared.calls.keys import Uncacheable, encode_call
        from overmind.client.connection import CachePending

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
        from overmind.client.connection import ServerUnavailable

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
    held = set(sys.modules) if remember is not None else None
    obj = target.original(*args, **kwargs)
    if remember is not None:
        _remember(obj, remember)
        _tell_plain_load(remember, time.monotonic() - started, [m for m in list(sys.modules) if m not in held])
    return obj


def _tell_plain_load(key: str, seconds: float, imported: list) -> None:
    """What our plain load of a filling key took: the server weighs a later caller's wait for
    the fill against it (Note [Joining a fill] in overmind.server.joins); and what it imported
    (a model's own module, say), which the fill's warm interpreter then imports before it forks
    the loader (Note [Cold fills wait for their caller])."""
    conn = getattr(_local, "conn", None)
    if conn is None:
        return
    from overmind.shared import protocol as P

    try:
        conn.tell(P.PlainLoaded(key, seconds, imported[:MAX_IMPORTED]))
    except Exception as err:  # noqa: BLE001 - only a hint for the server
        logger.debug("could not tell the server our plain load's time: %s", err)
        _drop_connection()


def _fetch(config: "Config", target: "Target", call) -> tuple[Any, Any, str]:
    """(object, its LoadMeta, the key it is filed under), or CachePending."""
    from overmind.shared import protocol as P
    from overmind.shared.calls.callstate import rng_digest, rng_key, seeded
    from overmind.shared.protocol.contexts import caller_context
    from overmind.client.prefetch import program_id

    request = P.Load(call.key, target.name, call.description, caller_context(), call.refs, modules=target.modules,
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
                request = P.Load(rng_key(call.key, digest), target.name, call.description, caller_context(),
                                 call.refs, modules=target.modules, wait=config.cold_wait, program=program_id())
                continue
            from overmind.client.connection import unreadable  # Note [A hit needs the caller's read permission]
            if (denied := unreadable(meta.files, call.paths)) is not None:
                raise NotWorthCaching(f"this process cannot read {denied}")
            references = dict(call.ref_objects)
            for key in meta.references:
                if key not in references:
                    references[key] = fetch_entry(key, [conn])
            return _rebuild(conn, reply, skeleton, references, meta), meta, request.key
        except retry as err:
            # A connection the server closed while idle, or an entry evicted between its reply and
            # our open of its segments (Note [A segment is opened by identity] in overmind.client.connection):
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

    from overmind.shared.calls.callstate import decode_rng

    return decode_rng(base64.b64decode(meta.rng["end"]))


def _as_plain_call_left_it(rng_end: Optional[dict], events: list) -> None:
    """After a hit: the caller's generators where the plain load would have left them, and the
    warnings and log records it would have emitted (Note [Process-global state of a load] in
    overmind.shared.calls.callstate). Outside the fallback guard: an ``error`` filter raises here, as in the
    plain call."""
    if rng_end:
        from overmind.shared.calls.callstate import set_rng_state

        set_rng_state(rng_end)
    if events:
        from overmind.shared.calls.replay import replay

        replay(events)


def _retry_once_errors() -> tuple:
    from overmind.client.connection import SegmentChanged, StaleConnection

    return (SegmentChanged, StaleConnection)
