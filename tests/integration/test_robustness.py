"""Never a stuck user: bad settings, odd arguments, a stopped or unreachable server, loader
deaths and hostile peers of our own uid. Real server subprocess, real clients, real sockets.
"""

from __future__ import annotations

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
from ..helpers.clients import PRELUDE, backdate, kill_all, run_client, servers_of, wait_for

LM = PRELUDE + '''
from transformers import LlamaForCausalLM
def weights(model):
    return float(sum(t.double().sum() for t in model.state_dict().values()))
path = sys.argv[1]
'''


def _rss_kib(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def _handshake(server) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(str(server.socket_path))
    P.send_message(sock, P.Hello(P.PROTOCOL_VERSION, os.getpid(), "client", "test"))
    assert isinstance(P.recv_message(sock)[0], P.Welcome)
    return sock


# -- 2. the user's call never fails because of overmind ---------------------------------------


@pytest.fixture(scope="module")
def plain_lm(models) -> float:
    """The LM's weights as plain python loads them (once: every setting below compares to it)."""
    return run_client(LM + "report(a=weights(LlamaForCausalLM.from_pretrained(path)))",
                       child_env(OVERMIND_DISABLE="1"), str(models["lm"]))["a"]


@pytest.mark.parametrize("setting", ["OVERMIND_TIMEOUT=abc", "OVERMIND_MAX_MEMORY=lots", "OVERMIND_WORKERS=-1",
                                     "OVERMIND_COLD=maybe", "OVERMIND_LOG_LEVEL=LOUD"])
def test_a_malformed_setting_falls_back_with_one_warning_and_strict_raises(server, models, plain_lm, setting):
    # Note [A bad setting never stops a script] in overmind.shared.settings.config: plain loads, one warning
    # naming the variable and what it accepts.
    name, value = setting.split("=")
    code = LM + '''
a = weights(LlamaForCausalLM.from_pretrained(path))
b = weights(LlamaForCausalLM.from_pretrained(path))
report(a=a, b=b, strict=strict(LlamaForCausalLM.from_pretrained, path))
'''
    out = run_client(code, server.client_env(**{name: value}), str(models["lm"]))
    assert out["a"] == out["b"] == plain_lm
    assert len(out["warnings"]) == 1 and f"{name}={value!r}" in out["warnings"][0], out["warnings"]
    assert "accepted: " in out["warnings"][0] or "use 40G" in out["warnings"][0], out["warnings"]
    assert out["strict"]["type"] == "OvermindError" and name in out["strict"]["message"]


def test_bad_yes_no_values_and_patch_points_warn_once_each_and_the_cache_still_serves(server, models):
    # monkey_patch_all() used to raise on OVERMIND_PATCH=garbage, before the script did anything;
    # a yes/no value that is no yes or no used to count as "no" silently. Now each warns once
    # and acts as its default, so the loads still go through the cache.
    env = server.client_env(OVERMIND_PATCH="garbage", OVERMIND_STRICT="banana", OVERMIND_DISABLE="maybe")
    code = LM + "report(**{k: weights(LlamaForCausalLM.from_pretrained(path)) for k in 'ab'})"
    out = run_client(code, env, str(models["lm"]))
    assert out["a"] == out["b"]
    warnings = sorted(out["warnings"])
    assert len(warnings) == 3, warnings
    assert "OVERMIND_DISABLE='maybe' is not a yes/no value" in warnings[0] and "using the default (no)" in warnings[0]
    assert "OVERMIND_PATCH: invalid patch spec 'garbage'" in warnings[1] and "module::Qualname.attr" in warnings[1]
    assert "OVERMIND_STRICT='banana' is not a yes/no value" in warnings[2]
    assert all("1, true, yes, on; 0, false, no, off or empty" in w for w in (warnings[0], warnings[2]))
    status = server.wait_idle()
    assert status["misses"] >= 1 and status["entries"] == 1, status  # OVERMIND_DISABLE=maybe left the cache on


@pytest.mark.parametrize("mode", ["--foreground", "--daemon"])
def test_a_bad_server_setting_refuses_to_start_saying_why_on_stderr_and_in_the_log(runtime_dir, mode):
    # It used to die of a raw "ValueError: Unknown level" with an empty log, while clients
    # pointed at that log.
    env = child_env(OVERMIND_RUNTIME_DIR=str(runtime_dir), OVERMIND_LOG_LEVEL="LOUD")
    proc = subprocess.run([sys.executable, "-m", "overmind.server", mode], env=env, capture_output=True,
                          text=True, timeout=120, cwd=REPO)
    said = "OVERMIND_LOG_LEVEL='LOUD' is not a choice (accepted: DEBUG, INFO, WARNING, ERROR, CRITICAL"
    assert proc.returncode == 2 and said in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert said in (runtime_dir / "server.log").read_text()
    assert not (runtime_dir / "server.sock").exists()


def test_a_server_logs_a_bad_yes_no_value_and_starts(make_server):
    server = make_server({"OVERMIND_STRICT": "banana"})
    assert server.status()["pid"] == server.pid
    assert "WARNING overmind.server.daemon" in server.log() and "OVERMIND_STRICT='banana'" in server.log()


def test_the_overmind_command_names_a_bad_setting_on_stderr(server, tmp_path):
    overmind = str(Path(sys.executable).parent / "overmind")
    # A yes/no value: said once, the default used, the command done.
    status = subprocess.run([overmind, "status", "--json"], env=server.client_env(OVERMIND_STRICT="banana"),
                            capture_output=True, text=True, timeout=60, cwd=REPO)
    assert status.returncode == 0 and status.stderr.count("overmind: OVERMIND_STRICT='banana'") == 1, status.stderr
    # Any other bad value: the command cannot know what was meant; it exits 2 (bad settings) saying why.
    status = subprocess.run([overmind, "status"], env=server.client_env(OVERMIND_REPLY_TIMEOUT="soon"),
                            capture_output=True, text=True, timeout=60, cwd=REPO)
    assert status.returncode == 2 and "OVERMIND_REPLY_TIMEOUT='soon'" in status.stderr, status.stderr
    # `overmind run` runs the script plainly and says why, with a server and without one.
    script = "print('ran')"
    for env in (server.client_env(OVERMIND_COLD="maybe"),
                child_env(OVERMIND_RUNTIME_DIR=str(tmp_path / "none"), OVERMIND_COLD="maybe")):
        run = subprocess.run([overmind, "run", "-c", script], env=env, capture_output=True, text=True, timeout=120,
                             cwd=REPO)
        assert run.returncode == 0 and run.stdout == "ran\n", (run.stdout, run.stderr)
        assert run.stderr.startswith("overmind run: OVERMIND_COLD='maybe' is not a choice (accepted: background, "
                                     "wait"), run.stderr
        assert "running plainly" in run.stderr and run.stderr.count("\n") == 1, run.stderr
    run = subprocess.run([overmind, "run", "-c", script], env=server.client_env(OVERMIND_DISABLE="maybe"),
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert run.returncode == 0 and run.stdout == "ran\n", (run.stdout, run.stderr)
    assert run.stderr.count("overmind run: OVERMIND_DISABLE='maybe' is not a yes/no value") == 1, run.stderr


def test_an_argument_whose_reduce_raises_falls_back_to_the_original(server, tmp_path):
    code = PRELUDE + '''
import torch
class Odd(dict):  # a valid map_location that refuses to be pickled
    def __reduce__(self):
        raise ValueError("no pickling for you")
torch.save({"w": torch.arange(6.0)}, sys.argv[1])
os.utime(sys.argv[1], (time.time() - 60, time.time() - 60))
got = torch.load(sys.argv[1], map_location=Odd(cpu="cpu"))
report(w=got["w"].tolist(), strict=strict(torch.load, sys.argv[1], Odd(cpu="cpu")))
'''
    out = run_client(code, server.client_env(), str(tmp_path / "w.pt"))
    assert out["w"] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert len(out["warnings"]) == 1 and "no pickling for you" in out["warnings"][0], out["warnings"]
    assert out["strict"]["type"] == "OvermindError" and "no pickling for you" in out["strict"]["message"]


# -- 3. a stopped or unreachable server --------------------------------------------------------


def test_a_warm_call_against_a_stopped_server_gives_up_at_the_reply_bound_and_loads_plainly(server, models):
    # The decision, not the latency (a busy machine stretches any wall-clock bound; the cost of
    # a fallback is a benchmark's business): the call gave up at OVERMIND_REPLY_TIMEOUT, never at
    # OVERMIND_TIMEOUT (300 s, which applies only to a cold fill the caller waits for), the
    # warning says so, and the plain load ran and returned the same weights.
    code = LM + '''
def stopped():  # every thread of the server
    tasks = f"/proc/{sys.argv[2]}/task"
    return all(open(f"{tasks}/{t}/stat").read().rpartition(")")[2].split()[0] == "T" for t in os.listdir(tasks))
first, _, _ = timed(LlamaForCausalLM.from_pretrained, path)
# SIGSTOP: the entry is cached, the server frozen. kill() returns before the stop takes effect: a
# thread that runs first (the one our request wakes) could still answer, so wait for every thread.
os.kill(int(sys.argv[2]), 19)
deadline = time.monotonic() + 60
while not stopped() and time.monotonic() < deadline:
    time.sleep(0.005)
before = stopped()
second, err, seconds = timed(LlamaForCausalLM.from_pretrained, path)
after = stopped()
strict_result = strict(LlamaForCausalLM.from_pretrained, path)
os.kill(int(sys.argv[2]), 18)
report(first=weights(first), second=weights(second), err=repr(err), seconds=seconds, strict=strict_result,
       server=[before, after])
'''
    env = server.client_env(OVERMIND_COLD="wait", OVERMIND_REPLY_TIMEOUT="1.25")
    try:
        out = run_client(code, env, str(models["lm"]), str(server.pid))
    finally:
        server.proc.send_signal(signal.SIGCONT)
    assert out["server"] == [True, True], out  # stopped throughout the second call
    assert out["first"] == out["second"] and out["err"] == "None", out
    [warning] = out["warnings"] or [f"no warning: {out}"]
    assert "did not answer within 1.25s" in warning and "loading without the cache" in warning, warning
    assert out["strict"]["type"] == "OvermindError" and "within 1.25s" in out["strict"]["message"], out["strict"]
    assert server.status()["pid"] == server.pid


def test_a_deleted_socket_is_replaced_and_no_second_server_is_started(server, runtime_dir, models):
    try:
        env = server.client_env(OVERMIND_COLD="wait")
        env.pop("OVERMIND_NO_AUTOSTART")  # clients may start a server: they must not start a second one
        code = LM + "m = LlamaForCausalLM.from_pretrained(path); report(w=weights(m))"
        first = run_client(code, env, str(models["lm"]))
        server.socket_path.unlink()
        again = run_client(code, env, str(models["lm"]))
        assert again["w"] == first["w"] and again["warnings"] == [], again
        assert servers_of(runtime_dir) == [server.pid]
        status = server.status()
        assert status["socket_rebinds"] == 1 and status["hits"] >= 1, status
        assert "was removed or replaced" in server.log()
    finally:
        server.stop()  # then whatever a client may have started there
        kill_all(runtime_dir)


def test_the_cli_finds_and_stops_a_server_it_cannot_reach(server):
    server.proc.send_signal(signal.SIGSTOP)  # it holds the runtime dir but answers nothing
    status = server.cli("status", check=False)
    assert status.returncode == 1 and f"pid {server.pid}" in status.stderr, status.stderr
    stop = server.cli("shutdown", check=False)
    assert stop.returncode == 0 and f"pid {server.pid}" in stop.stdout, (stop.stdout, stop.stderr)
    # Woken and stopped by SIGTERM (a clean exit), not killed once the CLI's wait ran out.
    assert server.proc.wait(timeout=60) == 0 and "killed" not in stop.stderr, stop.stderr
    assert "SIGTERM: shutting down" in server.log()


def test_a_client_whose_server_lost_the_start_race_uses_the_winner(runtime_dir):
    """The one line's first run starts a server detached (``wait=False``, no client lock) while its
    prepare thread starts one too: the one that finds the other holding the runtime dir leaves,
    which is no error, and a client whose server left connects to the winner."""
    from overmind.shared.protocol.connect import start_server
    from overmind.shared.settings.config import Config

    env = child_env(OVERMIND_RUNTIME_DIR=str(runtime_dir))
    config = Config.from_env(env)
    log = runtime_dir / "server.log"
    try:
        start_server(config, wait=False)  # as `overmind run` and the one line's hand-over do
        start_server(config)  # at once, as the prepare thread does: it raised when its server lost
        wait_for(lambda: log.exists() and "not starting: another overmind-server" in log.read_text(), 30,
                 "the server that lost the race to say so")
        status = subprocess.run([sys.executable, "-m", "overmind", "status"], env=env, capture_output=True,
                                text=True, timeout=60, cwd=REPO)
        assert status.returncode == 0, status.stderr
        assert " ERROR " not in log.read_text(), log.read_text()[-3000:]
    finally:
        subprocess.run([sys.executable, "-m", "overmind", "shutdown"], env=env, capture_output=True, timeout=60,
                       cwd=REPO)
        kill_all(runtime_dir)


def test_a_server_started_while_the_last_one_still_holds_the_runtime_dir_waits_for_it(runtime_dir):
    """Note [One server per runtime directory]: the lock goes with the last of the old server's
    threads, which can be after `overmind shutdown` saw it gone. A new server waits LOCK_WAIT for
    a holder that does not serve, then says another runs."""
    from overmind.server import daemon

    env = child_env(OVERMIND_RUNTIME_DIR=str(runtime_dir))
    start = [sys.executable, "-m", "overmind.server", "--daemon"]
    lock = os.open(runtime_dir / "server.instance.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        import fcntl

        fcntl.flock(lock, fcntl.LOCK_EX)  # an old server, exiting: it holds the lock, serves nothing
        started = time.monotonic()
        refused = subprocess.run(start, env=env, capture_output=True, text=True, timeout=60, cwd=REPO)
        assert refused.returncode == daemon.EXIT_ALREADY_RUNNING, refused.stderr
        assert "already running" in refused.stderr and time.monotonic() - started >= daemon.LOCK_WAIT
        threading.Timer(0.5, os.close, [lock]).start()  # it exits: the kernel releases its lock
        lock = -1
        ready = subprocess.run(start, env=env, capture_output=True, text=True, timeout=60, cwd=REPO)
        assert ready.returncode == 0 and "ready" in ready.stdout, ready.stderr
    finally:
        if lock >= 0:
            os.close(lock)
        subprocess.run([sys.executable, "-m", "overmind", "shutdown"], env=env, capture_output=True, timeout=60,
                       cwd=REPO)
        kill_all(runtime_dir)


def test_the_cli_counts_a_process_alive_until_its_last_thread_is_gone():
    """`overmind shutdown` returns once the server is gone, so that a server started next finds the
    runtime dir free: a first thread that exited while another runs is not the process gone."""
    from overmind.frontend.cli import _alive

    code = ("import ctypes, threading, time\n"
            "threading.Thread(target=time.sleep, args=(1.0,)).start()\n"
            "ctypes.CDLL(None).pthread_exit(None)  # the first thread leaves; the other sleeps on\n")
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        def first_thread_state() -> bytes:
            with open(f"/proc/{proc.pid}/stat", "rb") as f:
                return f.read().rpartition(b")")[2].split()[0]

        wait_for(lambda: first_thread_state() == b"Z", 30, "the first thread to exit")
        assert len(os.listdir(f"/proc/{proc.pid}/task")) == 2 and _alive(proc.pid)
        wait_for(lambda: not _alive(proc.pid), 30, "the other thread to end")  # the other thread ended: a zombie to reap
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
        proc.wait()


# -- 4. a loader's death is retried; a raise is remembered -------------------------------------

DYING_MODULE = '''
import os


def load(path):
    if os.environ.get("OVERMIND_DISABLE") == "1" and os.path.exists(path + ".die"):
        os.kill(os.getpid(), 9)  # as the OOM killer would
    return {"path": path, "n": 42}
'''


def test_a_loader_killed_mid_fill_does_not_poison_the_key(server, tmp_path):
    modules, data = tmp_path / "modules", tmp_path / "data"
    modules.mkdir()
    data.mkdir()
    (modules / "dying_loader.py").write_text(DYING_MODULE)
    backdate(data)
    marker = str(data) + ".die"
    open(marker, "w").close()
    code = PRELUDE + '''
import dying_loader
got = overmind.api.load(dying_loader.load, sys.argv[1])
report(got=got)
'''
    env = server.client_env(TEST_SYS_PATH=str(modules), OVERMIND_COLD="wait")
    died = run_client(code, env, str(data))
    assert died["got"] == {"path": str(data), "n": 42}
    assert len(died["warnings"]) == 1 and "LOADER_CRASHED" in died["warnings"][0], died["warnings"]
    os.unlink(marker)  # the next try would succeed: it must be made
    retried = run_client(code, env, str(data))
    assert retried["got"] == died["got"] and retried["warnings"] == [], retried["warnings"]
    status = server.status()
    assert (status["misses"], status["entries"], status["remembered_failures"]) == (2, 1, 0), status


# -- 5. hostile peers of our own uid cost bounded memory ---------------------------------------


def test_stalled_blobs_and_oversized_keys_cost_the_server_bounded_memory(server):
    for _ in range(3):
        server.status()
    idle = _rss_kib(server.pid)
    stalled = []
    for _ in range(8):  # each announces a 64 MiB blob and goes silent
        sock = _handshake(server)
        header = P.encode_frame(P.Load("a" * 32, "m:f", "d", {}, wait=False), b"x" * 0)
        fields = header[P.HEADER.size:]
        sock.sendall(P.HEADER.pack(P.MAGIC, P.PROTOCOL_VERSION, P.Load.TYPE, len(fields), 64 << 20 - 1) + fields)
        sock.sendall(b"\0" * 1000)
        stalled.append(sock)
    context = {"python": sys.executable, "cwd": "/", "sys_path": [], "env": {}}
    with _handshake(server) as sock:  # 300 loads with unique 512 KiB keys
        for i in range(300):
            key = f"{i:08x}" * (64 << 10)
            P.send_message(sock, P.Load(key, "m:f", "d", context, wait=False), b"x")
            reply = P.recv_message(sock)[0]
            assert isinstance(reply, P.Error) and reply.code == P.ErrorCode.BAD_REQUEST, reply
    time.sleep(0.5)
    grown = (_rss_kib(server.pid) - idle) / 1024
    assert grown < 40, f"server grew by {grown:.0f} MiB"
    status = server.status()
    assert status["remembered_failures"] == 0 and status["loading"] == 0, status
    for sock in stalled:
        sock.close()


def test_connections_past_the_cap_are_refused_busy_and_the_server_keeps_serving(server):
    from overmind.server.connections import MAX_CONNECTIONS

    held = []
    try:
        for _ in range(MAX_CONNECTIONS + 5):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(10)
            # A full listen backlog answers EAGAIN: wait for the server to accept the earlier ones.
            wait_for(lambda: sock.connect_ex(str(server.socket_path)) == 0, 20, "a free backlog slot")
            held.append(sock)
        # The extra ones get BUSY and are closed; the first MAX_CONNECTIONS wait for a handshake.
        refused = wait_for(lambda: server_busy(held[-5:]), 20, "BUSY answers")
        assert refused == 5
    finally:
        for sock in held:
            sock.close()
    wait_for(lambda: server.status()["connections"] <= 1, 20, "the connections to be released")
    assert server.status()["busy_refusals"] >= 5


def server_busy(socks) -> int:
    count = 0
    for sock in socks:
        try:
            message = P.recv_message(sock)[0]
        except (EOFError, OSError, P.ProtocolError):
            continue
        count += isinstance(message, P.Error) and message.code == P.ErrorCode.BUSY
    return count
