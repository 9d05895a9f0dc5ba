"""Warm after a restart: the state file survives the server, a fresh server refills from it.

Note [The state file] in overmind.server.state, Note [Restore after a restart] in overmind.server.restore.
Each test starts a real server, loads, stops it (``overmind shutdown`` or SIGKILL) and starts a
fresh one on the same runtime and state directories.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from ..conftest import REPO, age_files
from .conftest import ServerProcess, last_json, running_server

LOAD_LM = """
import json
import overmind.api
overmind.api.monkey_patch_all()
import transformers
model = transformers.AutoModelForCausalLM.from_pretrained({path!r})
print(json.dumps(float(sum(p.detach().double().sum() for p in model.parameters()))))
"""



def _plain_weights(lm: Path) -> float:
    """LOAD_LM's figure for a plain load, in this process (nothing is patched in a test's own)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(lm))
    return float(sum(p.detach().double().sum() for p in model.parameters()))


@pytest.fixture
def lm(tmp_path) -> Path:
    """A small LM of this test's own (some tests rewrite it)."""
    from overmind import modelgen

    path = modelgen.save_lm(tmp_path / "lm", seed=5)
    age_files(path)
    return path


@pytest.fixture
def state_dir(tmp_path) -> Path:
    return tmp_path / "state"


def _keeping(state_dir: Path, **env: str) -> dict:
    """The settings of a server that keeps its state in ``state_dir``."""
    return {"OVERMIND_STATE_DIR": str(state_dir), **env}


def _state_file(state_dir: Path) -> Path:
    files = list(state_dir.glob("state-*.json"))
    assert len(files) == 1, files
    return files[0]


def _saved_keys(state_dir: Path) -> list:
    try:
        doc = json.loads(_state_file(state_dir).read_text())
    except (AssertionError, ValueError, OSError):
        return []
    return [e["load"]["key"] for e in doc.get("entries", [])]


def _wait_saved(state_dir: Path, count: int, timeout: float = 30.0) -> list:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        keys = _saved_keys(state_dir)
        if len(keys) >= count:
            return keys
        time.sleep(0.2)
    raise AssertionError(f"the state file did not get {count} entries in {timeout}s: {_saved_keys(state_dir)}")


def _wait_ready(server: ServerProcess, timeout: float = 50) -> subprocess.CompletedProcess:
    proc = server.cli("status", "--wait-ready", "--timeout", str(timeout), check=False)
    assert proc.returncode == 0, proc.stderr
    return proc


def _fill(server: ServerProcess, lm: Path) -> float:
    """Load the LM (a miss the server fills behind the client) and wait for its fill."""
    weights = last_json(server.run(LOAD_LM.format(path=str(lm))))
    status = server.wait_idle()
    assert status["entries"] == 1, status
    return weights


def _hit(server: ServerProcess, lm: Path) -> float:
    before = server.status()
    weights = last_json(server.run(LOAD_LM.format(path=str(lm))))
    after = server.status()
    assert after["hits"] == before["hits"] + 1 and after["misses"] == before["misses"], (before, after)
    return weights


def _fill_and_shut_down(runtime_dir: Path, state_dir: Path, lm: Path) -> float:
    """A server fills the LM, saves its state and is shut down: the state a restart finds."""
    with running_server(runtime_dir, _keeping(state_dir)) as first:
        weights = _fill(first, lm)
        _wait_saved(state_dir, 1)
        first.cli("shutdown")
    return weights


