"""The compiled scenario: a generated transformer block under ``torch.compile`` and as an
AOTInductor package, whole process from the shell, plain ``python`` against ``overmind run``.

    overmind-bench --scenarios compiled [--whole-runs N] [--hang-runs N]

The model (:data:`CONFIG`, random weights from a fixed seed): ``torch.nn.TransformerEncoder`` of
6 layers, d_model 640, 10 heads, feed-forward 2560: 29.6 M parameters, fp32, one forward of a
(1, 64, 640) input under ``torch.no_grad()``. Two scripts, written into a temporary folder:

- ``compile_block.py``: builds the model and calls ``torch.compile(model)(x)``. Inductor's
  on-disk caches are filled by one plain run first, so every timed run is a cache hit (what
  "plain python's second run" means);
- ``aoti_block.py``: ``torch._inductor.aoti_load_package(block.pt2)(x)``, the package made once
  by ``aoti_compile_and_package`` beforehand. It calls ``monkey_patch_all()`` when ``OVERMIND=1``
  (the ``overmind run`` mode), so its load is a patch point (overmind.client.compiled).

For each script, against a fresh server: ``overmind run`` runs 1 to 5 back to back (run 1 has no
warm interpreter yet and goes plain; the server learns from it), then ``--whole-runs`` pairs of
plain ``python`` and ``overmind run``, alternating, each the wall time of the process as the
shell sees it; medians and their ratio. Every run's printed output must equal plain's.
``--hang-runs N`` then makes N more warm runs of each back to back, each bounded in time: a
hang (Note [No thread pool before a fork] in overmind.warm.compiled) fails the scenario.
``--json FILE``: overmind-bench's document with the results under ``compiled``
(:mod:`overmind.bench.alone`), which ``overmind-bench --report`` renders.
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from overmind.bench.harness import BenchServer

__all__ = ["CONFIG", "main", "run_scenario"]

CONFIG = {"layers": 6, "d_model": 640, "heads": 10, "ffn": 2560, "batch": 1, "seq": 64, "seed": 0}
RUN_TIMEOUT = 600.0
HANG_TIMEOUT = 120.0

MODEL = """\
import os, sys, time, json
START = time.monotonic()
import torch
C = {config!r}
torch.manual_seed(C["seed"])
layer = torch.nn.TransformerEncoderLayer(C["d_model"], C["heads"], C["ffn"], dropout=0.0, batch_first=True)
model = torch.nn.TransformerEncoder(layer, C["layers"], enable_nested_tensor=False).eval()
x = torch.linspace(-1, 1, C["batch"] * C["seq"] * C["d_model"]).reshape(C["batch"], C["seq"], C["d_model"])
"""

SCRIPTS = {
    "compile_block": MODEL + """
with torch.no_grad():
    out = torch.compile(model)(x)
print(json.dumps({{"sum": round(float(out.double().sum()), 3), "head": [round(v, 5) for v in out.flatten()[:4].tolist()]}}))
""",
    "aoti_block": """\
import os
if os.environ.get("OVERMIND") == "1":
    import overmind.api
    overmind.api.monkey_patch_all()
import json, sys, torch
C = {config!r}
x = torch.linspace(-1, 1, C["batch"] * C["seq"] * C["d_model"]).reshape(C["batch"], C["seq"], C["d_model"])
runner = torch._inductor.aoti_load_package({package!r})
with torch.no_grad():
    out = runner(x)
print(json.dumps({{"sum": round(float(out.double().sum()), 3), "head": [round(v, 5) for v in out.flatten()[:4].tolist()]}}))
""",
    "package": MODEL + """
