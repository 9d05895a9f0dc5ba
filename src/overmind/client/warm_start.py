"""A script that starts with ``monkey_patch_all()`` runs warm: by default, where it is safe.

    # train.py
    import overmind.api
    overmind.api.monkey_patch_all()     # the rest runs in a warm child, where that is safe
    import torch, diffusers
    ...

    $ python train.py --epochs 3                          # as fast as `overmind run train.py ...`
    $ OVERMIND_WARM_START=0 python train.py --epochs 3    # never handed over: only the loads are warm

Note [When a warm start applies]
The call hands the run to a warm interpreter (as ``overmind run`` would) only when the child
can be the process the user started (ARCHITECTURE.md, invariant 15: A hand-over is the same
process or none). Here, in the caller, before asking:
- nothing of the user's has run yet: the call is made by the ``__main__`` module of
  ``python SCRIPT``, ``python -m MODULE`` or ``python -c CODE``, at its top level, and every
  statement before it is a docstring, a ``from __future__`` import or an import of overmind;
- that ``__main__`` is the command line's own (not a script run by ``cProfile``, ``pdb``,
  ``trace``, ``coverage`` or another runner), started without interpreter options but ``-u``
  (torchrun starts every rank with it; the child makes its stdio unbuffered as ``-u`` would);
- nothing traces or profiles this process: no ``sys.gettrace()``, ``sys.getprofile()``, threading
  hook or ``sys.monitoring`` tool, and no tracer pid (a debugger, ``strace``);
- it is not interactive (``-i``, a REPL, IPython or a Jupyter kernel), not already a warm child or
  an overmind loader, and its stdin is not a terminal in raw mode (whose keys would reach a child
  the terminal does not know as its foreground job).
Then the run's child takes on the caller's cgroups, limits and scheduling, and compares every
trait (Note [A hand-over is the same process or none] in overmind.warm.match). Where anything
fails the script goes on in this process exactly as with ``OVERMIND_WARM_START=0``: the loads are
still warm, nothing is printed, and the server's log says why once per context
(``Prepare.plain``, sent before the script goes on). Refused because no interpreter is warm yet, the run teaches the one that
starts (Note [The first run teaches] in overmind.client.teach), so run 2 is warm. When it applies,
this process becomes the front end: it forwards signals and exits with the child's status, and
the child runs the whole script, ``monkey_patch_all()`` included, from its first line.
"""

from __future__ import annotations

import logging
import os
import sys

logger = logging.getLogger(__name__)

__all__ = ["hand_off_script", "why_not"]

_OVERMIND_IMPORTS = ("overmind", "overmind.api")
IN_WARM = "already in a warm interpreter or a loader"
SAY_WHY_TIMEOUT = 0.25  # seconds for the handshake that tells the server why a script runs here


def _command() -> tuple[str, str, list[str], tuple[str, ...]] | None:
    """(mode, target, args, options) of this interpreter's command line, if its options are
    only those a warm child reproduces (overmind.shared.protocol.contexts.RUN_OPTIONS)."""
    from overmind.shared.protocol.contexts import RUN_OPTIONS

    argv = list(getattr(sys, "orig_argv", []))[1:]
    options = []
    while argv and argv[0] in RUN_OPTIONS:
        options.append(argv.pop(0))
    if not argv:
        return None
    head = argv[0]
    if head in ("-m", "-c") and len(argv) >= 2:
        return ("module" if head == "-m" else "code"), argv[1], argv[2:], tuple(dict.fromkeys(options))
    if head.startswith("-"):
        return None
    return "script", head, argv[1:], tuple(dict.fromkeys(options))


def _is_the_command(main, mode: str, target: str) -> bool:
    """Is ``__main__`` what the command line names, not a module a runner (cProfile, coverage) made?"""
    if mode == "code":
        return getattr(main, "__file__", None) is None
    if mode == "module":
        spec = getattr(main, "__spec__", None)
        return getattr(spec, "name", None) in (target, target + ".__main__")
    path = getattr(main, "__file__", None)
    return bool(path) and os.path.realpath(path) == os.path.realpath(target)


def _source(mode: str, target: str) -> str | None:
    try:
        if mode == "code":
            return target
        main = sys.modules.get("__main__")
        path = getattr(main, "__file__", None)
        if not path:
            return None
        with open(path, "rb") as f:
            return f.read().decode("utf-8", errors="replace")
    except OSError:
        return None


