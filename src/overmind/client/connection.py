"""Loading from overmind-server: the answer to a ``Load``, and the mapping of its segments.

    with LoadingConnection.open(Config.from_env()) as conn:
        reply, skeleton = conn.load(request, blob)
        mappings = conn.map_segments(reply)

Used by the cache path (``overmind.client.cache``) and prefetch; connecting, the handshake and
starting the server are ``overmind.shared.protocol.connect``'s. Every answer is bounded by
``OVERMIND_REPLY_TIMEOUT`` (2 s), so a stopped or stuck server costs a caller about that; only
a cold load the caller chose to wait for (``Pending.waiting``) waits up to ``OVERMIND_TIMEOUT``.

Note [A segment is opened by identity]
An ``Entry`` names each segment by the server's fd number, and fd numbers are reused the
moment one is closed: if the entry is evicted between the server's reply and our open of
``/proc/<server pid>/fd/<n>``, that number may already belong to another entry's segment,
of the same size when two fine-tunes share an architecture. So the reply also carries each
segment's (st_dev, st_ino), taken under the registry's lock, and every open by number is
checked against it before mapping (``Segment.check``); a mismatch raises
:class:`SegmentChanged` and the caller asks once more (by then a miss, or the new entry).
Fds received over ``SCM_RIGHTS`` are checked the same way (ARCHITECTURE.md, invariant 7: A
segment is what it claims to be).

Note [Segments across PID namespaces]
The ``Welcome`` names the server's pid as the server sees it; in a container (a Kubernetes
pod beside a per-node DaemonSet) that is often 1, and ``/proc/1/fd/<n>`` is then the
client's own init, or the client itself. So ``/proc`` is opened with the pid ``SO_PEERCRED``
reports, which the kernel translates into our namespace, and when the server is in a
namespace we cannot see (the kernel reports 0) segments come over the socket with
``SCM_RIGHTS`` from the start.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import socket
from typing import Optional

from overmind.client import prefetch
from overmind.shared.protocol import connect
from overmind.shared import protocol as P
from overmind.shared.protocol.connect import START_TIMEOUT, ServerUnavailable, StaleConnection, server_holding, start_server
from overmind.shared.segments.memfd import Segment

logger = logging.getLogger(__name__)

__all__ = ["LoadingConnection", "ServerUnavailable", "CachePending", "SegmentChanged", "StaleConnection", "start_server",
           "server_holding", "START_TIMEOUT", "unreadable"]


class SegmentChanged(Exception):
    """A segment opened by number is not the one the reply named: Note [A segment is opened by identity]."""


class CachePending(Exception):
    """A miss being loaded in the background (Note [Cold loads run behind the caller] in overmind.server.loads)."""

    def __init__(self, key: str, loading: bool, reason: str, code: int = 0) -> None:
        super().__init__(reason or f"{key} is loading in the background")
        self.key = key
        self.loading = loading
        self.reason = reason
        self.code = code  # the remembered failure's ErrorCode


class LoadingConnection(connect.Connection):
    """A connection that loads: the answer to a ``Load`` and the mapping of its segments."""

    def load(self, request: P.Load, blob: bytes) -> tuple[P.Entry, bytes]:
        """An entry, or CachePending. The answer comes within the reply bound; a request that
        waits for a cold load then waits up to ``OVERMIND_TIMEOUT`` for the entry."""
        message, skeleton, fds = self.request(request, blob)
        if isinstance(message, P.Pending) and message.waiting:
            with self.lock:
                self.sock.settimeout(self.config.timeout)
                try:
                    message, skeleton, fds = P.recv_message(self.sock, frame_timeout=self.config.timeout)
                except socket.timeout:
                    raise TimeoutError(f"the cache did not load {request.key} within "
                                       f"OVERMIND_TIMEOUT={self.config.timeout:g}s") from None
        for fd in fds:
            os.close(fd)
        if isinstance(message, P.Pending):
            raise CachePending(message.key, message.loading, message.reason, message.code)
        return P.expect(message, P.Entry, "for a load"), skeleton

    def map_segments(self, entry: P.Entry) -> list[Optional[mmap.mmap]]:
        """Map every segment of ``entry`` MAP_PRIVATE; our fds are closed once mapped.
        Each is checked to be the segment the reply named: Note [A segment is opened by identity]."""
        slots = _slot_handles(entry)
        if self.proc_pid is None:
            return self._map_received(entry, slots)
        mappings: list[Optional[mmap.mmap]] = [None] * len(slots)
        try:
            for i, slot in enumerate(slots):
                if slot is None:
                    continue
                fd, size, dev, ino = slot
                mappings[i] = prefetch.take(dev, ino, size)  # Note [Prefetch] in overmind.client.prefetch
                if mappings[i] is not None:
                    continue
                with Segment.open_proc(self.proc_pid, fd, size, f"{entry.key[:12]}.{i}", identity=(dev, ino)) as seg:
                    mappings[i] = seg.map_private()
            return mappings
        except (PermissionError, FileNotFoundError) as err:
            # /proc/<pid>/fd refused (another PID namespace, a non-dumpable server): SCM_RIGHTS.
            logger.debug("opening segments through /proc failed (%s); asking for the fds", err)
            _close_all(mappings)
            return self._map_received(entry, slots)
        except Segment.Mismatch as err:
            _close_all(mappings)
            raise SegmentChanged(f"entry {entry.key[:16]} changed while we opened it: {err}") from None
        except OSError as err:  # the number now names something that cannot be opened (a socket: ENXIO)
            _close_all(mappings)
            raise SegmentChanged(f"entry {entry.key[:16]} changed while we opened it: {err}") from None
        except BaseException:
            _close_all(mappings)
            raise

    def _map_received(self, entry: P.Entry, slots: Optional[list] = None) -> list[Optional[mmap.mmap]]:
        slots = _slot_handles(entry) if slots is None else slots
        message, _, fds = self.request(P.GetFds(entry.key))
        mappings: list[Optional[mmap.mmap]] = [None] * len(slots)
        try:
            if isinstance(message, P.Error) and message.code == P.ErrorCode.NOT_FOUND:
                raise SegmentChanged(f"entry {entry.key[:16]} was evicted before its segments reached us")
            reply = P.expect(message, P.Fds, "for segment fds")
            live = [i for i, slot in enumerate(slots) if slot is not None]
            if len(fds) != len(live) or reply.sizes != [slots[i][1] for i in live]:
                raise SegmentChanged(f"entry {entry.key[:16]} changed: expected {len(live)} segment fds, got {len(fds)}")
            for i, fd in zip(live, fds):
                _, size, dev, ino = slots[i]
                seg = Segment(fd, size, f"{entry.key[:12]}.{i}")
                seg.check(size, identity=(dev, ino))
                mappings[i] = seg.map_private()
            return mappings
        except Segment.Mismatch as err:
            _close_all(mappings)
            raise SegmentChanged(f"entry {entry.key[:16]} changed while we opened it: {err}") from None
        except BaseException:
            _close_all(mappings)
            raise
        finally:
            for fd in fds:
                try:
                    os.close(fd)
                except OSError as err:
                    if err.errno != errno.EBADF:
                        raise



def _slot_handles(entry: P.Entry) -> list:
    """The reply's ``[fd, size, st_dev, st_ino]`` per slot, validated (a garbled reply is a ProtocolError)."""
    slots = entry.segments
    for slot in slots:
        if slot is not None and not (isinstance(slot, list) and len(slot) == 4
                                     and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in slot)):
            raise P.ProtocolError(f"malformed segment handle {str(slot)[:80]} in the entry for {entry.key[:16]}")
    return slots


