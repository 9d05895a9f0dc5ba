"""The child side of ``overmind run``: a process forked from a warm zygote becomes ``python SCRIPT``.

A zygote is a long-lived interpreter that already imported torch and the other installed
modules its context uses. For each run it forks, and the child calls ``become()`` with the
caller's stdio fds and a spec of the command line; from then on the child is, as nearly as a
forked process can be, a fresh ``python`` started by the user from their shell::

    pid = os.fork()
    if pid == 0:
        warm.become({"mode": "script", "target": "train.py", "argv": ["--epochs", "3"],
                     "cwd": "/home/me/proj", "env": caller_env, "umask": 0o022},
                    stdin_fd, stdout_fd, stderr_fd)          # never returns
    _, wait_status = os.waitpid(pid, 0)

    warm.installed_modules()   # in a finished run: what the next zygote should pre-import

The spec (all JSON types): ``mode`` is "script", "module" or "code"; ``target`` the script path
as typed (sys.argv[0]), the module name or the code; ``argv`` the arguments after it; ``cwd``;
``env`` the whole environment; ``umask``; optional ``ignored_signals``, the signal numbers the
caller's shell had set to SIG_IGN (``nohup``, background jobs), which a plain python inherits.

Note [What a warm run cannot make identical]
A fork inherits what no Python code can undo. These differ from a fresh ``python``:
- String hashing: the hash seed (PYTHONHASHSEED) is drawn when the zygote starts, so
  ``hash("x")`` and the order of a set of strings repeat in every run of one zygote.
- Address-space layout: ASLR is decided at exec, so every run of one zygote has the same
  library, heap and stack addresses; ``id()`` values and reprs repeat.
- What the interpreter reads once, at start: ``sys.flags``, ``sys._xoptions``,
  ``sys.warnoptions``, the filesystem encoding and the UTF-8 mode of ``open()``, sys.path
  from PYTHONPATH/site. ``ZYGOTE_ENV`` lists those variables; the server keys zygotes on them.
- Pre-imported modules: ``sys.modules`` holds more than a fresh interpreter's, and their
  import-time work happened in the zygote: output and warnings went to the zygote's log,
  module constants read the zygote's environment (huggingface_hub.constants, libgomp's
  OMP_NUM_THREADS) and clock (``logging`` relativeCreated counts from the zygote's import).
  The server keys zygotes on the environment those read. Their atexit callbacks, registered
  in the zygote, run at the end of every run, as they would after the same imports.
- Process identity: the parent is the zygote, not the shell; there is no controlling terminal
  (the zygote left its session, and the user's terminal belongs to the shell's), so
  ``open("/dev/tty")`` fails; ``/proc/self/cmdline`` and ``ps`` show the zygote's command
  line and ``/proc/self/environ`` its first environment; rlimits, nice, cgroup and
  capabilities are the zygote's. The signal mask starts empty.
- A run whose PYTHONFAULTHANDLER turns faulthandler on gets it after the signal module
  started, so ``signal.getsignal()`` says SIG_DFL, not None, for SIGSEGV/SIGFPE/SIGABRT/
  SIGBUS/SIGILL (faulthandler catches them all the same).
- fds the zygote holds stay open in the child (close-on-exec, so they never reach a program
  the run executes).
- At exit, Python's module teardown is not replayed: ``__main__``'s globals are released and
  collected (so their ``__del__`` runs) and every file the run left open is flushed, but
  objects held only by other modules' globals are not finalized. See Note [Exit like Py_RunMain].
- torch 2.13 seeds its default CPU generator from OS entropy at start, so ``torch.randn`` of a
  fresh interpreter is itself unrepeatable; a run reseeds it the same way.
"""

from __future__ import annotations

import atexit
import builtins
import codecs
import fcntl
import gc
import io
import locale
import os
import signal
import sys
import traceback
import types
from dataclasses import dataclass
from typing import Callable, Iterable, NoReturn

__all__ = ["become", "installed_modules", "ZYGOTE_ENV"]

