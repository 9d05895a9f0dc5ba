"""A fill's loader, seen from the server: forked once its caller's load and the entries its call
refers to allow, handed those entries, heard until its answer, which is filed as the entry, and
watched until it exits. Server side, stdlib only.

    loaders = Loaders(config, registry, pool, fills)   # one per overmind.server.loads.Loads
    entry = loaders.run(request, blob, pid, fill)      # the fill's entry, or LoadFailure
    loaders.exiting()                                  # loaders that answered and still rebuild

The warm pool forks the loader (``WarmPool.start_loader``); its priority and its progress are the
fill's (overmind.server.fills).

Note [The loader is handed its references]
A call may pass objects that came from the cache (``vae=vae``, ``controlnet=[a, b]``): the
client sends their keys (``Load.refs``) and the loader must rebuild the same objects. Before
the loader starts (and before it takes a load slot), the server waits for those entries to be
cached (a fill still running lends it our priority: Fills.depends), then hands them
to the loader on its job socket, each an ``Entry`` with its skeleton and the fds of its
segments, the entries they refer to in turn included, then the content index (``Contents``,
Note [Content index] in overmind.server.registry) and ``Ok``. So a loader never calls the server
back: the server never waits on a loader that waits on the server, and the loader imports
nothing of the client side (tests/unit/test_layers.py).
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
from typing import Callable, Optional

from overmind.shared import protocol as P
from overmind.shared.settings.config import Config
from overmind.server.fills import Fill, Fills
from overmind.server.pool import WarmPool, LoadFailure, context_from_wire
from overmind.server.registry import CacheEntry, Registry, TooLarge

logger = logging.getLogger("overmind.server.daemon")  # the server's, as a load request's: its log reads as before

__all__ = ["Loaders", "MAX_REFERRED"]

MAX_REFERRED = 256  # entries one load may refer to, those they refer to included (Note [Every peer is bounded] in overmind.server.connections)


class Loaders:
    """The loaders of fills: the load slots they take (``OVERMIND_WORKERS``), each one's run from
    its fill's start to its entry, and those that answered and still rebuild their segments."""

    def __init__(self, config: Config, registry: Registry, pool: WarmPool, fills: Fills) -> None:
        self.config = config
        self.registry = registry
        self.pool = pool
        self.fills = fills  # the fills they run: overmind.server.loads.Loads's
        self.load_slots = threading.BoundedSemaphore(config.workers)
        self._exiting = _ExitingLoaders()

    def exiting(self) -> int:
        """Loaders that answered and still rebuild their segments (``_ExitingLoaders``)."""
        return self._exiting.count

    def run(self, request: P.Load, blob: bytes, pid: int, fill: Fill) -> CacheEntry:
        """Run ``fill``, the load of ``request`` for process ``pid`` (0: none), to its entry, filed in
        the registry; LoadFailure if it cannot be had."""
        context, cwd, sys_path = context_from_wire(request.context)
        self.fills.after_caller(fill)  # Note [Cold fills wait for their caller] in overmind.server.fills
        references = self._references(request, fill)
        started = time.monotonic()
        try:
            with self.load_slots:
                self.fills.slot_taken(fill)  # Note [Joining a fill] in overmind.server.joins
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
                if len(seen) > MAX_REFERRED:
                    raise LoadFailure(P.ErrorCode.BAD_REQUEST, f"more than {MAX_REFERRED} entries referred to")
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
        overmind.server.joins) until its answer: (result, skeleton, segment fds), or LoadFailure."""
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
            answered = isinstance(message, P.JobResult)  # then the job socket stays open: run
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
