"""The OOM killer picks the cache first; a run's child gets its caller's score back.

    cache_first()                          # a warm interpreter, as it starts: its loaders inherit it
    with as_caller(spec.oom_score_adj):    # around the fork of a run's child
        pid = fork()

Note [The cache dies first]
When the kernel must kill, a warm interpreter or a loader is the cheapest loss on the machine:
the server starts another, and a user's job is never worth less. So each warm interpreter sets
its own ``oom_score_adj`` to CACHE_OOM_SCORE_ADJ as it starts, and every loader it forks
inherits it. A run's child is the user's process (ARCHITECTURE.md, invariant 8: Never stale
code): it must have the caller's score, not ours. An unprivileged process may lower its score
only down to the lowest a privileged one set for it, so the interpreter lowers its own score to
the caller's *before* the fork, where a refusal can still send the run to plain python
(``CannotMatch``), and raises it again after; the child never runs with ours.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator, Optional

logger = logging.getLogger(__name__)

__all__ = ["CACHE_OOM_SCORE_ADJ", "CannotMatch", "as_caller", "cache_first", "own_score", "take_score"]

CACHE_OOM_SCORE_ADJ = 1000
_PATH = "/proc/self/oom_score_adj"


class CannotMatch(Exception):
    """The caller's score is lower than this process may set."""


def own_score() -> Optional[int]:
    try:
        with open(_PATH) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def _set(value: int) -> None:
    with open(_PATH, "w") as f:
        f.write(str(value))


def take_score(score: int) -> None:
    """This process at ``score`` for good (a run's child forked ahead: Note [A run's child is forked
    ahead] in overmind.warm.children), or CannotMatch."""
    if score != own_score():
        _take(score)


def _take(score: int) -> None:
    try:
        _set(score)
    except OSError as err:
        raise CannotMatch(f"cannot give the run its caller's oom_score_adj {score} ({err.strerror}): "
                          "a warm child would be the OOM killer's first pick") from None


def cache_first() -> None:
    """Note [The cache dies first]: this process and what it forks go first (best effort)."""
    try:
        _set(CACHE_OOM_SCORE_ADJ)
    except OSError as err:
        logger.info("cannot raise this warm interpreter's oom_score_adj: %s", err)


@contextlib.contextmanager
def as_caller(score: Optional[int]) -> Iterator[None]:
    """Hold this process at ``score`` (the caller's; None: unknown, left alone) while the body forks."""
    own = own_score()
    if score is None or own is None or score == own:
        yield
        return
    _take(score)
    try:
        yield
    finally:
        try:
            _set(own)
        except OSError:  # raising a score is never refused; if it is, the interpreter stays at the caller's
            logger.warning("cannot restore this warm interpreter's oom_score_adj to %d", own)
