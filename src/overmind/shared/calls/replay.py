"""Warnings and log records of a load: recorded where the cache is filled, replayed on every hit.

    with Recorder() as recorder:          # in the loader, around the original
        result = original(*args, **kwargs)
    meta.events = recorder.events         # JSON-able, bounded

    replay(meta.events)                   # in the caller, on a hit

Note [Replayed warnings and log records]
A plain ``from_pretrained`` tells its caller things: "Some weights ... were newly initialized",
a size-mismatch report, a deprecation ``FutureWarning``. A hit must tell the same, through the
caller's own ``warnings`` filters and logging configuration, in the order they happened.

- Warnings are recorded with the filter ``always`` (so none is lost to the loader's registry)
  and replayed with ``warnings.warn_explicit`` against the registry of the module that issued
  them, so ``default``/``once``/``ignore``/``error`` act as they would on the plain call. A
  warning attributed to overmind's own frames (a ``stacklevel`` reaching past the loader's call
  of the original) is attributed to the caller's frame, as the plain call would.
- Log records are recorded from every logger at level INFO and up, whatever the loader's
  levels, and replayed through the logger of the same name with ``Logger.handle`` when that
  logger is enabled for the record's level in the caller: its level, ``disabled``, filters,
  handlers and propagation decide, as for the plain call. DEBUG records are not recorded.
- A record transformers logs with ``warning_once``/``info_once`` is replayed once per process
  and message, as those do (not knowing whether the caller's own code logged it before).
- Both are bounded (MAX_EVENTS, MAX_TEXT) to stay within the protocol's field limit.

Note [Warnings of an import inside a load]
A load may import a module whose top-level code warns or logs (bitsandbytes' CPU backend logs
"Failed to load CPU gemm_4bit_forward" when imported). The plain call emits that once per
process, on the import, not on every load. So each event records the module whose top-level
code was running when it was emitted (the innermost ``<module>`` frame). A hit never replays
such an event: when the module is in the caller's ``sys.modules`` once the result is rebuilt,
the caller imported it before (the plain call would not import it again) or the rebuild just
did (and its import emitted the event, as the plain call's would); when it is not, the hit
imports it, as the plain call would have, and that import emits what it emits. Only an import
that fails here (it did not in the loader) leaves the event to be replayed.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from typing import Any, Optional

import overmind

__all__ = ["Recorder", "replay", "MAX_EVENTS", "MAX_TEXT"]

MAX_EVENTS = 256
MAX_TEXT = 16_384
RECORDED_LEVEL = logging.INFO
_OVERMIND_DIR = os.path.join(os.path.dirname(os.path.abspath(overmind.__file__)), "")  # the package


class Recorder:
    """Record the warnings and log records emitted inside the ``with`` block (one thread at a time)."""

    def __init__(self) -> None:
        self.events: list[list] = []
        self.dropped = 0
        self._saved: Optional[tuple] = None
        self._warnings = warnings.catch_warnings()

    def _add(self, event: list) -> None:
        if len(self.events) < MAX_EVENTS:
            self.events.append(event)
        else:
            self.dropped += 1

    def _on_warning(self, message: Any, category: type, filename: str, lineno: int, file: Any = None,
                    line: Any = None) -> None:
        caller = os.path.abspath(filename).startswith(_OVERMIND_DIR)
        self._add(["warning", f"{category.__module__}:{category.__qualname__}", str(message)[:MAX_TEXT],
                   "" if caller else filename, 0 if caller else lineno, _importing()])

    def __enter__(self) -> "Recorder":
        self._warnings.__enter__()
        warnings.simplefilter("always")
        warnings.showwarning = self._on_warning
        recorder = self
        handle, enabled = logging.Logger.handle, logging.Logger.isEnabledFor

        def record(logger: logging.Logger, rec: logging.LogRecord) -> None:
            if logger.disabled or not logger.filter(rec):
                return
            text = rec.getMessage()
            if rec.exc_info and not rec.exc_text:
                rec.exc_text = logging.Formatter().formatException(rec.exc_info)
            if rec.exc_text:
                text = f"{text}\n{rec.exc_text}"
            recorder._add(["log", rec.name, rec.levelno, text[:MAX_TEXT], rec.pathname, rec.lineno, rec.funcName,
                           _logged_once(), _importing()])

        def is_enabled(logger: logging.Logger, level: int) -> bool:
            return level >= RECORDED_LEVEL or enabled(logger, level)

        self._saved = (handle, enabled)
        logging.Logger.handle = record  # type: ignore[method-assign]
        logging.Logger.isEnabledFor = is_enabled  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._saved is not None:
            logging.Logger.handle, logging.Logger.isEnabledFor = self._saved  # type: ignore[method-assign]
            self._saved = None
        self._warnings.__exit__(*exc)


# transformers' Logger.warning_once / info_once: once per process and message.
_ONCE_FUNCTIONS = frozenset({"warning_once", "info_once"})
_replayed_once: set = set()


def _logged_once() -> bool:
    frame, depth = sys._getframe(2), 0
    while frame is not None and depth < 6:
        if frame.f_code.co_name in _ONCE_FUNCTIONS:
            return True
        frame, depth = frame.f_back, depth + 1
    return False


def _importing() -> str:
    """The module whose top-level code is running on this thread (it is being imported), or "":
    Note [Warnings of an import inside a load]."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "<module>":
            name = frame.f_globals.get("__name__", "")
            # overmind's own: a loader's entry point, never a module the caller's load imports.
            return name if isinstance(name, str) and name != "__main__" and not name.startswith("overmind") else ""
        frame = frame.f_back
    return ""


