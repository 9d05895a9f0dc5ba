"""The benchmark's output: the JSON document (``--json``), the terminal table, the plot.

JSON schema, version 1 (``SCHEMA_VERSION``; a change to a key or its meaning bumps it).
Times are seconds, sizes bytes; a summary is ``{"median", "min", "max", "n"}`` over runs::

    {
      "schema_version": 1,
      "tool": "overmind-bench",
      "overmind_version": str,
      "created": str,                      # ISO 8601, UTC
      "command": [str, ...],               # argv of the run
      "about": str|null,                   # --about: what the run is (absent in older files)
      "wall_s": float,                     # the whole run, model generation included
      "machine": {"cpus": int, "memory_bytes": int, "platform": str, "python": str,
                  "versions": {"torch": str, "diffusers": str|null, "transformers": str|null},
                  "cuda_device": str|null},
      "settings": {"quick": bool, "scale": str, "device": str, "runs": int, "warm_runs": int,
                   "modes": [str], "page_cache": [str], "page_cache_method": str|null,
                   "memory_procs": int, "process_per": "scenario"|"run",
                   "cold_mode": "background"|"wait", "cache_dir": str,
                   "imports": [str],            # --imports: what the scripts import after torch
                   "shmem_enabled": str|null,   # the machine's value when the run started
                   "shmem_enabled_runs": [str]},  # --shmem-enabled: the values the loads ran
                                                  # under in turn; [] when not asked
      "startup": null | {"bare_s": summary, "patched_s": summary, "added_s": float},
      "scenarios": [{
          "name": str, "title": str, "why": str,
          "status": "ok"|"skipped"|"failed", "reason": str|null,
          "components": [str],             # the timed calls, in order
          "tensor_bytes": int|null, "file_bytes": int,
          "warm_misses": int,              # misses during warm runs: 0 when every call hit
          "results": [{
              "mode": "plain"|"first"|"cold"|"warm", "page_cache": "warm"|"cold",
              "shmem_enabled": str|null,   # the value this mode's runs ran under
              "runs": [{phase: float}],    # phases: "import", each component, "to_device",
                                           # "total" (components + to_device), "first_use"
              "summary": {phase: summary},
              "x_plain": float|null,       # median total / plain's, same page cache state
                                           # and shmem_enabled
              "x_plain_with_first_use": float|null}]}],
      "memory": [{
          "scenario": str, "procs": int, "tensor_bytes": int|null,
          "status": "ok"|"failed", "reason": str|null,
          "plain": null | holding, "overmind": null | holding}],
      "whole_process": null | {            # overmind.bench.whole; null when not run
          "runs": int, "warmup_runs": int, "modes": [str], "context_var": str,
          "scripts": [{
              "name": str, "title": str, "command": str, "run_command": str,   # as typed
              "models": [str], "loads": int,   # cache calls a run makes
              "tensor_bytes": int|null, "file_bytes": int,
              "status": "ok"|"skipped"|"failed", "reason": str|null,
              "results": [{
                  "mode": "plain"|"patched"|"run"|"first_run", "page_cache": "warm"|"cold",
                  "runs": [{"ready": float|null, "used": float|null, "wall": float,
                            "forked": bool, "hits": int, "misses": int}],
                  "summary": {"ready": summary|null, "used": summary|null, "wall": summary},
                  "x_plain": {"ready": float|null, "used": float|null, "wall": float|null}}]}]},
      "warmup_curve": null | {             # overmind.bench.curve; null when not run
          "rounds": int, "plain_runs": int, "modes": [str], "drop": str|null,
          "scripts": [{
              "name": str, "title": str, "command": str, "page_cache": "warm"|"cold",
              "shmem_enabled": str|null,       # the value its runs ran under
              "status": "ok"|"skipped"|"failed", "reason": str|null,
              "plain": summary|null,           # python's exit, this page cache state: plain_runs
                                               # runs before each mode's, every round
              "modes": [{"mode": "patched"|"dropin"|"run",
                         "runs": [{"run": "1"|...|"5"|"restart",
                                   "runs": [{"wall": float, "ready": float|null, "used": float|null,
                                             "sum": int|null, "hits": int, "misses": int,
                                             "plain_loads": int, "forked": bool, "fallback": bool}],
                                   "wall": summary|null, "x_plain": float|null}]}]}]},
      # The scenarios that run alone, each its runner's results (docstrings of overmind.bench.compiled,
      # .restart and .pressure) plus "status": "ok"|"failed" and "reason": str|null; a failed run
      # keeps what it had measured. Null when not run, absent in files older than these keys.
      "compiled": null | {"status", "reason", "config": {str: int}, "compile_cold_s": float,
          "package_s": float,
          "scripts": {"compile_block"|"aoti_block": {"curve_s": [float],   # overmind run, runs 1-5
              "plain_s": [float], "run_s": [float], "plain_median_s": float, "run_median_s": float,
              "ratio": float, "hang_runs": int, "hung": int}}},
      "restart": null | {"status", "reason", "scale": str, "targets": {str: float},
          "plain": {script: {"ready": float, "exit": float, ...}},    # absent with --stop none
          "stops": {"shutdown"|"sigkill": {"restore_seconds": float, "cold_fill_seconds": float,
              "restore_over_cold_fill": float, "restore": {...}, "cold_fill": {...},
              "next": {"SCRIPT/run"|"SCRIPT/patched": {"ready": float, "exit": float,
                                                       "over_plain": float, "weights_equal": bool}}}},
          "client_during_restore": {"pairs": int, "client": str, "restored_bytes": int,   # absent
              "median_seconds": {"restoring": float, "nothing": float}, "ratio": float, ...}},  # with 0 pairs
      "memory_pressure": null | {"status", "reason", "scale": str, "margin_bytes": int, "hold": float,
          "pairs": int, "ram": int, "swap": int, "available_before": int, "target_bytes": int,
          "job_alone": job, "job_beside_cache": job + {"server_alive": bool, "oom_kills": int|null,
              "min_available_while_cache_held": int|null, "used_before": int|null, "used_min": int|null,
              "used_empty_seconds": float|null, "first_event_after_job_start": float|null,
              "let_go_seconds": float|null, ...},
          "cache": {"entries": int|null, "used": int|null, ...},
          "warm_again": {"seconds": float|null, ...},     # these two absent when the server died
          "runs": {"next_run_exit": float, "plain_before_median": float, "run_over_plain": float,
                   "weights_equal": bool, ...},
          "targets": {name: {"value": any, "op": str, "target": any, "pass": bool|null}}}
    }

where ``holding`` is ``{"pss_bytes": int, "used_bytes": int, "pss_ratio": float,
"used_ratio": float, "pss_before_bytes": int, "pss_after_bytes": int, "load_s": summary}``:
the growth of the holders' summed PSS (plus the server's process tree, for overmind) and of
the machine's used memory (MemTotal - MemAvailable) while K processes load and hold the
model, and each over ``tensor_bytes``. In ``whole_process``, times count from just before a
fresh process is started from the shell (the bench) to its model ready (loaded and moved,
``ready``), to every page of every weight read (``used``) and to its exit (``wall``); a run
without a model (``-c "import ..."``) has only ``wall``. ``forked``: the server forked it from a
warm interpreter; ``hits``/``misses``/``plain_loads``: the server's counters over the run (a
plain load found its key filling and loaded beside it). ``x_plain`` divides
each median by plain's, same page cache state. In ``warmup_curve``, one entry per round of
the curve's run ``run`` (1 to 5 back to back from a fresh server and an empty cache,
``restart`` after the server was restarted); ``sum``: the bytes the script read from its
weights (one per page), equal to plain's in every run; ``x_plain``: the median exit over
plain's median. In ``memory_pressure``, ``job`` is ``{"got": int, "target": int|null,
"min_available": int|null, "stopped_early": str|null, "grow_seconds": float|null, "seconds":
float|null, "wall_seconds": float, "returncode": int|null, "killed_by_signal": int|null}``. The
document of a scenario that runs alone (:mod:`overmind.bench.alone`) has no other results.
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
from pathlib import Path
from typing import Any, Optional

from overmind.bench.harness import summary

__all__ = ["SCHEMA_VERSION", "PHASES_AFTER", "ALONE", "document", "format_tables", "plot", "validate"]

SCHEMA_VERSION = 1
ALONE = ("compiled", "restart", "memory_pressure")  # scenarios that run alone, each with its own runner
PHASES_AFTER = ("to_device", "total", "first_use")  # after a scenario's own components
MODE_LABELS = {"plain": "plain", "first": "overmind first", "cold": "overmind cold", "warm": "overmind warm"}
WHOLE_LABELS = {"plain": "python", "patched": "python + monkey_patch_all()", "run": "overmind run",
                "first_run": "overmind run, new context", "dropin": "the same, OVERMIND_WARM_START=0"}


def _versions() -> dict:
    from importlib import metadata

    out: dict[str, Optional[str]] = {}
    for name in ("torch", "diffusers", "transformers"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def document(plan, results: dict, startup: Optional[dict], *, cache_dir: Path, wall_s: float,
             cuda_device: Optional[str], argv: list[str], whole: Optional[dict] = None,
             curve: Optional[dict] = None, shmem_enabled: Optional[str] = None,
             about: Optional[str] = None, alone: Optional[dict] = None) -> dict:
    """The JSON document of a run (schema in the module docstring). ``shmem_enabled``: the
    machine's value when the run started; ``about``: ``--about``; ``alone``: name (of
    :data:`ALONE`) -> the results of a scenario that runs alone."""
    from overmind import __version__

    scenarios = []
    for scenario in plan.scenarios:
        entry = results["scenarios"].get(scenario.name)
        item: dict[str, Any] = {
            "name": scenario.name, "title": scenario.title, "why": scenario.why,
            "status": "ok", "reason": None, "components": list(scenario.components),
            "tensor_bytes": None, "file_bytes": 0, "warm_misses": 0, "results": [],
        }
        if scenario.name in plan.skipped:
            item.update(status="skipped", reason=plan.skipped[scenario.name])
        elif entry is not None:
            item.update(status=entry["status"], reason=entry["reason"], tensor_bytes=entry["tensor_bytes"],
                        file_bytes=entry["file_bytes"], warm_misses=entry["warm_misses"])
            with_use = {}  # (mode, page cache, shmem_enabled) -> median of total + first use
            for (mode, cache_state, setting), runs in entry["runs"].items():
                phases = [p for p in runs[0] if all(p in r for r in runs)]
                with_use[mode, cache_state, setting] = statistics.median(r["total"] + r["first_use"] for r in runs)
                item["results"].append({"mode": mode, "page_cache": cache_state, "shmem_enabled": setting,
                                        "runs": [{p: r[p] for p in phases} for r in runs],
                                        "summary": {p: summary([r[p] for r in runs]) for p in phases},
                                        "x_plain": None, "x_plain_with_first_use": None})
            order = {m: i for i, m in enumerate(plan.modes)}
            settings_order = {v: i for i, v in enumerate(plan.shmem_settings)}
            item["results"].sort(key=lambda r: (plan.page_cache.index(r["page_cache"]),
                                                settings_order.get(r["shmem_enabled"], -1), order[r["mode"]]))
            for r in item["results"]:
                base = next((b for b in item["results"] if b["mode"] == "plain" and b["page_cache"] == r["page_cache"]
                             and b["shmem_enabled"] == r["shmem_enabled"]), None)
                if base is not None:
                    r["x_plain"] = r["summary"]["total"]["median"] / base["summary"]["total"]["median"]
                    r["x_plain_with_first_use"] = (with_use[r["mode"], r["page_cache"], r["shmem_enabled"]]
                                                   / with_use["plain", r["page_cache"], r["shmem_enabled"]])
        scenarios.append(item)
    return {
        "schema_version": SCHEMA_VERSION,
        "tool": "overmind-bench",
        "overmind_version": __version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": list(argv),
        "about": about,
        "wall_s": wall_s,
        "machine": {"cpus": os.cpu_count() or 0,
                    "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
                    "platform": platform.platform(), "python": platform.python_version(), "versions": _versions(),
                    "cuda_device": cuda_device},
        "settings": {"quick": plan.quick, "scale": plan.scale, "device": plan.device, "runs": plan.runs,
                     "warm_runs": plan.warm_runs, "modes": list(plan.modes), "page_cache": list(plan.page_cache),
                     "page_cache_method": plan.page_cache_method, "memory_procs": plan.memory_procs,
                     "process_per": plan.process_per, "cold_mode": plan.cold_mode, "cache_dir": str(cache_dir),
                     "shmem_enabled": shmem_enabled, "shmem_enabled_runs": list(plan.shmem_settings),
                     "imports": list(plan.script_imports)},
        "startup": None if startup is None else {
            "bare_s": summary(startup["bare_s"]), "patched_s": summary(startup["patched_s"]),
            "added_s": startup["added_s"]},
        "scenarios": scenarios,
        "memory": [{**{k: m.get(k) for k in ("scenario", "procs", "tensor_bytes", "status", "reason")},
                    "plain": m.get("plain"), "overmind": m.get("overmind")} for m in results["memory"]],
        "whole_process": None if whole is None else _whole_document(plan, whole),
        "warmup_curve": None if curve is None else _curve_document(plan, curve),
        **{name: (alone or {}).get(name) for name in ALONE},
    }


def _whole_document(plan, whole: dict) -> dict:
    from overmind.bench.whole import CONTEXT_VAR, summarize

    return {"runs": plan.whole_runs, "warmup_runs": plan.whole_warmup, "modes": list(plan.whole_modes),
            "context_var": CONTEXT_VAR, "scripts": summarize(whole, plan)}


def _curve_document(plan, curve: dict) -> dict:
    from overmind.bench.curve import summarize

    return {"rounds": plan.curve_rounds, "plain_runs": plan.curve_plain, "modes": list(plan.curve_modes),
            "drop": plan.curve_drop, "scripts": summarize(curve, plan)}


# -- validation -------------------------------------------------------------------------------

_NUM = (int, float)
_SUMMARY = {"median": _NUM, "min": _NUM, "max": _NUM, "n": int}


def validate(doc: dict) -> None:
    """Raise ``ValueError`` naming the first place ``doc`` departs from the schema."""

    def check(value, kind, where: str) -> None:
        if isinstance(kind, dict):
            if not isinstance(value, dict):
                raise ValueError(f"{where}: expected an object, got {type(value).__name__}")
            missing = {k for k in kind if not k.endswith("?")} - set(value)  # "key?": may be absent
            if missing:
                raise ValueError(f"{where}: missing {sorted(missing)}")
            for key, sub in kind.items():
                if key.rstrip("?") in value:
                    check(value[key.rstrip("?")], sub, f"{where}.{key.rstrip('?')}")
        elif isinstance(kind, list):
            if not isinstance(value, list):
                raise ValueError(f"{where}: expected a list, got {type(value).__name__}")
            for i, item in enumerate(value):
                check(item, kind[0], f"{where}[{i}]")
        elif callable(kind) and not isinstance(kind, type) and not isinstance(kind, tuple):
            kind(value, where)
        else:
            kinds = kind if isinstance(kind, tuple) else (kind,)
            if isinstance(value, bool) and bool not in kinds:
                raise ValueError(f"{where}: expected {kinds}, got bool")
            if not isinstance(value, kinds):
                raise ValueError(f"{where}: expected {'/'.join(k.__name__ for k in kinds)}, got {type(value).__name__}")

    def one_of(*choices):
        def check_choice(value, where):
            if value not in choices:
                raise ValueError(f"{where}: {value!r} is not one of {choices}")
        return check_choice

    def optional(kind):
        def check_optional(value, where):
            if value is not None:
                check(value, kind, where)
        return check_optional

    def phases(kind):
        def check_phases(value, where):
            check(value, dict, where)
            for name in ("import", "total", "first_use", "to_device"):
                if name not in value:
                    raise ValueError(f"{where}: missing phase {name!r}")
            for name, item in value.items():
                check(item, kind, f"{where}.{name}")
        return check_phases

    def each(kind):  # an object of any keys, each value a ``kind``
        def check_each(value, where):
            check(value, dict, where)
            for key, item in value.items():
                check(item, kind, f"{where}.{key}")
        return check_each

    def ran(kind):  # a scenario that runs alone: its figures when it ran to the end
        def check_ran(value, where):
            check(value, {"status": one_of("ok", "failed"), "reason": optional(str)}, where)
            if value["status"] == "ok":
                check(value, kind, where)
        return check_ran

    holding = optional({"pss_bytes": int, "used_bytes": int, "pss_ratio": _NUM, "used_ratio": _NUM,
                        "pss_before_bytes": int, "pss_after_bytes": int, "load_s": _SUMMARY})
    times = {"ready": optional(_NUM), "used": optional(_NUM), "wall": _NUM}
    whole = optional({
        "runs": int, "warmup_runs": int, "modes": [one_of("plain", "patched", "run", "first_run")],
        "context_var": str,
        "scripts": [{"name": str, "title": str, "command": str, "run_command": str, "models": [str], "loads": int,
                     "tensor_bytes": optional(int), "file_bytes": int, "status": one_of("ok", "skipped", "failed"),
                     "reason": optional(str),
                     "results": [{"mode": one_of("plain", "patched", "run", "first_run"),
                                  "page_cache": one_of("warm", "cold"),
                                  "runs": [{**times, "forked": bool, "hits": int, "misses": int,
                                            "plain_loads": int}],
                                  "summary": {"ready": optional(_SUMMARY), "used": optional(_SUMMARY),
                                              "wall": _SUMMARY},
                                  "x_plain": {k: optional(_NUM) for k in times}}]}]})
    curve = optional({
        "rounds": int, "plain_runs": int, "modes": [one_of("patched", "dropin", "run")], "drop": optional(str),
        "scripts": [{"name": str, "title": str, "command": str, "page_cache": one_of("warm", "cold"),
                     "shmem_enabled": optional(str), "status": one_of("ok", "skipped", "failed"),
                     "reason": optional(str), "plain": optional(_SUMMARY),
                     "modes": [{"mode": one_of("patched", "dropin", "run"),
                                "runs": [{"run": one_of("1", "2", "3", "4", "5", "restart"),
                                          "runs": [{"wall": _NUM, "ready": optional(_NUM), "used": optional(_NUM),
                                                    "sum": optional(int), "hits": int, "misses": int,
                                                    "plain_loads": int, "forked": bool, "fallback": bool}],
                                          "wall": optional(_SUMMARY), "x_plain": optional(_NUM)}]}]}]})
    schema = {
        "schema_version": one_of(SCHEMA_VERSION), "tool": one_of("overmind-bench"), "overmind_version": str,
        "created": str, "command": [str], "wall_s": _NUM,
        "machine": {"cpus": int, "memory_bytes": int, "platform": str, "python": str,
                    "versions": {"torch": optional(str), "diffusers": optional(str), "transformers": optional(str)},
                    "cuda_device": optional(str)},
        "settings": {"quick": bool, "scale": str, "device": str, "runs": int, "warm_runs": int, "modes": [str],
                     "page_cache": [one_of("warm", "cold")], "page_cache_method": optional(str),
                     "memory_procs": int, "process_per": one_of("scenario", "run"),
                     "cold_mode": one_of("background", "wait"), "cache_dir": str,
                     "shmem_enabled": optional(str), "shmem_enabled_runs": [str]},
        "startup": optional({"bare_s": _SUMMARY, "patched_s": _SUMMARY, "added_s": _NUM}),
        "scenarios": [{
            "name": str, "title": str, "why": str, "status": one_of("ok", "skipped", "failed"),
            "reason": optional(str), "components": [str], "tensor_bytes": optional(int), "file_bytes": int,
            "warm_misses": int,
            "results": [{"mode": one_of("plain", "first", "cold", "warm"), "page_cache": one_of("warm", "cold"),
                         "shmem_enabled": optional(str), "runs": [phases(_NUM)], "summary": phases(_SUMMARY),
                         "x_plain": optional(_NUM),
                         "x_plain_with_first_use": optional(_NUM)}]}],
        "memory": [{"scenario": str, "procs": int, "tensor_bytes": optional(int),
                    "status": one_of("ok", "failed"), "reason": optional(str), "plain": holding,
                    "overmind": holding}],
        "whole_process": whole,
        "warmup_curve": curve,
        "about?": optional(str),  # files written before --about have none
        **{f"{name}?": optional(ran(kind)) for name, kind in _alone_schema(each).items()},
    }
    check(doc, schema, "$")


def _alone_schema(each) -> dict:
    """What validate checks of the scenarios that run alone, once they ran to the end."""
    int_, num = (int, type(None)), (int, float, type(None))  # or null
    job = {"got": int, "target": int_, "min_available": int_, "stopped_early": (str, type(None)),
           "grow_seconds": num, "wall_seconds": _NUM, "returncode": int_}
    beside = {**job, "server_alive": bool,
              **dict.fromkeys(("oom_kills", "min_available_while_cache_held", "used_before", "used_min"), int_),
              **dict.fromkeys(("used_empty_seconds", "first_event_after_job_start", "let_go_seconds"), num)}
    return {
        "compiled": {"config": each(int), "compile_cold_s": _NUM, "package_s": _NUM,
                     "scripts": each({"curve_s": [_NUM], "plain_s": [_NUM], "run_s": [_NUM], "plain_median_s": _NUM,
                                      "run_median_s": _NUM, "ratio": _NUM, "hang_runs": int, "hung": int})},
        "restart": {"scale": str, "targets": each(_NUM), "plain?": each({"ready": _NUM, "exit": _NUM}),
                    "stops?": each({"restore_seconds": _NUM, "cold_fill_seconds": _NUM, "restore_over_cold_fill": _NUM,
                                    "next": each({"ready": _NUM, "exit": _NUM, "over_plain": _NUM,
                                                  "weights_equal": bool})}),
                    "client_during_restore?": {"pairs": int, "restored_bytes": int, "ratio": _NUM,
                                               "median_seconds": {"restoring": _NUM, "nothing": _NUM}}},
        "memory_pressure": {
            "scale": str, "margin_bytes": int, "hold": _NUM, "pairs": int, "available_before": int,
            "target_bytes": int, "job_alone": job,
            "job_beside_cache": beside, "cache": {"entries": int_, "used": int_},
            "warm_again?": {"seconds": num},  # these two absent when the server died
            "runs?": {"next_run_exit": _NUM, "plain_before_median": _NUM, "run_over_plain": _NUM,
                      "weights_equal": bool},
            "targets": each({"op": str, "pass": (bool, type(None))})}}


# -- the terminal table -----------------------------------------------------------------------


def _gb(n: Optional[float]) -> str:
    return "-" if n is None else f"{n / 1e9:.2f} GB" if abs(n) >= 1e8 else f"{n / 1e6:.1f} MB"


def _s(x: float) -> str:
    return f"{x:.3f}" if x < 10 else f"{x:.1f}"


def slowest_cells(sc: dict, r: dict) -> list[str]:
    """A mode's slowest run, its own figures (not each column's maximum), then its total over plain's median."""
    slow, x = max(r["runs"], key=lambda run: run["total"]), r["x_plain"]
    cells = [_s(slow[c]) if c in slow else "-" for c in ("import", *sc["components"], "to_device", "total", "first_use")]
    return cells + ["-" if x is None else f"{x * slow['total'] / r['summary']['total']['median']:.3f}"]