def _close_all(mappings: list) -> None:
    for m in mappings:
        if m is not None:
            m.close()


# Note [A hit needs the caller's read permission]
# The server checks that an entry's files are unchanged, not that this caller may read them:
# it stats them with its own credentials, and the entry may have been filled for an earlier
# caller. A hit must not hand over the bytes of a file the caller could not read itself: a
# model chmod-ed 000 after caching, a folder of a group the caller has left, a process that
# dropped CAP_DAC_OVERRIDE beside a root server. So before mapping anything, the client opens
# for reading, with its own credentials, every file the plain call would read: the entry's
# observed files (Note [Observed files] in overmind.warm.loader) and the paths its arguments name.
# Opening rather than access(2): the kernel decides as for the plain call's own open (modes,
# ACLs, capabilities, LSMs, a network filesystem's server), where access(2) judges by the
# real uid and glibc's faccessat(AT_EACCESS) fallback lets uid 0 through whatever its
# capabilities. If one open fails the hit is declined and the caller runs the original, which
# raises plain's own exception; no overmind warning, since plain raises too. Nothing is read:
# one open and close per file. A folder argument must be listable, which a plain load that only
# looks names up in it does not need: that rare caller pays a plain load, never a wrong hit.
_PROBE_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY  # a FIFO or tty must not block or attach


def unreadable(files: list, paths: list) -> Optional[str]:
    """The first of an entry's observed ``files`` (``LoadMeta.files`` records) and argument
    ``paths`` this process cannot open for reading now, or None: Note [A hit needs the
    caller's read permission]."""
    for path in [record[0] if isinstance(record, list) and record else record for record in files] + list(paths):
        if not isinstance(path, str):
            return repr(path)[:200]
        try:
            os.close(os.open(path, _PROBE_FLAGS))
        except (OSError, ValueError):  # ValueError: a NUL in the path
            return path
    return None
