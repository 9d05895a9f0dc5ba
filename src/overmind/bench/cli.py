"""overmind-bench: plain vs overmind model loads, cold and warm, memory and start-up.

    overmind-bench --quick                        # a small version of everything, about a minute
    overmind-bench --json bench.json --plot bench.png          # SD1.5 sizes and a 1.1 B LM
    overmind-bench --loader diffusers:DiffusionPipeline --model PATH_OR_ID --dtype float16
    python -m overmind.bench ...                  # the same

Models are generated on this machine with random weights (no hub access) into a reusable
cache folder (``--cache-dir``, default ``~/.cache/overmind-bench``). Scenarios:

- ``whole_process``: what a user waits for: a script started from the shell, to its model
  ready and to first use of every weight, as ``python script.py``, ``python script.py`` with
  ``monkey_patch_all()`` (cache warm), ``overmind run script.py`` (cache and interpreter warm)
  and the first ``overmind run`` of a new context (:mod:`overmind.bench.whole`);
- ``controlnet``: a ControlNet workload: AutoencoderKL, two ControlNetModels and
  StableDiffusionControlNetPipeline(vae=vae, controlnet=[edge, depth]), fp16 safetensors;
- ``lm``: a Llama-style causal LM in bf16 (1.1 B parameters at the default scale);
- ``fp32_as_fp16``: a UNet saved in fp32 and loaded with ``torch_dtype=torch.float16``;
- ``pickle_bin``: the LM as a ``pytorch_model.bin``;
- ``single_file``: ``StableDiffusionPipeline.from_single_file`` of one original-layout file;
- ``custom``: your ``--loader`` and ``--model``;
- ``memory``: K processes hold a model, plain vs overmind: summed PSS and used memory;
- ``startup``: what ``import overmind.api; monkey_patch_all()`` adds to an interpreter.
- ``compiled``, ``restart`` and ``memory_pressure``, each alone (their own runners): a
  ``torch.compile`` and an AOTInductor script under ``overmind run`` (:mod:`overmind.bench.compiled`),
  how warm a restarted server is, and how much its restore slows a client (:mod:`overmind.bench.restart`),
  and whether a full cache gives way to a job that needs the memory, and how soon it is warm
  again (:mod:`overmind.bench.pressure`). Their ``--json`` is the same document, with their
  results under a key of their own (:mod:`overmind.bench.alone`).

Each load of the load scenarios runs in a fresh process in three modes: plain
(``OVERMIND_DISABLE=1``), overmind cold (after evicting the cache) and overmind warm; with
``--drop-page-cache`` each mode (of every scenario) runs again with the model's files evicted
from the page cache. Every call is timed, then ``.to(device)``, then the first use of every
weight. The bench starts its own
overmind-server in a private runtime directory and stops it at the end: it never touches
your server or its cache. The table and JSON say which
``/sys/kernel/mm/transparent_hugepage/shmem_enabled`` value the loads ran under (``advise``
lets overmind back its segments with huge pages, which makes the first use of a warm model
cheap); as root, ``--shmem-enabled never,advise`` runs the load scenarios under each value
in turn and restores the original afterwards. ``--json FILE`` writes every figure (schema:
:mod:`overmind.bench.report`; ``--about TEXT`` says in it what the run is); ``--plot FILE.png``
draws them (needs matplotlib: ``pip install 'overmind[bench]'``).

``--report RESULT.json ... [--output FILE]`` runs nothing: it renders the benchmarks page from
such files (:mod:`overmind.bench.page`); docs/benchmarks.md is
``overmind-bench --report docs/results/*.json --output docs/benchmarks.md``.

Exit status: 0 done (skipped scenarios say why); 1 a scenario failed (its worker logs are
kept and named); 2 bad usage.
"""

