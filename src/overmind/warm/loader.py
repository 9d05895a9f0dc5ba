"""Loader processes: run the original load function and hand the result to the server.

Runs in a child forked from a warm interpreter (``overmind.warm.interpreter``), one per cold load::

    run_job(job, blob, job_sock)     # -> JobResult or JobFailed on job_sock; the exit code

The child unpickles the call (rebuilding ``vae=vae``-style arguments from the entries the
server hands it: Note [The loader is handed its references] in ``overmind.server.loaders``),
calls the original, unpatched load function, strips what does not survive pickling
(``overmind.shared.segments.quirks``), packs the result into new sealed segments and sends their fds
and the skeleton to the server. Then it exits; see Note [Warm interpreters never touch CUDA]
in ``overmind.server.pool``.

Note [Hashing a file's storages after the answer]
Every storage of 64 KiB or more is hashed as it is packed, so that a later load can find its
bytes (Note [Stored once by content] in overmind.shared.segments.reductions). For a storage that stays
in its model file (Note [File-backed segments] in overmind.shared.segments.memfd) that hash was nearly
all of the pack: the LM of ``overmind-bench`` (2.1 GB of bf16 safetensors, every weight in the
file; packed in one process after its plain load, profiled) took 0.74 s to pack, 0.60 s of it
xxh3 over pages the loader had not touched yet, and ``overmind run``'s run 2, started 0.1 s
after run 1 exited, found its fill still packing and loaded plainly beside it (Note [Joining a
fill] in overmind.server.joins). Yet the entry needs no hash: only a later load's pack does, to
find these bytes. So a pack large enough to report its progress leaves a storage it places in a
file unhashed when no region of the index could hold it (Note [Probing before hashing] in
overmind.warm.dedup); the loader answers, then hashes those at idle priority and sends their
records (``FileContents``)
on the job socket, which the server adds to the entry while it waits for the loader to exit. A
load whose pack starts before they arrive (a copy of the same model, loaded within that
second), or after the loader died first, does not find them: it keeps its own file's pages,
which cost no memory until the server settles both files into sealed memory, never a wrong
weight (a found region is hashed again before use). Smaller packs hash as before: they take
milliseconds either way. The same pack now takes 0.04 s (0.02 s of it reading
``/proc/self/pagemap``), and run 2 of ``overmind-bench --scenarios warmup_curve --curve-scripts
lm --imports pandas`` hit in both rounds (0.09 x plain; it was 0.11 x, loading plainly).
"""

from __future__ import annotations

import base64
import json
import logging
import os
import socket
import sys
import threading
import time
import traceback
from typing import Any

from overmind.shared import protocol as P

logger = logging.getLogger(__name__)

__all__ = ["run_job", "spawned_main", "FileObserver"]

MAX_CONTENTS = 8000  # content records a result carries (~70 bytes each)
# A fill this large tells the server how far its pack is, every PROGRESS_INTERVAL seconds.
PROGRESS_MIN_BYTES = 32 << 20
PROGRESS_INTERVAL = 0.1
_WALK_LIMIT = 100_000  # objects looked at to count a result's bytes


def _storage_bytes(obj: Any, known: set) -> int:
    """Bytes of the distinct storages reachable through the usual containers of a load's
    result (modules, pipelines' components, dicts, lists, tuples), not counting those in
    ``known`` (data pointers); an estimate for progress reports, bounded in effort."""
    torch = sys.modules["torch"]
    total, stack, visited = 0, [obj], 0
    while stack and visited < _WALK_LIMIT:
        item = stack.pop()
        visited += 1
        if isinstance(item, torch.Tensor):
            storage = item.untyped_storage()
            if item.device.type != "meta" and storage.data_ptr() not in known:
                known.add(storage.data_ptr())
                total += storage.nbytes()
        elif isinstance(item, torch.nn.Module):
            stack.extend(item.parameters())
            stack.extend(item.buffers())
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(getattr(item, "components", None), dict):  # a diffusers pipeline
            stack.extend(item.components.values())
    return total


