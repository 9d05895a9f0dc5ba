"""The ``overmind`` command: inspect and control a running overmind-server.

    overmind status [--json]        the server (budget, used, hits, misses, evictions, ...), its entries, and
                                    whether segments get huge pages (read here: overmind.shared.segments.hugepages)
    overmind status --wait-ready [--timeout S]
                                    wait until the server's restore after a restart is done
                                    (Note [Restore after a restart] in overmind.server.restore)
    overmind preload FILE           fill the cache from a list of calls or a script (overmind.frontend.preload)
    overmind list [--json]          one line per cached entry
    overmind evict KEY | --all      drop an entry (KEY may be a unique prefix) or all of them
    overmind shutdown               stop the server and wait until it has stopped
    overmind run SCRIPT [ARGS...]   run like python, forked from a warm interpreter (overmind.frontend.run)
    overmind --runtime-dir DIR ...  talk to the server in DIR (default: OVERMIND_RUNTIME_DIR,
                                    $XDG_RUNTIME_DIR/overmind, /tmp/overmind-<uid>)

``overmind-list`` and ``overmind-shutdown`` are ``overmind list`` and ``overmind shutdown``;
``python -m overmind`` works too. ``run`` is overmind.frontend.run's (``overmind``'s console
script), which hands every other command to this module; ``python -m overmind.frontend.cli``
takes those others. Only ``run`` starts a server.

Exit status: 0 done; 1 the server refused or nothing matched; 2 bad usage or settings;
3 no server is running (``shutdown`` exits 0 then: there is nothing to stop). ``status``
without a server still prints the huge-page report (machine-wide, read without the server).
``status --wait-ready`` exits 0 once the restore is done, 4 on its timeout, 3 if no server
came up within it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import time
from typing import Callable, Optional

from overmind.shared.settings import config as settings
from overmind.shared.segments import hugepages
from overmind.shared import protocol as P
from overmind.shared.protocol.connect import Connection, ServerUnavailable, server_holding
from overmind.shared.settings.config import Config, ConfigError, read_runtime_file
from overmind.frontend.closed_stdout import leave_for_closed_stdout, stdout_closed

__all__ = ["main", "list_main", "shutdown_main", "human_bytes", "human_duration"]

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_NO_SERVER, EXIT_NOT_READY = 0, 1, 2, 3, 4
SHUTDOWN_WAIT = 15.0
LIST_TIMEOUT = 30.0  # thousands of entries take a while to describe
RECOVERY_WAIT = 2.0


def human_bytes(n: float) -> str:
    """``1700000000`` -> ``"1.7 GB"`` (decimal units, as disk and model sizes are quoted)."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def human_duration(seconds: float) -> str:
    """``192`` -> ``"3m12s"``; two units at most (``2h05m``, ``1d04h``)."""
    s = max(0, int(seconds))
    days, s = divmod(s, 86400)
    hours, s = divmod(s, 3600)
    minutes, s = divmod(s, 60)
    if days:
        return f"{days}d{hours:02d}h"
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m{s:02d}s"
    return f"{s}s"


def _table(rows: list[tuple[str, str]]) -> str:
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def _format_value(name: str, value: object) -> str:
    if name in ("bytes", "used", "budget") and isinstance(value, (int, float)):
        return f"{human_bytes(value)} ({value} bytes)"
    if name == "uptime" and isinstance(value, (int, float)):
        return human_duration(value)
    if name == "interpreters" and isinstance(value, list):
        ready = sum(1 for z in value if isinstance(z, dict) and z.get("ready"))
        return f"{len(value)} warm interpreters ({ready} ready)"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True)
    return str(value)


# -- commands: each gets an open connection and returns an exit status -----------------------


# A cache this large with no huge page anywhere was filled while they were off (small
# segments may fit none, so below it nothing is said).
STALE_FILL_HINT_BYTES = 64 << 20


