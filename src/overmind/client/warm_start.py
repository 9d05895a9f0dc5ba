"""``OVERMIND_WARM_START=1``: a script that starts with ``monkey_patch_all()`` runs warm.

    # train.py
    import overmind.api
    overmind.api.monkey_patch_all()     # with OVERMIND_WARM_START=1: the rest runs in a warm child
    import torch, diffusers
    ...

    $ OVERMIND_WARM_START=1 python train.py --epochs 3    # as fast as `overmind run train.py ...`

Note [When a warm start applies]
The call hands the run to a warm interpreter (as ``overmind run`` would) only when doing
so cannot change what the script does, that is, when nothing of the user's has run yet:
- the call is made by the ``__main__`` module of ``python SCRIPT``, ``python -m MODULE`` or
  ``python -c CODE``, at its top level, and every statement before it is a docstring, a
  ``from __future__`` import or an import of overmind itself;
- the interpreter was started without options a fork cannot reproduce (``sys.orig_argv``
  holds only the interpreter, then the script, ``-m`` or ``-c``);
- it is not interactive (``-i``, a REPL, IPython or a Jupyter kernel) and not already a warm
  child or an overmind loader.
Otherwise, or when the server refuses (none running, none warm yet for this context), the
script goes on in this process exactly as without the variable. When it applies, this
process becomes the front end: it forwards signals and exits with the child's status, and
the child runs the whole script, ``monkey_patch_all()`` included, from its first line.
"""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger(__name__)

__all__ = ["hand_off_script", "why_not"]

_OVERMIND_IMPORTS = ("overmind", "overmind.api")


def _command() -> tuple[str, str, list[str]] | None:
    """(mode, target, args) of this interpreter's command line, if it has no options."""
    argv = list(getattr(sys, "orig_argv", []))
    if len(argv) < 2:
        return None
    head = argv[1]
    if head in ("-m", "-c") and len(argv) >= 3:
        return ("module" if head == "-m" else "code"), argv[2], argv[3:]
    if head.startswith("-"):
        return None
    return "script", head, argv[2:]


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


def why_not(frame) -> str:
    """Why this process cannot hand its run off (Note [When a warm start applies]); "" if it can."""
    if "overmind.warm.interpreter" in sys.modules:
        return "already in a warm interpreter or a loader"
    if sys.flags.interactive or hasattr(sys, "ps1") or "ipykernel" in sys.modules or "IPython" in sys.modules:
        return "an interactive session"
    if frame.f_globals.get("__name__") != "__main__" or frame.f_code.co_name != "<module>":
        return "monkey_patch_all() is not called at the top level of the __main__ module"
    command = _command()
    if command is None:
        return f"the interpreter was started with options ({' '.join(getattr(sys, 'orig_argv', []))})"
    mode, target, _ = command
    source = _source(mode, target)
    if source is None or not _only_overmind_before(source, frame.f_lineno):
        return "code ran before monkey_patch_all()"
    return ""


def hand_off_script(frame) -> None:
    """Hand this run to a warm child and never return, or return to run the script here."""
    reason = why_not(frame)
    if reason:
        logger.debug("OVERMIND_WARM_START: running here: %s", reason)
        return
    from overmind.shared import handoff
    from overmind.shared.contexts import RunSpec
    from overmind.shared.config import Config, ConfigError

    try:
        config = Config.from_env()
    except ConfigError as err:
        logger.debug("OVERMIND_WARM_START: running here: %s", err)
        return
    mode, target, args = _command()
    started = handoff.hand_off(sys.executable, RunSpec.of_caller(mode, target, args), config)
    if started is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    handoff.exit_like(handoff.wait_for(*started))
