"""What the server learned, kept across restarts in a private state directory. Stdlib only (the server's).

    keeper = StateKeeper(config, registry, pool, history)   # one per overmind.server.daemon.Server
    state = keeper.open()            # what the last server kept, checked; None if nothing usable
    loads.on_cached = keeper.record  # every fill that was cached (overmind.server.loads)
    keeper.save_if_changed()         # at most every SAVE_INTERVAL seconds, and at shutdown

overmind.server.restore refills the cache from what :meth:`StateKeeper.open` returns.

Note [The state file]
One JSON document per server (per runtime directory: ``Config.state_path``), in the state
directory (``OVERMIND_STATE_DIR``, default ``$XDG_STATE_HOME/overmind``)::

    {"format": "overmind-state", "version": 1, "saved": 1716200000.5, "runtime_dir": "/run/user/1000/overmind",
     "contexts": [{"python": "/venv/bin/python", "env": {"HF_HOME": "...", ...},
                   "modules": ["torch", "diffusers", ...], "refused": [...],
                   "reads": {"names": [...], "prefixes": [...]}, "last_used": 1716199990.0,
                   "interpreters": [{"values": {"TORCHINDUCTOR_CACHE_DIR": "..."}, "last_used": 1716199990.0}],
                   "packages": [{"point": "torch._inductor::aoti_load_package", "path": "/m/block.pt2",
                                 "kwargs": {...}}]}],
     "entries": [{"load": {...the Load message's fields as the client sent them...},
                  "blob": "<base64 of the pickled call>",
                  "files": [[path, size, mtime_ns, ino, dev, ctime_ns], ...],
                  "bytes": 1970000000, "last_used": 1716199995.2, "plain_seconds": 0.52}],
     "programs": [["<program id>", ["<key>", ...]], ...]}

- ``contexts``: per lineage of warm interpreters (overmind.server.pool), the environment a
  client sent for it, the installed modules its runs and loads imported, those it must not
  import, the variables its imports read, the interpreters that were warm, with the
  values of those variables each was keyed on, and the AOTInductor packages its runs loaded
  (Note [AOTInductor packages are handed over] in overmind.shared.calls.compiled: a preload checks the
  file's fingerprint again, so a package changed meanwhile is never handed over).
- ``entries``: the most recently used cache entries (MAX_ENTRIES), each the load call as the
  client sent it (the Load fields and the blob: what the loader replays), the fingerprints of
  the files its loader read (what a refill re-checks: Note [Never stale] in overmind.server.restore),
  the bytes its loader wrote and when a client last used it.
- ``programs``: what each program loaded last time (overmind.server.programs), for its prefetch.

Trust. The directory is checked like the runtime directory (ours, 0700 when we create it,
refused when another uid owns it or others can write it, never a symlink) and then used only
through a file descriptor opened with ``O_NOFOLLOW``: a directory swapped for a link after
the check is never followed. The file must be a regular file of ours that others cannot
write, at most MAX_STATE_BYTES. Its content is checked item by item exactly as a client's
request is (``Load.from_fields``, ``loads.check_request``, ``context_from_wire``,
``check_modules``, ``reads_from_wire``): the file can ask for nothing a client of this uid
could not ask itself, and an item that fails is dropped. A file that cannot be read, is not
JSON, or has another format or version is ignored with one warning and replaced at the next save.

Note [Atomic, rate-limited saves]
A save writes a new file next to the old one (``.<name>.<pid>.tmp``, ``O_EXCL``), fsyncs it,
renames it over the old one and fsyncs the directory: a server killed at any point (SIGKILL,
a power cut) leaves the old state or the new one, never a mix; a temporary file left behind is
removed at the next start. Saves run on a thread of their own, at most every SAVE_INTERVAL
seconds and only when something changed, and once more at a graceful shutdown: a killed server
loses at most the last SAVE_INTERVAL seconds.
"""

from __future__ import annotations

import base64
import binascii
import errno
import json
import logging
import os
import stat
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional

from overmind import __version__
from overmind.shared import protocol as P
from overmind.shared.settings.config import Config, ConfigError, ensure_private_dir, selecting_environment
from overmind.shared.settings.import_env import reads_from_wire
from overmind.shared.calls.compiled import packages_from_wire
from overmind.shared.protocol.contexts import Context

logger = logging.getLogger("overmind.server.state")

__all__ = ["State", "StateKeeper", "StateError", "parse_state", "read_state", "write_state", "open_state_dir",
           "FORMAT", "VERSION", "SAVE_INTERVAL", "MAX_ENTRIES"]

