"""docs/benchmarks.md's results sections for the scenarios that run alone (``compiled``,
``restart``, ``memory_pressure``: :mod:`overmind.bench.alone`), for :mod:`overmind.bench.page`.
Each gives a table of the key figures and one sentence of what they mean for a user; a run
that failed says so and draws no conclusion."""

from __future__ import annotations

from typing import Optional

from overmind.bench.page_parts import Result, ratio, spread, status_lines, table, wrap
from overmind.bench.report import _gb

__all__ = ["compiled_section", "restart_section", "pressure_section"]

COMPILED_LABELS = {"compile_block": "`torch.compile(model)(x)`", "aoti_block": "`aoti_load_package(block.pt2)(x)`"}
COMPILED_PHRASES = {"compile_block": "the `torch.compile` script", "aoti_block": "the AOTInductor package"}
RESTART_STOPS = {"shutdown": "`overmind shutdown`", "sigkill": "SIGKILL"}
RESTART_MODES = {"run": "`overmind run`", "patched": "patched"}
PRESSURE_TARGETS = {
    "job_got_ratio": "what the job got, over its target", "min_available_while_cache_held":
    "lowest MemAvailable while the cache held anything", "oom_kills": "OOM kills (dmesg)",
    "job_exit_status": "the job's exit status", "server_alive": "the server alive after it",
    "warm_again_seconds": "warm again after the job exited (s)",
    "run_over_plain": "the next `overmind run` over plain python", "weights_equal": "every run's weights equal plain's"}


def _no_figure(entry: dict, has: bool) -> Optional[str]:
    if entry["status"] != "ok" or not has:
        return f"no figure: this run {'failed' if entry['status'] != 'ok' else 'has no results'}."
    return None


def _gib(n: Optional[float]) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB"


def _sec(n: Optional[float], digits: int = 1) -> str:
    return "-" if n is None else f"{n:.{digits}f}"


# -- compiled ----------------------------------------------------------------------------------


def compiled_section(result: Result) -> list[str]:
    c = result.doc["compiled"]
    config, scripts = c.get("config") or {}, c.get("scripts") or {}
    made = (f" Compiling the block cold took {c['compile_cold_s']:.1f} s, packaging it {c['package_s']:.1f} s."
            if "compile_cold_s" in c and "package_s" in c else "")
    out = [*wrap(f"A {config.get('layers', '?')}-layer transformer block (d_model {config.get('d_model', '?')}, "
                  "fp32), whole process from the shell, seconds: `overmind run` runs 1-5 back to back from a fresh "
                  "server, then plain python (Inductor's caches warm) and `overmind run` in alternating pairs, "
                  f"medians (min-max); x plain: `overmind run` over plain python.{made}"), "", *status_lines(c)]
    rows = [["script", "`overmind run`, runs 1-5", "plain python", "`overmind run`", "x plain", "warm runs that hung"]]
    for name, e in scripts.items():
        rows.append([COMPILED_LABELS.get(name, name), " / ".join(f"{v:.2f}" for v in e["curve_s"]),
                     f"{e['plain_median_s']:.2f} ({spread(e['plain_s'])})", f"{e['run_median_s']:.2f} "
                     f"({spread(e['run_s'])})", ratio(e["ratio"]), f"{e['hung']} of {e['hang_runs']}"])
    if len(rows) > 1:
        out += table(rows) + [""]
    return out + wrap("What it means: " + compiled_meaning(c))


def compiled_meaning(c: dict) -> str:
    scripts = c.get("scripts") or {}
    if (none := _no_figure(c, bool(scripts))) is not None:
        return none
    parts = [f"{e['ratio']:.2f} x for {COMPILED_PHRASES.get(name, name)} ({e['run_median_s']:.2f} s against "
             f"{e['plain_median_s']:.2f} s)" for name, e in scripts.items()]
    return "with Inductor's caches warm, a warm `overmind run` took plain python's time " + ", ".join(parts) + "."


