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
    # Every scenario either way; quick holds the seed's workload only.
    assert [s.name for s in quick.scenarios] == [s.name for s in full.scenarios] == list(SCENARIOS)
    assert [s.name for s in quick.memory_cases] == ["controlnet"]
    assert [s.name for s in full.memory_cases] == ["controlnet", "fp32_as_fp16"]
    assert quick.startup and full.startup


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
                             "runs": {("plain", "warm"): runs(0.2), ("warm", "warm"): runs(0.01),
                                      ("cold", "warm"): runs(0.25)}}},
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
