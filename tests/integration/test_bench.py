"""overmind-bench end to end: real models generated in tmp, a real private server, workers."""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ..conftest import REPO, age_files, child_env

LOADS = ("controlnet", "lm", "fp32_as_fp16", "pickle_bin", "single_file", "custom")
SUMMARY = {"median": float, "min": float, "max": float, "n": int}


def bench(*args: str, cwd: Path = REPO, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "overmind.bench", "--no-progress", *args], capture_output=True,
                          text=True, env=child_env(), cwd=cwd, timeout=timeout)


def check_schema(value, schema, where="$"):
    """Strict: every documented key present with its type (overmind.bench.report, version 1)."""
    if isinstance(schema, dict):
        assert isinstance(value, dict), where
        assert set(schema) <= set(value), f"{where}: missing {sorted(set(schema) - set(value))}"
        for key, sub in schema.items():
            check_schema(value[key], sub, f"{where}.{key}")
    elif isinstance(schema, list):
        assert isinstance(value, list), where
        for i, item in enumerate(value):
            check_schema(item, schema[0], f"{where}[{i}]")
    elif isinstance(schema, tuple):  # alternatives: None, a type, an object schema or a literal value
        assert any(_matches(value, alternative) for alternative in schema), f"{where}: {value!r} is none of {schema}"
    elif schema is float:
        assert isinstance(value, (int, float)) and not isinstance(value, bool), f"{where}: {value!r} is not a number"
    else:
        assert isinstance(value, schema) and (schema is bool or not isinstance(value, bool)), \
            f"{where}: {value!r} is not {schema.__name__}"


def _matches(value, alternative) -> bool:
    if alternative is None:
        return value is None
    if isinstance(alternative, (type, dict)):
        try:
            check_schema(value, alternative)
        except AssertionError:
            return False
        return True
    return value == alternative


def check_phases(phases: dict, components: list, kind) -> None:
    assert set(phases) == {"import", *components, "to_device", "total", "first_use"}
    for value in phases.values():
        check_schema(value, kind)


HOLDING = ({"pss_bytes": int, "used_bytes": int, "pss_ratio": float, "used_ratio": float,
            "pss_before_bytes": int, "pss_after_bytes": int, "load_s": SUMMARY},)
SCHEMA = {
    "schema_version": (1,), "tool": ("overmind-bench",), "overmind_version": str, "created": str,
    "command": [str], "wall_s": float,
    "machine": {"cpus": int, "memory_bytes": int, "platform": str, "python": str,
                "versions": {"torch": (str, None), "diffusers": (str, None), "transformers": (str, None)},
                "cuda_device": (str, None)},
    "settings": {"quick": bool, "scale": str, "device": str, "runs": int, "warm_runs": int, "modes": [str],
                 "page_cache": [("warm", "cold")], "page_cache_method": (str, None), "memory_procs": int,
                 "process_per": ("scenario", "run"), "cold_mode": ("background", "wait"), "cache_dir": str,
                 "shmem_enabled": (str, None), "shmem_enabled_runs": [str]},
    "startup": ({"bare_s": SUMMARY, "patched_s": SUMMARY, "added_s": float}, None),
    "scenarios": [{"name": str, "title": str, "why": str, "status": ("ok", "skipped", "failed"),
                   "reason": (str, None), "components": [str], "tensor_bytes": (int, None), "file_bytes": int,
                   "warm_misses": int,
                   "results": [{"mode": ("plain", "first", "cold", "warm"), "page_cache": ("warm", "cold"),
                                "shmem_enabled": (str, None), "runs": [dict], "summary": dict, "x_plain": (float, int, None),
                                "x_plain_with_first_use": (float, int, None)}]}],
    "memory": [{"scenario": str, "procs": int, "tensor_bytes": (int, None), "status": ("ok", "failed"),
                "reason": (str, None), "plain": HOLDING + (None,), "overmind": HOLDING + (None,)}],
}
WHOLE_MODES = ("plain", "patched", "run", "first_run")
WHOLE = {
    "runs": int, "warmup_runs": int, "modes": [WHOLE_MODES], "context_var": str,
    "scripts": [{"name": str, "title": str, "command": str, "run_command": str, "models": [str], "loads": int,
                 "tensor_bytes": (int, None), "file_bytes": int, "status": ("ok", "skipped", "failed"),
                 "reason": (str, None),
                 "results": [{"mode": WHOLE_MODES, "page_cache": ("warm", "cold"),
                              "runs": [{"ready": (float, None), "used": (float, None), "wall": float, "forked": bool,
                                        "hits": int, "misses": int}],
                              "summary": {"ready": (SUMMARY, None), "used": (SUMMARY, None), "wall": SUMMARY},
                              "x_plain": {"ready": (float, None), "used": (float, None), "wall": (float, None)}}]}],
}
SCHEMA["whole_process"] = (WHOLE, None)
CURVE_RUN = {"wall": float, "ready": (float, None), "used": (float, None), "sum": (int, None), "hits": int,
             "misses": int, "forked": bool, "fallback": bool}
