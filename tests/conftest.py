"""Shared fixtures: fresh-interpreter runner, offline Hugging Face environment."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

REPO = Path(__file__).resolve().parent.parent


def age_files(*paths, seconds: float = 30.0) -> None:
    """Backdate files so they are not 'racy' (overmind.shared.calls.keys Note [Racy files]): tests save a
    model and load it within the same second, which overmind rightly refuses to cache."""
    import time

    stamp = time.time() - seconds
    for path in paths:
        path = Path(path)
        for p in [path, *path.rglob("*")] if path.is_dir() else [path]:
            os.utime(p, (stamp, stamp))


# Servers the tests start keep their state (overmind.server.state) here, never in the user's
# ~/.local/state: one file per runtime directory, so two tests never restore each other's cache.
_STATE_HOME = None


def state_home() -> str:
    global _STATE_HOME
    if _STATE_HOME is None:
        import atexit
        import shutil
        import tempfile

        _STATE_HOME = tempfile.mkdtemp(prefix="om-state-home-")
        atexit.register(shutil.rmtree, _STATE_HOME, True)
    return _STATE_HOME


# A child that autostarts a server without a runtime directory of its own (a script calling
# monkey_patch_all()) starts it here, never in the user's $XDG_RUNTIME_DIR or /tmp/overmind-<uid>;
# the session stops it at its end.
_RUNTIME_HOME = None


def runtime_home() -> str:
    global _RUNTIME_HOME
    if _RUNTIME_HOME is None:
        import atexit
        import tempfile

        _RUNTIME_HOME = tempfile.mkdtemp(prefix="om-rt-", dir="/tmp")  # AF_UNIX paths: short
        atexit.register(_stop_default_server, _RUNTIME_HOME)
    return _RUNTIME_HOME


def _stop_default_server(home: str) -> None:
    import shutil
    import signal

    try:
        pid = int((Path(home) / "overmind" / "server.pid").read_text().split()[0])
        os.kill(pid, signal.SIGTERM)
    except (OSError, ValueError, IndexError):
        pass
    shutil.rmtree(home, ignore_errors=True)


def child_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OVERMIND_")}
    env.update({"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "XDG_STATE_HOME": state_home(),
                "XDG_RUNTIME_DIR": runtime_home()})
    env.update(extra)
    return env


def run_python(code: str, *, env: dict | None = None, timeout: float = 180, check: bool = True,
               user: str | None = None) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (a new process, as a user's script would be)."""
    argv = [sys.executable, "-c", textwrap.dedent(code)]
    if user is not None:
        argv = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", *argv]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env or child_env(), timeout=timeout, cwd=REPO)
    if check and proc.returncode != 0:
        raise AssertionError(f"child exited {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-6000:]}")
    return proc


@pytest.fixture
def python():
    return run_python


def build_shared_library(source: Path, out: Path) -> Path:
    """``cc -shared`` of one C file (the tests' shims and stand-ins for native libraries)."""
    import shutil

    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("needs a C compiler")
    subprocess.run([compiler, "-shared", "-fPIC", "-O2", "-o", str(out), str(source), "-ldl", "-lpthread"], check=True)
    return out


@pytest.fixture(scope="session")
def many_cpus(tmp_path_factory) -> dict:
    """The environment that makes a process see 16 CPUs on this machine (tests/shims/many_cpus.c,
    preloaded): what thread pools size themselves from on a user's 16-core host."""
    shim = build_shared_library(REPO / "tests" / "shims" / "many_cpus.c",
                                tmp_path_factory.mktemp("shim") / "libmany_cpus.so")
    return {"LD_PRELOAD": str(shim)}
