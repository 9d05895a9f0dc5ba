"""What makes a process the one its user started, read from ``/proc/self`` and the kernel:
ids, namespaces, cgroups, resource limits, scheduling, no_new_privs and seccomp. Standard
library only::

    caller = Traits.own()                          # the caller of a hand-over, before it asks
    spec = RunSpec(..., traits=caller.to_wire())   # it travels with the run
    differences(Traits.from_wire(spec.traits), Traits.own())   # in the run's child: [] or what differs

The run's child takes on what it may (``overmind.warm.match``) and then compares; anything that
still differs sends the run to plain python: Note [A hand-over is the same process or none] in
overmind.warm.match. Reading costs one small file per kind and a call per limit, well under a
millisecond.
"""

from __future__ import annotations

import os
import resource
from dataclasses import asdict, dataclass
from typing import Optional

__all__ = ["Traits", "differences", "tracer_pid", "status_fields", "RLIMITS", "NAMESPACES"]

# Every limit the kernel keeps per process, by the name prlimit(1) and the docs use.
# (RLIMIT_OFILE is RLIMIT_NOFILE's old name: one entry per number.)
RLIMITS = {name[len("RLIMIT_"):].lower(): number for number, name in sorted(
    {getattr(resource, n): n for n in sorted(dir(resource), reverse=True) if n.startswith("RLIMIT_")}.items())}
NAMESPACES = ("cgroup", "ipc", "mnt", "net", "pid", "pid_for_children", "time", "time_for_children",
              "user", "uts")
MAX_LINES = 64  # cgroup hierarchies on the wire
MAX_CPUS = 1 << 16  # CPUs, and supplementary groups


