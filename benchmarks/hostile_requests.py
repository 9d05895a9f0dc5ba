"""Acceptance: server RSS after 10,000 malformed, stalled or failing requests from the same user
is at most 50 MiB above its idle size, and the server keeps serving correctly.

    .venv/bin/python benchmarks/hostile_requests.py [--requests 10000] [--failing 300] [--check-load]
    .venv/bin/python benchmarks/hostile_requests.py --quick      # 1,500 requests, 60 real failing loads

Starts a private ``overmind-server --foreground``, reads its idle VmRSS after a Status round trip,
then fires a shuffled mix from --concurrency threads: malformed frames (garbage, bad magic or
version, huge JSON length, wrong field types, bad JSON, unknown or server-only types, no Hello);
stalled connections (a Load announcing a 64 MiB blob then silence, silent, half a header, idle
after Hello; at most --max-held open, each ~--hold s); failing loads (wait=False) with unique
512 KiB or normal keys, refused before a loader runs, and --failing real loader jobs that fail.
Peak RSS is sampled throughout; final RSS once stalled connections are closed and loads settled.
Exit 1 if final - idle > --limit MiB (or peak - idle > --peak-limit, if given) or the server stops
serving (Status; with --check-load also a tiny-LM from_pretrained, miss then hit, in a child).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import pickle
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from overmind.shared import protocol as P

MiB = 1 << 20
REPO = Path(__file__).resolve().parent.parent
CONTEXT = {"python": sys.executable, "cwd": os.getcwd(), "sys_path": sys.path, "env": {}}
BAD_CONTEXT = dict(CONTEXT, cwd="/nonexistent/overmind-hostile")  # refused before any loader starts
MALFORMED = ["garbage", "bad_magic", "bad_version", "huge_json_len", "max_json_then_close", "wrong_types",
             "bad_json", "unknown_type", "server_only_type", "blob_on_status", "no_hello"]
STALLED = ["blob_64mib", "blob_partial", "silent", "half_header", "idle_after_hello"]
CHEAP = ["huge_key_bad_context", "small_key_bad_context"]
ANNOUNCED = mmap.mmap(-1, 64 * MiB)  # a "blob" for P.encode_frame's header: never touched, never sent
CHECK_LOAD = """import sys, overmind.api
overmind.api.monkey_patch_all()
import transformers
for _ in range(2):
    model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1])