def _huge_page_lines(hp: hugepages.HugePageStatus, cached_bytes: int = 0) -> list[str]:
    """The huge-page report: the setting and the bytes; when off, why, what it costs, the fix."""
    where = f"shmem_enabled {hp.setting}" + (f", {hp.page_size >> 10} kB size {hp.size_setting}"
                                             if hp.size_setting not in (None, "inherit") else "")
    in_huge = f"{human_bytes(hp.shmem_huge_bytes)} of shared memory in huge pages (machine-wide)"
    if hp.enabled:
        lines = [f"huge pages  on ({where}): {in_huge}"]
        if hp.shmem_huge_bytes == 0 and cached_bytes >= STALE_FILL_HINT_BYTES:
            lines.append(f"  note:     the cache holds {human_bytes(cached_bytes)}, none of it in huge pages: segments "
                         "filled while they were off may keep 4 KiB pages; `overmind evict --all` lets the next "
                         "loads fill them again")
        return lines
    return [f"huge pages  off ({where}): segments use 4 KiB pages; {in_huge}",
            f"  why:      {hp.why_not}",
            f"  cost:     {hp.cost}",
            f"  turn on:  {hp.command}   (as root; until reboot; README 'Huge pages' says how to keep it)"]


def restore_line(info: dict) -> str:
    """The restore's progress in words (``info``: the server's status)."""
    restore = info.get("restore")
    if not isinstance(restore, dict):
        return "nothing to restore"
    state = restore.get("state")
    if state == "none":
        return "nothing to restore"
    if state == "off":
        return "off (OVERMIND_RESTORE=0)"
    done, pending = restore.get("entries_done", 0), restore.get("entries_pending", 0)
    line = (f"{state} in {restore.get('seconds', 0):.1f}s: {done} entries ({human_bytes(restore.get('bytes_done', 0))}) "
            f"refilled, {pending} ({human_bytes(restore.get('bytes_pending', 0))}) pending")
    extra = [f"{restore[k]} {k[8:]}" for k in ("entries_skipped", "entries_failed") if restore.get(k)]
    if restore.get("interpreters_pending"):
        extra.append(f"{restore['interpreters_pending']} warm interpreters starting")
    return line + (f" ({', '.join(extra)})" if extra else "")


def memory_rows(memory: dict) -> list[tuple[str, str]]:
    """The memory the server may use and how it gave way (Note [The cache gives way] in
    overmind.server.pressure), in words."""
    rows = [("memory", f"{human_bytes(memory.get('available', 0))} available of {human_bytes(memory.get('limit', 0))} "
             f"({memory.get('limit_from', '?')}); headroom {human_bytes(memory.get('headroom', 0))}"
             + ("; SHORT now: letting go" if memory.get("pressed") else ""))]
    event = memory.get("last_event")
    if isinstance(event, dict):
        let_go = event.get("let_go") or {}
        when = time.strftime("%H:%M:%S", time.localtime(event.get("started", 0)))
        took = f" in {event['seconds']:.2f}s" if isinstance(event.get("seconds"), (int, float)) else ""
        rows.append(("last pressure", f"{when} ({event.get('why', '')}), event {memory.get('events', 0)}: let go{took} "
                     f"{let_go.get('unsettled', 0)} file segments ({human_bytes(let_go.get('unsettled_bytes', 0))}) "
                     f"to their files, {let_go.get('interpreters', 0)} warm interpreters, {let_go.get('entries', 0)} "
                     f"entries ({human_bytes(let_go.get('entry_bytes', 0))})"))
    comeback = memory.get("comeback")
    if isinstance(comeback, dict) and (comeback.get("pending") or comeback.get("done")):
        rows.append(("coming back", f"{comeback.get('state', '')}: {comeback.get('done', 0)} back, "
                     f"{comeback.get('pending', 0)} pending"))
    return rows


