"""Never worse than no cache (ARCHITECTURE.md, invariant 4): every way the cache path can fail.

Each scenario runs real client processes against a real server (or none, or a dead,
frozen or fake one) and compares what the user got with a plain load of the same
files: a digest over every tensor's name, dtype, shape and bytes. A fallback must
return the same model, warn exactly once per process, and stay bounded in time;
``OVERMIND_STRICT=1`` turns each fallback into an ``OvermindError``.

On a miss the client normally loads plainly while the server caches behind it (Note
[Cold loads run behind the caller] in overmind.server.loads); scenarios about a client that
*waits* for the cache set ``OVERMIND_COLD=wait``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from overmind.shared import protocol as P

from ..conftest import REPO, child_env
from ..helpers.clients import (DIGEST, PRELUDE, backdate, kill_all, processes_of, run_client, servers_of,
                               wait_for)

LM_CLIENT = PRELUDE + '''
from transformers import LlamaForCausalLM
path = sys.argv[1]
first, err1, t1 = timed(LlamaForCausalLM.from_pretrained, path)
assert err1 is None, repr(err1)
second, err2, t2 = timed(LlamaForCausalLM.from_pretrained, path)
assert err2 is None, repr(err2)
fields = {"first": digest(first), "second": digest(second), "seconds": [t1, t2], "returned_at": time.time()}
if os.environ.get("TEST_STRICT"):
    fields["strict"] = strict(LlamaForCausalLM.from_pretrained, path)
report(**fields)
'''


def _digest(obj) -> str:
    namespace: dict = {}
    exec(DIGEST, namespace)
    return namespace["digest"](obj)


def _plain(fn, *args):
    """``fn(*args)`` in this process, never through the cache (whatever another test left patched)."""
    saved = os.environ.get("OVERMIND_DISABLE")
    os.environ["OVERMIND_DISABLE"] = "1"
    try:
        return fn(*args)
    finally:
        if saved is None:
            del os.environ["OVERMIND_DISABLE"]
        else:
            os.environ["OVERMIND_DISABLE"] = saved


@pytest.fixture(scope="module")
def plain_lm(models) -> str:
    """Digest of the tiny LM loaded without overmind."""
    from transformers import LlamaForCausalLM

    return _digest(_plain(LlamaForCausalLM.from_pretrained, str(models["lm"])))


def _start_client(code: str, env: dict, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code, *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO)


def _finish(proc: subprocess.Popen, timeout: float = 180) -> dict:
    out, err = proc.communicate(timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"client exited {proc.returncode}\n{out[-3000:]}\n{err[-6000:]}")
    return json.loads(out.strip().splitlines()[-1])


def _no_server_env(runtime_dir: Path, **extra: str) -> dict:
    return child_env(OVERMIND_RUNTIME_DIR=str(runtime_dir), OVERMIND_NO_AUTOSTART="1", **extra)


def _status(runtime_dir: Path, idle: bool = True) -> dict:
    """The server's status; with ``idle``, once no load is in flight (cold loads finish behind callers)."""
    from overmind.client.connection import LoadingConnection
    from overmind.shared.settings.config import Config

    config = Config.from_env(child_env(OVERMIND_RUNTIME_DIR=str(runtime_dir)))
    deadline = time.monotonic() + 120
    with LoadingConnection.open(config, role="cli", autostart=False) as conn:
        while True:
            info = conn.simple(P.Status(), P.StatusReply).info
            if not idle or info["loading"] == 0 or time.monotonic() > deadline:
                return info
            time.sleep(0.05)


@pytest.fixture
def daemon_cleanup(runtime_dir):
    """Stop whatever a test's clients started in ``runtime_dir`` (autostarted daemons)."""
    yield runtime_dir
    kill_all(runtime_dir)


# -- no server -------------------------------------------------------------------------------


