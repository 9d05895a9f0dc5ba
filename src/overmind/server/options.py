"""``overmind-server``'s command line: a flag for each server setting, its ``OVERMIND_*`` variable
the fallback::

    args, env = parse(argv)            # env: os.environ, each flag given in its variable's place
    config = Config.from_env(env)      # flags and variables read by one reader

:data:`SETTINGS` is the one list of the server's settings. Each row names its variable; the flag
is the variable's name without ``OVERMIND_``, lower case, ``-`` for ``_`` (``OVERMIND_WARM_MAX``
is ``--warm-max``), and its text is what ``overmind-server --help`` prints. What a value may be
and its default are overmind.shared.settings.config's: a flag's value is checked by the reader of its
variable, and a bad one stops the command line at once (exit 2) with what is accepted, as
argparse does; a flag given wins over its variable. The client's settings (``OVERMIND_COLD``,
``OVERMIND_STRICT``...) are variables only: overmind.shared.settings.config lists them.

Standard library only, as the whole server.
"""

from __future__ import annotations

import argparse
import os
from typing import NamedTuple, Optional

from overmind.shared.settings.config import LOG_LEVELS, Config, ConfigError

__all__ = ["SETTINGS", "Setting", "build_parser", "parse"]

PREFIX = "OVERMIND_"


class Setting(NamedTuple):
    variable: str  # OVERMIND_*; the flag and the Config field are named after it
    metavar: Optional[str]  # None: a yes/no setting, --name and --no-name
    help: str
    default: str = ""  # said in --help; empty: Config.from_env({})'s value of the field

    @property
    def flag(self) -> str:
        return "--" + self.variable[len(PREFIX):].lower().replace("_", "-")

    @property
    def dest(self) -> str:
        return self.variable[len(PREFIX):].lower()


SETTINGS = (
    Setting("OVERMIND_RUNTIME_DIR", "DIR", "socket, log and pid file: a directory of yours that only you can enter "
            "(created 0700); clients must name the same one", "$XDG_RUNTIME_DIR/overmind, else /tmp/overmind-<uid>"),
    # overmind.server.state
    Setting("OVERMIND_STATE_DIR", "DIR", "where the server keeps what it learned across restarts; created 0700",
            "$XDG_STATE_HOME/overmind, else ~/.local/state/overmind"),
    Setting("OVERMIND_MAX_MEMORY", "SIZE", "memory budget for cached models: 40G, 512M, 60% of the memory the "
            "server may use (the smallest of RAM and its cgroup limits) or bytes; least recently used entries are "
            "evicted", "50% of that memory"),
    # overmind.server.restore
    Setting("OVERMIND_RESTORE", "SIZE", "how much of the recently used cache a fresh server refills on its own: "
            "40G, 512M, bytes or 60% of the memory budget; 0: nothing (the state is still kept)", "100%"),
    # Note [Settling file segments] in overmind.server.settle
    Setting("OVERMIND_SETTLE_AFTER", "S", "seconds without a request after which the server copies the model files "
            "it serves from into sealed memory (at once for a file the page cache lost); never: not even then"),
    # Note [File segments stay mapped] in overmind.server.settle
    Setting("OVERMIND_KEEP_FILE_PAGES", None, "keep those files' pages mapped until they are copied; "
            "--no-keep-file-pages leaves them to the page cache, which may drop them"),
    # Note [Cold fills wait for their caller] in overmind.server.fills
    Setting("OVERMIND_FILL_YIELD", "S", "seconds a cache fill that no caller waits for waits for its caller's own "
            "plain load to end, then runs at idle CPU priority; 0: fills start at once at normal priority"),
    Setting("OVERMIND_WORKERS", "N", "loads that run at once for different keys"),
    Setting("OVERMIND_LOADER_TIMEOUT", "S", "seconds before the server kills a loader"),
    Setting("OVERMIND_WARM_MAX", "N", "warm interpreters kept at once, one per context"),
    Setting("OVERMIND_WARM_MEMORY", "SIZE", "memory all warm interpreters may hold together, as PSS: 8G, 512M, "
            "60% of the memory the server may use, or bytes"),
    Setting("OVERMIND_WARM_IDLE", "S", "seconds an unused warm interpreter is kept"),
    # Note [The cache gives way] in overmind.server.pressure
    Setting("OVERMIND_HEADROOM", "SIZE", "memory the server keeps free for other processes: when less is available "
            "it lets go of its cache, and refills it once there is room again: 2G, 512M, 10% of the memory the "
            "server may use, or bytes", "10% of that memory, at least 1G (a quarter of it at most), at most 8G"),
    Setting("OVERMIND_LOG_LEVEL", "LEVEL", f"the server log's level: {', '.join(LOG_LEVELS)}"),
)