# Read by CPython only while it starts, so a run cannot honour a value that differs from its
# zygote's: a zygote serves only runs that agree with it on these.
ZYGOTE_ENV = frozenset({
    "PYTHONHASHSEED", "PYTHONPATH", "PYTHONHOME", "PYTHONPLATLIBDIR", "PYTHONNOUSERSITE",
    "PYTHONUSERBASE", "PYTHONOPTIMIZE", "PYTHONDEBUG", "PYTHONVERBOSE", "PYTHONWARNINGS",
    "PYTHONDEVMODE", "PYTHONTRACEMALLOC", "PYTHONPYCACHEPREFIX", "PYTHONMALLOC",
    "PYTHONMALLOCSTATS", "PYTHONWARNDEFAULTENCODING", "PYTHONNODEBUGRANGES", "PYTHONINSPECT",
    "PYTHONPROFILEIMPORTTIME", "PYTHONCASEOK", "PYTHONEXECUTABLE",
})

_MODES = ("script", "module", "code")
# PEP 538: the locales CPython coerces a legacy C locale to, in its order of preference.
_COERCION_TARGETS = ("C.UTF-8", "C.utf8", "UTF-8")
_COERCION_WARNING = ("Python detected LC_CTYPE=C: LC_CTYPE coerced to {} (set another locale "
                     "or PYTHONCOERCECLOCALE=0 to disable this locale coercion behavior).\n")
_C_LOCALE_WARNING = ("Python runtime initialized with LC_CTYPE=C (a locale with default ASCII "
                     "encoding), which may cause Unicode compatibility problems. Using C.UTF-8, "
                     "C.utf8, or UTF-8 (if available) as alternative Unicode-compatible locales is "
                     "recommended.\n")
# Frames of this file are cut from the user's tracebacks: plain python has none above <module>.
_THIS_FILE = (lambda: None).__code__.co_filename
# Note [Zygote stdio is never flushed in the child]
# The zygote's sys.std* objects may hold unflushed bytes meant for the zygote's log. Flushing
# them after the dup2 would put those bytes in the user's output; letting them be collected
# would flush them too. So the child keeps them alive here, untouched, until os._exit.
_ZYGOTE_STREAMS: list = []


@dataclass(frozen=True)
class _Run:
    mode: str
    target: str
    argv: list[str]
    cwd: str
    env: dict[str, str]
    umask: int
    ignored_signals: frozenset[int]


def become(spec: dict, stdin_fd: int, stdout_fd: int, stderr_fd: int) -> NoReturn:
    """In a freshly forked child: turn this process into `python <spec>` and run it; never returns (os._exit)."""
    status = 1
    try:
        # Note [Signals held during set-up]
        # The zygote's handlers are Python code of the zygote; a signal that ran one here would
        # do the zygote's work in the user's process. All signals stay blocked until the user's
        # code starts; one that arrived meanwhile is delivered then, as to a python that is
        # just starting.
        signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
        _install_fds(stdin_fd, stdout_fd, stderr_fd)
        run = _parse_spec(spec)
        try:
            importer = _prepare(run)
        except BaseException as exc:  # noqa: BLE001 - anything before user code: run it cold
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

def _parse_spec(spec: dict) -> _Run:
    def need(key: str, kind: type) -> object:
        value = spec.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise ValueError(f"run spec field {key!r} must be {kind.__name__}, got {value!r:.80}")
        return value

    mode, target = need("mode", str), need("target", str)
    if mode not in _MODES or not target:
        raise ValueError(f"run spec: mode must be one of {_MODES} with a target, got {mode!r}")
    argv, env = need("argv", list), need("env", dict)
    if not all(isinstance(a, str) for a in argv):
        raise ValueError("run spec field 'argv' must hold only strings")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise ValueError("run spec field 'env' must map strings to strings")
    ignored = spec.get("ignored_signals") or []
    return _Run(mode, target, list(argv), need("cwd", str), dict(env), need("umask", int),
                frozenset(int(s) for s in ignored))


def _install_fds(stdin_fd: int, stdout_fd: int, stderr_fd: int) -> None:
    sources = (stdin_fd, stdout_fd, stderr_fd)
    # A source may itself sit on 0-2 (stdin_fd == 1, say): park every source above 2 first so
    # no dup2 overwrites a source still to be copied.
    parked = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3) for fd in sources]
    for target, fd in enumerate(parked):
        os.dup2(fd, target)  # inheritable, as a shell leaves 0-2 to the programs it starts
    for fd in {*parked, *(fd for fd in sources if fd > 2)}:
        os.close(fd)


