"""Joining a fill: a caller that finds its key filling waits for the fill, or loads plainly
beside it. Server side, stdlib only.

    joins = Joins(fills)                        # one per overmind.server.loads.Loads, over its Fills
    joins.plain_loaded(key, seconds)            # a caller's plain load of key took that long
    wait = joins.join(key, joins.plain_seconds_of(key), pid)   # seconds to wait; 0: load plainly
    done = joins.wait(fill, pid, wait)          # it waits, weighed again as each wait runs out

What a fill is and how far it got (its loader, its pack's reports) are its Fills'
(overmind.server.fills); this weighs them against a plain load's seconds, which it keeps.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict

from overmind.server.fills import Fill, Fills

logger = logging.getLogger("overmind.server.fills")  # the fills': a fill and who joins it read as one

__all__ = ["Joins", "MAX_RENEWALS", "JOIN_FLOOR", "LATE_REPORT", "MAX_PLAIN_SECONDS"]

MAX_RENEWALS = 2  # Note [Joining a fill]
JOIN_FLOOR = 0.1  # seconds a join waits at least: Note [Joining a fill]
LATE_REPORT = 0.25  # seconds without a progress report (one comes every 0.1 s) after which a pack's pace is its pace to now
MAX_PLAIN_SECONDS = 1024  # keys whose plain load time we remember

# Note [Joining a fill]
# A caller that finds its key filling (run 2 of a script, started while run 1's fill still
# runs) either loads plainly or waits for the fill, lending it normal priority. It waits when
# the fill should end sooner than a plain load would. A plain load's seconds: what the last
# caller that loaded plainly reported (PlainLoaded), or what the loader's own call of the
# original took if less. The first caller's figure includes the imports its load did
# (transformers imports the model's module inside from_pretrained: 1.55 s for the LM's load
# in a fresh process, 0.1-0.3 s in a loader or an `overmind run` child, which imported it
# already); a hit pays those imports too, when it unpickles, so they are no reason to wait.
# A fill whose loader runs the original is joined: the loader does what a plain load does,
# with its imports done and a head start (ControlNet run 2 loaded the VAE plainly 27 ms before
# its fill, forked 0.12 s earlier, was filed). One with no loader yet (waiting for a load slot,
# or for the fills of the models it refers to) is not: nothing says it is close; nor is one
# whose loader is a fresh interpreter (Note [A fill never waits for a fork] in
# overmind.warm.interpreter), which imports everything first.
# The loader, once it packs, reports the bytes in place and the bytes it expects every 0.1 s
# (FillProgress, Note [Progress of a pack] in overmind.warm.loader), so the fill's remaining
# seconds are the bytes left at its rate from the pack's start to its last report, less the
# time since that report (a report is up to 0.1 s old: counting the bytes it reported over
# the time to now made the LM's run 2 load plainly beside a fill that ended 0.06 s later; a
# pack whose reports stopped is timed to now). The rate is one at idle priority: lifted, it
# goes faster. A packing fill that reports nothing (small, or a result whose bytes cannot be
# counted) is joined as one still in the original. The wait is bounded by the plain load's
# seconds: past them the caller loads plainly after all, so a wrong guess costs at most one
# extra plain load's time (more only on news of the pack, below), and a fill nobody joins still
# ends within its own bounds.
# A join that runs out is weighed again, as a caller that came now would weigh it, the wait
# behind it being spent either way: if the fill has begun to pack since the wait began (ControlNet
# run 2, 2 cores: it joined the fill of a ControlNet whose loader ran the original, for the 0.08 s
# a plain load took; the pack began 52 ms into that wait, the caller gave up and the entry was
# filed 7 ms later), or if the pack, packing all along, reported how far it is (the pipeline's
# pack, 0.42 s beside run 2 against a plain load of 0.34 s: the caller gave up 51 ms before it was
# filed). It is weighed again only on news of the pack since the wait began, and at most
# MAX_RENEWALS times, so a wrong guess costs at most that many more plain loads' time.
# One exception to news: a join that runs out with the loader still in the original waits once
# more, for a plain load's time. The loader has run the call a plain load makes, its imports
# done, for that long at the caller's priority, so the call is close to its end, while giving up
# costs a whole plain load: ControlNet run 2 (users' venv, 2 cores, both rounds of a curve)
# joined the pipeline's fill as its loader was forked, for the 0.21 s a plain load took; its pack
# began 58-107 ms after the caller gave up, and it was filed 0.22 s after, when the caller's plain
# load of 1.9 GB of private memory ended. The bound stays 1 + MAX_RENEWALS plain loads' time.
# Two more, from the ControlNet runs 2 that still loaded something plainly (users' venv, 2 cores):
# - A fill that holds its load slot, its references filed, is joined as one whose loader runs
#   the original: all that is left before it does is the fork of that loader, 8-50 ms. Run 2
#   asked for the pipeline 8 ms before its loader was forked, and loaded it plainly.
# - A join waits at least JOIN_FLOOR. Below that, a fill's fixed steps (the loader's fork, its
#   answer, the filing, each a few ms to tens of ms on a busy machine) are most of its time, and
#   a tiny plain figure says nothing of how close it is: run 2 joined the VAE's fill against a
#   plain load of 0.03 s, twice, and gave up 1 ms before it was filed. A wrong guess then costs
#   at most 1 + MAX_RENEWALS times JOIN_FLOOR.
#
# A fill that writes its result into memory the kernel must hand out fresh is slow where
# fresh memory is (benchmarks/fresh_memory.py: a guest that reports free memory back to its
# host fills it at 0.4 GB/s instead of 2.4 GB/s past the last 1.5-3.5 GB freed): the ControlNet
# workload's pipeline took longer to fill than to load plainly, and runs that came sooner
# loaded it plainly. Weights that are a model file's own pages are therefore not written at
# all: the file is their segment (Note [File-backed segments] in overmind.shared.segments.memfd), and
# they are copied into sealed memory only when the server is idle (Note [Settling file
# segments] in overmind.server.settle).


class Joins:
    """Who joins which fill, for how long (Note [Joining a fill]), and a plain load's seconds per
    key to weigh that against. A fill's state is its Fills': read here under their lock."""

    def __init__(self, fills: Fills) -> None:
        self.fills = fills
        # a plain load's seconds per key, least recently told first: what a join is weighed against
        self.plain_seconds: "OrderedDict[str, float]" = OrderedDict()
        self.lock = threading.Lock()  # joined
        self.joined = 0  # callers that joined a fill

    def counters(self) -> dict:
        with self.lock:
            return {"joined": self.joined}

    # -- a plain load's seconds ---------------------------------------------------------------------

    def plain_seconds_of(self, key: str) -> float | None:
        return self.plain_seconds.get(key)

    def plain_loaded(self, key: str, seconds: float) -> None:
        """A caller's plain load of ``key`` took ``seconds`` (``PlainLoaded``)."""
        self.plain_seconds.pop(key, None)
        self.plain_seconds[key] = seconds
        while len(self.plain_seconds) > MAX_PLAIN_SECONDS:
            self.plain_seconds.popitem(last=False)

    def remember_plain_seconds(self, key: str, seconds: float) -> None:
        """A plain load's time from before a restart (overmind.server.restore), unless one is known."""
        if key not in self.plain_seconds and 0 <= seconds < 1e6:
            self.plain_seconds[key] = seconds
            while len(self.plain_seconds) > MAX_PLAIN_SECONDS:
                self.plain_seconds.popitem(last=False)

    # -- whether to join, and for how long ------------------------------------------------------------

    def remaining(self, key: str) -> tuple[float, Fill] | None:
        """(seconds the fill of ``key`` should still take at its pace so far, the fill); None
        while that cannot be told: no fill, or its loader still runs the original, or it
        reported nothing to go by."""
        with self.fills.lock:
            fill = self.fills.fills.get(key)
            if fill is None or not fill.packing_since or not fill.written:
                return None
            if fill.written >= fill.expected:  # all in place: the answer is on its way
                return 0.0, fill
            now = self.fills.clock()
            since = now - fill.reported_at
            if since > LATE_REPORT:  # its reports stopped: its pace up to now
                return (fill.expected - fill.written) * (now - fill.packing_since) / fill.written, fill
            # its pace up to its last report, and what it did since at that pace
            left = (fill.expected - fill.written) * max(fill.reported_at - fill.packing_since, 1e-3) / fill.written
            return max(left - since, 0.0), fill

    def join(self, key: str, plain: float | None, pid: int) -> float:
        """Note [Joining a fill]: how long process ``pid``, which found ``key`` filling, should wait
        for the fill rather than load plainly (``plain``: a plain load's seconds, None when none is
        known); 0: not at all."""
        if plain is None:
            return 0.0
        progress = self.remaining(key)
        if progress is None:
            with self.fills.lock:
                fill = self.fills.fills.get(key)
                running = fill is not None and (fill.warm_loader or fill.about_to_run)
                doing = ("is being forked" if running and fill.about_to_run else
                         "has begun to pack" if running and fill.packing_since else "runs the original")
            if running:  # with a head start and its imports done
                logger.info("pid %d joins the fill of %s: its loader %s, against a plain load of %.2fs", pid,
                            key[:16], doing, plain)
                return max(plain, JOIN_FLOOR)
            logger.info("pid %d loads %s plainly: its fill has %s", pid, key[:16],
                        "a fresh interpreter for loader, still importing" if fill is not None and fill.fresh
                        else "no loader yet")
            return 0.0
        left, fill = progress
        weighed = "the last plain load"
        if fill.original_seconds and fill.original_seconds < plain:  # the first caller's imports are done here too
            plain, weighed = fill.original_seconds, "the loader's call of the original"
        wait = max(plain, JOIN_FLOOR)
        joins = left <= wait
        logger.info("pid %d %s the fill of %s: %d of %d MB in place, %.2fs left against a plain load of %.2fs (%s)",
                    pid, "joins" if joins else "loads plainly beside", key[:16], fill.written >> 20,
                    fill.expected >> 20, left, plain, weighed)
        return wait if joins else 0.0

    def renew(self, fill: Fill, plain: float | None, pid: int, since: float, first: bool = True) -> float:
        """Note [Joining a fill]: how long process ``pid``, whose join of ``fill`` (waited for from
        ``since``, by the fills' clock) ran out, should wait again (``first``: no renewal yet); 0: not at all."""
        with self.fills.lock:
            began = fill.packing_since > since
            reported = fill.packing_since and fill.reported_at > since and fill.written
            original = fill.warm_loader and not fill.packing_since
        if not (began or reported):
            if first and original and plain:  # a plain load's time at normal priority: close to its end
                logger.info("pid %d waits once more for the fill of %s: its loader still runs the original",
                            pid, fill.key[:16])
                return max(plain, JOIN_FLOOR)
            return 0.0  # no news of the pack since it joined
        logger.info("pid %d weighs the fill of %s again: %s", pid, fill.key[:16],
                    "it has begun to pack" if began else "its pack reported how far it is")
        return self.join(fill.key, plain, pid)

    # -- the wait -------------------------------------------------------------------------------------

    def wait(self, fill: Fill, pid: int, join: float) -> bool:
        """Process ``pid``, which joined ``fill`` for ``join`` seconds, waits for it, lending it normal
        priority; as each wait runs out it is weighed again (``renew``), MAX_RENEWALS times at most.
        Whether the fill is done."""
        since = self.fills.clock()
        done = self._wait(fill, pid, join)
        for renewals in range(MAX_RENEWALS):  # ran out: weighed again, Note [Joining a fill]
            if done or fill.done.is_set():
                break
            renewal = self.renew(fill, self.plain_seconds.get(fill.key), pid, since, first=not renewals)
            since = self.fills.clock()
            if not renewal:
                break
            done = self._wait(fill, pid, renewal, renewed=True)
        return done or fill.done.is_set()

    def _wait(self, fill: Fill, pid: int, join: float, renewed: bool = False) -> bool:
        done = self.fills.wait(fill, pid, join)
        with self.lock:
            self.joined += not renewed
        logger.info("pid %d joined the fill of %s%s: %s", pid, fill.key[:16], " again" if renewed else "",
                    "served" if done else "gave up")
        return done