def _default_text(setting: Setting, defaults: Config) -> str:
    if setting.default:
        return setting.default
    value = getattr(defaults, setting.dest)
    if isinstance(value, bool):
        return setting.flag if value else "--no-" + setting.flag[2:]
    if setting.metavar == "SIZE":
        for letter, shift in (("T", 40), ("G", 30), ("M", 20), ("K", 10)):
            if value % (1 << shift) == 0:
                return f"{value >> shift}{letter}"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _checked(variable: str):
    """An argparse ``type``: the value as overmind.shared.settings.config reads ``variable``, or its error."""
    def check(value: str) -> str:
        try:
            Config.from_env({variable: value})
        except ConfigError as err:  # "OVERMIND_X='v' is not ... (accepted: ...)": the flag names itself
            raise argparse.ArgumentTypeError(str(err).replace(f"{variable}={value.strip()!r}", repr(value), 1)) \
                from None
        return value

    return check


def _memory_text() -> str:
    """Which limit the memory settings' shares are of, here and now."""
    from overmind.server.pressure import default_headroom
    from overmind.shared.settings.host_memory import HostMemory

    try:
        memory = HostMemory.read()
    except OSError as err:
        return f"The memory the server may use cannot be read here: {err}."
    limit = memory.limit
    gib = 1 << 30
    return (f"The memory the server may use here: {limit.bytes / gib:.1f} GiB, from {limit.source} (the smallest of "
            f"RAM and the cgroup limits over it); so by default the budget is {limit.bytes // 2 / gib:.1f} GiB "
            f"and the headroom {default_headroom(limit.bytes) / gib:.1f} GiB.")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="overmind-server", description="The overmind model cache daemon.",
        epilog="Clients find the server by its runtime directory (OVERMIND_RUNTIME_DIR, or `overmind --runtime-dir`); "
               "their own settings are environment variables (README, Settings). " + _memory_text())
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--foreground", action="store_true", help="stay attached; log to stderr too (default)")
    mode.add_argument("--daemon", action="store_true", help="detach once ready")
    group = parser.add_argument_group("settings", "Each flag falls back to the environment variable named with "
                                      "it, then to the default; a flag given wins.")
    defaults = Config.from_env({})
    for setting in SETTINGS:
        text = f"{setting.help} (default {_default_text(setting, defaults)}; {setting.variable})".replace("%", "%%")
        if setting.metavar is None:
            group.add_argument(setting.flag, dest=setting.dest, action=argparse.BooleanOptionalAction, help=text)
        else:
            path = setting.metavar == "DIR"
            group.add_argument(setting.flag, dest=setting.dest, metavar=setting.metavar, help=text,
                               type=str if path else _checked(setting.variable))
    return parser


def parse(argv: Optional[list[str]] = None, environ=None) -> tuple[argparse.Namespace, dict]:
    """The parsed command line, and ``environ`` (default ``os.environ``) with each flag given put in
    its variable's place, for Config.from_env. A bad flag exits 2 (argparse), naming what is accepted."""
    args = build_parser().parse_args(argv)
    env = dict(os.environ if environ is None else environ)
    for setting in SETTINGS:
        value = getattr(args, setting.dest)
        if value is not None:
            env[setting.variable] = ("1" if value else "0") if setting.metavar is None else value
    return args, env