def _grid(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip()
             for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_tables(doc: dict) -> str:
    settings, out = doc["settings"], []
    device = settings["device"]
    per = ("one process per mode and run, scenarios in turn" if settings["process_per"] == "run"
           else "a fresh process per run")
    loads = f", {per}; seconds, median (min-max) of {settings['runs']} runs (warm: {settings['warm_runs']}); " \
        "import = interpreter start to libraries imported" if doc["scenarios"] else ""
    out.append(f"overmind-bench: scale {settings['scale']}, device {device}{loads}")
    if settings["page_cache_method"]:
        out.append(f"page cache cold: {settings['page_cache_method']} on every file of the model before each run")
    out.append(_shmem_line(settings))
    if doc.get("warmup_curve"):
        out += ["", format_curve(doc["warmup_curve"])]
    if doc.get("whole_process"):
        out += ["", format_whole(doc["whole_process"])]
    for sc in doc["scenarios"]:
        size = f"{_gb(sc['tensor_bytes'])} of tensors" if sc["tensor_bytes"] else ""
        out += ["", f"{sc['name']}: {sc['title']}" + (f"; {size}" if size else "")
                + (f" ({sc['why']})" if sc["why"] else "")]
        if sc["status"] != "ok":
            out.append(f"  {sc['status']}: {sc['reason']}")
            if not sc["results"]:
                continue
        caches = {r["page_cache"] for r in sc["results"]}
        shmem_values = {r["shmem_enabled"] for r in sc["results"]}
        rows = [["mode", "import", *sc["components"], f"to({device})", "total", "first use", "x plain",
                 "x plain +use"]]
        for r in sc["results"]:
            s = r["summary"]
            label = (MODE_LABELS[r["mode"]] + (f", page cache {r['page_cache']}" if len(caches) > 1 else "")
                     + (f", shmem {r['shmem_enabled']}" if len(shmem_values) > 1 else ""))
            total = s["total"]
            rows.append([label, _s(s["import"]["median"]),
                         *[_s(s[c]["median"]) if c in s else "-" for c in sc["components"]],
                         _s(s["to_device"]["median"]),
                         f"{_s(total['median'])} ({_s(total['min'])}-{_s(total['max'])})",
                         _s(s["first_use"]["median"]),
                         "-" if r["x_plain"] is None else f"{r['x_plain']:.3f}",
                         "-" if r["x_plain_with_first_use"] is None else f"{r['x_plain_with_first_use']:.3f}"])
            if r["mode"] == "warm" and total["n"] > 1:  # a hit is fast in every run, not only in most
                rows.append(["  its slowest run", *slowest_cells(sc, r), ""])
        out.append(_grid(rows))
        if sc["warm_misses"]:
            out.append(f"  warning: {sc['warm_misses']} warm call(s) missed the cache")
    if doc["memory"]:
        procs = doc["memory"][0]["procs"]
        out.append("")
        out.append(f"memory: {procs} processes load and hold the model (every weight touched); growth of their "
                   "summed PSS (+ the server, for overmind) and of the machine's used memory (MemTotal - MemAvailable: "
                   "shared memory counts, page cache does not), and each over the tensor bytes")
        rows = [["model", "tensor bytes", "plain PSS", "overmind PSS", "plain used", "overmind used"]]
        for m in doc["memory"]:
            if m["status"] != "ok":
                rows.append([m["scenario"], _gb(m["tensor_bytes"]), m["status"], m["reason"].splitlines()[0][:60], "",
                             ""])
                continue
            p, o = m["plain"], m["overmind"]
            rows.append([m["scenario"], _gb(m["tensor_bytes"]),
                         *(f"{_gb(h[kind + '_bytes'])} ({h[kind + '_ratio']:.2f}x)" for kind in ("pss", "used")
                           for h in (p, o))])
        out.append(_grid(rows))
    if doc["startup"]:
        st = doc["startup"]
        out.append("")
        out.append(f"start-up: `import overmind.api; overmind.api.monkey_patch_all()` adds "
                   f"{st['added_s'] * 1000:.1f} ms to a fresh interpreter (median of {st['bare_s']['n']}: "
                   f"{st['bare_s']['median'] * 1000:.1f} ms bare, "
                   f"{st['patched_s']['median'] * 1000:.1f} ms patched)")
    out.append("")
    out.append(f"wall time {doc['wall_s']:.0f} s")
    return "\n".join(out)


def _shmem_line(settings: dict) -> str:
    from overmind.shared.segments.hugepages import ALLOWING

    value = settings["shmem_enabled"]
    if settings["shmem_enabled_runs"]:
        return (f"shmem_enabled (huge pages for overmind's segments): load scenarios run under "
                f"{', '.join(settings['shmem_enabled_runs'])} in turn; {value} otherwise and restored after")
    if value is None:
        return "shmem_enabled: unknown (no /sys/kernel/mm/transparent_hugepage/shmem_enabled): small pages"
    pages = "huge pages where the kernel has them" if value in ALLOWING else "small (4 KiB) pages"
    return f"shmem_enabled: {value}: overmind's segments use {pages}"


def format_curve(curve: dict) -> str:
    """The warm-up curve: one block per script and page cache state, a row per mode."""
    drop = {"posix_fadvise": "the model's files evicted before every run (posix_fadvise)",
            "drop_caches": "the whole page cache dropped before every run (/proc/sys/vm/drop_caches)"}
    out = [f"warm-up curve: runs 1-5 of a script back to back from a fresh server and an empty cache, then one "
           f"after a server restart; each run's exit (whole process, from the shell) over python's median; "
           f"median of {curve['rounds']} rounds; python: {curve['plain_runs']} runs before each mode's, every round"]
    for sc in curve["scripts"]:
        state = "warm" if sc["page_cache"] == "warm" else drop.get(curve["drop"] or "", "cold")
        plain = f"; python {_s(sc['plain']['median'])} s" if sc["plain"] else ""
        out += ["", f"{sc['name']}: `{sc['command']}`, page cache {state}, shmem_enabled {sc['shmem_enabled']}{plain}"]
        if sc["status"] != "ok":
            out.append(f"  {sc['status']}: {(sc['reason'] or '').splitlines()[0] if sc['reason'] else ''}")
        rows = [["mode", "1", "2", "3", "4", "5", "after restart"]]
        for m in sc["modes"]:
            rows.append([WHOLE_LABELS[m["mode"]],
                         *("-" if r["x_plain"] is None else f"{r['x_plain']:.2f}" for r in m["runs"])])
        if len(rows) > 1:
            out.append(_grid(rows))
    return "\n".join(out)


def format_whole(whole: dict) -> str:
    """The whole-process table: one block per script, a row per mode and page cache state."""
    out = [f"whole process: a script started from the shell as a fresh process; seconds from its start to "
           f"its model ready (loaded, .to('cpu')), to every page of every weight read (used) and to its exit; "
           f"median of {whole['runs']} runs, min-max of exit in brackets; x plain: median over python's",
           "modes: python SCRIPT | python SCRIPT calling monkey_patch_all() after its own import (the drop-in, "
           "never handed over), cache warm | overmind run "
           "SCRIPT, cache and interpreter warm | overmind run SCRIPT in a new context (no warm interpreter: runs "
           f"plainly while the server starts one; a fresh {whole['context_var']} each run)"]
    for sc in whole["scripts"]:
        size = f"; {_gb(sc['tensor_bytes'])} of tensors" if sc["tensor_bytes"] else ""
        out += ["", f"{sc['name']}: `{sc['command']}`: {sc['title']}{size}"]
        if sc["status"] != "ok":
            out.append(f"  {sc['status']}: {(sc['reason'] or '').splitlines()[0] if sc['reason'] else ''}")
            if not sc["results"]:
                continue
        caches = {r["page_cache"] for r in sc["results"]}
        rows = [["mode", "ready", "used", "exit", "x plain ready", "x plain used", "x plain exit"]]
        for r in sc["results"]:
            s, x = r["summary"], r["x_plain"]
            wall = s["wall"]
            rows.append([WHOLE_LABELS[r["mode"]] + (f", page cache {r['page_cache']}" if len(caches) > 1 else ""),
                         *("-" if s[k] is None else _s(s[k]["median"]) for k in ("ready", "used")),
                         f"{_s(wall['median'])} ({_s(wall['min'])}-{_s(wall['max'])})",
                         *("-" if x[k] is None else f"{x[k]:.3f}" for k in ("ready", "used", "wall"))])
        out.append(_grid(rows))
    return "\n".join(out)


# -- the plot ---------------------------------------------------------------------------------


def plot(doc: dict, path: Path) -> None:
    """A bar chart of the phases: one panel per scenario, one stacked bar per mode."""
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install 'overmind[bench]' (or pip install matplotlib)") \
            from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [sc for sc in doc["scenarios"] if sc["results"]]
    if not panels:
        raise RuntimeError("--plot: no scenario has results to draw")
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 1.2 + 1.1 * sum(len(sc["results"]) for sc in panels)),
                             squeeze=False)
    colors = plt.get_cmap("tab10").colors
    for ax, sc in zip(axes[:, 0], panels):
        phases = [*sc["components"], "to_device", "first_use"]
        labels = [MODE_LABELS[r["mode"]] + ("" if len({x["page_cache"] for x in sc["results"]}) == 1
                                            else f"\npage cache {r['page_cache']}")
                  + ("" if len({x["shmem_enabled"] for x in sc["results"]}) == 1
                     else f"\nshmem {r['shmem_enabled']}") for r in sc["results"]]
        left = [0.0] * len(sc["results"])
        for i, phase in enumerate(phases):
            widths = [r["summary"][phase]["median"] if phase in r["summary"] else 0.0 for r in sc["results"]]
            name = "to(device)" if phase == "to_device" else "first use" if phase == "first_use" else phase
            ax.barh(labels, widths, left=left, color=colors[i % len(colors)], label=name,
                    hatch="//" if phase == "first_use" else None, edgecolor="white")
            left = [a + b for a, b in zip(left, widths)]
        for y, (r, x) in enumerate(zip(sc["results"], left)):
            ratio = "" if r["x_plain"] is None or r["mode"] == "plain" else f"  {r['x_plain']:.3f} x plain"
            ax.text(x, y, f" {r['summary']['total']['median']:.3f} s{ratio}", va="center", fontsize=8)
        ax.invert_yaxis()
        ax.set_title(f"{sc['name']}: {_gb(sc['tensor_bytes'])}", fontsize=10, loc="left")
        ax.set_xlabel("seconds (median); import not shown")
        ax.set_xlim(0, max(left) * 1.45 or 1)
        ax.legend(fontsize=7, loc="lower right", ncol=len(phases))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
