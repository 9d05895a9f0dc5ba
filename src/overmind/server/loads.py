"""Load requests: a hit, or a miss whose fill runs behind the caller. Server side, stdlib only.

    loads = Loads(config, registry, pool, history)   # one per overmind.server.daemon.Server
    loads.load(conn, request, blob, pid)      # a Load message: Entry, Pending or Error on conn
    loads.plain_loaded(message)               # a PlainLoaded message (no answer)
    loads.send_fds(conn, message)             # GetFds; loads.prefetch(conn, message, pid): Prefetch

A miss's fill is a ``Fill`` in ``loads.fills`` (overmind.server.fills: admission, priority);
a caller that finds one may join it (``loads.joins``, overmind.server.joins); its loader is
forked, handed its references and heard by ``loads.loaders`` (overmind.server.loaders).

Note [Cold loads run behind the caller]
On a miss the server starts the load in a loader process and, unless the client
asked to wait (``OVERMIND_STRICT=1`` or ``OVERMIND_COLD=wait``), answers ``Pending``
at once: the client runs the original load function itself, exactly as without overmind,
while the loader fills the cache for every later call. A first load therefore
costs about a plain load, not a plain load plus a copy into shared memory. Loads
that wait (and a caller that joins a fill: Note [Joining a fill] in overmind.server.joins)
wait for the fill instead. A failed load is remembered for ``FAILURE_TTL`` seconds
(overmind.server.failures).
"""

from __future__ import annotations

import logging
import os
import socket
import threading

from overmind.shared import protocol as P
from overmind.shared.settings.config import Config
from overmind.server.fills import Admission, Fill, Fills
from overmind.server.joins import Joins
from overmind.server.loaders import Loaders
from overmind.server.pool import WarmPool, LoadFailure, context_from_wire
from overmind.server.programs import ProgramHistory
from overmind.server.registry import Registry, Reply

logger = logging.getLogger("overmind.server.daemon")

__all__ = ["Loads", "reply_error", "check_request", "check_modules", "MAX_KEY", "MAX_TEXT", "MAX_LIST",
           "MAX_MODULES"]

MAX_KEY = 64  # keys are xxh3-128 hex digests (overmind.shared.calls.keys): 32 characters
MAX_TEXT = 1000
MAX_LIST = 256
MAX_MODULES = 20000  # module names one Prepare may teach (a big script imports ~4000)


def reply_error(conn: socket.socket, code: int, message: str, tb: str = "") -> None:
    """An Error to a peer that may have gone already."""
    try:
        P.send_message(conn, P.Error(code, message, tb))
    except OSError:
        pass


def check_request(request: P.Load) -> None:
    """Note [Every peer is bounded] in overmind.server.connections: LoadFailure for a Load no client of
    ours sends (what a restore checks too: overmind.server.state)."""
    keys = [request.key, *request.refs]
    if not all(isinstance(k, str) and 0 < len(k) <= MAX_KEY and k.isalnum() and k.isascii() for k in keys):
        raise LoadFailure(P.ErrorCode.BAD_REQUEST, f"malformed key (at most {MAX_KEY} letters and digits)")
    if len(request.refs) > MAX_LIST or len(request.modules) > MAX_LIST:
        raise LoadFailure(P.ErrorCode.BAD_REQUEST, f"more than {MAX_LIST} references or modules")
    if not all(isinstance(m, str) and len(m) <= MAX_TEXT for m in request.modules):
        raise LoadFailure(P.ErrorCode.BAD_REQUEST, "modules must be names")
    if len(request.target) > MAX_TEXT or len(request.description) > MAX_TEXT:
        raise LoadFailure(P.ErrorCode.BAD_REQUEST, f"target or description over {MAX_TEXT} characters")
    if request.rehearsal is not False and not (request.rehearsal is True and request.lookup_only):
        raise LoadFailure(P.ErrorCode.BAD_REQUEST, "a rehearsal is a lookup")
    if not request.lookup_only:
        context_from_wire(request.context)


def check_modules(modules) -> list:
    """``modules`` (what a Prepare teaches), or LoadFailure for what no client of ours sends."""
    if not isinstance(modules, list) or len(modules) > MAX_MODULES or \
            not all(isinstance(m, str) and 0 < len(m) <= MAX_TEXT for m in modules):
        raise LoadFailure(P.ErrorCode.BAD_REQUEST, f"modules must be at most {MAX_MODULES} names")
    return modules


