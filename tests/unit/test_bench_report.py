"""overmind.bench without processes: the plan from arguments, the JSON document, the table."""

from __future__ import annotations

import copy
import json
import shlex
import re
from typing import Optional

import pytest

from overmind.bench import alone, cli, page, report
from overmind.bench.runner import Plan
from overmind.bench.scenarios import SCENARIOS

from ..conftest import REPO


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
    # The whole-process scenario: every script, 5 timed runs per mode; --quick leaves it out (its
    # curve is the whole process already) unless asked for.
    assert quick.whole_scripts == () and full.whole_scripts == ("controlnet", "lm", "imports")
    assert plan_of("--quick", "--scenarios", "whole_process").whole_scripts == ("controlnet", "lm", "imports")
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


# -- docs/benchmarks.md: overmind-bench --report -----------------------------------------------

PAGE, RESULTS = "docs/benchmarks.md", "docs/results"


def test_the_benchmarks_page_is_what_its_committed_results_make(monkeypatch):
    """docs/benchmarks.md is generated: a hand edit, a result added without regenerating, or a
    template change left unrendered fails here. The fix is `make docs`."""
    monkeypatch.chdir(REPO)
    paths = sorted(str(p.relative_to(REPO)) for p in (REPO / RESULTS).glob("*.json"))
    assert paths, f"no results in {RESULTS}"
    command = page.command_line(paths, PAGE)
    assert command == f"overmind-bench --report {RESULTS}/*.json --output {PAGE}"
    expected = page.render(page.load(paths), command, PAGE)
    assert (REPO / PAGE).read_text() == expected, f"{PAGE} is not what `{command}` makes: run `make docs`"


def test_the_page_gives_each_figure_with_its_command_date_machine_and_version(monkeypatch):
    monkeypatch.chdir(REPO)
    text = (REPO / PAGE).read_text()
    for path in sorted((REPO / RESULTS).glob("*.json")):
        doc = json.loads(path.read_text())
        block = text[text.index(f"### [{path.name}]"):]
        block = re.split(r"\n##+ ", block[4:], maxsplit=1)[0]  # to the next result or section
        head = " ".join(block.split("\n\n", 3)[2].split())  # the provenance list, unwrapped
        assert f"Command: `{shlex.join(doc['command'])}`" in head
        assert f"Measured {doc['created'][:10]} with overmind {doc['overmind_version']}" in head
        assert f"Machine: {doc['machine']['cpus']} cores" in head and doc["machine"]["versions"]["torch"] in head
        assert "What it means: " in block
    assert not re.search(r"\b(?:19|20)\d\d-\d\d-\d\d\b", (REPO / "src/overmind/bench/page.md").read_text()), \
        "a date in the template is a figure without its result"


def _page_doc(plan: Plan, **parts) -> dict:
    doc = report.document(plan, _results(plan), {"bare_s": [0.01, 0.012], "patched_s": [0.04, 0.05],
                                                 "added_s": 0.034}, cache_dir="/tmp/cache", wall_s=75.0,
                          cuda_device=None, argv=["overmind-bench", "--scenarios", "lm,memory,startup"],
                          about="A test run.", **parts)
    return json.loads(json.dumps(doc))


def test_the_page_renders_every_kind_and_says_what_has_no_result():
    plan = Plan(scenarios=[SCENARIOS["lm"]], memory_cases=[SCENARIOS["lm"]], whole_scripts=("lm", "imports"),
                whole_runs=3)
    doc = _page_doc(plan, whole=_whole_results())
    text = page.render([page.Result("out/run.json", doc)], "overmind-bench --report out/run.json", "out/page.md")
    assert "### [run.json](run.json)" in text and "A test run." in text
    assert "- Command: `overmind-bench --scenarios lm,memory,startup`" in text
    assert f"- Measured {doc['created'][:10]} with overmind {doc['overmind_version']}, in 1 min" in text
    assert "| overmind warm | warm | " in text and "0.060 (0.010-0.110)" in text
    assert "once cached, this load takes 0.240 x a plain one (0.060 s against 0.250 s)" in " ".join(text.split())
    assert "| lm | 2.20 GB | 8.00 GB (3.60 x) | 2.30 GB (1.05 x) |" in text
    assert "adds 34.0 ms" in text
    flat = " ".join(text.split())
    assert "| `overmind run` | cold | 1.250 | 1.350 | 1.550 (0.550-2.550) | 0.172 |" in text
    assert "`python lm.py` exited in 0.93 x with `monkey_patch_all()` (6.500 s), 0.21 x with `overmind run` " \
           "(1.500 s), against plain python's 7.000 s." in flat
    # No file has a warm-up curve or the other load scenarios: each says so, with the command that makes it.
    assert "No results yet: none of the files this page was made from has them. To make them: " \
           "`overmind-bench --scenarios warmup_curve --json docs/results/warmup-curve.json`" in flat
    assert "`overmind-bench --scenarios whole_process" not in flat
    assert "No results yet for controlnet, fp32_as_fp16, pickle_bin, single_file: " \
           "`overmind-bench --scenarios controlnet,fp32_as_fp16,pickle_bin,single_file" in flat
    assert "{{" not in text


