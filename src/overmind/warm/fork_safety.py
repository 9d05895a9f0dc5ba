"""What a fork breaks, checked in a warm interpreter before each fork: the native threads
libraries started, judged by evidence, and CUDA. Runs in the warm interpreter
(overmind.warm.interpreter) only::

    census = ThreadCensus()
    census.take()                                   # when ready: the threads that are its own
    with census.watching(refused, name) as watch:   # refused modules raise Refused
        importlib.import_module(name)
    census.culprits(watch)                          # modules that started threads nobody vouches for
    why = census.strangers_note() or cuda_note()    # before a fork: "" or what a child would miss

Note [Threads libraries start]
A fork copies only the calling thread; a lock another thread held stays locked in the child
for ever, and a pool the child believes it has is not there. Libraries start threads at
import, and a venv that holds scipy, pandas or a CUDA torch starts several (numpy
and scipy each load an OpenBLAS that starts its pool at load, one thread per CPU less one;
pyarrow's jemalloc starts ``jemalloc_bg_thd``). Each is judged by evidence:
- OpenBLAS's pool (pthreads build, what numpy's and scipy's wheels bundle) stops for a fork
  anyway: OpenBLAS registers ``blas_thread_shutdown_`` as a ``pthread_atfork`` prepare
  handler, and its next call in either process starts the pool again, the size it had. So
  the interpreter calls that function itself, for every OpenBLAS mapped in the process, before
  it counts threads: the pool's threads are joined and gone, and a thread still there is not
  the pool's. ``import torch`` imports numpy: the one thread ``import torch`` was seen to
  start is this pool's, on a 2-CPU machine. A child's pool, started at its first BLAS call,
  has the size plain python's has (``OPENBLAS_*`` and ``OMP_*`` select the interpreter:
  Note [Environment that selects an interpreter] in overmind.shared.settings.config).
- jemalloc's background thread (``jemalloc_bg_thd``) is forked past: jemalloc's own fork
  handlers take its locks before the fork and reset them after, and the child runs with
  background threads off (the one way it differs from plain, in how freed memory is purged).
- NVML: the interpreter's imports ask whether CUDA is there (Note [Warm interpreters never touch
  CUDA] in overmind.server.pool), and NVML starts a driver thread that outlives ``nvmlShutdown``
  (seen on an H200 and an H100, benchmarks/gpu_check.sh). So torch's NVML questions are answered
  by a process of their own (Note [NVML answered from outside] in overmind.warm.devices), and an
  NVML that a library started itself is still shut down (``nvmlShutdown`` until it says it is
  not running) before threads are counted.
- Anything else (a CUDA driver thread, a library's timer, a Python thread) is a stranger:
  the interpreter will not fork past it. The module whose import started it is blamed
  (:class:`Watch`) and refused, so the context's next interpreter does not import it: a
  refused module raises :class:`Refused` (a ``BaseException``, so no ``except ImportError``
  keeps a half-imported caller) and whatever imports it is refused with it; a run's child
  imports them itself, as plain python would. tests/integration/test_real_envs.py forks past
  each known pool and computes in the child.

Blame is the module being loaded when the thread appeared: the last one found (an extension
whose library started the thread as it loaded, before its own imports) while it is still
loading, else the innermost module whose code is running. A thread started by the last lines
of a module that nothing follows is blamed on the module being imported from the top.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import threading
import time

from overmind.warm import devices

__all__ = ["ThreadCensus", "Watch", "Refused", "thread_ids", "thread_names", "started_since", "own_threads",
           "stop_openblas_pools", "stop_pools", "cuda_note", "FORK_SAFE"]

# Threads a library starts whose fork handling was read and tested (Note [Threads libraries start]).
FORK_SAFE = {"jemalloc_bg_thd": "jemalloc's background thread (its fork handlers take its locks)"}

_openblas: dict[str, object] = {}  # library path -> its blas_thread_shutdown_, or None


class Refused(BaseException):
    """Raised by the import of a module this context's interpreters keep out (Note [Threads
    libraries start]); a BaseException, so that the module importing it fails too."""


def thread_ids() -> frozenset[str]:
    return frozenset(os.listdir("/proc/self/task"))


def thread_names(ids) -> list[str]:
    names = []
    for tid in sorted(ids):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            pass  # it ended meanwhile
    return names


def stop_pools() -> int:
    """Stop what stops for a fork anyway, or holds nothing once stopped: OpenBLAS's pools and
    NVML (Note [Threads libraries start]); how many were stopped."""
    mapped = _mapped_libraries()  # one read of /proc/self/maps for both
    return stop_openblas_pools(mapped) + stop_nvml(mapped)


def stop_nvml(mapped: set[str]) -> int:
    """Shut NVML down where it was started (torch's NVML-based CUDA check starts it and never
    stops it, once per call): its threads end, and a later ``nvmlInit`` in a child starts it
    afresh. 1 if it was running. ``mapped``: the libraries this process maps."""
    if not _named(mapped, "libnvidia-ml.so"):
        return 0
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1", mode=os.RTLD_NOLOAD)
    except OSError:
        return 0
    calls = 0
    while calls < 10000 and nvml.nvmlShutdown() == 0:  # NVML_ERROR_UNINITIALIZED once the last init is undone
        calls += 1
    return 1 if calls else 0


def stop_openblas_pools(mapped: set[str]) -> int:
    """Stop the thread pool of every OpenBLAS among ``mapped`` (the libraries this process maps),
    as its atfork handler does; the number stopped."""
    stopped = 0
    for path in _named(mapped, "openblas"):
        if path not in _openblas:
            try:
                _openblas[path] = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LOCAL).blas_thread_shutdown_
            except (OSError, AttributeError):
                _openblas[path] = None  # an OpenMP build, or another library: its threads are judged as any
        shutdown = _openblas[path]
        if shutdown is not None:
            shutdown()
            stopped += 1
    return stopped


def _mapped_libraries() -> set[str]:
    """The shared libraries this process maps, by path."""
    found = set()
    with open("/proc/self/maps") as f:
        for line in f:  # address perms offset dev inode path: a path may hold spaces
            fields = line.split(None, 5)
            path = fields[5].rstrip("\n") if len(fields) == 6 else ""
            if path.startswith("/") and ".so" in os.path.basename(path):
                found.add(path)
    return found


def _named(paths: set[str], word: str) -> list[str]:
    return sorted(p for p in paths if word in os.path.basename(p))


def started_since(before: frozenset[str]) -> frozenset[str]:
    """Threads not in ``before`` that a child forked now would miss: OpenBLAS's pools stopped
    first, fork-safe ones and those ending left out (Note [Threads libraries start])."""
    stopped = stop_pools()
    deadline = time.monotonic() + 0.5
    while True:
        left = _strangers(before)
        # A joined thread stays listed a moment while it exits: the pools just stopped.
        if not left or not stopped or time.monotonic() > deadline:
            return left
        time.sleep(0.002)


def _strangers(before: frozenset[str] = frozenset()) -> frozenset[str]:
    """The threads running now, not in ``before``, that nobody vouches for (``_judged``)."""
    return frozenset(t for t in thread_ids() - before if _judged(t) == "stranger")


def own_threads() -> frozenset[str]:
    """The threads that are no pool's, once OpenBLAS's pools are stopped: what a ready
    interpreter counts as its own (``ThreadCensus.take``). A pool's joined thread may stay listed
    a moment while it exits, so the threads are counted again until two counts 2 ms apart agree;
    waiting instead for no stranger to be left, as :func:`started_since` does, waited its whole
    0.5 s here, the main thread being one, and made every interpreter ready 0.5 s later."""
    stopped = stop_pools()
    now = _strangers()
    deadline = time.monotonic() + 0.5
    while stopped and time.monotonic() < deadline:
        time.sleep(0.002)
        again = _strangers()
        if again == now:
            break
        now = again
    return now


def cuda_note() -> str:
    """Why CUDA makes a fork unsafe now, or "" (Note [Warm interpreters never touch CUDA] in
    overmind.server.pool). Where libcuda is mapped, ``cuDeviceGetCount`` answers
    CUDA_ERROR_NOT_INITIALIZED (3) only while ``cuInit`` never ran in this process."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA was initialised here (Note [Warm interpreters never touch CUDA] in overmind.server.pool)"
    for path in _named(_mapped_libraries(), "libcuda.so"):
        try:
            count = ctypes.c_int()
            answer = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LOCAL).cuDeviceGetCount(ctypes.byref(count))
        except (OSError, AttributeError):
            continue
        if answer != 3:
            return (f"the CUDA driver was initialised here ({os.path.basename(path)}: cuDeviceGetCount answered "
                    f"{answer}); Note [Warm interpreters never touch CUDA] in overmind.server.pool")
    return ""