# -- restart -----------------------------------------------------------------------------------


def restart_section(result: Result) -> list[str]:
    r = result.doc["restart"]
    targets, plain, stops = r.get("targets") or {}, r.get("plain") or {}, r.get("stops") or {}
    during = r.get("client_during_restore")
    plains = ", ".join(f"{name} {p['exit']:.2f} s" for name, p in plain.items())
    out = [*wrap("Seconds from `overmind-server --daemon` until `overmind status --wait-ready` returns, after "
                  "each way of stopping the server, against a cold fill of the same entries; then the next run of "
                  "each script from the shell, its exit and that over plain python's"
                  + (f" ({plains}, median of 2)" if plains else "") + ". Targets: restore at most "
                  f"{targets.get('restore_over_cold_fill', '-')} x the cold fill, the next `overmind run` "
                  f"{targets.get('run_over_plain', '-')} x plain, patched {targets.get('patched_over_plain', '-')} x, "
                  f"a client during a restore {targets.get('client_during_restore', '-')} x."), "", *status_lines(r)]
    if stops:
        nexts = list(dict.fromkeys(k for e in stops.values() for k in e["next"]))
        rows = [["server stopped by", "restore (s)", "cold fill (s)", "x cold fill",
                 *(f"next {RESTART_MODES.get(k.partition('/')[2], k)}, {k.partition('/')[0]}" for k in nexts)]]
        for stop, e in stops.items():
            cells = [(f"{n['exit']:.2f} s ({n['over_plain']:.2f} x)"
                      + ("" if n["weights_equal"] else ", weights differ") if (n := e["next"].get(k)) else "-")
                     for k in nexts]
            rows.append([RESTART_STOPS.get(stop, stop), _sec(e["restore_seconds"], 2), _sec(e["cold_fill_seconds"], 2),
                         ratio(e["restore_over_cold_fill"]), *cells])
        out += table(rows) + [""]
    if during:
        m = during["median_seconds"]
        out += table([[f"the `{during.get('client', 'controlnet')}` script, patched, beside",
                        f"exit, median of {during['pairs']} (s)", "x nothing to restore"],
                       [f"a restore of {_gb(during['restored_bytes'])} of other entries", _sec(m["restoring"], 2),
                        ratio(during["ratio"])],
                       ["nothing to restore", _sec(m["nothing"], 2), "1.00"]]) + [""]
    return out + wrap("What it means: " + restart_meaning(r))


def restart_meaning(r: dict) -> str:
    stops, during = r.get("stops") or {}, r.get("client_during_restore")
    if (none := _no_figure(r, bool(stops or during))) is not None:
        return none
    parts = []
    for stop, e in stops.items():
        runs = [n["over_plain"] for k, n in e["next"].items() if k.endswith("/run")]
        parts.append(f"after {RESTART_STOPS.get(stop, stop)} the server was ready again in "
                     f"{e['restore_seconds']:.1f} s ({e['restore_over_cold_fill']:.2f} x a cold fill)"
                     + (f" and the next `overmind run` of each script took {spread(runs)} x plain python" if runs
                        else ""))
    if any(not n["weights_equal"] for e in stops.values() for n in e["next"].values()):
        parts.append("but a next run's weights differed from plain's")
    if during:
        parts.append(f"a script loading other models beside a restore took {during['ratio']:.2f} x its time beside "
                     "none")
    return "; ".join(parts) + "."


# -- memory pressure ---------------------------------------------------------------------------


def _job_row(label: str, job: dict, target: Optional[int]) -> list[str]:
    share = f"{job['got'] / target:.0%}" if target and job.get("got") is not None else "-"
    signal = job.get("killed_by_signal")
    exit_ = f"killed by signal {signal}" if signal else "-" if job.get("returncode") is None else str(job["returncode"])
    return [label, _gib(job.get("got")), share, _sec(job.get("grow_seconds")), _gib(job.get("min_available")),
            job.get("stopped_early") or "no", exit_]


