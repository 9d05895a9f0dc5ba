"""A run's child becomes the script: the process ``overmind run`` forks from a warm interpreter turns into ``python SCRIPT``.

A warm interpreter is a long-lived interpreter (started as ``python [options] -c CODE``) that has already
imported torch and the other installed modules of its context. Per run it forks; the child
calls ``become()`` with the caller's stdio fds and command line, and from then on is, as nearly
as a forked process can be, the ``python`` the user would have started from their shell::

    pid = os.fork()
    if pid == 0:
        warm.become({"mode": "script", "target": "train.py", "argv": ["--epochs", "3"],
                     "cwd": "/home/me/proj", "env": caller_env, "umask": 0o022},
                    stdin_fd, stdout_fd, stderr_fd)          # never returns
    _, wait_status = os.waitpid(pid, 0)

    warm.installed_modules()   # at the end of a run: what the next warm interpreter should pre-import

The spec is a ``RunSpec`` on the wire (overmind.shared.protocol.contexts): mode, target, argv, cwd, the
whole environment, umask and the signals the caller's shell ignored.

What the warm interpreter must do: ``gc.freeze()`` before each fork (a run's garbage collections and its
exit then never walk, or copy, the warm interpreter's pages); register no atexit callback (the child
inherits it); configure logging only on the ``overmind`` logger, which ``become`` gives back to the
run as plain python has it; keep no threads.

Note [What a warm run cannot make identical]
A fork inherits what no Python code can undo; these differ from a fresh ``python``:
- The string hash seed (PYTHONHASHSEED) is drawn when the warm interpreter starts: ``hash("x")`` and the
  order of a set of strings repeat in every run of one warm interpreter.
- ASLR is decided at exec: every run of one warm interpreter has the same library, heap and stack
  addresses, so ``id()`` values and default reprs repeat.
- What CPython reads once, at start: ``sys.flags``, ``sys._xoptions``, ``sys.warnoptions``, the
  filesystem encoding and ``open()``'s UTF-8 mode, sys.path from PYTHONPATH and site. The
  server keys warm interpreters on those variables (``ENV_NAMES``: Note [Environment that selects an
  interpreter] in overmind.shared.settings.config).
- Pre-imported modules stay imported, and their import-time work happened in the warm interpreter: its
  output and warnings went to the warm interpreter's log, module constants read the warm interpreter's environment
  (huggingface_hub.constants, libgomp's OMP_NUM_THREADS) and clock (logging's relativeCreated
  counts from the warm interpreter's import); the server keys warm interpreters on that environment too. The
  atexit callbacks they registered run at the end of every run, as after the same imports;
  their weakref.finalize callbacks do not (Note [The warm interpreter's finalizers stay the warm interpreter's]).
- The parent is the warm interpreter, not the shell. There is no controlling terminal (the warm interpreter left
  its session, and the user's terminal is the shell session's), so ``open("/dev/tty")``
  fails. ``/proc/self/cmdline`` and ``ps`` show the warm interpreter's command line and
  ``/proc/self/environ`` its first environment; rlimits, nice, cgroup are the warm interpreter's; the
  signal mask starts empty; fds the warm interpreter holds stay open (close-on-exec, so they never reach
  a program the run executes).
- A run whose PYTHONFAULTHANDLER turns faulthandler on turns it on after the signal module
  started: ``signal.getsignal()`` says SIG_DFL, not None, for the signals it catches.
- Module teardown is not replayed at exit: __main__'s globals are released (their ``__del__``
  runs) and every file left open is flushed, but objects held only by other modules are not
  finalized (Note [Output is never lost at exit] in overmind.shared.process.teardown).
- torch (2.13) seeds its default CPU generator from OS entropy at start, so ``torch.randn(3)``
  of a fresh interpreter is already unrepeatable; a run reseeds it the same way.
"""

from __future__ import annotations

import atexit
import builtins
import faulthandler
import fcntl
import gc
import importlib
import importlib.machinery
import importlib.util
import logging
import marshal
import os
import runpy
import signal
import sys
import time
import traceback
import types
from typing import Callable, NoReturn