class ThreadCensus:
    """The interpreter's own threads, and the judgement of any other."""

    def __init__(self) -> None:
        self.own: frozenset[str] = frozenset()

    def take(self) -> None:
        """When ready: what is running now, pools that stop for a fork stopped first, is its own."""
        self.own = own_threads()

    def strangers(self) -> frozenset[str]:
        """Threads started since :meth:`take` that a child forked now would miss."""
        return started_since(self.own)

    def culprits(self, watch: "Watch") -> dict[str, list[str]]:
        """The modules whose import, under ``watch``, started a stranger: {module: thread names}."""
        if not watch.blamed:
            return {}
        strangers = self.strangers()  # a stranger older than the watch is another import's, already blamed
        found = {m: ids & strangers for m, ids in watch.blamed.items() if ids & strangers}
        return {m: thread_names(ids) for m, ids in found.items()}

    def strangers_note(self) -> str:
        if threading.active_count() != 1:
            return f"{threading.active_count() - 1} Python thread(s) running (Note [Threads libraries start])"
        strangers = self.strangers()
        if not strangers:
            return ""
        return (f"{len(strangers)} native thread(s) nobody vouches for ({', '.join(thread_names(strangers))}) "
                "were started since it was ready; a child forked past them could hang "
                "(Note [Threads libraries start] in overmind.warm.fork_safety)")

    @contextlib.contextmanager
    def watching(self, refused: set[str], top: str):
        """Import under watch: ``refused`` modules raise :class:`Refused`, and a thread started
        by a module is blamed on it (Note [Threads libraries start])."""
        watch = Watch(refused, top, thread_ids())
        sys.meta_path.insert(0, watch)
        try:
            with _cuda_refused():
                yield watch
        finally:
            with contextlib.suppress(ValueError):
                sys.meta_path.remove(watch)
            watch.look(end=True)


