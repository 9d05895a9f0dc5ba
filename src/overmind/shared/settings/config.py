"""Every ``OVERMIND_*`` setting, read once into a frozen :class:`Config`.

Standard library only (the server imports it)::

    from overmind.shared.settings.config import Config
    cfg = Config.from_env()
    cfg.socket_path          # <runtime dir>/server.sock

The client's settings (your scripts' environment):

=========================  =========================================================
``OVERMIND_RUNTIME_DIR``   socket, log and pid file; else ``$XDG_RUNTIME_DIR/overmind``,
                           else ``/tmp/overmind-<uid>``. Created 0700; refused if another
                           user owns it or others can enter it. The server's too.
``OVERMIND_DISABLE``       ``1``: ``monkey_patch_all()`` patches nothing.
``OVERMIND_STRICT``        ``1``: raise instead of falling back to a plain load.
``OVERMIND_TIMEOUT``       seconds a client waits for a cold load it chose to wait for
                           (``OVERMIND_COLD=wait``; default 300); past it, the plain load runs.
``OVERMIND_REPLY_TIMEOUT`` seconds for every other answer of the server: connecting, the
                           handshake, a hit or a miss (default 2); a stopped or stuck
                           server costs at most this before the plain load runs.
``OVERMIND_COLD``          ``background`` (default): on a miss the caller loads plainly while
                           the server fills the cache; ``wait``: the caller waits for the
                           cache (always so with ``OVERMIND_STRICT=1``).
``OVERMIND_PATCH``         extra patch points, ``module::Qualname.attr``, comma separated.
``OVERMIND_WARM_START``    ``0``: ``monkey_patch_all()`` at the top of a script never hands
                           the run to a warm interpreter; by default (or ``1``) it does where
                           that is safe (overmind.client.warm_start).
``OVERMIND_NO_EXT``        ``1``: install and run without the compiled ``overmind._C``
                           (read by ``setup.py`` and ``overmind.shared.segments.native``).
=========================  =========================================================

The server's settings are each also a flag of ``overmind-server`` (``OVERMIND_WARM_MAX`` is
``--warm-max``; a flag given wins). One table, overmind.server.options.SETTINGS, says what each
means and its default, and ``overmind-server --help`` prints it: ``OVERMIND_RUNTIME_DIR``,
``OVERMIND_STATE_DIR``, ``OVERMIND_MAX_MEMORY``, ``OVERMIND_RESTORE``, ``OVERMIND_SETTLE_AFTER``,
``OVERMIND_KEEP_FILE_PAGES``, ``OVERMIND_FILL_YIELD``, ``OVERMIND_WORKERS``,
``OVERMIND_LOADER_TIMEOUT``, ``OVERMIND_WARM_MAX``, ``OVERMIND_WARM_MEMORY``,
``OVERMIND_WARM_IDLE``, ``OVERMIND_HEADROOM``, ``OVERMIND_LOG_LEVEL``. They are read here, by :meth:`Config.from_env`.

Seams for tests and benchmarks, not settings a user needs (``OVERMIND_NO_AUTOSTART`` also
serves pods that share their node's server: deploy/example-pod.yaml):

=========================  =========================================================
``OVERMIND_NO_AUTOSTART``  ``1``: clients never start a server themselves.
``OVERMIND_PRESTART``      ``0``: ``monkey_patch_all()`` does not ask the server, in the
                           background, to get a warm interpreter ready for this
                           process.
``OVERMIND_QUICK_EXIT``    ``0``: ``monkey_patch_all()`` leaves the interpreter's teardown as
                           it is (Note [The drop-in leaves quickly] in overmind.shared.process.teardown).
=========================  =========================================================

Yes/no settings take ``1``, ``true``, ``yes``, ``on`` or ``0``, ``false``, ``no``, ``off``
(any case; unset or empty is the default). A bad value is named with what is accepted and
never stops a script: Note [A bad setting never stops a script].
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import stat
import sys
import time

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing
if TYPE_CHECKING:
    from pathlib import Path
    from typing import Callable, Optional

__all__ = ["Config", "ConfigError", "default_runtime_dir", "default_state_dir", "ensure_private_dir",
           "open_runtime_file", "lock_within", "warm_start_enabled",
           "write_runtime_file", "read_runtime_file", "patching_disabled", "prestart_enabled",
           "flag", "selecting_environment", "ENV_PREFIXES", "ENV_NAMES", "FLAG_SPELLINGS",
           "LOG_LEVELS", "LOG_FORMAT", "COLD_MODES", "PREPARE_VARIABLE"]

# Environment a loader inherits from the client (and that selects its warm interpreter).
ENV_PREFIXES = ("HF_", "HUGGINGFACE_", "TRANSFORMERS_", "DIFFUSERS_", "CUDA_", "NVIDIA_", "TORCH_", "PYTORCH_",
                "OMP_", "MKL_", "OPENBLAS_", "GOTO_", "BNB_", "ACCELERATE_", "SAFETENSORS_", "TOKENIZERS_", "XDG_", "LC_")
ENV_NAMES = ("HOME", "PATH", "LD_LIBRARY_PATH", "LD_PRELOAD", "PYTHONPATH", "PYTHONHASHSEED", "VIRTUAL_ENV", "LANG",
             "TMPDIR", "USER", "LOGNAME", "TZ", "OVERMIND_NO_EXT", "PYTHONDONTWRITEBYTECODE", "PYTHONNOUSERSITE",
             "PYTHONUSERBASE", "PYTHONSAFEPATH", "PYTHONPYCACHEPREFIX", "PYTHONWARNINGS", "PYTHONHOME",
             "PYTHONPLATLIBDIR", "PYTHONOPTIMIZE", "PYTHONDEBUG", "PYTHONVERBOSE", "PYTHONDEVMODE",
             "PYTHONTRACEMALLOC", "PYTHONMALLOC", "PYTHONMALLOCSTATS", "PYTHONWARNDEFAULTENCODING",
             "PYTHONNODEBUGRANGES", "PYTHONINSPECT", "PYTHONPROFILEIMPORTTIME", "PYTHONCASEOK", "PYTHONEXECUTABLE",
             "PYTHONUTF8", "PYTHONIOENCODING", "PYTHONCOERCECLOCALE")

# Set by ``overmind run`` on a server it starts, not by users: the run's interpreter, whose warm
# interpreter that server starts as it starts (Note [The server a first run starts prepares its
# interpreter] in overmind.server.daemon), which takes it out of its environment.
PREPARE_VARIABLE = "OVERMIND_PREPARE_PYTHON"

# Note [Environment that selects an interpreter]
# A warm interpreter (overmind.warm.interpreter) imported its modules under its own environment, so it
# serves only clients that agree with it on what can change an import. Two parts:
# - ENV_PREFIXES and ENV_NAMES, always: what is read where Python cannot see it (C getenv:
#   TORCH_*, CUDA_*, OMP_NUM_THREADS, MKL_*, OPENBLAS_NUM_THREADS: thread pools size themselves at load), what CPython reads at start (PYTHONPATH,
#   PYTHONHASHSEED...; the locale), and what a loader needs (HF_HOME, PATH...).
# - The names the context's interpreters' imports actually read from os.environ, which no
#   list could name (torch._inductor.config reads ~300 TORCHINDUCTOR_*/TORCHDYNAMO_* names and
#   keeps them; a library may read any name): each interpreter records them while it imports
#   and tells the server, which adds the caller's values of those names to the context
#   (WarmPool.with_reads), and an interpreter forks a run only when the run's values equal
#   what its imports read. A caller with other values is served by an interpreter imported
#   under its own, after one plain run that says why: Note [Settings an import read] in
#   overmind.shared.settings.import_env.
# Everything else (a script's own settings, DISPLAY, SSH_*, terminal variables) reaches each
# run through its own environment but does not select an interpreter: keying on all of it
# would start an interpreter per terminal, and no import read it.


def memory_total() -> int:
    """The memory this process may use: the smallest of RAM and the cgroup limits over it, so a
    share of it (``60%``, the default budget) stays inside the container it runs in."""
    from overmind.shared.settings.host_memory import HostMemory  # here: monkey_patch_all() imports this module

    return HostMemory.read().limit.bytes


_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """``40G``, ``512MB``, ``1.5T``, ``60%`` (of memory_total()) or plain bytes."""
    raw = str(text).strip().upper()
    if raw.endswith("%"):
        share = float(raw[:-1])
        if not 0 < share <= 100:
            raise ValueError(f"memory share {text!r} must be in (0, 100]%")
        return int(memory_total() * share / 100)
    match = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([KMGT]?)(I?B)?", raw)
    if not match:
        raise ValueError(f"cannot read {text!r} as a size: use 40G, 512M, 60% or a number of bytes")
    value = int(float(match.group(1)) * _UNITS[match.group(2)])
    if value <= 0:
        raise ValueError(f"size {text!r} must be positive")
    return value


def selecting_environment(environ) -> dict:
    """The variables of ``environ`` that always select a warm interpreter (the first part of
    Note [Environment that selects an interpreter]): what a client sends as its context's env."""
    return {k: v for k, v in environ.items() if k.startswith(ENV_PREFIXES) or k in ENV_NAMES}