def test_a_failed_scenario_says_so_and_draws_no_conclusion():
    plan = Plan(scenarios=[SCENARIOS["lm"]], memory_cases=[], curve_scripts=("lm",), curve_modes=("patched",))
    doc = _page_doc(plan, curve=_curve_results())
    # Failed after its plain and warm runs: the rows it has are shown, but no conclusion drawn from them.
    doc["scenarios"][0].update(status="failed", reason="worker 3 exited 1\nTraceback ...")
    doc["warmup_curve"]["scripts"][0].update(status="failed", reason="run 2 printed no marks")
    text = page.render([page.Result("r.json", doc)], "overmind-bench --report r.json")
    flat = " ".join(text.split())
    assert "**failed**: worker 3 exited 1" in flat and "Traceback" not in text and "| overmind warm | warm |" in text
    assert "What it means: no figure: this scenario failed." in flat
    assert "**failed**: run 2 printed no marks" in flat and "What it means: no figure: this curve failed." in flat
    ok = _page_doc(plan, curve=_curve_results())
    ok_text = " ".join(page.render([page.Result("r.json", ok)], "x").split())
    assert "run 1, which fills the cache, took 1.04 x plain python; every run of `python lm.py` after it took " \
           "0.80-1.02 x (4.0-5.1 s) with the one line, against plain python's 5.0 s." in ok_text
    assert "| the one line | 1.04 | 0.82 | 0.80 | 0.80 | 0.80 | 1.02 | 0 of 10 | 8 of 10 |" in ok_text


def test_the_template_names_only_known_sections_and_results_must_be_results(tmp_path):
    with pytest.raises(ValueError, match=re.escape("unknown placeholder '{{results benchmarks}}'")):
        page.render([], "x", template="# B\n\n{{results benchmarks}}\n")
    (tmp_path / "a.json").write_text('{"tool": "something else"}')
    with pytest.raises(ValueError, match="a.json: not an overmind-bench --json result: .*missing"):
        page.load([str(tmp_path / "a.json")])
    (tmp_path / "b.json").write_text("{}")
    every = [str(tmp_path / "a.json"), str(tmp_path / "b.json")]
    assert page.command_line(every, "p.md") == f"overmind-bench --report {tmp_path}/*.json --output p.md"
    assert page.command_line(every[:1], None) == f"overmind-bench --report {tmp_path}/a.json"


def test_report_writes_the_page_and_runs_nothing(tmp_path, monkeypatch, capsys):
    plan = Plan(scenarios=[], memory_cases=[], startup=False, curve_scripts=("lm",), curve_modes=("patched",))
    doc = report.document(plan, {"scenarios": {}, "memory": []}, None, cache_dir="/tmp/cache", wall_s=1.0,
                          cuda_device=None, argv=["overmind-bench"], curve=_curve_results())
    monkeypatch.chdir(tmp_path)
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "curve.json").write_text(json.dumps(doc))
    assert cli.main(["--report", "results/curve.json", "--output", "page.md"]) == cli.EXIT_OK
    text = (tmp_path / "page.md").read_text()
    assert text.startswith("# Benchmarks\n\nThis page is generated by `overmind-bench --report results/*.json "
                           "--output page.md`")
    assert "[curve.json](results/curve.json)" in text
    assert cli.main(["--report", "page.md"]) == cli.EXIT_USAGE  # not a result
    assert cli.main(["--output", "page.md"]) == cli.EXIT_USAGE  # --output without --report
    assert "--output goes with --report" in capsys.readouterr().err


# -- the scenarios that run alone: compiled, restart, memory_pressure ---------------------------


