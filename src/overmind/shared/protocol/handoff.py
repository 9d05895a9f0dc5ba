"""Handing a run to a warm interpreter, from the caller's side: ``overmind run`` and
``OVERMIND_WARM_START=1`` both become a front end that forwards signals and leaves with the
child's status. Standard library only, and light (Note [A light front end] in
overmind.frontend.run)::

    started = hand_off(sys.executable, RunSpec.of_caller("script", "train.py", ["--epochs", "3"]), config)
    if started is not None:                  # None: run plainly
        exit_like(wait_for(*started))        # never returns

The child side is ``overmind.warm.script.become``; the server forks it (``Run``).
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    import socket

    from overmind.shared.settings.config import Config
    from overmind.shared.protocol.contexts import RunSpec

__all__ = ["hand_off", "wait_for", "exit_like"]


def _signals() -> tuple[tuple, tuple]:
    """(signals a terminal sends its foreground group: forwarded to the child's group,
    signals sent to this process by kill or a supervisor: forwarded to the child itself)."""
    import signal

    return ((signal.SIGINT, signal.SIGQUIT, signal.SIGTSTP, signal.SIGCONT, signal.SIGWINCH),
            (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM))


START_GRACE = 3.0


def hand_off(python: str, spec: RunSpec, config: Config) -> tuple[socket.socket, int] | None:
    """Ask the server to fork the run; (connection, child pid), or None to run plainly.

    The forwarded signals stay blocked from here until :func:`wait_for` can forward them: the
    child may be running (and the user pressing Ctrl-C) before its pid reaches us. On None
    they are unblocked again, and one that came meanwhile acts on this process as it would have.
    """
    import signal

    forwarded = sum(_signals(), ())
    signal.pthread_sigmask(signal.SIG_BLOCK, forwarded)
    started = _hand_off(python, spec, config)
    if started is None:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, forwarded)
    return started


def _hand_off(python: str, spec: RunSpec, config: Config) -> tuple[socket.socket, int] | None:
    from overmind.shared import protocol as P
    from overmind.shared.protocol.connect import handshake, server_holding, start_server
    from overmind.shared.protocol.contexts import caller_context

    try:
        sock, _, _ = handshake(config, "run")
    except (FileNotFoundError, ConnectionRefusedError):
        if config.autostart and not server_holding(config):
            start_server(config, wait=False, prepare=python)
        return None
    except (OSError, P.ProtocolError, P.RemoteError, EOFError):
        return None
    try:
        P.send_message(sock, P.Run(caller_context(python, load=False), spec.to_wire()), fds=[0, 1, 2])
        # A warm interpreter may finish importing one module first (Note [Warm interpreters learn] in
        # overmind.warm.interpreter). Giving up is safe: it forks nothing for a front end that left.
        sock.settimeout(config.reply_timeout + START_GRACE)
        message, _, fds = P.recv_message(sock, max_blob=0, frame_timeout=config.reply_timeout + START_GRACE)
        for fd in fds:
            os.close(fd)
    except (OSError, P.ProtocolError, EOFError):
        sock.close()
        return None
    if not isinstance(message, P.RunStarted):
        sock.close()
        return None
    return sock, message.pid


def wait_for(sock: socket.socket, pid: int) -> int:
    """Forward signals to the child until it exits; its raw wait status."""
    import signal

    from overmind.shared import protocol as P

    group_signals, process_signals = _signals()

    def forward(signum, frame):
        try:
            if signum in group_signals:
                os.killpg(pid, signum)
            else:
                os.kill(pid, signum)
        except ProcessLookupError:
            pass
        if signum == signal.SIGTSTP:  # stop ourselves too, as the shell expects of a foreground job
            signal.signal(signal.SIGTSTP, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTSTP)
            signal.signal(signal.SIGTSTP, forward)

    for signum in group_signals + process_signals:
        signal.signal(signum, forward)
    # blocked since hand_off: forwarded now
    signal.pthread_sigmask(signal.SIG_UNBLOCK, group_signals + process_signals)
    sock.settimeout(None)
    while True:
        try:
            message, _, fds = P.recv_message(sock, max_blob=0)
        except InterruptedError:
            continue
        except (EOFError, OSError, P.ProtocolError) as err:
            print(f"overmind run: lost the warm interpreter running pid {pid} ({err})", file=sys.stderr)
            return 1 << 8
        for fd in fds:
            os.close(fd)
        if isinstance(message, P.RunExited):
            return message.status


def exit_like(status: int) -> None:
    """Leave as the child did: its exit code, or death by its signal (the shell then reports 128+n)."""
    import signal

    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)  # the signal is ignored or blocked by whoever started us
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)