@pytest.mark.parametrize("stop", ["shutdown", pytest.param("sigkill", marks=pytest.mark.slow)])
def test_a_fresh_server_refills_what_the_last_one_served_and_the_next_load_hits(make_server, runtime_dir, state_dir,
                                                                               lm, stop):
    first = make_server(_keeping(state_dir))
    weights = _fill(first, lm)
    _wait_saved(state_dir, 1)
    if stop == "shutdown":
        first.cli("shutdown")
    else:
        os.kill(first.pid, signal.SIGKILL)
    first.proc.wait(timeout=30)
    first.stop()
    if stop == "sigkill":  # its warm interpreter outlives it a moment (it exits on the socket's EOF)
        (runtime_dir / "server.sock").unlink(missing_ok=True)
    second = make_server(_keeping(state_dir))
    ready = _wait_ready(second)
    assert "1 entries" in ready.stdout, ready.stdout
    status = second.status()
    restore = status["restore"]
    assert restore["state"] == "done" and restore["entries_done"] == 1 and restore["entries_pending"] == 0
    assert restore["bytes_done"] > 0 and restore["interpreters_ready"] >= 1
    assert status["entries"] == 1 and status["misses"] == 0  # a refill is no client's miss
    assert any(z["ready"] for z in status["interpreters"])  # the context's interpreter is warm again
    assert _hit(second, lm) == weights  # the first run's miss: a plain load (Note [Cold fills yield to their caller])


def test_a_model_changed_while_the_server_was_down_is_not_restored_and_loads_new_weights(make_server, runtime_dir,
                                                                                        state_dir, lm):
    from overmind import modelgen

    old = _fill_and_shut_down(runtime_dir, state_dir, lm)
    modelgen.save_lm(lm, seed=6)  # the same files, rewritten with other weights
    age_files(lm, seconds=10)
    second = make_server(_keeping(state_dir))
    _wait_ready(second)
    restore = second.status()["restore"]
    assert restore["entries_skipped"] == 1 and restore["entries_done"] == 0, restore
    assert second.status()["entries"] == 0
    assert "a file it read changed" in second.log()
    new = last_json(second.run(LOAD_LM.format(path=str(lm))))
    assert new != old and new == _plain_weights(lm)
    second.wait_idle()
    assert _hit(second, lm) == new
    second.stop()
    assert _saved_keys(state_dir) and len(_saved_keys(state_dir)) == 1  # the old call is forgotten