class ConfigError(ValueError):
    pass


# Note [A bad setting never stops a script]
# Every OVERMIND_* value is read here, and a bad one is told in one message that names the
# variable, the value and what is accepted. What happens next depends on the setting:
# - A yes/no setting (flag()) that is none of FLAG_SPELLINGS warns once per process and acts
#   as its default: it is read everywhere, some on every load, and reading it never raises.
# - OVERMIND_PATCH: a bad item warns once and is skipped; the good ones are patched.
# - Any other bad value makes Config.from_env raise ConfigError, with every bad value in it.
#   A client's load then runs plainly with one warning (OVERMIND_STRICT=1 raises, as for any
#   fallback: overmind.api), ``overmind run`` runs plain python and says why, the ``overmind``
#   command exits 2 saying why, and overmind-server refuses to start, saying why on stderr
#   (which reaches whoever started it) and in its log (where clients point). It refuses
#   rather than run on a default: a server is configured on purpose (a unit file, a deploy),
#   and one that runs with a memory budget or worker count nobody asked for fails later and
#   far from the typo, while its clients, sharing the environment, load plainly and say the
#   same thing.
FLAG_SPELLINGS = "1, true, yes, on; 0, false, no, off or empty"
_YES = ("1", "true", "yes", "on")
_NO = ("", "0", "false", "no", "off")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
# The server log's lines, from the server and from its warm interpreters and loaders alike
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s"
COLD_MODES = ("background", "wait")