FORMAT = "overmind-state"
VERSION = 1
SAVE_INTERVAL = 2.0  # seconds between two saves at most: Note [Atomic, rate-limited saves]
MAX_STATE_BYTES = 64 << 20
MAX_ENTRIES = 256  # entries kept, most recently used first
MAX_CONTEXTS = 32  # lineages kept
MAX_INTERPRETERS = 8  # warm interpreters kept per lineage
MAX_KEPT_BLOB = 1 << 20  # a call whose pickled form is larger is not kept (a client's is kilobytes)
MAX_KEY = 64


class StateError(Exception):
    """A state file that cannot be used at all (unreadable, not JSON, another format or version)."""


@dataclass
class State:
    """A state file's content, every item checked (Note [The state file])."""

    saved: float = 0.0
    contexts: list = field(default_factory=list)  # dicts as in the file, checked
    entries: list = field(default_factory=list)  # dicts as in the file plus "request" (a P.Load) and "call" (bytes)
    programs: list = field(default_factory=list)  # [program, [keys]]
    dropped: int = 0  # items that failed their checks


# -- the directory and the file: Note [The state file], Note [Atomic, rate-limited saves] -----------


def open_state_dir(path) -> int:
    """An fd of the state directory, checked private and ours; ConfigError says why not."""
    from pathlib import Path

    path = Path(path)
    ensure_private_dir(path, what="state directory", setting="OVERMIND_STATE_DIR", forbidden=0o022)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as err:
        raise ConfigError(f"cannot open state directory {path}: {err.strerror}") from None
    st = os.fstat(fd)  # what we opened, not what the name pointed to when checked
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
        os.close(fd)
        raise ConfigError(f"state directory {path} changed while it was checked; not using it")
    return fd


def _key_ok(key) -> bool:
    return isinstance(key, str) and 0 < len(key) <= MAX_KEY and key.isalnum() and key.isascii()


def read_state(dir_fd: int, name: str) -> Optional[bytes]:
    """The state file's bytes; None if there is none. StateError for one we must not use."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise StateError("it is a symlink") from None
        raise StateError(err.strerror) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise StateError("it is not a regular file")
        if st.st_uid != os.getuid():
            raise StateError(f"it belongs to uid {st.st_uid}, not to uid {os.getuid()}")
        if st.st_mode & 0o022:
            raise StateError(f"others can write it (mode {stat.S_IMODE(st.st_mode):04o})")
        if st.st_size > MAX_STATE_BYTES:
            raise StateError(f"it is {st.st_size} bytes, more than {MAX_STATE_BYTES}")
        chunks, left = [], MAX_STATE_BYTES + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    except OSError as err:
        raise StateError(err.strerror) from None
    finally:
        os.close(fd)


def write_state(dir_fd: int, name: str, data: bytes) -> None:
    """Replace ``name`` with ``data``: Note [Atomic, rate-limited saves]."""
    tmp = f".{name}.{os.getpid()}.tmp"
    try:
        os.unlink(tmp, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        os.unlink(tmp, dir_fd=dir_fd)
        raise
    os.close(fd)
    os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    os.fsync(dir_fd)


def remove_leftovers(dir_fd: int, name: str) -> int:
    """Temporary files of saves that a kill interrupted: Note [Atomic, rate-limited saves]."""
    return _unlink_each(dir_fd, [e for e in os.listdir(dir_fd) if e.startswith(f".{name}.") and e.endswith(".tmp")])


def _unlink_each(dir_fd: int, entries) -> int:
    """Unlink each entry of the directory (never following a link); how many went."""
    removed = 0
    for entry in entries:
        try:
            os.unlink(entry, dir_fd=dir_fd)
            removed += 1
        except OSError:
            pass
    return removed


def remove_orphans(dir_fd: int, name: str) -> int:
    """Note [State files die with their runtime directory]
    Each runtime directory has its own state file (``Config.state_path``), and a runtime
    directory is often short-lived: a test's, a benchmark's, a container's. Their files would
    pile up for ever (13 after one morning of runs). A server that opens the state directory
    removes the state files, but its own, whose recorded runtime directory no longer exists: no
    server can restore from them again (a new server there makes a new file). Files of another
    uid, links, and files it cannot read are left alone."""
    orphans = []
    for entry in os.listdir(dir_fd):
        if entry == name or not (entry.startswith("state-") and entry.endswith(".json")):
            continue
        try:
            data = read_state(dir_fd, entry)
            runtime_dir = json.loads(data).get("runtime_dir") if data else None
        except (StateError, ValueError, AttributeError):
            continue
        if isinstance(runtime_dir, str) and os.path.isabs(runtime_dir) and not os.path.lexists(runtime_dir):
            orphans.append(entry)
    return _unlink_each(dir_fd, orphans)


# -- the content: checked as a client's request is --------------------------------------------


def parse_state(data: bytes, check_load=None, check_context=None, check_modules=None) -> State:
    """The checked content of a state file (Note [The state file]). StateError if it is not a
    state file of this version at all; items that fail their checks are dropped and counted.
    ``check_load(request)``, ``check_context(dict)`` and ``check_modules(list)`` are the server's
    own checks of a client's Load, context and modules (they raise on what a client may not send)."""
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as err:
        raise StateError(f"it is not JSON ({str(err)[:100]}): truncated or corrupt") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise StateError("it is not an overmind state file")
    if doc.get("version") != VERSION:
        raise StateError(f"it is of version {doc.get('version')!r}; this server reads version {VERSION}")
    state = State(saved=doc.get("saved") if isinstance(doc.get("saved"), (int, float)) else 0.0)
    for item in _list(doc.get("contexts"))[:MAX_CONTEXTS]:
        context = _checked_context(item, check_context, check_modules)
        if context is None:
            state.dropped += 1
        else:
            state.contexts.append(context)
    for item in _list(doc.get("entries"))[:MAX_ENTRIES]:
        entry = _checked_entry(item, check_load)
        if entry is None:
            state.dropped += 1
        else:
            state.entries.append(entry)
    for item in _list(doc.get("programs")):
        if isinstance(item, list) and len(item) == 2 and isinstance(item[0], str) and 0 < len(item[0]) <= MAX_KEY \
                and isinstance(item[1], list) and all(_key_ok(k) for k in item[1]):
            state.programs.append([item[0], item[1]])
        else:
            state.dropped += 1
    return state