def _spoil(state_dir: Path, how: str) -> str:
    """Spoil the kept state as ``how`` says; the text the server's one warning must hold."""
    path = _state_file(state_dir)
    if how == "truncated":  # what a save that is not atomic leaves when killed mid-write
        data = path.read_bytes()
        path.write_bytes(data[:len(data) // 2])
        return "truncated or corrupt"
    if how == "garbage":
        path.write_bytes(os.urandom(5000))
        return "not JSON"
    if how == "foreign version":
        doc = json.loads(path.read_text())
        doc["version"] = 99
        path.write_text(json.dumps(doc))
        return "version 99"
    if how == "other uid":
        os.chown(path, 65534, 65534)
        return "belongs to uid 65534"
    if how == "group-writable dir":
        state_dir.chmod(0o770)
        return "is open to other users"
    raise AssertionError(how)


@pytest.fixture(scope="module")
def kept_state(tmp_path_factory):
    """(a runtime directory, the state directory its server kept after filling an LM, that LM):
    the cases below start a server there over a copy of that state (``_kept_copy``; a state file
    belongs to its runtime directory: Note [State files die with their runtime directory] in
    overmind.server.state), so one server fills for all of them."""
    from overmind import modelgen

    root = tmp_path_factory.mktemp("kept-state")
    lm, state_dir = modelgen.save_lm(root / "lm", seed=5), root / "state"
    age_files(lm)
    runtime_dir = Path(tempfile.mkdtemp(prefix="om-", dir="/tmp"))  # short: AF_UNIX paths
    try:
        _fill_and_shut_down(runtime_dir, state_dir, lm)
        yield runtime_dir, state_dir, lm
    finally:
        shutil.rmtree(runtime_dir, ignore_errors=True)


def _kept_copy(kept_state, state_dir: Path) -> Path:
    """A copy of the kept state at ``state_dir``; the runtime directory it belongs to."""
    runtime_dir, kept, _ = kept_state
    shutil.copytree(kept, state_dir)  # copy2: its modes too
    (runtime_dir / "server.log").unlink(missing_ok=True)
    return runtime_dir


@pytest.mark.parametrize("how", ["garbage", *(pytest.param(how, marks=pytest.mark.slow) for how in
                                              ("truncated", "foreign version", "other uid", "group-writable dir"))])
def test_a_spoiled_state_is_refused_with_one_line_and_the_server_serves(make_server, state_dir, kept_state, how):
    if how == "other uid" and os.getuid() != 0:
        pytest.skip("chown to another uid needs root")
    runtime_dir, lm = _kept_copy(kept_state, state_dir), kept_state[2]
    said = _spoil(state_dir, how)
    second = make_server(_keeping(state_dir), runtime_dir=runtime_dir)
    ready = _wait_ready(second, timeout=30)
    assert "nothing to restore" in ready.stdout
    warnings = [line for line in second.log().splitlines() if "WARNING" in line and "state" in line]
    assert len(warnings) == 1 and said in warnings[0], warnings
    status = second.status()
    assert status["entries"] == 0 and status["restore"]["state"] == "none"
    _fill(second, lm)  # serves normally: a miss, filled
    _hit(second, lm)
    if how == "group-writable dir":  # refused, never written to
        assert not status["state"]["kept"] and "open to other users" in status["state"]["problem"]
    else:  # replaced by a good one
        assert _wait_saved(state_dir, 1)
        assert os.stat(_state_file(state_dir)).st_uid == os.getuid()


def test_restore_zero_restores_nothing_but_keeps_the_state(make_server, state_dir, kept_state):
    second = make_server(_keeping(state_dir, OVERMIND_RESTORE="0"), runtime_dir=_kept_copy(kept_state, state_dir))
    ready = _wait_ready(second, timeout=30)
    assert "OVERMIND_RESTORE=0" in ready.stdout
    assert second.status()["entries"] == 0
    second.stop()
    assert len(_saved_keys(state_dir)) == 1


def test_wait_ready_times_out_with_a_clear_line_while_the_restore_runs(make_server, state_dir, kept_state):
    second = make_server(_keeping(state_dir), runtime_dir=_kept_copy(kept_state, state_dir))
    proc = second.cli("status", "--wait-ready", "--timeout", "0.01", check=False)
    assert proc.returncode == 4, (proc.returncode, proc.stdout, proc.stderr)
    assert "not ready after 0.01s: restoring" in proc.stderr
    assert _wait_ready(second).returncode == 0


def test_wait_ready_without_a_server_says_so(runtime_dir):
    env = {k: v for k, v in os.environ.items() if not k.startswith("OVERMIND_")}
    proc = subprocess.run([sys.executable, "-m", "overmind.frontend.cli", "--runtime-dir", str(runtime_dir), "status",
                           "--wait-ready", "--timeout", "0.5"], env=env, capture_output=True, text=True, cwd=REPO,
                          timeout=60)
    assert proc.returncode == 3 and "not ready after 0.5s: no server answers" in proc.stderr


def test_preload_fills_the_listed_calls_and_names_a_bad_line(make_server, state_dir, lm, tmp_path):
    server = make_server(_keeping(state_dir))
    calls = tmp_path / "calls.jsonl"
    calls.write_text("# the LM\n" + json.dumps({"fn": "transformers.AutoModelForCausalLM.from_pretrained",
                                                "args": [str(lm)],
                                                "kwargs": {"torch_dtype": {"$py": "torch.float32"}}}) + "\n")
    proc = server.cli("preload", str(calls), check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 of 1 calls cached" in proc.stdout
    assert server.status()["entries"] == 1
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"fn": "transformers.AutoModel.from_pretrained", "args": "x"}\n')
    proc = server.cli("preload", str(bad), check=False)
    assert proc.returncode == 2 and "bad.jsonl:1" in proc.stderr and '"args" must be a list' in proc.stderr
    missing = server.cli("preload", str(tmp_path / "none.jsonl"), check=False)
    assert missing.returncode == 2 and "is not a file" in missing.stderr
    failing = tmp_path / "failing.jsonl"
    failing.write_text(json.dumps({"fn": "transformers.AutoModelForCausalLM.from_pretrained",
                                   "args": [str(tmp_path / "no-such-model")]}) + "\n")
    proc = server.cli("preload", str(failing), check=False)
    assert proc.returncode == 1 and "failed  " in proc.stdout and "0 of 1 calls cached" in proc.stdout
