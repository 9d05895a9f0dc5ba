"""The restart_restore scenario: how warm a fresh server is after a restart.

    python -m overmind.bench.restart --scale base              # SD1.5 sizes and the 1 B LM
    python -m overmind.bench.restart --scale small --stop sigkill --json out.json

With the whole-process scenario's scripts (overmind.bench.whole: the ControlNet
pipeline and the LM), on a private server: plain ``python`` twice (the reference times and
weights); each script twice patched and twice with ``overmind run`` (the cache and the
interpreter learn); then for each way of stopping (``overmind shutdown``, SIGKILL):

- *restore*: ``overmind-server --daemon`` on the same runtime and state directories, timed
  until ``overmind status --wait-ready`` returns (Note [Restore after a restart] in
  overmind.server.restore);
- the very next run of each script from the shell, with ``overmind run`` and patched, against
  plain (targets: <= 0.15 x and <= 0.92 x plain), its weights' checksum equal to plain's;
- *cold fill*: the same restore again with the state's learning taken out (no modules, no
  warm interpreters: each refill starts as a first miss would), timed the same way
  (target: restore <= cold fill x 1.2).

Then *the ControlNet script during a restore* (``--contention-pairs N``, default 3; 0 skips it): a
server whose state holds the entries of both scripts over a copy of their models (5.7 GB at
base scale: other files, so other entries) is started, and as soon as its refills run, the
ControlNet script runs patched from the shell (its own models not cached: a first load);
against the same run beside a server started with nothing to restore, in alternating pairs
(target: at most 1.10 x). Its restore and its fill share the machine with the client as any
restore would.

Times are from the start of the process to its model ready (``ready``) and to its exit, as
overmind.bench.whole measures them. On stdout (or in ``--json FILE``): overmind-bench's document
with the results under ``restart`` (:mod:`overmind.bench.alone`), which ``overmind-bench --report``
renders. ``overmind-bench --scenarios restart [--scale S] [--stop S] [--contention-pairs N]`` runs
the same.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from overmind.bench.harness import BenchServer
from overmind.bench.models import SCALES, default_cache_dir, ensure_models
from overmind.bench.whole import SCRIPTS, front_end, script_source, time_script

__all__ = ["main", "TARGETS"]

TARGETS = {"restore_over_cold_fill": 1.2, "run_over_plain": 0.15, "patched_over_plain": 0.92,
           "client_during_restore": 1.10}
SCRIPT_NAMES = ("controlnet", "lm")


def _wait_gone(pid: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)


def _restart(server: BenchServer, stop: str, strip_learning: bool = False) -> dict:
    """Stop the server as ``stop`` says, start a fresh one, time it until ready."""
    pid = server.pid
    if stop == "sigkill":
        os.kill(pid, signal.SIGKILL)
        _wait_gone(pid)
    else:
        server.cli("shutdown")
    if strip_learning:  # Note: a cold fill of the same entries (module docstring)
        for path in (server.runtime_dir / "state").glob("state-*.json"):
            doc = json.loads(path.read_text())
            for context in doc["contexts"]:
                context["modules"], context["interpreters"] = [], []
            path.write_text(json.dumps(doc))
    start = time.monotonic()
    server.launch()
    server.cli("status", "--wait-ready", "--timeout", "1800")
    seconds = time.monotonic() - start
    return {"seconds": seconds, "restore": server.status()["restore"]}


def _models(scale: str) -> dict:
    """SCRIPT_NAMES' models at ``scale``, generated if need be: name -> path."""
    return ensure_models(default_cache_dir(), scale, sorted({m for n in SCRIPT_NAMES for m in SCRIPTS[n].models}))


def _scripts(prefix: str, paths: dict) -> Path:
    """A new folder holding SCRIPT_NAMES' scripts over the models at ``paths``."""
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    for name in SCRIPT_NAMES:
        (folder / f"{name}.py").write_text(script_source(name, paths))
    return folder


