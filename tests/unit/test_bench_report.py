"""overmind.bench without processes: the plan from arguments, the JSON document, the table."""

from __future__ import annotations

import copy
import json
import re

import pytest

from overmind.bench import cli, report
from overmind.bench.runner import Plan
from overmind.bench.scenarios import SCENARIOS


def plan_of(*argv: str) -> Plan:
    plan, _ = cli.make_plan(cli.build_parser().parse_args(list(argv)))
    return plan


def test_quick_is_small_one_run_two_holders_one_process_per_mode():
    quick, full = plan_of("--quick"), plan_of()
    assert (quick.scale, quick.runs, quick.warm_runs, quick.memory_procs, quick.process_per) == (
        "small", 1, 1, 2, "run")
    assert (full.scale, full.runs, full.warm_runs, full.memory_procs, full.process_per) == (
        "base", 3, 3, 4, "scenario")
    # Every scenario either way; quick holds the controlnet workload only.
    assert [s.name for s in quick.scenarios] == [s.name for s in full.scenarios] == list(SCENARIOS)
    assert [s.name for s in quick.memory_cases] == ["controlnet"]
    assert [s.name for s in full.memory_cases] == ["controlnet", "fp32_as_fp16"]
    assert quick.startup and full.startup
    # The whole-process scenario: every script, 3 timed runs per mode in --quick, 5 otherwise.
    assert quick.whole_scripts == full.whole_scripts == ("controlnet", "lm", "imports")
    assert (quick.whole_runs, full.whole_runs) == (1, 5)
    assert full.whole_modes == ("plain", "patched", "run", "first_run")
    only = plan_of("--scenarios", "lm", "--whole-runs", "2")
    assert only.whole_scripts == () and [s.name for s in only.scenarios] == ["lm"]
    picked = plan_of("--scenarios", "whole_process", "--whole-scripts", "imports,lm", "--whole-modes", "run,plain")
    assert (picked.whole_scripts, picked.whole_modes, picked.scenarios) == (("imports", "lm"), ("plain", "run"), [])


def test_explicit_options_win_over_quick_defaults_and_modes_keep_their_order():
    plan = plan_of("--quick", "--runs", "2", "--scale", "tiny", "--modes", "warm,plain,first")
    assert (plan.runs, plan.warm_runs, plan.scale) == (2, 2, "tiny")
    assert plan.modes == ("plain", "first", "warm")  # warm after what fills the cache


def test_a_users_model_is_the_custom_scenario(tmp_path):
    plan, extra = cli.make_plan(cli.build_parser().parse_args(
        ["--loader", "diffusers:DiffusionPipeline", "--model", str(tmp_path), "--dtype", "float16"]))
    assert [s.name for s in plan.scenarios] == ["custom"]
    assert [s.name for s in plan.memory_cases] == ["custom"]
    custom = plan.scenarios[0]
    assert custom.options == {"loader": "diffusers:DiffusionPipeline", "model": str(tmp_path), "dtype": "float16"}
    assert custom.preload == ("diffusers:DiffusionPipeline",)
    assert extra["custom_files"] == []  # an empty folder: nothing to evict, but local


@pytest.mark.parametrize("argv, message", [
    (["--dtype", "float17", "--loader", "a:b", "--model", "m"], "not a torch dtype"),
    (["--memory-cases", "nope"], "--memory-cases: unknown nope"),
    (["--whole-scripts", "controlnet,bash"], "--whole-scripts: unknown bash"),
    (["--whole-modes", "patched"], "--whole-modes must include plain"),
])
def test_bad_arguments_raise_value_error_with_the_option_name(argv, message):
    with pytest.raises(ValueError, match=message):
        plan_of(*argv)


