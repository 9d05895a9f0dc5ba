"""The machine's shmem huge-page setting, read and (for ``--shmem-enabled``) changed for a while.

    current()                                   # "never", "advise", ... or None
    with Switch(["never", "advise"]) as switch:   # refuses unless the bench may write it (root)
        for value in switch.values:
            switch.set(value)                   # ... timed runs under `value`
    # the original value is back, whatever happened (also Ctrl-C, SIGTERM, an error)

``/sys/kernel/mm/transparent_hugepage/shmem_enabled`` decides whether overmind's segments
can be backed by 2 MiB pages (Note [Huge pages for segments] in ``overmind.shared.segments.memfd``), and
with them what the first use of a warm model costs. It is machine-global: the bench only
changes it when asked, only for the load scenarios, and always puts the original back.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Optional

from overmind.shared.segments import hugepages

__all__ = ["SHMEM_ENABLED", "VALUES", "current", "Switch", "SwitchRefused"]

SHMEM_ENABLED = Path("/", hugepages.SHMEM_ENABLED)
VALUES = ("always", "within_size", "advise", "never", "deny", "force")


class SwitchRefused(RuntimeError):
    """The setting cannot be changed here (not root, no such file)."""


def current(root: str = "/") -> Optional[str]:
    """The selected value (read as ``overmind status`` reads it), or None where the kernel has no such file."""
    setting = hugepages.read_setting(root)
    return None if setting == hugepages.UNAVAILABLE else setting


class Switch:
    """Sets the values in turn; restores the original on exit, on SIGTERM too (as Ctrl-C)."""

    def __init__(self, values: list[str], root: str = "/") -> None:
        unknown = [v for v in values if v not in VALUES]
        if unknown:
            raise ValueError(f"--shmem-enabled: unknown {', '.join(unknown)}; choose from {', '.join(VALUES)}")
        self.values = list(dict.fromkeys(values))
        self.root = root
        self.path = Path(root, hugepages.SHMEM_ENABLED)
        self.original = current(root)
        self._wrote = False  # only a value this switch wrote is ever written back
        self._previous_sigterm = None

    def check(self) -> None:
        """Refuse early (before any model is generated) where the setting cannot be written."""
        if self.original is None:
            raise SwitchRefused(f"{self.path} does not exist (a kernel without transparent huge pages?)")
        if any(v != self.original for v in self.values) and not os.access(self.path, os.W_OK):
            raise SwitchRefused(f"changing {self.path} needs root (it is {self.original!r}); run as root, or leave "
                                f"out --shmem-enabled to run under the current value")

    def set(self, value: str) -> None:
        if value == self.original and not self._wrote:
            return  # the machine's own value: nothing to change (runs record what they ran under)
        if current(self.root) != value:
            self._wrote = True
            self.path.write_text(value)
            if current(self.root) != value:
                raise SwitchRefused(f"{self.path} did not take {value!r} (this kernel does not offer it?)")

    def restore(self) -> None:
        if self._wrote and self.original is not None and current(self.root) != self.original:
            self.path.write_text(self.original)

    def __enter__(self) -> "Switch":
        self.check()

        def on_sigterm(signum, frame):
            raise KeyboardInterrupt  # unwinds through __exit__, which restores

        self._previous_sigterm = signal.signal(signal.SIGTERM, on_sigterm)
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.restore()
        finally:
            if self._previous_sigterm is not None:
                signal.signal(signal.SIGTERM, self._previous_sigterm)