# This module: argument parsing and the order of a run; the docstring above is `--help`.

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from overmind.bench import models as M
from overmind.bench import shmem
from overmind.bench.curve import MODES as CURVE_MODES
from overmind.bench.curve import WarmupCurve
from overmind.bench.harness import BenchError, BenchServer, drop_all_caches, drop_page_cache, startup_overhead
from overmind.bench.report import document, format_tables, plot, validate
from overmind.bench.runner import MODES, Plan, Runner
from overmind.bench.scenarios import LOAD_SCENARIOS, SCENARIOS, custom_scenario
from overmind.bench.whole import MODES as WHOLE_MODES
from overmind.bench.whole import SCRIPTS as WHOLE_SCRIPTS
from overmind.bench.whole import WholeProcess

__all__ = ["main", "build_parser"]

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
EXTRA_SCENARIOS = ("warmup_curve", "whole_process", "custom", "memory", "startup")
# --quick: a small version of every scenario (Note [Processes per scenario or per run] in
# overmind.bench.runner).
CURVE_SCRIPTS = ("controlnet", "lm")  # whole-process scripts that load a model
# --quick (make demo) stays within 3 minutes here: the curve of the ControlNet script only, and no
# whole_process scenario.
QUICK = {"scale": "small", "runs": 1, "warm_runs": 1, "memory_procs": 2, "startup_repeats": 5,
         "process_per": "run", "memory_cases": "controlnet", "whole_runs": 1, "curve_rounds": 1,
         "curve_scripts": "controlnet", "curve_modes": "patched,run"}
