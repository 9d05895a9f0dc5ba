"""The second run is warm: prefetch of what a program loaded last time, imports taught while
the first run imports, and a caller that joins a fill instead of loading plainly.

Note [Prefetch] in overmind.client.prefetch, Note [Teaching the interpreter while importing] there,
Note [Joining a fill] in overmind.server.joins. Real server, real scripts run as fresh processes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from ..conftest import age_files
from overmind.shared.segments.memfd import RESIDENT, cached_share

from .conftest import LEFT_TO_PAGE_CACHE, last_json, lose_from_page_cache

OVERMIND = str(Path(sys.executable).parent / "overmind")

SCRIPT = """
import json, sys, time
import overmind.api
overmind.api.monkey_patch_all()
import xml.dom.minidom  # an installed module the warm interpreter lacks: taught while importing
from safetensors.torch import load_file
from overmind.client import prefetch

deadline = time.monotonic() + 30
while prefetch.stats["prepared"] == 0 and time.monotonic() < deadline and len(sys.argv) > 2:
    time.sleep(0.01)  # the test asked for a prefetch: let the background thread prepare it
w = load_file(sys.argv[1])["w"]
print(json.dumps({"sum": float(w.double().sum()), "first": w[:4].tolist(), **prefetch.stats}))
"""


@pytest.fixture
def program(tmp_path):
    script = tmp_path / "app.py"
    script.write_text(SCRIPT)
    weights = tmp_path / "w.safetensors"
    save_file({"w": torch.arange(300_000, dtype=torch.float32)}, str(weights))
    age_files(weights)
    return script, weights


def _run(server, script, *args) -> dict:
    proc = subprocess.run([sys.executable, str(script), *map(str, args)], env=server.client_env(),
                          capture_output=True, text=True, timeout=120, cwd=script.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Warning: overmind" not in proc.stderr, proc.stderr[-3000:]
    return last_json(proc)


def test_the_next_run_of_a_program_maps_what_it_loaded_before_its_load(server, program):
    script, weights = program
    first = _run(server, script, weights)
    assert first["prepared"] == 0  # no history yet
    server.wait_idle()
    second = _run(server, script, weights, "expect-prefetch")
    assert second["prepared"] >= 1 and second["used"] == second["prepared"]
    assert (second["sum"], second["first"]) == (first["sum"], first["first"])
    assert server.status()["hits"] >= 1


def test_the_next_run_of_a_program_reads_back_a_model_file_the_page_cache_lost(make_server, program):
    script, weights = program
    server = make_server({"OVERMIND_SETTLE_AFTER": "", **LEFT_TO_PAGE_CACHE})  # the file stays the segment
    first = _run(server, script, weights)
    assert server.wait_idle()["file_segments"]["bytes"] == weights.stat().st_size
    lose_from_page_cache(weights)
    fd = os.open(weights, os.O_RDONLY)
    try:
        second = _run(server, script, weights, "expect-prefetch")
        # read back on the prefetch thread (Note [Reading back a lost file]), the hit then equal
        assert second["read_back"] == weights.stat().st_size and second["used"] >= 1, second
        assert (second["sum"], second["first"]) == (first["sum"], first["first"])
        assert cached_share(fd, weights.stat().st_size) >= RESIDENT
        assert server.status()["file_segments"]["settled"] == 0  # empty: never copied, not even when lost
    finally:
        os.close(fd)


TWO_FILES = """
import json, os, sys, time
import overmind.api
overmind.api.monkey_patch_all()
from overmind.client import prefetch

paths = sys.argv[1:3]
lost = sum(os.path.getsize(p) for p in paths) if len(sys.argv) > 3 else 0
deadline = time.monotonic() + 30
while prefetch.stats["read_back"] < lost and time.monotonic() < deadline:
    time.sleep(0.01)  # before torch is imported: the thread reads back meanwhile
