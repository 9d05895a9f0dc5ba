"""Only the owner gets in, and no peer can take the server down (ARCHITECTURE.md, invariant 5).

Every test talks to a real ``overmind-server`` subprocess over its real socket; the
"other user" is a real process running as uid 65534 (``setpriv``).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from overmind.shared import protocol as P
from overmind.shared.settings.config import ConfigError, ensure_private_dir

from ..conftest import REPO, child_env, run_python

OTHER_UID = 65534

needs_root = pytest.mark.skipif(os.getuid() != 0 or shutil.which("setpriv") is None,
                                reason="acting as another uid needs root and setpriv (util-linux)")


# -- helpers ---------------------------------------------------------------------------------


def _connect(server) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(str(server.socket_path))
    return sock


def _handshake(server) -> socket.socket:
    sock = _connect(server)
    P.send_message(sock, P.Hello(P.PROTOCOL_VERSION, os.getpid(), "client", "test"))
    welcome, _, _ = P.recv_message(sock)
    assert isinstance(welcome, P.Welcome) and welcome.uid == os.getuid()
    return sock


def _reply(sock: socket.socket):
    """The server's answer before it closes: an Error message, or None if it just closed."""
    try:
        message, _, fds = P.recv_message(sock)
    except (EOFError, ConnectionResetError):
        return None
    for fd in fds:
        os.close(fd)
    return message


def _assert_closed(sock: socket.socket) -> None:
    try:
        assert sock.recv(1) == b"", "the server kept a connection that sent garbage"
    except ConnectionResetError:
        pass


def _assert_healthy(server) -> dict:
    assert server.proc.poll() is None, "the server died"
    info = server.status()
    assert info["pid"] == server.pid
    return info


def _header(mtype: int, json_len: int, blob_len: int = 0, version: int = P.PROTOCOL_VERSION,
            magic: bytes = P.MAGIC) -> bytes:
    return struct.pack("<4sHHIQ", magic, version, mtype, json_len, blob_len)


def _server_fds(server) -> int:
    return len(os.listdir(f"/proc/{server.pid}/fd"))


def _server_threads(server) -> int:
    return len(os.listdir(f"/proc/{server.pid}/task"))