def _list(value) -> list:
    return value if isinstance(value, list) else []


def _time(value) -> Optional[float]:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0 else None


def _checked_context(item, check_context, check_modules) -> Optional[dict]:
    if not isinstance(item, dict) or _time(item.get("last_used")) is None:
        return None
    python, env = item.get("python"), item.get("env")
    try:
        if check_context is not None:
            check_context({"python": python, "env": env, "cwd": "/", "sys_path": []})
        modules, refused = item.get("modules", []), item.get("refused", [])
        if check_modules is not None:
            check_modules(modules)
            check_modules(refused)
    except Exception:  # noqa: BLE001 - whatever the server's checks raise: dropped
        return None
    if not (isinstance(python, str) and isinstance(env, dict) and isinstance(modules, list)
            and isinstance(refused, list) and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())
            and all(isinstance(m, str) for m in [*modules, *refused])):
        return None
    names, prefixes = reads_from_wire(item.get("reads"))
    interpreters = []
    for one in _list(item.get("interpreters"))[:MAX_INTERPRETERS]:
        values = one.get("values") if isinstance(one, dict) else None
        if isinstance(values, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in values.items()) \
                and _time(one.get("last_used")) is not None and len(values) <= 1000:
            interpreters.append({"values": values, "last_used": float(one["last_used"])})
    return {"python": python, "env": selecting_environment(env), "modules": modules, "refused": refused,
            "reads": {"names": names, "prefixes": prefixes}, "last_used": float(item["last_used"]),
            "interpreters": interpreters, "packages": packages_from_wire(item.get("packages"))}


def _checked_entry(item, check_load) -> Optional[dict]:
    if not isinstance(item, dict) or _time(item.get("last_used")) is None:
        return None
    nbytes, files, blob, plain = item.get("bytes"), item.get("files"), item.get("blob"), item.get("plain_seconds")
    if not (isinstance(nbytes, int) and not isinstance(nbytes, bool) and 0 <= nbytes <= 1 << 50):
        return None
    if not (isinstance(files, list) and all(isinstance(r, list) and len(r) == 6 and isinstance(r[0], str)
                                            and all(isinstance(v, int) for v in r[1:]) for r in files)):
        return None
    if plain is not None and (_time(plain) is None or plain > 1e6):
        return None
    if not isinstance(blob, str) or len(blob) > MAX_KEPT_BLOB * 2:
        return None
    try:
        call = base64.b64decode(blob, validate=True)
        request = P.Load.from_fields(item.get("load"))
        if check_load is not None:
            check_load(request)
    except (binascii.Error, ValueError, P.ProtocolError):
        return None
    except Exception:  # noqa: BLE001 - the server's own checks refused it (LoadFailure)
        return None
    if request.lookup_only:
        return None
    return {"load": request.to_dict(), "blob": blob, "files": files, "bytes": nbytes,
            "last_used": float(item["last_used"]), "plain_seconds": plain, "request": request, "call": call}