def cmd_status(conn: Connection, args: argparse.Namespace) -> int:
    if args.wait_ready:
        return _wait_ready(conn, args)
    info = conn.simple(P.Status(), P.StatusReply).info
    # The huge-page facts are the kernel's, machine-wide: read here, so the server stays
    # free of them (and a status without a server still has them, see main()).
    hp = hugepages.read_status()
    if args.json:
        print(json.dumps({**info, "huge_pages": hp.as_dict()}, sort_keys=True))
        return EXIT_OK
    first = ["pid", "version", "uptime", "entries", "used", "budget", "hits", "misses", "plain_loads", "not_cacheable",
             "stale_misses", "evictions", "loading", "loaders_exiting"]
    special = ("bytes", "restore", "state", "ready", "file_segments", "packing", "memory")
    names = [n for n in first if n in info] + sorted(n for n in info if n not in first and n not in special)
    rows = [(name, _format_value(name, info[name])) for name in names]
    if "restore" in info:
        rows.append(("restore", restore_line(info)))
    if isinstance(info.get("memory"), dict):
        rows.extend(memory_rows(info["memory"]))
    files = info.get("file_segments")
    if isinstance(files, dict):  # Note [Settling file segments] in overmind.server.settle
        copying = files.get("copying")
        rows.append(("file segments", f"{human_bytes(files.get('bytes', 0))} served from model files; "
                     f"{files.get('settled', 0)} settled into sealed memory ({human_bytes(files.get('settled_bytes', 0))})"
                     + (f"; copying {human_bytes(copying[0])} of {human_bytes(copying[1])}" if copying else "")))
    for fill in info.get("packing") or []:  # Note [Joining a fill] in overmind.server.joins
        rows.append(("filling", f"{fill.get('key', '')}: {human_bytes(fill.get('written', 0))} of "
                     f"{human_bytes(fill.get('expected', 0))} in place after {fill.get('seconds', 0):.1f}s"))
    state = info.get("state")
    if isinstance(state, dict):
        rows.append(("state", state.get("path", "") if state.get("kept") else f"not kept: {state.get('problem', '')}"))
        if state.get("kept") and state.get("problem"):
            rows.append(("", state["problem"]))
    print(_table(rows))
    print()
    used = info.get("used")
    print("\n".join(_huge_page_lines(hp, used if isinstance(used, int) else 0)))
    if info.get("interpreters"):
        print()
        _print_interpreters(info["interpreters"])
    entries = _entries(conn)
    if entries:
        print()
        _print_entries(entries)
    return EXIT_OK


WAIT_POLL = 0.2


def _wait_ready(conn: Optional[Connection], args: argparse.Namespace, config: Optional[Config] = None) -> int:
    """``status --wait-ready``: poll until the restore is done or ``--timeout`` passes; a server
    that is not up yet (a deploy script that just started it) is waited for too."""
    deadline = time.monotonic() + args.timeout if args.timeout is not None else None
    last = ""
    while True:
        try:
            if conn is None:
                assert config is not None
                conn = Connection.open(config, role="cli", autostart=False)
            info = conn.simple(P.Status(), P.StatusReply).info
        except (ServerUnavailable, P.ProtocolError, EOFError, OSError) as err:
            if conn is not None:
                conn.close()
                conn = None
            info, last = None, f"no server answers ({err})"
        if info is not None:
            last = restore_line(info)
            if info.get("ready", True):  # a server from before the restore is always ready
                print(f"overmind-server pid {info.get('pid')} ready: {last}")
                return EXIT_OK
        if deadline is not None and time.monotonic() >= deadline:
            print(f"overmind: not ready after {args.timeout:g}s: {last}; `overmind status` shows the restore, "
                  "the server's log says what it waits for", file=sys.stderr)
            return EXIT_NO_SERVER if info is None else EXIT_NOT_READY
        if config is None and conn is not None:
            config = conn.config
        time.sleep(WAIT_POLL)


def _entries(conn: Connection) -> list[dict]:
    reply, blob, fds = conn.request(P.ListEntries(), timeout=LIST_TIMEOUT)
    for fd in fds:
        os.close(fd)
    P.expect(reply, P.EntryList, "for the entry list")
    entries = json.loads(blob) if blob else []
    if not isinstance(entries, list) or len(entries) != reply.count:
        raise P.ProtocolError(f"entry list of {reply.count} entries arrived garbled")
    return entries


def _print_interpreters(interpreters: list) -> None:
    """One line per warm interpreter: what it serves and what it costs."""
    rows = [("WARM PID", "CONTEXT", "MODULES", "PSS", "AGE", "IDLE", "RUNS", "LOADS", "PYTHON")]
    for z in interpreters:
        if not isinstance(z, dict):
            continue
        state = "" if z.get("ready") else " (starting)"
        rows.append((f"{z.get('pid')}{state}", str(z.get("context", "")), str(z.get("modules", 0)),
                     human_bytes(z.get("pss", 0)), human_duration(z.get("age", 0)), human_duration(z.get("idle", 0)),
                     str(z.get("runs", 0)), str(z.get("jobs", 0)), str(z.get("python", ""))))
    widths = [max(len(row[i]) for row in rows) for i in range(8)]
    for row in rows:
        print("  ".join(f"{row[i]:<{widths[i]}}" if i < 2 else f"{row[i]:>{widths[i]}}" for i in range(8))
              + f"  {row[8]}")


def cmd_list(conn: Connection, args: argparse.Namespace) -> int:
    entries = _entries(conn)
    if args.json:
        print(json.dumps(entries, sort_keys=True))
    elif not entries:
        print("no cached entries")
    else:
        _print_entries(entries)
    return EXIT_OK