def test_without_a_server_the_call_returns_the_plain_model_and_warns_once(runtime_dir, models, plain_lm):
    env = _no_server_env(runtime_dir, TEST_STRICT="1")
    out = run_client(LM_CLIENT, env, str(models["lm"]))
    assert out["first"] == out["second"] == plain_lm
    assert len(out["warnings"]) == 1, out["warnings"]
    assert "no overmind-server" in out["warnings"][0]
    assert out["strict"]["type"] == "OvermindError"
    assert "no overmind-server" in out["strict"]["message"] and str(runtime_dir) in out["strict"]["message"]
    assert not (runtime_dir / "server.sock").exists()  # OVERMIND_NO_AUTOSTART=1 started nothing


# -- autostart -------------------------------------------------------------------------------


def test_first_client_autostarts_a_daemon_and_the_second_gets_a_hit(daemon_cleanup, models, plain_lm):
    runtime_dir = daemon_cleanup
    env = child_env(OVERMIND_RUNTIME_DIR=str(runtime_dir))
    first = run_client(LM_CLIENT, env, str(models["lm"]))
    assert first["warnings"] == [] and first["first"] == first["second"] == plain_lm
    servers = servers_of(runtime_dir)
    assert len(servers) == 1
    assert (runtime_dir / "server.pid").read_text().strip() == str(servers[0])
    after_first = _status(runtime_dir)  # the daemon cached the model behind the first client
    assert (after_first["misses"], after_first["entries"]) == (1, 1), after_first

    second = run_client(LM_CLIENT, env, str(models["lm"]))
    assert second["warnings"] == [] and second["first"] == second["second"] == plain_lm
    status = _status(runtime_dir)
    assert (status["misses"], status["entries"]) == (1, 1), status
    assert status["hits"] - after_first["hits"] == 2  # both of the second client's loads
    assert servers_of(runtime_dir) == servers


def test_autostart_that_fails_falls_back_with_a_readable_warning(daemon_cleanup):
    # A server that cannot start (here: its log is a folder, which only the server opens; a bad
    # setting would already stop the client) must cost one clear warning, not the user's call.
    daemon_cleanup.mkdir(mode=0o700, exist_ok=True)
    (daemon_cleanup / "server.log").mkdir()
    env = child_env(OVERMIND_RUNTIME_DIR=str(daemon_cleanup), OVERMIND_PRESTART="0")
    code = '''
import json, warnings
caught = []
warnings.simplefilter("always")
warnings.showwarning = lambda message, category, *a, **k: caught.append(str(message))
import overmind.api
results = [overmind.api.load(json.loads, '[1, 2, 3]') for _ in range(2)]
print(json.dumps({"results": results, "warnings": [w for w in caught if w.startswith("overmind:")]}))
'''
    out = run_client(code, env)
    assert out["results"] == [[1, 2, 3], [1, 2, 3]]
    assert len(out["warnings"]) == 1, out["warnings"]
    assert out["warnings"][0].startswith("overmind: ServerUnavailable: overmind-server failed to start: ")
    assert "server.log" in out["warnings"][0] and "Traceback" not in out["warnings"][0]
    assert not servers_of(daemon_cleanup)


def test_racing_clients_autostart_exactly_one_daemon(daemon_cleanup, models, plain_lm):
    runtime_dir = daemon_cleanup
    # No prestart: the four reach for the server at the barrier, not while importing. All four
    # wait for the cache, so each request counts as a hit or a miss.
    env = child_env(OVERMIND_RUNTIME_DIR=str(runtime_dir), OVERMIND_PRESTART="0", OVERMIND_COLD="wait")
    code = PRELUDE + '''
from transformers import LlamaForCausalLM
barrier = sys.argv[2]
open(f"{barrier}.{os.getpid()}", "w").close()
while not os.path.exists(barrier):
    time.sleep(0.01)
report(digest=digest(LlamaForCausalLM.from_pretrained(sys.argv[1])))
'''
    barrier = runtime_dir / "go"
    clients = [_start_client(code, env, str(models["lm"]), str(barrier)) for _ in range(4)]
    try:
        wait_for(lambda: len(list(runtime_dir.glob("go.*"))) == 4, 120, "clients to be ready")
        assert not (runtime_dir / "server.sock").exists()
        barrier.touch()  # all four find no server at the same moment
        results = [_finish(c) for c in clients]
    finally:
        for c in clients:
            if c.poll() is None:
                c.kill()
    assert all(r["digest"] == plain_lm for r in results)
    assert all(r["warnings"] == [] for r in results), [r["warnings"] for r in results]
    assert len(servers_of(runtime_dir)) == 1
    status = _status(runtime_dir)
    assert status["misses"] + status["hits"] == 4 and status["misses"] == 1 and status["entries"] == 1, status


