"""Compiled code under ``overmind run``: ``torch.compile`` scripts start from an interpreter that
holds the compile stack and Inductor's probe answers; AOTInductor packages are handed over;
nothing was started that a fork breaks (Notes in overmind.warm.compiled and overmind.client.compiled).

Real server, real front end, real ``torch.compile`` (a tiny MLP, Inductor's caches in a folder of
this module's) and a real AOTInductor package.
"""

from __future__ import annotations

import json
import os
import sysconfig
import time
from pathlib import Path

import pytest


from .conftest import overmind_run, plain_python, runs_forked, started_warm_server, wait_warm

pytestmark = pytest.mark.slow  # each compiles a tiny model once (seconds to tens of seconds on 2 cores)

MODEL = """
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).eval()
example = torch.linspace(-1, 1, 32).reshape(2, 16)
"""

COMPILE = """
import json, sys
held = "torch._inductor" in sys.modules
""" + MODEL + """
import torch._inductor.config as config
isa = sys.modules.get("torch._inductor.cpu_vec_isa")
probed = bool(isa) and isa.VecISA._VecISA__bool__impl.cache_info().currsize > 0
if len(sys.argv) > 1:
    config.cpp.vec_isa_ok = False  # set by the script: plain then has no vector ISA
from torch._inductor.cpu_vec_isa import valid_vec_isa_list
with torch.no_grad():
    out = torch.compile(model)(example)
print(json.dumps({"held": held, "probed": probed, "out": out.tolist(),
                  "isas": [str(i) for i in valid_vec_isa_list()]}))
"""

AOTI = MODEL + """
import json, sys
import overmind.api
overmind.api.monkey_patch_all()
import overmind.shared.calls.compiled
runner = torch._inductor.aoti_load_package(sys.argv[1])
handed = bool(overmind.shared.calls.compiled._handed)
with torch.no_grad():
    print(json.dumps({"handed": handed, "out": runner(example).tolist(), "type": type(runner).__name__}))
"""


@pytest.fixture(scope="module")
def compiled_server():
    yield from started_warm_server("om-cc-")


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("compiled")


@pytest.fixture(scope="module")
def cache_env(compiled_server, work) -> dict:
    return compiled_server.client_env(TORCHINDUCTOR_CACHE_DIR=str(work / "inductor"))


@pytest.fixture(scope="module")
def package(work, cache_env) -> Path:
    """A tiny MLP as an AOTInductor package, aged so that it is not racy (Note [Racy files])."""
    path = work / "mlp.pt2"
    script = work / "package.py"
    script.write_text(MODEL + f"""
ep = torch.export.export(model, (example,))
torch._inductor.aoti_compile_and_package(ep, package_path={str(path)!r})
""")
    proc = plain_python(str(script), env=cache_env, cwd=work)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stamp = time.time() - 60
    os.utime(path, (stamp, stamp))
    return path


def _warm_until(server, args, env, cwd, done, timeout: float = 240) -> list:
    """Run until ``done(output)`` for a run forked from a warm interpreter; every output on the
    way is returned, each with whether it was forked."""
    seen = []
    deadline = time.monotonic() + timeout
    while True:
        wait_warm(server)
        before = runs_forked(server)
        proc = overmind_run(server, *args, env=env, cwd=cwd)
        assert proc.returncode == 0, f"{proc.stderr[-3000:]}\n{server.log()[-2000:]}"
        forked = runs_forked(server) > before
        out = json.loads(proc.stdout.splitlines()[-1])
        seen.append((forked, out))
        if forked and done(out):
            return seen
        assert time.monotonic() < deadline, f"never done: {seen}\n{server.log()[-3000:]}"
        time.sleep(0.5)


def test_a_compiled_script_is_forked_holding_the_compile_stack_and_inductors_probes(compiled_server, work,
                                                                                   cache_env):
    script = work / "compile.py"
    script.write_text(COMPILE)
    plain = json.loads(plain_python(str(script), env=cache_env, cwd=work).stdout)  # also fills Inductor's caches
    assert plain["isas"] and not plain["held"] and not plain["probed"]
    seen = _warm_until(compiled_server, [str(script)], cache_env, work, lambda out: out["held"] and out["probed"])
    for _, out in seen:
        assert out["out"] == plain["out"] and out["isas"] == plain["isas"]