def _prepare(run: _Run) -> bool:
    """Everything before the user's code; True when the script is a directory or zip."""
    _reset_signals(run.ignored_signals)
    os.setpgid(0, 0)  # lead a process group: the front end forwards terminal signals to it
    os.environ.clear()  # through os.environ, so os.environ and the C environ stay one
    os.environ.update(run.env)
    os.chdir(run.cwd)
    os.umask(run.umask)
    utf8, ctype = _apply_locale(run.env)
    _install_stdio(run.env, utf8, ctype)
    if ctype == "C" and _pyenv(run.env, "PYTHONCOERCECLOCALE") == "warn":
        sys.stderr.write(_C_LOCALE_WARNING)  # not coerced (LC_ALL is set): CPython says so
    _reset_interpreter_state(run)
    _reseed()
    return _set_argv_and_path(run)


def _reset_signals(ignored: frozenset[int]) -> None:
    """Dispositions as CPython sets them at start over what the caller ignored."""
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        if sig in ignored:
            want = signal.SIG_IGN  # CPython keeps an inherited SIG_IGN, SIGINT included
        elif sig == signal.SIGINT:
            want = signal.default_int_handler
        elif sig in (signal.SIGPIPE, signal.SIGXFSZ):
            want = signal.SIG_IGN  # CPython ignores these at start
        else:
            want = signal.SIG_DFL
        try:
            current = signal.getsignal(sig)
        except ValueError:
            continue
        # None is a C handler installed before CPython started; SIG_DFL may also hide one a C
        # extension installed later (CPython does not see it). Those belong to the modules,
        # as they would after the same imports: only what differs from the wish is reset.
        if current is None or current == want:
            continue
        try:
            signal.signal(sig, want)
        except (OSError, ValueError, RuntimeError):
            pass
    signal.set_wakeup_fd(-1)


def _pyenv(env: dict[str, str], name: str) -> str | None:
    """A PYTHON* variable as CPython reads it: ignored under -E/-I, empty means unset."""
    if sys.flags.ignore_environment:
        return None
    return env.get(name) or None


def _run_flag(letters: str, name: str, env: dict[str, str]) -> bool:
    """A start-up option for this run: on if the zygote's own command line gave one of
    ``letters`` (-u, -B, -P; -I implies -P), or if the run's environment sets ``name``. The
    zygote's environment does not count: it was the zygote's, not the run's."""
    given = set()
    for option in _interpreter_options():
        if option.startswith("-") and not option.startswith("--"):
            given.update(option[1:].split("W")[0].split("X")[0])  # a -W/-X value is no flag
    return bool(given & set(letters)) or bool(_pyenv(env, name))


def _apply_locale(env: dict[str, str]) -> tuple[bool, str]:
    """LC_CTYPE from the run's environment, as CPython sets it at start (PEP 538 coercion
    included); returns (UTF-8 mode for stdio, the LC_CTYPE locale)."""
    try:
        locale.setlocale(locale.LC_CTYPE, "")
    except locale.Error:
        locale.setlocale(locale.LC_CTYPE, "C")  # a fresh process starts in "C"
    ctype = locale.setlocale(locale.LC_CTYPE)
    utf8 = _utf8_mode(env, ctype)
    coerce = _pyenv(env, "PYTHONCOERCECLOCALE")
    if ctype == "C" and coerce != "0" and not env.get("LC_ALL"):
        for target in _COERCION_TARGETS:
            try:
                locale.setlocale(locale.LC_CTYPE, target)
            except locale.Error:
                continue
            if not locale.nl_langinfo(locale.CODESET):
                continue
            os.environ["LC_CTYPE"] = target  # a fresh python exports it to its children too
            locale.setlocale(locale.LC_CTYPE, "")
            if coerce == "warn":
                os.write(2, _COERCION_WARNING.format(target).encode())
            break
        else:
            locale.setlocale(locale.LC_CTYPE, ctype)
    return utf8, locale.setlocale(locale.LC_CTYPE)


def _utf8_mode(env: dict[str, str], ctype: str) -> bool:
    option = sys._xoptions.get("utf8")
    if option is not None:
        if option not in (True, "1", "0"):
            raise ValueError(f"invalid -X utf8 option value {option!r}")
        return option != "0"
    value = _pyenv(env, "PYTHONUTF8")
    if value is not None:
        if value not in ("0", "1"):
            # A plain python refuses to start; the cold start shows its own message.
            raise ValueError(f"invalid PYTHONUTF8 environment variable value {value!r}")
        return value == "1"
    return ctype in ("C", "POSIX")


