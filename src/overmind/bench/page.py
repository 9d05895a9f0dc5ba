"""docs/benchmarks.md, generated: the manual beside this module (``page.md``) with the results
of overmind-bench runs (their ``--json`` files) put in where it asks for them.

    overmind-bench --report docs/results/*.json --output docs/benchmarks.md    # or: make docs
    overmind-bench --report bench.json                                          # to stdout

The template is Markdown with lines of their own that the page replaces: ``{{generated}}``
(what made the page and from which files) and ``{{results NAME}}``, NAME one of
:data:`SECTIONS`. A results section gives, for every file that has results of its kind, the
exact command that made them, the date, the machine (cores, memory, platform, Python and the
library versions), the overmind version and the settings; its tables; and a sentence of what
the figures mean for a user. A kind no file has results for says so and gives the command that
makes them. The scenarios that run alone have their sections in :mod:`overmind.bench.page_alone`.
Nothing here measures or reads the clock: the same files and template give the
same bytes, which ``tests/unit/test_bench_report.py`` checks against the committed page.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from overmind.bench import page_alone
from overmind.bench.page_parts import Result, first_line, ratio, spread, status_lines, table, wrap
from overmind.bench.report import MODE_LABELS, _gb, _s, slowest_cells, validate
from overmind.bench.scenarios import LOAD_SCENARIOS

__all__ = ["SECTIONS", "TEMPLATE", "Result", "load", "render", "command_line", "main"]

TEMPLATE = Path(__file__).with_name("page.md")
PLACEHOLDER = re.compile(r"^\{\{ *(\w+)(?: +(\w+))? *\}\}$")
CURVE_LABELS = {"patched": "the one line", "dropin": "the one line, `OVERMIND_WARM_START=0`",
                "run": "`overmind run`"}
CURVE_PHRASES = {"run": "with `overmind run`", "patched": "with the one line",
                 "dropin": "with the loads alone (the one line, `OVERMIND_WARM_START=0`)"}
WHOLE_LABELS = {"plain": "`python`", "patched": "`python` + `monkey_patch_all()`", "run": "`overmind run`",
                "first_run": "`overmind run`, new context"}
WHOLE_PHRASES = {"patched": "with `monkey_patch_all()`", "run": "with `overmind run`",
                 "first_run": "with the first `overmind run` of a new context"}
NAMED_LOADS = tuple(n for n in LOAD_SCENARIOS if n != "custom")
def load(paths: list[str]) -> list[Result]:
    """The results files, validated against overmind.bench.report's schema; ValueError names
    the file that is not one."""
    results = []
    for path in paths:
        try:
            doc = json.loads(Path(path).read_text())
            validate(doc)
        except (OSError, ValueError) as err:
            raise ValueError(f"{path}: not an overmind-bench --json result: {err}") from None
        results.append(Result(path, doc))
    return results


def command_line(paths: list[str], output: Optional[str]) -> str:
    """The command that makes the page, as typed: every JSON file of one folder reads as a glob."""
    folders = {os.path.dirname(p) for p in paths}
    shown = [shlex.quote(p) for p in paths]
    if len(folders) == 1 and paths:
        folder = folders.pop()
        every = sorted(str(p) for p in Path(folder or ".").glob("*.json"))
        if every and sorted(os.path.normpath(p) for p in paths) == [os.path.normpath(p) for p in every]:
            shown = [os.path.join(folder, "*.json")]
    return " ".join(["overmind-bench", "--report", *shown, *(["--output", output] if output else [])])


# -- pieces ------------------------------------------------------------------------------------


def _link(result: Result, output: Optional[str]) -> str:
    target = os.path.relpath(result.label, os.path.dirname(output) or ".") if output else result.label
    return f"[{os.path.basename(result.label)}]({target})"


def _machine(doc: dict) -> str:
    m = doc["machine"]
    libraries = ", ".join(f"{name} {version}" for name, version in m["versions"].items() if version)
    gpu = f", GPU {m['cuda_device']}" if m["cuda_device"] else ", no GPU used"
    return (f"{m['cpus']} cores, {m['memory_bytes'] / 2**30:.1f} GiB, {m['platform']}, Python {m['python']}"
            f"{', ' + libraries if libraries else ''}{gpu}")


def _settings(doc: dict) -> str:
    s = doc["settings"]
    imports = s.get("imports") or []
    scale = [] if doc.get("compiled") else [f"scale {s['scale']}" + (" (--quick)" if s["quick"] else "")]
    parts = [*scale, f"device {s['device']}", f"shmem_enabled {s['shmem_enabled'] or 'unknown'}"]
    if imports:
        parts.append(f"the scripts import {', '.join(imports)} after torch")
    return ", ".join(parts)


def provenance(result: Result, output: Optional[str]) -> list[str]:
    """What a figure comes with: the command, the date, the version, the machine, the settings."""
    doc = result.doc
    lines = [f"### {_link(result, output)}", ""]
    if doc.get("about"):
        lines += [*wrap(doc["about"]), ""]
    took = f"{doc['wall_s'] / 60:.0f} min" if doc["wall_s"] >= 60 else f"{doc['wall_s']:.0f} s"
    for item in (f"Command: `{shlex.join(doc['command'])}`",
                 f"Measured {doc['created'][:10]} with overmind {doc['overmind_version']}, in {took}",
                 f"Machine: {_machine(doc)}", f"Settings: {_settings(doc)}"):
        lines += wrap(item, "- ", "  ")
    return lines + [""]
# -- the warm-up curve -------------------------------------------------------------------------


def _after_first(mode: dict) -> list[dict]:
    return [r for r in mode["runs"] if r["run"] != "1"]


def _hits(mode: dict) -> tuple[str, str]:
    runs = [x for r in _after_first(mode) for x in r["runs"]]
    forked = sum(x["forked"] for x in runs)
    hits = sum(x["hits"] for x in runs)
    loads = sum(x["hits"] + x["misses"] + x["plain_loads"] for x in runs)
    return f"{forked} of {len(runs)}", f"{hits} of {loads}"


def curve_section(result: Result) -> list[str]:
    curve, out = result.doc["warmup_curve"], []
    drop = {"posix_fadvise": "the model's files evicted before every run",
            "drop_caches": "the whole page cache dropped before every run"}
    out += wrap(f"Runs 1-5 back to back from a fresh server, then one after a restart, each over plain python's "
                 f"median in the same round; median of {curve['rounds']} rounds. Forked and hits: over runs 2-5 "
                 "and the restart, every round.")
    for sc in curve["scripts"]:
        state = "warm" if sc["page_cache"] == "warm" else drop.get(curve["drop"] or "", "cold")
        plain = f", plain python {sc['plain']['median']:.1f} s" if sc["plain"] else ""
        out += ["", *wrap(f"**{sc['name']}** (`{sc['command']}`: {sc['title']}; page cache {state}{plain})"), ""]
        out += status_lines(sc)
        rows = [["mode", "1", "2", "3", "4", "5", "after a restart", "forked", "loads that hit"]]
        for m in sc["modes"]:
            rows.append([CURVE_LABELS[m["mode"]], *(ratio(r["x_plain"]) for r in m["runs"]), *_hits(m)])
        if len(rows) > 1:
            out += table(rows) + [""]
        out += wrap("What it means: " + curve_meaning(sc))
    return out


def curve_meaning(sc: dict) -> str:
    done = [m for m in sc["modes"] if any(r["x_plain"] is not None for r in _after_first(m))]
    if sc["status"] != "ok" or not done or not sc["plain"]:
        return f"no figure: this curve {sc['status'] if sc['status'] != 'ok' else 'has no runs'}."
    firsts = [r["x_plain"] for m in sc["modes"] for r in m["runs"] if r["run"] == "1" and r["x_plain"] is not None]
    first = f"run 1, which fills the cache, took {spread(firsts)} x plain python; " if firsts else ""
    parts = []
    for m in sorted(done, key=lambda m: list(CURVE_PHRASES).index(m["mode"])):
        after = [r for r in _after_first(m) if r["x_plain"] is not None]
        seconds = [r["wall"]["median"] for r in after if r["wall"]]
        parts.append(f"{spread([r['x_plain'] for r in after])} x" + (f" ({spread(seconds, 1)} s)" if seconds else "")
                     + f" {CURVE_PHRASES[m['mode']]}")
    return (f"{first}every run of `{sc['command']}` after it took " + ", ".join(parts)
            + f", against plain python's {sc['plain']['median']:.1f} s.")


# -- the whole process -------------------------------------------------------------------------


def whole_section(result: Result) -> list[str]:
    whole, out = result.doc["whole_process"], []
    out += wrap(f"Seconds from the shell's start of the process to its model ready, to every weight used and to "
                 f"its exit, median of {whole['runs']} runs (exit's min-max in brackets); x plain: exit over "
                 "plain python's, same page cache state.")
    for sc in whole["scripts"]:
        size = f", {_gb(sc['tensor_bytes'])} of tensors" if sc["tensor_bytes"] else ""
        out += ["", *wrap(f"**{sc['name']}** (`{sc['command']}`: {sc['title']}{size})"), ""]
        out += status_lines(sc)
        rows = [["mode", "page cache", "ready", "used", "exit", "x plain"]]
        for r in sc["results"]:
            s, wall = r["summary"], r["summary"]["wall"]
            rows.append([WHOLE_LABELS[r["mode"]], r["page_cache"],
                         *("-" if s[k] is None else _s(s[k]["median"]) for k in ("ready", "used")),
                         f"{_s(wall['median'])} ({_s(wall['min'])}-{_s(wall['max'])})", ratio(r["x_plain"]["wall"], 3)])
        if len(rows) > 1:
            out += table(rows) + [""]
        out += wrap("What it means: " + whole_meaning(sc))
    return out


def whole_meaning(sc: dict) -> str:
    warm = [r for r in sc["results"] if r["page_cache"] == "warm"]
    plain = next((r for r in warm if r["mode"] == "plain"), None)
    others = [r for r in warm if r["mode"] != "plain" and r["x_plain"]["wall"] is not None]
    if sc["status"] != "ok" or plain is None or not others:
        return f"no figure: this script {sc['status'] if sc['status'] != 'ok' else 'has no runs'}."
    parts = [f"{r['x_plain']['wall']:.2f} x {WHOLE_PHRASES[r['mode']]} ({_s(r['summary']['wall']['median'])} s)"
             for r in others]
    return (f"started from the shell with its cache warm, `{sc['command']}` exited in " + ", ".join(parts)
            + f", against plain python's {_s(plain['summary']['wall']['median'])} s.")


# -- the load calls, memory, start-up ----------------------------------------------------------


def loads_section(result: Result) -> list[str]:
    doc, out = result.doc, []
    device = doc["settings"]["device"]
    out += wrap(f"Seconds per call in a fresh process with the default settings, libraries imported before the "
                 f"clock; median (min-max) of {doc['settings']['runs']} runs, warm: {doc['settings']['warm_runs']}.")
    for sc in doc["scenarios"]:
        size = f", {_gb(sc['tensor_bytes'])} of tensors" if sc["tensor_bytes"] else ""
        out += ["", *wrap(f"**{sc['name']}** ({sc['title']}{size})"), ""]
        out += status_lines(sc)
        rows = [["mode", "page cache", "import", *sc["components"], f"to({device})", "total", "first use",
                 "x plain", "x plain +use"]]
        for r in sc["results"]:
            s, total = r["summary"], r["summary"]["total"]
            rows.append([MODE_LABELS[r["mode"]], r["page_cache"], _s(s["import"]["median"]),
                         *(_s(s[c]["median"]) if c in s else "-" for c in sc["components"]),
                         _s(s["to_device"]["median"]),
                         f"{_s(total['median'])} ({_s(total['min'])}-{_s(total['max'])})",
                         _s(s["first_use"]["median"]), ratio(r["x_plain"], 3), ratio(r["x_plain_with_first_use"], 3)])
            if r["mode"] == "warm" and total["n"] > 1:
                rows.append(["its slowest run", "", *slowest_cells(sc, r), ""])
        if len(rows) > 1:
            out += table(rows) + [""]
        if sc["warm_misses"]:
            out += [f"{sc['warm_misses']} warm call(s) missed the cache.", ""]
        out += wrap("What it means: " + load_meaning(sc))
    return out


def load_meaning(sc: dict) -> str:
    by_mode = {r["mode"]: r for r in sc["results"] if r["page_cache"] == "warm"}
    plain, warm, cold = by_mode.get("plain"), by_mode.get("warm"), by_mode.get("cold")
    if sc["status"] != "ok" or plain is None or warm is None or warm["x_plain"] is None:
        return f"no figure: this scenario {sc['status'] if sc['status'] != 'ok' else 'has no warm run'}."
    text = (f"once cached, this load takes {warm['x_plain']:.3f} x a plain one "
            f"({_s(warm['summary']['total']['median'])} s against {_s(plain['summary']['total']['median'])} s)")
    if cold is not None and cold["x_plain"] is not None:
        text += f"; the load that fills the cache takes {cold['x_plain']:.2f} x"
    if warm["x_plain_with_first_use"] is not None:
        text += f"; counted with the first use of every weight, {warm['x_plain_with_first_use']:.2f} x"
    return text + " (page cache warm)."


def memory_section(result: Result) -> list[str]:
    memory = result.doc["memory"]
    out = [*wrap(f"{memory[0]['procs']} processes load and hold the model, every weight touched: the growth of "
                  "their summed PSS (plus the server's, for overmind) and of the machine's used memory, and each "
                  "over the tensor bytes."), ""]
    rows = [["model", "tensor bytes", "plain PSS", "overmind PSS", "plain used", "overmind used"]]
    for m in memory:
        if m["status"] != "ok":
            rows.append([m["scenario"], _gb(m["tensor_bytes"]), f"{m['status']}: {first_line(m['reason'])}",
                         "", "", ""])
            continue
        rows.append([m["scenario"], _gb(m["tensor_bytes"]),
                     *(f"{_gb(h[kind + '_bytes'])} ({h[kind + '_ratio']:.2f} x)" for kind in ("pss", "used")
                       for h in (m["plain"], m["overmind"]))])
    out += table(rows) + [""]
    sentences = [f"{m['procs']} processes holding `{m['scenario']}` took {m['overmind']['pss_ratio']:.2f} x its "
                 f"bytes through overmind against {m['plain']['pss_ratio']:.2f} x plainly"
                 for m in memory if m["status"] == "ok"]
    out += wrap("What it means: " + ("; ".join(sentences) + " (summed PSS)." if sentences
                                      else "no figure: every case failed."))
    return out


def startup_section(result: Result) -> list[str]:
    st = result.doc["startup"]
    return [f"| | median of {st['bare_s']['n']} |", "|---|---|",
            f"| `python -c pass` | {st['bare_s']['median'] * 1000:.1f} ms |",
            f"| the same after `import overmind.api; overmind.api.monkey_patch_all()` | "
            f"{st['patched_s']['median'] * 1000:.1f} ms |", "",
            *wrap(f"What it means: the one line adds {st['added_s'] * 1000:.1f} ms to an interpreter's start and "
                   "exit.")]


# -- the sections ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Section:
    has: Callable[[dict], bool]  # a document has results of this kind
    render: Callable[[Result], list[str]]
    make: str  # the command that makes its results


SECTIONS: dict[str, Section] = {
    "warmup_curve": Section(lambda d: bool(d["warmup_curve"]), curve_section,
                            "overmind-bench --scenarios warmup_curve --json docs/results/warmup-curve.json"),
    "whole_process": Section(lambda d: bool(d["whole_process"]), whole_section,
                             "overmind-bench --scenarios whole_process --drop-page-cache "
                             "--json docs/results/whole-process.json"),
    "loads": Section(lambda d: bool(d["scenarios"]), loads_section,
                     f"overmind-bench --scenarios {','.join(NAMED_LOADS)} --drop-page-cache "
                     "--json docs/results/load-calls.json"),
    "memory": Section(lambda d: bool(d["memory"]), memory_section,
                      "overmind-bench --scenarios memory --memory-cases fp32_as_fp16,controlnet "
                      "--json docs/results/memory.json"),
    "startup": Section(lambda d: d["startup"] is not None, startup_section,
                       "overmind-bench --scenarios startup --json docs/results/startup.json"),
    # The scenarios that run alone (overmind.bench.alone); documents older than their keys have none.
    "compiled": Section(lambda d: bool(d.get("compiled")), page_alone.compiled_section,
                        "overmind-bench --scenarios compiled --hang-runs 10 --json docs/results/compiled.json"),
    "restart": Section(lambda d: bool(d.get("restart")), page_alone.restart_section,
                       "overmind-bench --scenarios restart --json docs/results/restart.json"),
    "memory_pressure": Section(lambda d: bool(d.get("memory_pressure")), page_alone.pressure_section,
                               "overmind-bench --scenarios memory_pressure --scale base "
                               "--json docs/results/memory-pressure.json"),
}


def results_section(name: str, results: list[Result], output: Optional[str]) -> list[str]:
    section = SECTIONS[name]
    having = sorted((r for r in results if section.has(r.doc)), key=lambda r: (r.doc["created"], r.label))
    out: list[str] = []
    for result in having:
        out += provenance(result, output) + section.render(result) + [""]
    if not having:
        out += [*wrap(f"No results yet: none of the files this page was made from has them. To make them: "
                       f"`{section.make}`, then regenerate this page with that file among its results."), ""]
    elif name == "loads":
        missing = [n for n in NAMED_LOADS if not any(sc["name"] == n for r in having for sc in r.doc["scenarios"])]
        if missing:
            out += [*wrap(f"No results yet for {', '.join(missing)}: `overmind-bench --scenarios "
                           f"{','.join(missing)} --json docs/results/FILE.json` makes them."), ""]
    return out[:-1] if out and out[-1] == "" else out


def generated(results: list[Result], command: str, output: Optional[str]) -> list[str]:
    out = [*wrap(f"This page is generated by `{command}` from the manual text in `src/overmind/bench/page.md` "
                  "and the results listed here: do not edit it by hand (a test compares it with what they make). "
                  "Add or replace a result and rerun the command; older results are in git history."), "",
           "| results | scenarios | measured | machine | overmind |", "|---|---|---|---|---|"]
    for r in sorted(results, key=lambda r: (r.doc["created"], r.label)):
        kinds = [n for n, s in SECTIONS.items() if s.has(r.doc)]
        m = r.doc["machine"]
        out.append(f"| {_link(r, output)} | {', '.join(kinds) or 'none'} | {r.doc['created'][:10]} | "
                   f"{m['cpus']} cores, {m['memory_bytes'] / 2**30:.1f} GiB | {r.doc['overmind_version']} |")
    return out


def render(results: list[Result], command: str, output: Optional[str] = None,
           template: Optional[str] = None) -> str:
    """The page: the template with its placeholders replaced. ``output``: where the page goes,
    for the links to the results files."""
    text = TEMPLATE.read_text() if template is None else template
    out: list[str] = []
    for line in text.splitlines():
        m = PLACEHOLDER.match(line.strip())
        if m is None:
            out.append(line)
        elif m.group(1) == "generated" and m.group(2) is None:
            out += generated(results, command, output)
        elif m.group(1) == "results" and m.group(2) in SECTIONS:
            out += results_section(m.group(2), results, output)
        else:
            raise ValueError(f"template: unknown placeholder {line.strip()!r}; known: {{{{generated}}}}, "
                             + ", ".join(f"{{{{results {n}}}}}" for n in SECTIONS))
    return "\n".join(out).rstrip("\n") + "\n"


def main(paths: list[str], output: Optional[str]) -> int:
    """``overmind-bench --report``: 0 written, 2 a file that is not a result."""
    try:
        results = load(paths)
    except ValueError as err:
        print(f"overmind-bench: --report: {err}", file=sys.stderr)
        return 2
    page = render(results, command_line(paths, output), output)
    if output:
        Path(output).write_text(page)
        print(f"overmind-bench: wrote {output} from {len(results)} result(s)", file=sys.stderr)
    else:
        sys.stdout.write(page)
    return 0
