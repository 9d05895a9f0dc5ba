"""Imported by ``site`` in a run that ``overmind run`` had to execute plainly (no warm
interpreter for its context yet): teach that interpreter, while the run imports, what it
imports. Standard library and overmind's light modules only.

Note [The first run teaches]
The first ``overmind run`` of a context goes plain: there is no warm interpreter to fork from
(Note [Never worse than plain python] in overmind.frontend.run), and one starts beside it. For the
second run to import nothing, that interpreter must learn the run's modules while the run
imports, not after it: imported at the run's exit they would still be importing when the next
run, started at once, asks for its fork. So the front end puts this folder first on
``PYTHONPATH`` (keeping the caller's value in ``OVERMIND_FIRST_RUN_PYTHONPATH``) and execs
python as it would have. Here, before any of the user's code: the environment and
``sys.path`` are put back as plain python has them, a ``sitecustomize`` of the caller's own
is imported in our place, and a daemon thread tells the server every REPORT_INTERVAL which
installed modules are new (``Prepare.modules``; Note [Warm interpreters learn] in
overmind.warm.interpreter), until nothing new came for QUIET_AFTER seconds, and once more at exit,
as a forked run's report does. What stays different from plain python: that thread while it
lives (ended before the interpreter's teardown), a ``sitecustomize`` module where there was
none, and two ``atexit`` callbacks. ``-I``, ``-E`` and ``-S`` runs never import this file, and
learn nothing.
"""

import os
import sys

REPORT_INTERVAL = 0.25
QUIET_AFTER = 3.0
SAVED = "OVERMIND_FIRST_RUN_PYTHONPATH"  # "=" and the caller's PYTHONPATH, or "" when it had none


def _restore() -> bool:
    saved = os.environ.pop(SAVED, None)
    if saved is None:
        return False
    if saved.startswith("="):
        os.environ["PYTHONPATH"] = saved[1:]
    else:
        os.environ.pop("PYTHONPATH", None)
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    sys.path_importer_cache.pop(here, None)
    return True


def _import_theirs() -> None:
    """The caller's own sitecustomize, which this module shadowed (site imports only one)."""
    import importlib.util

    mine = sys.modules.pop("sitecustomize", None)
    try:
        spec = importlib.util.find_spec("sitecustomize")
    except (ImportError, ValueError):
        spec = None
    if spec is None or spec.origin == __file__:
        if mine is not None:
            sys.modules["sitecustomize"] = mine
        return
    import importlib

    try:
        importlib.import_module("sitecustomize")  # importlib's bookkeeping keeps theirs in sys.modules
    except Exception:  # noqa: BLE001 - as site.py does: print and go on
        import traceback

        traceback.print_exc()


def _teach() -> None:
    import threading

    # The run's environment as it started, for the interpreter the server starts for this context:
    # Note [A run's interpreter imports under the run's environment] in overmind.server.pool.
    state = {"seen": set(), "sock": None, "lock": threading.Lock(), "env": dict(os.environ)}

    def report(extra: list = ()) -> bool:
        from overmind.shared import protocol as P
        from overmind.shared.contexts import caller_context
        from overmind.client.prefetch import new_module_names  # the warm interpreter keeps only installed ones

        new = new_module_names(state["seen"]) + list(extra)
        if not new:
            return False
        with state["lock"]:
            if state["sock"] is None:
                from overmind.shared.config import Config
                from overmind.shared.connect import handshake

                state["sock"] = handshake(Config.from_env(), "run")[0]
            env, state["env"] = state["env"], {}  # the first report starts the interpreter: only it carries it
            P.send_message(state["sock"], P.Prepare(caller_context(), modules=new, env=env))
            P.expect(P.recv_message(state["sock"], max_blob=0)[0], P.Ok)
        return True

    def loop() -> None:
        import time

        quiet_since = time.monotonic()
        count = -1
        while time.monotonic() - quiet_since < QUIET_AFTER:
            if teardown.pause(REPORT_INTERVAL):
                return  # at_exit reports the rest
            if len(sys.modules) != count:
                try:
                    if report():
                        quiet_since = time.monotonic()
                    count = len(sys.modules)
                except Exception:  # noqa: BLE001 - learning is a bonus; the run must not notice
                    # A server this run autostarted may not listen yet: the same news, next time.
                    state["sock"] = None

    def at_exit() -> None:
        try:
            from overmind.shared.compiled import USED, used

            report([USED] if used() else [])
        except Exception:  # noqa: BLE001
            pass

    import atexit

    from overmind.shared import teardown

    atexit.register(at_exit)  # runs after teardown's own, which ends the thread first
    # Note [Our threads end before the teardown] in overmind.shared.teardown
    teardown.start_thread(loop, "overmind-first-run")


if _restore():
    _import_theirs()
    _teach()