CURVE = {
    "rounds": int, "plain_runs": int, "modes": [("patched", "dropin", "run")], "drop": (str, None),
    "scripts": [{"name": str, "title": str, "command": str, "page_cache": ("warm", "cold"),
                 "shmem_enabled": (str, None), "status": ("ok", "skipped", "failed"), "reason": (str, None), "plain": (SUMMARY, None),
                 "modes": [{"mode": ("patched", "dropin", "run"),
                            "runs": [{"run": ("1", "2", "3", "4", "5", "restart"), "runs": [CURVE_RUN],
                                      "wall": (SUMMARY, None), "x_plain": (float, None)}]}]}],
}
SCHEMA["warmup_curve"] = (CURVE, None)


@pytest.fixture(scope="module")
def tiny_unet(tmp_path_factory) -> Path:
    import torch

    from overmind import modelgen

    path = modelgen.save_unet(tmp_path_factory.mktemp("user-model") / "unet", "tiny", torch.float32, seed=3)
    age_files(path)
    return path


@pytest.mark.slow
def test_quick_run_covers_every_scenario_and_writes_the_documented_json(tmp_path, tiny_unet):
    out = tmp_path / "bench.json"
    plot = tmp_path / "bench.png"
    want_plot = _has_matplotlib()
    proc = bench("--quick", "--scale", "tiny", "--cache-dir", str(tmp_path / "cache"), "--json", str(out),
                 "--scenarios", ",".join((*LOADS, "memory", "startup")), "--memory-cases", "controlnet",
                 "--loader", "diffusers:UNet2DConditionModel", "--model", str(tiny_unet), "--dtype", "float16",
                 *(["--plot", str(plot)] if want_plot else []))
    assert proc.returncode == 0, proc.stderr[-6000:]
    doc = json.loads(out.read_text())
    check_schema(doc, SCHEMA)

    assert doc["settings"]["quick"] and doc["settings"]["process_per"] == "run"
    # The huge-page setting the loads ran under (tests never change it).
    setting = shmem_setting()
    assert doc["settings"]["shmem_enabled"] == setting and doc["settings"]["shmem_enabled_runs"] == []
    assert all(r["shmem_enabled"] == setting for s in doc["scenarios"] for r in s["results"])
    assert f"shmem_enabled: {setting}: overmind's segments use " in proc.stdout
    assert [s["name"] for s in doc["scenarios"]] == list(LOADS)
    for scenario in doc["scenarios"]:
        assert scenario["status"] == "ok", scenario["reason"]
        assert scenario["warm_misses"] == 0, scenario["name"]  # every warm call was a hit
        assert scenario["tensor_bytes"] > 0
        assert [(r["mode"], r["page_cache"]) for r in scenario["results"]] == [
            ("plain", "warm"), ("cold", "warm"), ("warm", "warm")]
        for result in scenario["results"]:
            check_phases(result["summary"], scenario["components"], SUMMARY)
            for run in result["runs"]:
                check_phases(run, scenario["components"], float)
            assert result["summary"]["total"]["n"] == 1
        assert scenario["results"][0]["x_plain"] == 1.0
    custom = doc["scenarios"][-1]
    assert custom["title"].startswith("diffusers:UNet2DConditionModel.from_pretrained(")
    assert custom["components"] == ["load"]

    [memory] = doc["memory"]
    assert memory["status"] == "ok", memory["reason"]
    assert memory["procs"] == 2 and memory["tensor_bytes"] > 0
    assert doc["startup"]["bare_s"]["n"] == 5

    # The table: one block per scenario, then memory and start-up.
    for name in LOADS:
        assert f"\n{name}: " in proc.stdout
    assert "overmind warm" in proc.stdout and "\nmemory: 2 processes" in proc.stdout
    assert "start-up: `import overmind.api" in proc.stdout
    if want_plot:
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The bench's own server is gone, and the user's default runtime dir was never used.
    assert "private overmind-server pid" in proc.stderr