# -- a server that dies or freezes -----------------------------------------------------------


SLOW_MODULE = '''
import os
import time


def load(path, marker):
    if os.environ.get("OVERMIND_DISABLE") == "1":  # inside an overmind loader: hold the load open
        with open(marker + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.rename(marker + ".tmp", marker)
        time.sleep(600)
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(path)
'''


def test_server_killed_mid_load_falls_back_to_a_plain_load(server, models, plain_lm, tmp_path):
    modules = tmp_path / "modules"
    modules.mkdir()
    (modules / "slow_loader.py").write_text(SLOW_MODULE)
    marker = tmp_path / "loader.pid"
    code = PRELUDE + '''
import slow_loader
def call():
    return overmind.api.load(slow_loader.load, sys.argv[1], sys.argv[2])
first, err1, t1 = timed(call)  # the server dies under this one
assert err1 is None, repr(err1)
second, err2, t2 = timed(call)  # and is gone for this one
assert err2 is None, repr(err2)
report(first=digest(first), second=digest(second), seconds=[t1, t2], returned_at=time.time())
'''
    env = server.client_env(OVERMIND_TIMEOUT="120", OVERMIND_COLD="wait",  # the client waits on the load
                            TEST_SYS_PATH=str(modules))
    client = _start_client(code, env, str(models["lm"]), str(marker))
    loader_pid = None
    try:
        wait_for(marker.exists, 120, "the loader to start the load")
        loader_pid = int(marker.read_text())
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait(10)
        out = _finish(client)
        # The warm interpreter notices the server is gone and exits.
        wait_for(lambda: set(processes_of(server.runtime_dir)) <= {loader_pid}, 30, "the warm interpreter to exit",
                  interval=0.1)
    finally:
        if client.poll() is None:
            client.kill()
        if loader_pid is not None:
            try:
                os.kill(loader_pid, signal.SIGKILL)  # the job itself sleeps on (see the report on loader.py)
            except ProcessLookupError:
                pass
    assert out["first"] == out["second"] == plain_lm
    [warning] = out["warnings"]
    # The client noticed the death (the connection closed) and loaded plainly; it did not wait
    # out OVERMIND_TIMEOUT (120 s here), which would time out with that name in the warning.
    # Asserted by what it decided, not by the clock: a busy machine stretches any bound.
    assert "OVERMIND_TIMEOUT" not in warning and "loading without the cache" in warning, warning


def test_frozen_server_costs_at_most_the_reply_bound_not_the_timeout(server, models, plain_lm):
    # OVERMIND_TIMEOUT (300 s) is for a cold fill the caller waits for; a server that does not
    # answer at all costs OVERMIND_REPLY_TIMEOUT (here 1.5 s) per call.
    env = server.client_env(OVERMIND_REPLY_TIMEOUT="1.5", TEST_STRICT="1")
    server.proc.send_signal(signal.SIGSTOP)
    try:
        out = run_client(LM_CLIENT, env, str(models["lm"]))
    finally:
        server.proc.send_signal(signal.SIGCONT)
    assert out["first"] == out["second"] == plain_lm
    assert len(out["warnings"]) == 1, out["warnings"]
    # The reply bound, not OVERMIND_TIMEOUT, decided (no upper bound on the clock: a busy machine
    # stretches it; the cost of a fallback is measured by benchmarks).
    assert "did not answer" in out["warnings"][0] and "within 1.5s" in out["warnings"][0], out["warnings"]
    assert out["strict"]["type"] == "OvermindError" and "within 1.5s" in out["strict"]["message"]
    assert out["strict"]["seconds"] > 1.4  # it did wait for the bound: only a lower bound, safe when busy
    assert server.status()["pid"] == server.pid  # and it serves again once thawed


