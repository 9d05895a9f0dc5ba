"""Leaving the process: what a teardown must not skip, and nothing more. Stdlib only.

    teardown.leave_quickly()            # monkey_patch_all(): Note [The drop-in leaves quickly]
    teardown.flush_left_open(skip_ids)  # overmind.warm.script: Note [Output is never lost at exit]
    teardown.start_thread(loop, "overmind-x")  # Note [Our threads end before the teardown]
    teardown.wake_at_exit(event)        # an event such a thread waits on: set as the process leaves
    if teardown.pause(0.25): return     # in such a thread: sleep, True once the process leaves

Note [The drop-in leaves quickly]
A python that imported torch, diffusers and transformers spends a second or more between the
script's last line and its exit, almost all of it in the interpreter's own teardown, where the
cycle collector walks and frees the millions of objects those libraries made (a module's functions
and its globals are a cycle, so every module dies by the collector). The user waits for it on
every run, plain or cached; it was as much as the cache saved on the loads. So
``monkey_patch_all()`` registers an atexit callback (then: so it runs after every callback
registered later, which is nearly all of them) that does what the teardown must not skip and
lets the rest go:

- ``gc.collect()``: every cycle that is garbage now is collected and its finalizers run, as
  the teardown would have run them;
- every file object still open is flushed (Note [Output is never lost at exit]);
- ``gc.freeze()``: what is still alive moves to the permanent generation. The teardown still
  runs the atexit callbacks registered earlier and releases every module's globals, so what
  dies by its reference count dies as in plain python (its ``__del__`` runs), but the
  collector no longer walks or frees the old objects: the kernel takes their memory back at
  once.

The exit status, the atexit callbacks and the output are plain python's. What is not: the
finalizers of objects that only become cyclic garbage during the teardown itself do not run
(CPython does not promise them either: "It is not guaranteed that __del__() methods are
called for objects that still exist when the interpreter exits"); their files were flushed
above. What is left to pay is the collection, the sweep for open files and the rest of the
teardown. ``OVERMIND_QUICK_EXIT=0`` turns it off. Runs of ``overmind run`` leave through
``overmind.warm.script._finalize`` instead, which skips the teardown altogether.

Note [Output is never lost at exit]
Skipping (part of) the teardown skips where a fresh python closes what is still open. So
every text file is flushed, then every buffered binary file (text first: its pending text
lands in its buffer). Objects in the permanent generation are not looked at: in a run forked
from a warm interpreter they are the interpreter's, not the run's.

Note [Our threads end before the teardown]
The client's background threads (the drop-in's prefetch and import reports, the first run's
import reports) are daemon threads that sleep and wake on their own. A daemon thread that wakes
while the interpreter finalizes reaches for the GIL through thread states the teardown has
freed already: CPython can then write into freed memory (python/cpython#110052, reproduced on
3.9 to 3.12; #124878 reworked how thread states are freed, for 3.14). A client run in the test suite aborted so at exit, once, with
"malloc_consolidate(): invalid chunk size" after printing its correct result. So every such
thread is started by ``start_thread``, whose atexit callback (registered as the first starts:
at ``monkey_patch_all()``, or before the first run's script, so it runs after the script's own
callbacks) wakes each (``pause`` and the events of ``wake_at_exit``) and joins them, for
JOIN_FOR seconds in all: a woken loop ends in microseconds, a request to the server in a
millisecond; only a thread inside a long system call (reading back a lost model file) can
outlast the bound, and the process then exits as it would have before. The price is paid by a
script that leaves as soon as it called ``monkey_patch_all()`` (``--help``): its exit waits for
that thread's own imports, 21-31 ms here. The thread registers its event only once it imported
``overmind.client.prefetch``, after the exit's wake pass, so ``wake_at_exit`` sets an event
registered late at once (without that, such an exit waited all of JOIN_FOR); and it checks
``exiting()`` before it talks to the server. A script that imports torch exits 0.2-0.6 ms later.
"""

from __future__ import annotations