FULL = {"scale": "base", "runs": 3, "warm_runs": 3, "memory_procs": 4, "startup_repeats": 20,
        "process_per": "scenario", "memory_cases": "controlnet,fp32_as_fp16", "whole_runs": 5, "curve_rounds": 2,
        "curve_scripts": ",".join(CURVE_SCRIPTS), "curve_modes": ",".join(CURVE_MODES)}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="overmind-bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="a small version of every scenario (small models, 1 run, 2 holders)")
    parser.add_argument("--scale", choices=list(M.SCALES),
                        help="model sizes: " + "; ".join(f"{k}: {v.about}" for k, v in M.SCALES.items())
                        + " (default base; --quick: small)")
    parser.add_argument("--scenarios", metavar="LIST",
                        help=f"comma-separated, from {', '.join((*LOAD_SCENARIOS, *EXTRA_SCENARIOS))} "
                             "(default: all built-in ones; with --model: custom,memory,startup); or compiled, "
                             "restart or memory_pressure, alone")
    parser.add_argument("--memory-cases", metavar="LIST",
                        help="the load scenarios the memory scenario holds (default controlnet,fp32_as_fp16; "
                             "--quick: controlnet; with --model: custom)")
    parser.add_argument("--runs", type=int, help="plain and cold runs per scenario (default 3; --quick: 1)")
    parser.add_argument("--warm-runs", type=int, help="warm runs per scenario (default 3; --quick: 1)")
    parser.add_argument("--memory-procs", type=int, metavar="K",
                        help="processes holding the model at once in the memory scenario (default 4; --quick: 2)")
    parser.add_argument("--modes", default="plain,cold,warm",
                        help=f"comma-separated, from {', '.join(MODES)} (default plain,cold,warm; first: cold on a "
                             "server started just before)")
    parser.add_argument("--whole-scripts", metavar="LIST",
                        help=f"the whole-process scenario's scripts, from {', '.join(WHOLE_SCRIPTS)} (default all)")
    parser.add_argument("--whole-modes", metavar="LIST",
                        help=f"its modes, from {', '.join(WHOLE_MODES)} (default all; plain is required)")
    parser.add_argument("--hang-runs", type=int, metavar="N", default=0,
                        help="compiled scenario: N more back-to-back warm runs of each script, each bounded in time")
    parser.add_argument("--stop", choices=("shutdown", "sigkill", "both", "none"), default="both",
                        help="restart scenario: how the server is stopped before its restore (default both)")
    parser.add_argument("--contention-pairs", type=int, metavar="N", default=3,
                        help="restart scenario: pairs of a client run during a restore against one beside nothing "
                             "to restore (default 3; 0 skips them)")
    parser.add_argument("--margin", type=float, metavar="GIB", default=3.0,
                        help="memory_pressure scenario: its job's target is MemAvailable with no server less this "
                             "(default 3 GiB)")
    parser.add_argument("--hold", type=float, metavar="S", default=5.0,
                        help="memory_pressure scenario: seconds its job holds the memory (default 5)")
    parser.add_argument("--pairs", type=int, metavar="N", default=3,
                        help="memory_pressure scenario: pairs of overmind run and plain python after the job "
                             "(default 3)")
    parser.add_argument("--whole-runs", type=int, metavar="N",
                        help="its timed runs per script and mode (default 5; --quick: 1)")
    parser.add_argument("--curve-scripts", metavar="LIST",
                        help=f"the warm-up curve's scripts, from {', '.join(CURVE_SCRIPTS)} "
                             "(default both; --quick: controlnet)")
    parser.add_argument("--curve-modes", metavar="LIST",
                        help=f"its modes, from {', '.join(CURVE_MODES)} (default all, --quick: patched,run; plain always runs)")
    parser.add_argument("--curve-rounds", type=int, metavar="N",
                        help="its rounds: each a fresh server per mode and runs 1-5 (default 2; --quick: 1)")
    parser.add_argument("--drop-page-cache", action="store_true",
                        help="also run every mode with the model's files evicted from the page cache")
    parser.add_argument("--drop-caches", action="store_true",
                        help="also run the warm-up curve with the whole machine's page cache dropped before every "
                             "run (/proc/sys/vm/drop_caches: root only; what another workload leaves behind)")
    parser.add_argument("--shmem-enabled", metavar="LIST",
                        help="run the load scenarios once under each of these values of "
                             f"{shmem.SHMEM_ENABLED} in turn (from {', '.join(shmem.VALUES)}), e.g. never,advise: "
                             "the first use of a warm model with and without huge pages for overmind's segments "
                             "(rows say which; ratios compare runs of the same value). Needs root. The machine-wide "
                             "value is restored afterwards, also on Ctrl-C, SIGTERM or an error; memory, start-up "
                             "and whole_process run under it. Without this option every run uses the current value, "
                             "which the table and JSON report")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]: adds .to(device) to every load")
    parser.add_argument("--imports", metavar="LIST", default="",
                        help="modules the warm-up curve's and whole-process scripts import right after torch, as "
                             "a user's own libraries, e.g. pandas,scipy.stats (each must be importable here)")
    parser.add_argument("--loader", help="your model: module:Class with a from_pretrained, "
                                         "e.g. diffusers:DiffusionPipeline")
    parser.add_argument("--model", help="your model: a path or a hub id already in the local cache")
    parser.add_argument("--dtype", help="torch dtype for your model, e.g. float16")
    parser.add_argument("--cache-dir", type=Path,
                        help=f"where generated models are kept (default {M.default_cache_dir()}; "
                             "OVERMIND_BENCH_CACHE)")
    parser.add_argument("--cold-mode", choices=["background", "wait"], default="background",
                        help="OVERMIND_COLD of the cold runs (default background: the caller loads plainly "
                             "while the server fills the cache)")
    parser.add_argument("--process-per", choices=["scenario", "run"],
                        help="a fresh worker per scenario and run (default), or one per mode and run for all "
                             "scenarios (--quick)")
    parser.add_argument("--startup-repeats", type=int, help="interpreters timed for start-up (default 20)")
    parser.add_argument("--json", type=Path, metavar="FILE",
                        help="write the results here (schema: overmind.bench.report)")
    parser.add_argument("--plot", type=Path, metavar="FILE.png", help="bar chart of the phases (needs matplotlib)")
    parser.add_argument("--about", metavar="TEXT",
                        help="what this run is (a venv, a machine), kept in the JSON and printed by --report")
    parser.add_argument("--report", nargs="+", metavar="RESULT.json",
                        help="run nothing: render the benchmarks page from these --json results "
                             "(docs/benchmarks.md: --report docs/results/*.json --output docs/benchmarks.md)")
    parser.add_argument("--output", metavar="FILE", help="--report: write the page here (default: stdout)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar while generating models")
    parser.add_argument("--keep-logs", action="store_true",
                        help="keep the worker logs and the warm-up curve's server logs when every run passed "
                             "(a failure always keeps them)")
    return parser


