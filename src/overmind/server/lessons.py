"""What each context's warm interpreters learned, kept by the server beyond any one of them.
Standard library only.

    lessons = Lessons()
    modules, refused = lessons.for_new(context, live)   # what a new interpreter pre-imports
    lessons.remember(interpreter)                       # a retiring interpreter's lessons
    context = lessons.with_reads(context, caller_env)   # Note [Settings an import read]

Kept per lineage (``Context.lineage``: a context and its variants keyed on the values of the
variables their imports read): the installed modules its runs and loads imported (Note [Warm
interpreters learn] in overmind.warm.interpreter), the AOTInductor packages its runs loaded
(Note [AOTInductor packages are handed over] in overmind.shared.calls.compiled), the modules that started a thread when
imported (never pre-imported again: Note [Threads libraries start] in overmind.warm.fork_safety), and the environment
names and prefixes its imports read (Note [Settings an import read] in overmind.shared.settings.import_env).
``overmind.server.state`` keeps a ``snapshot()`` across restarts and ``teach``es it back.
"""

from __future__ import annotations

import threading

from overmind.shared.protocol.contexts import Context
from overmind.shared.settings.import_env import MAX_NAMES, MAX_PREFIXES, select
from overmind.shared.calls.compiled import MAX_PACKAGES, refusal_name, spec_key

__all__ = ["Lessons", "MAX_LEARNED"]

MAX_LEARNED = 10000


class Lessons:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.learned: dict[str, list] = {}  # lineage -> installed modules its runs and loads imported
        self.refused: dict[str, set] = {}  # lineage -> modules that started a thread when imported
        self.reads: dict[str, tuple[set, set]] = {}  # lineage -> (names, prefixes) its imports read
        self.packages: dict[str, list] = {}  # lineage -> AOTInductor packages to preload (overmind.shared.calls.compiled)

    def for_new(self, context: Context, live: list) -> tuple[list, list]:
        """(modules to pre-import, modules refused) for a new interpreter of ``context``: what its
        lineage learned, the ``live`` interpreters' lessons included, so a variant keyed on
        another value of a variable read at import starts as warm as they are."""
        with self.lock:
            known = list(self.learned.get(context.lineage, ()))
            refused = set(self.refused.get(context.lineage, ()))
        for interpreter in live:
            if interpreter.context.lineage == context.lineage:
                known += [n for n in [*interpreter.imported, *interpreter.learned]
                          if n not in known and n not in refused]
        return known[:MAX_LEARNED], sorted(refused)

    def add(self, context: Context, modules, refused=()) -> None:
        """``modules`` a client of ``context`` imported (``Prepare``), or that it learned before a restart."""
        with self.lock:
            known = self.learned.setdefault(context.lineage, [])
            seen = set(known) | set(refused)
            known.extend(n for n in modules if n not in seen and len(known) < MAX_LEARNED)
            if refused:
                self.refused.setdefault(context.lineage, set()).update(refused)

    def packages_for(self, context: Context) -> list:
        """The lineage's AOTInductor packages, but those that started a thread where loaded."""
        with self.lock:
            refused = self.refused.get(context.lineage, set())
            return [p for p in self.packages.get(context.lineage, ()) if refusal_name(p) not in refused]

    def add_packages(self, context: Context, packages: list) -> None:
        with self.lock:
            known = self.packages.setdefault(context.lineage, [])
            for spec in packages:
                known[:] = [k for k in known if spec_key(k) != spec_key(spec)] + [spec]
            del known[:-MAX_PACKAGES]

    def remember(self, interpreter) -> None:
        """A retiring interpreter's lessons (an ``overmind.server.warm_process.WarmProcess``)."""
        with self.lock:
            known = self.learned.setdefault(interpreter.context.lineage, [])
            for name in [*interpreter.imported, *interpreter.learned]:
                if name not in known and len(known) < MAX_LEARNED:
                    known.append(name)
            refused = self.refused.setdefault(interpreter.context.lineage, set())
            refused.update(interpreter.refused)
            known[:] = [name for name in known if name not in refused]

    def heard_reads(self, context: Context, names: list, prefixes: list) -> None:
        with self.lock:
            known_names, known_prefixes = self.reads.setdefault(context.lineage, (set(), set()))
            known_names.update(names[:max(MAX_NAMES - len(known_names), 0)])
            known_prefixes.update(prefixes[:max(MAX_PREFIXES - len(known_prefixes), 0)])

    def with_reads(self, context: Context, env) -> Context:
        """``context`` with the caller's values (``env``, its whole environment) of the variables its
        lineage's imports read: a caller whose values differ from an interpreter's gets another,
        imported under its own (Note [Settings an import read] in overmind.shared.settings.import_env)."""
        with self.lock:
            names, prefixes = self.reads.get(context.lineage, ((), ()))
            chosen = select(env, names, prefixes) if isinstance(env, dict) else {}
        merged = {**dict(context.env), **chosen}
        return Context(context.python, tuple(sorted(merged.items())), family=context.lineage)

    def snapshot(self, live: list) -> dict:
        """lineage -> (modules, refused, names, prefixes), the ``live`` interpreters' lessons
        included: what overmind.server.state keeps across a restart."""
        with self.lock:
            known = {k: list(v) for k, v in self.learned.items()}
            refused = {k: sorted(v) for k, v in self.refused.items()}
            reads = {k: (sorted(n), sorted(p)) for k, (n, p) in self.reads.items()}
        for interpreter in live:
            lineage = interpreter.context.lineage
            modules = known.setdefault(lineage, [])
            refused[lineage] = sorted({*refused.get(lineage, ()), *interpreter.refused})
            skip = set(modules) | set(refused[lineage])
            modules += [n for n in dict.fromkeys([*interpreter.imported, *interpreter.learned]) if n not in skip]
        return {lineage: (modules[:MAX_LEARNED], refused.get(lineage, []), *reads.get(lineage, ([], [])))
                for lineage, modules in known.items()}

    def packages_snapshot(self) -> dict:
        """lineage -> the AOTInductor packages its runs loaded, but those refused: kept across a restart."""
        with self.lock:
            return {lineage: [p for p in packages if refusal_name(p) not in self.refused.get(lineage, set())]
                    for lineage, packages in self.packages.items() if packages}

    def teach(self, context: Context, modules: list, refused: list, names: list, prefixes: list) -> None:
        """What ``context``'s lineage learned before a restart (overmind.server.restore), checked as a
        client's Prepare is: its interpreters import ``modules`` and key on ``names``."""
        self.add(context, modules, refused)
        self.heard_reads(context, names, prefixes)
