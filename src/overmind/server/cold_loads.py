"""Load requests: a hit, or a miss whose fill runs behind the caller. Server side, stdlib only.

    loads = ColdLoads(config, registry, pool, history)   # one per overmind.server.daemon.Server
    loads.load(conn, request, blob, pid)      # a Load message: Entry, Pending or Error on conn
    loads.plain_loaded(message)               # a PlainLoaded message (no answer)
    loads.send_fds(conn, message)             # GetFds; loads.prefetch(conn, message, pid): Prefetch

Note [Cold loads run behind the caller]
On a miss the server starts the load in a loader process and, unless the client
asked to wait (``OVERMIND_STRICT=1`` or ``OVERMIND_COLD=wait``), answers ``Pending``
at once: the client runs the original loader itself, exactly as without overmind,
while the loader fills the cache for every later call. A first load therefore
costs about a plain load, not a plain load plus a copy into shared memory. Loads
that wait (and a caller that joins a fill: Note [Joining a fill]) wait for the
flight instead. A failed load is remembered for ``FAILURE_TTL`` seconds.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import OrderedDict

from overmind.shared import protocol as P
from overmind.shared.config import Config
from overmind.server.fill_priority import Fill
from overmind.server.pool import WarmPool, LoadFailure, context_from_wire
from overmind.server.programs import ProgramHistory
from overmind.server.registry import Admission, CacheEntry, Flight, Registry, Reply, TooLarge

logger = logging.getLogger("overmind.server.daemon")

__all__ = ["ColdLoads", "reply_error", "MAX_KEY", "MAX_TEXT", "MAX_LIST", "MAX_MODULES"]

MAX_KEY = 64  # keys are xxh3-128 hex digests (overmind.shared.calls): 32 characters
MAX_TEXT = 1000
MAX_LIST = 256
MAX_MODULES = 20000  # module names one Prepare may teach (a big script imports ~4000)
MAX_PLAIN_SECONDS = 1024  # keys whose plain load time we remember

# Note [The loader is handed its references]
# A call may pass objects that came from the cache (``vae=vae``, ``controlnet=[a, b]``): the
# client sends their keys (``Load.refs``) and the loader must rebuild the same objects. Before
# the loader starts (and before it takes a load slot), the server waits for those entries to be
# cached (a fill still running lends it our priority: FillPriorities.depends), then hands them
# to the loader on its job socket, each an ``Entry`` with its skeleton and the fds of its
# segments, the entries they refer to in turn included, then the content index (``Contents``,
# Note [Content index] in overmind.server.registry) and ``Ok``. So a loader never calls the server
# back: the server never waits on a loader that waits on the server, and the loader imports
# nothing of the client side (tests/unit/test_layers.py).

# Note [Joining a fill]
# A caller that finds its key filling (run 2 of a script, started while run 1's fill still
# runs) either loads plainly or waits for the fill, lending it normal priority. It waits when
# the fill should end sooner than a plain load would. A plain load's seconds: what the last
# caller that loaded plainly reported (PlainLoaded), or what the loader's own call of the
# original took if less. The first caller's figure includes the imports its load did
# (transformers imports the model's module inside from_pretrained: 1.55 s for the LM's load
# in a fresh process, 0.1-0.3 s in a loader or an `overmind run` child, which imported it
# already); a hit pays those imports too, when it unpickles, so they are no reason to wait.
# The loader, once it packs, reports the bytes in place and the bytes it expects every 0.1 s
# (FillProgress, Note [Progress of a pack] in overmind.warm.loader), so the fill's remaining
# seconds are the bytes left at its rate since the pack began (a rate at idle priority:
# lifted, it goes faster). A fill still running the original, or one that
# reports nothing (small, or a result whose bytes cannot be counted), is not joined: nothing
# says it is close. The wait is bounded by the plain load's seconds: past them the caller loads
# plainly after all, so a wrong guess costs at most one extra plain load's time, and a fill
# nobody joins still ends within its own bounds.
#
# A fill that writes its result into memory the kernel must hand out fresh is slow where
# fresh memory is (benchmarks/fresh_memory.py: a guest that reports free memory back to its
# host fills it at 0.4 GB/s instead of 2.4 GB/s past the last 1.5-3.5 GB freed): the ControlNet
# workload's pipeline took longer to fill than to load plainly, and runs that came sooner
# loaded it plainly. Weights that are a model file's own pages are therefore not written at
# all: the file is their segment (Note [File-backed segments] in overmind.shared.memfd), and
# they are copied into sealed memory only when the server is idle (Note [Settling file
# segments] in overmind.server.settle).


def reply_error(conn: socket.socket, code: int, message: str, tb: str = "") -> None:
    """An Error to a peer that may have gone already."""
    try:
        P.send_message(conn, P.Error(code, message, tb))
    except OSError:
        pass


class ColdLoads:
    """Every Load request of every connection, and the fills the misses start."""

    def __init__(self, config: Config, registry: Registry, pool: WarmPool, history: ProgramHistory) -> None:
        self.config = config
        self.registry = registry
        self.pool = pool
        self.history = history  # Note [Prefetch] in overmind.client.prefetch
        self.load_slots = threading.BoundedSemaphore(config.workers)
        self.plain_seconds: "OrderedDict[str, float]" = OrderedDict()  # Note [Joining a fill]
        self.joined = 0
        self.not_cacheable = 0  # calls told their result cannot be rebuilt: Note [Results that cannot be rebuilt]
        self.on_cached = None  # called with (request, blob, entry) once a fill is cached: overmind.server.state keeps it

    def counters(self) -> dict:
        return {"joined": self.joined, "not_cacheable": self.not_cacheable}

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

    def plain_seconds_of(self, key: str) -> float | None:
        return self.plain_seconds.get(key)

    def remember_plain_seconds(self, key: str, seconds: float) -> None:
        """A plain load's time from before a restart (overmind.server.restore), unless one is known."""
        if key not in self.plain_seconds and 0 <= seconds < 1e6:
            self.plain_seconds[key] = seconds
            while len(self.plain_seconds) > MAX_PLAIN_SECONDS:
                self.plain_seconds.popitem(last=False)

    def plain_loaded(self, message: P.PlainLoaded) -> None:
        """A caller's plain load of a key being filled returned, in ``message.seconds``."""
        if isinstance(message.key, str) and len(message.key) <= MAX_KEY and 0 <= message.seconds < 1e6:
            self.plain_seconds.pop(message.key, None)
            self.plain_seconds[message.key] = float(message.seconds)
            self.pool.caller_loaded(message.key)  # Note [Cold fills wait for their caller]
            while len(self.plain_seconds) > MAX_PLAIN_SECONDS:
                self.plain_seconds.popitem(last=False)


    @staticmethod
    def _send_entry(conn: socket.socket, reply: Reply, hit: bool) -> None:
        P.send_message(conn, P.Entry(reply.key, os.getpid(), reply.handles, reply.nbytes, hit, reply.meta.to_dict()),
                       reply.skeleton)

    @staticmethod
    def check_request(request: P.Load) -> None:
        """LoadFailure for a Load no client of ours sends (what a restore checks: overmind.server.state)."""
        ColdLoads._check_load(request)

    @staticmethod
    def _check_load(request: P.Load) -> None:
        """Note [Every peer is bounded] in overmind.server.daemon: refuse what no client of ours sends."""
        keys = [request.key, *request.refs]
        if not all(isinstance(k, str) and 0 < len(k) <= MAX_KEY and k.isalnum() and k.isascii() for k in keys):
            raise LoadFailure(P.ErrorCode.BAD_REQUEST, f"malformed key (at most {MAX_KEY} letters and digits)")
        if len(request.refs) > MAX_LIST or len(request.modules) > MAX_LIST:
            raise LoadFailure(P.ErrorCode.BAD_REQUEST, f"more than {MAX_LIST} references or modules")
        if not all(isinstance(m, str) and len(m) <= MAX_TEXT for m in request.modules):
            raise LoadFailure(P.ErrorCode.BAD_REQUEST, "modules must be names")
        if len(request.target) > MAX_TEXT or len(request.description) > MAX_TEXT:
            raise LoadFailure(P.ErrorCode.BAD_REQUEST, f"target or description over {MAX_TEXT} characters")
        if not request.lookup_only:
            context_from_wire(request.context)

    @staticmethod
    def check_modules(modules) -> list:
        if not isinstance(modules, list) or len(modules) > MAX_MODULES or \
                not all(isinstance(m, str) and 0 < len(m) <= MAX_TEXT for m in modules):
            raise LoadFailure(P.ErrorCode.BAD_REQUEST, f"modules must be at most {MAX_MODULES} names")
        return modules

    def _joins(self, request: P.Load, pid: int) -> float:
        """Note [Joining a fill]: how long a caller that found ``request.key`` filling should
        wait for it rather than load plainly; 0: not at all."""
        plain = self.plain_seconds.get(request.key)
        if request.wait or request.lookup_only or plain is None:
            return 0.0
        progress = self.pool.fill_remaining(request.key)
        if progress is None:
            logger.info("pid %d loads %s plainly: its fill has not begun to pack", pid, request.key[:16])
            return 0.0
        left, fill = progress
        if fill.original_seconds:  # the imports the first caller's load did are done here too
            plain = min(plain, fill.original_seconds)
        joins = left <= plain
        logger.info("pid %d %s the fill of %s: %d of %d MB in place, %.2fs left against a plain load of %.2fs",
                    pid, "joins" if joins else "loads plainly beside", request.key[:16], fill.written >> 20,
                    fill.expected >> 20, left, plain)
        return plain if joins else 0.0

    def load(self, conn: socket.socket, request: P.Load, blob: bytes, pid: int) -> None:
        """Hit, or miss: see Note [Cold loads run behind the caller]."""
        try:
            self._check_load(request)
        except LoadFailure as failure:
            return reply_error(conn, failure.code, failure.message)
        if request.program and not request.lookup_only:
            self.history.record(request.program, pid, request.key)  # Note [Prefetch] in overmind.client.prefetch
        admission = self.registry.begin(request.key, lookup_only=request.lookup_only)
        if admission.reply is not None:
            return self._send_entry(conn, admission.reply, hit=True)
        if admission.busy:
            return P.send_message(conn, P.Pending(request.key, False, "the server is busy with other loads"))
        if admission.failure is not None:
            if admission.failure.code == P.ErrorCode.NOT_REBUILDABLE:
                self.not_cacheable += 1  # Note [Results that cannot be rebuilt] in overmind.shared.quirks
            if request.wait or request.lookup_only:
                return P.send_message(conn, admission.failure)
            return P.send_message(conn, P.Pending(request.key, False, admission.failure.message[:MAX_TEXT],
                                                  code=admission.failure.code))
        flight = admission.flight
        if flight is None:  # lookup_only and nothing there
            return reply_error(conn, P.ErrorCode.NOT_FOUND, f"no entry {request.key}")
        if admission.started:
            # Note [Cold fills yield to their caller] in overmind.server.fill_priority
            fill = self.pool.begin_fill(request.key, background=not request.wait, caller=pid)
            threading.Thread(target=self._fly, args=(flight, request, blob, pid, fill), daemon=True,
                             name="overmind-load").start()
        join = 0.0 if admission.started else self._joins(request, pid)
        if not (request.wait or request.lookup_only or join):
            return P.send_message(conn, P.Pending(request.key, True, ""))
        # Answer at once that we are alive and loading; the entry follows (Pending.waiting).
        P.send_message(conn, P.Pending(request.key, True, "", waiting=True))
        with self.pool.lend_to_fill(request.key, pid):  # it lends the fill its priority
            done = flight.done.wait(join or self.config.loader_timeout + 60)
        if join:
            self.joined += 1
            logger.info("pid %d joined the fill of %s: %s", pid, request.key[:16], "served" if done else "gave up")
            if not done:  # slower than we thought: the caller loads plainly after all
                return P.send_message(conn, P.Pending(request.key, True, "the fill took longer than a plain load"))
        if not done:
            return reply_error(conn, P.ErrorCode.LOADER_TIMEOUT, f"gave up waiting for {request.key}")
        if flight.entry is None:
            assert flight.error is not None
            return P.send_message(conn, flight.error)
        reply = self.registry.served_by_flight(flight, count=not admission.started)
        if reply is None:  # evicted already (budget pressure from another load): a plain load it is
            return P.send_message(conn, P.Error(P.ErrorCode.NOT_FOUND, f"{request.key} was evicted right after loading"))
        self._send_entry(conn, reply, hit=not admission.started)

    def refill(self, request: P.Load, blob: bytes) -> "Admission":
        """Fill ``request`` as a miss would, with no caller: a restore after a restart
        (overmind.server.restore). Checked as a client's request is; at idle priority, counted as no
        client's miss. The admission: a hit (cached already), the flight to wait for (``started``:
        this call started it), or a failure. LoadFailure for a request no client may send."""
        self._check_load(request)
        if request.lookup_only:
            raise LoadFailure(P.ErrorCode.BAD_REQUEST, "a refill is a load, not a lookup")
        admission = self.registry.begin(request.key, count=False)
        if admission.started:
            fill = self.pool.begin_fill(request.key, background=True, caller=0)  # Note [Cold fills yield to their caller]
            threading.Thread(target=self._fly, args=(admission.flight, request, blob, 0, fill), daemon=True,
                             name="overmind-refill").start()
        return admission

    def _fly(self, flight: Flight, request: P.Load, blob: bytes, pid: int, fill: Fill) -> None:
        remember = False
        try:
            flight.entry = self._run_load(request, blob, pid, fill)
            if self.on_cached is not None:
                try:
                    self.on_cached(request, blob, flight.entry)
                except Exception:  # pragma: no cover - the entry is cached all the same
                    logger.exception("could not keep %s in the state file", request.key[:16])
        except LoadFailure as failure:
            flight.error = P.Error(failure.code, failure.message, failure.traceback)
            # Note [Only deterministic failures are remembered] in overmind.server.registry
            remember = failure.code in (P.ErrorCode.LOADER_FAILED, P.ErrorCode.TOO_LARGE, P.ErrorCode.BAD_REQUEST,
                                        P.ErrorCode.NOT_REBUILDABLE)
        except Exception as err:  # pragma: no cover - reported, never fatal
            logger.exception("load of %s failed inside the server", request.key)
            flight.error = P.Error(P.ErrorCode.INTERNAL, f"server error: {err}")
        finally:
            self.pool.end_fill(fill)
            if flight.error is not None and flight.error.code == P.ErrorCode.NOT_REBUILDABLE:
                self.not_cacheable += 1  # not a fault: Note [Results that cannot be rebuilt] in overmind.shared.quirks
                logger.info("not caching %s: %s", request.key[:16], flight.error.message[:300])
            elif flight.error is not None:
                logger.warning("load of %s failed: %s", request.key[:16], flight.error.message[:300])
            self.registry.finish(request.key, flight, remember=remember)

    def _references(self, request: P.Load, fill: Fill) -> list:
        """Note [The loader is handed its references]: (Reply, segment fds) of every entry the
        call refers to, and of those they refer to; waits for those still filling."""
        handed: list = []
        try:
            pending, seen = list(request.refs), set()
            deadline = time.monotonic() + self.config.loader_timeout
            while pending:
                key = pending.pop(0)
                if key in seen:
                    continue
                seen.add(key)
                if len(seen) > MAX_LIST:
                    raise LoadFailure(P.ErrorCode.BAD_REQUEST, f"more than {MAX_LIST} entries referred to")
                reply, fds = self._reference(key, fill, deadline)
                handed.append((reply, fds))
                pending += reply.meta.references
            return handed
        except BaseException:
            for _, fds in handed:
                P.close_fds(fds)
            raise

    def _reference(self, key: str, fill: Fill, deadline: float) -> tuple:
        while True:
            found = self.registry.pinned(key)
            if found is not None:
                return found
            admission = self.registry.begin(key, lookup_only=True)
            if admission.flight is not None:
                with self.pool.fill_depends(fill, key):  # it lends the fill our priority, if we have it
                    if not admission.flight.done.wait(max(deadline - time.monotonic(), 0.0)):
                        raise LoadFailure(P.ErrorCode.LOADER_TIMEOUT, f"gave up waiting for {key[:16]}, "
                                          "an entry this load refers to")
            elif admission.reply is None:  # failed, or evicted since the caller named it
                raise LoadFailure(P.ErrorCode.NOT_FOUND, f"the entry {key[:16]} this load refers to is not cached")

    def _run_load(self, request: P.Load, blob: bytes, pid: int, fill: Fill) -> CacheEntry:
        context, cwd, sys_path = context_from_wire(request.context)
        self.pool.after_caller(fill)  # Note [Cold fills wait for their caller] in overmind.server.fill_priority
        references = self._references(request, fill)
        started = time.monotonic()
        try:
            with self.load_slots:
                logger.info("miss %s: loading %s for pid %d", request.key[:16], request.description, pid)
                result, skeleton, fds = self.pool.load(request.key, context, cwd, sys_path, blob, request.modules,
                                                         fill=fill, references=references,
                                                         contents=self.registry.content_index())
        finally:
            for _, handed in references:
                P.close_fds(handed)
        # The loader sends its new segments and, after them, those of other entries that hold some
        # of its storages already (Note [Stored once by content] in overmind.shared.reductions).
        slots: list = [None] * result.nslots
        for fd, size, slot in zip(fds, result.sizes, result.slots):
            slots[slot] = [fd, size]
        try:
            meta = P.LoadMeta.from_wire(result.meta)
        except P.ProtocolError as err:
            for slot in slots:
                if slot is not None:
                    os.close(slot[0])
            raise LoadFailure(P.ErrorCode.INTERNAL, f"loader sent malformed metadata: {err}") from None
        meta.load_seconds = time.monotonic() - started
        contents, meta.contents = meta.contents, []  # kept by the registry, not sent to every client
        entry = CacheEntry(request.key, request.target, request.description, skeleton, slots, result.nbytes,
                           list(result.refs), meta, contents=contents)
        try:
            evicted = self.registry.add(entry)
        except TooLarge as err:
            entry.close()
            logger.warning("not keeping %s (%s): %s; raise --max-memory to cache it", request.key[:16],
                           request.description, err)
            raise LoadFailure(P.ErrorCode.TOO_LARGE, f"not cached: {err}") from None
        for key in evicted:
            logger.info("evicted %s to stay within the %d-byte budget", key[:16], self.registry.budget)
        logger.info("cached %s: %d bytes in %.2fs", request.key[:16], result.nbytes, time.monotonic() - started)
        return entry
