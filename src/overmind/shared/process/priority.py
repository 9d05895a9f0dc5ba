"""CPU scheduling of a process and its threads, for the server (which lowers and lifts its fills)
and for a loader (which lowers itself): Note [Cold fills yield to their caller] in
overmind.server.fills. Standard library only::

    every_thread(loader_pid, to_idle)      # SCHED_IDLE, thread by thread
    if can_lift_idle():
        every_thread(loader_pid, to_normal)
"""

from __future__ import annotations

import os
import resource

__all__ = ["can_lift_idle", "every_thread", "to_idle", "to_normal"]


def can_lift_idle() -> bool:
    """May this process take a SCHED_IDLE loader back to SCHED_OTHER? (The loader inherits our
    RLIMIT_NICE, which is what the kernel checks for an unprivileged caller.)"""
    try:
        return os.geteuid() == 0 or resource.getrlimit(resource.RLIMIT_NICE)[0] >= 20
    except (OSError, ValueError):
        return False


def every_thread(pid: int, change) -> bool:
    """Apply ``change(tid)`` to every thread of ``pid`` (the policy is per thread; threads
    started meanwhile inherit it from their creator, so a few passes catch them all).
    False if the process is gone or the kernel refused."""
    done: set = set()
    for _ in range(4):
        try:
            tids = {int(t) for t in os.listdir(f"/proc/{pid}/task")} - done
        except (OSError, ValueError):
            return False
        if not tids:
            return True
        for tid in tids:
            try:
                change(tid)
            except ProcessLookupError:
                pass  # that thread ended
            except OSError:
                return False
        done |= tids
    return True


def to_idle(tid: int) -> None:
    os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))


def to_normal(tid: int) -> None:
    os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
