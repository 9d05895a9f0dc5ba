"""The loads and runs a warm interpreter forked and has not reaped yet.

    children = Children()
    pid = children.fork_job(job, blob, job_fd, in_child)     # a cold load (overmind.warm.loader)
    pid = children.spawn_job(job, blob, job_fd, env)         # the same, in a fresh interpreter
    pid = children.fork_run(fork, fds, in_child)             # a run (overmind.warm.script)
    select(children.watched() + ...); children.readable(ready)
    for names in children.reap(): ...                        # modules each ended run imported

A run's child writes, at its exit, the installed modules it imported to a pipe (Note [Warm
interpreters learn] in overmind.warm.interpreter); its front end's connection tells us when
the front end is gone (then so is the run), and gets ``RunStarted`` and ``RunExited``.
``in_child`` is the interpreter's: what a child closes of its parent's right after the fork.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import socket
import sys
from typing import Callable

from overmind.shared import protocol as P
from overmind.warm import pytest_runs
from overmind.warm.oom import CannotMatch

__all__ = ["Children"]

MAX_REPORT = 4 << 20  # bytes of a run's module report
MAX_REASON = 4096  # bytes of a child's reason for not taking on its caller's traits


class _RunChild:
    def __init__(self, conn: socket.socket, report: int) -> None:
        self.conn = conn
        self.report = report  # read end of the child's module report pipe, -1 once read
        self.data = bytearray()
        self.front_end_gone = False


class Children:
    def __init__(self) -> None:
        self.runs: dict[int, _RunChild] = {}
        self.loads: set[int] = set()

    def busy(self) -> bool:
        return bool(self.runs or self.loads)

    def watched(self) -> list:
        """What to select on for them: each run's front end, and its module report until read."""
        return [c.conn for c in self.runs.values() if not c.front_end_gone] + \
            [c.report for c in self.runs.values() if c.report >= 0]

    def readable(self, ready: list) -> None:
        for pid, child in list(self.runs.items()):
            if child.report >= 0 and child.report in ready:
                _read_report(child)
            if child.conn in ready and not child.front_end_gone:
                _front_end_gone(pid, child)

    def reap(self) -> list[list]:
        """Reap what ended, telling each run's front end its status; the module lists they reported."""
        reported = []
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return reported
            if pid == 0:
                return reported
            self.loads.discard(pid)
            child = self.runs.pop(pid, None)
            if child is None:
                continue
            if child.report >= 0:
                _read_report(child, final=True)
            try:
                child.conn.settimeout(5.0)
                P.send_message(child.conn, P.RunExited(status))
            except OSError:
                pass
            child.conn.close()
            try:
                names = json.loads(bytes(child.data)) if child.data else []
            except ValueError:
                continue
            if isinstance(names, list):
                reported.append(names)

    def kill_loads(self) -> None:
        """The server died: the loads have nowhere to send their result (Note [Retiring never kills work])."""
        for pid in self.loads:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def fork_job(self, job: P.Job, blob: bytes, job_fd: int, in_child: Callable[[], None]) -> int:
        gc.freeze()  # Note [Frozen before forking] in overmind.warm.interpreter
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                in_child()
                from overmind.warm.loader import run_job

                try:
                    os.chdir(job.cwd)
                except OSError:
                    pass
                with socket.socket(fileno=job_fd) as job_sock:
                    code = run_job(job, blob, job_sock)
            finally:
                os._exit(code)
        os.close(job_fd)
        self.loads.add(pid)
        return pid

    def spawn_job(self, job: P.Job, blob: bytes, job_fd: int, env: dict) -> int:
        """A cold load in a fresh interpreter, for one that cannot fork (Note [A fill never waits
        for a fork] in overmind.warm.interpreter): the job is handed over on a socket pair."""
        from overmind.warm.startup import interpreter_options

        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            os.set_inheritable(theirs.fileno(), True)
            code = f"from overmind.warm.loader import spawned_main; spawned_main({theirs.fileno()})"
            pid = os.posix_spawn(sys.executable, [sys.executable, *interpreter_options(), "-c", code], env)
        finally:
            theirs.close()
        with ours:
            ours.settimeout(30.0)
            P.send_message(ours, job, blob, fds=[job_fd])
        os.close(job_fd)
        self.loads.add(pid)
        return pid

    def fork_run(self, fork: P.Fork, fds: list[int], in_child: Callable[[], None]) -> int:
        """The run's pid; -1 when its front end had already left (then nothing runs: never twice, never
        late); CannotMatch when the child could not become its caller's process (then nothing ran)."""
        stdin, stdout, stderr, conn_fd = fds
        conn = socket.socket(fileno=conn_fd)
        try:
            if conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b"":
                P.close_fds([stdin, stdout, stderr])
                conn.close()
                return -1
        except BlockingIOError:
            pass
        why = pytest_runs.refuses(fork.spec)
        if why:
            P.close_fds([stdin, stdout, stderr])
            conn.close()
            raise CannotMatch(why)
        report_r, report_w = os.pipe2(os.O_CLOEXEC)
        matched_r, matched_w = os.pipe2(os.O_CLOEXEC)
        gc.freeze()  # Note [Frozen before forking] in overmind.warm.interpreter
        pid = os.fork()
        if pid == 0:
            try:
                in_child()
                conn.close()
                os.close(report_r)
                os.close(matched_r)
                _take_on_caller(fork.spec, matched_w)
                _report_modules_at_exit(report_w)
                from overmind.warm.script import become

                become(fork.spec, stdin, stdout, stderr)
            finally:
                os._exit(1)
        os.close(matched_w)
        why = _read_all(matched_r)
        if why:  # it has exited, having run nothing: Note [A hand-over is the same process or none]
            os.close(report_r)
            os.close(report_w)
            P.close_fds([stdin, stdout, stderr])
            conn.close()
            os.waitpid(pid, 0)
            raise CannotMatch(why)
        P.close_fds([stdin, stdout, stderr, report_w])
        os.set_blocking(report_r, False)
        self.runs[pid] = _RunChild(conn, report_r)
        try:
            conn.settimeout(5.0)
            P.send_message(conn, P.RunStarted(pid))
        except OSError:
            pass
        return pid

    def close_in_child(self) -> None:
        """In a freshly forked child: the fds of its siblings are not its own."""
        for child in self.runs.values():
            child.conn.close()
            if child.report >= 0:
                os.close(child.report)