# -- the keeper ----------------------------------------------------------------------------------


class StateKeeper:
    """The server's side of the state file: what to keep, when to write it (Note [The state file])."""

    def __init__(self, config: Config, registry, pool, history, plain_seconds=None) -> None:
        self.config = config
        self.registry = registry
        self.pool = pool
        self.history = history
        self.plain_seconds = plain_seconds or (lambda key: None)  # key -> a plain load's seconds (Joins)
        self.path = config.state_path
        self.dir_fd = -1
        self.problem = ""  # why no state is kept or the old one was not used: said once, shown in the status
        self.lock = threading.Lock()
        self.entries: "OrderedDict[str, dict]" = OrderedDict()  # key -> entry as in the file, oldest first
        self.contexts: dict = {}  # lineage -> context as in the file
        self.programs: list = []  # restored, until history has its own
        self.written = b""  # the last content written, "saved" left out
        self.saved_at = 0.0
        self.saves = 0
        self.save_lock = threading.Lock()  # the saving thread and the final save at shutdown

    @property
    def enabled(self) -> bool:
        return self.dir_fd >= 0

    def open(self, check_load=None, check_context=None, check_modules=None) -> Optional[State]:
        """Check the state directory and read the file; what it holds, or None. Never raises:
        a refused directory or a file that cannot be used is said in one warning."""
        if self.path is None:
            self.problem = "no state directory configured"
            return None
        try:
            self.dir_fd = open_state_dir(self.path.parent)
        except (ConfigError, OSError) as err:
            self.problem = f"not keeping state: {err}"
            logger.warning("%s; the server runs without it (nothing is restored after a restart)", self.problem)
            return None
        left = remove_leftovers(self.dir_fd, self.path.name)
        if left:
            logger.info("removed %d temporary state file(s) of interrupted saves", left)
        orphans = remove_orphans(self.dir_fd, self.path.name)
        if orphans:
            logger.info("removed %d state file(s) of runtime directories that no longer exist", orphans)
        try:
            data = read_state(self.dir_fd, self.path.name)
            if data is None:
                return None
            state = parse_state(data, check_load, check_context, check_modules)
        except StateError as err:
            self.problem = f"ignored state file {self.path}: {err}"
            logger.warning("%s; starting without it, and replacing it", self.problem)
            self.written = b"(replace)"
            return None
        if state.dropped:
            logger.warning("state file %s: %d item(s) failed their checks and were dropped", self.path, state.dropped)
        with self.lock:
            for entry in sorted(state.entries, key=lambda e: e["last_used"]):
                self.entries[entry["request"].key] = entry
            for context in state.contexts:
                self.contexts[_lineage(context)] = context
            self.programs = state.programs
        return state

    def record(self, request: P.Load, blob: bytes, entry) -> None:
        """A fill was cached (Loads.on_cached): keep its call for a restore."""
        if not self.enabled or len(blob) > MAX_KEPT_BLOB or request.lookup_only:
            return
        load = request.to_dict()
        load["wait"] = False  # a refill has no caller waiting
        record = {"load": load, "blob": base64.b64encode(blob).decode(), "files": entry.meta.files,
                  "bytes": entry.nbytes, "last_used": entry.last_used, "plain_seconds": None,
                  "request": request, "call": blob}
        with self.lock:
            old = self.entries.pop(request.key, None)
            if old is not None:
                record["plain_seconds"] = old["plain_seconds"]
            self.entries[request.key] = record
            while len(self.entries) > MAX_ENTRIES:
                self.entries.popitem(last=False)

    def records(self, keys: list) -> list:
        """The kept records of those of ``keys`` it keeps, in that order (overmind.server.restore.Restore.bring_back)."""
        with self.lock:
            return [self.entries[key] for key in keys if key in self.entries]

    def forget(self, key: str) -> None:
        """An entry whose files changed: no later restore tries it (Note [Never stale] in overmind.server.restore)."""
        with self.lock:
            self.entries.pop(key, None)

    def snapshot(self) -> dict:
        """The document to write (Note [The state file]), without its "saved" time."""
        recency = self.registry.recency()
        with self.lock:
            for key, when in recency.items():  # the registry's, while cached: hits move it
                if key in self.entries:
                    self.entries[key]["last_used"] = when
            for key in list(self.entries):
                seconds = self.plain_seconds(key)
                if seconds is not None:
                    self.entries[key]["plain_seconds"] = seconds
            entries = sorted(self.entries.values(), key=lambda e: -e["last_used"])[:MAX_ENTRIES]
            self._merge_contexts()
            contexts = sorted(self.contexts.values(), key=lambda c: -c["last_used"])[:MAX_CONTEXTS]
        programs = self.history.snapshot() or self.programs
        return {"format": FORMAT, "version": VERSION, "server_version": __version__,
                "runtime_dir": str(self.config.runtime_dir),
                "contexts": contexts,
                "entries": [{k: e[k] for k in ("load", "blob", "files", "bytes", "last_used", "plain_seconds")}
                            for e in entries],
                "programs": programs}

    def _merge_contexts(self) -> None:
        """The live interpreters and what each lineage learned, into ``self.contexts`` (lock held)."""
        live = self.pool.live()
        lessons = self.pool.lessons.snapshot(live)
        for context, last_used in [(interpreter.context, interpreter.last_used) for interpreter in live]:
            base = selecting_environment(dict(context.env))
            record = self.contexts.get(context.lineage)
            if record is None:
                record = {"python": context.python, "env": base, "modules": [], "refused": [],
                          "reads": {"names": [], "prefixes": []}, "last_used": last_used, "interpreters": [],
                          "packages": []}
                if _lineage(record) != context.lineage:
                    continue  # not a context a client sent: nothing we could restore
                self.contexts[context.lineage] = record
            record["last_used"] = max(record["last_used"], last_used)
            values = {k: v for k, v in context.env if k not in base}
            kept = [i for i in record["interpreters"] if i["values"] != values]
            record["interpreters"] = sorted([*kept, {"values": values, "last_used": last_used}],
                                            key=lambda i: -i["last_used"])[:MAX_INTERPRETERS]
        for lineage, (modules, refused, names, prefixes) in lessons.items():
            record = self.contexts.get(lineage)
            if record is not None:
                record["modules"] = list(dict.fromkeys([*modules, *record["modules"]]))[:10000]
                record["refused"] = sorted({*refused, *record["refused"]})
                record["reads"] = {"names": sorted({*names, *record["reads"]["names"]}),
                                   "prefixes": sorted({*prefixes, *record["reads"]["prefixes"]})}
        for lineage, packages in self.pool.lessons.packages_snapshot().items():
            record = self.contexts.get(lineage)
            if record is not None:
                record["packages"] = packages
        while len(self.contexts) > MAX_CONTEXTS:
            del self.contexts[min(self.contexts, key=lambda k: self.contexts[k]["last_used"])]

    def save_if_changed(self) -> bool:
        """Write the state if it changed since the last write; True if written. Never raises."""
        with self.save_lock:
            return self._save_if_changed()

    def _save_if_changed(self) -> bool:
        if not self.enabled:
            return False
        try:
            doc = self.snapshot()
            body = json.dumps(doc, sort_keys=True).encode()
            if body == self.written:
                return False
            doc["saved"] = time.time()
            write_state(self.dir_fd, self.path.name, json.dumps(doc, sort_keys=True).encode())
        except Exception as err:  # noqa: BLE001 - a full disk must not take the cache down
            logger.warning("could not save the state to %s: %s", self.path, err)
            return False
        self.written, self.saved_at, self.saves = body, time.time(), self.saves + 1
        return True

    def run(self, stopping: threading.Event) -> None:
        """The saving thread: Note [Atomic, rate-limited saves]."""
        while not stopping.wait(SAVE_INTERVAL):
            self.save_if_changed()

    def describe(self) -> dict:
        with self.lock:
            entries = len(self.entries)
        return {"path": str(self.path) if self.path else "", "kept": self.enabled, "problem": self.problem,
                "entries": entries, "saved": self.saved_at, "saves": self.saves}

    def close(self) -> None:
        with self.save_lock:
            self._close()

    def _close(self) -> None:
        if self.dir_fd >= 0:
            os.close(self.dir_fd)
            self.dir_fd = -1


def _lineage(context: dict) -> str:
    """The lineage key (overmind.shared.protocol.contexts.Context.key) of a context as kept in the file."""
    return Context(context["python"], tuple(sorted(context["env"].items()))).key