def _results(plan: Plan) -> dict:
    """What Runner.run() returns, for two scenarios and the memory scenario."""
    def runs(total: float, n: int = 2) -> list[dict]:
        return [{"import": 4.0, "model": total - 0.01, "to_device": 0.01, "total": total + i * 0.1,
                 "first_use": 0.05} for i in range(n)]

    lm = SCENARIOS["lm"]
    return {
        "scenarios": {"lm": {"scenario": lm, "status": "ok", "reason": None, "tensor_bytes": 2_200_000_000,
                             "file_bytes": 2_200_000_100, "warm_misses": 0,
                             "runs": {("plain", "warm", "never"): runs(0.2), ("warm", "warm", "never"): runs(0.01),
                                      ("cold", "warm", "never"): runs(0.25)}}},
        "memory": [{"scenario": "lm", "procs": 4, "tensor_bytes": 2_200_000_000, "status": "ok", "reason": None,
                    "plain": {"pss_bytes": 8_000_000_000, "used_bytes": 1_000_000_000, "pss_ratio": 3.6,
                              "used_ratio": 0.45, "pss_before_bytes": 1, "pss_after_bytes": 2,
                              "load_s": {"median": 0.2, "min": 0.2, "max": 0.3, "n": 4}},
                    "overmind": {"pss_bytes": 2_300_000_000, "used_bytes": 2_250_000_000, "pss_ratio": 1.05,
                                 "used_ratio": 1.02, "pss_before_bytes": 1, "pss_after_bytes": 2,
                                 "load_s": {"median": 0.01, "min": 0.01, "max": 0.02, "n": 4}}}],
    }


def _document(plan: Plan) -> dict:
    return report.document(plan, _results(plan), {"bare_s": [0.01, 0.012], "patched_s": [0.04, 0.05],
                                                  "added_s": 0.034},
                           cache_dir="/tmp/cache", wall_s=12.5, cuda_device=None, argv=["overmind-bench"])


def test_document_orders_modes_computes_ratios_and_validates():
    plan = Plan(scenarios=[SCENARIOS["lm"], SCENARIOS["controlnet"]], memory_cases=[SCENARIOS["lm"]],
                skipped={"controlnet": "--device cuda: CUDA is not available"})
    doc = json.loads(json.dumps(_document(plan)))  # what --json writes
    report.validate(doc)
    lm, controlnet = doc["scenarios"]
    assert [r["mode"] for r in lm["results"]] == ["plain", "cold", "warm"]
    assert lm["results"][2]["x_plain"] == pytest.approx(0.06 / 0.25)  # medians: 0.06 and 0.25
    assert lm["results"][2]["x_plain_with_first_use"] == pytest.approx(0.11 / 0.30)
    assert lm["results"][0]["summary"]["total"] == pytest.approx({"median": 0.25, "min": 0.2, "max": 0.3, "n": 2})
    assert "total_with_first_use" not in lm["results"][0]["summary"]
    assert (controlnet["status"], controlnet["results"]) == ("skipped", [])


def test_validate_names_the_first_departure_from_the_schema():
    plan = Plan(scenarios=[SCENARIOS["lm"]], memory_cases=[])
    good = json.loads(json.dumps(_document(plan)))
    for mutate, where in [
        (lambda d: d.pop("schema_version"), "$: missing ['schema_version']"),
        (lambda d: d["settings"].update(runs="3"), "$.settings.runs"),
        (lambda d: d["scenarios"][0]["results"][0]["runs"][0].pop("first_use"), "missing phase 'first_use'"),
        (lambda d: d["scenarios"][0].update(status="fine"), "$.scenarios[0].status"),
        (lambda d: d["settings"].update(quick=1), "$.settings.quick"),
    ]:
        doc = copy.deepcopy(good)
        mutate(doc)
        with pytest.raises(ValueError, match=re.escape(where)):
            report.validate(doc)


def test_table_shows_each_phase_the_ratio_and_the_memory_growth():
    plan = Plan(scenarios=[SCENARIOS["lm"]], memory_cases=[SCENARIOS["lm"]])
    text = report.format_tables(_document(plan))
    lines = text.splitlines()
    header = next(line for line in lines if line.startswith("mode"))
    assert header.split() == ["mode", "import", "model", "to(cpu)", "total", "first", "use", "x", "plain", "x",
                              "plain", "+use"]
    warm = next(line for line in lines if line.startswith("overmind warm"))
    assert "0.060 (0.010-0.110)" in warm and "0.240" in warm
    assert "lm: AutoModelForCausalLM.from_pretrained" in text and "2.20 GB of tensors" in text
    assert "8.00 GB (3.60x)" in text and "2.30 GB (1.05x)" in text
    assert "adds 34.0 ms" in text


