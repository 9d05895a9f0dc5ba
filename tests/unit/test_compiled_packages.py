"""overmind.client.compiled and overmind.warm.compiled without a daemon: the AOTInductor patch points are invisible
wrappers over upstream signatures we pin, packages from the wire are validated, a preloaded runner
is handed over once and never for a changed file, and the fork check sees a started thread pool."""

from __future__ import annotations

import inspect
import json
import io
import sys
import os
import time

import pytest

from overmind.client import compiled as client_aoti
from overmind.shared.calls import compiled as packages
from overmind.warm import compiled as warm_aoti

torch = pytest.importorskip("torch")


# --- upstream signatures the wrappers rely on ----------------------------------------------------

def test_aoti_load_package_and_aot_load_signatures_unchanged() -> None:
    import torch._export
    import torch._inductor

    # overmind.client.compiled._describe binds the call to these: the first parameter is the path, the rest
    # are plain values it keys on and passes back when it preloads.
    assert list(inspect.signature(torch._inductor.aoti_load_package).parameters) == [
        "path", "run_single_threaded", "device_index"]
    assert list(inspect.signature(torch._export.aot_load).parameters) == ["so_path", "device"]
    from torch.export.pt2_archive._package import AOTICompiledModel  # what plain returns

    assert callable(getattr(AOTICompiledModel, "__call__"))


def test_the_aoti_patch_points_are_invisible_wrappers(python):
    out = python("""
        import inspect
        import torch._inductor, torch._export
        originals = (torch._inductor.aoti_load_package, torch._export.aot_load)
        import overmind.api
        overmind.api.monkey_patch_all()
        patched = (torch._inductor.aoti_load_package, torch._export.aot_load)
        for o, p in zip(originals, patched):
            assert p is not o and overmind.api.is_patched(p), p
            assert inspect.signature(p) == inspect.signature(o) and p.__name__ == o.__name__ and p.__doc__ == o.__doc__
        overmind.api.unpatch_all()
        assert (torch._inductor.aoti_load_package, torch._export.aot_load) == originals
        print("ok")
    """).stdout.split()
    assert out[-1] == "ok"


# --- the wire -------------------------------------------------------------------------------------

def test_packages_from_the_wire_are_validated_and_malformed_ones_dropped():
    good = {"point": "torch._inductor::aoti_load_package", "path": "/m/a.pt2",
            "kwargs": {"run_single_threaded": False, "device_index": -1}}
    bad = [
        "x", {"point": "os::system", "path": "/m/a.pt2", "kwargs": {}},
        {"point": good["point"], "path": "relative.pt2", "kwargs": {}},
        {"point": good["point"], "path": "/m/\0", "kwargs": {}},
        {"point": good["point"], "path": "/m/a.pt2", "kwargs": {"x": [1]}},
        {"point": good["point"], "path": "/m/a.pt2", "kwargs": {}, "extra": 1},
    ]
    assert packages.packages_from_wire([*bad, good]) == [good]
    assert packages.packages_from_wire("nope") == []
    assert len(packages.packages_from_wire([good] * 100)) == packages.MAX_PACKAGES


def test_a_call_is_described_by_its_real_path_and_bound_arguments(tmp_path):
    import torch._export
    import torch._inductor

    target = tmp_path / "m.pt2"
    target.write_bytes(b"x")
    link = tmp_path / "link.pt2"
    link.symlink_to(target)
    point = "torch._inductor::aoti_load_package"
    spec = client_aoti._describe(point, torch._inductor.aoti_load_package, (link,), {})
    assert spec == {"point": point, "path": str(target), "kwargs": {"run_single_threaded": False, "device_index": -1}}
    assert client_aoti._describe(point, torch._inductor.aoti_load_package, (io.BytesIO(b"x"),), {}) is None
    assert client_aoti._describe(point, torch._inductor.aoti_load_package, (), {"nope": 1}) is None  # the plain call raises
    assert client_aoti._describe("torch._export::aot_load", torch._export.aot_load, (str(target), "cuda"), {}) is None
    assert client_aoti._describe("torch._export::aot_load", torch._export.aot_load, (str(target), "cpu"), {})["kwargs"] == {
        "device": "cpu"}


# --- the hand-over --------------------------------------------------------------------------------