def _settle(server, fds: int, threads: int, timeout: float = 10.0) -> tuple[int, int]:
    """Wait for the server's fd and thread counts to come back down to (at most) a baseline."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        now = _server_fds(server), _server_threads(server)
        if now[0] <= fds and now[1] <= threads:
            return now
        time.sleep(0.05)
    return now


# -- the runtime directory -------------------------------------------------------------------


def test_runtime_dir_is_0700_and_socket_is_owner_only(server):
    st = os.lstat(server.runtime_dir)
    assert stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid()
    assert stat.S_IMODE(st.st_mode) == 0o700
    sock = os.lstat(server.socket_path)
    assert stat.S_ISSOCK(sock.st_mode) and sock.st_uid == os.getuid()
    assert stat.S_IMODE(sock.st_mode) & 0o077 == 0, oct(sock.st_mode)


def _start_server(runtime_dir: Path) -> subprocess.CompletedProcess:
    env = child_env(OVERMIND_RUNTIME_DIR=str(runtime_dir), OVERMIND_NO_AUTOSTART="1")
    return subprocess.run([sys.executable, "-m", "overmind.server", "--daemon"], env=env, capture_output=True,
                          text=True, timeout=60, cwd=REPO)


@pytest.mark.parametrize("mode", [0o755, 0o777, 0o1777], ids=["0755", "0777", "1777-like-tmp"])
def test_an_existing_runtime_dir_open_to_others_is_refused_and_left_as_it_was(runtime_dir, mode):
    shared = runtime_dir / "shared"
    shared.mkdir()
    os.chmod(shared, mode)
    with pytest.raises(ConfigError, match="open to other users"):
        ensure_private_dir(shared)
    proc = _start_server(shared)
    assert proc.returncode != 0 and "open to other users" in proc.stderr and "chmod 700" in proc.stderr, proc.stderr
    assert stat.S_IMODE(os.lstat(shared).st_mode) == mode  # never chmod-ed: /tmp stays usable for everyone
    assert os.listdir(shared) == []


def test_the_cli_creates_nothing_in_a_runtime_dir_it_would_refuse(runtime_dir):
    # A server refuses a runtime dir open to others; `overmind status` must not write there either
    # (it used to leave a server.instance.lock behind while looking for a server).
    shared = runtime_dir / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    env = child_env(OVERMIND_RUNTIME_DIR=str(shared), OVERMIND_NO_AUTOSTART="1")
    for command in (["status"], ["list"]):
        subprocess.run([sys.executable, "-m", "overmind.frontend.cli", *command], env=env, capture_output=True,
                       text=True, timeout=60, cwd=REPO)
    assert os.listdir(shared) == []


def test_a_new_runtime_dir_is_created_private(runtime_dir):
    fresh = runtime_dir / "a" / "b"
    ensure_private_dir(fresh)
    assert stat.S_IMODE(os.lstat(fresh).st_mode) == 0o700


def test_a_planted_pid_symlink_is_replaced_never_written_through(make_server, runtime_dir, tmp_path):
    precious = tmp_path / "precious"
    precious.write_text("root's file\n")
    (runtime_dir / "server.pid").symlink_to(precious)
    server = make_server()
    assert precious.read_text() == "root's file\n"
    pid_file = runtime_dir / "server.pid"
    assert stat.S_ISREG(os.lstat(pid_file).st_mode) and pid_file.read_text().strip() == str(server.pid)
    server.stop()
    assert precious.read_text() == "root's file\n"


def test_a_planted_fifo_as_pid_file_does_not_hang_the_server(make_server, runtime_dir):
    os.mkfifo(runtime_dir / "server.pid")
    server = make_server()  # returns once ready: a hang would time the test out
    assert (runtime_dir / "server.pid").read_text().strip() == str(server.pid)


@pytest.mark.parametrize("name", ["server.log", "server.instance.lock"])
def test_a_planted_symlink_or_fifo_for_the_log_or_lock_is_refused_with_a_clear_message(runtime_dir, tmp_path, name):
    precious = tmp_path / "precious"
    precious.write_text("keep\n")
    (runtime_dir / name).symlink_to(precious)
    proc = _start_server(runtime_dir)
    assert proc.returncode != 0 and name in proc.stderr and "symlink" in proc.stderr, proc.stderr
    assert precious.read_text() == "keep\n"
    (runtime_dir / name).unlink()
    os.mkfifo(runtime_dir / name)
    proc = _start_server(runtime_dir)  # O_NONBLOCK: a FIFO cannot hang the open
    assert proc.returncode != 0 and "not a regular file" in proc.stderr, proc.stderr


@needs_root
def test_runtime_dir_owned_by_another_user_is_refused(runtime_dir):
    theirs = runtime_dir / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, OTHER_UID, OTHER_UID)
    with pytest.raises(ConfigError, match=f"belongs to uid {OTHER_UID}"):
        ensure_private_dir(theirs)
    assert os.lstat(theirs).st_uid == OTHER_UID  # left alone, not taken over

    # The server refuses to start there, rather than listening in a directory someone else controls.
    env = child_env(OVERMIND_RUNTIME_DIR=str(theirs), OVERMIND_NO_AUTOSTART="1")
    proc = subprocess.run([sys.executable, "-m", "overmind.server", "--foreground"], env=env, capture_output=True,
                          text=True, timeout=60, cwd=REPO)
    assert proc.returncode != 0
    assert f"belongs to uid {OTHER_UID}" in proc.stderr
    assert not (theirs / "server.sock").exists()


def test_runtime_dir_that_is_a_symlink_is_refused(runtime_dir):
    real = runtime_dir / "real"
    real.mkdir(mode=0o700)
    link = runtime_dir / "link"
    link.symlink_to(real)
    with pytest.raises(ConfigError, match="not a directory"):
        ensure_private_dir(link)


# -- peers of another uid --------------------------------------------------------------------

OTHER_USER_CONNECT = """
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(10)
try:
    s.connect(sys.argv[1] if len(sys.argv) > 1 else {path!r})