def _print_entries(entries: list[dict]) -> None:
    """One line per entry, most recently used first: bytes it owns, bytes it shares with others."""
    now = time.time()
    rows = [("KEY", "OWNED", "SHARED", "HITS", "LAST USE", "DESCRIPTION")]
    for e in sorted(entries, key=lambda e: -float(e.get("last_used", 0))):
        rows.append((str(e.get("key", ""))[:16], human_bytes(e.get("bytes_owned", e.get("bytes", 0))),
                     human_bytes(e.get("bytes_shared", 0)), str(e.get("hits", 0)),
                     human_duration(now - float(e.get("last_used", now))) + " ago", str(e.get("description", ""))))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    for row in rows:
        print(f"{row[0]:<{widths[0]}}  " + "  ".join(f"{row[i]:>{widths[i]}}" for i in range(1, 5)) + f"  {row[5]}")


def cmd_evict(conn: Connection, args: argparse.Namespace) -> int:
    # The listing only gives the evicted keys a description; eviction itself is one request.
    described = {e.get("key"): e.get("description", "") for e in _entries(conn)}
    evicted = conn.simple(P.Evict(key=args.key or "", all=args.all), P.Evicted).keys
    if not evicted and not args.all:
        print(f"overmind: no cached entry matches {args.key!r} (see `overmind list`)", file=sys.stderr)
        return EXIT_FAILED
    for key in evicted:
        print(f"evicted {key[:16]}  {described.get(key, '')}".rstrip())
    print(f"{len(evicted)} {'entry' if len(evicted) == 1 else 'entries'} evicted")
    return EXIT_OK


def _accepting(path: str) -> bool:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(1.0)
    try:
        sock.connect(path)
        return True
    except OSError:
        return False
    finally:
        sock.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie has exited; only its parent's wait is left (a supervisor may take its time). But
    # its first thread is a zombie as soon as it has exited itself: the process, its files and
    # the instance lock with them, are gone only with the last of its threads.
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return False  # reaped meanwhile
    except OSError:
        return True
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                if f.read().rpartition(b")")[2].split()[0] != b"Z":
                    return True
        except FileNotFoundError:
            continue  # that thread is gone
        except (OSError, IndexError):
            return True
    return False


def cmd_shutdown(conn: Connection, args: argparse.Namespace) -> int:
    pid, path = conn.server_pid, conn.config.socket_path
    conn.simple(P.Shutdown(), P.Ok)
    conn.close()  # an open connection must not keep the server's handler busy
    deadline = time.monotonic() + SHUTDOWN_WAIT
    # The listener closes first; the socket file goes once loaders and entries are released; the
    # instance lock (Note [One server per runtime directory]) only when the process is gone, so
    # wait for that: a server started right after this returns must not find it still held.
    while time.monotonic() < deadline and (_accepting(str(path)) or _alive(pid)):
        time.sleep(0.05)
    if _accepting(str(path)):
        print(f"overmind: server pid {pid} still accepts connections after {SHUTDOWN_WAIT:.0f}s", file=sys.stderr)
        return EXIT_FAILED
    if _alive(pid):
        print(f"overmind: server pid {pid} stopped serving but has not exited after {SHUTDOWN_WAIT:.0f}s",
              file=sys.stderr)
        return EXIT_FAILED
    print(f"overmind-server pid {pid} stopped" + (" (socket file still present)" if path.exists() else ""))
    return EXIT_OK


def _open(config: Config) -> Connection:
    """Connect; a server that holds the runtime dir but lost its socket binds a new one within
    a second (Note [A lost socket is replaced] in overmind.server.daemon), so give it that second."""
    deadline = time.monotonic() + RECOVERY_WAIT
    while True:
        try:
            return Connection.open(config, role="cli", autostart=False)
        except ServerUnavailable:
            if time.monotonic() > deadline or not server_holding(config):
                raise
            time.sleep(0.1)


def _server_pid(config: Config) -> Optional[int]:
    """The pid in ``server.pid`` if it is a live overmind-server of ours, else None."""
    text = read_runtime_file(config.pid_path).strip()
    if not text.isdigit():
        return None
    pid = int(text)
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read().split(b"\0")
        if os.stat(f"/proc/{pid}").st_uid != os.getuid():
            return None
    except OSError:
        return None
    return pid if any(b"overmind.server" in part or part.endswith(b"overmind-server") for part in cmdline) else None