# torch's calls that initialise CUDA (torch.cuda._lazy_init, and device_count() where NVML cannot
# answer): while a warm interpreter imports, each raises Refused (Note [Warm interpreters never
# touch CUDA] in overmind.server.pool), so the module whose import would have made it is kept out
# and a run imports it itself; anywhere else, a child included, each is the original.
_CUDA_CALLS = ("_cuda_init", "_cuda_getDeviceCount")
_importing = False


@contextlib.contextmanager
def _cuda_refused():
    global _importing
    torch = sys.modules.get("torch")
    torch_c = getattr(torch, "_C", None)
    for name in _CUDA_CALLS:
        original = getattr(torch_c, name, None)
        if original is not None and not getattr(original, "_overmind_guard", False):
            setattr(torch_c, name, _guarded(name, original))
    cuda = getattr(torch, "cuda", None)
    answers = [("_raw_device_count_nvml", devices.raw_count), ("_raw_device_uuid_nvml", devices.raw_uuids)]
    if hasattr(torch_c, "_cuda_getDeviceCount"):
        answers.append(("get_device_capability", _capability))
    for name, answer in answers:
        original = getattr(cuda, name, None)
        if original is not None and not getattr(original, "_overmind_guard", False):
            setattr(cuda, name, _answered_outside(original, answer))
    _importing = True
    try:
        yield
    finally:
        _importing = False


