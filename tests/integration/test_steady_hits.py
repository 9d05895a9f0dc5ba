"""Every hit costs what the fastest hit of its entry costs: the ControlNet pattern (an entry that
refers to others, ``vae=vae`` and a list of ControlNets) timed in fresh processes in a row, as a
user's edit-run loop makes them, with the default settings (the README's one line at the top:
from the second run the script is handed to a warm interpreter).

Note [A hit imports nothing] in overmind.client.cache says what kept a hit slow in some runs, and
Note [A run's child is forked ahead] in overmind.warm.children what makes a warm run's first hits
as fast as its later ones.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from .conftest import last_json

SCRIPT = '''\
import overmind.api
overmind.api.monkey_patch_all()
import json, os, sys, time
import torch
from diffusers import AutoencoderKL, ControlNetModel, StableDiffusionControlNetPipeline

paths = json.loads(sys.argv[1])
times = {}


def timed(name, call):
    start = time.perf_counter()
    obj = call()
    times[name] = time.perf_counter() - start
    times[name + "_hit"] = overmind.api.cache_key_of(obj) is not None
    return obj


vae = timed("vae", lambda: AutoencoderKL.from_pretrained(paths["sd"], subfolder="vae"))
a = timed("depth", lambda: ControlNetModel.from_pretrained(paths["controlnet_a"]))
b = timed("edge", lambda: ControlNetModel.from_pretrained(paths["controlnet_b"]))
pipe = timed("pipeline", lambda: StableDiffusionControlNetPipeline.from_pretrained(
    paths["sd"], vae=vae, controlnet=[b, a], safety_checker=None))
assert pipe.vae is vae
with open("/proc/self/stat") as f:  # when this process began: clock ticks since boot
    ticks = int(f.read().rpartition(")")[2].split()[19])
times["started"] = time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK"))
print(json.dumps(times))
'''

RUNS = 5  # warm runs after the cold one
# "A few times the fastest", with room for a 2-core machine that runs other tests beside this one:
# what this guards against is a hit that costs a collection of the whole heap or a wait on the
# server (tenths of a second), not one slowed by a busy neighbour.
TIMES_THE_FASTEST = 4.0
SLACK = 0.1
GAP = 1.0  # seconds between runs: a user's edit takes longer; the next run's child is forked ahead meanwhile


@pytest.fixture(scope="module")
def paths(tmp_path_factory, models) -> dict:
    from overmind import modelgen

    from ..conftest import age_files

    root = tmp_path_factory.mktemp("steady")
    sd = modelgen.save_sd_pipeline(root / "sd", seed=7)
    age_files(root)
    return {"sd": str(sd), "controlnet_a": str(models["controlnet_a"]), "controlnet_b": str(models["controlnet_b"])}


def _run(server, script, paths) -> dict:
    launched = time.time()
    proc = subprocess.run([sys.executable, str(script), json.dumps(paths)], env=server.client_env(),
                          capture_output=True, text=True, timeout=300, cwd=script.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "overmind:" not in proc.stderr, proc.stderr[-3000:]
    return {**last_json(proc), "launched": launched}


def test_the_hit_of_an_entry_that_refers_to_others_is_as_fast_in_every_run(server, paths, tmp_path):
    script = tmp_path / "controlnet.py"
    script.write_text(SCRIPT)
    _run(server, script, paths)  # cold: the fills run behind it
    server.wait_idle()
    time.sleep(GAP)
    hits = server.status()["hits"]
    runs = []
    for _ in range(RUNS):
        runs.append(_run(server, script, paths))
        server.wait_idle()
        time.sleep(GAP)
    for name in ("vae", "depth", "edge", "pipeline"):
        assert all(run[name + "_hit"] for run in runs), (name, runs)
        seconds = [run[name] for run in runs]
        bound = max(TIMES_THE_FASTEST * min(seconds), min(seconds) + SLACK)
        assert max(seconds) <= bound, (
            f"{name}'s hit took {max(seconds):.3f} s in one run and {min(seconds):.3f} s in the fastest "
            f"(every run: {', '.join(f'{s:.3f}' for s in seconds)})")
    assert server.status()["runs"] >= RUNS - 1, "the runs were not handed to a warm interpreter"
    ahead = [run for run in runs if run["started"] < run["launched"] - 0.1]
    assert len(ahead) >= RUNS - 1, f"{RUNS - len(ahead)} of {RUNS} runs were not handed to a child forked ahead"
    # the children's rehearsals are no client's hits: each run's four loads are
    assert server.status()["hits"] - hits == 4 * RUNS