def _unreachable_server(config: Config, args: argparse.Namespace, why: str = "") -> int:
    """A server holds the runtime dir but does not answer on its socket (stopped, hung, or its
    socket file gone for good), or speaks another protocol version (the overmind it was started
    from was upgraded since): name it, and let ``shutdown`` stop it by its pid."""
    why = why or f"it was not answering on {config.socket_path}"
    pid = _server_pid(config)
    who = f"overmind-server pid {pid}" if pid else "an overmind-server"
    if args.command != "shutdown":
        print(f"overmind: {who} holds {config.runtime_dir} but does not answer on {config.socket_path}; "
              "`overmind shutdown` stops it", file=sys.stderr)
        return EXIT_FAILED
    if pid is None:
        print(f"overmind: {who} holds {config.runtime_dir} but its pid is unknown ({config.pid_path}); "
              "stop it by hand", file=sys.stderr)
        return EXIT_FAILED
    for sig in (signal.SIGCONT, signal.SIGTERM):
        os.kill(pid, sig)
    deadline = time.monotonic() + SHUTDOWN_WAIT
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.05)
    if _alive(pid):
        os.kill(pid, signal.SIGKILL)  # the second signal the server would also take as "now"
        print(f"overmind-server pid {pid} did not stop in {SHUTDOWN_WAIT:.0f}s; killed", file=sys.stderr)
    print(f"overmind-server pid {pid} stopped ({why})")
    return EXIT_OK


def _not_connected(config: Config, args: argparse.Namespace, err: Exception) -> int:
    """Say why there is no connection; the exit status."""
    mismatch = isinstance(err, P.VersionMismatch) or \
        (isinstance(err, P.RemoteError) and err.code == P.ErrorCode.VERSION_MISMATCH)
    if mismatch and args.command == "shutdown" and server_holding(config):
        return _unreachable_server(config, args, f"it speaks another protocol version: {err}")
    if not isinstance(err, ServerUnavailable):
        print(f"overmind: cannot talk to the server at {config.socket_path}: {err}", file=sys.stderr)
        return EXIT_FAILED
    if server_holding(config):
        return _unreachable_server(config, args)
    if args.command == "shutdown" and not _accepting(str(config.socket_path)):
        print(f"overmind: no server running at {config.socket_path}; nothing to stop", file=sys.stderr)
        return EXIT_OK
    if str(err).startswith("no overmind-server"):
        print(f"overmind: no server running at {config.socket_path}", file=sys.stderr)
    else:
        print(f"overmind: {err}", file=sys.stderr)
    return EXIT_NO_SERVER


def _print_huge_pages_alone(args: argparse.Namespace) -> None:
    """``status`` without a server: the huge-page report still holds (it is the kernel's), and
    is what to set up before starting one. The exit status still says there is no server."""
    hp = hugepages.read_status()
    print(json.dumps({"huge_pages": hp.as_dict()}, sort_keys=True) if args.json else "\n".join(_huge_page_lines(hp)))


COMMANDS: dict[str, Callable[[Connection, argparse.Namespace], int]] = {
    "status": cmd_status, "list": cmd_list, "evict": cmd_evict, "shutdown": cmd_shutdown,
}


PRELOAD_HELP = """Fill the cache before the first use of a model: replay the calls in FILE.

FILE is either
  - a .py script: run once like `overmind run FILE` with its output discarded and every load
    waiting for the cache (OVERMIND_COLD=wait); it must call overmind.api.monkey_patch_all();
  - calls, one JSON object a line (blank lines and lines starting with # are skipped):
      {"fn": "diffusers.ControlNetModel.from_pretrained", "args": ["/models/canny"],
       "kwargs": {"torch_dtype": {"$py": "torch.float16"}}}
    "fn" is a dotted name (module, then attributes); "args" and "kwargs" are JSON values, and
    {"$py": "torch.float16"} names a Python object the same way. Every call runs patched, in
    a fresh process of the chosen interpreter, and waits until its entry is cached.

Exit status: 0 every call cached, 1 some failed (each is named), 2 a bad FILE."""