except OSError as err:
    print("connect-failed", type(err).__name__)
    raise SystemExit(0)
data = b""
try:
    while True:
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
except OSError as err:
    print("recv-failed", type(err).__name__)
print("received", data.hex())
"""


@needs_root
def test_other_user_cannot_even_connect_through_the_private_dir(server):
    proc = run_python(OTHER_USER_CONNECT.format(path=str(server.socket_path)), user=str(OTHER_UID),
                      env=child_env(), timeout=60)
    assert proc.stdout.split() == ["connect-failed", "PermissionError"], proc.stdout + proc.stderr
    assert _assert_healthy(server)["refused_connections"] == 0  # it never reached the server


@needs_root
def test_server_refuses_a_peer_of_another_uid_by_its_credentials(server):
    # Open the file-system barrier on purpose, so only the SO_PEERCRED check stands in the way.
    os.chmod(server.runtime_dir, 0o711)
    os.chmod(server.socket_path, 0o666)
    proc = run_python(OTHER_USER_CONNECT.format(path=str(server.socket_path)), user=str(OTHER_UID),
                      env=child_env(), timeout=60)
    words = proc.stdout.split()
    assert words[0] == "received", proc.stdout + proc.stderr
    raw = bytes.fromhex(words[1]) if len(words) > 1 else b""
    if raw:  # the server says why, then closes; it never sends a Welcome
        a, b = socket.socketpair()
        a.sendall(raw)
        a.close()
        message, _, _ = P.recv_message(b)
        b.close()
        assert isinstance(message, P.Error) and message.code == P.ErrorCode.PERMISSION_DENIED
    assert "refused connection" in server.log()
    assert f"uid {OTHER_UID}" in server.log()
    os.chmod(server.runtime_dir, 0o700)
    assert _assert_healthy(server)["refused_connections"] == 1


# A "server" run by another user, in a runtime dir that user controls (a squatted
# /tmp/overmind-<uid>): it lies in its Welcome, claiming to run as the client's uid, and
# answers every load with a skeleton that runs code when unpickled.
FOREIGN_SERVER = """
import os, pickle, socket, sys
from overmind.shared import protocol as P
path, marker, claimed_uid = sys.argv[1], sys.argv[2], int(sys.argv[3])

class Payload:
    def __reduce__(self):
        return (os.mkdir, (marker,))

listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
listener.bind(path)
os.chmod(path, 0o777)
listener.listen(16)
print("ready", flush=True)
while True:
    conn, _ = listener.accept()
    try:
        while True:
            message, blob, fds = P.recv_message(conn)
            print("received", repr(message), flush=True)
            if isinstance(message, P.Hello):
                P.send_message(conn, P.Welcome(P.PROTOCOL_VERSION, os.getpid(), "0.1.0", claimed_uid))
            elif isinstance(message, P.Load):
                P.send_message(conn, P.Entry(message.key, os.getpid(), [], 0, True, {}), pickle.dumps(Payload()))
            else:
                P.send_message(conn, P.Ok())
    except Exception:
        conn.close()