def _compiled_results() -> dict:
    """What compiled.run_scenario() fills in: both scripts, 3 pairs, 10 hang runs each."""
    from overmind.bench.compiled import CONFIG

    def script(curve: list, plain: list, run: list, hung: int = 0) -> dict:
        plain_median, run_median = sorted(plain)[1], sorted(run)[1]
        return {"curve_s": curve, "plain_s": plain, "run_s": run, "plain_median_s": plain_median,
                "run_median_s": run_median, "ratio": round(run_median / plain_median, 3), "hang_runs": 10,
                "hung": hung}

    return {"config": dict(CONFIG), "python": "/venv/bin/python", "compile_cold_s": 41.23, "package_s": 55.0,
            "scripts": {"compile_block": script([9.1, 2.4, 2.3, 2.3, 2.2], [6.1, 6.0, 6.3], [2.3, 2.2, 2.4]),
                        "aoti_block": script([3.5, 0.6, 0.5, 0.5, 0.5], [2.9, 3.0, 3.1], [0.5, 0.5, 0.6])}}


def _restart_results() -> dict:
    """What restart.run() and client_during_restore() fill in: both stops, 3 pairs."""
    from overmind.bench.restart import TARGETS

    def after(exit_: float, plain: float, equal: bool = True) -> dict:
        return {"ready": exit_ - 0.2, "exit": exit_, "weights": "1234", "over_plain": exit_ / plain,
                "weights_equal": equal}

    restore = {"state": "done", "ready": True, "entries": 9}
    return {"scale": "base", "targets": dict(TARGETS),
            "plain": {"controlnet": {"ready": 5.2, "exit": 5.6, "weights": "1234"},
                      "lm": {"ready": 3.1, "exit": 3.5, "weights": "5678"}},
            "stops": {stop: {"restore_seconds": seconds, "restore": restore, "cold_fill_seconds": 4.0,
                             "cold_fill": restore, "restore_over_cold_fill": seconds / 4.0,
                             "next": {"controlnet/run": after(0.7, 5.6), "controlnet/patched": after(4.9, 5.6),
                                      "lm/run": after(0.35, 3.5), "lm/patched": after(3.0, 3.5)}}
                      for stop, seconds in (("shutdown", 4.2), ("sigkill", 4.6))},
            "client_during_restore": {"pairs": 3, "client": "controlnet", "restored_bytes": 5_700_000_000,
                                      "exit_seconds": {"restoring": [6.0, 6.1, 5.9], "nothing": [5.8, 5.7, 5.9]},
                                      "restore_states": {"restoring": ["restoring"] * 3, "nothing": ["none"] * 3},
                                      "median_seconds": {"restoring": 6.0, "nothing": 5.8}, "ratio": 6.0 / 5.8}}


def _pressure_results() -> dict:
    """What pressure.run() fills in: a 20 GiB job beside no server and beside a 5.4 GiB cache
    that let go of everything and came back; the targets as check_targets() makes them."""
    from overmind.bench.pressure import GiB, MiB, check_targets

    def job(got: int, lowest: int, grow: float, **more) -> dict:
        return {"got": got, "target": 20 * GiB, "min_available": lowest, "stopped_early": None, "grow_seconds": grow,
                "seconds": grow + 5.0, "wall_seconds": grow + 5.3, "returncode": 0, "killed_by_signal": None, **more}

    results = {"scenario": "memory_pressure", "scale": "base", "margin_bytes": 3 * GiB, "hold": 5.0, "pairs": 3,
               "ram": 31 * GiB, "swap": 0, "available_before": 23 * GiB, "target_bytes": 20 * GiB,
               "job_alone": job(20 * GiB, 2900 * MiB, 9.8),
               "cache": {"entries": 9, "used": 5_800_000_000, "interpreters": 2, "interpreters_pss": 900_000_000,
                         "available": 16 * GiB, "file_segments_bytes": 0, "memory": {}, "settled_seconds": 3.2},
               "job_beside_cache": job(20 * GiB, 1200 * MiB, 14.1, server_alive=True, oom_kills=0,
                                       min_available_while_cache_held=1100 * MiB, used_before=5_800_000_000,
                                       used_min=0, used_first_drop_seconds=6.1, used_empty_seconds=8.4,
                                       status_errors=0, memory_before=None, events_seen=[],
                                       first_event_after_job_start=5.9, let_go_seconds=2.5, timeline=[],
                                       memory_after={}),
               "warm_again": {"seconds": 21.4, "entries": 9, "used": 5_800_000_000, "interpreters": 2,
                              "comeback": {"pending": 0}},
               "runs": {"controlnet": {"run": [], "plain": []}, "median_exit": {"run": 0.7, "plain": 5.5},
                        "patched": {}, "next_run_exit": 0.82, "plain_before": [], "plain_before_median": 5.6,
                        "run_over_plain": 0.82 / 5.6, "median_run_over_plain_after": 0.127, "weights_equal": True},
               "server_log": "/tmp/om-bench-pressure-1.log"}
    results["targets"] = check_targets(results)
    return results