from overmind.shared.process import teardown
from overmind.shared.protocol.contexts import RunSpec, mark_warm_run
from overmind.warm import startup
from overmind.warm.installed import RUN_FOLDERS, installed_modules  # noqa: F401  (installed_modules: re-exported)

__all__ = ["become", "installed_modules"]

# Frames of this file are cut from the user's tracebacks: plain python has none above <module>.
_THIS_FILE = (lambda: None).__code__.co_filename
# Note [Warm interpreter stdio is never flushed in the child]
# The warm interpreter's sys.std* objects may hold bytes meant for the warm interpreter's log. Flushed after the
# dup2, or collected (which flushes), they would land in the user's output: the child keeps
# them alive and untouched here until os._exit.
_INTERPRETER_STREAMS: list = []


def become(spec: dict, stdin_fd: int, stdout_fd: int, stderr_fd: int) -> NoReturn:
    """In a freshly forked child: turn this process into `python <spec>` and run it; never returns (os._exit)."""
    status = 1
    try:
        # Note [Signals held during set-up]
        # The warm interpreter's handlers are the warm interpreter's Python code: run here, they would do the
        # warm interpreter's work in the user's process. Every signal stays blocked until the user's code
        # starts; one that arrived meanwhile is delivered then, as to a python just starting.
        signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
        _install_fds(stdin_fd, stdout_fd, stderr_fd)
        run = RunSpec.from_wire(spec)
        mark_warm_run()  # monkey_patch_all() asks for no interpreter of its own (overmind.api._prepare)
        teardown.exit_handled_elsewhere()  # _finalize leaves; monkey_patch_all() adds nothing
        try:
            importer = _prepare(run)
        except BaseException as exc:  # noqa: BLE001 - no user code ran yet: start it cold
            _cold_start(run, exc)
        status = _execute(run, importer)
    except BaseException as exc:  # noqa: BLE001 - last resort: say why on whatever fd 2 is
        try:
            os.write(2, f"overmind: warm run failed: {exc!r}\n".encode(errors="replace"))
        except OSError:
            pass
    finally:
        os._exit(status & 0xFF)


# --------------------------------------------------------------------------- set-up

def _command(run: RunSpec) -> list[str]:
    """The equivalent plain python's ``sys.orig_argv``."""
    return [sys.orig_argv[0] if sys.orig_argv else sys.executable, *startup.interpreter_options(), *run.options,
            *{"code": ["-c"], "module": ["-m"], "script": []}[run.mode], run.target, *run.argv]


def _install_fds(stdin_fd: int, stdout_fd: int, stderr_fd: int) -> None:
    sources = (stdin_fd, stdout_fd, stderr_fd)
    # A source may sit on 0-2 itself (stdin_fd == 1): park all above 2 before any dup2.
    parked = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3) for fd in sources]
    for target, fd in enumerate(parked):
        os.dup2(fd, target)  # inheritable, as a shell leaves 0-2 to what it starts
    for fd in {*parked, *(fd for fd in sources if fd > 2)}:
        os.close(fd)


def _prepare(run: RunSpec) -> bool:
    """Everything before the user's code, in CPython's start-up order where it matters.
    True when the script is a directory or zip file with a __main__.py."""
    _reset_signals(run.ignored_signals)
    os.setpgid(0, 0)  # lead a process group: the front end forwards terminal signals to it
    os.environ.clear()  # through os.environ, so that os.environ and the C environ stay one
    os.environ.update(run.env)
    os.chdir(run.cwd)
    os.umask(run.umask)
    utf8, ctype = startup.apply_locale(run.env)
    startup.install_stdio(run.env, utf8, ctype, keep=_INTERPRETER_STREAMS, options=run.options)
    if ctype == "C" and startup.pyenv(run.env, "PYTHONCOERCECLOCALE") == "warn":
        sys.stderr.write(startup.C_LOCALE_WARNING)  # left uncoerced (LC_ALL is set): CPython says so
    _reset_interpreter_state(run.env)
    _reseed()
    return _set_argv_and_path(run)


