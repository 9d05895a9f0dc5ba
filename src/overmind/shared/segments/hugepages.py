"""Whether the kernel backs overmind's segments with transparent huge pages, and what it costs if not.

Standard library only (``overmind status`` reads it without the server or torch)::

    from overmind.shared.segments.hugepages import read_status
    hp = read_status()              # or read_status("/tmp/fake-root") in tests
    hp.enabled, hp.setting          # False, "never"
    hp.as_dict()                    # what `overmind status --json` prints as "huge_pages"

Segments are memfds, i.e. shmem, so what decides is ``shmem_enabled``, not the
``enabled`` file anonymous memory follows. The loader rebuilds every segment it filled
out of huge pages (``MADV_COLLAPSE``) and every client mapping asks for them
(``MADV_HUGEPAGE``; Note [Huge pages for segments] in :mod:`overmind.shared.segments.memfd`); the kernel
grants them when the setting is one of :data:`ALLOWING`. Only root can change it, and it resets on
reboot: README "Huge pages" gives the command, a systemd ``tmpfiles.d`` line and a
Kubernetes DaemonSet (``deploy/``).

Note [The 2 MiB size has its own shmem setting]
Kernels with multi-size THP for shmem add ``hugepages-<size>kB/shmem_enabled`` per page
size. For the PMD size (2 MiB on x86-64, the size that saves the faults) its default is
``inherit``: the top-level setting decides. Any other value decides for that size
instead, except that a top-level ``deny`` or ``force`` overrides every size. (Recent
kernels apply the per-size knobs to the internal mount memfds live on; the first ones to
have them, 6.11 on, applied them to anonymous shmem only, and there a non-default
per-size value is reported although memfds follow the top level. Defaults read the same.)
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Optional

__all__ = ["HugePageStatus", "read_status", "read_setting", "SHMEM_ENABLED", "ALLOWING", "ENABLE_COMMAND",
           "PMD_SIZE"]

# Paths relative to a root ("/" on a real machine; a temp dir holding the same tree in tests).
SHMEM_ENABLED = "sys/kernel/mm/transparent_hugepage/shmem_enabled"
_PMD_SIZE_FILE = "sys/kernel/mm/transparent_hugepage/hpage_pmd_size"
_SIZE_SETTING = "sys/kernel/mm/transparent_hugepage/hugepages-{kb}kB/shmem_enabled"
_MEMINFO = "proc/meminfo"

PMD_SIZE = 2 << 20  # x86-64 and most arm64 kernels; read from hpage_pmd_size where present
SMALL_PAGE = 4096
UNAVAILABLE = "unavailable"  # no THP in this kernel (or no sysfs in this container)

# Settings under which an madvise(MADV_HUGEPAGE)d shmem mapping gets huge pages.
# `never` refuses them; `deny` (a testing value) refuses them even where a mount asks.
ALLOWING = frozenset({"always", "within_size", "advise", "force"})
ENABLE_COMMAND = "echo advise | sudo tee /" + SHMEM_ENABLED


@dataclass(frozen=True)
class HugePageStatus:
    """One reading of the machine-wide huge-page state for shared memory."""

    setting: str  # the bracketed value of shmem_enabled, or "unavailable"
    size_setting: Optional[str]  # hugepages-<PMD>kB/shmem_enabled; None where the kernel has no such file
    enabled: bool  # an madvised segment can be backed by huge pages
    shmem_huge_bytes: int  # ShmemHugePages: shmem (all of it, not only overmind's) in huge pages
    shmem_pmd_mapped_bytes: int  # ShmemPmdMapped: of that, mapped with huge page-table entries
    page_size: int  # the huge page size (hpage_pmd_size)
    why_not: Optional[str]  # why segments get 4 KiB pages; None when enabled
    cost: str  # what a user pays without them
    command: str  # the one command that turns them on (root; until reboot)

    def as_dict(self) -> dict:
        return asdict(self)


def _read(root: str, relative: str) -> Optional[str]:
    try:
        with open(os.path.join(root, relative), encoding="ascii", errors="replace") as f:
            return f.read()
    except OSError:
        return None


def _bracketed(text: Optional[str]) -> Optional[str]:
    """``"always within_size advise [never] deny force"`` -> ``"never"``."""
    if text is None:
        return None
    for word in text.split():
        if word.startswith("[") and word.endswith("]"):
            return word[1:-1]
    return text.strip() or None  # some kernels print the value alone


def read_setting(root: str = "/") -> str:
    """The top-level ``shmem_enabled`` value, or ``"unavailable"`` where the file is missing."""
    return _bracketed(_read(root, SHMEM_ENABLED)) or UNAVAILABLE


def _meminfo_bytes(root: str) -> dict[str, int]:
    values: dict[str, int] = {}
    for line in (_read(root, _MEMINFO) or "").splitlines():
        name, _, rest = line.partition(":")
        fields = rest.split()
        if fields and fields[0].isdigit():
            values[name.strip()] = int(fields[0]) * (1024 if fields[1:2] == ["kB"] else 1)
    return values


def _size_text(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def _page_size(root: str) -> int:
    text = (_read(root, _PMD_SIZE_FILE) or "").strip()
    return int(text) if text.isdigit() and int(text) > 0 else PMD_SIZE


def read_status(root: str = "/") -> HugePageStatus:
    """Read the setting and the counters under ``root`` (``/`` on a real machine)."""
    setting = read_setting(root)
    page_size = _page_size(root)
    size_path = _SIZE_SETTING.format(kb=page_size // 1024)
    size_setting = _bracketed(_read(root, size_path))
    # Note [The 2 MiB size has its own shmem setting]
    size_overrides = size_setting not in (None, "inherit") and setting not in ("deny", "force")
    enabled = (size_setting if size_overrides else setting) in ALLOWING
    command = ENABLE_COMMAND
    why_not: Optional[str] = None
    if setting == UNAVAILABLE:
        why_not = f"/{SHMEM_ENABLED} is missing: this kernel (or container) offers no transparent huge pages"
    elif not enabled and not size_overrides:
        why_not = f"/{SHMEM_ENABLED} is {setting!r}, which refuses huge pages to shared memory"
    elif not enabled:
        why_not = f"/{size_path} is {size_setting!r}, which overrides the top-level {setting!r}"
        command = f"echo inherit | sudo tee /{size_path}" + ("" if setting in ALLOWING else f" && {ENABLE_COMMAND}")
    meminfo = _meminfo_bytes(root)
    small_per_huge = page_size // SMALL_PAGE
    cost = (f"without huge pages the first use of a cached model faults its weights in one {SMALL_PAGE // 1024} KiB "
            f"page at a time ({small_per_huge} faults where one {_size_text(page_size)} page would do), and that first "
            "pass can take longer than the warm load itself; overmind-bench measures it here (its 'first use' column)")
    return HugePageStatus(setting=setting, size_setting=size_setting, enabled=enabled,
                          shmem_huge_bytes=meminfo.get("ShmemHugePages", 0),
                          shmem_pmd_mapped_bytes=meminfo.get("ShmemPmdMapped", 0), page_size=page_size,
                          why_not=why_not, cost=cost, command=command)