class _Progress:
    """The pack's progress, sent as FillProgress on the job socket by a thread of its own.

    Note [Progress of a pack]
    A caller that finds its key filling decides between waiting and loading plainly on how
    long the fill should still take (Note [Joining a fill] in overmind.server.joins). The loader
    knows: before packing it counts the bytes of the result's storages (those of the
    arguments handed back unchanged left out: they are not packed again), then reports the
    bytes in place every PROGRESS_INTERVAL seconds, counted by the fill threads as each
    storage lands (or is found stored already), and the seconds its call of the original took:
    what a plain load costs in a process that imported the libraries already. Fills under PROGRESS_MIN_BYTES say nothing:
    they end sooner than the decision would matter. Reports stop before the answer, which
    follows them on the same socket.
    """

    def __init__(self, sock: socket.socket, key: str, expected: int, original_seconds: float) -> None:
        self.sock, self.key, self.expected, self.original_seconds = sock, key, expected, original_seconds
        self.written = 0
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None

    def add(self, nbytes: int) -> None:  # from the fill threads too
        with self.lock:
            self.written += nbytes

    def _send(self) -> None:
        with self.lock:
            written = self.written
        P.send_message(self.sock, P.FillProgress(self.key, written, self.expected, self.original_seconds))

    def _report(self) -> None:
        try:
            while not self.stop.wait(PROGRESS_INTERVAL):
                self._send()
        except OSError:  # the server went away; the answer will fail the same way
            pass

    def __enter__(self) -> "_Progress":
        if self.expected >= PROGRESS_MIN_BYTES:
            self._send()  # the pack starts now: the server times its rate from here
            self.thread = threading.Thread(target=self._report, name="overmind-progress", daemon=True)
            self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join()  # before the answer goes out on the same socket


def _state_of(obj: Any) -> Any:
    """What would tell us the loader changed an argument in place (dtype casts, moves, fusing)."""
    torch = sys.modules["torch"]
    modules = []
    if isinstance(obj, torch.nn.Module):
        modules = [obj]
    elif hasattr(obj, "components") and isinstance(getattr(obj, "components"), dict):
        modules = [m for m in obj.components.values() if isinstance(m, torch.nn.Module)]
    return [tuple((name, t.data_ptr(), t.dtype, t.device, tuple(t.shape)) for name, t in m.state_dict().items())
            for m in modules]


class FileObserver:
    """Which files a load read: Python-level opens (an audit hook) and file mappings.

    Note [Observed files]
    The key already fingerprints the paths named in the arguments, but a loader may read
    files no argument names (a config's base model, a custom patch point's own index). The
    loader therefore records every regular file opened for reading while the original
    runs, plus every file mapped into the process by then (safetensors maps its files from
    Rust, unseen by Python's audit events). The server re-checks these fingerprints (ctime
    included: Note [What a fingerprint cannot see] in overmind.shared.calls.keys) on every hit and treats
    a change as a miss; the client checks it can still read them (Note [A hit needs the
    caller's read permission] in overmind.client.connection). Files under the interpreter's own prefixes
    (the libraries themselves) are left out: their versions are in the key.
    """

    def __init__(self) -> None:
        self.paths: set[str] = set()
        self.active = False
        prefixes = {sys.prefix, sys.base_prefix, sys.exec_prefix}
        prefixes |= {p for p in sys.path if "site-packages" in p or "dist-packages" in p}
        self.ignored = tuple(os.path.join(os.path.realpath(p), "") for p in prefixes if p)
        sys.addaudithook(self._hook)

    def _hook(self, event: str, args: tuple) -> None:
        if not self.active or event != "open":
            return
        path, mode = args[0], args[1]
        if isinstance(path, (str, bytes)) and (mode is None or "r" in str(mode) or "+" in str(mode)):
            self.paths.add(os.fsdecode(path))

    def mapped(self) -> set[str]:
        found = set()
        try:
            with open("/proc/self/maps") as maps:
                for line in maps:
                    parts = line.split(None, 5)
                    if len(parts) == 6 and parts[5].startswith("/"):
                        found.add(parts[5].rstrip("\n").removesuffix(" (deleted)"))
        except OSError:
            pass
        return found

    def fingerprints(self, before_maps: set[str]) -> list[list]:
        from overmind.shared.calls.keys import file_fingerprint

        out = []
        for path in sorted(self.paths | (self.mapped() - before_maps)):
            try:
                real = os.path.realpath(path)
                st = os.stat(real)
            except OSError:
                continue
            if not os.path.isfile(real) or real.startswith(self.ignored) or real.startswith(("/proc/", "/dev/", "/sys/")):
                continue
            out.append(list(file_fingerprint(real, st)))  # Note [What a fingerprint cannot see]
        return out


