"""Load requests: a hit, or a miss whose fill runs behind the caller. Server side, stdlib only.

    loads = Loads(config, registry, pool, history)   # one per overmind.server.daemon.Server
    loads.load(conn, request, blob, pid)      # a Load message: Entry, Pending or Error on conn
    loads.plain_loaded(message)               # a PlainLoaded message (no answer)
    loads.send_fds(conn, message)             # GetFds; loads.prefetch(conn, message, pid): Prefetch

A miss's fill is a ``Fill`` in ``loads.fills`` (overmind.server.fills: admission, priority,
joins); the warm pool forks its loader (``WarmPool.start_loader``), and the server talks to the
loader here: its references handed, its progress and its answer read.

Note [Cold loads run behind the caller]
On a miss the server starts the load in a loader process and, unless the client
asked to wait (``OVERMIND_STRICT=1`` or ``OVERMIND_COLD=wait``), answers ``Pending``
at once: the client runs the original load function itself, exactly as without overmind,
while the loader fills the cache for every later call. A first load therefore
costs about a plain load, not a plain load plus a copy into shared memory. Loads
that wait (and a caller that joins a fill: Note [Joining a fill] in overmind.server.fills)
wait for the fill instead. A failed load is remembered for ``FAILURE_TTL`` seconds
(overmind.server.fills).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import signal
import socket
import threading
import time
from collections import OrderedDict
from typing import Callable, Optional

from overmind.shared import protocol as P
from overmind.shared.settings.config import Config
from overmind.server.fills import MAX_RENEWALS, Admission, Fill, Fills
from overmind.server.pool import WarmPool, LoadFailure, context_from_wire
from overmind.server.programs import ProgramHistory
from overmind.server.registry import CacheEntry, Registry, Reply, TooLarge

logger = logging.getLogger("overmind.server.daemon")

__all__ = ["Loads", "reply_error", "check_request", "check_modules", "MAX_KEY", "MAX_TEXT", "MAX_LIST",
           "MAX_MODULES"]

MAX_KEY = 64  # keys are xxh3-128 hex digests (overmind.shared.calls.keys): 32 characters
MAX_TEXT = 1000
MAX_LIST = 256
MAX_MODULES = 20000  # module names one Prepare may teach (a big script imports ~4000)
MAX_PLAIN_SECONDS = 1024  # keys whose plain load time we remember

# Note [The loader is handed its references]
# A call may pass objects that came from the cache (``vae=vae``, ``controlnet=[a, b]``): the
# client sends their keys (``Load.refs``) and the loader must rebuild the same objects. Before
# the loader starts (and before it takes a load slot), the server waits for those entries to be
# cached (a fill still running lends it our priority: Fills.depends), then hands them
# to the loader on its job socket, each an ``Entry`` with its skeleton and the fds of its
# segments, the entries they refer to in turn included, then the content index (``Contents``,
# Note [Content index] in overmind.server.registry) and ``Ok``. So a loader never calls the server
# back: the server never waits on a loader that waits on the server, and the loader imports
# nothing of the client side (tests/unit/test_layers.py).


def reply_error(conn: socket.socket, code: int, message: str, tb: str = "") -> None:
    """An Error to a peer that may have gone already."""
    try:
        P.send_message(conn, P.Error(code, message, tb))
    except OSError:
        pass


def check_request(request: P.Load) -> None:
    """Note [Every peer is bounded] in overmind.server.daemon: LoadFailure for a Load no client of
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
    if not request.lookup_only:
        context_from_wire(request.context)


def check_modules(modules) -> list:
    """``modules`` (what a Prepare teaches), or LoadFailure for what no client of ours sends."""
    if not isinstance(modules, list) or len(modules) > MAX_MODULES or \
            not all(isinstance(m, str) and 0 < len(m) <= MAX_TEXT for m in modules):
        raise LoadFailure(P.ErrorCode.BAD_REQUEST, f"modules must be at most {MAX_MODULES} names")
    return modules