def _stdio_encoding(env: dict[str, str], utf8: bool, ctype: str) -> tuple[str, str]:
    encoding = errors = None
    configured = _pyenv(env, "PYTHONIOENCODING")
    if configured:
        name, _, handler = configured.partition(":")
        if name:
            encoding, errors = name, handler or "strict"  # PYTHONIOENCODING=latin1 means strict
        elif handler:
            errors = handler
    if encoding is None:
        encoding = "utf-8" if utf8 else (locale.nl_langinfo(locale.CODESET) or "utf-8")
    encoding = codecs.lookup(encoding).name  # LookupError: a plain python would not start
    if errors is None:
        legacy = ctype in ("C", "POSIX", *_COERCION_TARGETS)
        errors = "surrogateescape" if utf8 or legacy else "strict"
    return encoding, errors


def _install_stdio(env: dict[str, str], utf8: bool, ctype: str) -> None:
    _ZYGOTE_STREAMS.extend([sys.stdin, sys.stdout, sys.stderr,
                            sys.__stdin__, sys.__stdout__, sys.__stderr__])
    encoding, errors = _stdio_encoding(env, utf8, ctype)
    unbuffered = _run_flag("u", "PYTHONUNBUFFERED", env)
    sys.stdin = sys.__stdin__ = _create_stdio(0, "<stdin>", encoding, errors, unbuffered)
    sys.stdout = sys.__stdout__ = _create_stdio(1, "<stdout>", encoding, errors, unbuffered)
    sys.stderr = sys.__stderr__ = _create_stdio(2, "<stderr>", encoding, "backslashreplace", unbuffered)


def _create_stdio(fd: int, name: str, encoding: str, errors: str, unbuffered: bool) -> io.TextIOWrapper:
    """The same calls as CPython's create_stdio() (Python/pylifecycle.c)."""
    write = fd != 0
    # stdin is always buffered: TextIOWrapper needs the read1() of a buffered reader.
    buffering = 0 if unbuffered and write else -1
    buf = io.open(fd, "wb" if write else "rb", buffering, closefd=False)
    raw = buf.raw if buffering else buf
    raw.name = name
    isatty = raw.isatty()
    stream = io.TextIOWrapper(buf, encoding, errors, newline="\n",
                              line_buffering=not unbuffered and (isatty or fd == 2),
                              write_through=unbuffered)
    stream.mode = "w" if write else "r"
    return stream


def _reset_interpreter_state(run: _Run) -> None:
    """Module state a fresh interpreter would compute from this run's environment and cwd."""
    env = run.env
    sys.dont_write_bytecode = _run_flag("B", "PYTHONDONTWRITEBYTECODE", env)
    if "int_max_str_digits" not in sys._xoptions:
        digits = _pyenv(env, "PYTHONINTMAXSTRDIGITS")
        sys.set_int_max_str_digits(int(digits) if digits else sys.int_info.default_max_str_digits)
    for name in ("last_type", "last_value", "last_traceback"):
        sys.__dict__.pop(name, None)
    import faulthandler  # built in; enabled at start by -X faulthandler or PYTHONFAULTHANDLER

    if "faulthandler" in sys._xoptions or _pyenv(env, "PYTHONFAULTHANDLER"):
        faulthandler.enable(file=sys.stderr, all_threads=True)
    elif faulthandler.is_enabled():
        faulthandler.disable()
    import time

    time.tzset()  # time.timezone/tzname were computed from the zygote's TZ
    gc.enable()  # a zygote may run with gc disabled around fork (gc.freeze() recipe)
    if (tempfile := sys.modules.get("tempfile")) is not None:
        tempfile.tempdir = None  # recomputed from this run's TMPDIR on first use
    if (mp_process := sys.modules.get("multiprocessing.process")) is not None:
        # Both were set when the zygote imported multiprocessing. ORIGINAL_DIR replaces '' in
        # the sys.path a spawned child gets; the authkey must not be shared between runs.
        mp_process.ORIGINAL_DIR = os.path.abspath(os.getcwd())
        mp_process.current_process().authkey = os.urandom(32)
    if (warnings := sys.modules.get("warnings")) is not None:
        warnings._filters_mutated()  # forget which warnings were already shown
        warnings.onceregistry.clear()
    import importlib
    import linecache

    importlib.invalidate_caches()  # directory listings cached by the zygote's imports
    linecache.clearcache()