import atexit
import gc
import io
import itertools
import os
import threading
import time

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (monkey_patch_all()'s start-up)
if TYPE_CHECKING:
    from typing import Callable

__all__ = ["exit_handled_elsewhere", "exiting", "flush_left_open", "leave_quickly", "pause", "start_thread",
           "wake_at_exit"]

JOIN_FOR = 0.25  # seconds the process waits at exit for its background threads, all together

_registered = False
_lock = threading.Lock()
_exiting = threading.Event()
_threads: list[threading.Thread] = []  # this process's, started by start_thread
_wake: list[threading.Event] = []  # set as the process leaves (kept across a fork: the objects stay)
_threads_registered = False  # the atexit callback that ends them


def start_thread(target: Callable[[], None], name: str) -> threading.Thread:
    """Start ``target`` on a daemon thread that ends before the interpreter's teardown (Note [Our
    threads end before the teardown]): it must return soon once ``exiting()``."""
    global _threads_registered
    thread = threading.Thread(target=target, daemon=True, name=name)
    with _lock:
        if not _threads_registered:
            atexit.register(_end_threads)
            _threads_registered = True
    thread.start()  # first: a thread that could not start is never joined
    with _lock:
        _threads.append(thread)
    return thread


def wake_at_exit(event: threading.Event) -> None:
    """``event``, which a thread of ``start_thread`` waits on, is set as the process leaves."""
    with _lock:
        _wake.append(event)
    if _exiting.is_set():  # registered after the exit's wake pass (a thread still importing then): now
        event.set()


def exiting() -> bool:
    """Is the process leaving (its atexit callbacks run)? A background thread's loops stop then."""
    return _exiting.is_set()


def pause(seconds: float) -> bool:
    """Sleep ``seconds`` on a background thread, less if the process leaves; True if it does."""
    return _exiting.wait(seconds)


def _end_threads() -> None:
    _exiting.set()
    with _lock:
        threads, wake = list(_threads), list(_wake)
    for event in wake:
        event.set()
    deadline = time.monotonic() + JOIN_FOR
    for thread in threads:
        if thread is not threading.current_thread():
            thread.join(max(0.0, deadline - time.monotonic()))


def _forget_in_child() -> None:
    """A forked child has none of its parent's threads, and leaves when it leaves."""
    global _lock, _exiting
    _lock = threading.Lock()
    _exiting = threading.Event()
    _threads.clear()


os.register_at_fork(after_in_child=_forget_in_child)


def flush_left_open(skip: set = frozenset()) -> None:
    """Flush every file object still open (Note [Output is never lost at exit]), but those
    whose ``id`` is in ``skip``."""
    text_kinds = _subclasses(io.TextIOWrapper)
    kinds = text_kinds | _subclasses(io.BufferedWriter, io.BufferedRandom)
    objects = gc.get_objects()
    # type(), not isinstance(), which reads __class__ (some proxies warn on it); the scan stays in
    # C: a Python loop over the 560,000 objects a diffusers script holds took 0.17 s, this 0.11.
    files = list(itertools.compress(objects, map(kinds.__contains__, map(type, objects))))
    del objects
    texts = [f for f in files if type(f) in text_kinds]
    buffers = [f for f in files if type(f) not in text_kinds]
    for stream in texts + buffers:  # text first: its pending text lands in its buffer
        try:
            if id(stream) not in skip and not stream.closed:
                stream.flush()
        except BaseException:  # noqa: BLE001 - a fresh python would not report it either
            pass


def _subclasses(*roots: type) -> set:
    """``roots`` and every class derived from them, however deep."""
    found, todo = set(), list(roots)
    while todo:
        kind = todo.pop()
        if kind not in found:
            found.add(kind)
            todo.extend(type.__subclasses__(kind))
    return found


def leave_quickly() -> None:
    """Register the callback of Note [The drop-in leaves quickly], once per process."""
    global _registered
    with _lock:
        if not _registered:
            atexit.register(_at_exit)
            _registered = True


def exit_handled_elsewhere() -> None:
    """A run forked by ``overmind run`` leaves through overmind.warm.script's own exit: the
    callback, were it registered, would have nothing to add."""
    global _registered
    with _lock:
        if _registered:
            atexit.unregister(_at_exit)
        _registered = True


def _at_exit() -> None:
    gc.collect()
    flush_left_open()
    gc.freeze()