def _copies(paths: dict, say) -> dict:
    """The same models at other paths (``<model>-copy`` beside each, made once): the same bytes,
    other files, so other cache entries, for a restore that holds none of the client's."""
    out = {}
    for name, path in paths.items():
        folder = path if path.is_dir() else path.parent
        copy, done = folder.with_name(folder.name + "-copy"), folder.with_name(folder.name + "-copy.done")
        if not done.exists():
            say(f"copying {folder} to {copy} (once)")
            shutil.rmtree(copy, ignore_errors=True)
            shutil.copytree(folder, copy)
            done.touch()
        out[name] = copy if path.is_dir() else copy / path.name
    return out


def run(scale: str, stops: list, say, results: Optional[dict] = None) -> dict:
    """Restores after each way of stopping in ``stops``; the results, filled into ``results`` as it goes."""
    results = {} if results is None else results
    results.update(scale=scale, targets=TARGETS, plain={}, stops={})
    folder = _scripts("om-bench-restart-", _models(scale))
    server = BenchServer.start()
    try:
        env = server.client_env()
        patched_env = server.client_env({"OVERMIND": "1"})
        python = [sys.executable]
        for name in SCRIPT_NAMES:
            plain = [time_script(python + [f"{name}.py"], env, str(folder)) for _ in range(2)]
            results["plain"][name] = {"ready": statistics.median(p["ready"] for p in plain),
                                      "exit": statistics.median(p["exit"] for p in plain),
                                      "weights": plain[0]["weights"]}
            say(f"plain {name}: ready {results['plain'][name]['ready']:.2f}s, exit {results['plain'][name]['exit']:.2f}s")
        for name in SCRIPT_NAMES:  # the learning runs
            for argv in (python, front_end(), python, front_end()):
                time_script(argv + [f"{name}.py"], patched_env, str(folder))
                server.wait_idle()
        time.sleep(3)  # one save at least (SAVE_INTERVAL) after the last fill
        for stop in stops:
            restored = _restart(server, stop)
            say(f"{stop}: restore {restored['seconds']:.2f}s ({restored['restore']})")
            nxt = {}
            for name in SCRIPT_NAMES:
                for mode, argv in (("run", front_end()), ("patched", python)):
                    t = time_script(argv + [f"{name}.py"], patched_env, str(folder))
                    plain = results["plain"][name]
                    nxt[f"{name}/{mode}"] = {**t, "over_plain": t["exit"] / plain["exit"],
                                             "weights_equal": t["weights"] == plain["weights"]}
                    say(f"  next {mode} {name}: exit {t['exit']:.2f}s = {t['exit'] / plain['exit']:.3f} x plain, "
                        f"weights {'equal' if t['weights'] == plain['weights'] else 'DIFFER'}")
            server.wait_idle()
            time.sleep(3)
            cold = _restart(server, "shutdown", strip_learning=True)
            say(f"  cold fill of the same entries: {cold['seconds']:.2f}s ({cold['restore']})")
            server.wait_idle()
            results["stops"][stop] = {"restore_seconds": restored["seconds"], "restore": restored["restore"],
                                      "cold_fill_seconds": cold["seconds"], "cold_fill": cold["restore"],
                                      "restore_over_cold_fill": restored["seconds"] / cold["seconds"],
                                      "next": nxt}
            # The cold fill's learning runs put the learning back for the next stop.
            for name in SCRIPT_NAMES:
                for argv in (python, front_end()):
                    time_script(argv + [f"{name}.py"], patched_env, str(folder))
                    server.wait_idle()
            time.sleep(3)
    finally:
        server.stop()
    return results