class Loads:
    """Every Load request of every connection, and the fills the misses start."""

    def __init__(self, config: Config, registry: Registry, pool: WarmPool, history: ProgramHistory) -> None:
        self.config = config
        self.registry = registry
        self.pool = pool
        self.history = history  # Note [Prefetch] in overmind.client.prefetch
        self.fills = Fills(config, registry)  # the fills in flight (overmind.server.fills)
        self.load_slots = threading.BoundedSemaphore(config.workers)
        # a plain load's seconds per key: Note [Joining a fill] in overmind.server.fills
        self.plain_seconds: "OrderedDict[str, float]" = OrderedDict()
        self._exiting = _ExitingLoaders()
        self.not_cacheable = 0  # calls told their result cannot be rebuilt: Note [Results that cannot be rebuilt]
        self.on_cached = None  # called with (request, blob, entry) once a fill is cached: overmind.server.state keeps it

    def counters(self) -> dict:
        return {**self.fills.counters(), "not_cacheable": self.not_cacheable}

    def loaders_exiting(self) -> int:
        """Loaders that answered and still rebuild their segments (``_ExitingLoaders``)."""
        return self._exiting.count

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
        """A caller's plain load of a key being filled returned, in ``message.seconds``, having
        imported ``message.modules``."""
        if isinstance(message.key, str) and len(message.key) <= MAX_KEY and 0 <= message.seconds < 1e6:
            try:
                imported = check_modules(message.modules)
            except LoadFailure:
                imported = []  # only a hint: the fill imports what it needs itself
            self.plain_seconds.pop(message.key, None)
            self.plain_seconds[message.key] = float(message.seconds)
            self.fills.caller_loaded(message.key, imported)  # Note [Cold fills wait for their caller] in overmind.server.fills
            while len(self.plain_seconds) > MAX_PLAIN_SECONDS:
                self.plain_seconds.popitem(last=False)

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
        admission = self.fills.admit(request.key, lookup_only=request.lookup_only, background=not request.wait,
                                     caller=pid)
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
        join = 0.0  # Note [Joining a fill] in overmind.server.fills
        if not (admission.started or request.wait or request.lookup_only):
            join = self.fills.join(request.key, self.plain_seconds.get(request.key), pid)
        if not (request.wait or request.lookup_only or join):
            if not admission.started:  # it loads plainly beside the fill
                self.fills.loads_plainly()
            return P.send_message(conn, P.Pending(request.key, True, ""))
        # Answer at once that we are alive and loading; the entry follows (Pending.waiting).
        P.send_message(conn, P.Pending(request.key, True, "", waiting=True))
        since = self.fills.clock()
        done = self.fills.wait(fill, pid, join)  # it lends the fill its priority
        for renewals in range(MAX_RENEWALS if join else 0):  # ran out: weighed again, Note [Joining a fill]
            if done or fill.done.is_set():
                break
            renewal = self.fills.renew(fill, self.plain_seconds.get(request.key), pid, since, first=not renewals)
            since = self.fills.clock()
            if not renewal:
                break
            done = self.fills.wait(fill, pid, renewal, renewed=True)
        done = done or fill.done.is_set()
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
            fill.entry = self._run_load(request, blob, pid, fill)
            if self.on_cached is not None:
                try:
                    self.on_cached(request, blob, fill.entry)
                except Exception:  # pragma: no cover - the entry is cached all the same
                    logger.exception("could not keep %s in the state file", request.key[:16])
        except LoadFailure as failure:
            fill.error = P.Error(failure.code, failure.message, failure.traceback)
            # Note [Only deterministic failures are remembered] in overmind.server.fills
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
            admission = self.fills.admit(key, lookup_only=True)
            if admission.fill is not None:
                with self.fills.depends(fill, key):  # it lends the fill our priority, if we have it
                    if not admission.fill.done.wait(max(deadline - time.monotonic(), 0.0)):
                        raise LoadFailure(P.ErrorCode.LOADER_TIMEOUT, f"gave up waiting for {key[:16]}, "
                                          "an entry this load refers to")
            elif admission.reply is None:  # failed, or evicted since the caller named it
                raise LoadFailure(P.ErrorCode.NOT_FOUND, f"the entry {key[:16]} this load refers to is not cached")

    def _run_load(self, request: P.Load, blob: bytes, pid: int, fill: Fill) -> CacheEntry:
        context, cwd, sys_path = context_from_wire(request.context)
        self.fills.after_caller(fill)  # Note [Cold fills wait for their caller] in overmind.server.fills
        references = self._references(request, fill)
        started = time.monotonic()
        try:
            with self.load_slots:
                self.fills.slot_taken(fill)  # Note [Joining a fill] in overmind.server.fills
                logger.info("miss %s: loading %s for pid %d", request.key[:16], request.description, pid)
                contents = self.registry.content_index()
                job, loader, fresh = self.pool.start_loader(request.key, context, cwd, sys_path, blob,
                                                            [*request.modules, *fill.caller_imported])
                self.fills.forked(fill, loader, fresh)  # Note [Cold fills yield to their caller] in overmind.server.fills
                result, skeleton, fds = self._hand_over(job, loader, fill, references, contents)
        finally:
            for _, handed in references:
                P.close_fds(handed)
        entry = None
        try:
            entry = self._file(request, result, skeleton, fds, started)
            return entry
        finally:  # the job socket is the watcher's now: it hears the loader's later word and its exit
            self._exiting.add(job, loader, self.config.loader_timeout,
                              None if entry is None else functools.partial(self.registry.add_contents, entry))

    def _file(self, request: P.Load, result: P.JobResult, skeleton: bytes, fds: list[int], started: float
              ) -> CacheEntry:
        """File the loader's answer as an entry: the registry's now."""
        # The loader sends its new segments and, after them, those of other entries that hold some
        # of its storages already (Note [Stored once by content] in overmind.shared.segments.reductions).
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

    def _hand_over(self, job: socket.socket, pid: int, fill: Fill, references: list, contents: dict
                   ) -> tuple[P.JobResult, bytes, list[int]]:
        """Hand loader ``pid`` on its ``job`` socket the entries its call refers to, (registry Reply,
        segment fds) each, and the content index ``contents`` (Note [The loader is handed its
        references]); the fds stay the caller's. Then its progress (Note [Joining a fill] in
        overmind.server.fills) until its answer: (result, skeleton, segment fds), or LoadFailure."""
        answered = False
        try:
            deadline = time.monotonic() + self.config.loader_timeout
            try:
                job.settimeout(self.config.loader_timeout)  # a loader that stops reading is killed below
                for reply, fds in references:
                    P.send_message(job, P.Entry(reply.key, os.getpid(), reply.handles, reply.nbytes, True,
                                                reply.meta.to_dict()), reply.skeleton, fds=fds)
                index = {**contents, "server_pid": os.getpid()}
                P.send_message(job, P.Contents(len(index["regions"])), json.dumps(index).encode())
                P.send_message(job, P.Ok())
                message, skeleton, fds = self.fills.answer(job, fill, deadline)
            except socket.timeout:
                _kill(pid)
                raise LoadFailure(P.ErrorCode.LOADER_TIMEOUT,
                                  f"loader pid {pid} exceeded OVERMIND_LOADER_TIMEOUT={self.config.loader_timeout:g}s "
                                  "and was killed") from None
            except (EOFError, P.ProtocolError, ConnectionResetError, BrokenPipeError) as err:
                _kill(pid)
                raise LoadFailure(P.ErrorCode.LOADER_CRASHED,
                                  f"loader pid {pid} died before answering ({err}); a crash or a kill "
                                  f"(out of memory?); see {self.config.log_path}") from None
            answered = isinstance(message, P.JobResult)  # then the job socket stays open: _run_load
        finally:
            if not answered:
                job.close()
        if isinstance(message, P.JobFailed):
            P.close_fds(fds)
            raise LoadFailure(message.code, message.message, message.traceback)
        if not isinstance(message, P.JobResult) or len(fds) != len(message.sizes) or \
                len(message.slots) != len(fds) or not all(0 <= s < message.nslots for s in message.slots):
            P.close_fds(fds)
            raise LoadFailure(P.ErrorCode.INTERNAL, f"malformed answer from loader pid {pid}")
        return message, skeleton, fds