def test_a_compiled_script_that_turns_the_vector_isa_off_sees_none_as_in_plain_python(compiled_server, work,
                                                                                      cache_env):
    # Note [Inductor's probes, made once]: the primed answers are per setting, never the list
    # valid_vec_isa_list() caches at its first call.
    script = work / "compile.py"
    script.write_text(COMPILE)
    plain = json.loads(plain_python(str(script), "no-isa", env=cache_env, cwd=work).stdout)
    assert plain["isas"] == []
    seen = _warm_until(compiled_server, [str(script), "no-isa"], cache_env, work, lambda out: out["probed"])
    for _, out in seen:
        assert out["isas"] == [] and out["out"] == plain["out"], seen


def test_an_aoti_package_is_loaded_in_the_warm_interpreter_and_handed_to_the_run(compiled_server, work, cache_env,
                                                                                package):
    script = work / "aoti.py"
    script.write_text(AOTI)
    plain = json.loads(plain_python(str(script), str(package), env=cache_env, cwd=work).stdout)  # teaches the server
    assert not plain["handed"] and plain["type"] == "AOTICompiledModel"
    seen = _warm_until(compiled_server, [str(script), str(package)], cache_env, work, lambda out: out["handed"])
    for _, out in seen:
        assert out["out"] == plain["out"] and out["type"] == plain["type"]


def test_a_changed_package_is_never_handed_over(compiled_server, work, cache_env, package):
    # Note [AOTInductor packages are handed over]: keyed by the file's fingerprint, taken again at the call.
    script = work / "aoti.py"
    script.write_text(AOTI)
    _warm_until(compiled_server, [str(script), str(package)], cache_env, work, lambda out: out["handed"])
    stamp = time.time() - 30
    os.utime(package, (stamp, stamp))  # a new mtime (and ctime): the preloaded runner is stale
    wait_warm(compiled_server)
    before = runs_forked(compiled_server)
    proc = overmind_run(compiled_server, str(script), str(package), env=cache_env, cwd=work)
    assert runs_forked(compiled_server) == before + 1, proc.stderr[-2000:]  # forked, from the interpreter that preloaded
    assert not json.loads(proc.stdout)["handed"], proc.stdout
    # ...and the run taught it again: a later run gets the package as it is now.
    _warm_until(compiled_server, [str(script), str(package)], cache_env, work, lambda out: out["handed"])


def test_an_interpreter_that_started_a_thread_pool_is_never_forked_past(compiled_server, tmp_path, cache_env):
    # Note [No thread pool before a fork]: an installed module that runs a parallel kernel at
    # import starts OpenMP's pool; a child forked past it would hang in its first parallel kernel.
    # The runs go plain (saying why in the log) and the context settles on interpreters without it.
    name = f"overmind_test_kernel_{os.getpid()}"
    path = Path(sysconfig.get_paths()["purelib"]) / f"{name}.py"
    path.write_text("import torch\nVALUE = float((torch.ones(512, 512) @ torch.ones(512, 512)).sum())\n")
    os.utime(path, (time.time() - 60, time.time() - 60))
    try:
        script = tmp_path / "kernel.py"
        script.write_text(f"import sys, torch\nheld = {name!r} in sys.modules\nimport {name}\n"
                          "print(held, float((torch.ones(512, 512) @ torch.ones(512, 512)).sum()))\n")
        outputs = []
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            wait_warm(compiled_server)
            before = runs_forked(compiled_server)
            proc = overmind_run(compiled_server, str(script), env=cache_env, cwd=tmp_path)  # 120 s: a hang fails here
            forked = runs_forked(compiled_server) > before
            outputs.append((forked, proc.stdout))
            assert proc.returncode == 0 and proc.stdout == "False 134217728.0\n", outputs  # never forked past it
            if len(outputs) >= 4 and all(f for f, _ in outputs[-2:]):
                break
            time.sleep(0.5)
        assert all(f for f, _ in outputs[-2:]), outputs
        assert f"in {name}: {name} is kept out of this context's warm interpreters" in compiled_server.log()
    finally:
        path.unlink()