def _whole_results() -> dict:
    """What WholeProcess.run() returns: the lm script (plain, patched, run; page cache warm and cold),
    the imports command (no model: wall time only)."""
    from overmind.bench.whole import SCRIPTS

    def runs(ready: float, wall: float, forked=False, hits=0) -> list[dict]:
        return [{"ready": ready + i, "used": ready + i + 0.1, "wall": wall + i, "forked": forked, "hits": hits,
                 "misses": 0, "plain_loads": 0} for i in range(3)]

    lm_runs = {("plain", "warm"): runs(5.0, 6.0), ("patched", "warm"): runs(4.5, 5.5, hits=1),
               ("run", "warm"): runs(0.2, 0.5, True, 1), ("plain", "cold"): runs(7.0, 8.0),
               ("run", "cold"): runs(0.25, 0.55, True, 1)}
    imports_runs = {("plain", "warm"): [{"ready": None, "used": None, "wall": w, "forked": False, "hits": 0,
                                         "misses": 0, "plain_loads": 0} for w in (4.0, 4.2)],
                    ("run", "warm"): [{"ready": None, "used": None, "wall": w, "forked": True, "hits": 0,
                                       "misses": 0, "plain_loads": 0} for w in (0.1, 0.3)]}
    return {"scripts": {
        "lm": {"script": SCRIPTS["lm"], "runs": lm_runs, "status": "ok", "reason": None,
               "tensor_bytes": 2_200_000_000, "file_bytes": 2_200_000_100, "command": "python lm.py"},
        "imports": {"script": SCRIPTS["imports"], "runs": imports_runs, "status": "ok", "reason": None,
                    "tensor_bytes": None, "file_bytes": 0, "command": ""}}}


def test_whole_process_document_orders_rows_divides_by_plain_and_validates():
    plan = Plan(scenarios=[], memory_cases=[], startup=False, whole_scripts=("lm", "imports"), whole_runs=3)
    doc = report.document(plan, {"scenarios": {}, "memory": []}, None, cache_dir="/tmp/cache", wall_s=1.0,
                          cuda_device=None, argv=["overmind-bench"], whole=_whole_results())
    doc = json.loads(json.dumps(doc))
    report.validate(doc)
    lm, imports = doc["whole_process"]["scripts"]
    assert [(r["mode"], r["page_cache"]) for r in lm["results"]] == [
        ("plain", "warm"), ("patched", "warm"), ("run", "warm"), ("plain", "cold"), ("run", "cold")]
    run_warm, run_cold = lm["results"][2], lm["results"][4]
    assert run_warm["x_plain"]["wall"] == pytest.approx(1.5 / 7.0)  # medians of 0.5, 1.5, 2.5 and 6, 7, 8
    assert run_warm["x_plain"]["ready"] == pytest.approx(1.2 / 6.0)
    assert run_cold["x_plain"]["used"] == pytest.approx(1.35 / 8.1)  # against plain with the page cache cold
    assert imports["results"][1]["x_plain"] == {"ready": None, "used": None, "wall": pytest.approx(0.2 / 4.1)}
    assert imports["command"] == 'python -c "import torch, diffusers, transformers"'

    bad = copy.deepcopy(doc)
    bad["whole_process"]["scripts"][0]["results"][0]["runs"][0].pop("forked")
    with pytest.raises(ValueError, match=re.escape("$.whole_process.scripts[0].results[0].runs[0]: missing")):
        report.validate(bad)

    text = report.format_tables(doc)
    assert text.index("whole process:") < text.index("wall time")
    lines = text.splitlines()
    row = next(line for line in lines if line.startswith("overmind run, page cache cold"))
    assert row.split()[5:] == ["1.250", "1.350", "1.550", "(0.550-2.550)", "0.156", "0.167", "0.172"]
    assert "imports: `python -c \"import torch, diffusers, transformers\"`" in text
    bare = next(line for line in lines if line.startswith("overmind run ") and "page cache" not in line)
    assert bare.split()[2:4] == ["-", "-"]  # no model: no ready, no used