def _capability(device=None) -> tuple[int, int]:
    """``torch.cuda.get_device_capability``'s answer while a warm interpreter imports, from NVML,
    from outside (a device's compute capability is the hardware's: the answer is the one CUDA
    would give), so that an import that sizes itself by it (bitsandbytes picks its native
    library so) needs no CUDA. What NVML cannot answer raises Refused."""
    import torch

    try:
        index = torch.cuda._get_nvml_device_index(0 if device is None else device)
    except Exception as err:  # noqa: BLE001 - whatever NVML cannot say keeps the module out
        raise Refused(f"torch.cuda.get_device_capability() without CUDA: {err}") from None
    found = devices.capability(index)
    if found is None:
        raise Refused(f"NVML cannot tell device {index}'s compute capability")
    return found


def _answered_outside(original, answer):
    """One of torch's NVML questions (device count, UUIDs, compute capability), answered by
    overmind.warm.devices while a warm interpreter imports (Note [NVML answered from outside]
    there); anywhere else, the original."""

    def asked(*args, **kwargs):
        return answer(*args, **kwargs) if _importing else original(*args, **kwargs)

    asked._overmind_guard = True
    asked.__name__ = asked.__qualname__ = original.__name__
    asked.__doc__ = original.__doc__
    return asked


def _guarded(name: str, original):
    def guard(*args, **kwargs):
        if _importing:
            raise Refused(f"torch._C.{name}() would initialise CUDA in a warm interpreter")
        return original(*args, **kwargs)

    guard._overmind_guard = True
    guard.__name__ = guard.__qualname__ = name
    guard.__doc__ = getattr(original, "__doc__", None)
    return guard


def _judged(tid: str) -> str:
    """"gone" (ended or ending), "safe" (FORK_SAFE) or "stranger"."""
    try:
        with open(f"/proc/self/task/{tid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
        with open(f"/proc/self/task/{tid}/comm") as f:
            name = f.read().strip()
    except (OSError, IndexError):
        return "gone"
    if state in ("X", "Z"):
        return "gone"
    return "safe" if name in FORK_SAFE else "stranger"


class Watch:
    """A finder first on ``sys.meta_path`` while the interpreter imports: it finds nothing
    itself; it refuses the refused and notes, at each module found, which threads appeared
    since the last one and who started them."""

    def __init__(self, refused: set[str], top: str, seen: frozenset[str]) -> None:
        self.refused = refused
        self.top = top
        self.seen = seen
        self.last = ""  # the last module found
        self.blamed: dict[str, set[str]] = {}  # module -> thread ids it started

    def find_spec(self, name, path=None, target=None):
        if name in self.refused:
            raise Refused(f"{name} is kept out of this warm interpreter (Note [Threads libraries start])")
        self.look()
        self.last = name
        return None

    def look(self, end: bool = False) -> None:
        now = thread_ids()
        new = now - self.seen
        self.seen = now
        if new:
            self.blamed.setdefault(self._culprit(end), set()).update(new)

    def _culprit(self, end: bool) -> str:
        module = sys.modules.get(self.last)
        spec = getattr(module, "__spec__", None)
        if self.last and (module is None or getattr(spec, "_initializing", False)):
            return self.last  # still loading: an extension's library started it as it loaded
        if end:
            return self.top
        frame = sys._getframe(2)
        while frame is not None:
            if frame.f_code.co_name == "<module>":
                name = frame.f_globals.get("__name__")
                if isinstance(name, str) and name in sys.modules:
                    return name
            frame = frame.f_back
        return self.top
