"""Who a load or a run is for, as it crosses the wire. Standard library only.

    caller_context()                         # a client's load: {"python", "env", "cwd", "sys_path"}
    context, cwd, sys_path = load_context_from_wire(request.context)     # the server, once
    spec = RunSpec.of_caller("script", "train.py", ["--epochs", "3"])    # overmind run, warm start
    spec = RunSpec.from_wire(message.spec)   # the server, and the warm child it forks

A :class:`Context` names the warm interpreter that serves a caller; a :class:`RunSpec` is
what a warm child becomes. Each is built by the caller in one function and validated where it
is received in one function (Note [Frames are untrusted] in overmind.shared.protocol): a bad
value raises ``ValueError`` naming the field.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import asdict, dataclass, field
from typing import Optional

from overmind.shared.settings.config import selecting_environment

__all__ = ["Context", "RunSpec", "caller_context", "load_context_from_wire", "environment_from_wire", "MODES",
           "mark_warm_run", "in_warm_run", "RUN_OPTIONS", "UNBUFFERED"]

MODES = ("script", "module", "code")
# Interpreter options a warm child can reproduce: -u only sets how the run's stdio is made
# (overmind.warm.startup.install_stdio), and torchrun starts every rank with it.
UNBUFFERED = "-u"
RUN_OPTIONS = (UNBUFFERED,)


@dataclass(frozen=True)
class Context:
    """Which warm interpreter serves a client: the interpreter and the environment that can
    change what an import does (Note [Environment that selects an interpreter] in overmind.shared.settings.config).
    Not the cwd or sys.path: a warm interpreter holds only installed code (Note [Warm
    interpreters] in overmind.warm.interpreter); each load or run brings its own."""

    python: str
    env: tuple  # sorted (name, value) pairs
    # The key of the context before the names its interpreters' imports read were added to env
    # (Note [Settings an import read] in overmind.shared.settings.import_env); "": this is that context.
    family: str = field(default="", compare=False)

    @property
    def lineage(self) -> str:
        """What this context's variants share: what to pre-import, what their imports read."""
        return self.family or self.key

    @property
    def key(self) -> str:
        # .venv/bin/python and .venv/bin/python3 are one interpreter with one venv: the folder
        # (where a venv is found) and the binary the name resolves to, not the name.
        python = [os.path.dirname(self.python), os.path.realpath(self.python)]
        raw = json.dumps([python, list(self.env)]).encode()
        return hashlib.sha256(raw).hexdigest()[:16]

    @classmethod
    def from_wire(cls, data: object) -> "Context":
        if not isinstance(data, dict) or "python" not in data or "env" not in data:
            raise ValueError("context needs python and env")
        python, env = data["python"], data["env"]
        if not (isinstance(python, str) and os.path.isabs(python) and os.access(python, os.X_OK)):
            raise ValueError(f"context python {python!r:.200} is not an executable absolute path")
        if not (isinstance(env, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
            raise ValueError("context env must map strings to strings")
        return cls(python, tuple(sorted(selecting_environment(env).items())))


def environment_from_wire(env: object) -> dict:
    """A whole environment as a client sent it (``Prepare.env``), validated: ValueError if it is not
    names to values that an exec could take."""
    if not isinstance(env, dict) or not all(
            isinstance(k, str) and isinstance(v, str) and k and "=" not in k and "\0" not in k + v
            for k, v in env.items()):
        raise ValueError("an environment must map names (no '=' or NUL) to strings (no NUL)")
    return dict(env)


_warm_run = False  # this process is a run forked from a warm interpreter (overmind.warm.script)


def mark_warm_run() -> None:
    """Said by overmind.warm.script in a run it forked, before the user's code starts."""
    global _warm_run
    _warm_run = True


def in_warm_run() -> bool:
    """Whether this process is a run forked from a warm interpreter: that interpreter serves its
    context's runs, and learns what the run imported from its report at exit."""
    return _warm_run


def program_of(argv0: str, cwd: str) -> str:
    """The program (Note [Prefetch] in overmind.client.prefetch) of a process of this interpreter
    with ``sys.argv[0]`` and cwd ``cwd``: "" for ``-c`` and the prompt."""
    if not argv0 or argv0 == "-c" or not os.path.isfile(os.path.join(cwd, argv0)):
        return ""
    import xxhash

    path = os.path.realpath(os.path.join(cwd, argv0))
    return xxhash.xxh3_128_hexdigest("\0".join((path, cwd, sys.executable)).encode())


def caller_context(python: str | None = None, load: bool = True) -> dict:
    """This process's context on the wire; a load's also carries its cwd and sys.path (the
    loader runs there). ``python``: another interpreter (``overmind run --python``)."""
    found = {"python": os.path.abspath(python or sys.executable), "env": selecting_environment(os.environ)}
    if load:
        found.update(cwd=os.getcwd(), sys_path=list(sys.path))
    return found


def load_context_from_wire(data: object) -> tuple[Context, str, list]:
    """A load's context, its cwd and sys.path, validated."""
    context = Context.from_wire(data)
    cwd, sys_path = data.get("cwd"), data.get("sys_path")  # type: ignore[union-attr]
    if not (isinstance(cwd, str) and os.path.isdir(cwd)):
        raise ValueError(f"context cwd {cwd!r:.200} is not a directory")
    if not (isinstance(sys_path, list) and all(isinstance(p, str) for p in sys_path)):
        raise ValueError("context sys_path must be a list of strings")
    return context, cwd, sys_path


@dataclass(frozen=True)
class RunSpec:
    """What a warm child becomes: ``python <mode> <target> <argv>`` in ``cwd`` with ``env`` and
    ``umask``, ignoring the signals its caller's shell ignored (``nohup``, ``cmd &``), as a plain
    python inherits them (overmind.warm.script.become)."""

    mode: str  # "script" | "module" | "code"
    target: str  # the script path as typed (it becomes sys.argv[0]), the module name or the code
    argv: tuple  # the arguments after it
    cwd: str
    env: dict
    umask: int
    ignored_signals: frozenset = frozenset()
    oom_score_adj: Optional[int] = None  # the caller's: Note [The cache dies first] in overmind.warm.oom
    # The caller's Traits on the wire, which the child takes on (Note [A hand-over is the same
    # process or none] in overmind.warm.match); None: nothing to match (a test's own spec).
    traits: Optional[dict] = None
    options: tuple = ()  # interpreter options a hand-over reproduces: only UNBUFFERED

    @classmethod
    def of_caller(cls, mode: str, target: str, args: list[str], options: tuple = ()) -> "RunSpec":
        import signal

        from overmind.shared.process.traits import Traits

        umask = os.umask(0o022)
        os.umask(umask)
        ignored = frozenset(int(s) for s in signal.valid_signals() if s not in (signal.SIGKILL, signal.SIGSTOP)
                            and signal.getsignal(s) == signal.SIG_IGN)
        return cls(mode, target, tuple(args), os.getcwd(), dict(os.environ), umask, ignored, _own_oom_score_adj(),
                   Traits.own().to_wire(), tuple(options))

    def to_wire(self) -> dict:
        wire = asdict(self)
        wire.update(argv=list(self.argv), ignored_signals=sorted(self.ignored_signals), options=list(self.options))
        return wire

    @classmethod
    def from_wire(cls, spec: object) -> "RunSpec":
        if not isinstance(spec, dict):
            raise ValueError("a run spec must be an object")

        def need(key: str, kind: type) -> object:
            value = spec.get(key)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise ValueError(f"run spec field {key!r} must be {kind.__name__}, got {value!r:.80}")
            return value

        mode, target, argv, env = need("mode", str), need("target", str), need("argv", list), need("env", dict)
        if mode not in MODES or not target:
            raise ValueError(f"run spec: mode must be one of {MODES} with a target, got {mode!r:.80}")
        if not all(isinstance(a, str) for a in argv):
            raise ValueError("run spec field 'argv' must hold only strings")
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise ValueError("run spec field 'env' must map strings to strings")
        ignored = spec.get("ignored_signals") or []
        if not (isinstance(ignored, list) and all(isinstance(s, int) and not isinstance(s, bool) for s in ignored)):
            raise ValueError("run spec field 'ignored_signals' must be a list of signal numbers")
        oom = spec.get("oom_score_adj")
        if oom is not None and not (isinstance(oom, int) and not isinstance(oom, bool) and -1000 <= oom <= 1000):
            raise ValueError(f"run spec field 'oom_score_adj' must be an integer in [-1000, 1000], got {oom!r:.80}")
        traits = spec.get("traits")
        if traits is not None:
            from overmind.shared.process.traits import Traits

            traits = Traits.from_wire(traits).to_wire()
        options = spec.get("options") or []
        if not (isinstance(options, list) and set(options) <= set(RUN_OPTIONS)):
            raise ValueError(f"run spec field 'options' may hold only {RUN_OPTIONS}, got {options!r:.80}")
        return cls(mode, target, tuple(argv), need("cwd", str), dict(env), need("umask", int), frozenset(ignored), oom,
                   traits, tuple(options))


def _own_oom_score_adj() -> Optional[int]:
    try:
        with open("/proc/self/oom_score_adj") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None