def status_fields(path: str = "/proc/self/status") -> dict[str, str]:
    """``Name:\\tvalue`` lines of a status file; {} when it cannot be read."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(":")
        out[name] = value.strip()
    return out


def _namespaces() -> dict[str, str]:
    found = {}
    for name in NAMESPACES:
        try:
            found[name] = os.readlink(f"/proc/self/ns/{name}")
        except OSError:
            pass  # a kernel without that namespace kind: the same for every process on it
    return found


def _cgroups() -> tuple[str, ...]:
    try:
        with open("/proc/self/cgroup", encoding="utf-8") as f:
            return tuple(line for line in f.read().splitlines() if line)
    except OSError:
        return ()


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split())


@dataclass(frozen=True)
class Traits:
    uids: tuple  # real, effective, saved, filesystem (Uid: in /proc/self/status)
    gids: tuple
    groups: tuple  # supplementary, sorted
    namespaces: dict  # name -> "net:[4026531833]"
    cgroups: tuple  # the lines of /proc/self/cgroup
    rlimits: dict  # name -> (soft, hard); -1 is unlimited (resource.RLIM_INFINITY)
    nice: int
    policy: int  # os.SCHED_*
    priority: int  # the real-time priority (0 unless SCHED_FIFO or SCHED_RR)
    affinity: tuple  # CPUs, sorted
    no_new_privs: int
    seccomp: tuple  # (mode, filters)

    @classmethod
    def own(cls) -> "Traits":
        status = status_fields()
        return cls(
            uids=_ints(status.get("Uid", "")), gids=_ints(status.get("Gid", "")),
            groups=tuple(sorted(_ints(status.get("Groups", "")))),
            namespaces=_namespaces(), cgroups=_cgroups(),
            rlimits={name: tuple(resource.getrlimit(number)) for name, number in RLIMITS.items()},
            nice=os.getpriority(os.PRIO_PROCESS, 0),
            policy=os.sched_getscheduler(0), priority=os.sched_getparam(0).sched_priority,
            affinity=tuple(sorted(os.sched_getaffinity(0))),
            no_new_privs=int(status.get("NoNewPrivs", "0") or 0),
            seccomp=(int(status.get("Seccomp", "0") or 0), int(status.get("Seccomp_filters", "0") or 0)))

    def to_wire(self) -> dict:
        wire = asdict(self)
        wire["rlimits"] = {k: list(v) for k, v in self.rlimits.items()}
        for name in ("uids", "gids", "groups", "cgroups", "affinity", "seccomp"):
            wire[name] = list(wire[name])
        return wire

    @classmethod
    def from_wire(cls, data: object) -> "Traits":
        """Validated: ValueError naming the field (Note [Frames are untrusted] in overmind.shared.protocol)."""
        if not isinstance(data, dict):
            raise ValueError("traits must be an object")

        def ints(name: str, most: int) -> tuple:
            value = data.get(name)
            if not (isinstance(value, list) and len(value) <= most
                    and all(isinstance(v, int) and not isinstance(v, bool) for v in value)):
                raise ValueError(f"traits field {name!r} must be a list of at most {most} integers")
            return tuple(value)

        def integer(name: str) -> int:
            value = data.get(name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"traits field {name!r} must be an integer")
            return value

        namespaces, cgroups, rlimits = data.get("namespaces"), data.get("cgroups"), data.get("rlimits")
        if not (isinstance(namespaces, dict) and set(namespaces) <= set(NAMESPACES)
                and all(isinstance(v, str) and len(v) < 64 for v in namespaces.values())):
            raise ValueError("traits field 'namespaces' must map namespace kinds to their links")
        if not (isinstance(cgroups, list) and len(cgroups) <= MAX_LINES
                and all(isinstance(v, str) and len(v) < 4096 for v in cgroups)):
            raise ValueError("traits field 'cgroups' must be the lines of /proc/self/cgroup")
        if not (isinstance(rlimits, dict) and set(rlimits) <= set(RLIMITS) and all(
                isinstance(v, list) and len(v) == 2 and all(isinstance(n, int) and not isinstance(n, bool)
                                                            for n in v) for v in rlimits.values())):
            raise ValueError("traits field 'rlimits' must map limit names to [soft, hard]")
        seccomp = ints("seccomp", 2)
        if len(seccomp) != 2:
            raise ValueError("traits field 'seccomp' must be [mode, filters]")
        return cls(ints("uids", 4), ints("gids", 4), ints("groups", MAX_CPUS), dict(namespaces), tuple(cgroups),
                   {k: tuple(v) for k, v in rlimits.items()}, integer("nice"), integer("policy"),
                   integer("priority"), ints("affinity", MAX_CPUS), integer("no_new_privs"), seccomp)


def _limit(value: int) -> str:
    return "unlimited" if value == resource.RLIM_INFINITY else str(value)


def differences(want: Traits, have: Traits) -> list[str]:
    """What ``have`` (this process) differs in from ``want`` (the caller), in words; [] if nothing."""
    found = []
    for name in ("uids", "gids", "groups"):
        if getattr(want, name) != getattr(have, name):
            found.append(f"{name} {list(getattr(want, name))} (here {list(getattr(have, name))})")
    for kind in sorted(set(want.namespaces) | set(have.namespaces)):
        if want.namespaces.get(kind) != have.namespaces.get(kind):
            found.append(f"the {kind} namespace {want.namespaces.get(kind)} (here {have.namespaces.get(kind)})")
    if sorted(want.cgroups) != sorted(have.cgroups):
        found.append(f"cgroups {', '.join(sorted(set(want.cgroups) - set(have.cgroups)))} "
                     f"(here {', '.join(sorted(set(have.cgroups) - set(want.cgroups)))})")
    for name in sorted(set(want.rlimits) | set(have.rlimits)):
        a, b = want.rlimits.get(name), have.rlimits.get(name)
        if a != b:
            show = lambda v: "?" if v is None else f"{_limit(v[0])}:{_limit(v[1])}"  # noqa: E731
            found.append(f"RLIMIT_{name.upper()} {show(a)} (here {show(b)})")
    if want.nice != have.nice:
        found.append(f"nice {want.nice} (here {have.nice})")
    if (want.policy, want.priority) != (have.policy, have.priority):
        found.append(f"scheduling policy {want.policy} priority {want.priority} "
                     f"(here {have.policy} priority {have.priority})")
    if want.affinity != have.affinity:
        found.append(f"CPU affinity {_cpus(want.affinity)} (here {_cpus(have.affinity)})")
    if want.no_new_privs != have.no_new_privs:
        found.append(f"no_new_privs {want.no_new_privs} (here {have.no_new_privs})")
    if want.seccomp != have.seccomp:
        found.append(f"seccomp mode {want.seccomp[0]} with {want.seccomp[1]} filters "
                     f"(here mode {have.seccomp[0]} with {have.seccomp[1]})")
    return found


def _cpus(cpus: tuple) -> str:
    """0-3,8 as taskset writes a list."""
    runs: list[list[int]] = []
    for cpu in cpus:
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs) or "none"


def tracer_pid(status: Optional[dict] = None) -> int:
    """The pid tracing this process (a debugger, strace), 0 if none."""
    try:
        return int((status if status is not None else status_fields()).get("TracerPid", "0") or 0)
    except ValueError:
        return 0