def _take_on_caller(spec: dict, matched_w: int) -> None:
    """In the run's child: become the caller's process (overmind.warm.match), closing ``matched_w``
    empty; or write why not to it and leave before anything of the run starts."""
    from overmind.shared.process.traits import Traits
    from overmind.warm.match import take_on

    traits = spec.get("traits") if isinstance(spec, dict) else None
    try:
        if traits is not None:
            take_on(Traits.from_wire(traits))
    except (CannotMatch, ValueError) as err:
        os.write(matched_w, str(err).encode(errors="replace")[:MAX_REASON])
        os._exit(1)
    os.close(matched_w)


def _read_all(fd: int) -> str:
    """What the child wrote before closing its end (it is quick: a few small reads and writes)."""
    data = b""
    try:
        while chunk := os.read(fd, 65536):
            data += chunk
    finally:
        os.close(fd)
    return data.decode(errors="replace")


def _read_report(child: _RunChild, final: bool = False) -> None:
    while True:
        try:
            chunk = os.read(child.report, 65536)
        except BlockingIOError:
            if not final:
                return
            chunk = b""
        if not chunk or len(child.data) > MAX_REPORT:
            os.close(child.report)
            child.report = -1
            return
        child.data += chunk


def _front_end_gone(pid: int, child: _RunChild) -> None:
    """The front end closed its connection (killed, or its terminal went away): so does the run."""
    try:
        if child.conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT):
            return  # it never sends anything; ignore stray bytes
    except BlockingIOError:
        return
    except OSError:
        pass
    child.front_end_gone = True
    for target in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
        try:
            target()
        except (ProcessLookupError, PermissionError):
            pass


def _report_modules_at_exit(fd: int) -> None:
    """At the run's exit (the first atexit callback, so it runs last): its installed modules."""
    import atexit

    held = frozenset(sys.modules)  # what the interpreter has already: only the rest is news

    def report() -> None:
        try:
            from overmind.shared.calls.compiled import USED, used
            from overmind.warm.installed import installed_modules

            news = not held.issuperset(sys.modules)
            names = installed_modules(skip=held) if news else []
            data = json.dumps(names + [USED] if used() else names).encode()
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        except Exception:  # noqa: BLE001 - learning is a bonus; the run's exit must not suffer
            pass
        finally:
            os.close(fd)

    atexit.register(report)