def _until_refilling(server: BenchServer, timeout: float = 120.0) -> None:
    """Until the restore's interpreters are ready and its refills run (or it ended)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        restore = server.status()["restore"]
        if restore["state"] != "restoring" or (restore["interpreters_pending"] == 0 and restore["current"]):
            return
        time.sleep(0.1)


def client_during_restore(scale: str, pairs: int, say) -> dict:
    """The ControlNet script, patched, its models not cached, run at once beside a server
    that restores both scripts' entries over copies of the models, against beside one with
    nothing to restore, in alternating pairs."""
    paths = _models(scale)
    folder = _scripts("om-bench-restore-client-", paths)
    learned = _scripts("om-bench-restore-learned-", _copies(paths, say))
    server = BenchServer.start()
    state, kept = server.runtime_dir / "state", folder / "state-kept"
    patched_env = server.client_env({"OVERMIND": "1"})
    timed: dict = {"restoring": [], "nothing": []}
    restores: dict = {"restoring": [], "nothing": []}  # the restore's state as each client exited
    try:
        for name in SCRIPT_NAMES:  # what the restore will refill: both scripts' entries, learned
            for _ in range(2):
                time_script([sys.executable, f"{name}.py"], patched_env, str(learned))
                server.wait_idle()
        restored_bytes = server.status()["used"]
        time.sleep(3)  # one save at least (SAVE_INTERVAL)
        server.stop(remove=False)
        _wait_gone(server.pid)
        shutil.copytree(state, kept)
        for _ in range(pairs):
            for case in ("restoring", "nothing"):
                shutil.rmtree(state, ignore_errors=True)
                if case == "restoring":
                    shutil.copytree(kept, state)
                server.launch()
                if case == "restoring":
                    _until_refilling(server)
                t = time_script([sys.executable, "controlnet.py"], patched_env, str(folder))
                restore = server.status()["restore"]
                timed[case].append(t["exit"])
                restores[case].append(restore["state"])
                say(f"client during a restore: controlnet patched beside {case}: exit {t['exit']:.2f}s (restore {restore})")
                server.wait_idle()
                server.stop(remove=False)
                _wait_gone(server.pid)
    finally:
        server.stop()
        shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(learned, ignore_errors=True)
    medians = {case: statistics.median(v) for case, v in timed.items()}
    return {"pairs": pairs, "client": "controlnet", "restored_bytes": restored_bytes, "exit_seconds": timed,
            "restore_states": restores, "median_seconds": medians,
            "ratio": medians["restoring"] / medians["nothing"]}


def main(argv: Optional[list] = None, command: Optional[list] = None) -> int:
    """``command``: the command as the document gives it (overmind-bench's, when it runs this)."""
    from overmind.bench import alone

    parser = argparse.ArgumentParser(prog="python -m overmind.bench.restart", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenarios", default="restart", help=argparse.SUPPRESS)  # overmind-bench --scenarios restart
    parser.add_argument("--scale", choices=sorted(SCALES), default="base", help="model sizes (default base: SD1.5)")
    parser.add_argument("--stop", choices=("shutdown", "sigkill", "both", "none"), default="both",
                        help="how the server is stopped before a restore (none: only the client-during-restore pairs)")
    parser.add_argument("--contention-pairs", type=int, default=3, metavar="N",
                        help="pairs of the client-during-restore measurement (default 3; 0 skips it)")
    parser.add_argument("--json", metavar="FILE", help="write the results here (default: stdout)")
    parser.add_argument("--about", metavar="TEXT", help="what the run is, said in its document")
    args, _ = parser.parse_known_args(argv)
    say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    stops = {"both": ["shutdown", "sigkill"], "none": []}.get(args.stop, [args.stop])

    def measure(results: dict) -> None:
        results.update(scale=args.scale, targets=TARGETS)
        if stops:
            run(args.scale, stops, say, results)
        if args.contention_pairs > 0:
            results["client_during_restore"] = found = client_during_restore(args.scale, args.contention_pairs, say)
            say(f"client during a restore: {found['ratio']:.3f} x beside nothing to restore "
                f"(target <= {TARGETS['client_during_restore']})")

    doc = alone.measure("restart", measure, argv=command or alone.command("overmind.bench.restart", argv),
                        scale=args.scale, about=args.about)
    alone.write(doc, args.json)
    return 0 if doc["restart"]["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