# Where a bad yes/no value is told; None: ``warnings.warn``, pointing at the user's code. A
# front end whose stderr is the user's terminal (``overmind``, ``overmind run``) prints it.
report: Optional[Callable[[str], None]] = None
_told: dict = {}  # the messages already told in this process: each is told once


def tell(message: str, notes: Optional[list] = None) -> None:
    """Tell the user a bad setting, once per process: into ``notes`` where given, else to
    ``report``, else as a warning pointing at the user's code."""
    if notes is not None:  # the server logs them once its log is set up
        notes.append(message)
        return
    token = object()
    if _told.setdefault(message, token) is not token:  # atomic: two threads never both tell it
        return
    if report is not None:
        report(message)
        return
    import warnings

    # The first frame outside overmind: the user's monkey_patch_all() or load call.
    frame, level = sys._getframe(1), 2
    while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] == "overmind":
        frame, level = frame.f_back, level + 1
    warnings.warn(f"overmind: {message}", RuntimeWarning, stacklevel=level)


def _flag(env, name: str, default: bool = False, notes: Optional[list] = None) -> bool:
    raw = env.get(name, "")
    value = raw.strip().lower()
    if value in _YES:
        return True
    if value in _NO:
        return default if not value else False
    tell(f"{name}={raw!r} is not a yes/no value (accepted: {FLAG_SPELLINGS}); "
          f"using the default ({'yes' if default else 'no'})", notes)
    return default


