"""pytest plugin used by ``benchmarks/hf_suites.py``: one pass over an upstream test file.

Loaded with ``-p hf_suites_plugin`` (``benchmarks/`` on ``PYTHONPATH``); it is configured only
through the environment, which the harness sets:

    HF_SUITES_PATCH=1      call ``overmind.api.monkey_patch_all()`` as this module is imported,
                           i.e. before any conftest or test module imports torch, transformers
                           or diffusers (``-p`` plugins load before conftests).
    HF_SUITES_RESULTS=F    append one JSON line per test to F: nodeid, outcome, seconds, the
                           short traceback of a failure, and (patched) what overmind did.
    HF_SUITES_AGE=S        after every save_pretrained/save_config/torch.save/save_file the tests
                           call, set the saved files' times S seconds into the past (Note
                           [Aged saves]); 0 turns it off. Applied in plain passes too, so plain
                           and patched runs see the same files.

A test's outcome is the first of setup/call/teardown that did not pass: ``failed`` (call),
``error`` (setup or teardown), ``skipped``, ``xfailed``/``xpassed``, else ``passed``; a module
that did not import is one ``collect-error`` record named by its path.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sys
import time
from typing import Any, Optional

PATCHED = os.environ.get("HF_SUITES_PATCH") == "1"
if PATCHED:
    from overmind.api import monkey_patch_all

    monkey_patch_all()

RESULTS = os.environ.get("HF_SUITES_RESULTS")
AGE_SECONDS = float(os.environ.get("HF_SUITES_AGE", "0") or 0)
TRACEBACK_CHARS = 2500

_records: dict[str, dict] = {}
_counts_before: Optional[dict] = None


# -- what overmind did during each test (patched passes only) ----------------------------------


class _OvermindEvents(logging.Handler):
    """Counts overmind's own log records: "not caching X: why" (the call went to the original
    uncached) and anything at INFO or above (fallbacks: the cache failed, the original ran)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.uncached: dict[str, int] = {}
        self.fallbacks: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
        except Exception:
            return
        if message.startswith("not caching "):
            why = message.split(": ", 1)[1] if ": " in message else message
            reason = _reason_class(why)
            self.uncached[reason] = self.uncached.get(reason, 0) + 1
        elif record.levelno >= logging.INFO and record.name.startswith("overmind.api"):
            self.fallbacks.append(message[:300])

    def take(self) -> dict:
        out = {"uncached": self.uncached, "fallbacks": self.fallbacks}
        self.uncached, self.fallbacks = {}, []
        return out


def _reason_class(why: str) -> str:
    """A short class for an Uncacheable reason: its words without paths and numbers
    ("was modified less than s ago", "a file-like argument (BytesIO)")."""
    words = [w for w in why.split() if "/" not in w and not any(c.isdigit() for c in w)]
    return " ".join(words[:8]) or why[:40]


_events = _OvermindEvents()
if PATCHED:
    _overmind_logger = logging.getLogger("overmind")
    _overmind_logger.addHandler(_events)
    _overmind_logger.setLevel(logging.DEBUG)


