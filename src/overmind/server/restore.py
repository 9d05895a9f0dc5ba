"""A fresh server gets warm again on its own: interpreters and recent entries. Stdlib only (the server's).

    restore = Restore(config, registry, loads, keeper, stopping)   # one per overmind.server.daemon.Server
    restore.start(state)          # state: overmind.server.state.StateKeeper.open()'s answer, or None
    restore.describe()            # progress, for `overmind status` and `--wait-ready`

Note [Restore after a restart]
From what the last server kept (Note [The state file] in overmind.server.state), in one background
thread: first what each context learned (the modules its interpreters import, the variables
their imports read) and what each program loaded, so the next run is warm and prefetches;
then a warm interpreter for each context used recently (most recent first, at most
``OVERMIND_WARM_MAX``), all starting at once; then the entries, most recently used first,
until their bytes reach ``OVERMIND_RESTORE`` (bytes, or a share of the memory budget; ``0``:
none), each after the entries it refers to (a ``vae=vae`` argument). A refill is a fill like a
client's miss would start (``Loads.refill``): in a loader process forked from the warm
interpreter, at idle CPU priority, through every check a client's request goes through.

Clients go first: a refill starts only when no client's fill is in flight (for at most
CLIENT_FIRST seconds), runs at SCHED_IDLE, and takes one load slot of ``OVERMIND_WORKERS`` at
a time. A client asking for an entry being refilled joins it as it would join any fill (the
last plain load time is kept too: Note [Joining a fill] in overmind.server.joins); one asking
for an entry not refilled yet loads it as a miss, and the restore then finds it cached.

Note [Never stale]
A restored entry is filed under the key its client computed, which holds the fingerprints of
the files it named (Note [What a fingerprint cannot see] in overmind.shared.calls.keys). Each refill first
checks that every file its loader read last time still has that size, mtime, inode, device and
ctime; one that changed is skipped and forgotten (a client now computes another key, and loads
the new weights as a miss). The loader's new fingerprints must equal the kept ones, else the
entry is evicted at once (a file changed during the refill). And every hit re-checks the files
anyway (Note [Observed files] in overmind.warm.loader).
"""

from __future__ import annotations

import logging
import threading
import time
from overmind.shared.settings.config import Config
from overmind.server.pool import LoadFailure, context_from_wire
from overmind.server.registry import files_unchanged

logger = logging.getLogger("overmind.server.restore")

__all__ = ["Restore", "CLIENT_FIRST"]

CLIENT_FIRST = 30.0  # seconds a refill waits at most for clients' fills to end
POLL = 0.1