def flag(name: str, env=None, default: bool = False) -> bool:
    """A yes/no ``OVERMIND_*`` setting read straight from the environment: ``1``, ``true``,
    ``yes``, ``on`` or ``0``, ``false``, ``no``, ``off``; unset or empty is ``default``. Any other
    value warns once and acts as ``default``: Note [A bad setting never stops a script]."""
    return _flag(os.environ if env is None else env, name, default)


def _number(env, name: str, default: float, minimum: float, whole: bool = False, also: str = "") -> float:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    what = "a whole number" if whole else "a number of seconds"
    accepted = f"accepted: {what}, at least {minimum:g}{also}; default {default:g}"
    try:
        value = int(raw) if whole else float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not {what} ({accepted})") from None
    if not minimum <= value < float("inf"):  # also refuses nan and inf
        raise ConfigError(f"{name}={raw!r} is out of range ({accepted})")
    return value


def _optional_number(env, name: str, default: float, minimum: float) -> Optional[float]:
    """Seconds; ``default`` where the variable is unset, None where it is ``never`` or set empty."""
    if name not in env:
        return default
    if env[name].strip().lower() in ("", "never"):
        return None
    return _number(env, name, default, minimum, also=", or never")


def _size(env, name: str) -> Optional[int]:
    raw = env.get(name, "").strip()
    if not raw:
        return None

    try:
        return parse_size(raw)
    except ValueError as err:
        accepted = "" if "40G" in str(err) else " (accepted: 40G, 512M, 60% of the memory this process may use or a number of bytes)"
        raise ConfigError(f"{name}={raw!r} is not a size: {err}{accepted}") from None


def _restore(env, name: str) -> tuple:
    """``OVERMIND_RESTORE``: (bytes, None) or (None, share of the budget); ``0`` is (0, 0.0)."""
    raw = env.get(name, "").strip()
    if not raw:
        return None, 1.0
    accepted = "accepted: 40G, 512M, a number of bytes, 60% of the memory budget, or 0 for no restore"
    if raw.endswith("%"):
        try:
            share = float(raw[:-1])
        except ValueError:
            share = -1.0
        if not 0 <= share <= 100:
            raise ConfigError(f"{name}={raw!r} is not a share of the budget ({accepted})")
        return None, share / 100
    if raw in ("0", "0B", "0b"):
        return 0, 0.0
    try:
        return parse_size(raw), 1.0
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a size ({accepted})") from None


def _choice(env, name: str, choices: tuple, default: str, fold=str.lower) -> str:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    if fold(raw) not in choices:
        raise ConfigError(f"{name}={raw!r} is not a choice (accepted: {', '.join(choices)}; default {default})")
    return fold(raw)


def runtime_dir_path(env=None) -> str:
    """The runtime directory as a string, without importing pathlib (``overmind run``'s fast path)."""
    env = os.environ if env is None else env
    if env.get("OVERMIND_RUNTIME_DIR"):
        return os.path.abspath(env["OVERMIND_RUNTIME_DIR"])
    if env.get("XDG_RUNTIME_DIR"):
        return os.path.join(env["XDG_RUNTIME_DIR"], "overmind")
    return f"/tmp/overmind-{os.getuid()}"


def default_runtime_dir(env=None) -> Path:
    from pathlib import Path

    return Path(runtime_dir_path(env))


def default_state_dir(env=None) -> Path:
    """``OVERMIND_STATE_DIR``, else ``$XDG_STATE_HOME/overmind``, else ``~/.local/state/overmind``."""
    from pathlib import Path

    env = os.environ if env is None else env
    if env.get("OVERMIND_STATE_DIR"):
        return Path(os.path.abspath(env["OVERMIND_STATE_DIR"]))
    if env.get("XDG_STATE_HOME") and os.path.isabs(env["XDG_STATE_HOME"]):  # the XDG spec: a relative one is ignored
        return Path(env["XDG_STATE_HOME"]) / "overmind"
    home = env.get("HOME") or os.path.expanduser("~")
    return Path(home) / ".local" / "state" / "overmind"