def _reset_signals(ignored: frozenset[int]) -> None:
    """Dispositions as CPython leaves them at start, over what the caller ignored."""
    for sig in signal.valid_signals() - {signal.SIGKILL, signal.SIGSTOP}:
        if sig in ignored:
            want = signal.SIG_IGN  # CPython keeps an inherited SIG_IGN, even for SIGINT
        elif sig == signal.SIGINT:
            want = signal.default_int_handler
        elif sig in (signal.SIGPIPE, signal.SIGXFSZ):
            want = signal.SIG_IGN  # CPython ignores these at start
        else:
            want = signal.SIG_DFL
        current = signal.getsignal(sig)
        # None is a C handler from before CPython started; SIG_DFL may hide one a C extension
        # installed since. Both belong to the modules, as after the same imports in a fresh
        # python: only what Python code changed is put back.
        if current is not None and current != want:
            signal.signal(sig, want)
    signal.set_wakeup_fd(-1)


def _reset_interpreter_state(env: dict[str, str]) -> None:
    """State a fresh interpreter derives from this run's environment and cwd, or starts empty."""
    sys.dont_write_bytecode = startup.run_flag("B", "PYTHONDONTWRITEBYTECODE", env)
    if "int_max_str_digits" not in sys._xoptions:
        digits = startup.pyenv(env, "PYTHONINTMAXSTRDIGITS")
        sys.set_int_max_str_digits(int(digits) if digits else sys.int_info.default_max_str_digits)
    for name in ("last_type", "last_value", "last_traceback"):
        sys.__dict__.pop(name, None)
    if "faulthandler" in sys._xoptions or startup.pyenv(env, "PYTHONFAULTHANDLER"):
        faulthandler.enable(file=sys.stderr, all_threads=True)
    elif faulthandler.is_enabled():
        faulthandler.disable()
    time.tzset()  # time.timezone and tzname were computed from the warm interpreter's TZ
    gc.enable()  # the gc.freeze() recipe runs a warm interpreter with gc disabled
    if (tempfile := sys.modules.get("tempfile")) is not None:
        tempfile.tempdir = None  # cached from the warm interpreter's TMPDIR (torch's import asks)
    if (mp_process := sys.modules.get("multiprocessing.process")) is not None:
        # Set when the warm interpreter imported multiprocessing: ORIGINAL_DIR replaces '' in the sys.path
        # of a spawned child, and no two runs may share an authkey.
        mp_process.ORIGINAL_DIR = os.path.abspath(os.getcwd())
        mp_process.current_process().authkey = os.urandom(32)
    if (warnings := sys.modules.get("warnings")) is not None:
        warnings._filters_mutated()  # forget which warnings were shown already
        warnings.onceregistry.clear()
    if (weakref := sys.modules.get("weakref")) is not None:
        # Note [The warm interpreter's finalizers stay the warm interpreter's]
        # weakref.finalize callbacks registered in the warm interpreter act on the warm interpreter's objects,
        # some of them shared with every run (a temporary directory made at import): run at
        # a child's exit they would destroy them. The rest only free the child's own copy of
        # memory (torch deregisters its 130 op libraries, 30 ms). The run's own still run.
        for finalizer in list(weakref.finalize._registry):
            finalizer.atexit = False
    importlib.invalidate_caches()  # directory listings cached by the warm interpreter's imports
    ours = logging.getLogger("overmind")  # the warm interpreter's, to the server's log (_log_to_server)
    for handler in list(ours.handlers):
        ours.removeHandler(handler)
    ours.setLevel(logging.NOTSET)
    ours.propagate = True


def _reseed() -> None:
    """Random state as fresh as a new interpreter's (os.register_at_fork hooks already ran)."""
    if (random := sys.modules.get("random")) is not None:
        random.seed()  # the hidden Random instance behind random.random() and friends
    if (np_random := sys.modules.get("numpy.random")) is not None:
        np_random.seed()
    if (torch := sys.modules.get("torch")) is not None and hasattr(torch, "default_generator"):
        # A fresh torch seeds it from OS entropy (initial_seed() differs in every interpreter);
        # seed() does the same and drops the cached normal samples too.
        torch.default_generator.seed()