def _names(text: str, allowed: tuple[str, ...], option: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in allowed]
    if unknown:
        raise ValueError(f"{option}: unknown {', '.join(unknown)}; choose from {', '.join(allowed)}")
    return names


def _importable(text: str) -> tuple[str, ...]:
    """--imports: module names, each one this interpreter finds (a typo fails now, not in every run)."""
    import importlib.util

    names = tuple(n.strip() for n in text.split(",") if n.strip())
    for name in names:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise ValueError(f"--imports: no module named {name!r} in {sys.executable}")
    return names


def _custom_files(model: str) -> Optional[list[Path]]:
    """The files of a user's model, for the page-cache-cold runs: a local path, or the local
    snapshot of a hub id. None when neither is found."""
    if Path(model).exists():
        return M.model_files(Path(model))
    try:
        from huggingface_hub import snapshot_download

        return M.model_files(Path(snapshot_download(model, local_files_only=True)))
    except Exception:  # noqa: BLE001 -- any failure means: not available locally
        return None


def make_plan(args: argparse.Namespace) -> tuple[Plan, dict]:
    """The plan and the custom model's details; raises ValueError on bad usage."""
    defaults = QUICK if args.quick else FULL
    if bool(args.loader) != bool(args.model):
        raise ValueError("--loader and --model go together, e.g. --loader diffusers:DiffusionPipeline --model PATH")
    if args.dtype:
        import torch

        if not isinstance(getattr(torch, args.dtype, None), torch.dtype):
            raise ValueError(f"--dtype {args.dtype!r} is not a torch dtype (float16, bfloat16, float32, ...)")
    custom = None
    extra: dict = {}
    if args.model:
        model = str(Path(args.model).resolve()) if Path(args.model).exists() else args.model
        custom = custom_scenario(args.loader, model, args.dtype)
        extra["custom_files"] = _custom_files(model)
    allowed = (*LOAD_SCENARIOS, *EXTRA_SCENARIOS)
    # --quick leaves out whole_process: its curve is already the whole process from the shell.
    default_list = ("custom,memory,startup" if custom
                    else ",".join(("warmup_curve", *(() if args.quick else ("whole_process",)), *LOAD_SCENARIOS,
                                   "memory", "startup")))
    chosen = _names(args.scenarios or default_list, allowed, "--scenarios")
    if "custom" in chosen and custom is None:
        raise ValueError("--scenarios custom needs --loader and --model")
    by_name = {**SCENARIOS, **({"custom": custom} if custom else {})}
    loads = [by_name[n] for n in chosen if n in by_name]
    memory_cases: list = []
    if "memory" in chosen:
        default_cases = "custom" if custom else defaults["memory_cases"]
        cases = _names(args.memory_cases or default_cases, tuple(by_name), "--memory-cases")
        memory_cases = [by_name[n] for n in cases]
    modes = tuple(_names(args.modes, MODES, "--modes"))
    if "plain" not in modes:
        raise ValueError("--modes must include plain: every ratio is against it")
    modes = tuple(m for m in MODES if m in modes)  # plain, first, cold, warm: warm must follow what filled it
    whole_scripts = tuple(_names(args.whole_scripts or ",".join(WHOLE_SCRIPTS), tuple(WHOLE_SCRIPTS),
                                 "--whole-scripts")) if "whole_process" in chosen else ()
    whole_modes = tuple(_names(args.whole_modes or ",".join(WHOLE_MODES), WHOLE_MODES, "--whole-modes"))
    if "plain" not in whole_modes:
        raise ValueError("--whole-modes must include plain: every ratio is against it")
    curve_scripts = tuple(_names(args.curve_scripts or defaults["curve_scripts"], CURVE_SCRIPTS,
                                 "--curve-scripts")) if "warmup_curve" in chosen else ()
    curve_modes = tuple(_names(args.curve_modes or defaults["curve_modes"], CURVE_MODES, "--curve-modes"))
    if not curve_modes:
        raise ValueError("--curve-modes needs at least one of " + ", ".join(CURVE_MODES))
    if args.drop_caches and os.geteuid() != 0:
        raise ValueError("--drop-caches writes /proc/sys/vm/drop_caches: run as root, or use --drop-page-cache "
                         "(the model's files only, no privilege needed)")
    for option in ("runs", "warm_runs", "memory_procs", "startup_repeats", "whole_runs", "curve_rounds"):
        value = getattr(args, option)
        if value is not None and value < 1:
            raise ValueError(f"--{option.replace('_', '-')} must be at least 1")
    plan = Plan(
        scenarios=loads, memory_cases=memory_cases, startup="startup" in chosen,
        scale=args.scale or defaults["scale"], runs=args.runs or defaults["runs"],
        warm_runs=args.warm_runs or args.runs or defaults["warm_runs"], modes=modes,
        memory_procs=args.memory_procs or defaults["memory_procs"],
        startup_repeats=args.startup_repeats or defaults["startup_repeats"], device=args.device,
        script_imports=_importable(args.imports),
        process_per=args.process_per or defaults["process_per"], cold_mode=args.cold_mode, quick=args.quick,
        whole_scripts=whole_scripts, whole_modes=tuple(m for m in WHOLE_MODES if m in whole_modes),
        whole_runs=args.whole_runs or defaults["whole_runs"],
        curve_scripts=curve_scripts, curve_modes=tuple(m for m in CURVE_MODES if m in curve_modes),
        curve_rounds=args.curve_rounds or defaults["curve_rounds"],
        curve_page_cache=("warm", "cold") if args.drop_caches or args.drop_page_cache else ("warm",),
        curve_drop="drop_caches" if args.drop_caches else "posix_fadvise" if args.drop_page_cache else None,
        shmem_settings=tuple(dict.fromkeys(n.strip() for n in (args.shmem_enabled or "").split(",") if n.strip())),
    )
    if args.shmem_enabled is not None and not plan.shmem_settings:
        raise ValueError("--shmem-enabled needs at least one value, e.g. never,advise")
    return plan, extra