def build_parser() -> argparse.ArgumentParser:
    runtime_help = "the server's runtime directory (overrides OVERMIND_RUNTIME_DIR)"
    parser = argparse.ArgumentParser(prog="overmind", description="Inspect and control overmind-server.")
    parser.add_argument("--runtime-dir", help=runtime_help)
    # Accepted after the command too (``overmind-list --runtime-dir D``); SUPPRESS keeps the global value.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--runtime-dir", default=argparse.SUPPRESS, help=runtime_help)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    status = sub.add_parser("status", parents=[common], help="server pid, uptime and cache counters")
    status.add_argument("--json", action="store_true", help="the server's status as one JSON object")
    status.add_argument("--wait-ready", action="store_true",
                        help="wait until the server is up and its restore after a restart is done (for systemd "
                        "ExecStartPost=, a readiness probe, a deploy script); exit 0 then, 4 on --timeout")
    status.add_argument("--timeout", type=float, metavar="S", help="with --wait-ready: give up after S seconds")
    preload = sub.add_parser("preload", parents=[common], help="fill the cache from a file of calls or a script",
                             description=PRELOAD_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    preload.add_argument("file", metavar="FILE", help="calls, one JSON object a line (.jsonl), or a script (.py)")
    preload.add_argument("--python", metavar="PATH", help="the interpreter to load with (default: the one running "
                         "overmind); the warm interpreter of its context does the loads")
    listing = sub.add_parser("list", parents=[common], help="cached entries")
    listing.add_argument("--json", action="store_true", help="the entries as one JSON array")
    evict = sub.add_parser("evict", parents=[common], help="drop cached entries")
    which = evict.add_mutually_exclusive_group(required=True)
    which.add_argument("key", nargs="?", metavar="KEY", help="a key or a unique prefix of one")
    which.add_argument("--all", action="store_true", help="every entry")
    sub.add_parser("shutdown", parents=[common], help="stop the server and wait until it has stopped")
    # Listed for `overmind --help` only: overmind.frontend.run.command takes `run` before this module is
    # imported (Note [A light front end] in overmind.frontend.run); its own help is `overmind run -h`.
    sub.add_parser("run", add_help=False, help="run a script like python, forked from a warm interpreter "
                   "(`overmind run -h`)").add_argument("args", nargs=argparse.REMAINDER)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    """The ``overmind`` command but ``run``; its exit status. Note [A closed stdout is not an error] in
    overmind.frontend.closed_stdout."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        try:
            return _main(argv)
        finally:
            sys.stdout.flush()  # output still buffered fails here, not in the interpreter's exit
    except BrokenPipeError as err:
        if not stdout_closed(err):
            raise
        leave_for_closed_stdout()
        raise AssertionError("unreachable") from None


def _main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "run":  # `python -m overmind.frontend.cli run`: overmind.frontend.run.command takes
        # every form argparse would take before it hands a command here
        print("overmind: `run` is the overmind command's own: `overmind run ...` or `python -m overmind run ...`",
              file=sys.stderr)
        return EXIT_USAGE
    # Note [A bad setting never stops a script] in overmind.shared.settings.config: said on the user's stderr.
    settings.report = lambda message: print(f"overmind: {message}", file=sys.stderr)
    env = dict(os.environ)
    if args.runtime_dir:
        env["OVERMIND_RUNTIME_DIR"] = args.runtime_dir
    try:
        config = Config.from_env(env)
    except ConfigError as err:
        print(f"overmind: {err}", file=sys.stderr)
        return EXIT_USAGE
    if args.command == "status" and args.timeout is not None and not args.wait_ready:
        print("overmind: --timeout goes with --wait-ready", file=sys.stderr)
        return EXIT_USAGE
    if args.command == "status" and args.wait_ready:
        return _wait_ready(None, args, config)
    if args.command == "preload":
        from overmind.frontend.preload import preload_command

        return preload_command(args.file, args.python, env)
    try:
        conn = _open(config)
    except (ServerUnavailable, P.RemoteError, P.ProtocolError, OSError) as err:
        status = _not_connected(config, args, err)
        if args.command == "status":
            _print_huge_pages_alone(args)
        return status
    try:
        with conn:
            return COMMANDS[args.command](conn, args)
    except P.RemoteError as err:
        print(f"overmind: {err.message if err.code == P.ErrorCode.BAD_REQUEST else err}", file=sys.stderr)
        return EXIT_FAILED
    except (P.ProtocolError, EOFError, OSError) as err:
        if stdout_closed(err):  # our reader left, not the server: Note [A closed stdout is not an error]
            raise
        print(f"overmind: lost the server at {config.socket_path}: {err}", file=sys.stderr)
        return EXIT_FAILED


def list_main() -> int:
    return main(["list", *sys.argv[1:]])


def shutdown_main() -> int:
    return main(["shutdown", *sys.argv[1:]])


if __name__ == "__main__":
    sys.exit(main())
