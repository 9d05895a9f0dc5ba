"""A command whose reader has left: ``overmind status | head -1``. Standard library only, and
``select`` and ``signal`` come in only when stdout has failed (Note [A light front end] in
overmind.frontend.run). Used by both front ends, ``overmind run`` and overmind.frontend.cli.

Note [A closed stdout is not an error]
``overmind status | head -1``: once the reader has left, writing our stdout fails with EPIPE
(Python ignores SIGPIPE, so the write raises BrokenPipeError instead of killing us). Unix
tools die of SIGPIPE there, silently (shells do not report it), so the ``overmind`` command
does the same: no traceback, no "lost the server". A BrokenPipeError from the server's socket
is a different failure and is reported: the pipe itself tells which one it was.
"""

from __future__ import annotations

import os
import sys

__all__ = ["stdout_closed", "leave_for_closed_stdout", "print_or_leave"]


def stdout_closed(err: BaseException) -> bool:
    """Whether ``err`` means our stdout's reader has left: a pipe without readers polls POLLERR
    (a socket whose peer has gone, POLLHUP); a failed socket write leaves stdout as it was."""
    if not isinstance(err, BrokenPipeError):
        return False
    import select

    try:
        poller = select.poll()
        poller.register(1, select.POLLOUT)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))
    except (OSError, ValueError):
        return False


def leave_for_closed_stdout() -> None:
    """Die of SIGPIPE, as a Unix tool whose reader left: Note [A closed stdout is not an error]."""
    import signal

    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGPIPE])
    os.kill(os.getpid(), signal.SIGPIPE)
    os._exit(128 + signal.SIGPIPE)  # not reached: the signal kills us (os._exit flushes nothing)


def print_or_leave(text: str) -> int:
    """Print ``text`` to stdout; 0, or leave quietly if nobody reads it any more."""
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError as err:
        if not stdout_closed(err):
            raise
        leave_for_closed_stdout()
    return 0