def ensure_private_dir(path: Path, what: str = "runtime directory", setting: str = "OVERMIND_RUNTIME_DIR",
                       forbidden: int = 0o077) -> Path:
    """Create ``path`` 0700, or check that an existing one is ours and private (ARCHITECTURE.md,
    invariant 5: Only the owner gets in).

    An existing directory with a ``forbidden`` mode bit (the runtime directory: any access by
    others; the state directory: write access by others) is refused, never chmod-ed: it may
    be a shared one (``/tmp``, a group's folder) whose mode others rely on, and files already
    in it may have been planted. See Note [Runtime files are opened, never followed].
    """
    created = False
    try:
        path.mkdir(mode=0o700, parents=True)
        created = True
    except FileExistsError:
        pass
    except OSError as err:
        raise ConfigError(f"cannot create {what} {path}: {err.strerror}") from None
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"{what} {path} is not a directory (a symlink?); remove it")
    if st.st_uid != os.getuid():
        raise ConfigError(f"{what} {path} belongs to uid {st.st_uid}, not to you (uid {os.getuid()}); "
                          f"set {setting} to a private directory")
    if st.st_mode & forbidden:
        if created:  # mkdir's mode met a strange umask; the directory is new and empty, so ours to fix
            os.chmod(path, 0o700)
        else:
            raise ConfigError(f"{what} {path} is open to other users (mode {stat.S_IMODE(st.st_mode):04o}); "
                              f"overmind needs a private one: `chmod 700 {path}` if it is yours alone, or set "
                              f"{setting} to a new path")
    return path