def _reseed() -> None:
    """Random state as fresh as a new interpreter's (os.register_at_fork hooks already ran)."""
    if (random := sys.modules.get("random")) is not None:
        random.seed()  # the hidden Random instance behind random.random() and friends
    if (np_random := sys.modules.get("numpy.random")) is not None:
        np_random.seed()
    if (torch := sys.modules.get("torch")) is not None and hasattr(torch, "default_generator"):
        # torch seeds its default CPU generator from OS entropy at start (initial_seed() differs
        # in every fresh interpreter), and seed() does the same, dropping cached normals too.
        torch.default_generator.seed()


def _interpreter_options() -> list[str]:
    """The zygote's own interpreter options (-X utf8, -B, ...): what precedes its -c/-m/script."""
    args, options, i = list(sys.orig_argv[1:]), [], 0
    while i < len(args):
        arg = args[i]
        if arg == "--check-hash-based-pycs":
            options += args[i:i + 2]
            i += 2
            continue
        if not arg.startswith("-") or arg in ("-", "--") or arg.startswith("--"):
            break
        for j, letter in enumerate(arg[1:], 1):  # a cluster such as -uBc
            if letter in "cm":
                if j > 1:
                    options.append(arg[:j])
                return options
            if letter in "WX":
                options += [arg] if j + 1 < len(arg) else args[i:i + 2]
                i += 0 if j + 1 < len(arg) else 1
                break
        else:
            options.append(arg)
        i += 1
    return options


def _command_line(run: _Run) -> list[str]:
    """The command line of the equivalent plain python (its sys.orig_argv)."""
    head = [sys.orig_argv[0] if sys.orig_argv else sys.executable, *_interpreter_options()]
    if run.mode == "code":
        return [*head, "-c", run.target, *run.argv]
    if run.mode == "module":
        return [*head, "-m", run.target, *run.argv]
    return [*head, run.target, *run.argv]


def _script_path(target: str) -> str:
    # CPython makes the script path absolute by joining, never normalising: cwd "/" and
    # "tmp/x.py" give "//tmp/x.py", and that is __file__.
    return target if os.path.isabs(target) else os.getcwd() + "/" + target


def _is_importer_path(path: str) -> bool:
    """A directory or zip file holding __main__.py, run the way ``python DIR`` runs one."""
    for hook in sys.path_hooks:
        try:
            hook(path)
        except ImportError:
            continue
        return True
    return False


def _set_argv_and_path(run: _Run) -> bool:
    # Note [sys.path[0] of a run]
    # The zygote started as `python -c`, so its sys.path[0] is '' (its cwd, "/"): it goes. What
    # a plain python puts there: -c '' ; -m the full cwd; a script the real directory of the
    # script (symlinks of the script itself resolved); a directory or zip run as a script,
    # itself. PYTHONSAFEPATH (-P) adds nothing, except the directory or zip run as a script.
    if sys.path and sys.path[0] == "" and not sys.flags.safe_path:
        del sys.path[0]
    safe = _run_flag("PI", "PYTHONSAFEPATH", run.env)
    sys.orig_argv = _command_line(run)
    if run.mode == "code":
        sys.argv = ["-c", *run.argv]
        path0 = ""
    elif run.mode == "module":
        sys.argv = ["-m", *run.argv]  # runpy puts the module's file there once found
        path0 = os.getcwd()
    else:
        sys.argv = [run.target, *run.argv]
        path = _script_path(run.target)
        if _is_importer_path(path):
            sys.path.insert(0, path)
            return True
        path0 = os.path.dirname(os.path.realpath(path))
    if not safe:
        sys.path.insert(0, path0)
    return False


def _cold_start(run: _Run, exc: BaseException) -> NoReturn:
    """Note [Never worse than no cache]: set-up failed before any user code ran, so start the
    plain interpreter with the same command line instead; it behaves as python does, errors
    included (a PYTHONIOENCODING naming no codec fails exactly as it would have)."""
    os.write(2, f"overmind: warm start failed ({exc!r}); starting a cold python\n".encode(errors="replace"))
    try:
        os.chdir(run.cwd)
        os.umask(run.umask)
        for sig in (signal.SIGPIPE, signal.SIGXFSZ):  # exec keeps SIG_IGN; python re-ignores
            signal.signal(sig, signal.SIG_IGN if sig in run.ignored_signals else signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, [])  # exec keeps the mask
        os.execve(sys.executable, _command_line(run), run.env)
    except (OSError, ValueError) as err:
        os.write(2, f"overmind: cannot start python: {err}\n".encode(errors="replace"))
    os._exit(1)


