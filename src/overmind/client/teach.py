"""A run that goes plain teaches its context's warm interpreter, while it imports, what it imports.

    teach()     # before the user's code: a daemon thread reports new installed modules to the server

Used by the plain first run of ``overmind run`` (overmind.client.first_run.sitecustomize) and by a
script whose ``monkey_patch_all()`` could not hand its run over yet (overmind.client.warm_start).
Standard library and overmind's light modules only.

Note [The first run teaches]
The first run of a context goes plain: there is no warm interpreter to fork from (Note [Never
worse than plain python] in overmind.frontend.run), and one starts beside it. For the second run
to import nothing, that interpreter must learn the run's modules while the run imports, not
after it: imported at the run's exit they would still be importing when the next run, started
at once, asks for its fork. So a daemon thread tells the server every REPORT_INTERVAL which
installed modules are new (``Prepare.modules``; Note [Warm interpreters learn] in
overmind.warm.interpreter), until nothing new came for QUIET_AFTER seconds, and once more at
exit, as a forked run's report does. What stays different from plain python: that thread while
it lives (ended before the interpreter's teardown, Note [Our threads end before the teardown] in
overmind.shared.process.teardown) and one ``atexit`` callback.
"""

from __future__ import annotations

import os
import sys

__all__ = ["teach", "REPORT_INTERVAL", "QUIET_AFTER"]

REPORT_INTERVAL = 0.25
QUIET_AFTER = 3.0


def teach() -> None:
    import threading

    # The run's environment as it started, for the interpreter the server starts for this context:
    # Note [A run's interpreter imports under the run's environment] in overmind.server.pool.
    state = {"seen": set(), "sock": None, "lock": threading.Lock(), "env": dict(os.environ)}

    def report(extra: list = ()) -> bool:
        from overmind.shared import protocol as P
        from overmind.shared.protocol.contexts import caller_context
        from overmind.client.prefetch import new_module_names  # the warm interpreter keeps only installed ones

        new = new_module_names(state["seen"]) + list(extra)
        if not new:
            return False
        with state["lock"]:
            if state["sock"] is None:
                from overmind.shared.settings.config import Config
                from overmind.shared.protocol.connect import handshake

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
            from overmind.shared.calls.compiled import USED, used

            report([USED] if used() else [])
        except Exception:  # noqa: BLE001
            pass

    import atexit

    from overmind.shared.process import teardown

    atexit.register(at_exit)  # runs after teardown's own, which ends the thread first
    # Note [Our threads end before the teardown] in overmind.shared.process.teardown
    teardown.start_thread(loop, "overmind-first-run")
