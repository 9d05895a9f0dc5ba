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

    children.expect(program)                 # a program ran in this context (a Warm says so)
    if children.wants_spare(): children.fork_spare(in_child)   # idle: the next run's child, ahead
    children.drop_spare()                    # the interpreter is about to change what it holds

Note [A run's child is forked ahead]
A run forked from a warm interpreter begins its loads within milliseconds of the fork, and its
first hits paid for everything they touched first: each page of the interpreter's they wrote
(reference counts, allocator pools, the bytecode specialised on first calls) a copy-on-write
fault, thousands for the ControlNet pattern's four loads, and those hits took about twice what
the same hits take later in the same process (``overmind-bench --scenarios controlnet``
measures them). So once a run has ended and the interpreter is idle, it forks the next run's
child ahead (``fork_spare``); the spare rebuilds and drops what the last run's program loaded
(overmind.client.rehearsal, a lookup the server counts as no hit) under SCHED_IDLE where that
can be lifted, and waits. The next run is handed to it (``Fork`` on its socket, with the run's
stdio and pipes) and it becomes the run as a fresh child does, its caller's ``oom_score_adj``
taken by itself (Note [The cache dies first] in overmind.warm.oom: the lowest it may set is its
parent's). A run that comes while the spare still rehearses is forked afresh, and the spare is
kept for the run after (it yields the CPU to that run meanwhile). A spare the interpreter's
holdings moved past (it imported, indexed or primed since the fork, or a fill ended:
``drop_spare``), one whose rehearsal imported a module (named back, for the interpreter to
learn; the run would hold code the interpreter never checked: Note [Warm interpreters] in
overmind.warm.interpreter) or said something (a warning or log record the run would then never
show) is killed, and runs are forked as before. What a run can tell: its CPU time and start
time include the rehearsal's.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import signal
import socket
import sys
from typing import Callable

from overmind.shared import protocol as P
from overmind.warm import pytest_runs
from overmind.warm import oom
from overmind.warm.oom import CannotMatch

logger = logging.getLogger(__name__)

__all__ = ["Children"]

MAX_REPORT = 4 << 20  # bytes of a run's module report
MAX_REASON = 4096  # bytes of a child's reason for not taking on its caller's traits
MAX_SPARE_WORD = 1 << 20  # bytes of a spare's word when its rehearsal ended


class _RunChild:
    def __init__(self, conn: socket.socket, report: int) -> None:
        self.conn = conn
        self.report = report  # read end of the child's module report pipe, -1 once read
        self.data = bytearray()
        self.front_end_gone = False


class _Spare:
    def __init__(self, pid: int, sock: socket.socket, program: str) -> None:
        self.pid = pid
        self.program = program
        self.sock = sock  # ours: its word when rehearsed, then the run it becomes
        self.word = bytearray()
        self.ready = False


class Children:
    def __init__(self) -> None:
        self.runs: dict[int, _RunChild] = {}
        self.loads: set[int] = set()
        self.spare: _Spare | None = None  # Note [A run's child is forked ahead]
        self.ahead: str | None = None  # the program whose next run to fork ahead, while none is

    def busy(self) -> bool:
        return bool(self.runs or self.loads)

    def watched(self) -> list:
        """What to select on for them: each run's front end, its module report until read, and
        the spare until it is ready."""
        spare = [self.spare.sock] if self.spare is not None and not self.spare.ready else []
        return [c.conn for c in self.runs.values() if not c.front_end_gone] + \
            [c.report for c in self.runs.values() if c.report >= 0] + spare

    def readable(self, ready: list) -> list:
        """Read what came; the modules a spare's rehearsal imported (for the interpreter to learn)."""
        for pid, child in list(self.runs.items()):
            if child.report >= 0 and child.report in ready:
                _read_report(child)
            if child.conn in ready and not child.front_end_gone:
                _front_end_gone(pid, child)
        spare = self.spare
        if spare is None or spare.ready or spare.sock not in ready:
            return []
        try:
            chunk = spare.sock.recv(65536)
        except OSError:
            chunk = b""
        spare.word += chunk
        if chunk and not spare.word.endswith(b"\n") and len(spare.word) < MAX_SPARE_WORD:
            return []
        try:
            word = json.loads(bytes(spare.word)) if chunk else None
        except ValueError:
            word = None
        if isinstance(word, dict) and word.get("pristine") is True and not word.get("imported"):
            spare.ready = True
            logger.debug("the next run's child %d is ready", spare.pid)
            return []
        logger.debug("the next run's child %d is not used: %s", spare.pid, bytes(spare.word[:200]))
        self.drop_spare(again=False)
        imported = word.get("imported") if isinstance(word, dict) else None
        return [n for n in imported if isinstance(n, str)] if isinstance(imported, list) else []

    def wants_spare(self) -> bool:
        return self.ahead is not None and self.spare is None

    def expect(self, program: object) -> None:
        """``program`` ran in this context: fork its next run's child ahead, once idle."""
        if isinstance(program, str) and program:
            self.ahead = program

    def fork_spare(self, in_child: Callable[[], None]) -> None:
        """Note [A run's child is forked ahead]: fork the next run's child now, to rehearse ``self.ahead``."""
        self.drop_spare(again=False)
        program, self.ahead = self.ahead or "", None
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        gc.freeze()  # Note [Frozen before forking] in overmind.warm.interpreter
        pid = os.fork()
        if pid == 0:
            try:
                in_child()
                ours.close()
                _spare_main(theirs, program)
            finally:
                os._exit(1)
        theirs.close()
        self.spare = _Spare(pid, ours, program)
        logger.debug("forked the next run's child %d ahead, to rehearse %s", pid, program[:16] or "nothing")

    def drop_spare(self, again: bool = True) -> None:
        """Kill the spare, if any (reap() reaps it); ``again``: fork another once idle."""
        spare, self.spare = self.spare, None
        if spare is None:
            return
        if again:
            self.ahead = self.ahead or spare.program
        try:
            os.kill(spare.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        spare.sock.close()

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
            if self.spare is not None and pid == self.spare.pid:
                self.spare.sock.close()
                self.spare = None
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
        pid = self._hand_to_spare(fork, [stdin, stdout, stderr, report_w, matched_w])
        if pid < 0:
            gc.freeze()  # Note [Frozen before forking] in overmind.warm.interpreter
            pid = os.fork()
        if pid == 0:
            try:
                in_child()
                conn.close()
                os.close(report_r)
                os.close(matched_r)
                _become_run(fork.spec, stdin, stdout, stderr, report_w, matched_w)
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
        self.expect(_program(fork.spec))  # Note [A run's child is forked ahead]
        os.set_blocking(report_r, False)
        self.runs[pid] = _RunChild(conn, report_r)
        try:
            conn.settimeout(5.0)
            P.send_message(conn, P.RunStarted(pid))
        except OSError:
            pass
        return pid

    def _hand_to_spare(self, fork: P.Fork, fds: list[int]) -> int:
        """The spare's pid, now running ``fork`` (Note [A run's child is forked ahead]); -1 when
        there is no spare ready (one still rehearsing is kept for the run after)."""
        spare = self.spare
        if spare is None or not spare.ready:
            return -1
        self.spare = None
        try:
            spare.sock.settimeout(5.0)
            P.send_message(spare.sock, fork, fds=fds)
            spare.sock.close()
            logger.debug("run handed to the child %d forked ahead", spare.pid)
            return spare.pid
        except OSError:  # it died: the run is forked afresh
            self.spare = spare
            self.drop_spare(again=False)
            return -1

    def close_in_child(self) -> None:
        """In a freshly forked child: the fds of its siblings are not its own."""
        for child in self.runs.values():
            child.conn.close()
            if child.report >= 0:
                os.close(child.report)
        if self.spare is not None:
            self.spare.sock.close()
            self.spare = None


def _program(spec: object) -> str:
    """The program (Note [Prefetch] in overmind.client.prefetch) of the run ``spec`` describes: its
    script, or the file ``-m`` runs (found without importing anything); "" for ``-c``."""
    from overmind.shared.protocol.contexts import program_of

    mode, target, cwd = (spec.get(k) for k in ("mode", "target", "cwd")) if isinstance(spec, dict) else (None,) * 3
    if not (isinstance(target, str) and isinstance(cwd, str)):
        return ""
    try:
        return program_of(target if mode == "script" else _module_file(target, cwd) if mode == "module" else "", cwd)
    except (OSError, ImportError, ValueError):
        return ""


def _module_file(name: str, cwd: str) -> str:
    """What ``python -m name`` in ``cwd`` runs, as runpy names it in ``sys.argv[0]``: the module's
    file, or its package's ``__main__``. Only folders are searched: no package is imported."""
    from importlib.machinery import PathFinder

    search, spec = [cwd, *sys.path], None
    parts = name.split(".")
    for i in range(len(parts)):
        spec = PathFinder.find_spec(".".join(parts[:i + 1]), search)
        if spec is None:
            return ""
        search = list(spec.submodule_search_locations or [])
        if i < len(parts) - 1 and not search:
            return ""
    if search:  # a package
        spec = PathFinder.find_spec(f"{name}.__main__", search)
    return spec.origin if spec is not None and spec.origin else ""


def _become_run(spec: dict, stdin: int, stdout: int, stderr: int, report_w: int, matched_w: int) -> None:
    """In a run's child (forked now, or ahead): become the caller's process and run ``spec``."""
    _take_on_caller(spec, matched_w)
    _report_modules_at_exit(report_w)
    from overmind.warm.script import become

    become(spec, stdin, stdout, stderr)


def _spare_main(sock: socket.socket, program: str) -> None:
    """The spare: rehearse, say so, and become the run that comes (Note [A run's child is forked ahead])."""
    from overmind.api import rehearse_program  # the interpreter holds it (prepare_hit_path)
    from overmind.shared.process import priority

    before = set(sys.modules)
    lifted = priority.can_lift_idle()
    pristine = False
    try:
        if lifted:
            priority.to_idle(0)
        pristine = rehearse_program(program)
    except Exception:  # noqa: BLE001 - a spare that did not rehearse is one the interpreter kills
        pass
    finally:
        if lifted:
            priority.to_normal(0)
    imported = [n for n in sys.modules if n not in before]
    sock.sendall(json.dumps({"pristine": pristine, "imported": imported}).encode() + b"\n")
    if imported or not pristine:
        return
    sock.settimeout(None)
    try:
        message, _, fds = P.recv_message(sock)
    except (EOFError, OSError, P.ProtocolError):
        return  # the interpreter is gone, or killed us first
    if not isinstance(message, P.Fork) or len(fds) != 5:
        P.close_fds(fds)
        return
    sock.close()
    stdin, stdout, stderr, report_w, matched_w = fds
    score = message.spec.get("oom_score_adj") if isinstance(message.spec, dict) else None
    if isinstance(score, int):
        try:
            oom.take_score(score)
        except CannotMatch as err:
            os.write(matched_w, str(err).encode(errors="replace")[:MAX_REASON])
            return
    _become_run(message.spec, stdin, stdout, stderr, report_w, matched_w)


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
