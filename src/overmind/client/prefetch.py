"""Client side of a program's head start: map what it loaded last time, and teach the server
what it imports, while its main thread is still importing.

    server_pid, entries = plan(conn)     # monkey_patch_all()'s background thread, then
    background(config, server_pid, entries)
    take(dev, ino, size)            # overmind.client.connection, when a hit maps its segments
    loading()                       # overmind.api, as the first load call begins
    program_id()                    # sent with every Load (Note [Prefetch])

Note [Prefetch]
A patched script spends seconds importing torch and its libraries before its first load, on
one core. Meanwhile a background thread asks the server what this *program* (the script or
``-m`` module's path, the cwd and the interpreter: ``program_id``) loaded in its previous
process (``Prefetch``; the server keeps the keys of each program's last process, in order:
overmind.server.programs), opens those entries' segments through ``/proc/<server>/fd`` with the
identity check of every open (Note [A segment is opened by identity] in overmind.client.connection),
maps each ``MAP_PRIVATE`` as a hit would, and fills its page tables with
``MADV_POPULATE_READ`` (with the GIL released: ctypes drops it around the call; in chunks of
POPULATE_CHUNK, as each call holds the address space's lock, and the main thread's own mmaps,
which import does for every extension module and large allocation, wait for it; so populating
waits for ``import torch`` to end, the import that maps most: populating during it made torch's
import slower; opening, mapping and reading back, below, do not wait). A mapping counts as
prepared once it is mapped: a load that comes first takes it unpopulated and faults in what it
uses. When the load call comes, the server's answer names each segment by (device, inode, size);
a prepared mapping of that very file is used instead of a new one (the mapping holds the file
open, so that identity cannot be reused while it exists), and each prepared mapping is used at
most once, so two loads in one process still get two mappings (ARCHITECTURE.md, invariant 1:
Immutable cache). A mapping the answer does not name is never used; those left over are closed
after LEFTOVER_SECONDS.
It is a head start only: once the first load call begins it maps nothing more (a forked
``overmind run`` child loads within milliseconds, and two threads faulting the same pages only
get in each other's way); a mapping it finished is still used. Bounded by what the program
loaded last time and by OVERMIND_MAX_MEMORY; nothing happens without history, over
SCM_RIGHTS-only servers, or for ``-c`` and the interactive prompt. The
thread is a daemon (it never delays the exit) and a forked child forgets what it prepared.

Note [Reading back a lost file]
A segment can be the model file itself (Note [File-backed segments] in overmind.shared.segments.memfd),
and the page cache can lose its pages before the server copied them into sealed memory (Note
[Settling file segments] in overmind.server.settle): another workload needed the memory. The hit
then reads them from disk on the main thread as plain python would, at first use. So the same
thread, for each segment it opens, reads a file segment the page cache lost (less than RESIDENT
of it there, ``cachestat``) whole, at once, not waiting for torch's import (it maps nothing), on
the core the imports leave idle: into one reused buffer named READ_BACK_VECTORS times per
``preadv``, so the GIL is released for up to 2 GiB at a time, not taken back after every buffer
(each take waits out the importing main thread's switch interval; Segment.read_back). The server
leaves such a file to the client for a while rather than copy it into sealed memory meanwhile,
which read the same disk at the same time (Note [Settling file segments]). Reading with the CPU
rather than ``sendfile`` to /dev/null matters on this VM: the first touch of memory the
hypervisor took back costs about as much as the disk read, and ``POSIX_FADV_WILLNEED`` reads
only the readahead window. It goes on past the first load call (the loads' first use needs the
pages too), within the same budget. ``overmind-bench --scenarios warmup_curve --drop-page-cache``
measures it: run 2 with the model's files evicted before every run.

Note [Teaching the interpreter while importing]
In a program's first run with this server (no history for it), the same thread tells the
server, every REPORT_INTERVAL while the script imports, once more as its first load begins, and
on through its loads until no module came for REPORT_QUIET intervals, which modules it has
imported since it last said (``Prepare.modules``; the names only: see ``new_module_names``).
Its loads import too: transformers imports a model's own module inside ``from_pretrained`` (1.3
s of the LM's first plain load), and its fill forks once the interpreter holds it (Note [Cold
fills wait for their caller] in overmind.server.fills). Told only when that load had returned,
the interpreter imported it then, and ``overmind run``'s run 2 of the LM in the minimal venv
found the fill forked 0.9 s after run 1's load and loaded plainly beside it (0.17 x plain);
told while it loads, 0.7 s, and run 2 took 0.14-0.15 x (``benchmarks/real_envs.sh minimal``),
still beside the fill: that interpreter starts with run 1 and imports what it did. A program
with history taught them when it first ran, and reporting would slow a warm run's imports. The
context's warm interpreter imports them too, on the core this script leaves idle, so the cache
fills that the first load starts fork from an interpreter that already holds diffusers or
transformers, and the next ``overmind run`` of the script finds everything imported (Note [Warm
interpreters learn] in overmind.warm.interpreter).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

from overmind.shared.process import teardown

TYPE_CHECKING = False
if TYPE_CHECKING:
    import mmap

    from overmind.shared.settings.config import Config

logger = logging.getLogger(__name__)

__all__ = ["plan", "background", "take", "loading", "program_id", "populate", "report_imports"]

MADV_POPULATE_READ = 22  # linux/mman.h, Linux 5.14
POPULATE_CHUNK = 32 << 20  # bytes per madvise call: Note [Prefetch]
REPORT_INTERVAL = 0.25
REPORT_FOR = 120.0  # seconds: a script still importing after this is not in a hurry
REPORT_QUIET = 8  # intervals without a new module, once loading began, after which reporting ends
LEFTOVER_SECONDS = 60.0

_lock = threading.Lock()
_prepared: dict[tuple[int, int, int], list] = {}  # (st_dev, st_ino, size) -> mappings not yet used
_first_load = threading.Event()
teardown.wake_at_exit(_first_load)  # Note [Our threads end before the teardown] in overmind.shared.process.teardown
# segments this process prepared, those a load used, and bytes of lost files it read back
stats = {"prepared": 0, "used": 0, "read_back": 0}
_program: "str | None" = None


def program_id() -> str:
    """Who is loading, as Note [Prefetch] names it; "" for ``-c`` and the prompt."""
    global _program
    if _program is None:
        from overmind.shared.protocol.contexts import program_of

        _program = program_of(sys.argv[0] if sys.argv else "", os.getcwd())
    return _program


def take(dev: int, ino: int, size: int) -> "mmap.mmap | None":
    """A prepared mapping of the segment (dev, ino) of ``size`` bytes, once; else None."""
    with _lock:
        found = _prepared.get((dev, ino, size))
        if not found:
            return None
        stats["used"] += 1
        return found.pop()


def loading() -> None:
    """The first load call begins: one last report of the imports (Note [Teaching the interpreter
    while importing])."""
    _first_load.set()


def populate(mapping: "mmap.mmap", stop: "threading.Event | None" = None) -> bool:
    """Fill the page tables of ``mapping`` (MADV_POPULATE_READ) without holding the GIL, one
    POPULATE_CHUNK at a time (Note [Prefetch]: the main thread's own mmaps wait while a call holds
    the address space); False if the kernel refused or ``stop`` was set first."""
    import ctypes

    libc = _libc()
    if libc is None:
        return False
    anchor = ctypes.c_char.from_buffer(mapping)
    try:
        address = ctypes.addressof(anchor)
    finally:
        del anchor  # an exported buffer would keep the mapping from being closed
    for start in range(0, len(mapping), POPULATE_CHUNK):
        if stop is not None and stop.is_set():
            return False
        length = min(POPULATE_CHUNK, len(mapping) - start)
        if libc.madvise(ctypes.c_void_p(address + start), ctypes.c_size_t(length), MADV_POPULATE_READ) != 0:
            return False
    return True


_libc_handle = None


def _libc():
    global _libc_handle
    if _libc_handle is None:
        import ctypes

        try:
            _libc_handle = ctypes.CDLL(None, use_errno=True)
            _libc_handle.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        except (OSError, AttributeError):
            _libc_handle = False
    return _libc_handle or None


def _forget_in_child() -> None:
    global _lock
    _lock = threading.Lock()
    _prepared.clear()  # the parent's thread filled them; the child starts as a plain process would
    stats.update(prepared=0, used=0, read_back=0)


os.register_at_fork(after_in_child=_forget_in_child)


def plan(conn) -> tuple[int, list]:
    """(server pid, [[key, segment handles], ...]): what this program loaded last time."""
    from overmind.shared import protocol as P
    from overmind.shared.protocol.contexts import in_warm_run

    program = program_id()
    if not program or conn.proc_pid is None:
        return 0, []
    reply = conn.simple(P.Prefetch(program, importing=not in_warm_run()), P.PrefetchReply)
    return reply.server_pid, reply.entries


def prepare(server_pid: int, entries: list, budget: int) -> int:
    """Map and populate the segments of ``entries`` (from :func:`plan`); the bytes prepared."""
    from overmind.shared.segments.memfd import Segment

    done = 0
    unpopulated: list = []  # (segment identity, mapping): mapped, page tables not yet filled
    for key, handle in ((key, handle) for key, handles in entries for handle in handles if handle is not None):
        fd, size, dev, ino = handle
        if done + size > budget or teardown.exiting():
            break
        mapping = None
        try:
            with Segment.open_proc(server_pid, fd, size, f"{key[:12]}.prefetch", identity=(dev, ino)) as seg:
                stats["read_back"] += seg.read_back()  # Note [Reading back a lost file]
                if not _first_load.is_set():  # else the loads map what they need themselves
                    mapping = seg.map_private()
        except (OSError, ValueError, Segment.Mismatch) as err:  # evicted meanwhile: the load maps its own
            logger.debug("not prefetching a segment of %s: %s", key[:16], err)
            continue
        done += size
        if mapping is None:
            continue
        with _lock:
            _prepared.setdefault((dev, ino, size), []).append(mapping)
            stats["prepared"] += 1
        unpopulated.append(((dev, ino, size), mapping))
        if not _torch_importing():  # reading back goes on while torch imports; populating waits
            _populate(unpopulated)
    _after_torch_import()
    _populate(unpopulated)
    return done


def _populate(unpopulated: list) -> None:
    """Fill the page tables of the mappings in ``unpopulated`` that no load took yet (a load
    faults in what it uses; two threads faulting the same pages get in each other's way)."""
    for identity, mapping in unpopulated:
        with _lock:
            waiting = any(m is mapping for m in _prepared.get(identity, ()))
        if waiting and not populate(mapping, _first_load):
            break
    unpopulated.clear()


def _torch_importing() -> bool:
    torch = sys.modules.get("torch")
    return torch is None or getattr(getattr(torch, "__spec__", None), "_initializing", False)


def _after_torch_import(timeout: float = 60.0) -> None:
    """Wait while torch is being imported: it maps its libraries then, and each of those mmaps
    would wait for our populate (Note [Prefetch])."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not _first_load.is_set() and _torch_importing():
        time.sleep(0.02)


def background(config: "Config", server_pid: int, entries: list) -> None:
    """The rest of monkey_patch_all()'s background thread, once its connection is handed on.
    Reporting imports needs a plain connection (overmind.shared.protocol.connect), not the loading one of
    overmind.client.connection, which takes from this module."""
    from overmind.shared.protocol.connect import Connection
    from overmind.shared.protocol.contexts import in_warm_run

    try:
        started = time.monotonic()
        budget = config.max_memory or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
        done = prepare(server_pid, entries, budget) if entries else 0
        logger.debug("prefetched %d bytes in %.3f s", done, time.monotonic() - started)
        if not entries and not in_warm_run():  # a program with history taught its imports when it ran
            # first; a forked run's interpreter learns them from the run's report at exit
            with Connection.open(config, autostart=False) as conn:
                report_imports(conn)
    except Exception as err:  # noqa: BLE001 - a head start only; the loads do it all themselves
        logger.debug("prefetch stopped: %s", err)
    if _prepared and not teardown.pause(LEFTOVER_SECONDS):
        close_leftovers()


def new_module_names(seen: set) -> list:
    """Names in sys.modules not in ``seen`` (which this adds them to), in import order. No
    filtering here: telling installed modules from the user's takes a few syscalls per module,
    and each syscall of this thread hands the GIL back and forth with the main thread while it
    imports; the warm interpreter imports only installed modules anyway (``_installed`` in
    overmind.warm.interpreter)."""
    new = [name for name in list(sys.modules) if name not in seen and name not in ("__main__", "__mp_main__")]
    seen.update(new)
    return new


def report_imports(conn) -> None:
    """Note [Teaching the interpreter while importing]."""
    from overmind.shared import protocol as P
    from overmind.shared.protocol.contexts import caller_context

    seen: set = set()
    deadline = time.monotonic() + REPORT_FOR
    count, quiet = -1, 0
    while time.monotonic() < deadline and quiet < REPORT_QUIET:
        if not _first_load.is_set():
            _first_load.wait(REPORT_INTERVAL)  # wakes at once as the first load begins, or the process leaves
        else:
            teardown.pause(REPORT_INTERVAL)
        if teardown.exiting():
            return
        if len(sys.modules) != count:
            count, quiet = len(sys.modules), 0
            new = new_module_names(seen)
            if new:
                conn.simple(P.Prepare(caller_context(), modules=new), P.Ok)
        elif _first_load.is_set():
            quiet += 1


def close_leftovers() -> None:
    with _lock:
        left = [m for maps in _prepared.values() for m in maps]
        _prepared.clear()
    for mapping in left:
        mapping.close()
