"""The warm-up curve: what a user meets in the loop edit, run, look, run again.

    curve = WarmupCurve(plan, paths, log_dir, echo=say).run()   # report.document() wraps it

For each of the whole-process scripts (:data:`overmind.bench.whole.SCRIPTS`) and each mode of
:data:`MODES`, a fresh ``overmind-server`` in a private runtime directory with an empty cache,
then runs 1 to 5 of the script with no pause between them (the next starts as the last exits:
a fill, or the imports of a warm interpreter, that the server does behind run 1 must be done
by the time run 2 needs it, or run 2 pays), then one more run after the server was restarted
as the systemd unit restarts it: its memory is gone, it refills what it kept in its state
directory, and the run starts once ``overmind status --wait-ready`` returns (Note [Restore after
a restart] in overmind.server.restore; ``python -m overmind.bench.restart`` times the restore). Plain ``python script.py`` runs in the same round, right before
each mode's runs; each run's exit over the median of plain's runs is the figure. Modes:

- ``patched``: ``python script.py``, the script's first two lines being README's one line
  (``import overmind.api``, ``overmind.api.monkey_patch_all()``), no overmind variable set:
  the run is handed to a warm interpreter where that is safe (Note [When a warm start applies]
  in overmind.client.warm_start);
- ``dropin``: the same with ``OVERMIND_WARM_START=0``: only the loads are warm;
- ``run``: ``overmind run script.py``.

Unlike the whole-process scenario, nothing waits for the server to go quiet between runs:
that wait is exactly what a user does not do (Note [Quiet between runs] in
overmind.bench.whole measures the opposite). Page cache: warm (the files read before each
round), and with ``--drop-page-cache`` (the model's files) or ``--drop-caches`` (the whole
machine's page cache, root only: what another workload leaves behind) dropped before every run,
plain's included.

Every run must exit 0 and print its markers, and the sum of the bytes it read from the weights
(one byte of every page, as ``touch`` reads them) must equal plain's: a wrong or stale model
fails the curve. A fallback warning is recorded, not failed: the curve shows what happens.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from overmind.bench import shmem
from overmind.bench.harness import BenchServer, base_env, drop_all_caches, drop_page_cache, summary
from overmind.bench.whole import (FALLBACK_MARK, RUN_TIMEOUT, SCRIPTS, Script, front_end, read_marks, script_files,
                                  script_source)

__all__ = ["MODES", "RUNS", "WarmupCurve", "summarize"]

MODES = ("patched", "dropin", "run")
ONE_LINE = "import overmind.api\novermind.api.monkey_patch_all()\n"  # README's, at the top of the script
RUNS = ("1", "2", "3", "4", "5", "restart")


class WarmupCurve:
    def __init__(self, plan, paths: dict, log_dir: Path, echo=None, switch=None) -> None:
        self.plan, self.paths, self.log_dir = plan, paths, Path(log_dir)
        self.switch = switch  # --shmem-enabled: the curve runs under each value in turn
        self.echo = echo or (lambda line: print(line, file=sys.stderr, flush=True))
        self.dir = Path(tempfile.mkdtemp(prefix="overmind-bench-curve-"))
        self.front = front_end()
        self.counter = 0
        # (script, page cache, shmem_enabled) -> {"plain": [run], mode: {run: [run]}, "status", "reason"}
        self.results: dict = {}

    def _drop(self, script: Script, cache_state: str) -> None:
        if cache_state == "cold":
            if self.plan.curve_drop == "drop_caches":
                drop_all_caches()
            else:
                drop_page_cache(script_files(script, self.paths))

    def once(self, script: Script, mode: str, cache_state: str, label: str,
             server: Optional[BenchServer]) -> dict:
        """One fresh process from here, timed from just before its start to its exit."""
        self._drop(script, cache_state)
        argv = [*(self.front if mode == "run" else [sys.executable]),
                f"{script.name}{'_one_line' if mode in ('patched', 'dropin') else ''}.py"]
        env = base_env() if server is None else server.client_env(
            {"OVERMIND": "1", **({"OVERMIND_WARM_START": "0"} if mode == "dropin" else {})})
        before = server.status() if server else {}
        start = time.monotonic()
        proc = subprocess.run(argv, cwd=self.dir, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                              text=True, timeout=RUN_TIMEOUT)
        wall = time.monotonic() - start
        after = server.status() if server else {}
        self.counter += 1
        log = self.log_dir / f"curve-{self.counter:03d}-{label}.log"
        log.write_text(f"$ {' '.join(argv)}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")
        marks = read_marks(proc.stdout, start)
        used = marks.get("used")
        run = {"wall": wall, "ready": marks["ready"][0] if "ready" in marks else None,
               "used": used[0] if used else None,
               "sum": int(used[3][1]) if used and len(used[3]) > 1 else None,
               "hits": after.get("hits", 0) - before.get("hits", 0),
               "misses": after.get("misses", 0) - before.get("misses", 0),
               "plain_loads": after.get("plain_loads", 0) - before.get("plain_loads", 0),
               "forked": after.get("runs", 0) - before.get("runs", 0) == 1,
               "fallback": FALLBACK_MARK in proc.stderr}
        problem = None
        if proc.returncode != 0 or run["sum"] is None:
            problem = f"{label}: exited with status {proc.returncode}, markers {sorted(marks)}; log: {log}\n" \
                      f"{proc.stderr[-2000:]}"
        return {"run": run, "problem": problem}

    def _entry(self, script: Script, cache_state: str, setting: Optional[str]) -> dict:
        return self.results.setdefault((script.name, cache_state, setting), {
            "plain": [], **{m: {r: [] for r in RUNS} for m in self.plan.curve_modes},
            "status": "ok", "reason": None})

    def _fail(self, entry: dict, reason: str) -> None:
        if entry["status"] == "ok":
            entry["status"], entry["reason"] = "failed", reason
            self.echo(f"warm-up curve: FAILED: {reason.splitlines()[0]}")

    def run(self) -> dict:
        scripts = [SCRIPTS[n] for n in self.plan.curve_scripts]
        for script in scripts:
            source = script_source(script.name, {n: self.paths[n] for n in script.models}, self.plan.device,
                                   self.plan.script_imports)
            (self.dir / f"{script.name}.py").write_text(source)
            (self.dir / f"{script.name}_one_line.py").write_text(ONE_LINE + source)
        settings = self.switch.values if self.switch else [shmem.current()]
        for setting in settings:
            if self.switch:
                self.switch.set(setting)
            for cache_state in self.plan.curve_page_cache:
                for script in scripts:
                    entry = self._entry(script, cache_state, setting)
                    for round_ in range(self.plan.curve_rounds):
                        if entry["status"] != "ok":
                            break
                        self._round(script, cache_state, round_, entry, setting)
        return {"scripts": self.results, "settings": settings, "dir": str(self.dir)}

    def _round(self, script: Script, cache_state: str, round_: int, entry: dict, setting: Optional[str]) -> None:
        name = f"{script.name} page cache {cache_state}, shmem {setting}, round {round_ + 1}"
        for mode in self.plan.curve_modes:
            # Plain's runs right before each mode's: a shared machine's speed drifts in minutes.
            for i in range(self.plan.curve_plain):
                done = self.once(script, "plain", cache_state, f"{script.name}-{cache_state}-plain-{round_ + 1}-"
                                 f"{mode}-{i + 1}", None)
                if done["problem"]:
                    return self._fail(entry, done["problem"])
                entry["plain"].append(done["run"])
                self.echo(f"warm-up curve {name}: python {done['run']['wall']:.2f} s")
            expected = entry["plain"][0]["sum"]
            # Fresh: an empty cache, no warm interpreter; started by run 1, as a user's first run starts it.
            server = BenchServer.autostart()
            try:
                for run in RUNS:
                    if run == "restart":
                        server.restart()
                    done = self.once(script, mode, cache_state, f"{script.name}-{cache_state}-{mode}-"
                                     f"{round_ + 1}-{run}", server)
                    r = done["run"]
                    if done["problem"] or r["sum"] != expected:
                        return self._fail(entry, done["problem"] or f"{name}, {mode} run {run}: the weights read "
                                          f"sum to {r['sum']}, plain's to {expected}: not the same model")
                    entry[mode][run].append(r)
                    self.echo(f"warm-up curve {name}: {mode} run {run}: {r['wall']:.2f} s, {r['hits']} hits, "
                              f"{r['misses']} misses, {r['plain_loads']} plain{', forked' if r['forked'] else ''}"
                              f"{', FALLBACK' if r['fallback'] else ''}")
            finally:
                # The server's own account of the round (its log goes with its runtime directory).
                (self.log_dir / f"curve-server-{script.name}-{cache_state}-{setting}-{mode}-{round_ + 1}.log").write_text(
                    server.log())
                server.stop()

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def summarize(results: dict, plan) -> list[dict]:
    """The ``warmup_curve.scripts`` list of the JSON document (schema in overmind.bench.report)."""
    out = []
    for setting in results.get("settings") or [None]:
        for cache_state in plan.curve_page_cache:
            for name in plan.curve_scripts:
                out.append(_summarize_one(results["scripts"].get((name, cache_state, setting)), plan, name,
                                          cache_state, setting))
    return out


def _summarize_one(entry: Optional[dict], plan, name: str, cache_state: str, setting: Optional[str]) -> dict:
    script = SCRIPTS[name]
    item = {"name": name, "title": script.title, "command": script.command("python"), "page_cache": cache_state,
            "shmem_enabled": setting, "status": "skipped", "reason": "not run", "plain": None, "modes": []}
    if entry is None:
        return item
    item.update(status=entry["status"], reason=entry["reason"])
    plain = [r["wall"] for r in entry["plain"]]
    item["plain"] = summary(plain) if plain else None
    for mode in plan.curve_modes:
        runs = []
        for run in RUNS:
            done = entry[mode][run]
            wall = summary([r["wall"] for r in done]) if done else None
            runs.append({"run": run, "runs": done, "wall": wall,
                         "x_plain": wall["median"] / item["plain"]["median"] if wall and item["plain"] else None})
        item["modes"].append({"mode": mode, "runs": runs})
    return item