def test_the_warm_up_curve_is_in_every_run_by_default_and_its_options_pick_scripts_modes_and_rounds():
    quick, full = plan_of("--quick"), plan_of()
    assert (quick.curve_scripts, full.curve_scripts) == (("controlnet",), ("controlnet", "lm"))
    assert (quick.curve_rounds, full.curve_rounds, full.curve_modes) == (1, 2, ("patched", "dropin", "run"))
    assert full.curve_page_cache == ("warm",) and full.curve_drop is None
    picked = plan_of("--scenarios", "warmup_curve", "--curve-scripts", "lm", "--curve-modes", "run",
                     "--curve-rounds", "3", "--drop-page-cache")
    assert (picked.curve_scripts, picked.curve_modes, picked.curve_rounds, picked.scenarios) == (
        ("lm",), ("run",), 3, [])
    assert (picked.curve_page_cache, picked.curve_drop) == (("warm", "cold"), "posix_fadvise")
    assert plan_of("--scenarios", "lm").curve_scripts == ()
    with pytest.raises(ValueError, match="--curve-scripts: unknown imports"):
        plan_of("--curve-scripts", "imports")  # it loads no model: nothing to warm


def _curve_results() -> dict:
    """What WarmupCurve.run() returns for the lm script: 3 plain runs, then patched runs 1-5 and
    after a restart, two rounds."""
    from overmind.bench.curve import RUNS

    def run(wall: float, hits: int) -> dict:
        return {"wall": wall, "ready": wall - 0.5, "used": wall - 0.2, "sum": 1234, "hits": hits,
                "misses": 1 - hits, "plain_loads": 0, "forked": False, "fallback": False}

    walls = {"1": (5.0, 5.4), "2": (4.0, 4.2), "3": (4.0, 4.0), "4": (3.9, 4.1), "5": (4.0, 4.0),
             "restart": (5.2, 5.0)}
    patched = {r: [run(w, int(r not in ("1", "restart"))) for w in walls[r]] for r in RUNS}
    return {"settings": ["never"], "scripts": {("lm", "warm", "never"): {"plain": [run(w, 0) for w in (5.0, 5.2, 4.8)], "patched": patched,
                                         "status": "ok", "reason": None}}}


def test_warm_up_curve_document_divides_each_run_by_plains_median_and_validates():
    plan = Plan(scenarios=[], memory_cases=[], startup=False, curve_scripts=("lm",), curve_modes=("patched",))
    doc = report.document(plan, {"scenarios": {}, "memory": []}, None, cache_dir="/tmp/cache", wall_s=1.0,
                          cuda_device=None, argv=["overmind-bench"], curve=_curve_results())
    doc = json.loads(json.dumps(doc))
    report.validate(doc)
    [lm] = doc["warmup_curve"]["scripts"]
    assert (lm["page_cache"], lm["plain"]["median"], lm["status"]) == ("warm", 5.0, "ok")
    [patched] = lm["modes"]
    assert [r["run"] for r in patched["runs"]] == ["1", "2", "3", "4", "5", "restart"]
    assert [r["x_plain"] for r in patched["runs"]] == pytest.approx([1.04, 0.82, 0.8, 0.8, 0.8, 1.02])

    bad = copy.deepcopy(doc)
    bad["warmup_curve"]["scripts"][0]["modes"][0]["runs"][1]["runs"][0].pop("sum")
    with pytest.raises(ValueError, match=re.escape("$.warmup_curve.scripts[0].modes[0].runs[1].runs[0]: missing")):
        report.validate(bad)

    text = report.format_tables(doc)
    row = next(line for line in text.splitlines() if line.startswith("python + monkey_patch_all()"))
    assert row.split()[3:] == ["1.04", "0.82", "0.80", "0.80", "0.80", "1.02"]
    assert "lm: `python lm.py`, page cache warm, shmem_enabled never; python 5.000 s" in text