# --------------------------------------------------------------------------- running

def _fresh_main() -> types.ModuleType:
    """A __main__ as CPython's add_main_module() makes it, installed in sys.modules, so
    classes defined by the script pickle and multiprocessing's spawn finds the script."""
    main = types.ModuleType("__main__")
    main.__loader__ = _machinery().BuiltinImporter
    main.__annotations__ = {}
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    return main


def _machinery() -> types.ModuleType:
    import importlib.machinery

    return importlib.machinery


def _script_body(main: types.ModuleType, path: str) -> Callable[[], None]:
    """Run a script file as CPython's _PyRun_SimpleFileObject does. Raises OSError when the
    file cannot be read (a plain python says "can't open file" and exits 2)."""
    with open(path, "rb") as f:
        data = f.read()
    machinery = _machinery()
    import importlib.util

    magic = importlib.util.MAGIC_NUMBER
    compiled = path.endswith(".pyc") or data[:2] == magic[:2]
    main.__file__ = path
    main.__cached__ = None
    loader = machinery.SourcelessFileLoader if compiled else machinery.SourceFileLoader
    main.__loader__ = loader("__main__", path)

    def body() -> None:
        if compiled:
            if data[:4] != magic:
                raise RuntimeError("Bad magic number in .pyc file")
            import marshal

            code = marshal.loads(data[16:])
        else:
            # dont_inherit: this module's `from __future__ import annotations` must not leak.
            code = compile(data, path, "exec", dont_inherit=True)
        exec(code, main.__dict__)

    return body


def _main_body(run: _Run, importer: bool) -> tuple[types.ModuleType, Callable[[], None] | None]:
    main = _fresh_main()
    import runpy

    if run.mode == "code":
        code = run.target
        return main, lambda: exec(compile(code, "<string>", "exec", dont_inherit=True), main.__dict__)
    if run.mode == "module":
        return main, lambda: runpy._run_module_as_main(run.target)
    if importer:  # a directory or zip holding __main__.py
        return main, lambda: runpy._run_module_as_main("__main__", alter_argv=False)
    path = _script_path(run.target)
    try:
        return main, _script_body(main, path)
    except OSError as err:
        program = sys.orig_argv[0] if sys.orig_argv else sys.executable
        print(f"{program}: can't open file {path!r}: [Errno {err.errno}] {err.strerror}",
              file=sys.stderr)
        return main, None


def _execute(run: _Run, importer: bool) -> int:
    """Note [Exit like Py_RunMain]
    Run the user's code and leave as CPython's Py_RunMain does: SystemExit(code) gives code
    (None 0, an int itself, anything else printed to stderr and 1); any other uncaught
    exception goes to sys.excepthook and gives 1; then threading._shutdown() waits for
    non-daemon threads, atexit callbacks run, stdout and stderr are flushed (a failure is
    reported as an unraisable exception and makes the status 120). An uncaught
    KeyboardInterrupt ends in death by SIGINT after all that, as since Python 3.8.

    Note [Output is never lost at exit]
    os._exit() skips the interpreter's teardown, which is where a fresh python closes what is
    still open. So after the flush: __main__'s globals are released and collected (their
    __del__ runs, as in a fresh python's teardown; only when no other thread could still use
    them), every unclosed file object the run created is flushed, and stdout/stderr are
    flushed once more."""
    main, body = _main_body(run, importer)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])  # Note [Signals held during set-up]
    sigint = False
    if body is None:
        status = 2
    else:
        try:
            body()
        except SystemExit as exc:
            status = _system_exit_status(exc)
        except BaseException as exc:  # noqa: BLE001 - what the interpreter itself would catch
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
        status = 128 + signal.SIGINT  # still alive: SIGINT is blocked by the user's code
    return status


def _forget_script_file(main: types.ModuleType) -> None:
    # CPython drops these once the script has run (not when it called sys.exit): an atexit
    # callback of a plain python sees no __main__.__file__.
    main.__dict__.pop("__file__", None)
    main.__dict__.pop("__cached__", None)