class _Handed:
    """What the server hands a loader on its job socket before the call: the entries the call
    refers to and the content index (Note [The loader is handed its references] in
    overmind.server.loaders). ``rebuild(key)`` gives each entry's object, once."""

    def __init__(self, sock: socket.socket) -> None:
        self.entries: dict[str, tuple[P.Entry, bytes, list[int]]] = {}
        self.index: dict = {}
        self.built: dict[str, Any] = {}
        while True:
            message, blob, fds = P.recv_message(sock)
            if isinstance(message, P.Ok):
                P.close_fds(fds)
                return
            if isinstance(message, P.Entry):
                self.entries[message.key] = (message, blob, fds)
            elif isinstance(message, P.Contents):
                P.close_fds(fds)
                self.index = json.loads(blob)
            else:
                P.close_fds(fds)
                raise P.ProtocolError(f"unexpected {type(message).__name__} before the job")

    def rebuild(self, key: str) -> Any:
        if key in self.built:
            return self.built[key]
        from overmind.shared.segments.memfd import Segment
        from overmind.shared.segments.reductions import unpack

        if key not in self.entries:
            raise LookupError(f"the server handed over no entry {key[:16]}, which the call refers to")
        entry, skeleton, fds = self.entries[key]
        meta = P.LoadMeta.from_wire(entry.meta)
        references = {k: self.rebuild(k) for k in meta.references}
        sys.path.extend(p for p in meta.sys_path_extra if isinstance(p, str) and p not in sys.path)
        live = [(i, handle) for i, handle in enumerate(entry.segments) if handle is not None]
        if len(live) != len(fds):
            raise P.ProtocolError(f"entry {key[:16]} came with {len(fds)} fds for {len(live)} segments")
        mappings: list = [None] * len(entry.segments)
        for (i, (_, size, dev, ino)), fd in zip(live, fds):
            with Segment.from_fd(fd, size, f"{key[:12]}.{i}", identity=(dev, ino)) as segment:
                mappings[i] = segment.map_private()  # the mapping keeps the file; the fd goes
        self.built[key] = unpack(skeleton, mappings, references=references)
        return self.built[key]


def _context_environment() -> None:
    """A load runs in its context's environment (Note [Environment that selects an interpreter] in
    overmind.shared.settings.config), also in an interpreter that a run started under that run's whole
    environment (Note [A run's interpreter imports under the run's environment] in overmind.server.pool):
    another shell's other variables (proxies, credentials, a script's own settings) stay out of it."""
    from overmind.shared.settings.config import selecting_environment

    keep = set(selecting_environment(os.environ))
    for name in [n for n in os.environ if n not in keep and not n.startswith("OVERMIND_")]:
        del os.environ[name]


def spawned_main(fd: int) -> None:
    """A job in a fresh interpreter, handed over on socket ``fd`` by a warm interpreter that cannot
    fork (Note [A fill never waits for a fork] in overmind.warm.interpreter)."""
    code = 1
    try:
        with socket.socket(fileno=fd) as sock:
            message, blob, fds = P.recv_message(sock)
        job = P.expect(message, P.Job, "from a warm interpreter")
        if len(fds) != 1:
            raise P.ProtocolError(f"a spawned job needs 1 fd, got {len(fds)}")
        try:
            os.chdir(job.cwd)
        except OSError:
            pass
        with socket.socket(fileno=fds[0]) as job_sock:
            code = run_job(job, blob, job_sock)
    finally:
        os._exit(code)


