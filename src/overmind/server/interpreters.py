"""The warm interpreters the server keeps, by context key: which one serves a context, what a new
one imports under, each filed under its own values of what its imports read, bounded in count,
and retired. Server side, standard library only.

    interpreters = Interpreters(config, lessons)       # the pool's (overmind.server.pool.WarmPool)
    interpreter = interpreters.get(context, env=env)   # the one that serves context, started if need be
    interpreters.rekey(lineage)                        # each filed under its own values
    interpreters.retire(interpreter, "idle")           # it forks nothing more, exits after its children
    interpreters.live()                                # least recently used first

Each is a ``WarmProcess`` (overmind.server.warm_process). What they are asked for (a loader, a run,
modules to learn) and when they retire (idle, memory, a notice) is the pool's.

Note [One interpreter per lineage]
A load or a Prepare names its context as the client sent it, without the values of what the
imports read; the lineage's interpreter may be filed under the key of its own values
(``rekey``). Such a client is served by the lineage's most recently used interpreter, not by a
second one that would import the same thousands of modules again (seconds of CPU, as much
memory again); a loader keeps only what selects the context (overmind.warm.loader), so which
one it forks from does not change a fill. An interpreter started without a whole environment
(by a load, after its predecessor retired; by a Prepare that got there before its
predecessor's successor) imports under the last one a run or a client of the lineage gave
(``overmind run``, ``monkey_patch_all()``, a first run's report). Under only the context's, it
would not see the shell's other settings its imports read (CI, COLUMNS, a library's own), be
filed under a key no run of that shell has, and the next runs would go plain while yet
another interpreter imported (seen once in CI: runs 2 and 3 of a curve plain).
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections import OrderedDict

from overmind.shared.settings.config import Config
from overmind.shared.protocol.contexts import Context
from overmind.server.lessons import Lessons
from overmind.server.warm_process import WarmProcess

logger = logging.getLogger("overmind.server.pool")  # the pool's: its log reads as before

__all__ = ["Interpreters", "MAX_CANNOT_FORK", "MAX_ENVIRONMENTS"]

MAX_CANNOT_FORK = 3  # interpreters of a lineage retired in a row as unable to fork, before its runs go plain
MAX_ENVIRONMENTS = 64  # lineages whose last environment given is kept (Note [One interpreter per lineage])


class Interpreters:
    """The warm interpreters by key, least recently used first; the last whole environment each
    lineage gave; and how many of each lineage's were retired in a row as unable to fork."""

    def __init__(self, config: Config, lessons: Lessons) -> None:
        self.config = config
        self.lessons = lessons  # the pool's: what a new one imports, what a retiring one learned
        self.lock = threading.Lock()
        self._by_key: "OrderedDict[str, WarmProcess]" = OrderedDict()
        self.retired = 0
        # lineage -> the whole environment its last run or client gave: what an interpreter started
        # for a load imports under (Note [One interpreter per lineage]); never written to disk
        self._environments: "OrderedDict[str, dict]" = OrderedDict()
        self._cannot_fork: dict[str, int] = {}  # lineage -> interpreters retired as unable to fork
        self._counted_unforkable: "weakref.WeakSet[WarmProcess]" = weakref.WeakSet()

    def get(self, context: Context, create: bool = True, env: dict | None = None) -> WarmProcess | None:
        """The interpreter that serves ``context``, started if ``create`` (Note [One interpreter per
        lineage]); ``env``: the whole environment of the run or client asking."""
        with self.lock:
            if env is not None:
                self._remember_environment(context, env)
            key = self._serving(context)
            interpreter = self._by_key.get(key)
            if interpreter is not None and not interpreter.alive:
                logger.warning("warm interpreter %d for context %s died (exit %s); starting another",
                               interpreter.proc.pid, key, interpreter.proc.returncode)
                del self._by_key[key]
                interpreter.retire()
                interpreter = None
            if interpreter is None and create:
                key = context.key
                modules, refused = self.lessons.for_new(context, list(self._by_key.values()))
                interpreter = self._by_key[key] = WarmProcess(
                    context, self.config, modules, refused, on_reads=self.lessons.heard_reads,
                    packages=self.lessons.packages_for(context),
                    env=env if env is not None else self._environments.get(context.lineage))
            if interpreter is not None:
                self._by_key.move_to_end(key)
            victims = []
            while len(self._by_key) > self.config.warm_max:
                victims.append(self._by_key.popitem(last=False)[1])
        for victim in victims:
            self.retire(victim, "over OVERMIND_WARM_MAX")
        return interpreter

    def _serving(self, context: Context) -> str:
        """The key of the interpreter that serves ``context`` (Note [One interpreter per lineage]):
        its own; for a context as a client sent it (a load's, a Prepare's), the most recently used
        interpreter of its lineage when none has its key. Under self.lock."""
        if context.key in self._by_key or context.family:
            return context.key
        for key in reversed(self._by_key):
            if self._by_key[key].context.lineage == context.lineage:
                return key
        return context.key

    def remember_environment(self, context: Context, env: dict) -> None:
        """``env``, a run's whole environment, is what the next interpreter of its lineage started
        for a load imports under (Note [One interpreter per lineage])."""
        with self.lock:
            self._remember_environment(context, env)

    def _remember_environment(self, context: Context, env: dict) -> None:
        """Under self.lock."""
        self._environments[context.lineage] = env
        self._environments.move_to_end(context.lineage)
        while len(self._environments) > MAX_ENVIRONMENTS:
            self._environments.popitem(last=False)

    def rekey(self, lineage: str) -> None:
        """File the interpreters of ``lineage`` under their own values of what their imports read
        (Note [A run's interpreter imports under the run's environment] in overmind.server.pool);
        of two that end up with one key, one retires."""
        with self.lock:
            kept, extra = _filed_by_own_values(self._by_key, lineage, self.lessons.with_reads)
            if kept is None:
                return
            self._by_key = kept
            for interpreter in extra:
                self.lessons.remember(interpreter)
                self.retired += 1
        for interpreter in extra:
            logger.info("retiring warm interpreter %d (another imported under the same settings)", interpreter.proc.pid)
            interpreter.retire()

    # -- retiring ------------------------------------------------------------------------------

    def retire(self, interpreter: WarmProcess, why: str) -> None:
        with self.lock:
            if self._by_key.get(interpreter.context.key) is interpreter:
                del self._by_key[interpreter.context.key]
            self.lessons.remember(interpreter)
            self.retired += 1
        logger.info("retiring warm interpreter %d (%s)", interpreter.proc.pid, why)
        interpreter.retire()

    def retire_unforkable(self, interpreter: WarmProcess, why: str) -> bool:
        """Retire one that cannot fork; whether its lineage may have another (Note [Threads libraries
        start] in overmind.warm.fork_safety): each successor keeps out the modules that started
        threads, so it forks; after MAX_CANNOT_FORK in a row that did not, its runs go plain, never
        in a loop of interpreters started and retired."""
        lineage = interpreter.context.lineage
        with self.lock:
            if interpreter in self._counted_unforkable:  # found so by another path too: counted once
                return self._cannot_fork.get(lineage, 0) < MAX_CANNOT_FORK
            self._counted_unforkable.add(interpreter)
            count = self._cannot_fork[lineage] = self._cannot_fork.get(lineage, 0) + 1
        self.retire(interpreter, why)
        if count == MAX_CANNOT_FORK:
            logger.warning("%d warm interpreters of context %s in a row could not fork; its runs go plain (its "
                           "loads still fill, each in a fresh interpreter)", count, interpreter.context.key)
        return count < MAX_CANNOT_FORK

    def given_up(self, lineage: str) -> bool:
        """Were MAX_CANNOT_FORK interpreters of ``lineage`` in a row unable to fork? Its runs go plain."""
        with self.lock:
            return self._cannot_fork.get(lineage, 0) >= MAX_CANNOT_FORK

    def forked(self, lineage: str) -> None:
        """An interpreter of ``lineage`` forked a run: those that could not before are forgotten."""
        with self.lock:
            self._cannot_fork.pop(lineage, None)

    def discard(self, interpreter: WarmProcess) -> None:
        """Kill one that is not ready (still importing: no child of it to wait for)."""
        with self.lock:
            if self._by_key.get(interpreter.context.key) is interpreter:
                del self._by_key[interpreter.context.key]
        interpreter.kill()

    def take_all(self) -> list:
        """Every interpreter, none kept any more: the server stops."""
        with self.lock:
            interpreters = list(self._by_key.values())
            self._by_key.clear()
        return interpreters

    # -- looking on ----------------------------------------------------------------------------

    def live(self) -> list:
        """Every warm interpreter (``WarmProcess``), least recently used first."""
        with self.lock:
            return list(self._by_key.values())

    def by_key(self) -> list:
        """(key, interpreter) of every one, least recently used first."""
        with self.lock:
            return list(self._by_key.items())


def _filed_by_own_values(interpreters: "OrderedDict[str, WarmProcess]", lineage: str, with_reads):
    """(the interpreters with those of ``lineage`` filed under their own values of what their imports
    read, each in its place among the least recently used; those that lost their key to another), or
    (None, []) when each is filed so already. Of two that end up with one key, the ready, more
    recently used one stays."""
    owned = {key: with_reads(interpreter.context, interpreter.start_env) for key, interpreter in interpreters.items()
             if interpreter.context.lineage == lineage}
    if all(own.key == key for key, own in owned.items()):
        return None, []
    kept: "OrderedDict[str, WarmProcess]" = OrderedDict()
    extra = []
    for key, interpreter in interpreters.items():  # least recently used first
        own = owned.get(key)
        if own is not None:
            interpreter.context = own
            key = own.key
        other = kept.get(key)
        if other is not None:  # the later one is the more recently used
            stays, goes = (interpreter, other) if interpreter.ready or not other.ready else (other, interpreter)
            extra.append(goes)
            kept.pop(key)
            interpreter = stays
        kept[key] = interpreter
    return kept, extra
