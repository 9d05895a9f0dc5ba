"""Client processes against a real server, for the integration tests that break things:
a digest of what a load returned, the prelude every such client runs, and the processes a
runtime directory owns."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from ..conftest import REPO
from ..integration.conftest import last_json

# Shared by the clients (exec'd in each) and by this process, for the plain-load reference.
DIGEST = '''
def digest(obj):
    import hashlib
    import torch
    state = obj.state_dict() if hasattr(obj, "state_dict") else obj
    h = hashlib.sha256(type(obj).__name__.encode())
    for name in sorted(state):
        t = state[name].detach().contiguous().cpu()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
'''

PRELUDE = DIGEST + '''
import json, os, sys, time, warnings
if os.environ.get("TEST_SYS_PATH"):  # before monkey_patch_all, so its prestarted loader has it too
    sys.path.insert(0, os.environ["TEST_SYS_PATH"])
_caught = []
warnings.simplefilter("always")
warnings.showwarning = lambda message, category, *a, **k: _caught.append((category.__name__, str(message)))
import overmind.api
overmind.api.monkey_patch_all()

def overmind_warnings():
    return [m for c, m in _caught if c == "RuntimeWarning" and m.startswith("overmind:")]

def timed(fn, *args, **kwargs):
    started = time.monotonic()
    try:
        return fn(*args, **kwargs), None, time.monotonic() - started
    except Exception as err:
        return None, err, time.monotonic() - started

def with_env(name, value, fn, *args):
    os.environ[name] = value
    try:
        return timed(fn, *args)
    finally:
        del os.environ[name]

def strict(fn, *args):
    _, err, seconds = with_env("OVERMIND_STRICT", "1", fn, *args)
    return {"type": type(err).__name__, "message": str(err), "seconds": seconds}

def report(**fields):
    fields["warnings"] = overmind_warnings()
    print(json.dumps(fields))
'''

def run_client(code: str, env: dict, *args: str, timeout: float = 180) -> dict:
    proc = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)
    if proc.returncode != 0:
        raise AssertionError(f"client exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return last_json(proc)


def backdate(root: Path, seconds: float = 60.0) -> Path:
    """Age a tree the test just wrote: files modified in the last moments are not cached
    (Note [Racy files] in overmind.shared.calls.keys)."""
    when = time.time() - seconds
    for path in [*root.rglob("*"), root]:
        os.utime(path, (when, when))
    return root


def wait_for(predicate, timeout: float, what: str, interval: float = 0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


# -- processes that belong to one runtime dir (servers, warm interpreters, loaders) ----------------------


def processes_of(runtime_dir: Path) -> dict[int, list[bytes]]:
    """Live processes whose environment names ``runtime_dir``: pid -> argv."""
    marker = f"OVERMIND_RUNTIME_DIR={runtime_dir}".encode()
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            if marker not in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                continue
            if Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue  # a zombie nobody reaped yet (no init in this container): already gone
            found[int(entry)] = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError):
            continue
    return found


def servers_of(runtime_dir: Path) -> list[int]:
    return [pid for pid, argv in processes_of(runtime_dir).items() if argv[1:3] == [b"-m", b"overmind.server"]]


def kill_all(runtime_dir: Path) -> None:
    for pid in servers_of(runtime_dir):
        os.kill(pid, signal.SIGTERM)  # graceful: the server kills its warm interpreters
    try:
        wait_for(lambda: not processes_of(runtime_dir), 15, "the daemon to stop")
    except AssertionError:
        for pid in processes_of(runtime_dir):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
