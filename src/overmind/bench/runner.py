"""Runs a benchmark plan: every load in fresh worker processes, then the memory scenario.

    results = Runner(plan, paths, server, log_dir).run()     # the dict report.document() wraps

Modes, each a fresh process (:mod:`overmind.bench.worker`):

- ``plain``: ``OVERMIND_DISABLE=1``, the libraries' own load functions;
- ``cold``: overmind after ``overmind evict --all``: a miss (by default the caller runs the
  original load function while the server fills the cache behind it);
- ``warm``: overmind, every call a hit;
- ``first`` (only when asked for): cold on a server started just before, no loader ready.

Note [Rounds interleave the modes]
Round r runs plain, then cold, then warm, then round r+1: the machine is shared and its
load drifts, and interleaving spreads that drift over every mode instead of charging it
to whichever ran last. Warm follows cold, so the cold run is what filled the cache; the
server is idle before each run (a cache fill behind a cold load would otherwise compete
with the next run for the CPU), and warm runs must add no miss.

Note [Runs under each shmem setting]
With ``--shmem-enabled never,advise`` each round runs plain, cold and warm under each
value in turn (Note [Rounds interleave the modes]), so a warm run always maps segments
that the cold run before it filled under the same value: segments filled under
``never`` hold small pages whatever the setting later becomes. Every run records the
value it ran under, and ratios compare runs of the same value. Only the timed load
scenarios run under the values; the original is back for everything after them.

Note [Processes per scenario or per run]
By default each scenario gets its own worker per run. ``--quick`` (``process_per="run"``)
runs every scenario of a round in one worker per mode, in turn: interpreter start-up and
``import torch, diffusers, transformers`` cost seconds on a small machine, and paying them
once per mode is what keeps the quick run within minutes. Loads are timed the same way;
only ``import`` is then shared by the scenarios of that worker.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from overmind.bench import shmem
from overmind.bench.harness import (BenchError, BenchServer, Worker, base_env, drop_page_cache, pss, summary, tree_pss,
                                    used_memory)
from overmind.bench.models import model_files
from overmind.bench.scenarios import Scenario

__all__ = ["Plan", "Runner", "MODES", "FALLBACK_MARK"]

MODES = ("plain", "first", "cold", "warm")
# What overmind.api's fallback warning looks like on stderr: a run that printed it did not
# go through the cache, whatever its times say.
FALLBACK_MARK = "Warning: overmind:"


@dataclass
class Plan:
    scenarios: list[Scenario]
    memory_cases: list[Scenario]
    startup: bool = True
    scale: str = "base"
    runs: int = 3
    warm_runs: int = 3
    modes: tuple[str, ...] = ("plain", "cold", "warm")
    page_cache: tuple[str, ...] = ("warm",)
    page_cache_method: Optional[str] = None
    memory_procs: int = 4
    startup_repeats: int = 20
    device: str = "cpu"
    script_imports: tuple[str, ...] = ()  # --imports: what the curve's and whole process's scripts import after torch
    process_per: str = "scenario"
    cold_mode: str = "background"
    quick: bool = False
    skipped: dict = field(default_factory=dict)  # scenario name -> reason
    # The whole-process scenario (overmind.bench.whole); no scripts: not run.
    whole_scripts: tuple[str, ...] = ()
    whole_modes: tuple[str, ...] = ("plain", "patched", "run", "first_run")
    whole_runs: int = 5
    whole_warmup: int = 2
    # The warm-up curve (overmind.bench.curve); no scripts: not run.
    curve_scripts: tuple[str, ...] = ()
    curve_modes: tuple[str, ...] = ("patched", "run")
    curve_rounds: int = 2
    curve_plain: int = 2  # plain runs before each mode's, per round: their median is the baseline
    curve_page_cache: tuple[str, ...] = ("warm",)
    curve_drop: Optional[str] = None  # how the "cold" state drops: posix_fadvise or drop_caches
    # --shmem-enabled: the load scenarios run under each (Note [Runs under each shmem setting]);
    # empty: under the machine's value, unchanged.
    shmem_settings: tuple[str, ...] = ()


class Runner:
    def __init__(self, plan: Plan, paths: dict, server: BenchServer, log_dir: Path, cwd: Optional[str] = None,
                 echo=None, switch: Optional[shmem.Switch] = None) -> None:
        self.plan, self.paths, self.server, self.log_dir, self.cwd = plan, paths, server, Path(log_dir), cwd
        self.switch = switch  # sets plan.shmem_settings in turn
        self.echo = echo or (lambda line: print(line, file=sys.stderr, flush=True))
        self.results: dict = {}
        self._holders: dict[str, list[Worker]] = {}

    # -- timing ---------------------------------------------------------------------------

    def files(self, scenario: Scenario) -> list[Path]:
        if scenario.name == "custom":
            return self.paths.get("custom_files") or []
        out: list[Path] = []
        for name in scenario.models:
            out += model_files(self.paths[name])
        return sorted(set(out))

    def env(self, mode: str) -> dict:
        if mode == "plain":
            return base_env({"OVERMIND_DISABLE": "1", "OVERMIND_RUNTIME_DIR": str(self.server.runtime_dir),
                             "OVERMIND_NO_AUTOSTART": "1"})
        return self.server.client_env({"OVERMIND_COLD": self.plan.cold_mode})

    def _entry(self, scenario: Scenario) -> dict:
        if scenario.name not in self.results:
            files = self.files(scenario)
            self.results[scenario.name] = {
                "scenario": scenario, "runs": {}, "tensor_bytes": None,
                "file_bytes": sum(p.stat().st_size for p in files), "status": "ok", "reason": None,
                "warm_misses": 0,
            }
        return self.results[scenario.name]

    def _fail(self, scenario: Scenario, reason: str) -> None:
        entry = self._entry(scenario)
        if entry["status"] != "failed":
            entry["status"], entry["reason"] = "failed", reason.strip()
            self.echo(f"{scenario.name}: FAILED: {reason.strip().splitlines()[0] if reason.strip() else ''}")

    def job(self, scenario: Scenario, hold: bool = False, device: Optional[str] = None) -> dict:
        paths = {name: str(self.paths[name]) for name in scenario.models}
        return {"op": "load", "scenario": scenario.name, "paths": paths, "options": scenario.options,
                "device": device or self.plan.device, "hold": hold}

    def run_batch(self, batch: list[Scenario], mode: str, cache_state: str, round_: int) -> None:
        batch = [s for s in batch if self._entry(s)["status"] == "ok"]
        if not batch:
            return
        if mode == "first":
            self.server.restart(keep_state=False)  # a server that learned nothing yet
        if mode in ("cold", "first"):
            self.server.evict_all()
            self.server.wait_idle()
        misses = _missed(self.server.status()) if mode == "warm" else 0
        setting = shmem.current()
        preload = list(dict.fromkeys(p for s in batch for p in s.preload))
        label = f"{mode}-pagecache-{cache_state}-{round_ + 1}-{'+'.join(s.name for s in batch)}"
        worker = Worker(self.env(mode), preload, self.log_dir, label[:200], cwd=self.cwd)
        try:
            try:
                ready = worker.wait_ready()
            except BenchError as err:
                for s in batch:
                    self._fail(s, str(err))
                return
            for scenario in batch:
                if cache_state == "cold":
                    drop_page_cache(self.files(scenario))
                try:
                    reply = worker.request(self.job(scenario))
                except BenchError as err:
                    self._fail(scenario, str(err))
                    continue
                if mode != "plain":
                    self.server.wait_idle()
                entry = self._entry(scenario)
                entry["tensor_bytes"] = reply["tensor_bytes"]
                run = {"import": ready["import_s"], **reply["phases"]}
                entry["runs"].setdefault((mode, cache_state, setting), []).append(run)
                under = f" shmem_enabled {setting}" if self.plan.shmem_settings else ""
                self.echo(f"{scenario.name:<13} {mode:<5} page cache {cache_state:<4}{under} run {round_ + 1}: "
                          f"load {run['total']:.3f} s, first use {run['first_use']:.3f} s, "
                          f"import {run['import']:.2f} s")
        finally:
            worker.close()
        if mode != "plain" and FALLBACK_MARK in worker.stderr():
            line = next(ln for ln in worker.stderr().splitlines() if FALLBACK_MARK in ln)
            for s in batch:
                self._fail(s, f"{mode} run fell back to a plain load: {line.strip()}")
        if mode == "warm":
            extra = _missed(self.server.status()) - misses
            for s in batch:
                self._entry(s)["warm_misses"] += extra

    def timing(self) -> None:
        plan = self.plan
        runnable = [s for s in plan.scenarios if s.name not in plan.skipped]
        batches = [runnable] if plan.process_per == "run" else [[s] for s in runnable]
        counts = {"plain": plan.runs, "first": plan.runs, "cold": plan.runs, "warm": plan.warm_runs}
        settings: tuple = plan.shmem_settings or (None,)
        try:
            for batch in (b for b in batches if b):
                for cache_state in plan.page_cache:
                    if cache_state == "warm":
                        for scenario in batch:
                            _read_files(self.files(scenario))
                    # Note [Rounds interleave the modes], Note [Runs under each shmem setting]
                    for round_ in range(max(counts[m] for m in plan.modes)):
                        for setting in settings:
                            if setting is not None and self.switch is not None:
                                self.switch.set(setting)
                            for mode in plan.modes:
                                if round_ < counts[mode]:
                                    self.run_batch(batch, mode, cache_state, round_)
        finally:
            if self.switch is not None:
                self.switch.restore()

    # -- memory ---------------------------------------------------------------------------

    def memory(self, scenario: Scenario) -> dict:
        """K workers hold ``scenario``'s object (every weight touched), plain and then through
        overmind; growth of their summed PSS and of the machine's used memory.

        Note [One set of holders]
        The same K processes hold the model plainly (``unpatch_all()``), let go of it, and
        hold it through overmind (``monkey_patch_all()`` again), so the K imports are paid
        once. Each pair of measurements brackets one set of loads, with the same processes
        alive at both ends; what a process kept of the plain load stays in both ends of the
        overmind pair and cancels out. The cache is empty when the overmind loads start
        (``OVERMIND_COLD=wait``: one fill, every holder maps it), so its shared memory is
        part of the growth."""
        out: dict = {"scenario": scenario.name, "procs": self.plan.memory_procs, "tensor_bytes": None,
                     "status": "ok", "reason": None, "plain": None, "overmind": None}
        _read_files(self.files(scenario))
        self.server.evict_all()
        self.server.wait_idle()
        workers = self._holders.pop(scenario.name, None) or self.start_holders(scenario)
        try:
            for w in workers:
                w.wait_ready()
            self.wait_interpreters_ready()
            for mode in ("plain", "overmind"):
                for w in workers:
                    w.request({"op": "unpatch" if mode == "plain" else "patch"})
                out[mode], out["tensor_bytes"] = self._hold(scenario, mode, workers)
                for w in workers:
                    w.request({"op": "drop"})
        except BenchError as err:
            out["status"], out["reason"] = "failed", str(err).strip()
            self.echo(f"memory {scenario.name}: FAILED: {str(err).strip().splitlines()[0]}")
            return out
        finally:
            for w in workers:
                w.close()
        text = "".join(w.stderr() for w in workers)
        if FALLBACK_MARK in text:
            out["status"] = "failed"
            out["reason"] = "a holder fell back to a plain load: " + next(
                ln for ln in text.splitlines() if FALLBACK_MARK in ln).strip()
        return out

    def start_holders(self, scenario: Scenario) -> list[Worker]:
        # Patched, waiting for the cache on a miss (Note [One set of holders]); each in its own
        # process, never handed over: a holder forked from a warm interpreter shares that
        # interpreter's pages, and their PSS shifts as holders come and go.
        env = self.server.client_env({"OVERMIND_COLD": "wait", "OVERMIND_WARM_START": "0"})
        return [Worker(env, scenario.preload, self.log_dir, f"memory-{scenario.name}-{i + 1}", cwd=self.cwd)
                for i in range(self.plan.memory_procs)]

    def start_holders_early(self) -> None:
        """Note [Early holders]: the memory scenario's workers spend seconds importing and
        then wait, idle, until the memory scenario; ``--quick`` starts them first, beside
        model generation and the server's warm interpreter start-up (which they ask for), instead of
        after the timed runs. A full run does not: K idle holders would sit on memory for
        minutes, and a separate :meth:`prestart` gets the loader started."""
        for scenario in self.plan.memory_cases:
            self._holders[scenario.name] = self.start_holders(scenario)

    def _hold(self, scenario: Scenario, mode: str, workers: list[Worker]) -> tuple[dict, int]:
        overmind = mode == "overmind"

        def measure() -> tuple[int, int]:
            used = used_memory()  # waits for freed memory to show (harness.used_memory)
            total = sum(pss(w.pid) for w in workers)
            return total + (tree_pss(self.server.pid) if overmind else 0), used

        pss0, used0 = measure()
        for w in workers:
            w.send(self.job(scenario, hold=True, device="cpu"))
        replies = [w.receive() for w in workers]
        if overmind:
            self.server.wait_idle()
        pss1, used1 = measure()
        nbytes = max(replies[0]["tensor_bytes"], 1)
        result = {"pss_bytes": pss1 - pss0, "used_bytes": used1 - used0, "pss_ratio": (pss1 - pss0) / nbytes,
                  "used_ratio": (used1 - used0) / nbytes, "pss_before_bytes": pss0, "pss_after_bytes": pss1,
                  "load_s": summary([r["phases"]["total"] for r in replies])}
        self.echo(f"memory {scenario.name:<13} {mode:<8} {len(workers)} holders: summed PSS "
                  f"{result['pss_bytes'] / 1e9:+.2f} GB, used memory {result['used_bytes'] / 1e9:+.2f} GB, "
                  f"{replies[0]['tensor_bytes'] / 1e9:.2f} GB of tensors")
        return result, replies[0]["tensor_bytes"]

    def prestart(self) -> Worker:
        """Get the server's warm interpreter for the workers' context started now, while models are
        generated: a warm interpreter importing torch beside a timed worker would slow it (its import
        time most). monkey_patch_all() asks for it in the background; close the returned
        worker once :meth:`interpreters_started` says the request arrived."""
        worker = Worker(self.env("warm"), [], self.log_dir, "prestart", cwd=self.cwd)
        return worker

    def interpreters_started(self) -> bool:
        return bool(self.server.status().get("interpreters"))

    def wait_interpreters_ready(self, timeout: float = 300.0) -> None:
        # A warm interpreter still importing must not land between two measurements.
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            interpreters = self.server.status().get("interpreters") or []
            if all(isinstance(z, dict) and z.get("ready") for z in interpreters):
                return
            time.sleep(0.2)

    # -- everything -----------------------------------------------------------------------

    def run(self) -> dict:
        for worker in (w for ws in self._holders.values() for w in ws):
            try:
                worker.wait_ready()  # early holders (Note [Early holders]): imported before anything is timed
            except BenchError:
                pass  # the memory scenario reports it
        self.wait_interpreters_ready()
        self.timing()
        memory = [self.memory(s) for s in self.plan.memory_cases]
        return {"scenarios": self.results, "memory": memory}


def _read_files(files: list[Path]) -> None:
    """Warm the page cache: every byte of ``files`` read once."""
    for path in files:
        with open(path, "rb") as f:
            while f.read(1 << 24):
                pass


def _missed(status: dict) -> int:
    """Loads the cache did not serve: those that started a fill and those that loaded beside one."""
    return status["misses"] + status.get("plain_loads", 0)