def _script_path(target: str) -> str:
    # CPython joins, never normalises: cwd "/" and "tmp/x.py" give __file__ "//tmp/x.py".
    return target if os.path.isabs(target) else os.getcwd() + "/" + target


def _is_importer_path(path: str) -> bool:
    """A directory or zip file, run as ``python DIR`` runs one (its __main__.py)."""
    for hook in sys.path_hooks:
        try:
            hook(path)
            return True
        except ImportError:
            pass
    return False


def _set_argv_and_path(run: RunSpec) -> bool:
    # Note [sys.path[0] of a run]
    # The warm interpreter's own sys.path[0] is the '' of its `python -c`: it goes. A plain python puts
    # there: for -c '', for -m the full cwd, for a script the real directory of the script
    # (symlinks resolved), for a directory or zip file run as a script the path itself.
    # PYTHONSAFEPATH (-P) adds nothing, except that directory or zip file.
    if sys.path and sys.path[0] == "" and not sys.flags.safe_path:
        del sys.path[0]
    sys.orig_argv = _command(run)
    if run.mode == "code":
        sys.argv, path0 = ["-c", *run.argv], ""
    elif run.mode == "module":
        sys.argv, path0 = ["-m", *run.argv], os.getcwd()  # runpy puts the module's file there
    else:
        sys.argv, path = [run.target, *run.argv], _script_path(run.target)
        if _is_importer_path(path):
            sys.path.insert(0, path)
            RUN_FOLDERS.append(path)
            return True
        path0 = os.path.dirname(os.path.realpath(path))
    RUN_FOLDERS.append(path0 or os.getcwd())
    if not startup.run_flag("PI", "PYTHONSAFEPATH", run.env):
        sys.path.insert(0, path0)
    return False


def _cold_start(run: RunSpec, exc: BaseException) -> NoReturn:
    """Note [Never worse than no cache]: set-up failed before any user code ran, so exec the
    plain interpreter with the same command line. It behaves as python does, failures
    included: a PYTHONIOENCODING naming no codec stops it with python's own message."""
    os.write(2, f"overmind: warm start failed ({exc!r}); starting a cold python\n".encode(errors="replace"))
    try:
        os.chdir(run.cwd)
        os.umask(run.umask)
        for sig in (signal.SIGPIPE, signal.SIGXFSZ):  # exec keeps a SIG_IGN
            signal.signal(sig, signal.SIG_IGN if sig in run.ignored_signals else signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, [])  # and the mask
        os.execve(sys.executable, _command(run), run.env)
    except (OSError, ValueError) as err:
        os.write(2, f"overmind: cannot start python: {err}\n".encode(errors="replace"))
    os._exit(1)


# --------------------------------------------------------------------------- running

def _fresh_main() -> types.ModuleType:
    """__main__ as CPython's add_main_module() makes it, in sys.modules: classes the script
    defines pickle by reference, and multiprocessing's spawn finds the script."""
    main = types.ModuleType("__main__")
    main.__loader__ = importlib.machinery.BuiltinImporter
    main.__annotations__ = {}
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    return main


def _script_body(main: types.ModuleType, path: str) -> Callable[[], None]:
    """Run a file as CPython's _PyRun_SimpleFileObject does; OSError if it cannot be read."""
    with open(path, "rb") as f:
        data = f.read()
    magic = importlib.util.MAGIC_NUMBER
    compiled = path.endswith(".pyc") or data[:2] == magic[:2]
    main.__file__, main.__cached__ = path, None
    machinery = importlib.machinery
    main.__loader__ = (machinery.SourcelessFileLoader if compiled else machinery.SourceFileLoader)("__main__", path)

    def body() -> None:
        if not compiled:
            # dont_inherit: this module's `from __future__ import annotations` must not leak.
            code = compile(data, path, "exec", dont_inherit=True)
        elif data[:4] == magic:
            code = marshal.loads(data[16:])
        else:
            raise RuntimeError("Bad magic number in .pyc file")
        exec(code, main.__dict__)
    return body


