"""The failures fills left, remembered so that later calls of their key load plainly at once.
Server side, stdlib only.

    failures = Failures()                          # a Fills' (overmind.server.fills), under its lock
    error = failures.get(key)                      # the remembered overmind.shared.protocol.Error, or None
    failures.record(key, error, remember=True)     # a fill failed; remember: it will fail again
    failures.forget(key)                           # a fill of the key ended well

Note [Only deterministic failures are remembered]
A load whose original load function raised will raise again: it is remembered for
``FAILURE_TTL`` seconds, so later calls load plainly at once instead of paying a loader
each. So is a result that cannot be rebuilt (Note [Results that cannot be rebuilt] in
overmind.shared.segments.quirks): the same call gives the same model, and no loader runs it again while
remembered. A loader that *died* (the OOM killer, a signal, a timeout) says nothing about the
next try, so the key is tried again; only after ``MAX_DEATHS`` deaths in a row is it
remembered like a raise. At most ``MAX_FAILURES`` failures are kept (oldest dropped) with
their text cut to ``MAX_REMEMBERED_TEXT``: a client sending unique failing keys costs the
server bounded memory.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

__all__ = ["Failures", "FAILURE_TTL", "MAX_FAILURES", "MAX_DEATHS", "MAX_REMEMBERED_TEXT"]

# Failures remembered at once (Note [Only deterministic failures are remembered]).
MAX_FAILURES = 256
FAILURE_TTL = 600.0
MAX_REMEMBERED_TEXT = 16 << 10  # bytes of a failure's message and traceback kept
MAX_DEATHS = 3  # loader deaths in a row after which a key is remembered as failing like a raise


@dataclass
class _Failure:
    error: object  # overmind.shared.protocol.Error
    when: float
    deaths: int = 0  # loader deaths in a row; remembered only from MAX_DEATHS on


class Failures:
    """The last failure of each key, MAX_FAILURES keys at most, oldest dropped first. No lock of
    its own: its Fills calls it under theirs, with the admission or the end of a fill."""

    def __init__(self) -> None:
        self._failures: "OrderedDict[str, _Failure]" = OrderedDict()

    def __len__(self) -> int:
        return len(self._failures)

    def get(self, key: str) -> Optional[object]:
        """The failure remembered for ``key`` (an overmind.shared.protocol.Error), or None: none,
        one past FAILURE_TTL (forgotten now), or fewer than MAX_DEATHS loader deaths in a row."""
        failure = self._failures.get(key)
        if failure is not None and time.monotonic() - failure.when > FAILURE_TTL:
            del self._failures[key]
            failure = None
        if failure is not None and failure.deaths in (0, MAX_DEATHS):
            return failure.error
        return None

    def record(self, key: str, error, *, remember: bool) -> None:
        """A fill of ``key`` failed with ``error`` (an overmind.shared.protocol.Error): ``remember``,
        it will fail again; else its loader died, one death more in a row."""
        previous = self._failures.pop(key, None)
        deaths = 0 if remember else min(MAX_DEATHS, (previous.deaths if previous else 0) + 1)
        self._failures[key] = _Failure(_trimmed(error), time.monotonic(), deaths)
        while len(self._failures) > MAX_FAILURES:
            self._failures.popitem(last=False)

    def forget(self, key: str) -> None:
        """A fill of ``key`` ended well: the deaths before it are forgotten."""
        self._failures.pop(key, None)


def _trimmed(error):
    """A failure as remembered: its text bounded (Note [Only deterministic failures are remembered])."""
    return type(error)(error.code, error.message[:MAX_REMEMBERED_TEXT], error.traceback[-MAX_REMEMBERED_TEXT:])
