"""Every ``OVERMIND_*`` setting, read once into a frozen :class:`Config`.

Standard library only (the server imports it)::

    from overmind.config import Config
    cfg = Config.from_env()
    cfg.socket_path          # <runtime dir>/server.sock

=========================  =========================================================
``OVERMIND_RUNTIME_DIR``   socket, log and pid file; else ``$XDG_RUNTIME_DIR/overmind``,
                           else ``/tmp/overmind-<uid>``. Created 0700; refused if another
                           user owns it or others can enter it.
``OVERMIND_DISABLE``       ``1``: ``monkey_patch_all()`` patches nothing.
``OVERMIND_STRICT``        ``1``: raise instead of falling back to a plain load.
``OVERMIND_TIMEOUT``       seconds a client waits for the server, cold loads included
                           (default 300); past it, the plain load runs.
``OVERMIND_COLD``          ``background`` (default): on a miss the caller loads plainly while
                           the server fills the cache; ``wait``: the caller waits for the
                           cache (always so with ``OVERMIND_STRICT=1``).
``OVERMIND_PATCH``         extra patch points, ``module::Qualname.attr``, comma separated.
``OVERMIND_LOADER_TIMEOUT`` seconds before the server kills a loader (default 3600).
``OVERMIND_WORKERS``       loads that run at once for different keys (default 2).
``OVERMIND_NO_AUTOSTART``  ``1``: clients never start a server themselves.
``OVERMIND_PRESTART``      ``0``: ``monkey_patch_all()`` does not ask the server, in the
                           background, to get a loader ready for this process.
``OVERMIND_MAX_MEMORY``    server memory budget: ``40G``, ``512M``, ``60%`` of RAM or bytes
                           (default 50% of RAM); least recently used entries are evicted.
``OVERMIND_LOG_LEVEL``     server log level (default INFO).
=========================  =========================================================
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

__all__ = ["Config", "ConfigError", "default_runtime_dir", "ensure_private_dir", "ENV_PREFIXES", "ENV_NAMES"]

# Environment a loader inherits from the client (and that selects its zygote).
ENV_PREFIXES = ("HF_", "HUGGINGFACE_", "TRANSFORMERS_", "DIFFUSERS_", "CUDA_", "NVIDIA_", "TORCH_", "PYTORCH_",
                "OMP_", "MKL_", "BNB_", "ACCELERATE_", "SAFETENSORS_", "TOKENIZERS_", "XDG_", "LC_")
ENV_NAMES = ("HOME", "PATH", "LD_LIBRARY_PATH", "LD_PRELOAD", "PYTHONPATH", "PYTHONHASHSEED", "VIRTUAL_ENV", "LANG",
             "TMPDIR", "USER", "LOGNAME", "TZ", "OVERMIND_NO_EXT", "PYTHONDONTWRITEBYTECODE", "PYTHONNOUSERSITE",
             "PYTHONUSERBASE", "PYTHONSAFEPATH", "PYTHONPYCACHEPREFIX", "PYTHONWARNINGS")


class ConfigError(ValueError):
    pass


def _flag(env, name: str) -> bool:
    return env.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _number(env, name: str, default: float, minimum: float = 0.0) -> float:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number") from None
    if value < minimum:
        raise ConfigError(f"{name}={raw!r} must be at least {minimum}")
    return value


def _size(env, name: str) -> Optional[int]:
    raw = env.get(name, "").strip()
    if not raw:
        return None
    from overmind.registry import parse_size

    try:
        return parse_size(raw)
    except ValueError as err:
        raise ConfigError(f"{name}: {err}") from None


def default_runtime_dir(env=None) -> Path:
    env = os.environ if env is None else env
    if env.get("OVERMIND_RUNTIME_DIR"):
        return Path(env["OVERMIND_RUNTIME_DIR"]).absolute()
    if env.get("XDG_RUNTIME_DIR"):
        return Path(env["XDG_RUNTIME_DIR"]) / "overmind"
    return Path(f"/tmp/overmind-{os.getuid()}")


def ensure_private_dir(path: Path) -> Path:
    """Create ``path`` 0700, or check an existing one is ours and private (DESIGN invariant 5)."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"cannot create runtime directory {path}: {err.strerror}") from None
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"runtime directory {path} is not a directory (a symlink?); remove it")
    if st.st_uid != os.getuid():
        raise ConfigError(f"runtime directory {path} belongs to uid {st.st_uid}, not to you (uid {os.getuid()}); "
                          "set OVERMIND_RUNTIME_DIR to a private directory")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


@dataclass(frozen=True)
class Config:
    runtime_dir: Path
    disable: bool = False
    strict: bool = False
    timeout: float = 300.0
    patch: str = ""
    loader_timeout: float = 3600.0
    workers: int = 2
    autostart: bool = True
    prestart: bool = True
    cold_wait: bool = False
    log_level: str = "INFO"
    max_memory: Optional[int] = None  # bytes; None: overmind.registry.default_budget()

    @classmethod
    def from_env(cls, env=None) -> "Config":
        env = os.environ if env is None else env
        return cls(
            runtime_dir=default_runtime_dir(env),
            disable=_flag(env, "OVERMIND_DISABLE"),
            strict=_flag(env, "OVERMIND_STRICT"),
            timeout=_number(env, "OVERMIND_TIMEOUT", 300.0, 0.1),
            patch=env.get("OVERMIND_PATCH", ""),
            loader_timeout=_number(env, "OVERMIND_LOADER_TIMEOUT", 3600.0, 1.0),
            workers=int(_number(env, "OVERMIND_WORKERS", 2, 1)),
            autostart=not _flag(env, "OVERMIND_NO_AUTOSTART"),
            cold_wait=env.get("OVERMIND_COLD", "background").strip().lower() == "wait" or _flag(env, "OVERMIND_STRICT"),
            prestart=env.get("OVERMIND_PRESTART", "1").strip().lower() not in ("0", "false", "no", "off"),
            log_level=env.get("OVERMIND_LOG_LEVEL", "INFO").upper(),
            max_memory=_size(env, "OVERMIND_MAX_MEMORY"),
        )

    @property
    def socket_path(self) -> Path:
        return self.runtime_dir / "server.sock"

    @property
    def log_path(self) -> Path:
        return self.runtime_dir / "server.log"

    @property
    def pid_path(self) -> Path:
        return self.runtime_dir / "server.pid"

    @property
    def lock_path(self) -> Path:
        return self.runtime_dir / "server.lock"