class Restore:
    def __init__(self, config: Config, registry, loads, keeper, stopping: threading.Event) -> None:
        self.config = config
        self.registry = registry
        self.loads = loads  # overmind.server.loads.Loads
        self.pool = loads.pool
        self.keeper = keeper  # overmind.server.state.StateKeeper
        self.stopping = stopping
        self.lock = threading.Lock()
        self.state = "none"  # none (nothing kept), restoring, done, off (OVERMIND_RESTORE=0)
        self.started = 0.0
        self.finished = 0.0
        self.bound = 0
        self.interpreters = [0, 0]  # ready, pending
        self.entries = {"done": 0, "pending": 0, "skipped": 0, "failed": 0}
        self.bytes = {"done": 0, "pending": 0}
        self.current = ""  # the refill running now
        self.ready = threading.Event()

    # -- what `overmind status` shows ------------------------------------------------------

    def describe(self) -> dict:
        with self.lock:
            end = self.finished or time.monotonic()
            return {"state": self.state, "ready": self.ready.is_set(),
                    "seconds": round(end - self.started, 3) if self.started else 0.0, "bound": self.bound,
                    "interpreters_ready": self.interpreters[0], "interpreters_pending": self.interpreters[1],
                    **{f"entries_{k}": v for k, v in self.entries.items()},
                    **{f"bytes_{k}": v for k, v in self.bytes.items()}, "current": self.current}

    # -- the restore -----------------------------------------------------------------------

    def start(self, state) -> None:
        budget = self.registry.budget
        bound = self.config.restore_bytes if self.config.restore_bytes is not None else \
            int(budget * self.config.restore_share)
        self.bound = min(bound, budget)
        if state is None:
            self._finish("none")
            return
        if self.bound <= 0:
            logger.info("OVERMIND_RESTORE=0: not restoring the %d entries and %d contexts kept", len(state.entries),
                        len(state.contexts))
            self._teach(state)  # learning costs nothing at start: the next interpreter is warm
            self._finish("off")
            return
        self.state, self.started = "restoring", time.monotonic()
        threading.Thread(target=self._run, args=(state,), daemon=True, name="overmind-restore").start()

    def _finish(self, state: str) -> None:
        with self.lock:
            self.state = state
            self.finished = time.monotonic()
            self.current = ""
        self.ready.set()

    def _run(self, state) -> None:
        try:
            self._teach(state)
            preparing = self._prepare_interpreters(state)
            self._refill(self._choose(state))
            for thread in preparing:
                while thread.is_alive() and not self.stopping.is_set():
                    thread.join(POLL)
        except Exception:  # pragma: no cover - reported; the server serves on
            logger.exception("restore failed")
        finally:
            self._finish("done")
            info = self.describe()
            logger.info("restore done in %.1fs: %d entries (%d bytes) refilled, %d skipped, %d failed; "
                        "%d warm interpreters", info["seconds"], info["entries_done"], info["bytes_done"],
                        info["entries_skipped"], info["entries_failed"], info["interpreters_ready"])

    def _teach(self, state) -> None:
        """What each context learned and what each program loaded: Note [Restore after a restart]."""
        for context in state.contexts:
            try:
                base, _, _ = context_from_wire({"python": context["python"], "env": context["env"], "cwd": "/",
                                                "sys_path": []})
            except LoadFailure as why:
                logger.info("not restoring the context of %s: %s", context["python"], why.message)
                continue
            reads = context["reads"]
            self.pool.lessons.teach(base, context["modules"], context["refused"], reads["names"], reads["prefixes"])
            if context.get("packages"):  # preloaded by the interpreters the restore starts
                self.pool.lessons.add_packages(base, context["packages"])
        if state.programs:
            self.loads.history.restore(state.programs)
        for entry in state.entries:
            if entry["plain_seconds"] is not None:
                self.loads.joins.remember_plain_seconds(entry["request"].key, float(entry["plain_seconds"]))

    def _prepare_interpreters(self, state) -> list:
        wanted = []
        for context in state.contexts:
            try:
                base, _, _ = context_from_wire({"python": context["python"], "env": context["env"], "cwd": "/",
                                                "sys_path": []})
            except LoadFailure:
                continue
            for one in context["interpreters"] or [{"values": {}, "last_used": context["last_used"]}]:
                # What a client's run would get: overmind.server.lessons.Lessons.with_reads
                wanted.append((one["last_used"], self.pool.lessons.with_reads(base, {**context["env"], **one["values"]})))
        wanted.sort(key=lambda item: -item[0])
        contexts = list({c.key: c for _, c in wanted}.values())[:self.config.warm_max]
        with self.lock:
            self.interpreters[1] = len(contexts)
        threads = []
        for context in contexts:
            thread = threading.Thread(target=self._prepare, args=(context,), daemon=True, name="overmind-restore-warm")
            thread.start()
            threads.append(thread)
        return threads

    def _prepare(self, context) -> None:
        self.pool.prepare(context)
        with self.lock:
            self.interpreters[0] += 1
            self.interpreters[1] -= 1

    def _choose(self, state) -> list:
        """The entries to refill in order: newest first, each after what it refers to, within the bound."""
        by_key = {e["request"].key: e for e in state.entries}
        chosen: dict = {}
        total = 0

        def add(entry: dict, path: frozenset) -> bool:
            nonlocal total
            key = entry["request"].key
            if key in chosen:
                return True
            if key in path:
                return False
            for ref in entry["request"].refs:
                if ref not in by_key or not add(by_key[ref], path | {key}):
                    logger.info("not restoring %s: it refers to %s, which is not kept", key[:16], ref[:16])
                    return False
            if not files_unchanged(entry["files"]):
                self._skip(entry, "a file it read changed while the server was down")
                return False
            if total + entry["bytes"] > self.bound:
                return False
            chosen[key] = entry
            total += entry["bytes"]
            return True

        for entry in sorted(state.entries, key=lambda e: -e["last_used"]):
            if total >= self.bound:
                break
            add(entry, frozenset())
        with self.lock:
            self.entries["pending"] = len(chosen)
            self.bytes["pending"] = total
        return list(chosen.values())

    def _skip(self, entry: dict, why: str, count: bool = True) -> None:
        logger.info("not restoring %s (%s): %s", entry["request"].key[:16], entry["request"].description, why)
        self.keeper.forget(entry["request"].key)
        if count:
            with self.lock:
                self.entries["skipped"] += 1

    def _refill(self, entries: list) -> None:
        for entry in entries:
            if self.stopping.is_set():
                return
            with self.lock:
                self.current = entry["request"].description
            self._clients_first(entry["request"].key)
            outcome = self._refill_one(entry)
            with self.lock:
                self.entries["pending"] -= 1
                self.bytes["pending"] -= entry["bytes"]
                self.entries[outcome] += 1
                if outcome == "done":
                    self.bytes["done"] += entry["bytes"]

    def bring_back(self, keys: list, room_for) -> tuple[int, list]:
        """Refill the entries of ``keys`` (in that order: the most recently used first) that memory
        pressure evicted (Note [The cache gives way] in overmind.server.pressure), each only while
        ``room_for`` its bytes: (how many were refilled, the keys left for lack of room). A key the
        state does not keep (no state directory, or too old) comes back when a client loads it."""
        refilled = 0
        records = _refs_first(self.keeper.records(keys))
        for i, entry in enumerate(records):
            if self.stopping.is_set():
                return refilled, []
            if not room_for(entry["bytes"]):
                return refilled, [e["request"].key for e in records[i:]]
            self._clients_first(entry["request"].key)
            if self._refill_one(entry) == "done":
                refilled += 1
        return refilled, []

    def _clients_first(self, key: str) -> None:
        """Note [Restore after a restart]: wait while a client's fill is in flight."""
        deadline = time.monotonic() + CLIENT_FIRST
        while time.monotonic() < deadline and not self.stopping.is_set():
            if not self.loads.fills.in_flight_besides(key):
                return
            time.sleep(POLL)

    def _refill_one(self, entry: dict) -> str:
        request, started = entry["request"], time.monotonic()
        if not files_unchanged(entry["files"]):  # again: it may have changed while others refilled
            self._skip(entry, "a file it read changed", count=False)  # counted by _refill
            return "skipped"
        try:
            admission = self.loads.refill(request, entry["call"])
        except LoadFailure as failure:
            logger.warning("not restoring %s (%s): %s", request.key[:16], request.description, failure.message)
            return "failed"
        if admission.reply is not None:
            return "done"  # a client loaded it meanwhile
        if admission.fill is None:
            why = admission.failure.message if admission.failure is not None else "the server is busy"
            logger.info("not restoring %s: %s", request.key[:16], why)
            return "failed"
        while not admission.fill.done.wait(POLL):
            if self.stopping.is_set():
                return "failed"
        cached = admission.fill.entry
        if cached is None:
            return "failed"  # the fill said why in the log
        if cached.meta.files != entry["files"]:  # Note [Never stale]
            self.registry.evict([request.key])
            self._skip(entry, "a file it read changed during the refill", count=False)
            return "skipped"
        # It keeps its place among the others: least recently used is evicted first, and the next
        # restore goes newest first again (overmind.server.state keeps what the registry says).
        cached.last_used = min(cached.last_used, entry["last_used"])
        logger.info("restored %s (%s): %d bytes in %.2fs", request.key[:16], request.description, entry["bytes"],
                    time.monotonic() - started)
        return "done"


def _refs_first(records: list) -> list:
    """``records`` in their order, each after those of the entries it refers to (a pipeline's
    ``vae=vae``): its refill hands its loader those entries (Note [The loader is handed its
    references] in overmind.server.loaders)."""
    by_key = {r["request"].key: r for r in records}
    ordered: dict = {}

    def add(record: dict, path: frozenset) -> None:
        key = record["request"].key
        if key in ordered or key in path:
            return
        for ref in record["request"].refs:
            if ref in by_key:
                add(by_key[ref], path | {key})
        ordered[key] = record

    for record in records:
        add(record, frozenset())
    return list(ordered.values())