def _cuda_device(device: str) -> tuple[Optional[str], Optional[str]]:
    """(device name, None) or (None, why CUDA cannot be used)."""
    import torch

    if not torch.cuda.is_available():
        build = "a CPU-only torch build" if torch.version.cuda is None else f"torch built for CUDA {torch.version.cuda}"
        return None, f"--device {device}: CUDA is not available ({build}, {torch.cuda.device_count()} devices)"
    index = int(device.partition(":")[2] or 0)
    return torch.cuda.get_device_name(index), None


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    if args.report:  # renders results, runs nothing: overmind.bench.page
        from overmind.bench import page

        return page.main(args.report, args.output)
    if args.output:
        print("overmind-bench: --output goes with --report", file=sys.stderr)
        return EXIT_USAGE
    alone = (args.scenarios or "").strip()
    if alone in ("compiled", "restart", "memory_pressure"):  # each its own runner, in this process
        from overmind.bench import compiled, pressure, restart

        runner = {"compiled": compiled, "restart": restart, "memory_pressure": pressure}[alone]
        return runner.main(argv, command=["overmind-bench", *argv])  # overmind.bench.alone
    started = time.monotonic()
    try:
        plan, extra = make_plan(args)
    except ValueError as err:
        print(f"overmind-bench: {err}", file=sys.stderr)
        return EXIT_USAGE

    def say(line: str) -> None:
        print(f"[{time.monotonic() - started:6.1f} s] {line}", file=sys.stderr, flush=True)

    shmem_enabled = shmem.current()
    switch = None
    if plan.shmem_settings:
        try:
            switch = shmem.Switch(list(plan.shmem_settings))
            switch.check()
        except (ValueError, shmem.SwitchRefused) as err:
            print(f"overmind-bench: {err}", file=sys.stderr)
            return EXIT_USAGE
        with switch:  # Note [Runs under each shmem setting] in overmind.bench.runner
            return _run(args, argv, plan, extra, started, say, shmem_enabled, switch)
    return _run(args, argv, plan, extra, started, say, shmem_enabled, None)


