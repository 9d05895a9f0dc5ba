"""How much memory the overmind server may use, and how much of it is still free.

Standard library only (the server never imports torch)::

    from overmind.shared.settings.host_memory import HostMemory
    memory = HostMemory.read()       # or HostMemory.read("/tmp/fake-root") in tests
    memory.limit                     # Limit(bytes=12884901888, source="cgroup v2 memory.max of /user.slice", ...)
    memory.available()               # bytes we may still take before the tightest limit bites
    memory.pressure()                # Stall(some_avg10=0.0, ...) or None on kernels without PSI
    memory.describe()                # what `overmind status` prints

``read`` finds our cgroup once (``/proc/self/cgroup`` and ``mountinfo``); ``available`` and
``pressure`` then cost a few small reads each, so the server may ask often.

Note [Which memory limit binds]
The kernel charges a cgroup's pages to every ancestor too, so a limit on a parent binds us
as surely as our own: a job's cgroup often says ``max`` while its slice holds the real
limit. We read every level from our cgroup up to the hierarchy's root as our mount shows it
(never above the mount point: that is the host's tree, or another hierarchy). A v1
container cannot see its ancestors at all, so we also read ``hierarchical_memory_limit``,
which the kernel computes over all of them. On v2, ``memory.high`` counts as a limit: past
it the kernel throttles and reclaims hard, which is what we must give memory back to avoid.
The JVM and Go read only their own level, or only the v1 files, for years; do not do that.

Note [What is left under a limit]
Under a cgroup limit, what is left is ``limit - usage + inactive_file``: usage counts page
cache, and inactive file pages are reclaimed before the OOM killer runs (kubelet's
"working set" subtracts the same). Each level is its own bound, and MemAvailable bounds
them all. A limit file that vanishes (the cgroup was removed, or moved under us) skips its
level: the server asks again soon and must never fail for it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Optional

__all__ = ["Limit", "Stall", "HostMemory", "CgroupMount", "cgroup_mounts", "below_mount", "mem_available", "ram_total",
           "V1_UNLIMITED"]

# v1 writes "no limit" as its page counter's maximum in bytes (9223372036854771712 with 4 KiB
# pages, a little less with larger pages): anything this big is no limit.
V1_UNLIMITED = 2**62

_LIMIT_FILES = {2: ("memory.max", "memory.high"), 1: ("memory.limit_in_bytes",)}
_USAGE_FILE = {2: "memory.current", 1: "memory.usage_in_bytes"}
_OCTAL = re.compile(r"\\([0-7]{3})")


@dataclass(frozen=True)
class Limit:
    bytes: int
    source: str  # for `overmind status` and --help: "RAM", "cgroup v2 memory.max of /user.slice/job"
    cgroup_dir: Optional[str]  # the directory (under root) holding the limit's files; None for RAM
    version: int  # 0 for RAM, else the cgroup version


@dataclass(frozen=True)
class Stall:
    """One reading of a PSI file (``/proc/pressure/memory`` or a v2 cgroup's ``memory.pressure``)."""

    some_avg10: float  # percent of the last 10 s some task waited for memory
    some_total_us: int  # cumulative microseconds
    full_avg10: float  # percent of the last 10 s every task waited
    full_total_us: int
    source: str  # the file read


def _under(root: str, path: str) -> str:
    """An absolute path as seen from ``root`` (a fixture tree in tests)."""
    return os.path.join(root, path.lstrip("/"))


def _read(path: str) -> Optional[str]:
    """The file's text, or None: missing, unreadable, or the kernel refuses (EOPNOTSUPP, ENODEV...)."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, ValueError):
        return None


def _fields(text: str) -> dict[str, str]:
    """``key value`` lines (memory.stat) and ``Key:  value kB`` lines (meminfo)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.replace(":", " ").split()
        if len(parts) >= 2:
            out[parts[0]] = parts[1]
    return out


def _meminfo(root: str, key: str) -> int:
    path = _under(root, "proc/meminfo")
    with open(path, encoding="utf-8") as f:
        value = _fields(f.read()).get(key)
    if value is None:
        raise ValueError(f"{path} has no {key} (a kernel before 3.14?)")
    return int(value) * 1024


def mem_available(root: str = "/") -> int:
    """MemAvailable from /proc/meminfo, in bytes; OSError or ValueError when it cannot be read."""
    return _meminfo(root, "MemAvailable")


def ram_total(root: str = "/") -> int:
    """MemTotal from /proc/meminfo, in bytes; OSError or ValueError when it cannot be read."""
    return _meminfo(root, "MemTotal")


def _limit_value(text: Optional[str], version: int) -> Optional[int]:
    """A limit file's bytes, or None for no limit, a missing file or garbage (the server starts anyway)."""
    if text is None:
        return None
    try:
        value = int(text)
    except ValueError:
        return None  # v2's "max" lands here too
    if value <= 0 or (version == 1 and value >= V1_UNLIMITED):
        return None
    return value


@dataclass(frozen=True)
class CgroupMount:
    root: str  # the cgroup the mount shows at its mount point
    point: str  # absolute, in our mount namespace
    fstype: str
    superopts: tuple[str, ...]


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash in paths as octal: ``\\040``."""
    return _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), field)


def cgroup_mounts(root: str = "/") -> list[CgroupMount]:
    """cgroup mounts from mountinfo: ``id parent maj:min root point opts [optional...] - fstype source superopts``."""
    mounts = []
    for line in (_read(_under(root, "proc/self/mountinfo")) or "").splitlines():
        fields = line.split()  # the kernel escapes spaces in paths, so no field holds one
        if "-" not in fields[6:]:
            continue
        sep = fields.index("-", 6)  # the optional fields vary in number: find their end
        if len(fields) < sep + 2 or not fields[sep + 1].startswith("cgroup"):
            continue
        superopts = tuple(fields[sep + 3].split(",")) if len(fields) > sep + 3 else ()
        mounts.append(CgroupMount(_unescape(fields[3]), _unescape(fields[4]), fields[sep + 1], superopts))
    return mounts


def _own_paths(root: str) -> tuple[Optional[str], Optional[str]]:
    """Our v2 cgroup path (``0::/path``) and our v1 memory cgroup path (``id:...,memory,...:/path``)."""
    v2 = v1 = None
    for line in (_read(_under(root, "proc/self/cgroup")) or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            v2 = path
        elif "memory" in controllers.split(","):
            v1 = path
    return v2, v1


def _parts(path: str) -> list[str]:
    return [p for p in path.split("/") if p and p != "."]


def is_under(path: str, mount_root: str) -> bool:
    parts, base = _parts(path), _parts(mount_root)
    return ".." not in parts and parts[: len(base)] == base


def below_mount(path: str, mount_root: str) -> Optional[list[str]]:
    """A cgroup's directories below a mount whose root is ``mount_root``; None when that mount
    cannot show it (a cgroup namespace's "/..", a foreign mount)."""
    return _parts(path)[len(_parts(mount_root)):] if is_under(path, mount_root) else None


def _relative(path: str, mount_root: str, point: str) -> list[str]:
    """Our cgroup's directories below the mount point; none when the mount cannot show us."""
    rel = below_mount(path, mount_root)
    if rel is None:
        return []  # its point is all we see
    return rel if os.path.isdir(os.path.join(point, *rel)) else []


def _hierarchy(root: str) -> Optional[tuple[int, str, list[str]]]:
    """The memory hierarchy in use: its version, its mount point under root, our path below it."""
    v2_path, v1_path = _own_paths(root)
    mounts = cgroup_mounts(root)
    candidates: list[tuple[int, str, CgroupMount]] = []
    if v2_path is not None:
        # A hybrid host mounts v2 at /sys/fs/cgroup/unified without the memory controller.
        candidates = [(2, v2_path, m) for m in mounts if m.fstype == "cgroup2" and "memory" in
                      (_read(os.path.join(_under(root, m.point), "cgroup.controllers")) or "").split()]
    if not candidates and v1_path is not None:
        candidates = [(1, v1_path, m) for m in mounts if m.fstype == "cgroup" and "memory" in m.superopts]
    if not candidates:
        return None
    # Several mounts (a bind mount, the host's tree): prefer one that shows our own cgroup.
    version, path, mount = min(candidates, key=lambda c: not is_under(c[1], c[2].root))
    point = _under(root, mount.point)
    return version, point, _relative(path, mount.root, point)


def _left(cgroup_dir: str, version: int, limit: int) -> Optional[int]:
    """``limit - usage + inactive_file`` at one level (Note [What is left under a limit]); None if unreadable."""
    usage, stat = _read(os.path.join(cgroup_dir, _USAGE_FILE[version])), _read(os.path.join(cgroup_dir, "memory.stat"))
    if usage is None or stat is None:
        return None
    fields = _fields(stat)
    # v1's total_ sums the children, as usage_in_bytes does; v2's memory.stat always does.
    inactive = fields.get("total_inactive_file", fields.get("inactive_file")) if version == 1 \
        else fields.get("inactive_file")
    try:
        return max(0, limit - int(usage) + int(inactive or 0))
    except ValueError:
        return None


def _stall(text: Optional[str], source: str) -> Optional[Stall]:
    """``some avg10=0.12 avg60=... total=123`` and ``full ...`` lines, or None when they do not parse."""
    rows: dict[str, dict[str, str]] = {}
    for line in (text or "").splitlines():
        kind, *pairs = line.split() or [""]
        rows[kind] = dict(p.split("=", 1) for p in pairs if "=" in p)
    try:
        return Stall(float(rows["some"]["avg10"]), int(rows["some"]["total"]),
                     float(rows["full"]["avg10"]), int(rows["full"]["total"]), source)
    except (KeyError, ValueError):
        return None


@dataclass(frozen=True)
class HostMemory:
    """Built once by :meth:`read`, then asked repeatedly (cheap: a few small reads)."""

    root: str
    limits: list[Limit]  # RAM first, then every finite cgroup limit from our cgroup upward
    version: Optional[int]  # the memory hierarchy in use: 1, 2, or None without one
    cgroup_dir: Optional[str]  # our own cgroup's directory in it

    @classmethod
    def read(cls, root: str = "/") -> HostMemory:
        """Our limits (Note [Which memory limit binds]); OSError only when /proc/meminfo cannot be read."""
        limits = [Limit(ram_total(root), "RAM", None, 0)]
        found = _hierarchy(root)
        if found is None:
            return cls(root, limits, None, None)
        version, point, rel = found
        levels = [(os.path.join(point, *rel[:i]), "/" + "/".join(rel[:i])) for i in range(len(rel), -1, -1)]
        for directory, shown in levels:
            for name in _LIMIT_FILES[version]:
                value = _limit_value(_read(os.path.join(directory, name)), version)
                if value is not None:
                    limits.append(Limit(value, f"cgroup v{version} {name} of {shown}", directory, version))
        own_dir, shown = levels[0]
        if version == 1:
            stat = _fields(_read(os.path.join(own_dir, "memory.stat")) or "")
            value = _limit_value(stat.get("hierarchical_memory_limit"), 1)
            if value is not None and all(limit.bytes != value for limit in limits[1:]):
                limits.append(Limit(value, f"cgroup v1 hierarchical_memory_limit of {shown}", own_dir, 1))
        return cls(root, limits, version, own_dir)

    @property
    def limit(self) -> Limit:
        """The tightest of :attr:`limits` (RAM on a tie)."""
        return min(self.limits, key=lambda limit: limit.bytes)

    def available(self) -> int:
        """Bytes we may still take: the least of MemAvailable and what each limited level has left."""
        bounds = []
        try:
            bounds.append(mem_available(self.root))
        except (OSError, ValueError):
            pass
        for limit in self.limits:
            left = None if limit.cgroup_dir is None else _left(limit.cgroup_dir, limit.version, limit.bytes)
            if left is not None:
                bounds.append(left)
        # Nothing readable at all: claim the limit rather than nothing, so one failed read
        # does not make the server throw its whole cache away.
        return min(bounds) if bounds else self.limit.bytes

    def pressure(self) -> Optional[Stall]:
        """Memory stall (PSI): our v2 cgroup's, else the whole machine's; None without PSI."""
        paths = [os.path.join(self.cgroup_dir, "memory.pressure")] if self.version == 2 and self.cgroup_dir else []
        paths.append(_under(self.root, "proc/pressure/memory"))
        for path in paths:
            stall = _stall(_read(path), path)
            if stall is not None:
                return stall
        return None

    def describe(self) -> dict:
        """What `overmind status` prints about memory."""
        return {"limit": self.limit.bytes, "limit_from": self.limit.source, "ram": self.limits[0].bytes,
                "cgroup": self.version}