class Loads:
    """Every Load request of every connection, and the fills the misses start (their loaders:
    ``loaders``; who joins them: ``joins``)."""

    def __init__(self, config: Config, registry: Registry, pool: WarmPool, history: ProgramHistory) -> None:
        self.config = config
        self.registry = registry
        self.pool = pool  # the warm interpreters its loaders fork from (a restore's too)
        self.history = history  # Note [Prefetch] in overmind.client.prefetch
        self.fills = Fills(config, registry)  # the fills in flight (overmind.server.fills)
        self.joins = Joins(self.fills)  # with a plain load's seconds per key: Note [Joining a fill] in overmind.server.joins
        self.loaders = Loaders(config, registry, pool, self.fills)  # the fills' loaders (overmind.server.loaders)
        self.not_cacheable = 0  # calls told their result cannot be rebuilt: Note [Results that cannot be rebuilt]
        self.on_cached = None  # called with (request, blob, entry) once a fill is cached: overmind.server.state keeps it

    def counters(self) -> dict:
        return {**self.fills.counters(), **self.joins.counters(), "not_cacheable": self.not_cacheable}

    def send_fds(self, conn: socket.socket, message: P.GetFds) -> None:
        """Duplicates of an entry's segment fds, for a client that cannot open them through /proc."""
        found = self.registry.segment_fds(message.key)
        if found is None:
            return reply_error(conn, P.ErrorCode.NOT_FOUND, f"no entry {message.key[:MAX_KEY]}")
        sizes, fds = found
        try:
            P.send_message(conn, P.Fds(message.key, sizes), fds=fds)
        finally:
            P.close_fds(fds)

    def prefetch(self, conn: socket.socket, message: P.Prefetch, pid: int) -> list:
        """What this program loaded last time and is cached: Note [Prefetch] in overmind.client.prefetch.
        Returns the (dev, ino) of every segment handed out."""
        if not isinstance(message.program, str) or len(message.program) > MAX_KEY:
            reply_error(conn, P.ErrorCode.BAD_REQUEST, "malformed program")
            return []
        entries = []
        for key in self.history.last(message.program, pid):
            handles = self.registry.peek(key)
            if handles is not None:
                entries.append([key, handles])
        P.send_message(conn, P.PrefetchReply(os.getpid(), entries))
        return [(h[2], h[3]) for _, handles in entries for h in handles if h is not None]

    def plain_loaded(self, message: P.PlainLoaded) -> None:
        """A caller's plain load of a key being filled returned, in ``message.seconds``, having
        imported ``message.modules``."""
        if isinstance(message.key, str) and len(message.key) <= MAX_KEY and 0 <= message.seconds < 1e6:
            try:
                imported = check_modules(message.modules)
            except LoadFailure:
                imported = []  # only a hint: the fill imports what it needs itself
            self.joins.plain_loaded(message.key, float(message.seconds))  # Note [Joining a fill] in overmind.server.joins
            self.fills.caller_loaded(message.key, imported)  # Note [Cold fills wait for their caller] in overmind.server.fills

    @staticmethod
    def _send_entry(conn: socket.socket, reply: Reply, hit: bool) -> None:
        P.send_message(conn, P.Entry(reply.key, os.getpid(), reply.handles, reply.nbytes, hit, reply.meta.to_dict()),
                       reply.skeleton)

    def load(self, conn: socket.socket, request: P.Load, blob: bytes, pid: int) -> None:
        """Hit, or miss: see Note [Cold loads run behind the caller]."""
        try:
            check_request(request)
        except LoadFailure as failure:
            return reply_error(conn, failure.code, failure.message)
        if request.program and not request.lookup_only:
            self.history.record(request.program, pid, request.key)  # Note [Prefetch] in overmind.client.prefetch
        # Note [Cold fills yield to their caller] in overmind.server.fills
        # Note [A run's child is forked ahead] in overmind.warm.children: a rehearsal counts no hit
        admission = self.fills.admit(request.key, lookup_only=request.lookup_only, count=not request.rehearsal,
                                     background=not request.wait, caller=pid)
        if admission.reply is not None:
            return self._send_entry(conn, admission.reply, hit=True)
        if admission.busy:
            self.fills.loads_plainly()
            why = "memory is short on this machine" if self.fills.holding_back() else "the server is busy with other loads"
            return P.send_message(conn, P.Pending(request.key, False, why))
        if admission.failure is not None:
            if admission.failure.code == P.ErrorCode.NOT_REBUILDABLE:
                self.not_cacheable += 1  # Note [Results that cannot be rebuilt] in overmind.shared.segments.quirks
            if not request.lookup_only:
                self.fills.loads_plainly()
            if request.wait or request.lookup_only:
                return P.send_message(conn, admission.failure)
            return P.send_message(conn, P.Pending(request.key, False, admission.failure.message[:MAX_TEXT],
                                                  code=admission.failure.code))
        fill = admission.fill
        if fill is None:  # lookup_only and nothing there
            return reply_error(conn, P.ErrorCode.NOT_FOUND, f"no entry {request.key}")
        if admission.started:
            threading.Thread(target=self._fly, args=(fill, request, blob, pid), daemon=True,
                             name="overmind-load").start()
        join = 0.0  # Note [Joining a fill] in overmind.server.joins
        if not (admission.started or request.wait or request.lookup_only):
            join = self.joins.join(request.key, self.joins.plain_seconds_of(request.key), pid)
        if not (request.wait or request.lookup_only or join):
            if not admission.started:  # it loads plainly beside the fill
                self.fills.loads_plainly()
            return P.send_message(conn, P.Pending(request.key, True, ""))
        # Answer at once that we are alive and loading; the entry follows (Pending.waiting).
        P.send_message(conn, P.Pending(request.key, True, "", waiting=True))
        if join:  # weighed again as it runs out
            done = self.joins.wait(fill, pid, join)
        else:  # it lends the fill its priority
            done = self.fills.wait(fill, pid) or fill.done.is_set()
        if join and not done:  # slower than we thought: the caller loads plainly after all
            self.fills.loads_plainly()
            return P.send_message(conn, P.Pending(request.key, True, "the fill took longer than a plain load"))
        if not done:
            return reply_error(conn, P.ErrorCode.LOADER_TIMEOUT, f"gave up waiting for {request.key}")
        if fill.entry is None:
            assert fill.error is not None
            return P.send_message(conn, fill.error)
        reply = self.registry.hit(fill.entry, count=not admission.started)
        if reply is None:  # evicted already (budget pressure from another load): a plain load it is
            return P.send_message(conn, P.Error(P.ErrorCode.NOT_FOUND, f"{request.key} was evicted right after loading"))
        self._send_entry(conn, reply, hit=not admission.started)

    def refill(self, request: P.Load, blob: bytes) -> Admission:
        """Fill ``request`` as a miss would, with no caller: a restore after a restart
        (overmind.server.restore). Checked as a client's request is; at idle priority, counted as no
        client's miss. The admission: a hit (cached already), the fill to wait for (``started``:
        this call started it), or a failure. LoadFailure for a request no client may send."""
        check_request(request)
        if request.lookup_only:
            raise LoadFailure(P.ErrorCode.BAD_REQUEST, "a refill is a load, not a lookup")
        # Note [Cold fills yield to their caller] in overmind.server.fills
        admission = self.fills.admit(request.key, count=False, background=True, caller=0)
        if admission.started:
            threading.Thread(target=self._fly, args=(admission.fill, request, blob, 0), daemon=True,
                             name="overmind-refill").start()
        return admission

    def _fly(self, fill: Fill, request: P.Load, blob: bytes, pid: int) -> None:
        remember = False
        try:
            fill.entry = self.loaders.run(request, blob, pid, fill)
            if self.on_cached is not None:
                try:
                    self.on_cached(request, blob, fill.entry)
                except Exception:  # pragma: no cover - the entry is cached all the same
                    logger.exception("could not keep %s in the state file", request.key[:16])
        except LoadFailure as failure:
            fill.error = P.Error(failure.code, failure.message, failure.traceback)
            # Note [Only deterministic failures are remembered] in overmind.server.failures
            remember = failure.code in (P.ErrorCode.LOADER_FAILED, P.ErrorCode.TOO_LARGE, P.ErrorCode.BAD_REQUEST,
                                        P.ErrorCode.NOT_REBUILDABLE)
        except Exception as err:  # pragma: no cover - reported, never fatal
            logger.exception("load of %s failed inside the server", request.key)
            fill.error = P.Error(P.ErrorCode.INTERNAL, f"server error: {err}")
        finally:
            if fill.error is not None and fill.error.code == P.ErrorCode.NOT_REBUILDABLE:
                self.not_cacheable += 1  # not a fault: Note [Results that cannot be rebuilt] in overmind.shared.segments.quirks
                logger.info("not caching %s: %s", request.key[:16], fill.error.message[:300])
            elif fill.error is not None:
                logger.warning("load of %s failed: %s", request.key[:16], fill.error.message[:300])
            self.fills.finish(fill, remember=remember)
