"""``overmind run``: run a script in a child forked from a warm interpreter. Standard library only.

    overmind run train.py --epochs 3        # like `python train.py --epochs 3`
    overmind run -m http.server 8000        # like `python -m http.server 8000`
    overmind run -c "import torch; print(torch.randn(3))"
    overmind run --python /opt/venv/bin/python script.py

This process is only the front end: it hands its argv, working directory, environment,
umask and its own stdin/stdout/stderr to overmind-server, which forks the run from a warm
interpreter of the same context (Note [Warm interpreters] in overmind.warm.interpreter). The child
has the caller's terminal or pipes themselves, so ``isatty()``, interleaving and reading
stdin are those of plain python. The front end forwards signals and exits with the
child's status; a death by a signal is reported as a shell would see it.

Note [A light front end]
``overmind run -c pass`` costs tens of milliseconds: this module imports only ``os`` and
``sys`` at first; the path with no server (no socket file) execs plain python having read
only the settings, and the protocol, ``socket`` and ``signal`` come in only to talk to a server.

Note [Never worse than plain python]
No server, a server that refuses or does not answer within the reply bound, or no warm
interpreter ready yet for this context: the front end ``exec``\\ s plain python with the
same arguments, in place, and the server (started in the background if there was none)
gets an interpreter ready for next time. That path costs the front end's own start-up and
one round trip, tens of milliseconds.
"""

from __future__ import annotations

import os
import sys

# Note [A light front end]: the plain path (no server) imports neither the protocol nor signal;
# both are imported by the functions that talk to a server (overmind.shared.protocol.handoff).

__all__ = ["main", "command", "parse", "run_arguments"]

USAGE = "usage: overmind run [-h] [--python PATH] (SCRIPT | -m MODULE | -c CODE) [ARGS...]"
HELP = USAGE + """

Run a script as `python` would, forked from a warm interpreter of overmind-server that has
already imported what the script imports. Arguments, working directory, environment, stdio,
signals and exit status are the script's. Without a server, or before one is warm for this
interpreter and environment, it runs plain python (and gets the server ready for next time).

options:
  -h, --help     show this help message and exit
  --python PATH  the interpreter to run the script with (default: the one running overmind)

Options before `run` are the overmind command's: `overmind --runtime-dir DIR run ...` uses the
server in DIR. Python's own options go in PYTHON* variables (PYTHONWARNINGS, PYTHONOPTIMIZE...).
"""


class UsageError(ValueError):
    pass


class HelpWanted(Exception):
    """``-h`` or ``--help`` before what to run (after it, they are the script's)."""


def parse(argv: list[str]) -> tuple[str, str, str, list[str]]:
    """(python, mode, target, args) from ``overmind run``'s arguments."""
    python = sys.executable
    rest = list(argv)
    while rest and (rest[0] in ("--python", "-h", "--help") or rest[0].startswith("--python=")):
        option = rest.pop(0)
        if option in ("-h", "--help"):
            raise HelpWanted
        python = option.split("=", 1)[1] if "=" in option else rest.pop(0) if rest else ""
        if not python:
            raise UsageError("--python needs a path")
    if not rest:
        raise UsageError("nothing to run")
    head = rest.pop(0)
    if head in ("-m", "-c"):
        if not rest:
            raise UsageError(f"{head} needs an argument")
        return python, "module" if head == "-m" else "code", rest.pop(0), rest
    if head.startswith("-m") and len(head) > 2:
        return python, "module", head[2:], rest
    if head.startswith("-c") and len(head) > 2:
        return python, "code", head[2:], rest
    if head.startswith("-") and head != "-":
        raise UsageError(f"unknown option {head}; python options go in PYTHON* variables")
    return python, "script", head, rest


def _plain_argv(python: str, mode: str, target: str, args: list[str]) -> list[str]:
    flag = {"module": ["-m"], "code": ["-c"], "script": []}[mode]
    return [python, *flag, target, *args]