ALONE_RESULTS = {"compiled": _compiled_results, "restart": _restart_results, "memory_pressure": _pressure_results}


def _alone_doc(name: str, results: dict, raises: Optional[Exception] = None) -> dict:
    """The document overmind-bench --scenarios NAME --json writes, as its runner filled ``results``."""
    def run(into: dict) -> None:
        into.update(results)
        if raises is not None:
            raise raises

    doc = alone.measure(name, run, argv=["overmind-bench", "--scenarios", name, "--json", f"{name}.json"],
                        about="A test run.")
    return json.loads(json.dumps(doc))


def test_a_scenario_that_runs_alone_is_a_document_with_its_results_under_its_own_key(capsys):
    for name, results in ALONE_RESULTS.items():
        doc = _alone_doc(name, results())
        report.validate(doc)
        assert doc[name] == {"status": "ok", "reason": None, **results()}
        assert [doc[other] for other in report.ALONE if other != name] == [None, None]
        assert (doc["scenarios"], doc["memory"], doc["startup"], doc["whole_process"]) == ([], [], None, None)
        assert doc["command"] == ["overmind-bench", "--scenarios", name, "--json", f"{name}.json"]
    # A run that raised is a failed one, with what it had measured.
    partial = {"scale": "base", "targets": {"run_over_plain": 0.15}, "plain": {}, "stops": {}}
    doc = _alone_doc("restart", partial, raises=RuntimeError("overmind-server did not start"))
    assert (doc["restart"]["status"], doc["restart"]["reason"]) == ("failed",
                                                                     "RuntimeError: overmind-server did not start")
    assert "overmind-server did not start" in capsys.readouterr().err  # its traceback
    # Every other run's document says null, and files older than these keys have none.
    plain = _page_doc(Plan(scenarios=[SCENARIOS["lm"]], memory_cases=[]))
    assert [plain[name] for name in report.ALONE] == [None, None, None]
    for name in report.ALONE:
        del plain[name]
    report.validate(plain)


def test_validate_checks_the_figures_of_a_scenario_that_ran_to_the_end():
    good = {name: _alone_doc(name, results()) for name, results in ALONE_RESULTS.items()}
    for name, mutate, where in [
        ("compiled", lambda e: e["scripts"]["aoti_block"].pop("ratio"), "$.compiled.scripts.aoti_block: missing"),
        ("restart", lambda e: e["stops"]["sigkill"]["next"]["lm/run"].update(over_plain=None),
         "$.restart.stops.sigkill.next.lm/run.over_plain"),
        ("restart", lambda e: e["client_during_restore"].pop("ratio"), "$.restart.client_during_restore: missing"),
        ("memory_pressure", lambda e: e.update(status="fine"), "$.memory_pressure.status"),
        ("memory_pressure", lambda e: e["job_beside_cache"].update(server_alive=None),
         "$.memory_pressure.job_beside_cache.server_alive"),
        ("memory_pressure", lambda e: e["targets"]["oom_kills"].update(**{"pass": "n/a"}),
         "$.memory_pressure.targets.oom_kills.pass"),
    ]:
        doc = copy.deepcopy(good[name])
        mutate(doc[name])
        with pytest.raises(ValueError, match=re.escape(where)):
            report.validate(doc)
    # What may be missing: the restore pairs (--contention-pairs 0), the stops (--stop none), and
    # what comes after the job when the server died beside it; a failed run's figures.
    for name, keys in (("restart", ("client_during_restore", "stops", "plain")),
                       ("memory_pressure", ("warm_again", "runs"))):
        doc = copy.deepcopy(good[name])
        for key in keys:
            del doc[name][key]
        report.validate(doc)
    doc = copy.deepcopy(good["compiled"])
    doc["compiled"].update(status="failed", reason="warm runs hung", scripts={}, package_s=None)
    report.validate(doc)


