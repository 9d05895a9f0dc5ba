"""A venv as users have it: scipy, scikit-learn, pandas and pyarrow beside torch, and hosts of
many cores. Their libraries start threads at import (Note [Threads libraries start] in
overmind.warm.fork_safety); warm runs still fork, loads are still cached, and a run's thread
pools are plain python's. Real server, real front end, real libraries; the many-core host is
tests/shims/many_cpus.c preloaded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from ..conftest import REPO, age_files, build_shared_library, child_env, run_python
from .conftest import curve, last_json

pytest.importorskip("scipy")
pytest.importorskip("pandas")
pytest.importorskip("threadpoolctl")

# A script as users write it: their libraries first, then a model load, then its use.
SCRIPT = """
import json, os, sys
import torch, scipy.stats, pandas, sklearn.linear_model, {reader}
from threadpoolctl import threadpool_info
import overmind.api
overmind.api.monkey_patch_all()
from diffusers import AutoencoderKL
vae = AutoencoderKL.from_pretrained({path!r})
with torch.no_grad():
    out = vae.decode(torch.ones(1, vae.config.latent_channels, 4, 4)).sample
pools = sorted((p["internal_api"], p["num_threads"]) for p in threadpool_info())
print(json.dumps({{"sum": float(out.double().sum()), "hit": overmind.api.cache_key_of(vae) is not None,
                  "pools": pools, "torch_threads": torch.get_num_threads(),
                  "nvml": os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK")}}))
"""


def test_a_fork_past_openblas_and_jemalloc_computes_in_the_child(many_cpus):
    """The evidence for forking past them: with numpy's and scipy's OpenBLAS pools and pyarrow's
    jemalloc thread started (16 CPUs seen), the census finds no stranger, and a forked child
    computes with all three, with plain's pool sizes, and exits."""
    out = run_python("""
        import json, os, time
        import torch, numpy, scipy.linalg, pyarrow
        from threadpoolctl import threadpool_info
        from overmind.warm.fork_safety import ThreadCensus, thread_ids, thread_names
        started = thread_names(thread_ids())
        census = ThreadCensus()
        began = time.monotonic()
        census.take()
        took = time.monotonic() - began
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            a = numpy.random.default_rng(0).random((300, 300))
            inv = scipy.linalg.inv(a + 300 * numpy.eye(300))
            total = pyarrow.array(range(100000)).to_numpy().sum()
            pools = sorted((p["internal_api"], p["num_threads"]) for p in threadpool_info())
            os.write(w, json.dumps({"ok": bool(numpy.allclose(inv @ (a + 300 * numpy.eye(300)), numpy.eye(300))),
                                    "total": int(total), "pools": pools}).encode())
            os._exit(0)
        os.close(w)
        _, status = os.waitpid(pid, 0)
        child = json.loads(os.read(r, 1 << 16))
        print(json.dumps({"started": started, "own": len(census.own), "why": census.strangers_note(), "took": took,
                          "status": status, "child": child,
                          "pools": sorted((p["internal_api"], p["num_threads"]) for p in threadpool_info())}))
    """, env=child_env(**many_cpus), timeout=120).stdout
    found = json.loads(out.strip().splitlines()[-1])
    assert len(found["started"]) >= 30 and "jemalloc_bg_thd" in found["started"], found["started"]
    assert found["own"] == 1, found  # the main thread: both pools stopped, jemalloc's thread forked past
    assert found["took"] < 0.25, found  # no wait for the main thread to end (fork_safety.own_threads)
    assert found["why"] == ""
    assert found["status"] == 0 and found["child"]["ok"] and found["child"]["total"] == 4999950000
    assert found["child"]["pools"] == found["pools"]
    assert ["openblas", 16] in found["pools"]


@pytest.fixture
def nvml_reader():
    """An installed module that reads PYTORCH_NVML_BASED_CUDA_CHECK at import, as torch's CUDA check
    does on a CUDA build: the warm interpreter sets it for its own imports, and a run whose value
    differs must still be forked (overmind.shared.settings.import_env.INTERPRETERS_OWN)."""
    name = f"overmind_test_nvml_reader_{os.getpid()}"
    path = Path(sysconfig.get_paths()["purelib"]) / f"{name}.py"
    path.write_text("import os\nos.environ.get('PYTORCH_NVML_BASED_CUDA_CHECK')\n")
    age_files(path)
    yield name
    path.unlink()


@pytest.fixture
def vae_script(models, tmp_path, nvml_reader) -> Path:
    script = tmp_path / "decode.py"
    script.write_text(SCRIPT.format(path=str(models["vae"]), reader=nvml_reader))
    age_files(script)
    return script


@pytest.mark.parametrize("cpus", ["this machine's", "16"])
def test_a_script_importing_scipy_pandas_and_sklearn_runs_warm_from_run_2_with_plains_pools(
        make_server, vae_script, many_cpus, cpus):
    env = child_env(**(many_cpus if cpus == "16" else {}))
    plain = last_json(subprocess.run([sys.executable, str(vae_script)], env={**env, "OVERMIND_DISABLE": "1"},
                                     capture_output=True, text=True, timeout=120, check=True))
    server = make_server()
    outputs = curve(server, vae_script, {**server.client_env(), **env})
    log = server.log()
    status = server.status()
    assert [forked for forked, _ in outputs] == [False, True, True], log[-12000:]
    assert [out["hit"] for _, out in outputs][1:] == [True, True] and status["hits"] == 2, log[-4000:]
    for _, out in outputs:
        assert out["sum"] == plain["sum"]
        assert (out["pools"], out["torch_threads"]) == (plain["pools"], plain["torch_threads"])
        assert out["nvml"] is None  # the interpreter's NVML check is its own (Note [Warm interpreters never touch CUDA])
    if cpus == "16":
        assert ["openblas", 16] in plain["pools"]
    assert "kept out" not in log and "cannot fork" not in log, log[-4000:]
    assert status["warm_retired"] == 0


def test_a_module_that_starts_an_unknown_native_thread_is_kept_out_and_its_loads_still_fill(
        make_server, tmp_path, vae_script):
    """Note [Threads libraries start]: the module is blamed and kept out (the run imports it itself),
    one interpreter is replaced, never a loop, and the script's load is cached all the same. Note
    [A tainted interpreter says so at once]: the successor starts while run 1 runs, so run 2 forks."""
    name = f"overmind_test_stranger_{os.getpid()}"
    purelib = Path(sysconfig.get_paths()["purelib"])
    library = build_shared_library(REPO / "tests" / "shims" / "stranger.c", purelib / f"lib{name}.so")
    module = purelib / f"{name}.py"
    module.write_text(f"import ctypes, os\nctypes.CDLL(os.path.join(os.path.dirname(__file__), 'lib{name}.so'))\n")
    age_files(module, library)
    script = tmp_path / "stranger.py"
    script.write_text(f"import sys\nheld = {name!r} in sys.modules\nimport {name}\n" + vae_script.read_text()
                      .replace('"nvml":', '"held": held, "nvml":'))
    age_files(script)
    server = make_server()
    try:
        env = server.client_env()
        outputs = curve(server, script, env, runs=4)
        log = server.log()
        status = server.status()
    finally:
        server.stop()  # before the module it imported goes
        module.unlink()
        library.unlink()
    assert not any(out["held"] for _, out in outputs)  # never forked with it imported
    assert all(out["hit"] for _, out in outputs[1:]) and status["hits"] == 3, log[-4000:]
    assert [f for f, _ in outputs] == [False, True, True, True], log[-6000:]
    assert log.index("retiring warm interpreter") < log.index("forked as"), log[-4000:]
    kept_out = [line for line in log.splitlines() if "is kept out of this context's warm interpreters" in line]
    assert kept_out and all(f"(om-stranger) in {name}: {name} is kept out" in line for line in kept_out), kept_out
    assert status["warm_retired"] == 1, log[-4000:]