CONTENTS_BLOB = 4 << 20  # bytes of a loader's FileContents: 8000 records of ~70 bytes, with room


class _ExitingLoaders:
    """A loader that answered may still hash the storages it left in their files (Note [Hashing
    a file's storages after the answer] in overmind.warm.loader) and rebuild its segments out of
    huge pages (Note [Huge pages for segments] in overmind.shared.segments.memfd); it counts here until it
    exits (EOF on its job socket), so a benchmark can wait for the machine to be quiet
    (``loaders_exiting`` in the status)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.count = 0

    def add(self, job: socket.socket, pid: int, timeout: float,
            contents: Optional[Callable[[list], object]] = None) -> None:
        """Watch loader ``pid``'s ``job`` socket until it exits; its ``FileContents`` go to
        ``contents`` (None: its answer was not filed, they are dropped)."""
        with self.lock:
            self.count += 1

        def wait_for_exit() -> None:
            try:
                job.settimeout(timeout)
                while True:
                    message, blob, fds = P.recv_message(job, max_blob=CONTENTS_BLOB)
                    P.close_fds(fds)
                    if isinstance(message, P.FileContents) and contents is not None:
                        contents(json.loads(blob))
            except (OSError, EOFError, P.ProtocolError, ValueError):
                pass  # exited, or said something else: nothing more is read
            finally:
                job.close()
                with self.lock:
                    self.count -= 1

        threading.Thread(target=wait_for_exit, daemon=True, name=f"overmind-loader-exit-{pid}").start()


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