def _server_counters() -> Optional[dict]:
    """hits/misses/uncacheable... from the private server, or None if it cannot be asked."""
    try:
        from overmind.shared import protocol as P
        from overmind.client.connection import LoadingConnection
        from overmind.shared.settings.config import Config

        conn = LoadingConnection.open(Config.from_env(), autostart=False)
        try:
            info = conn.simple(P.Status(), P.StatusReply, timeout=10).info
        finally:
            conn.close()
        return {k: v for k, v in info.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    except Exception:
        return None


# -- Note [Aged saves] -------------------------------------------------------------------------
# Upstream tests save_pretrained into a fresh temporary folder and load it at once, so nearly
# every load finds files modified less than RACY_SECONDS ago and goes to the original uncached
# (Note [Racy files] in overmind.shared.calls.keys). To make those loads reach the cache, the harness can
# move the times of what a test just saved into the past. Each save gets its own time (now - S,
# in ns), so two saves of one folder still differ, as they would after 2 s of real waiting.

_SAVE_POINTS = (
    ("transformers.modeling_utils", "PreTrainedModel", "save_pretrained"),
    ("transformers.configuration_utils", "PretrainedConfig", "save_pretrained"),
    ("transformers.generation.configuration_utils", "GenerationConfig", "save_pretrained"),
    ("transformers.tokenization_utils_base", "PreTrainedTokenizerBase", "save_pretrained"),
    ("transformers.processing_utils", "ProcessorMixin", "save_pretrained"),
    ("transformers.feature_extraction_utils", "FeatureExtractionMixin", "save_pretrained"),
    ("transformers.image_processing_base", "ImageProcessingMixin", "save_pretrained"),
    ("diffusers.configuration_utils", "ConfigMixin", "save_config"),
    ("diffusers.models.modeling_utils", "ModelMixin", "save_pretrained"),
    ("diffusers.pipelines.pipeline_utils", "DiffusionPipeline", "save_pretrained"),
)
_FILE_SAVES = (("torch", "save"), ("safetensors.torch", "save_file"))


def _age_tree(path: Any) -> None:
    if not isinstance(path, (str, os.PathLike)):
        return
    path = os.fspath(path)
    stamp = time.time_ns() - int(AGE_SECONDS * 1e9)
    if os.path.isfile(path):
        os.utime(path, ns=(stamp, stamp))
        return
    for root, dirs, files in os.walk(path):
        for name in files:
            try:
                os.utime(os.path.join(root, name), ns=(stamp, stamp), follow_symlinks=False)
            except OSError:
                pass
        os.utime(root, ns=(stamp, stamp))


def _aged_method(method, where: str):
    @functools.wraps(method)
    def save(self, *args, **kwargs):
        result = method(self, *args, **kwargs)
        target = args[0] if args else kwargs.get(where, kwargs.get("save_directory"))
        _age_tree(target)
        return result

    save.__hf_suites_aged__ = True
    return save


def _aged_function(function, position: int):
    @functools.wraps(function)
    def save(*args, **kwargs):
        result = function(*args, **kwargs)
        target = args[position] if len(args) > position else kwargs.get("f", kwargs.get("filename"))
        _age_tree(target)
        return result

    save.__hf_suites_aged__ = True
    return save


def _install_aged_saves() -> list[str]:
    """Wrap the save points of the libraries already imported (the tests' modules are, after
    collection); nothing is imported here."""
    done = []
    for module_name, class_name, method_name in _SAVE_POINTS:
        cls = getattr(sys.modules.get(module_name), class_name, None)
        method = cls.__dict__.get(method_name) if cls is not None else None
        if method is None or getattr(method, "__hf_suites_aged__", False):
            continue
        where = "save_directory"
        setattr(cls, method_name, _aged_method(method, where))
        done.append(f"{class_name}.{method_name}")
    for module_name, function_name in _FILE_SAVES:
        module = sys.modules.get(module_name)
        function = getattr(module, function_name, None)
        if function is None or getattr(function, "__hf_suites_aged__", False):
            continue
        setattr(module, function_name, _aged_function(function, 1))
        done.append(f"{module_name}.{function_name}")
    return done


# -- pytest hooks ------------------------------------------------------------------------------


def pytest_collection_modifyitems(session, config, items) -> None:
    if AGE_SECONDS > 0:
        _install_aged_saves()


def pytest_sessionstart(session) -> None:
    global _counts_before
    if PATCHED:
        _counts_before = _server_counters()


def _short_text(report) -> str:
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2])[:300]
    text = getattr(report, "longreprtext", "") or ""
    if len(text) > TRACEBACK_CHARS:
        text = text[:600] + "\n[...]\n" + text[-(TRACEBACK_CHARS - 600):]
    return text


def pytest_runtest_logstart(nodeid, location) -> None:
    _records[nodeid] = {"nodeid": nodeid, "outcome": "passed", "seconds": 0.0}
    if PATCHED:
        _events.take()
        _records[nodeid]["_before"] = _server_counters()


def pytest_runtest_logreport(report) -> None:
    rec = _records.setdefault(report.nodeid, {"nodeid": report.nodeid, "outcome": "passed", "seconds": 0.0})
    rec["seconds"] += report.duration
    if rec["outcome"] != "passed":
        return
    wasxfail = hasattr(report, "wasxfail")
    if report.failed:
        rec["outcome"] = "failed" if report.when == "call" else "error"
        if wasxfail:
            rec["outcome"] = "xpassed"  # strict xfail that passed
        rec["text"] = _short_text(report)
        rec["when"] = report.when
    elif report.skipped:
        rec["outcome"] = "xfailed" if wasxfail else "skipped"
        rec["text"] = _short_text(report)
    elif report.when == "call" and wasxfail:
        rec["outcome"] = "xpassed"


def pytest_runtest_logfinish(nodeid, location) -> None:
    rec = _records.pop(nodeid, None)
    if rec is None:
        return
    before = rec.pop("_before", None)
    if PATCHED:
        events = _events.take()
        after = _server_counters()
        if before and after:
            rec["server"] = {k: after[k] - before.get(k, 0) for k in ("hits", "misses") if k in after}
        if events["uncached"]:
            rec["uncached"] = events["uncached"]
        if events["fallbacks"]:
            rec["fallbacks"] = events["fallbacks"][:5]
    _write(rec)


def pytest_warning_recorded(warning_message, when, nodeid, location) -> None:
    """overmind's own warnings (the first fallback in a process is a RuntimeWarning, later ones are
    log records): pytest reports them after the test's records, so they get a record of their own."""
    text = str(warning_message.message)
    if text.startswith("overmind"):
        _write({"nodeid": f"{nodeid}#overmind-warning", "outcome": "overmind-warning", "seconds": 0.0,
                "text": f"{warning_message.category.__name__}: {text[:300]}"})


def pytest_collectreport(report) -> None:
    if report.failed:
        _write({"nodeid": report.nodeid or "<collection>", "outcome": "collect-error", "seconds": 0.0,
                "text": _short_text(report)})


def pytest_sessionfinish(session, exitstatus) -> None:
    if PATCHED:
        after = _server_counters()
        _write({"nodeid": "<session>", "outcome": "session", "seconds": 0.0, "exitstatus": int(exitstatus),
                "server_before": _counts_before, "server_after": after})


def _write(record: dict) -> None:
    if not RESULTS:
        return
    with open(RESULTS, "a") as f:
        f.write(json.dumps(record, sort_keys=True, default=str) + "\n")