@pytest.mark.parametrize("name", list(ALONE_RESULTS))
def test_overmind_bench_writes_the_document_of_a_scenario_that_runs_alone(name, tmp_path, monkeypatch, capsys):
    """overmind-bench --scenarios NAME --json FILE hands NAME to its runner, in this process, and
    FILE is what --report renders; nothing is measured here (each runner's work is replaced)."""
    from overmind.bench import compiled, pressure, restart

    results = ALONE_RESULTS[name]()
    if name == "compiled":
        monkeypatch.setattr(compiled, "run_scenario", lambda pairs, hang_runs, **kw:
                            kw["results"].update(copy.deepcopy(results)))
    elif name == "restart":
        during = results.pop("client_during_restore")
        monkeypatch.setattr(restart, "run", lambda scale, stops, say, into: into.update(copy.deepcopy(results)))
        monkeypatch.setattr(restart, "client_during_restore", lambda scale, pairs, say: during)
    else:
        monkeypatch.setattr(pressure, "run", lambda scale, margin, hold, pairs, say, into:
                            into.update(copy.deepcopy(results)))
    out = tmp_path / f"{name}.json"
    argv = ["--scenarios", name, "--json", str(out), "--about", "Wired."]
    assert cli.main(argv) == cli.EXIT_OK
    [loaded] = page.load([str(out)])  # validated
    assert (loaded.doc["command"], loaded.doc["about"]) == (["overmind-bench", *argv], "Wired.")
    assert loaded.doc[name]["status"] == "ok" and page.SECTIONS[name].has(loaded.doc)
    text = page.render([loaded], "x")
    assert "What it means: no figure" not in text and f"`overmind-bench --scenarios {name} --json" in text


def test_a_hang_fails_the_compiled_scenario(tmp_path, monkeypatch, capsys):
    from overmind.bench import compiled

    results = _compiled_results()
    results["scripts"]["compile_block"]["hung"] = 2
    monkeypatch.setattr(compiled, "run_scenario", lambda pairs, hang_runs, **kw: kw["results"].update(results))
    out = tmp_path / "compiled.json"
    assert cli.main(["--scenarios", "compiled", "--json", str(out)]) == cli.EXIT_FAILED
    entry = json.loads(out.read_text())["compiled"]
    assert (entry["status"], entry["reason"]) == ("failed", "warm runs hung (compile_block: 2 of 10)")


def _alone_page(name: str, results: dict, raises: Optional[Exception] = None) -> str:
    text = page.render([page.Result(f"out/{name}.json", _alone_doc(name, results, raises))], "x", "out/page.md")
    return " ".join(text.split())


def test_the_page_renders_a_compiled_result():
    flat = _alone_page("compiled", _compiled_results())
    assert "### [compiled.json](compiled.json) A test run. - Command: `overmind-bench --scenarios compiled --json " \
           "compiled.json` - Measured " in flat
    assert "- Settings: device cpu, shmem_enabled" in flat  # its block has no scale
    assert "Compiling the block cold took 41.2 s, packaging it 55.0 s." in flat
    assert "| `torch.compile(model)(x)` | 9.10 / 2.40 / 2.30 / 2.30 / 2.20 | 6.10 (6.00-6.30) | 2.30 (2.20-2.40) | " \
           "0.38 | 0 of 10 |" in flat
    assert "| `aoti_load_package(block.pt2)(x)` | 3.50 / 0.60 / 0.50 / 0.50 / 0.50 | 3.00 (2.90-3.10) | " \
           "0.50 (0.50-0.60) | 0.17 | 0 of 10 |" in flat
    assert "What it means: with Inductor's caches warm, a warm `overmind run` took plain python's time 0.38 x for " \
           "the `torch.compile` script (2.30 s against 6.10 s), 0.17 x for the AOTInductor package (0.50 s against " \
           "3.00 s)." in flat
    assert "No results yet" not in flat.split("## Warm after a restart")[0].split("## Compiled code")[1]