before_torch = {"read_back": prefetch.stats["read_back"], "torch": "torch" in sys.modules}
from safetensors.torch import load_file
sums = [float(load_file(p)["w"].double().sum()) for p in paths]
print(json.dumps({"before_torch": before_torch, "sums": sums, **prefetch.stats}))
"""


@pytest.fixture
def two_files(tmp_path):
    script = tmp_path / "two.py"
    script.write_text(TWO_FILES)
    paths = [tmp_path / f"w{i}.safetensors" for i in range(2)]
    for i, path in enumerate(paths):
        save_file({"w": torch.arange(300_000, dtype=torch.float32) * (i + 1)}, str(path))
    age_files(*paths)
    return script, paths


def test_lost_files_are_read_back_while_the_script_has_not_imported_torch(make_server, two_files):
    script, paths = two_files
    server = make_server({"OVERMIND_SETTLE_AFTER": "", **LEFT_TO_PAGE_CACHE})  # the files stay the segments
    first = _run(server, script, *paths)
    assert server.wait_idle()["file_segments"]["bytes"] == sum(p.stat().st_size for p in paths)
    for path in paths:
        lose_from_page_cache(path)
    second = _run(server, script, *paths, "lost")
    # every lost file, not only the first: the mappings wait for torch's import, the reads do not
    assert second["before_torch"] == {"read_back": sum(p.stat().st_size for p in paths), "torch": False}
    assert second["sums"] == first["sums"] and second["used"] == 2


def test_a_lost_file_a_program_was_handed_to_read_back_is_not_copied_beside_it(make_server, two_files):
    script, paths = two_files
    server = make_server({"OVERMIND_SETTLE_AFTER": "600", **LEFT_TO_PAGE_CACHE})  # copies only what the page cache lost
    _run(server, script, *paths)
    server.wait_idle()
    _run(server, script, *paths)  # its prefetch was handed both files
    lose_from_page_cache(paths[0])
    time.sleep(2.0)  # four looks of the settler, which copies a lost file at once (test_file_segments)
    status = server.status()["file_segments"]
    assert status["settled"] == 0 and status["copying"] is None, status


def test_a_lost_file_a_forked_run_was_handed_last_is_copied_at_once(make_server, two_files):
    script, paths = two_files
    server = make_server({"OVERMIND_SETTLE_AFTER": "600", **LEFT_TO_PAGE_CACHE})
    _run(server, script, *paths)
    server.wait_idle()
    _run(server, script, *paths)  # an importing client: the files are left to it
    before = server.status()["runs"]
    deadline = time.monotonic() + 60
    while server.status()["runs"] == before:  # the first `overmind run` runs plainly, and imports
        assert time.monotonic() < deadline, "no run was forked"
        proc = subprocess.run([OVERMIND, "run", str(script), *map(str, paths)], env=server.client_env(),
                              capture_output=True, text=True, timeout=120, cwd=script.parent)
        assert proc.returncode == 0, proc.stderr[-3000:]
    lose_from_page_cache(paths[0])
    # a forked run imports nothing: its next run gains from the sealed copy, not from its own read
    # (named by its inode: the machine's memory needs may take the other file too, as in CI)
    stat = paths[0].stat()
    settled = f"settled file segment {stat.st_dev}:{stat.st_ino} ({stat.st_size} bytes)"
    deadline = time.monotonic() + 20
    while settled not in server.log() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert settled in server.log(), (server.status()["file_segments"], server.log()[-3000:])


def test_a_prefetched_entry_whose_file_changed_is_never_used(server, program):
    script, weights = program
    _run(server, script, weights)
    server.wait_idle()
    save_file({"w": torch.arange(300_000, dtype=torch.float32) * 2}, str(weights))  # a new model, same path
    age_files(weights)
    changed = _run(server, script, weights)
    assert changed["prepared"] == 0  # the stale entry is evicted, never mapped
    assert changed["first"] == [0.0, 2.0, 4.0, 6.0]


def test_imports_of_the_first_run_are_warm_in_the_next_overmind_run(server, program):
    script, weights = program
    _run(server, script, weights)
    probe = [OVERMIND, "run", "-c", "import sys; print('xml.dom.minidom' in sys.modules, flush=True)"]
    deadline = time.monotonic() + 60
    while True:  # the interpreter imports what it was taught between forks, at idle priority
        before = server.status()["runs"]
        out = subprocess.run(probe, env=server.client_env(), capture_output=True, text=True, timeout=120).stdout
        forked = server.status()["runs"] == before + 1
        if (forked and out == "True\n") or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert forked and out == "True\n", server.log()[-3000:]


FIRST_RUN = """
import json, os, sys
import xml.dom.minidom
print(json.dumps({"pythonpath": os.environ.get("PYTHONPATH"), "saved": os.environ.get("OVERMIND_FIRST_RUN_PYTHONPATH"),
                  "path": [p for p in sys.path if "first_run" in p], "path0": sys.path[0]}))
"""


@pytest.mark.parametrize("pythonpath", [None, "/nonexistent/overmind-test"])
def test_the_first_overmind_run_of_a_context_teaches_its_imports_and_stays_plain(server, tmp_path, pythonpath):
    script = tmp_path / "first.py"
    script.write_text(FIRST_RUN)
    env = server.client_env(HF_OVERMIND_TEST_CONTEXT=tmp_path.name)  # a context no run used yet
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    else:
        env.pop("PYTHONPATH", None)
    before = server.status()["runs"]
    first = subprocess.run([OVERMIND, "run", str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert first.returncode == 0 and server.status()["runs"] == before, first.stderr  # it went plain
    assert last_json(first) == {"pythonpath": pythonpath, "saved": None, "path": [], "path0": str(tmp_path)}
    probe = [OVERMIND, "run", "-c", "import sys; print('xml.dom.minidom' in sys.modules, flush=True)"]
    deadline = time.monotonic() + 60
    while True:
        before = server.status()["runs"]
        out = subprocess.run(probe, env=env, capture_output=True, text=True, timeout=120).stdout
        forked = server.status()["runs"] == before + 1
        if (forked and out == "True\n") or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert forked and out == "True\n", server.log()[-3000:]


TEACHING_LOAD = """
import os, time

def load_weights(path):
    import xml.dom.pulldom  # first imported inside the load, as transformers imports a model's module
    log = os.path.join(os.environ["OVERMIND_RUNTIME_DIR"], "server.log")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with open(log) as f:
            if "learned xml.dom.pulldom" in f.read():
                return {"taught_while_loading": True}
        time.sleep(0.1)
    return {"taught_while_loading": False}
"""


def test_what_a_first_runs_load_imports_is_taught_while_it_loads(make_server, tmp_path):
    """Note [Teaching the interpreter while importing] in overmind.client.prefetch: the report goes
    on through the loads, so the interpreter holds a module the load imported before the load
    returns (the fill that follows forks from it)."""
    (tmp_path / "teaching.py").write_text(TEACHING_LOAD)
    server = make_server({"OVERMIND_LOG_LEVEL": "DEBUG"})
    code = f"""
import json, sys
sys.path.insert(0, {str(tmp_path)!r})
import overmind.api
overmind.api.monkey_patch_all(["teaching::load_weights"])
import teaching
print(json.dumps(teaching.load_weights("weights")))
"""
    proc = subprocess.run([sys.executable, "-c", code], env=server.client_env(), capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert last_json(proc) == {"taught_while_loading": True}, server.log()[-3000:]