def test_a_preloaded_runner_is_handed_over_once_and_never_for_a_changed_file(tmp_path, monkeypatch):
    path = tmp_path / "m.pt2"
    path.write_bytes(b"package")
    stamp = time.time() - 60
    os.utime(path, (stamp, stamp))
    time.sleep(0.2)  # past the ctime's racy window (Note [Racy files] in overmind.shared.calls.keys)
    spec = {"point": "torch._inductor::aoti_load_package", "path": str(path), "kwargs": {}}
    runner = object()
    monkeypatch.setattr(packages, "_loaded", {})
    monkeypatch.setattr(packages, "_handed", [])
    packages.hold(spec, runner, packages.fingerprint(str(path)))
    assert packages.take(dict(spec)) is runner
    assert packages.take(dict(spec)) is None  # a second call of the run loads plainly
    assert packages._handed == [runner]  # kept: its destruction would delete the interpreter's folder

    packages.hold(spec, runner, packages.fingerprint(str(path)))
    os.utime(path, (stamp - 10, stamp - 10))  # a new mtime: stale
    time.sleep(0.2)
    assert packages.take(dict(spec)) is None


def test_a_package_for_another_device_than_the_cpu_is_never_preloaded(tmp_path):
    import json
    import zipfile

    for device, expected in (("cpu", True), ("cuda", False)):
        path = tmp_path / f"{device}.pt2"
        with zipfile.ZipFile(path, "w") as archive:
            archive.writestr("m/data/aotinductor/model/x.wrapper_metadata.json", json.dumps({"AOTI_DEVICE_KEY": device}))
        assert warm_aoti._cpu_package(str(path), {}) is expected
    (tmp_path / "junk.pt2").write_bytes(b"not a zip")
    assert warm_aoti._cpu_package(str(tmp_path / "junk.pt2"), {}) is False


# --- the fork check -------------------------------------------------------------------------------

def test_the_fork_check_sees_a_started_thread_pool_even_after_openblas_stopped_its_own(python):
    # Note [No thread pool before a fork]: OpenBLAS's pool (which `import torch` starts through numpy)
    # stops at a fork, and the census stops it itself; OpenMP's pool, started by a kernel, does not.
    out = python("""
        import os, torch
        from overmind.warm.fork_safety import ThreadCensus
        census = ThreadCensus()
        census.take()
        assert census.strangers_note() == ""
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        assert census.strangers_note() == ""  # a thread ended: nothing new
        (torch.ones(512, 512) @ torch.ones(512, 512)).sum()  # starts OpenMP's pool
        print(len(os.listdir("/proc/self/task")), len(census.own), "|", census.strangers_note())
    """, env={**os.environ, "OMP_NUM_THREADS": "2"}).stdout
    counts, why = out.split("|")
    now, ready = map(int, counts.split())
    assert now > ready
    assert "nobody vouches for" in why


def test_a_package_a_run_reports_reaches_its_lineage_and_starts_no_interpreter(tmp_path):
    """A run forked from a variant interpreter that loads a package plainly tells the server: the
    lineage learns it (its interpreters preload it, and its next ones), and no interpreter of the
    base context starts beside the one serving the run (overmind.server.pool.WarmPool.prepare)."""
    from overmind.server.pool import WarmPool, context_from_wire
    from overmind.shared.settings.config import Config

    (tmp_path / "run").mkdir(mode=0o700)  # where an interpreter's log would go
    pool = WarmPool(Config(tmp_path / "run"))
    context, _, _ = context_from_wire({"python": sys.executable, "env": {}, "cwd": "/", "sys_path": []})
    spec = {"point": "torch._inductor::aoti_load_package", "path": str(tmp_path / "block.pt2"), "kwargs": {}}
    try:
        pool.prepare(context, packages=[spec])
        assert pool.live() == []
        assert pool.lessons.packages_for(context) == [spec]
    finally:
        pool.close()


def test_the_isa_probes_made_at_once_are_each_cached_and_leave_no_thread(python):
    # Note [The ISA probes at once]: a thread per probe, every one gone from the kernel's list when
    # it returns, or the next fork would be refused (Note [No thread pool before a fork]).
    out = python("""
        import json, platform, time
        import torch._inductor.config as config
        from torch._inductor import cpu_vec_isa
        from overmind.warm.compiled import _isa_candidates, probe_vector_isas
        from overmind.warm.fork_safety import started_since, thread_ids
        ready = thread_ids()
        started = time.monotonic()
        probe_vector_isas()
        took = time.monotonic() - started
        cached = cpu_vec_isa.VecISA._VecISA__bool__impl.cache_info().currsize
        print(json.dumps({"why": sorted(started_since(ready)), "left": sorted(thread_ids() - ready),
                          "cached": cached, "candidates": len(_isa_candidates()), "x86": platform.machine() == "x86_64"}))
    """).stdout
    found = json.loads(out.strip().splitlines()[-1])
    assert found["why"] == [] and found["left"] == []
    if found["x86"]:
        assert found["candidates"] >= 1
    assert found["cached"] >= found["candidates"]  # each answered, per vec_isa_ok, for the children