def _run(args: argparse.Namespace, argv: list[str], plan: Plan, extra: dict, started: float, say,
         shmem_enabled: Optional[str], switch: Optional[shmem.Switch]) -> int:
    cuda_name = None
    if plan.device != "cpu":
        cuda_name, why = _cuda_device(plan.device) if plan.device.startswith("cuda") else (None, None)
        if why:
            say(f"skipped: {why}; the load scenarios need it (memory and start-up still run)")
            plan.skipped.update({s.name: why for s in plan.scenarios})
    cache_dir = (args.cache_dir or M.default_cache_dir()).expanduser().resolve()
    needed = list(dict.fromkeys([*(n for s in [*plan.scenarios, *plan.memory_cases] if s.name not in plan.skipped
                                   for n in s.models),
                                 *(n for name in (*plan.curve_scripts, *plan.whole_scripts)
                                   for n in WHOLE_SCRIPTS[name].models)]))
    log_dir = Path(tempfile.mkdtemp(prefix="overmind-bench-logs-"))
    try:
        server = BenchServer.start()
    except BenchError as err:
        print(f"overmind-bench: {err}", file=sys.stderr)
        return EXIT_FAILED
    startup = whole = curve = None
    try:
        say(f"private overmind-server pid {server.pid} in {server.runtime_dir}; worker logs in {log_dir}")
        runner = Runner(plan, {}, server, log_dir, cwd=os.getcwd(), echo=say, switch=switch)
        # The server's warm interpreter starts while models are generated (Runner.prestart).
        prestart = None
        if plan.quick and plan.memory_cases:
            runner.start_holders_early()  # they ask for it too
        elif plan.memory_cases or any(s.name not in plan.skipped for s in plan.scenarios):
            prestart = runner.prestart()
        try:
            runner.paths = M.generate_in_child(cache_dir, plan.scale, needed, progress=not args.no_progress)
        except Exception as err:  # noqa: BLE001 -- whatever generation raised, say it and stop
            print(f"overmind-bench: generating models in {cache_dir} failed: {type(err).__name__}: {err}",
                  file=sys.stderr)
            return EXIT_FAILED
        finally:
            if prestart is not None:
                _close_prestart(runner, prestart)
        runner.paths.update(extra)
        if args.drop_page_cache:
            _plan_page_cache(plan, runner.paths, say)
        if plan.curve_scripts:
            curve = _warmup_curve(plan, runner.paths, log_dir, say, switch)
        results = runner.run()
        if plan.whole_scripts:
            whole = _whole_process(plan, runner.paths, server, log_dir, say)
        if plan.startup:
            say(f"start-up: timing {plan.startup_repeats} bare and {plan.startup_repeats} patched interpreters")
            startup = startup_overhead(plan.startup_repeats)
    except BenchError as err:  # the server failed under us; a scenario's failure is in its results
        print(f"overmind-bench: {err}\nworker logs: {log_dir}\nserver log: {server.log()[-2000:]}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        say("interrupted")
        return 130
    finally:
        server.stop()
    doc = document(plan, results, startup, cache_dir=cache_dir, wall_s=time.monotonic() - started,
                   cuda_device=cuda_name, argv=["overmind-bench", *argv], whole=whole, curve=curve,
                   shmem_enabled=shmem_enabled, about=args.about)
    validate(doc)
    print(format_tables(doc), flush=True)
    if args.json:
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
        say(f"wrote {args.json}")
    if args.plot:
        try:
            plot(doc, args.plot)
            say(f"wrote {args.plot}")
        except RuntimeError as err:
            print(f"overmind-bench: {err}", file=sys.stderr)
            return EXIT_FAILED
    failed = [s["name"] for s in doc["scenarios"] if s["status"] == "failed"]
    failed += [f"memory {m['scenario']}" for m in doc["memory"] if m["status"] == "failed"]
    failed += [f"whole process {s['name']}" for s in (doc["whole_process"] or {}).get("scripts", [])
               if s["status"] == "failed"]
    failed += [f"warm-up curve {s['name']} (page cache {s['page_cache']})"
               for s in (doc["warmup_curve"] or {}).get("scripts", []) if s["status"] == "failed"]
    if failed:
        say(f"overmind-bench: failed: {', '.join(failed)}; worker logs kept in {log_dir}")
        return EXIT_FAILED
    if args.keep_logs:
        say(f"worker logs kept in {log_dir}")
    else:
        shutil.rmtree(log_dir, ignore_errors=True)
    return EXIT_OK


def _whole_process(plan: Plan, paths: dict, server: BenchServer, log_dir: Path, say) -> dict:
    whole = WholeProcess(plan, paths, server, log_dir, echo=say)
    say(f"whole process: {', '.join(plan.whole_scripts)} x {', '.join(plan.whole_modes)}, "
        f"{plan.whole_runs} runs each; scripts in {whole.dir}")
    try:
        return whole.run()
    finally:
        whole.close()


def _warmup_curve(plan: Plan, paths: dict, log_dir: Path, say, switch: Optional[shmem.Switch]) -> dict:
    if plan.curve_drop == "drop_caches":
        drop_all_caches()  # says now, not after the first round, when it is not permitted
    curve = WarmupCurve(plan, paths, log_dir, echo=say, switch=switch)
    say(f"warm-up curve: {', '.join(plan.curve_scripts)} x python, {', '.join(plan.curve_modes)}; "
        f"{plan.curve_rounds} rounds of, per mode, {plan.curve_plain} plain runs then runs 1-5 and one after a restart, "
        f"page cache {' and '.join(plan.curve_page_cache)}; scripts in {curve.dir}"
        f"{'; each imports ' + ', '.join(plan.script_imports) + ' after torch' if plan.script_imports else ''}")
    try:
        return curve.run()
    finally:
        curve.close()


def _close_prestart(runner: Runner, worker, timeout: float = 60.0) -> None:
    # Its only job is monkey_patch_all()'s background request for a warm interpreter.
    deadline = time.monotonic() + timeout
    try:
        worker.wait_ready()
        while not runner.interpreters_started() and time.monotonic() < deadline:
            time.sleep(0.1)
    except BenchError:
        pass  # the timed runs start one anyway
    finally:
        worker.close()


def _plan_page_cache(plan: Plan, paths: dict, say) -> None:
    """Add the page-cache-cold state if dropping is permitted here; say which method, or why not."""
    files = [f for s in plan.scenarios if s.name not in plan.skipped
             for f in (paths.get("custom_files") or [] if s.name == "custom"
                       else [f for n in s.models for f in M.model_files(paths[n])])]
    files += [f for name in plan.whole_scripts for n in WHOLE_SCRIPTS[name].models for f in M.model_files(paths[n])]
    if not files:
        say("page cache cold: skipped: no local model files to evict")
        return
    if any(s.name == "custom" for s in plan.scenarios) and paths.get("custom_files") is None:
        say("page cache cold: skipped: your model has no local files to evict (a hub id not in the local cache?)")
        return
    try:
        plan.page_cache_method = drop_page_cache(files[:1])
    except BenchError as err:
        say(f"page cache cold: skipped: {err}")
        return
    plan.page_cache = ("warm", "cold")
    say(f"page cache cold: {plan.page_cache_method} on every model file before each run")