# -- a fake server ---------------------------------------------------------------------------


class FakeServer:
    """A real AF_UNIX listener at ``<runtime>/server.sock`` that answers with ``reply(conn)``."""

    def __init__(self, runtime_dir: Path, reply) -> None:
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(runtime_dir / "server.sock"))
        self.listener.listen(16)
        self.reply = reply
        self.connections = 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            with conn:
                conn.settimeout(10)
                try:
                    self.reply(conn)
                except OSError:
                    pass

    def close(self) -> None:
        self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        self.thread.join(5)


def _random_bytes(conn: socket.socket) -> None:
    conn.recv(65536)
    conn.sendall(os.urandom(4096).replace(P.MAGIC, b"...."))


def _garbled_entry(conn: socket.socket) -> None:
    hello, _, _ = P.recv_message(conn)
    P.send_message(conn, P.Welcome(P.PROTOCOL_VERSION, os.getpid(), "0.1.0", os.getuid()))
    while True:
        try:
            request, _, _ = P.recv_message(conn)
        except (EOFError, P.ProtocolError):
            return
        if isinstance(request, P.Load):  # a well-formed entry whose skeleton is not a pickle
            P.send_message(conn, P.Entry(request.key, os.getpid(), [], 0, True, {}), b"\x80\x05garbage")
        else:
            conn.sendall(os.urandom(64))


@pytest.mark.parametrize("reply", [_random_bytes, _garbled_entry], ids=["random-bytes", "garbled-entry"])
def test_fake_server_answering_garbage_falls_back(runtime_dir, models, plain_lm, reply):
    fake = FakeServer(runtime_dir, reply)
    try:
        out = run_client(LM_CLIENT, _no_server_env(runtime_dir, TEST_STRICT="1"), str(models["lm"]))
    finally:
        fake.close()
    assert fake.connections >= 1
    assert out["first"] == out["second"] == plain_lm
    assert len(out["warnings"]) == 1, out["warnings"]
    assert out["strict"]["type"] == "OvermindError"


# -- loaders that fail -----------------------------------------------------------------------


FAILING_CLIENT = PRELUDE + '''
def call():
    return LOAD(sys.argv[1])

behind, err1, _ = timed(call)  # a miss: loaded here while the server tries behind the caller
waited, err2, _ = with_env("OVERMIND_COLD", "wait", call)  # the cache's own failure, then the fallback
report(results=[repr(behind), repr(waited)], errors=[type(err1).__name__, type(err2).__name__],
       messages=[str(err1), str(err2)], strict=strict(call))
'''


def test_loader_exception_reaches_the_user_as_the_original_type(server, tmp_path):
    from transformers import LlamaForCausalLM

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "llama", ')  # cut short
    backdate(broken)
    with pytest.raises(Exception) as plain:
        _plain(LlamaForCausalLM.from_pretrained, str(broken))
    code = FAILING_CLIENT.replace("LOAD(", "LlamaForCausalLM.from_pretrained(")
    code = code.replace("def call():", "from transformers import LlamaForCausalLM\ndef call():")
    out = run_client(code, server.client_env(), str(broken))
    expected = type(plain.value).__name__
    assert out["errors"] == [expected, expected], out  # exactly what the plain call raises
    assert out["warnings"] == []  # as the plain call: the original raised, nothing else to say
    strict = out["strict"]
    assert strict["type"] == "OvermindError"
    assert "LOADER_FAILED" in strict["message"]
    assert "Traceback (most recent call last)" in strict["message"]  # the loader's own traceback
    assert expected in strict["message"]
    status = server.status()  # the server is unharmed, cached nothing, and ran the failing load once
    assert server.proc.poll() is None and status["entries"] == 0 and status["misses"] == 1, status
    assert status["hits"] == 0 and status["plain_loads"] >= 1, status  # the later calls loaded plainly