"""


def proc_status(pid: int) -> dict:
    with open(f"/proc/{pid}/status") as f:
        fields = dict(line.split(":", 1) for line in f if line.startswith(("VmRSS:", "Threads:")))
    return {"rss_mib": int(fields["VmRSS"].split()[0]) / 1024, "threads": int(fields["Threads"]),
            "fds": len(os.listdir(f"/proc/{pid}/fd"))}


def hello() -> P.Hello:
    return P.Hello(version=P.PROTOCOL_VERSION, pid=os.getpid(), role="client")


class Server:
    def __init__(self) -> None:
        self.runtime = Path(tempfile.mkdtemp(prefix="omh-", dir="/tmp"))
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("OVERMIND_")}
        self.env.update(OVERMIND_RUNTIME_DIR=str(self.runtime), OVERMIND_NO_AUTOSTART="1", HF_HUB_OFFLINE="1")
        # stderr to /dev/null: thousands of warnings would fill a pipe and block the server (server.log has them)
        self.proc = subprocess.Popen([sys.executable, "-m", "overmind.server", "--foreground"], env=self.env,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=REPO)
        self.pid, self.path = self.proc.pid, str(self.runtime / "server.sock")
        line = self.proc.stdout.readline()
        if "ready" not in line:
            self.stop()
            raise RuntimeError(f"server did not start: {line!r}")

    def connect(self, timeout: float = 10.0) -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(timeout)
        s.connect(self.path)  # on failure, s is closed as it is dropped
        return s

    def handshake(self, timeout: float = 10.0) -> socket.socket:
        s = self.connect(timeout)
        P.send_message(s, hello())
        P.expect(P.recv_message(s, max_blob=0)[0], P.Welcome, "in the handshake")
        return s

    def status(self, timeout: float = 10.0) -> dict:
        with self.handshake(timeout) as s:
            P.send_message(s, P.Status())
            return P.expect(P.recv_message(s)[0], P.StatusReply).info

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.runtime, ignore_errors=True)


class Watcher:
    """Samples the server's peak RSS, threads and fds, and keeps stalled connections open (at most
    ``limit``), each closed ~``hold`` s after it was opened."""

    def __init__(self, pid: int, limit: int, hold: float) -> None:
        self.pid, self.slots, self.hold, self.lock = pid, threading.Semaphore(limit), hold, threading.Lock()
        self.held, self.done, self.peak = [], threading.Event(), {"rss_mib": 0.0, "threads": 0, "fds": 0}
        self.server_closed: Counter = Counter()  # the server hung up before we let go
        threading.Thread(target=self._loop, daemon=True).start()

    def add(self, sock: socket.socket, variant: str) -> None:
        with self.lock:
            self.held.append((time.monotonic() + self.hold * random.uniform(0.5, 1.5), sock, variant))

    def _close(self, sock: socket.socket, variant: str) -> None:
        try:
            sock.setblocking(False)
            sock.recv(65536)  # b"" or an Error: the server already gave up on it
            self.server_closed[variant] += 1
        except BlockingIOError:
            pass
        except OSError:
            self.server_closed[variant] += 1
        sock.close()
        self.slots.release()

    def _loop(self) -> None:
        while not self.done.is_set():
            now = time.monotonic()
            with self.lock:
                due, self.held = [h for h in self.held if h[0] <= now], [h for h in self.held if h[0] > now]
            for _, sock, variant in due:
                self._close(sock, variant)
            try:
                self.peak = {k: max(v, proc_status(self.pid)[k]) for k, v in self.peak.items()}
            except (OSError, KeyError):  # the server is gone
                pass
            time.sleep(0.05)

    def release_all(self) -> None:
        with self.lock:
            held, self.held = self.held, []
        for _, sock, variant in held:
            self._close(sock, variant)


def reply(sock: socket.socket, timeout: float = 10.0) -> str:
    """What the server answered: a message type, ``Error:CODE``, ``eof``, ``reset``, ``timeout``."""
    try:
        sock.settimeout(timeout)
        message, _, fds = P.recv_message(sock)
        for fd in fds:
            os.close(fd)
        return f"Error:{P.ErrorCode.name(message.code)}" if isinstance(message, P.Error) else type(message).__name__
    except EOFError:
        return "eof"
    except socket.timeout:
        return "timeout"
    except (ConnectionResetError, BrokenPipeError):
        return "reset"
    except P.ProtocolError:
        return "garbled"


def raw_frame(mtype: int, fields: bytes, blob_len: int = 0, magic: bytes = P.MAGIC, version: int = -1) -> bytes:
    version = P.PROTOCOL_VERSION if version < 0 else version
    return P.HEADER.pack(magic, version, mtype, len(fields), blob_len) + fields


def load_msg(key: str, context: dict) -> P.Load:
    return P.Load(key=key, target="overmind_hostile_missing:load", description="hostile", context=context, wait=False)


class Attack:
    def __init__(self, server: Server, watcher: Watcher) -> None:
        self.server, self.watcher, self.outcomes = server, watcher, defaultdict(Counter)
        self.local, self.sessions, self.lock = threading.local(), [], threading.Lock()

    def run(self, job: tuple) -> None:
        kind, variant, i = job
        try:
            outcome = getattr(self, kind)(variant, i)
        except socket.timeout:
            outcome = "timeout"
        except (ConnectionResetError, BrokenPipeError):
            outcome = "reset"
        except (OSError, EOFError, P.ProtocolError, P.RemoteError) as err:
            outcome = type(err).__name__
        with self.lock:
            self.outcomes[variant][outcome] += 1

    def malformed(self, variant: str, i: int) -> str:
        frames = {  # before the handshake
            "garbage": lambda: os.urandom(random.randint(1, 4096)),
            "bad_magic": lambda: raw_frame(P.Hello.TYPE, b"{}", magic=b"EVIL"),
            "bad_version": lambda: raw_frame(P.Hello.TYPE, b"{}", version=999),
            "huge_json_len": lambda: P.HEADER.pack(P.MAGIC, P.PROTOCOL_VERSION, P.Hello.TYPE, 0xFFFFFFFF, 0),
            "max_json_then_close": lambda: P.HEADER.pack(P.MAGIC, P.PROTOCOL_VERSION, P.Hello.TYPE, P.MAX_JSON, 0),
            "no_hello": lambda: P.encode_frame(P.Status()) if i % 2 else P.encode_frame(hello())[:30] + b"}" * 99,
        }
        after_hello = {
            "wrong_types": lambda: raw_frame(P.Load.TYPE, json.dumps(
                {"key": i, "target": [], "description": None, "context": "x", "wait": "no"}).encode()),
            "bad_json": lambda: raw_frame(P.Load.TYPE, random.choice([b"{not json", b"[" * 200000, b'"str"'])),
            "unknown_type": lambda: raw_frame(60000 + i % 1000, b"{}"),
            "server_only_type": lambda: P.encode_frame(P.StatusReply(info={"i": i})),
            "blob_on_status": lambda: raw_frame(P.Status.TYPE, b"{}", blob_len=16) + b"x" * 16,
        }
        with (self.server.handshake() if variant in after_hello else self.server.connect()) as s:
            s.sendall((after_hello.get(variant) or frames[variant])())
            if variant == "max_json_then_close":
                return "closed"
            s.shutdown(socket.SHUT_WR)
            return reply(s)

    def stalled(self, variant: str, i: int) -> str:
        self.watcher.slots.acquire()
        try:
            s = self.server.handshake() if variant in ("blob_64mib", "blob_partial", "idle_after_hello") \
                else self.server.connect()
            if variant.startswith("blob"):  # on failure, s is closed as it is dropped
                s.sendall(P.encode_frame(load_msg("%032x" % random.getrandbits(128), CONTEXT), ANNOUNCED))
                if variant == "blob_partial":
                    s.sendall(b"\0" * MiB)
            elif variant == "half_header":
                s.sendall(P.encode_frame(hello())[:P.HEADER.size // 2])
            self.watcher.add(s, variant)
            return "held"
        except BaseException:
            self.watcher.slots.release()
            raise

    def _failing_load(self, message: P.Load, blob: bytes) -> str:
        """On this thread's handshaken connection (reopened when the server drops it)."""
        s = getattr(self.local, "sock", None)
        if s is None:
            s = self.local.sock = self.server.handshake(timeout=60)
            with self.lock:
                self.sessions.append(s)
        try:
            P.send_message(s, message, blob)
            outcome = reply(s, timeout=60)
        except OSError:
            outcome = "reset"
        if outcome in ("eof", "reset", "timeout", "garbled"):
            s.close()
            self.local.sock = None
        return outcome

    def failing(self, variant: str, i: int) -> str:
        huge = variant.startswith("huge") or (variant == "real_loader" and i % 2 == 0)
        key = ("%032x" % random.getrandbits(128)) * (16384 if huge else 1)  # a real key's form, or 512 KiB of it
        if variant != "real_loader":
            return self._failing_load(load_msg(key, BAD_CONTEXT), pickle.dumps(None))
        # a real loader job: the warm interpreter forks a child whose unpickle or import fails
        call = ((("module", f"overmind_hostile_missing_{i}", "load"), (), {}))
        return self._failing_load(load_msg(key, CONTEXT), pickle.dumps(call) if i % 4 < 2 else os.urandom(256))

    def close(self) -> None:
        for s in self.sessions:
            s.close()