def _only_overmind_before(source: str, line: int) -> bool:
    """Is the statement at ``line`` preceded only by a docstring, __future__ and overmind imports?"""
    import ast

    try:
        tree = ast.parse(source)
    except SyntaxError:
        return False
    for node in tree.body:
        if node.lineno <= line <= (node.end_lineno or node.lineno):
            return True
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            continue
        if isinstance(node, ast.ImportFrom) and node.module in ("__future__", "overmind"):
            continue
        if isinstance(node, ast.Import) and all(a.name in _OVERMIND_IMPORTS for a in node.names):
            continue
        return False
    return False


def _watched() -> str:
    """What traces or profiles this process, or ""."""
    if sys.gettrace() is not None or sys.getprofile() is not None:
        return "a trace or profile function is set (a debugger, profiler or coverage)"
    threading = sys.modules.get("threading")
    if threading is not None and (getattr(threading, "_trace_hook", None) or getattr(threading, "_profile_hook", None)):
        return "threading has a trace or profile hook"
    monitoring = getattr(sys, "monitoring", None)
    if monitoring is not None and any(monitoring.get_tool(i) for i in range(6)):
        return "a sys.monitoring tool is registered (a debugger, profiler or coverage)"
    from overmind.shared.process.traits import tracer_pid

    if tracer := tracer_pid():
        return f"pid {tracer} traces this process (a debugger or strace)"
    return ""


def _raw_terminal() -> bool:
    """Is stdin a terminal that line editing and signal keys are off for (raw or cbreak mode)?"""
    try:
        if not os.isatty(0):
            return False
        import termios

        lflag = termios.tcgetattr(0)[3]
    except Exception:  # noqa: BLE001 - termios.error or OSError: not a terminal we can read
        return False
    return not (lflag & termios.ICANON and lflag & termios.ISIG)


def why_not(frame) -> str:
    """Why this process cannot hand its run off (Note [When a warm start applies]); "" if it can."""
    if "overmind.warm.interpreter" in sys.modules:
        return IN_WARM
    if sys.flags.interactive or hasattr(sys, "ps1") or "ipykernel" in sys.modules or "IPython" in sys.modules:
        return "an interactive session"
    main = sys.modules.get("__main__")
    if frame.f_globals.get("__name__") != "__main__" or frame.f_code.co_name != "<module>" \
            or main is None or frame.f_globals is not main.__dict__:
        return "monkey_patch_all() is not called at the top level of the __main__ module"
    watched = _watched()
    if watched:
        return watched
    command = _command()
    if command is None:
        return f"the interpreter was started with options ({' '.join(getattr(sys, 'orig_argv', []))})"
    mode, target, _, _ = command
    if not _is_the_command(main, mode, target):
        return f"__main__ is not the command line's {mode} {target!r} (a runner such as cProfile or coverage)"
    source = _source(mode, target)
    if source is None or not _only_overmind_before(source, frame.f_lineno):
        return "code ran before monkey_patch_all()"
    if _raw_terminal():
        return "stdin is a terminal in raw mode"
    return ""


def _say_why(reason: str) -> None:
    """Tell the server why this script runs here, for its log (once per context): one Prepare,
    not waiting for its answer. No server: nothing to tell (monkey_patch_all() starts one)."""
    try:
        from overmind.shared import protocol as P
        from overmind.shared.settings.config import Config
        from overmind.shared.protocol.connect import handshake
        from overmind.shared.protocol.contexts import caller_context

        # A short bound: a stuck server must not hold up a script that runs here anyway.
        sock, _, _ = handshake(Config.from_env(), "run", timeout=SAY_WHY_TIMEOUT)
        with sock:
            P.send_message(sock, P.Prepare(caller_context(), plain=reason))
    except Exception as err:  # noqa: BLE001 - a bonus for the log; the script goes on regardless
        logger.debug("warm start: could not tell the server why: %s", err)


def hand_off_script(frame) -> None:
    """Hand this run to a warm child and never return, or return to run the script here."""
    reason = why_not(frame)
    if reason:
        logger.debug("warm start: running here: %s", reason)
        if reason != IN_WARM:
            _say_why(reason)
        return
    from overmind.shared.protocol import handoff
    from overmind.shared.protocol.contexts import RunSpec
    from overmind.shared.settings.config import Config, ConfigError

    try:
        config = Config.from_env()
    except ConfigError as err:
        logger.debug("warm start: running here: %s", err)
        return
    mode, target, args, options = _command()
    started = handoff.hand_off(sys.executable, RunSpec.of_caller(mode, target, args, options), config)
    if started is None:
        from overmind.client.teach import teach

        teach()  # Note [The first run teaches]: the interpreter starting for this context learns from us
        return
    sys.stdout.flush()
    sys.stderr.flush()
    handoff.exit_like(handoff.wait_for(*started))