def _main_body(run: RunSpec, importer: bool) -> tuple[types.ModuleType, Callable[[], None] | None]:
    """The fresh __main__ and what runs in it; None for a script that cannot be opened."""
    main = _fresh_main()
    if run.mode == "code":
        code = run.target
        return main, lambda: exec(compile(code, "<string>", "exec", dont_inherit=True), main.__dict__)
    if run.mode == "module":
        return main, lambda: runpy._run_module_as_main(run.target)
    if importer:
        return main, lambda: runpy._run_module_as_main("__main__", alter_argv=False)
    path = _script_path(run.target)
    try:
        return main, _script_body(main, path)
    except OSError as err:
        print(f"{sys.orig_argv[0]}: can't open file {path!r}: [Errno {err.errno}] {err.strerror}",
              file=sys.stderr)
        return main, None


def _execute(run: RunSpec, importer: bool) -> int:
    """Note [Exit like Py_RunMain]
    Run the user's code and leave as CPython's Py_RunMain does: SystemExit(code) gives code
    (None 0, an int itself, anything else printed to stderr and 1); another uncaught exception
    goes to sys.excepthook and gives 1; then threading._shutdown() waits for non-daemon threads,
    atexit callbacks run, stdout and stderr are flushed (a failure is reported as unraisable and
    gives 120). An uncaught KeyboardInterrupt then ends in death by SIGINT, as since 3.8."""
    main, body = _main_body(run, importer)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])  # Note [Signals held during set-up]
    sigint, status = False, 2
    if body is not None:
        try:
            body()
        except SystemExit as exc:
            status = _system_exit_status(exc)
        except BaseException as exc:  # noqa: BLE001 - what the interpreter itself catches
            sigint = isinstance(exc, KeyboardInterrupt)
            status = _print_uncaught(exc)
            _forget_script_file(main)
        else:
            status = 0
            _forget_script_file(main)
    del main, body
    status = _finalize(status)
    if sigint:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        status = 128 + signal.SIGINT  # still alive: the user's code blocked SIGINT
    return status


def _forget_script_file(main: types.ModuleType) -> None:
    # CPython drops these once a script has run, but not on sys.exit(): the atexit callbacks
    # of a plain python see no __main__.__file__ after a normal end.
    main.__dict__.pop("__file__", None)
    main.__dict__.pop("__cached__", None)


def _system_exit_status(exc: SystemExit) -> int:
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code if -2**63 <= code < 2**63 else -1  # CPython: (int)PyLong_AsLong(code)
    try:
        sys.stderr.write(str(code))
        sys.stderr.write("\n")
    except BaseException:  # noqa: BLE001 - as CPython: nothing more to say
        pass
    return 1


def _user_traceback(tb: types.TracebackType | None) -> types.TracebackType | None:
    while tb is not None and tb.tb_frame.f_code.co_filename == _THIS_FILE:
        tb = tb.tb_next
    return tb


def _print_uncaught(exc: BaseException) -> int:
    """CPython's PyErr_Print(): sys.last_*, then sys.excepthook, and the hook's own failure."""
    exc.__traceback__ = _user_traceback(exc.__traceback__)
    sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, exc.__traceback__
    hook = getattr(sys, "excepthook", None)
    try:
        if hook is None:
            sys.stderr.write("sys.excepthook is missing\n")
            hook = sys.__excepthook__
        hook(type(exc), exc, exc.__traceback__)
    except SystemExit as exit_exc:
        return _system_exit_status(exit_exc)
    except BaseException as hook_exc:  # noqa: BLE001
        try:
            sys.stdout.flush()
            sys.stderr.write("Error in sys.excepthook:\n")
            sys.__excepthook__(type(hook_exc), hook_exc, _user_traceback(hook_exc.__traceback__))
            sys.stderr.write("\nOriginal exception was:\n")
            sys.__excepthook__(type(exc), exc, exc.__traceback__)
        except BaseException:  # noqa: BLE001
            pass
    return 1


