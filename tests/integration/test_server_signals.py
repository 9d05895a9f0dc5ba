"""Note [A server's signals are its own] in overmind.server.daemon: a server autostarted from a
warm-start script (whose signal mask blocks TERM while it hands its run over) starts with a clean
mask, and stops on `overmind shutdown` and on SIGTERM. Real autostart, real signals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from ..conftest import REPO, child_env

SCRIPT = "import overmind.api\novermind.api.monkey_patch_all()\nprint('ran')\n"


def _autostarted(tmp_path) -> tuple[dict, int]:
    runtime = tmp_path / "run"
    env = child_env(OVERMIND_RUNTIME_DIR=str(runtime), OVERMIND_WARM_START="1")
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    assert proc.returncode == 0 and "ran" in proc.stdout, proc.stderr[-3000:]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:  # the daemon's own pid (the launcher that started it has exited or is about to)
            pid = int((runtime / "server.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            pid = 0
        if pid and (runtime / "server.sock").exists() and _environ_has(pid, f"OVERMIND_RUNTIME_DIR={runtime}"):
            return env, pid
        time.sleep(0.1)
    raise AssertionError(f"no server autostarted in {runtime}")


def _environ_has(pid: int, item: str) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return item.encode() in f.read().split(b"\0")
    except OSError:
        return False


def _signal_state(pid: int) -> dict:
    with open(f"/proc/{pid}/status") as f:
        fields = dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)
    return {k: int(fields[k], 16) for k in ("SigBlk", "SigIgn")}


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()[0] == "Z":
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("how", ["overmind shutdown", "SIGTERM"])
def test_a_server_autostarted_by_a_warm_start_script_has_its_own_signals_and_stops(tmp_path, how):
    env, pid = _autostarted(tmp_path)
    try:
        state = _signal_state(pid)
        assert state["SigBlk"] == 0, f"blocked: {state['SigBlk']:#x}"
        assert not state["SigIgn"] & (1 << (signal.SIGTERM - 1) | 1 << (signal.SIGINT - 1) | 1 << (signal.SIGHUP - 1))
        if how == "SIGTERM":
            os.kill(pid, signal.SIGTERM)
        else:
            subprocess.run([sys.executable, "-m", "overmind.frontend.cli", "shutdown"], env=env, timeout=60,
                           capture_output=True, cwd=REPO, check=True)
        assert _gone_within(pid, 5.0), f"the server still runs 5 s after {how}"
    finally:
        if os.path.exists(f"/proc/{pid}"):
            os.kill(pid, signal.SIGKILL)