def test_the_page_renders_a_restart_result():
    flat = _alone_page("restart", _restart_results())
    assert "- Settings: scale base, device cpu" in flat
    assert "its exit and that over plain python's (controlnet 5.60 s, lm 3.50 s, median of 2)" in flat
    assert "| `overmind shutdown` | 4.20 | 4.00 | 1.05 | 0.70 s (0.12 x) | 4.90 s (0.88 x) | 0.35 s (0.10 x) | " \
           "3.00 s (0.86 x) |" in flat
    assert "| SIGKILL | 4.60 | 4.00 | 1.15 |" in flat
    assert "| a restore of 5.70 GB of other entries | 6.00 | 1.03 | | nothing to restore | 5.80 | 1.00 |" in flat
    assert "What it means: after `overmind shutdown` the server was ready again in 4.2 s (1.05 x a cold fill) and " \
           "the next `overmind run` of each script took 0.10-0.12 x plain python; after SIGKILL the server was ready " \
           "again in 4.6 s (1.15 x a cold fill) and the next `overmind run` of each script took 0.10-0.12 x plain " \
           "python; a script loading other models beside a restore took 1.03 x its time beside none." in flat
    # A next run whose weights were not plain's says so, in its cell and in the conclusion.
    results = _restart_results()
    results["stops"]["sigkill"]["next"]["lm/patched"]["weights_equal"] = False
    flat = _alone_page("restart", results)
    assert "| 3.00 s (0.86 x), weights differ |" in flat and "but a next run's weights differed from plain's" in flat


def test_the_page_renders_a_memory_pressure_result():
    flat = _alone_page("memory_pressure", _pressure_results())
    assert "A job that takes 20.00 GiB (MemAvailable with no server of ours, 23.00 GiB, less 3.00 GiB)" in flat
    assert "(9 entries, 5.40 GiB)" in flat
    assert "| no server | 20.00 GiB | 100% | 9.8 | 2.83 GiB | no | 0 |" in flat
    assert "| the full cache | 20.00 GiB | 100% | 14.1 | 1.17 GiB | no | 0 |" in flat
    assert "| 5.40 GiB | 5.9 | 2.5 | 0.00 GiB | 8.4 | 21.4 | 0.82 s (0.15 x) | 5.60 |" in flat
    assert "| lowest MemAvailable while the cache held anything | 1.07 GiB | >= 0.50 GiB | pass |" in flat
    assert "| the next `overmind run` over plain python | 0.146 | <= 0.15 | pass |" in flat
    assert "What it means: beside a full cache of 5.40 GiB the job got 100% of what it got beside no server " \
           "(20.00 GiB against 20.00 GiB); the cache was warm again 21 s after the job exited, and the next " \
           "`overmind run` took 0.15 x plain python." in flat
    # The job short of what it got alone, and the server dead beside it: a figure, and the targets it missed.
    from overmind.bench.pressure import GiB, check_targets

    results = _pressure_results()
    results["job_beside_cache"].update(got=15 * GiB, server_alive=False, returncode=None, killed_by_signal=9)
    del results["warm_again"], results["runs"]
    results["targets"] = check_targets(results)
    flat = _alone_page("memory_pressure", results)
    assert "| the full cache | 15.00 GiB | 75% | 14.1 | 1.17 GiB | no | killed by signal 9 |" in flat
    assert "| the server alive after it | no | == yes | **fail** |" in flat
    assert "What it means: beside a full cache of 5.40 GiB the job got 75% of what it got beside no server " \
           "(15.00 GiB against 20.00 GiB), and the server did not survive it (targets missed: what the job got, " \
           "over its target; the job's exit status; the server alive after it; warm again after the job exited " \
           "(s); the next `overmind run` over plain python; every run's weights equal plain's)." in flat


def test_a_failed_run_of_a_scenario_that_runs_alone_says_so_and_draws_no_conclusion(capsys):
    compiled = _compiled_results()
    del compiled["scripts"]["aoti_block"]
    partial = {"compiled": compiled,
               "restart": {"scale": "base", "targets": _restart_results()["targets"], "plain": {}, "stops": {}},
               "memory_pressure": {k: v for k, v in _pressure_results().items()
                                   if k in ("scale", "margin_bytes", "hold", "pairs", "job_alone")}}
    for name, results in partial.items():
        flat = _alone_page(name, results, raises=RuntimeError("overmind-server did not start\nat line 3"))
        section = flat.split(f"### [{name}.json]")[1].split(" ## ")[0]
        assert "**failed**: RuntimeError: overmind-server did not start" in section and "at line 3" not in section
        assert section.endswith("What it means: no figure: this run failed."), section
    # What it had measured is still shown.
    assert "| `torch.compile(model)(x)` | 9.10 /" in _alone_page("compiled", compiled, raises=RuntimeError("x"))
    assert "| no server | 20.00 GiB | - | 9.8 |" in _alone_page("memory_pressure", partial["memory_pressure"],
                                                                raises=RuntimeError("x"))
