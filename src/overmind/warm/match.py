"""A run's child takes on its caller's traits, or says why it cannot.

    take_on(Traits.from_wire(spec.traits))     # in the child, right after the fork; CannotMatch: go plain

Note [A hand-over is the same process or none]
(ARCHITECTURE.md, invariant 15: A hand-over is the same process or none.) A warm interpreter
was started by the server, so a child forked from it has the server's cgroups, limits,
scheduling and credentials, not those of the process that asked for the run. Before any of
the run's code, the child takes on the caller's (``overmind.shared.process.traits``):
- its cgroup in every hierarchy, by writing its pid to that cgroup's ``cgroup.procs``, so the
  run's memory and CPU are counted where the user's limits are;
- its resource limits (``setrlimit``), nice value, scheduling policy and CPU affinity, in that
  order, after the cgroup, whose cpuset bounds the affinity;
- ``no_new_privs``, which may be set and never cleared.
Then it reads its own traits again and compares them with the caller's, field by field. What
no process can take on makes the comparison fail: other uids, gids or groups, another
namespace of any kind, other seccomp filters, a limit the kernel will not raise. So does a
finite address-space or data limit (RLIMIT_AS, RLIMIT_DATA): the child's address space
already holds the warm interpreter's imports, which a fresh process would not have mapped,
so the same limit would not bind the same way. Where anything differs the child writes why
to the interpreter and exits before the caller is told it started; the caller then runs the
script in its own process (Note [When a warm start applies] in overmind.client.warm_start), and
the server logs the reason once per context. The OOM score is matched before the fork
(Note [The cache dies first] in overmind.warm.oom).
"""

from __future__ import annotations

import os
import resource

from overmind.shared.settings.host_memory import below_mount, cgroup_mounts
from overmind.shared.process.traits import RLIMITS, Traits, differences
from overmind.warm.oom import CannotMatch

__all__ = ["take_on", "CannotMatch", "cgroup_procs_file"]

_PR_SET_NO_NEW_PRIVS = 38


def take_on(caller: Traits) -> None:
    """Make this process the caller's, or raise CannotMatch naming every difference left."""
    for name in ("as", "data"):
        soft = caller.rlimits.get(name, (resource.RLIM_INFINITY,))[0]
        if soft != resource.RLIM_INFINITY:
            raise CannotMatch(f"the caller's RLIMIT_{name.upper()} is {soft} bytes: it would count the warm "
                              "interpreter's mappings too")
    have = Traits.own()
    if set(caller.cgroups) != set(have.cgroups):
        _join_cgroups(caller.cgroups, have.cgroups)
    for name, (soft, hard) in caller.rlimits.items():
        if have.rlimits.get(name) != (soft, hard) and name in RLIMITS:
            _quietly(resource.setrlimit, RLIMITS[name], (soft, hard))
    if have.nice != caller.nice:
        _quietly(os.setpriority, os.PRIO_PROCESS, 0, caller.nice)
    if (have.policy, have.priority) != (caller.policy, caller.priority):
        _quietly(os.sched_setscheduler, 0, caller.policy, os.sched_param(caller.priority))
    if tuple(sorted(os.sched_getaffinity(0))) != caller.affinity:
        _quietly(os.sched_setaffinity, 0, caller.affinity)
    if caller.no_new_privs and not have.no_new_privs:
        _set_no_new_privs()
    left = differences(caller, Traits.own())
    if left:
        raise CannotMatch("the warm child cannot match its caller: " + "; ".join(left))


def _quietly(call, *args) -> None:
    """A refusal shows as a difference when the traits are compared again."""
    try:
        call(*args)
    except (OSError, ValueError):
        pass


def cgroup_procs_file(line: str, root: str = "/") -> str | None:
    """The ``cgroup.procs`` file of one ``/proc/self/cgroup`` line, found through our mounts; None
    if no mount of ours shows that cgroup."""
    hierarchy, controllers, path = line.split(":", 2)
    wanted = set(filter(None, controllers.split(",")))
    for mount in cgroup_mounts(root):
        if hierarchy == "0" and not wanted:
            if mount.fstype != "cgroup2":
                continue
        elif mount.fstype != "cgroup" or not wanted <= set(mount.superopts):
            continue
        parts = below_mount(path, mount.root)
        if parts is None:
            continue
        folder = os.path.join(root, mount.point.lstrip("/"), *parts)
        if os.path.isdir(folder):
            return os.path.join(folder, "cgroup.procs")
    return None


def _join_cgroups(want: tuple, have: tuple) -> None:
    for line in sorted(set(want) - set(have)):
        target = cgroup_procs_file(line)
        if target is not None:
            # Not O_CREAT: a cgroup.procs that vanished (the cgroup was removed) must not become a file.
            _quietly(_write_pid, target)


def _write_pid(path: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, b"0")  # "0" is the writer itself
    finally:
        os.close(fd)


def _set_no_new_privs() -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