def _write_unraisable(exc: BaseException, obj: object) -> None:
    """PyErr_WriteUnraisable(obj) for an exception raised outside the user's frames."""
    try:
        tb = _user_traceback(exc.__traceback__)
        if sys.unraisablehook is sys.__unraisablehook__:
            # The default hook takes only CPython's own argument type: write its format.
            lines = traceback.format_exception(type(exc), exc, tb)
            sys.stderr.write(f"Exception ignored in: {obj!r}\n" + "".join(lines))
            sys.stderr.flush()
        else:
            sys.unraisablehook(types.SimpleNamespace(
                exc_type=type(exc), exc_value=exc, exc_traceback=tb, err_msg=None, object=obj))
    except BaseException:  # noqa: BLE001 - an unraisable report never raises
        pass


def _flush_std(report: bool = True) -> bool:
    """CPython's flush_std_files(): False when a flush failed."""
    ok = True
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name, None)
        try:
            if stream is None or stream.closed:
                continue
        except BaseException:  # noqa: BLE001 - CPython skips a stream whose .closed fails
            continue
        try:
            stream.flush()
        except BaseException as exc:  # noqa: BLE001
            ok = False
            if report and name == "stdout":  # CPython is quiet about stderr's failure
                _write_unraisable(exc, stream)
    return ok


def _finalize(status: int) -> int:
    """Py_FinalizeEx's visible part: Note [Exit like Py_RunMain].

    os._exit() skips the teardown in which a fresh python closes what is still open. So after
    the flush, __main__'s globals are released as that teardown would (their __del__ runs),
    every file object the run left open is flushed (Note [Output is never lost at exit] in
    overmind.shared.process.teardown), and stdout and stderr once more."""
    if (threading := sys.modules.get("threading")) is not None:
        try:
            threading._shutdown()
        except BaseException as exc:  # noqa: BLE001 - CPython reports it and goes on
            _write_unraisable(exc, threading)
    try:
        atexit._run_exitfuncs()  # reports its callbacks' errors itself
    except BaseException:  # noqa: BLE001
        pass
    flushed = _flush_std()
    if not flushed:
        status = 120
    _release_main(threading)
    _flush_left_open()
    # What __del__ printed. CPython flushes it as it destroys the streams, which can only
    # report an error, and only if the first flush did not fail already.
    _flush_std(report=flushed)
    return status


def _release_main(threading: types.ModuleType | None) -> None:
    """Release __main__'s globals as CPython's teardown does (Note [Output is never lost at exit])."""
    if threading is not None and threading.active_count() > 1:
        return  # a daemon thread may still use them (a fresh python would freeze it first)
    try:
        for name in ("last_type", "last_value", "last_traceback"):  # their frames hold __main__
            sys.__dict__.pop(name, None)
        main = sys.modules.pop("__main__", None)
        if isinstance(main, types.ModuleType):
            # As _PyModule_ClearDict: one value at a time, so that each object dies by its
            # reference count, in order. Left to the cycle collector (a function and its
            # globals are a cycle), a file's FileIO can be finalized before the buffer that
            # writes into it, and the buffered bytes are lost.
            namespace = main.__dict__
            for key in [k for k in namespace if isinstance(k, str) and k[:1] == "_" and k[1:2] != "_"]:
                namespace[key] = None
            for key in [k for k in namespace if k != "__builtins__"]:
                namespace[key] = None
            del main, namespace
        gc.collect()
    except BaseException:  # noqa: BLE001 - CPython reports a __del__ error itself
        pass


def _flush_left_open() -> None:
    """Flush the files the run left open (Note [Output is never lost at exit] in
    overmind.shared.process.teardown). What the warm interpreter froze with gc.freeze() is not even looked at."""
    skip = {id(s) for s in _INTERPRETER_STREAMS} | {id(getattr(s, "buffer", None)) for s in _INTERPRETER_STREAMS}
    skip |= {id(sys.stdout), id(sys.stderr)}  # _flush_std's
    teardown.flush_left_open(skip)