def check_load(server: Server) -> dict:
    """A real tiny-LM load through monkey_patch_all, miss then hit, in a child process."""
    before = server.status()
    with tempfile.TemporaryDirectory(prefix="omh-model-") as tmp:
        gen = subprocess.run([sys.executable, "-c", "import sys; from overmind.modelgen import save_lm, age_files; "
                              "save_lm(sys.argv[1], size='tiny', seed=1); age_files(sys.argv[1])", tmp],
                             capture_output=True, text=True, timeout=300, cwd=REPO, env=server.env)
        env = dict(server.env, OVERMIND_COLD="wait", OVERMIND_STRICT="1")
        proc = gen if gen.returncode else subprocess.run([sys.executable, "-c", CHECK_LOAD, tmp], capture_output=True,
                                                         text=True, timeout=300, cwd=REPO, env=env)
    after = server.status()
    ok = proc.returncode == 0 and after["hits"] > before["hits"] and after["entries"] > before["entries"]
    return {"ok": ok, "hits": after["hits"] - before["hits"], "misses": after["misses"] - before["misses"],
            **({} if ok else {"error": (proc.stdout + proc.stderr)[-3000:]})}


def attack(server: Server, jobs: list, args: argparse.Namespace) -> dict:
    server.status()
    time.sleep(0.5)
    idle = proc_status(server.pid)
    watcher = Watcher(server.pid, args.max_held, args.hold)
    hostile, started = Attack(server, watcher), time.monotonic()
    with ThreadPoolExecutor(args.concurrency) as pool:
        list(pool.map(hostile.run, jobs))
    sent_s = time.monotonic() - started
    held = proc_status(server.pid)["rss_mib"] if server.alive() else None
    watcher.release_all()
    hostile.close()
    status, serves, deadline = {}, False, time.monotonic() + 300
    try:
        while server.alive() and time.monotonic() < deadline:  # real failing loads finish behind their Pending
            status = server.status(timeout=30)
            if status["loading"] == 0:
                break
            time.sleep(0.5)
        time.sleep(args.settle)
        final = proc_status(server.pid) if server.alive() else None
        status = server.status()
        serves = status.get("pid") == server.pid
    except (OSError, EOFError, P.ProtocolError, P.RemoteError) as err:
        status, final = {"error": repr(err)}, proc_status(server.pid) if server.alive() else None
    watcher.done.set()
    load = check_load(server) if args.check_load and serves else None
    log = server.runtime / "server.log"
    text = log.read_text(errors="replace") if log.exists() else ""
    mib = lambda v: None if v is None else round(v, 1)  # noqa: E731
    return {
        "idle_rss_mib": mib(idle["rss_mib"]), "peak_rss_mib": mib(watcher.peak["rss_mib"]), "held_rss_mib": mib(held),
        "final_rss_mib": mib(final and final["rss_mib"]),
        "growth_mib": mib(final and final["rss_mib"] - idle["rss_mib"]),
        "peak_growth_mib": mib(watcher.peak["rss_mib"] - idle["rss_mib"]), "limit_mib": args.limit,
        "requests": dict(Counter(kind for kind, _, _ in jobs)), "total_requests": len(jobs),
        "outcomes": {v: dict(c) for v, c in sorted(hostile.outcomes.items())},
        "stalled_closed_by_server": dict(watcher.server_closed),
        "threads": {"idle": idle["threads"], "peak": watcher.peak["threads"], "final": final and final["threads"]},
        "fds": {"idle": idle["fds"], "peak": watcher.peak["fds"], "final": final and final["fds"]},
        "server_status": {k: status.get(k) for k in ("entries", "misses", "hits", "loading", "error")},
        "log": {"bytes": len(text), "loader_runs": text.count(": loading "), "failed": text.count(" failed: ")},
        "send_seconds": round(sent_s, 1), "server_alive": server.alive(),
        "serves_correctly": serves and (load is None or load["ok"]), "load_check": load,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=10000, help="hostile requests in all")
    ap.add_argument("--failing", type=int, default=300, help="of which real loads that fail in a loader")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-held", type=int, default=64, help="stalled connections open at once")
    ap.add_argument("--hold", type=float, default=2.0, help="mean seconds a stalled connection is held")
    ap.add_argument("--settle", type=float, default=3.0)
    ap.add_argument("--limit", type=float, default=50.0, help="MiB final RSS may exceed idle RSS")
    ap.add_argument("--peak-limit", type=float, default=0.0, help="MiB peak RSS may exceed idle (0: report only)")
    ap.add_argument("--check-load", action="store_true", help="also check a real tiny-LM load afterwards")
    ap.add_argument("--quick", action="store_true", help="1,500 requests, 60 real failing loads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="also write the summary here")
    args = ap.parse_args()
    if args.quick:
        args.requests, args.failing = min(args.requests, 1500), min(args.failing, 60)
    random.seed(args.seed)
    real = min(args.failing, args.requests // 5)
    rest = args.requests - real
    n_malformed, n_stalled = rest * 45 // 100, rest // 10
    jobs = [("failing", "real_loader", i) for i in range(real)]
    jobs += [("malformed", MALFORMED[i % len(MALFORMED)], i) for i in range(n_malformed)]
    jobs += [("stalled", STALLED[i % len(STALLED)], i) for i in range(n_stalled)]
    jobs += [("failing", CHEAP[i % len(CHEAP)], i) for i in range(rest - n_malformed - n_stalled)]
    random.shuffle(jobs)

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the finally below stops the server
    server = Server()
    try:
        summary = attack(server, jobs, args)
    finally:
        server.stop()
    print(json.dumps(summary, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    growth = summary["growth_mib"]
    ok = (summary["server_alive"] and summary["serves_correctly"] and growth is not None and growth <= args.limit
          and (args.peak_limit <= 0 or summary["peak_growth_mib"] <= args.peak_limit))
    print(f"{'PASS' if ok else 'FAIL'}: {len(jobs)} hostile requests; server RSS idle {summary['idle_rss_mib']} MiB, "
          f"peak {summary['peak_rss_mib']}, final {summary['final_rss_mib']} (growth {growth} MiB, limit "
          f"{args.limit}); threads peak {summary['threads']['peak']}; serving correctly: {summary['serves_correctly']}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