@pytest.mark.slow
def test_whole_process_times_each_script_from_the_shell_in_the_mode_it_claims(tmp_path):
    """overmind.bench.whole: every run is checked by the bench itself (Note [Every run proves its
    mode]: a run mode that was not forked, a patched call that missed, fail the script); here the
    JSON must say the same, run by run."""
    out = tmp_path / "bench.json"
    # The LM script is left out: the warm-up curve's test runs it in every mode.
    proc = bench("--scenarios", "whole_process", "--scale", "tiny", "--whole-runs", "1",
                 "--whole-scripts", "controlnet,imports",
                 "--cache-dir", str(tmp_path / "cache"), "--json", str(out), timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    doc = json.loads(out.read_text())
    check_schema(doc, SCHEMA)
    assert doc["scenarios"] == [] and doc["memory"] == [] and doc["startup"] is None
    whole = doc["whole_process"]
    assert (whole["runs"], whole["warmup_runs"], whole["modes"]) == (1, 2, list(WHOLE_MODES))
    scripts = {s["name"]: s for s in whole["scripts"]}
    assert list(scripts) == ["controlnet", "imports"]
    assert scripts["imports"]["command"] == 'python -c "import torch, diffusers, transformers"'
    assert scripts["imports"]["run_command"] == 'overmind run -c "import torch, diffusers, transformers"'
    assert (scripts["controlnet"]["loads"], scripts["imports"]["loads"]) == (4, 0)
    for name, script in scripts.items():
        assert script["status"] == "ok", script["reason"]
        modes = ["plain", "run", "first_run"] if name == "imports" else list(WHOLE_MODES)
        assert [(r["mode"], r["page_cache"]) for r in script["results"]] == [(m, "warm") for m in modes]
        for result in script["results"]:
            [run] = result["runs"]
            mode = result["mode"]
            # Only the run mode is forked from a warm interpreter; the first run of a new context
            # is refused and runs plainly.
            assert run["forked"] is (mode == "run"), (name, mode)
            assert (run["hits"], run["misses"]) == ((0 if mode == "plain" else script["loads"]), 0), (name, mode)
            if name == "imports":
                assert run["ready"] is None and run["used"] is None and result["x_plain"]["ready"] is None
            else:
                assert 0 < run["ready"] <= run["used"] <= run["wall"], (name, mode, run)
            assert result["summary"]["wall"]["n"] == 1
        assert script["results"][0]["x_plain"]["wall"] == 1.0
        if name != "imports":
            assert script["tensor_bytes"] > 0 and script["file_bytes"] > 0
    # How far below plain a forked run is (it skips start-up and imports) is the benchmark's figure,
    # not something a test on a busy machine can bound; that the run mode forked is asserted above.
    assert "whole process: a script started from the shell" in proc.stdout
    assert "\ncontrolnet: `python controlnet.py`" in proc.stdout and "overmind run, new context" in proc.stdout


@pytest.mark.slow
def test_warm_up_curve_runs_each_mode_from_a_fresh_server_and_every_run_reads_plains_weights(tmp_path):
    """overmind.bench.curve: runs 1-5 back to back and one after a restart, per mode, each from a
    fresh server; a run whose weights differ from plain's would fail the curve."""
    out = tmp_path / "bench.json"
    proc = bench("--scenarios", "warmup_curve", "--scale", "tiny", "--curve-scripts", "lm", "--curve-rounds", "1",
                 "--cache-dir", str(tmp_path / "cache"), "--json", str(out), timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    doc = json.loads(out.read_text())
    check_schema(doc, SCHEMA)
    curve = doc["warmup_curve"]
    assert (curve["rounds"], curve["plain_runs"], curve["modes"], curve["drop"]) == (1, 2, ["patched", "dropin", "run"], None)
    [lm] = curve["scripts"]
    assert (lm["name"], lm["page_cache"], lm["status"], lm["plain"]["n"]) == ("lm", "warm", "ok", 6)  # 2 per mode
    for mode in lm["modes"]:
        runs = {r["run"]: r["runs"][0] for r in mode["runs"]}
        assert list(runs) == ["1", "2", "3", "4", "5", "restart"]
        assert len({r["sum"] for r in runs.values()}) == 1, runs  # the same weights every run
        # A fresh server: an empty cache, the run misses; by run 5 it hits. After a restart the
        # server refilled what it kept before the run started (Note [Restore after a restart]).
        assert (runs["1"]["hits"], runs["1"]["misses"]) == (0, 1), (mode["mode"], runs["1"])
        assert (runs["restart"]["hits"], runs["restart"]["misses"]) == (1, 0), (mode["mode"], runs["restart"])
        assert runs["5"]["hits"] == 1 and runs["5"]["misses"] == 0, (mode["mode"], runs)
        assert not runs["1"]["forked"]  # the first overmind run of a fresh server goes plain
        # README's one line hands the run over from run 2, as overmind run does; =0 never does.
        assert runs["5"]["forked"] == (mode["mode"] != "dropin"), (mode["mode"], runs["5"])
        assert all(r["x_plain"] > 0 for r in mode["runs"])
    assert "warm-up curve: runs 1-5 of a script back to back" in proc.stdout
    assert proc.stdout.index("warm-up curve") < proc.stdout.index("\nlm: `python lm.py`")


def test_usage_errors_exit_2_and_say_what_is_wrong(tmp_path):
    for args, message in [
        (["--loader", "diffusers:DiffusionPipeline"], "--loader and --model go together"),
        (["--scenarios", "controlnet,bogus"], "--scenarios: unknown bogus"),
        (["--modes", "cold,warm"], "--modes must include plain"),
        (["--runs", "0"], "--runs must be at least 1"),
        (["--scenarios", "custom"], "--scenarios custom needs --loader and --model"),
        (["--whole-modes", "run,patched"], "--whole-modes must include plain"),
        (["--whole-scripts", "lm,nope"], "--whole-scripts: unknown nope"),
        (["--whole-runs", "0"], "--whole-runs must be at least 1"),
        (["--curve-scripts", "imports"], "--curve-scripts: unknown imports; choose from controlnet, lm"),
        (["--curve-rounds", "0"], "--curve-rounds must be at least 1"),
        (["--shmem-enabled", "never,sometimes"], "--shmem-enabled: unknown sometimes; choose from always,"),
        (["--shmem-enabled", ","], "--shmem-enabled needs at least one value"),
    ]:
        proc = bench(*args, "--cache-dir", str(tmp_path))
        assert proc.returncode == 2, (args, proc.stderr)
        assert message in proc.stderr, (args, proc.stderr)
    assert not any(tmp_path.iterdir())  # nothing generated


def test_the_model_generator_has_usage_and_names_a_bad_model(tmp_path):
    """python -m overmind.bench.models, which the bench runs in a child and the GPU check by hand."""
    def models(*args):
        return subprocess.run([sys.executable, "-m", "overmind.bench.models", *args], capture_output=True, text=True,
                              env=child_env(), timeout=120)

    proc = models("--help")
    assert proc.returncode == 0 and proc.stdout.startswith("usage: python -m overmind.bench.models"), proc.stderr
    assert "controlnet_a" in proc.stdout and "tiny" in proc.stdout
    proc = models(str(tmp_path), "tiny", "sd", "nope")
    assert proc.returncode == 2 and "invalid choice: 'nope'" in proc.stderr, proc.stderr
    assert not any(tmp_path.iterdir())  # nothing generated


def shmem_setting() -> str | None:
    text = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled").read_text()
    return text[text.index("[") + 1:text.index("]")]


@pytest.mark.slow
def test_shmem_enabled_option_labels_every_run_with_the_value_it_ran_under_and_leaves_the_machine_as_it_was(
        tmp_path):
    """--shmem-enabled with the machine's own value: the same code path as never,advise on a
    root machine (Note [Runs under each shmem setting]), without changing a global setting."""
    setting = shmem_setting()
    out = tmp_path / "bench.json"
    proc = bench("--scale", "tiny", "--scenarios", "lm", "--runs", "1", "--shmem-enabled", setting,
                 "--cache-dir", str(tmp_path / "cache"), "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads(out.read_text())
    check_schema(doc, SCHEMA)
    assert doc["settings"]["shmem_enabled"] == setting and doc["settings"]["shmem_enabled_runs"] == [setting]
    [lm] = doc["scenarios"]
    assert [(r["mode"], r["shmem_enabled"]) for r in lm["results"]] == [(m, setting) for m in ("plain", "cold", "warm")]
    assert lm["results"][0]["x_plain"] == 1.0
    assert f"load scenarios run under {setting} in turn" in proc.stdout
    assert f"shmem_enabled {setting} run 1" in proc.stderr
    assert shmem_setting() == setting


def test_device_cuda_runs_or_skips_cleanly(tmp_path):
    import torch

    out = tmp_path / "bench.json"
    proc = bench("--scale", "tiny", "--scenarios", "lm", "--runs", "1", "--device", "cuda", "--cache-dir",
                 str(tmp_path / "cache"), "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-4000:]
    [lm] = json.loads(out.read_text())["scenarios"]
    if torch.cuda.is_available():
        assert lm["status"] == "ok" and lm["results"][0]["summary"]["to_device"]["n"] == 1
    else:
        assert lm["status"] == "skipped" and "CUDA is not available" in lm["reason"]
        assert "skipped: --device cuda: CUDA is not available" in proc.stderr
        assert not (tmp_path / "cache").exists()  # nothing generated for a skipped scenario


def test_single_file_checkpoint_loads_back_every_tensor_of_the_pipeline(tmp_path):
    """modelgen Note [Writing an LDM checkpoint]: diffusers' own reader inverts our writer."""
    import torch
    from diffusers import StableDiffusionPipeline

    from overmind import modelgen

    folder = modelgen.save_sd_pipeline(tmp_path / "sd", "tiny", torch.float16, seed=7)
    checkpoint = modelgen.save_sd_single_file(tmp_path / "sd.safetensors", folder)
    loaded = StableDiffusionPipeline.from_single_file(str(checkpoint), config=str(folder), torch_dtype=torch.float16)
    reference = StableDiffusionPipeline.from_pretrained(folder, torch_dtype=torch.float16)
    for name in ("unet", "vae", "text_encoder"):
        got, want = getattr(loaded, name).state_dict(), getattr(reference, name).state_dict()
        assert got.keys() == want.keys(), name
        assert all(torch.equal(got[k], want[k]) for k in want), name


def _resident_pages(path: Path) -> int:
    """Pages of ``path`` in the page cache (mincore(2) over a read-only mapping)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size = path.stat().st_size
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    with open(path, "rb") as f:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, f.fileno(), 0)
        assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        try:
            vec = (ctypes.c_ubyte * pages)()
            assert libc.mincore(addr, size, vec) == 0, os.strerror(ctypes.get_errno())
            return sum(v & 1 for v in vec)
        finally:
            libc.munmap(addr, size)


def test_drop_page_cache_evicts_every_page_of_the_files(tmp_path):
    from overmind.bench.harness import drop_page_cache

    files = []
    for i in range(2):
        path = tmp_path / f"weights-{i}.bin"
        path.write_bytes(os.urandom(4 << 20))
        path.read_bytes()
        files.append(path)
    assert all(_resident_pages(p) > 0 for p in files)
    assert drop_page_cache(files) == "posix_fadvise"
    assert [_resident_pages(p) for p in files] == [0, 0]


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.slow
def test_restart_scenario_times_a_client_beside_a_restore_against_one_beside_nothing(tmp_path):
    """overmind-bench --scenarios restart (overmind.bench.restart): the client-during-restore pairs
    really ran beside a restore (the server had entries to refill) and beside none."""
    out = tmp_path / "restart.json"
    proc = subprocess.run([sys.executable, "-m", "overmind.bench", "--scenarios", "restart", "--scale", "tiny",
                           "--stop", "none", "--contention-pairs", "1", "--json", str(out)],
                          env=child_env(HF_HUB_OFFLINE="1", OVERMIND_BENCH_CACHE=str(tmp_path / "models")),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(out.read_text())["restart"]["client_during_restore"]  # overmind-bench's document
    assert [len(found["exit_seconds"][case]) for case in ("restoring", "nothing")] == [1, 1], found
    assert found["restore_states"]["nothing"] == ["none"], found
    assert found["restore_states"]["restoring"][0] in ("restoring", "done"), found
    assert found["ratio"] > 0