def _system_exit_status(exc: SystemExit) -> int:
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code if -2**63 <= code < 2**63 else -1  # CPython: (int)PyLong_AsLong(code)
    try:
        stderr = sys.stderr
        stderr.write(str(code))
        stderr.write("\n")
    except BaseException:  # noqa: BLE001 - as CPython: nothing more to say
        pass
    return 1


def _user_traceback(tb: types.TracebackType | None) -> types.TracebackType | None:
    while tb is not None and tb.tb_frame.f_code.co_filename == _THIS_FILE:
        tb = tb.tb_next
    return tb


def _print_uncaught(exc: BaseException) -> int:
    """CPython's PyErr_Print(): sys.last_*, then sys.excepthook, and its own failure too."""
    exc.__traceback__ = _user_traceback(exc.__traceback__)
    hook = getattr(sys, "excepthook", None)
    try:
        if hook is None:
            sys.stderr.write("sys.excepthook is missing\n")
            sys.__excepthook__(type(exc), exc, exc.__traceback__)
        else:
            hook(type(exc), exc, exc.__traceback__)
    except SystemExit as exit_exc:
        return _system_exit_status(exit_exc)
    except BaseException as hook_exc:  # noqa: BLE001
        try:
            sys.stdout.flush()
        except BaseException:  # noqa: BLE001
            pass
        sys.stderr.write("Error in sys.excepthook:\n")
        sys.__excepthook__(type(hook_exc), hook_exc, _user_traceback(hook_exc.__traceback__))
        sys.stderr.write("\nOriginal exception was:\n")
        sys.__excepthook__(type(exc), exc, exc.__traceback__)
    return 1


def _write_unraisable(exc: BaseException, obj: object) -> None:
    """PyErr_WriteUnraisable(obj) for an exception raised outside any user frame."""
    try:
        tb = _user_traceback(exc.__traceback__)
        if sys.unraisablehook is sys.__unraisablehook__:
            # The default hook only accepts CPython's own argument type; write its format.
            text = f"Exception ignored in: {obj!r}\n" + "".join(traceback.format_exception(type(exc), exc, tb))
            sys.stderr.write(text)
            sys.stderr.flush()
        else:
            sys.unraisablehook(types.SimpleNamespace(
                exc_type=type(exc), exc_value=exc, exc_traceback=tb, err_msg=None, object=obj))
    except BaseException:  # noqa: BLE001 - as CPython: an unraisable report never raises
        pass


def _flush_std(report: bool = True) -> bool:
    """CPython's flush_std_files(): False when a flush failed."""
    ok = True
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name, None)
        try:
            if stream is None or getattr(stream, "closed", False):
                continue
        except BaseException:  # noqa: BLE001 - an unreadable .closed counts as open
            pass
        try:
            stream.flush()
        except BaseException as exc:  # noqa: BLE001
            ok = False
            if report and name == "stdout":  # CPython is quiet about stderr's failure
                _write_unraisable(exc, stream)
    return ok


def _finalize(status: int) -> int:
    """Py_FinalizeEx's visible part: Note [Exit like Py_RunMain]."""
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
    # What __del__ printed. CPython flushes it when it destroys the streams, which can only
    # report an error, and only if the first flush did not already fail.
    _flush_std(report=flushed)
    return status


def _release_main(threading: types.ModuleType | None) -> None:
    """Note [Output is never lost at exit]: __main__'s globals die as in a fresh teardown."""
    if threading is not None and threading.active_count() > 1:
        return  # a daemon thread may still read them; a fresh python would freeze it first
    try:
        for name in ("last_type", "last_value", "last_traceback"):  # their frames hold __main__
            sys.__dict__.pop(name, None)
        main = sys.modules.pop("__main__", None)
        if isinstance(main, types.ModuleType):
            # As CPython's _PyModule_ClearDict: one value at a time, so each object dies by its
            # reference count, in order. Left to the cycle collector (functions and their
            # globals form a cycle), a file's FileIO may be finalized before the buffer
            # writing into it, and the buffered bytes are lost.
            namespace = main.__dict__
            for key in [k for k in namespace if isinstance(k, str) and k[:1] == "_" and k[1:2] != "_"]:
                namespace[key] = None
            for key in [k for k in namespace if k != "__builtins__"]:
                namespace[key] = None
            del main, namespace
        gc.collect()
    except BaseException:  # noqa: BLE001 - a __del__ error is already reported by CPython
        pass