def _teaching_env() -> dict:
    """The environment of a run that goes plain, with overmind.client.first_run first on PYTHONPATH:
    Note [The first run teaches] in overmind.client.teach (which puts it back)."""
    here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "client", "first_run")
    old = os.environ.get("PYTHONPATH")
    return dict(os.environ, PYTHONPATH=here + (os.pathsep + old if old else ""),
                OVERMIND_FIRST_RUN_PYTHONPATH="" if old is None else "=" + old)  # "": there was none


def main(argv: list[str]) -> int:
    try:
        python, mode, target, args = parse(argv)
    except HelpWanted:
        from overmind.frontend.closed_stdout import print_or_leave

        return print_or_leave(HELP)
    except UsageError as err:
        print(f"overmind run: {err}\n{USAGE}", file=sys.stderr)
        return 2
    plain = _plain_argv(python, mode, target, args)
    from overmind.shared.settings import config as settings
    from overmind.shared.settings.config import Config, ConfigError, flag, runtime_dir_path

    # Note [A bad setting never stops a script] in overmind.shared.settings.config: said here on the user's stderr.
    settings.report = lambda message: print(f"overmind run: {message}", file=sys.stderr)
    started = None
    if flag("OVERMIND_DISABLE"):
        pass
    elif not os.path.exists(os.path.join(runtime_dir_path(), "server.sock")):
        # Note [Never worse than plain python]: no server; start one for next time, unless told not to
        if not flag("OVERMIND_NO_AUTOSTART"):
            from overmind.shared.protocol.connect import start_server

            try:
                start_server(Config.from_env(), wait=False, prepare=python)
            except ConfigError as err:
                print(f"overmind run: {err}; running plainly, no server started", file=sys.stderr)
    else:
        try:
            config = Config.from_env()
        except ConfigError as err:
            print(f"overmind run: {err}; running plainly", file=sys.stderr)
        else:
            from overmind.shared.protocol.contexts import RunSpec
            from overmind.shared.protocol.handoff import hand_off

            started = hand_off(python, RunSpec.of_caller(mode, target, args), config)
    if started is None:
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            os.execve(plain[0], plain, os.environ if flag("OVERMIND_DISABLE") else _teaching_env())
        except OSError as err:
            print(f"overmind run: cannot run {plain[0]}: {err.strerror}", file=sys.stderr)
            return 127
    from overmind.shared.protocol.handoff import exit_like, wait_for

    exit_like(wait_for(*started))
    return 1  # unreachable


def command(argv: list[str] | None = None) -> int:
    """The ``overmind`` console script and ``python -m overmind``: ``run`` stays here, light
    (Note [A light front end]: no argparse); the rest is overmind.frontend.cli, which never
    imports this module (``run`` is this command's alone)."""
    argv = sys.argv[1:] if argv is None else argv
    run_args = run_arguments(argv)
    if run_args is not None:
        return main(run_args)
    from overmind.frontend.cli import main as cli_main

    return cli_main(argv)


def run_arguments(argv: list[str]) -> list[str] | None:
    """``run``'s own arguments when ``argv`` is ``[--runtime-dir DIR]... run ...``, else None (the
    command is overmind.frontend.cli's). DIR goes into the environment: the run, the server it starts
    and the script's own ``monkey_patch_all()`` all use the server in DIR."""
    i, runtime_dir = 0, None
    while i < len(argv):
        name, eq, value = argv[i].partition("=")
        if len(name) < 3 or not "--runtime-dir".startswith(name):  # argparse takes a unique prefix too
            break
        if eq:
            runtime_dir, i = value, i + 1
        elif i + 1 < len(argv):
            runtime_dir, i = argv[i + 1], i + 2
        else:
            break
    if argv[i:i + 1] != ["run"]:
        return None
    if runtime_dir:  # empty is unset, as overmind.frontend.cli takes it
        os.environ["OVERMIND_RUNTIME_DIR"] = os.path.abspath(runtime_dir)
    return argv[i + 1:]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