CRASHING_MODULE = '''
import os


def load(path):
    if os.environ.get("OVERMIND_DISABLE") == "1":  # only inside an overmind loader
        os.kill(os.getpid(), 9)
    return {"path": path, "weights": [[float(3 * row + col) for col in range(3)] for row in range(2)]}
'''


UNCACHEABLE_MODULE = """
def load(path):
    return {"path": path, "rows": (i for i in range(3))}  # a generator pickles with neither pickle nor dill
"""


def _run_custom_loader(server, tmp_path: Path, name: str, source: str) -> tuple[dict, Path]:
    """FAILING_CLIENT through ``overmind.api.load(<name>.load, data)``, ``source`` being that module."""
    modules, data = tmp_path / "modules", tmp_path / "data"
    modules.mkdir()
    data.mkdir()
    (modules / f"{name}.py").write_text(source)
    backdate(data)
    code = FAILING_CLIENT.replace("LOAD(", f"overmind.api.load({name}.load, ")
    code = code.replace("def call():", f"import {name}\ndef call():")
    return run_client(code, server.client_env(TEST_SYS_PATH=str(modules)), str(data)), data


def test_a_result_the_cache_cannot_hold_is_loaded_plainly_with_one_warning(server, tmp_path):
    out, _ = _run_custom_loader(server, tmp_path, "uncacheable_loader", UNCACHEABLE_MODULE)
    assert out["errors"] == ["NoneType", "NoneType"], out["messages"]
    # Unlike an original that raised, this is the cache's own limit: say so, once.
    assert len(out["warnings"]) == 1 and "CANNOT_CACHE" in out["warnings"][0], out["warnings"]


def test_loader_crash_is_reported_and_the_server_survives(server, tmp_path):
    out, data = _run_custom_loader(server, tmp_path, "crashing_loader", CRASHING_MODULE)
    expected = repr({"path": str(data), "weights": [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]})
    assert out["errors"] == ["NoneType", "NoneType"], out["messages"]
    assert out["results"] == [expected, expected]
    assert len(out["warnings"]) == 1 and "LOADER_CRASHED" in out["warnings"][0], out["warnings"]
    assert out["strict"]["type"] == "OvermindError" and "LOADER_CRASHED" in out["strict"]["message"]
    status = server.status()
    # A death is tried again (Note [Only deterministic failures are remembered] in overmind.server.failures),
    # up to MAX_DEATHS in a row: the three calls start at most three loads.
    assert server.proc.poll() is None and status["entries"] == 0 and 1 <= status["misses"] <= 3, status
    assert all(z["alive"] for z in status["interpreters"]), status["interpreters"]  # only the forked child died


# -- single flight ---------------------------------------------------------------------------


def test_sixteen_clients_missing_one_key_share_one_load(server, models):
    import safetensors.torch

    weights = models["lm"] / "model.safetensors"
    plain = _digest(_plain(safetensors.torch.load_file, str(weights)))
    code = PRELUDE + '''
import safetensors.torch
weights, barrier = sys.argv[1], sys.argv[2]
open(f"{barrier}.{os.getpid()}", "w").close()
while not os.path.exists(barrier):
    time.sleep(0.005)
report(digest=digest(safetensors.torch.load_file(weights)))
'''
    barrier = server.runtime_dir / "go"
    env = server.client_env(OVERMIND_COLD="wait")  # all sixteen wait for the one load
    clients = [_start_client(code, env, str(weights), str(barrier)) for _ in range(16)]
    try:
        wait_for(lambda: len(list(server.runtime_dir.glob("go.*"))) == 16, 150, "16 clients to be ready")
        barrier.touch()  # all sixteen ask at once
        results = [_finish(c) for c in clients]
    finally:
        for c in clients:
            if c.poll() is None:
                c.kill()
    assert [r["digest"] for r in results] == [plain] * 16
    assert all(r["warnings"] == [] for r in results), [r["warnings"] for r in results]
    status = server.status()
    assert (status["misses"], status["hits"], status["entries"]) == (1, 15, 1), status
    misses = [line for line in server.log().splitlines() if " miss " in line]
    assert len(misses) == 1, misses  # one loader ran