"""

VICTIM_CLIENT = """
import json, warnings
caught = []
warnings.simplefilter("always")
warnings.showwarning = lambda message, category, *a, **k: caught.append(str(message))
import overmind.api
result = overmind.api.load(json.loads, '{"answer": 42}')
print(json.dumps({"result": result, "warnings": [w for w in caught if w.startswith("overmind:")]}))
"""


@needs_root
def test_client_refuses_a_server_run_by_another_user(runtime_dir):
    os.chmod(runtime_dir, 0o711)  # the other user may pass through to its own directory
    squatted = runtime_dir / "squatted"
    squatted.mkdir(mode=0o755)
    os.chown(squatted, OTHER_UID, OTHER_UID)
    marker = runtime_dir / "pwned"
    # The other user cannot enter a checkout only its owner may (a clone in a 0700 home, the venv in
    # it): it runs the base interpreter on a copy of overmind's standard-library protocol module.
    readable = Path(tempfile.mkdtemp(prefix="om-other-"))
    shutil.copytree(REPO / "src" / "overmind", readable / "overmind",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    for path in (readable, *readable.rglob("*")):
        os.chmod(path, 0o755 if path.is_dir() else 0o644)
    fake = subprocess.Popen(
        ["setpriv", f"--reuid={OTHER_UID}", f"--regid={OTHER_UID}", "--clear-groups", sys._base_executable, "-I",
         "-c", f"import sys; sys.path.insert(0, {str(readable)!r})\n{FOREIGN_SERVER}", str(squatted / "server.sock"),
         str(marker), str(os.getuid())],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(), cwd=readable)
    try:
        assert fake.stdout.readline().strip() == "ready", fake.stderr.read()
        env = child_env(OVERMIND_RUNTIME_DIR=str(squatted), OVERMIND_NO_AUTOSTART="1", OVERMIND_PRESTART="0",
                        HF_TOKEN="hf_secret_that_must_not_leak")
        out = json.loads(run_python(VICTIM_CLIENT, env=env, timeout=60).stdout.strip().splitlines()[-1])
    finally:
        fake.kill()
        received, errors = fake.communicate(timeout=10)
        shutil.rmtree(readable, ignore_errors=True)
    assert out["result"] == {"answer": 42}  # the plain call ran
    assert len(out["warnings"]) == 1 and f"uid {OTHER_UID}" in out["warnings"][0], out["warnings"]
    assert "Load" not in received and "hf_secret" not in received, received  # nothing was sent
    assert not marker.exists(), "the client unpickled a foreign server's skeleton"


# -- garbage on the real socket --------------------------------------------------------------


def test_garbage_bytes_close_only_that_connection(server):
    good = _handshake(server)  # an established client must not notice
    bad = _connect(server)
    bad.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + os.urandom(200))
    reply = _reply(bad)
    assert reply is None or (isinstance(reply, P.Error) and reply.code == P.ErrorCode.BAD_REQUEST)
    _assert_closed(bad)
    bad.close()
    P.send_message(good, P.Status())
    status, _, _ = P.recv_message(good)
    assert isinstance(status, P.StatusReply) and status.info["pid"] == server.pid
    good.close()
    _assert_healthy(server)
    assert "closing connection" in server.log()


def test_truncated_frame_closes_only_that_connection(server):
    bad = _connect(server)
    bad.sendall(P.encode_frame(P.Hello(P.PROTOCOL_VERSION, 1, "client"))[:30])  # header + part of the fields
    bad.shutdown(socket.SHUT_WR)
    _reply(bad)
    _assert_closed(bad)
    bad.close()

    after_hello = _handshake(server)  # and mid-frame after a handshake
    after_hello.sendall(_header(P.Load.TYPE, 500, 1000) + b'{"key":')
    after_hello.close()
    _assert_healthy(server)


def test_oversized_header_is_answered_and_closed_without_reading_on(server):
    bad = _connect(server)
    bad.sendall(_header(P.Hello.TYPE, 0xFFFFFFFF))  # 4 GiB of fields claimed, nothing sent
    reply = _reply(bad)
    assert isinstance(reply, P.Error) and reply.code == P.ErrorCode.BAD_REQUEST and "limit" in reply.message
    _assert_closed(bad)
    bad.close()

    bad = _handshake(server)
    bad.sendall(_header(P.Load.TYPE, 2, 1 << 40) + b"{}")  # 1 TiB blob claimed after a handshake
    reply = _reply(bad)
    assert isinstance(reply, P.Error) and reply.code == P.ErrorCode.BAD_REQUEST
    bad.close()
    _assert_healthy(server)


def test_huge_request_blob_is_refused_before_the_server_allocates_it(server):
    # Under the protocol's MAX_BLOB (sized for skeletons) but far over any pickled call: the
    # server must answer at once rather than allocate 1 GiB and wait for bytes that never come.
    rss_before = _rss_kib(server)
    sock = _handshake(server)
    fields = json.dumps({"key": "k", "target": "t", "description": "d", "context": {}}).encode()
    sock.sendall(_header(P.Load.TYPE, len(fields), 1 << 30) + fields)
    sock.settimeout(5)
    reply = _reply(sock)
    assert isinstance(reply, P.Error) and reply.code == P.ErrorCode.BAD_REQUEST, reply
    assert "limit" in reply.message
    sock.close()
    assert _rss_kib(server) - rss_before < 256 * 1024
    _assert_healthy(server)


def _rss_kib(server) -> int:
    for line in Path(f"/proc/{server.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_version_mismatch_is_answered_naming_both_versions(server):
    sock = _connect(server)
    other = P.PROTOCOL_VERSION + 1
    fields = json.dumps({"version": other, "pid": 1, "role": "client"}).encode()
    sock.sendall(_header(P.Hello.TYPE, len(fields), version=other) + fields)
    reply = _reply(sock)
    assert isinstance(reply, P.Error) and reply.code == P.ErrorCode.VERSION_MISMATCH, reply
    assert str(other) in reply.message and str(P.PROTOCOL_VERSION) in reply.message
    sock.close()
    _assert_healthy(server)


def test_requests_before_the_handshake_are_refused(server):
    sock = _connect(server)
    P.send_message(sock, P.Status())
    reply = _reply(sock)
    assert isinstance(reply, P.Error) and reply.code == P.ErrorCode.BAD_REQUEST and "Hello" in reply.message
    _assert_closed(sock)
    sock.close()
    _assert_healthy(server)


def test_loader_messages_from_a_client_are_refused(server):
    sock = _handshake(server)
    P.send_message(sock, P.JobStarted("k", 1))
    reply = _reply(sock)
    assert isinstance(reply, P.Error) and reply.code == P.ErrorCode.BAD_REQUEST
    sock.close()
    _assert_healthy(server)


def test_fds_sent_by_a_client_are_closed_by_the_server(server):
    sock = _handshake(server)
    fds_before = _server_fds(server)
    r, w = os.pipe()
    for _ in range(20):
        P.send_message(sock, P.Fds("k", [0, 0]), fds=[r, w])  # an unexpected message, with fds
        reply = _reply(sock)
        assert isinstance(reply, P.Error)
        sock.close()
        sock = _handshake(server)
        P.send_message(sock, P.Status(), fds=[r, w])  # an expected message, with unexpected fds
        assert isinstance(_reply(sock), P.StatusReply)
    os.close(r)
    os.close(w)
    fds_after, _ = _settle(server, fds_before, 10 ** 6)
    assert fds_after <= fds_before, f"server fds grew from {fds_before} to {fds_after}"
    sock.close()


def test_many_bad_connections_leave_no_fds_or_threads_behind(server):
    _assert_healthy(server)
    fds_before, threads_before = _settle(server, 10 ** 6, 10 ** 6)
    for i in range(40):
        sock = _connect(server)
        kind = i % 4
        if kind == 0:
            sock.sendall(os.urandom(100).replace(P.MAGIC, b"...."))
        elif kind == 1:
            sock.sendall(_header(P.Hello.TYPE, 1 << 30))
        elif kind == 2:
            sock.sendall(_header(P.Hello.TYPE, 10) + b"[1,")
            sock.shutdown(socket.SHUT_WR)
        else:
            sock.sendall(_header(999, 2) + b"{}")
        _reply(sock)
        sock.close()
    fds_after, threads_after = _settle(server, fds_before, threads_before)
    assert fds_after <= fds_before and threads_after <= threads_before, \
        (fds_before, fds_after, threads_before, threads_after)
    _assert_healthy(server)