def open_runtime_file(path: Path, flags: int = os.O_RDWR, mode: int = 0o600, create: bool = True) -> int:
    """Open (creating, unless ``create`` is false) a file of the runtime directory; returns an fd.
    Refuses anything but a regular file of ours: Note [Runtime files are opened, never followed].

    Note [Runtime files are opened, never followed]
    The runtime directory is checked private before use, but files in it may predate the
    check or come from another tool. Every file the server or a client creates there is
    opened with ``O_NOFOLLOW`` (a planted symlink is refused, never written through),
    ``O_NONBLOCK`` (a planted FIFO cannot hang the open) and checked with ``fstat`` to be
    a regular file owned by us. ``server.pid`` is written to a fresh file and renamed over
    the old name, which replaces whatever was there instead of following it.
    """
    try:
        fd = os.open(path, flags | (os.O_CREAT if create else 0) | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise ConfigError(f"cannot open {path}: it is a symlink; remove it") from None
        try:
            odd = not stat.S_ISREG(os.lstat(path).st_mode)
        except OSError:
            odd = False
        raise ConfigError(f"cannot open {path}: " + ("it is not a regular file; remove it" if odd else err.strerror)
                          ) from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
        os.close(fd)
        raise ConfigError(f"{path} is not a regular file of yours; remove it")
    os.set_blocking(fd, True)
    return fd


def lock_within(fd: int, seconds: float, interval: float, give_up: Callable[[], bool] = lambda: False) -> bool:
    """Take ``fd``'s exclusive lock, trying every ``interval`` seconds for ``seconds`` at most,
    or until ``give_up()`` says to stop; whether it was taken."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline or give_up():
                return False
            time.sleep(interval)


def write_runtime_file(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` atomically, without following what is there now."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        os.unlink(tmp)
    except FileNotFoundError:
        pass
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)
    os.rename(tmp, path)


def read_runtime_file(path: Path, limit: int = 4096) -> str:
    """The text of a small runtime file, or "" if it is missing or not a regular file of ours."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return ""
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            return ""
        return os.read(fd, limit).decode(errors="replace")
    finally:
        os.close(fd)


class Config:
    """Every setting, read once. Frozen; compares by value. A plain class, not a dataclass:
    ``monkey_patch_all()`` imports this module, and dataclasses + pathlib would double its cost."""

    __slots__ = ("runtime_dir", "disable", "strict", "timeout", "reply_timeout", "loader_timeout", "workers",
                 "autostart", "cold_wait", "log_level", "max_memory", "warm_max", "warm_idle", "warm_memory",
                 "fill_yield", "settle_after", "keep_file_pages", "state_dir", "restore_bytes", "restore_share",
                 "headroom")
    _DEFAULTS = {"disable": False, "strict": False, "timeout": 300.0, "reply_timeout": 2.0, "loader_timeout": 3600.0,
                 "workers": 2, "autostart": True, "cold_wait": False, "log_level": "INFO", "max_memory": None,
                 "warm_max": 4, "warm_idle": 1800.0, "warm_memory": 8 << 30, "fill_yield": 120.0, "settle_after": 30.0,
                 "keep_file_pages": True,
                 "state_dir": None, "restore_bytes": None, "restore_share": 1.0, "headroom": None}

    runtime_dir: Path
    disable: bool
    strict: bool
    timeout: float  # a cold load the caller chose to wait for (OVERMIND_COLD=wait)
    reply_timeout: float  # every other answer: connect, handshake, hit or miss
    loader_timeout: float
    workers: int
    autostart: bool
    cold_wait: bool
    log_level: str
    max_memory: Optional[int]  # bytes; None: overmind.server.registry.default_budget()
    warm_max: int  # warm interpreters at once
    warm_idle: float  # seconds before an unused one is retired
    warm_memory: int  # bytes of PSS all of them together may hold
    fill_yield: float  # seconds a cache fill nobody waits for waits for its caller, then yields the CPU
    settle_after: Optional[float]  # seconds without a request before file segments are copied; None: never
    keep_file_pages: bool  # file segments' pages stay mapped in the server until copied
    state_dir: Optional[Path]  # None: no state kept (overmind.server.state)
    restore_bytes: Optional[int]  # OVERMIND_RESTORE as bytes; None: restore_share of the budget
    restore_share: float  # OVERMIND_RESTORE as a share of the memory budget (0: no restore)
    headroom: Optional[int]  # bytes kept free for others; None: overmind.server.pressure.default_headroom()

    def __init__(self, runtime_dir: Path, **values) -> None:
        unknown = set(values) - set(self._DEFAULTS)
        if unknown:
            raise TypeError(f"Config has no setting {sorted(unknown)}")
        object.__setattr__(self, "runtime_dir", runtime_dir)
        for name, default in self._DEFAULTS.items():
            object.__setattr__(self, name, values.get(name, default))

    def __setattr__(self, name: str, value) -> None:
        raise AttributeError(f"Config is frozen; cannot set {name}")

    def _values(self) -> tuple:
        return tuple(getattr(self, name) for name in self.__slots__)

    def __eq__(self, other: object) -> bool:
        return type(other) is Config and other._values() == self._values()

    def __hash__(self) -> int:
        return hash(self._values())

    def __repr__(self) -> str:
        return "Config(" + ", ".join(f"{n}={getattr(self, n)!r}" for n in self.__slots__) + ")"

    @classmethod
    def from_env(cls, env=None, notes: Optional[list] = None) -> "Config":
        """The settings in ``env`` (default ``os.environ``). ConfigError names every bad value;
        a bad yes/no value warns (or goes to ``notes``) and acts as its default: Note [A bad
        setting never stops a script]."""
        env = os.environ if env is None else env
        default = cls._DEFAULTS  # each default written once
        values: dict = {}
        errors: list[str] = []

        def read(name: str, parse, *args) -> None:
            try:
                values[name] = parse(env, *args)
            except ConfigError as err:
                errors.append(str(err))

        strict = _flag(env, "OVERMIND_STRICT", notes=notes)
        read("timeout", _number, "OVERMIND_TIMEOUT", default["timeout"], 0.1)
        read("reply_timeout", _number, "OVERMIND_REPLY_TIMEOUT", default["reply_timeout"], 0.1)
        read("loader_timeout", _number, "OVERMIND_LOADER_TIMEOUT", default["loader_timeout"], 1.0)
        read("workers", _number, "OVERMIND_WORKERS", default["workers"], 1, True)
        read("cold", _choice, "OVERMIND_COLD", COLD_MODES, "background")
        read("log_level", _choice, "OVERMIND_LOG_LEVEL", LOG_LEVELS, default["log_level"], str.upper)
        read("max_memory", _size, "OVERMIND_MAX_MEMORY")
        read("warm_max", _number, "OVERMIND_WARM_MAX", default["warm_max"], 1, True)
        read("warm_idle", _number, "OVERMIND_WARM_IDLE", default["warm_idle"], 1.0)
        read("warm_memory", _size, "OVERMIND_WARM_MEMORY")
        read("headroom", _size, "OVERMIND_HEADROOM")
        read("fill_yield", _number, "OVERMIND_FILL_YIELD", default["fill_yield"], 0.0)
        read("settle_after", _optional_number, "OVERMIND_SETTLE_AFTER", default["settle_after"], 0.0)
        read("restore", _restore, "OVERMIND_RESTORE")
        if errors:
            raise ConfigError("; ".join(errors))
        restore_bytes, restore_share = values.pop("restore")
        return cls(
            runtime_dir=default_runtime_dir(env),
            state_dir=default_state_dir(env),
            restore_bytes=restore_bytes,
            restore_share=restore_share,
            disable=_flag(env, "OVERMIND_DISABLE", notes=notes),
            strict=strict,
            autostart=not _flag(env, "OVERMIND_NO_AUTOSTART", notes=notes),
            keep_file_pages=_flag(env, "OVERMIND_KEEP_FILE_PAGES", default["keep_file_pages"], notes=notes),
            cold_wait=values.pop("cold") == "wait" or strict,
            **{**values, "warm_memory": values["warm_memory"] or default["warm_memory"]},
        )

    @property
    def socket_path(self) -> Path:
        return self.runtime_dir / "server.sock"

    @property
    def log_path(self) -> Path:
        return self.runtime_dir / "server.log"

    @property
    def pid_path(self) -> Path:
        return self.runtime_dir / "server.pid"

    @property
    def lock_path(self) -> Path:
        """Held by a client while it starts a server (racing clients start one)."""
        return self.runtime_dir / "server.lock"

    @property
    def state_path(self) -> Optional[Path]:
        """This server's state file (overmind.server.state): one per runtime directory, so two servers
        of one user (two runtime directories) never restore each other's cache."""
        if self.state_dir is None:
            return None
        import hashlib

        tag = hashlib.sha256(os.fsencode(str(self.runtime_dir))).hexdigest()[:12]
        return self.state_dir / f"state-{tag}.json"

    @property
    def instance_lock_path(self) -> Path:
        """Held by the running server for its whole life: Note [One server per runtime directory]."""
        return self.runtime_dir / "server.instance.lock"


# -- settings read before any Config exists: monkey_patch_all() reads them on every start-up --------


def patching_disabled(env=None) -> bool:
    """``OVERMIND_DISABLE``."""
    return flag("OVERMIND_DISABLE", env)


def prestart_enabled(env=None) -> bool:
    """``OVERMIND_PRESTART`` (default on)."""
    return flag("OVERMIND_PRESTART", env, default=True)


def warm_start_enabled(env=None) -> bool:
    """``OVERMIND_WARM_START`` (default on): Note [When a warm start applies] in overmind.client.warm_start."""
    return flag("OVERMIND_WARM_START", env, default=True)


def quick_exit_enabled(env=None) -> bool:
    """``OVERMIND_QUICK_EXIT`` (default on)."""
    return flag("OVERMIND_QUICK_EXIT", env, default=True)