def _emitted_by_import(event: list, length: int) -> bool:
    """Whether the event came from a module's import, which has happened in this process or
    happens now (Note [Warnings of an import inside a load]). Entries filed before events
    carried their importing module have ``length`` fields."""
    name = event[length] if len(event) > length else ""
    if not name or not isinstance(name, str):
        return False
    if name not in sys.modules:
        import importlib

        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - the loader imported it; replay what it emitted there
            return False
    return True


def _category(name: str) -> type:
    module, _, qualname = name.partition(":")
    obj: Any = sys.modules.get(module)
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    return obj if isinstance(obj, type) and issubclass(obj, Warning) else UserWarning


def _module_of(filename: str) -> Optional[Any]:
    """The module loaded from ``filename``. Its name is guessed from the ``sys.path`` entry that
    holds the file, so a hit looks at one module, not at every module of the process: a pass
    over thousands of them is a page fault apiece in a run forked from a warm interpreter
    (Note [A hit imports nothing] in overmind.client.cache). The pass is the fallback."""
    for entry in sys.path:
        folder = os.path.join(entry, "") if entry else ""
        if folder and filename.startswith(folder):
            parts = filename[len(folder):].rsplit(".", 1)[0].split(os.sep)
            if parts[-1] == "__init__":
                parts.pop()
            module = sys.modules.get(".".join(parts))
            if module is not None and getattr(module, "__file__", None) == filename:
                return module
    for module in list(sys.modules.values()):
        if getattr(module, "__file__", None) == filename:
            return module
    return None


def _caller_frame() -> Any:
    frame = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] == "overmind":
        frame = frame.f_back
    return frame


def replay(events: list) -> None:
    """Emit ``events`` (a Recorder's) in this process, as the plain call would have."""
    if not events:
        return
    modules: dict[str, Any] = {}
    for event in events:
        if not isinstance(event, list) or not event:
            continue
        if event[0] == "warning" and len(event) in (5, 6):
            if _emitted_by_import(event, 5):  # Note [Warnings of an import inside a load]
                continue
            _, category, message, filename, lineno = event[:5]
            if filename:
                if filename not in modules:
                    modules[filename] = _module_of(filename)
                module = modules[filename]
                globals_ = vars(module) if module is not None else {}
            else:  # attributed to the caller: Note [Replayed warnings and log records]
                frame = _caller_frame()
                globals_ = frame.f_globals if frame is not None else {}
                filename = frame.f_code.co_filename if frame is not None else "<unknown>"
                lineno = frame.f_lineno if frame is not None else 0
            registry = globals_.setdefault("__warningregistry__", {}) if globals_ else None
            # No module_globals: linecache reads a library's source from its file, and a `-c`
            # script's loader (BuiltinImporter) raises on get_source.
            # module=None given explicitly makes CPython 3.11 drop the warning: leave it out, and
            # warn_explicit names the module after the file, as for a warning of a module unknown here.
            module_name = globals_.get("__name__") if globals_ else None
            warnings.warn_explicit(message, _category(category), filename, lineno, registry=registry,
                                   **({"module": module_name} if module_name else {}))
        elif event[0] == "log" and len(event) in (8, 9):
            if _emitted_by_import(event, 8):
                continue
            _, name, level, text, pathname, lineno, func, once = event[:8]
            if once:  # as the plain call's warning_once would: once per process and message
                if (name, level, text) in _replayed_once:
                    continue
                _replayed_once.add((name, level, text))
            logger = logging.getLogger(name) if name != "root" else logging.getLogger()
            if logger.isEnabledFor(level):
                logger.handle(logger.makeRecord(logger.name, level, pathname, lineno, text, (), None, func))