def _value(name: str, value) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if "available" in name:
        return _gib(value)
    return "-" if value is None else f"{value:.3g}" if isinstance(value, float) else str(value)


def pressure_section(result: Result) -> list[str]:
    p = result.doc["memory_pressure"]
    alone, beside = p.get("job_alone"), p.get("job_beside_cache")
    cache, warm, runs = p.get("cache") or {}, p.get("warm_again") or {}, p.get("runs") or {}
    target = p.get("target_bytes")
    out = [*wrap(f"A job that takes {_gib(target)} (MemAvailable with no server of ours, "
                  f"{_gib(p.get('available_before'))}, less {_gib(p.get('margin_bytes'))}) in 256 MiB steps and "
                  f"holds it {p.get('hold', 0):g} s, beside no server, then beside a full cache of the ControlNet and "
                  f"LM scripts at scale {p.get('scale', '-')} ({cache.get('entries', '-')} entries, "
                  f"{_gib(cache.get('used'))}); RAM {_gib(p.get('ram'))}, swap {_gib(p.get('swap'))}. Seconds after "
                  "the job started, except *warm again*: after it exited."), "", *status_lines(p)]
    rows = [["the job beside", "got", "of its target", "grew in (s)", "lowest MemAvailable", "stopped early", "exit"]]
    rows += [_job_row(label, job, target) for label, job in (("no server", alone), ("the full cache", beside)) if job]
    if len(rows) > 1:
        out += table(rows) + [""]
    if beside:
        plain = runs.get("plain_before_median")
        out += table([["the cache held", "first pressure event", "let go in", "least held", "empty after",
                        "warm again", "next `overmind run`", "plain python before the job"],
                       [_gib(beside.get("used_before")), _sec(beside.get("first_event_after_job_start")),
                        _sec(beside.get("let_go_seconds")), _gib(beside.get("used_min")),
                        _sec(beside.get("used_empty_seconds")), _sec(warm.get("seconds")),
                        "-" if "next_run_exit" not in runs else
                        f"{runs['next_run_exit']:.2f} s ({runs['run_over_plain']:.2f} x)", _sec(plain, 2)]]) + [""]
    checks = p.get("targets") or {}
    if checks:
        verdicts = {True: "pass", False: "**fail**", None: "not measurable here"}
        out += table([["target", "value", "wanted", "result"]]
                      + [[PRESSURE_TARGETS.get(name, name), _value(name, t.get("value")),
                          f"{t['op']} {_value(name, t.get('target'))}", verdicts[t["pass"]]]
                         for name, t in checks.items()]) + [""]
    return out + wrap("What it means: " + pressure_meaning(p))


def pressure_meaning(p: dict) -> str:
    alone, beside = p.get("job_alone") or {}, p.get("job_beside_cache") or {}
    if (none := _no_figure(p, bool(alone.get("got") and beside))) is not None:
        return none
    warm, runs = p.get("warm_again") or {}, p.get("runs") or {}
    text = (f"beside a full cache of {_gib((p.get('cache') or {}).get('used'))} the job got "
            f"{beside['got'] / alone['got']:.0%} of what it got beside no server ({_gib(beside['got'])} against "
            f"{_gib(alone['got'])})")
    if not beside.get("server_alive"):
        text += ", and the server did not survive it"
    elif warm.get("seconds") is not None and "run_over_plain" in runs:
        text += (f"; the cache was warm again {warm['seconds']:.0f} s after the job exited, and the next "
                 f"`overmind run` took {runs['run_over_plain']:.2f} x plain python")
    else:
        text += "; the cache was not warm again within 90 s"
    missed = [PRESSURE_TARGETS.get(n, n) for n, t in (p.get("targets") or {}).items() if t["pass"] is False]
    return text + (f" (targets missed: {'; '.join(missed)})" if missed else "") + "."
