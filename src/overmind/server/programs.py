"""What each program loaded last time, for its next run's prefetch. Stdlib only (the server's).

    history = ProgramHistory()
    history.record(program, pid, key)     # every Load that names its program
    history.last(program)                 # the keys its previous process loaded, in order

A *program* is what the client names it (``overmind.client.prefetch.program_id``: the script or
``-m`` module, the cwd and the interpreter). Note [Prefetch] in overmind.client.prefetch says what
the client does with the answer. Bounded: MAX_PROGRAMS programs (least recently seen
dropped first), MAX_KEYS keys each.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

__all__ = ["ProgramHistory", "MAX_PROGRAMS", "MAX_KEYS"]

MAX_PROGRAMS = 256
MAX_KEYS = 64


class ProgramHistory:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        # program -> (pid of the process recording now, its keys, the keys of the process before it)
        self._programs: "OrderedDict[str, tuple[int, list, list]]" = OrderedDict()

    def record(self, program: str, pid: int, key: str) -> None:
        if not program:
            return
        with self._lock:
            current_pid, keys, previous = self._programs.pop(program, (pid, [], []))
            if current_pid != pid:  # a new process of this program: the last one's list is complete
                current_pid, keys, previous = pid, [], keys
            if key not in keys and len(keys) < MAX_KEYS:
                keys.append(key)
            self._programs[program] = (current_pid, keys, previous)
            while len(self._programs) > MAX_PROGRAMS:
                self._programs.popitem(last=False)

    def last(self, program: str, pid: int) -> list[str]:
        """What ``program`` loaded in its latest process other than ``pid`` (the one asking)."""
        with self._lock:
            found = self._programs.get(program)
        if found is None:
            return []
        current_pid, keys, previous = found
        return list(previous if current_pid == pid else keys)

    def snapshot(self) -> list[list]:
        """[[program, keys of its last complete process], ...], least recently seen first: what
        overmind.server.state keeps across a restart."""
        with self._lock:
            return [[program, list(previous if not keys else keys)]
                    for program, (_, keys, previous) in self._programs.items() if keys or previous]

    def restore(self, items: list[list]) -> None:
        """What :meth:`snapshot` gave, checked by overmind.server.state: the next process of each
        program prefetches those keys (``last`` answers them to any pid)."""
        with self._lock:
            for program, keys in items:
                self._programs.pop(program, None)
                self._programs[program] = (0, list(keys[:MAX_KEYS]), [])
            while len(self._programs) > MAX_PROGRAMS:
                self._programs.popitem(last=False)