ep = torch.export.export(model, (x,))
torch._inductor.aoti_compile_and_package(ep, package_path={package!r})
""",
}


def _write(folder: Path) -> dict:
    package = str(folder / "block.pt2")
    paths = {}
    for name, text in SCRIPTS.items():
        path = folder / f"{name}.py"
        path.write_text(text.format(config=CONFIG, package=package))
        paths[name] = path
    paths["package_file"] = Path(package)
    return paths


def _timed(argv: list, env: dict, cwd: Path, timeout: float = RUN_TIMEOUT) -> tuple[float, str]:
    """(wall seconds of the process as the shell sees it, its last output line); a run that
    fails or outlives ``timeout`` raises (its process group killed)."""
    started = time.monotonic()
    proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise RuntimeError(f"{' '.join(map(str, argv))} did not end within {timeout:.0f} s (a hang?)") from None
    wall = time.monotonic() - started
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, argv))} exited {proc.returncode}: {err[-2000:]}")
    lines = out.strip().splitlines()
    return wall, lines[-1] if lines else ""


def run_scenario(pairs: int = 5, hang_runs: int = 0, say=print, results: Optional[dict] = None) -> dict:
    """Both scripts; the results (see the module docstring), filled into ``results`` as it goes."""
    overmind = str(Path(sys.executable).parent / "overmind")
    base = {k: v for k, v in os.environ.items() if not k.startswith("OVERMIND_")}
    results = {} if results is None else results
    results.update(config=CONFIG, python=sys.executable, scripts={})
    with tempfile.TemporaryDirectory(prefix="om-bench-compiled-", dir="/tmp") as tmp:
        folder = Path(tmp)
        paths = _write(folder)
        base["TORCHINDUCTOR_CACHE_DIR"] = str(folder / "inductor")  # a cache of its own, filled below
        say("compiling the block once (Inductor's caches) and packaging it (AOTInductor)")
        cold, _ = _timed([sys.executable, paths["compile_block"]], base, folder)
        pack, _ = _timed([sys.executable, paths["package"]], base, folder)
        stamp = time.time() - 60
        os.utime(paths["package_file"], (stamp, stamp))  # not racy (Note [Racy files] in overmind.shared.calls.keys)
        results["compile_cold_s"], results["package_s"] = round(cold, 2), round(pack, 2)
        for name in ("compile_block", "aoti_block"):
            script = str(paths[name])
            plain_env, run_env = base, {**base, "OVERMIND": "1"}
            _, expected = _timed([sys.executable, script], plain_env, folder)
            # A private server, fresh for each script, started by run 1 from the shell that exported
            # TORCHINDUCTOR_CACHE_DIR, as a user's first run starts it.
            server = BenchServer.autostart(run_env)
            try:
                env = server.env
                curve = []
                for i in range(5):  # runs 1 to 5 back to back
                    wall, out = _timed([overmind, "run", script], env, folder)
                    curve.append(round(wall, 2))
                    if out != expected:
                        raise RuntimeError(f"{name}: overmind run {i + 1} printed {out}, plain {expected}")
                say(f"{name}: overmind run, runs 1-5 back to back: {curve}")
                plain, warm = [], []
                for _ in range(pairs):  # paired, alternating: the machine's noise hits both
                    wall, out = _timed([sys.executable, script], plain_env, folder)
                    plain.append(wall)
                    assert out == expected, (out, expected)
                    wall, out = _timed([overmind, "run", script], env, folder)
                    warm.append(wall)
                    if out != expected:
                        raise RuntimeError(f"{name}: overmind run printed {out}, plain {expected}")
                entry = {"curve_s": curve, "plain_s": [round(v, 2) for v in plain], "run_s": [round(v, 2) for v in warm],
                         "plain_median_s": round(statistics.median(plain), 2),
                         "run_median_s": round(statistics.median(warm), 2)}
                entry["ratio"] = round(entry["run_median_s"] / entry["plain_median_s"], 3)
                hung = 0
                for _ in range(hang_runs):
                    try:
                        _, out = _timed([overmind, "run", script], env, folder, timeout=HANG_TIMEOUT)
                    except RuntimeError:
                        hung += 1
                        continue
                    if out != expected:
                        raise RuntimeError(f"{name}: overmind run printed {out}, plain {expected}")
                entry["hang_runs"], entry["hung"] = hang_runs, hung
                results["scripts"][name] = entry
                say(f"{name}: plain {entry['plain_median_s']} s, overmind run {entry['run_median_s']} s "
                    f"(x {entry['ratio']}), {hung} of {hang_runs} back-to-back warm runs hung")
            finally:
                server.stop()
    return results


def table(results: dict) -> str:
    lines = ["| script | overmind run, runs 1-5 (s) | plain 2nd+ median (s) | overmind run median (s) | ratio | hung |",
             "|---|---|---|---|---|---|"]
    for name, e in results["scripts"].items():
        lines.append(f"| {name} | {' / '.join(f'{v:.2f}' for v in e['curve_s'])} | {e['plain_median_s']:.2f} | "
                     f"{e['run_median_s']:.2f} | {e['ratio']:.2f} | {e['hung']} of {e['hang_runs']} |")
    return "\n".join(lines)


def main(argv: Optional[list] = None, command: Optional[list] = None) -> int:
    """``command``: the command as the document gives it (overmind-bench's, when it runs this)."""
    import argparse

    from overmind.bench import alone

    parser = argparse.ArgumentParser(prog="overmind-bench --scenarios compiled")
    parser.add_argument("--scenarios", default="compiled")
    parser.add_argument("--whole-runs", type=int, default=5, help="pairs of plain and overmind run (default 5)")
    parser.add_argument("--hang-runs", type=int, default=0, help="back-to-back warm runs checked for hangs")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--about", metavar="TEXT", help="what the run is, said in its document")
    args, _ = parser.parse_known_args(argv)
    started = time.monotonic()

    def measure(results: dict) -> None:
        run_scenario(args.whole_runs, args.hang_runs, results=results,
                     say=lambda line: print(f"[{time.monotonic() - started:6.1f} s] {line}", file=sys.stderr,
                                            flush=True))
        hung = [f"{name}: {e['hung']} of {e['hang_runs']}" for name, e in results["scripts"].items() if e["hung"]]
        if hung:
            results.update(status="failed", reason=f"warm runs hung ({'; '.join(hung)})")

    doc = alone.measure("compiled", measure, argv=command or alone.command("overmind.bench.compiled", argv),
                        about=args.about)
    results = doc["compiled"]
    if args.json:
        alone.write(doc, args.json)
    if results.get("scripts"):
        print(table(results))
    if results["status"] != "ok":
        print(f"compiled: failed: {results['reason']}", file=sys.stderr)
    return 0 if results["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