def run_job(job: P.Job, blob: bytes, job_sock: socket.socket) -> int:
    """Run one load in this (forked) process; answer on ``job_sock``. Returns the exit code."""
    started = time.monotonic()
    code = P.ErrorCode.CANNOT_CACHE  # until the original runs, and once it has returned
    try:
        _context_environment()
        sys.path[:] = job.sys_path
        from overmind.shared.calls import callstate
        from overmind.shared.segments import quirks
        from overmind.shared.calls.keys import decode_call
        from overmind.warm.dedup import SegmentContents
        from overmind.warm.file_backed import MappedFiles
        from overmind.shared.segments.reductions import pack
        from overmind.shared.calls.replay import Recorder

        handed = _Handed(job_sock)
        call = decode_call(blob, handed.rebuild)
        prepared = time.monotonic()
        refs = call.references
        before = {key: _state_of(obj) for key, obj in refs.items()}
        # Note [Process-global state of a load]: the caller's state, then its generators'.
        grad_mode = callstate.apply_keyed(call.keyed_state)
        caller_rng = callstate.decode_rng(call.rng)
        callstate.set_rng_state(caller_rng)
        rng_start = callstate.rng_state()  # as this process reads it back: the comparison below is exact
        observer = FileObserver()
        maps_before = observer.mapped()
        observer.active = True
        code = P.ErrorCode.LOADER_FAILED
        original_started = time.monotonic()
        try:
            with grad_mode, Recorder() as recorder:
                result = call.fn(*call.args, **call.kwargs)
        finally:
            observer.active = False
        original_seconds = time.monotonic() - original_started
        code = P.ErrorCode.CANNOT_CACHE
        # A generator the load first imported counts only if drawn from: Note [Loads that draw random numbers].
        drew = callstate.drawn(rng_start, callstate.rng_state())
        rng = {} if not drew else {"drew": sorted(drew), "start": callstate.rng_digest(caller_rng, sorted(drew)),
                                   "end": base64.b64encode(callstate.encode_rng(drew)).decode()}
        files = observer.fingerprints(maps_before)
        loaded = time.monotonic()
        # Note [Results that cannot be rebuilt] in overmind.shared.segments.quirks: before the hooks are stripped.
        code = P.ErrorCode.NOT_REBUILDABLE
        quirks.check_rebuildable(result)
        code = P.ErrorCode.CANNOT_CACHE
        quirks.prepare_for_pickle(result)
        # Arguments handed back unchanged travel as references: the client puts its own object there.
        references = {id(obj): key for key, obj in refs.items() if _state_of(obj) == before[key]}
        mapped_files = MappedFiles(files)  # Note [File-backed segments] in overmind.shared.segments.memfd
        store = SegmentContents(handed.index, handed.index.get("server_pid", 0), mapped_files)
        handed_back: set = set()  # their storages are not packed again: the client supplies them
        for obj in refs.values():
            if id(obj) in references:
                _storage_bytes(obj, handed_back)
        expected = _storage_bytes(result, handed_back)
        with _Progress(job_sock, job.key, expected, original_seconds) as progress:
            packed = pack(result, name=job.key[:12], store=store, references=references, progress=progress.add,
                          hash_files_later=expected >= PROGRESS_MIN_BYTES)
        slots = [i for i, seg in enumerate(packed.segments) if seg is not None]
        fds = [packed.segments[i].fd for i in slots] + store.fds
        sizes = [packed.segments[i].size for i in slots] + store.sizes
        slots += [len(packed.segments) + i for i in range(len(store.fds))]
        meta = P.LoadMeta(
            type=f"{type(result).__module__}.{type(result).__qualname__}",
            pickler=packed.pickler, storages=packed.storages, tensors=packed.tensors,
            original_seconds=loaded - started, pack_seconds=time.monotonic() - loaded,
            sys_path_extra=quirks.dynamic_module_paths(),
            references=sorted(set(references.values())),
            files=files,  # Note [Observed files]
            deduplicated=packed.deduplicated,
            # Note [Content index] in overmind.server.registry; bounded to stay within protocol.MAX_JSON.
            contents=packed.contents if len(packed.contents) <= MAX_CONTENTS else [],
            rng=rng, events=recorder.events,
        ).to_dict()
        P.send_message(job_sock, P.JobResult(job.key, sizes, slots, len(packed.segments) + len(store.fds),
                                             packed.nbytes, store.holders, meta),
                       packed.skeleton, fds=fds)
        logger.debug("answered %s: %.2f s to its call (%d references), %.2f s in the original, %.2f s to pack "
                     "and answer",
                     job.key[:16], prepared - started, len(refs), original_seconds, time.monotonic() - loaded)
    except BaseException as err:  # reported to the client as a typed error with this traceback
        try:
            P.send_message(job_sock, P.JobFailed(job.key, code,
                                                 f"{type(err).__name__}: {err}", traceback.format_exc()))
        except OSError:
            pass
        return 1
    segments = [seg for seg in packed.segments if seg is not None]
    if packed.unhashed or any(seg.huge for seg in segments):
        from overmind.shared.process.priority import every_thread, to_idle

        every_thread(os.getpid(), to_idle)  # what is left runs behind the served entry, on CPU nobody wants
    if packed.unhashed:
        _hash_behind(job_sock, job.key, packed.unhashed)
    try:
        _collapse_behind(segments)
    except Exception:  # the entry is served already; small pages are only slower
        logger.exception("rebuilding segments out of huge pages failed")
    return 0


def _hash_behind(job_sock: socket.socket, key: str, unhashed: list) -> None:
    """After the answer, at idle priority: hash the storages the pack left in their files
    unhashed and send their contents records (Note [Hashing a file's storages after the answer])."""
    from overmind.shared.segments.reductions import hash_regions

    started = time.monotonic()
    try:
        records = hash_regions(unhashed[:MAX_CONTENTS])  # bounded as the answer's own records are
        P.send_message(job_sock, P.FileContents(key, len(records)), json.dumps(records).encode())
    except (OSError, ValueError) as err:  # the entry is served already; only later sharing is lost
        logger.warning("could not send the contents of %s's file storages: %s", key[:16], err)
        return
    logger.debug("hashed %d file storages of %s in %.2f s", len(records), key[:16], time.monotonic() - started)


def _collapse_behind(segments: list) -> None:
    """After the answer, at idle priority: rebuild the new segments out of huge pages while
    the entry is already served (Note [Huge pages for segments] in overmind.shared.segments.memfd). The
    server counts this loader among those exiting until it exits (EOF on ``job_sock``)."""
    if not any(seg.huge for seg in segments):
        return
    started, asked = time.monotonic(), sum(seg.size for seg in segments)
    done = sum(seg.collapse_to_huge_pages() for seg in segments)
    logger.debug("huge pages for %d of %d bytes in %.2f s", done, asked, time.monotonic() - started)