def _flush_left_open() -> None:
    """Note [Output is never lost at exit]: flush files the run left open (a fresh python
    closes them in its teardown). Objects a zygote froze (gc.freeze()) are not even seen."""
    skip = {id(s) for s in _ZYGOTE_STREAMS}
    skip |= {id(getattr(s, "buffer", None)) for s in _ZYGOTE_STREAMS}
    skip |= {id(getattr(sys, name, None)) for name in ("stdout", "stderr")}  # _flush_std's
    texts, buffers = [], []
    for obj in gc.get_objects():
        kind = type(obj)  # not isinstance(): it reads __class__, which some proxies override
        if issubclass(kind, io.TextIOWrapper):
            texts.append(obj)
        elif issubclass(kind, (io.BufferedWriter, io.BufferedRandom)):
            buffers.append(obj)
    for stream in texts + buffers:  # text first: its pending text lands in its buffer
        if id(stream) in skip:
            continue
        try:
            if not stream.closed:
                stream.flush()
        except BaseException:  # noqa: BLE001 - a fresh python would only print "ignored"
            pass


# --------------------------------------------------------------------------- what to pre-import

def _installed_prefixes() -> list[str]:
    import site
    import sysconfig

    paths = sysconfig.get_paths()
    found = [paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths]
    try:
        found += site.getsitepackages()
        found.append(site.getusersitepackages())
    except AttributeError:  # an old virtualenv's site module
        pass
    return found


def _module_paths(name: str, module: object) -> list[str] | None:
    """The files a module came from; None for built-in and frozen modules (stdlib)."""
    file = getattr(module, "__file__", None)
    if isinstance(file, str) and file:
        return [file]
    spec = getattr(module, "__spec__", None)
    if getattr(spec, "origin", None) in ("built-in", "frozen") or name in sys.builtin_module_names:
        return None
    try:
        return [p for p in getattr(module, "__path__", None) or () if isinstance(p, str)]
    except Exception:  # noqa: BLE001 - a broken namespace path: not ours to pre-import
        return []


def installed_modules(prefixes: tuple[str, ...] | None = None, *, exclude: Iterable[str] = ()) -> list[str]:
    """Names of modules in sys.modules whose file lies under an installed location (stdlib, site-packages, dist-packages), never the user's own code (the script's folder, the cwd, editable installs / anything else on PYTHONPATH outside site-packages). Used to learn what to pre-import.

    In import order, which is the order to import them in. ``prefixes`` replaces the installed
    locations; ``exclude`` adds the user's folders to the cwd and the script's folder.

    Note [Installed means found under an installed prefix]
    Each file is resolved (realpath) and matched to the longest folder containing it, among
    the installed prefixes and the user's folders; it counts only if that folder is an
    installed one (a tie goes to the user). So a venv inside the project (cwd ~/proj, packages
    in ~/proj/.venv/...) counts, a module beside the script never does, and an editable
    install (a .pth path or a finder pointing at ~/proj/src, a symlink into the project) is
    outside every prefix. A namespace package counts only if all its portions do.
    """
    installed = [os.path.realpath(p) for p in (prefixes if prefixes is not None else _installed_prefixes())]
    users = [*exclude]
    try:
        users.append(os.getcwd())
    except OSError:
        pass
    main = sys.modules.get("__main__")
    main_file = getattr(main, "__file__", None)
    if isinstance(main_file, str) and getattr(main, "__spec__", None) is None:
        users.append(os.path.dirname(main_file))  # a script's folder (-m puts the cwd first)
    users = [os.path.realpath(p) for p in users]
    real_dirs: dict[str, str] = {}

    def real(path: str) -> str:
        folder, base = os.path.split(path)
        if folder not in real_dirs:
            real_dirs[folder] = os.path.realpath(folder)
        joined = os.path.join(real_dirs[folder], base)
        return os.path.realpath(joined) if os.path.islink(joined) else joined

    def depth(path: str, folders: list[str]) -> int:
        return max((len(f) for f in folders if path == f or path.startswith(f.rstrip("/") + "/")), default=-1)

    def is_installed(path: str) -> bool:
        path = real(path)
        return depth(path, installed) > depth(path, users)

    names = []
    for name, module in list(sys.modules.items()):
        if name in ("__main__", "__mp_main__") or module is None:
            continue
        paths = _module_paths(name, module)
        if paths is None or (paths and all(is_installed(p) for p in paths)):
            names.append(name)
    return names
