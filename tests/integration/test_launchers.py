"""Programs that start Python themselves, with the one line at the script's top: the same exit
status and output as plain python, and warm from run 2 wherever the child is the process the
launcher started (Note [When a warm start applies] in overmind.client.warm_start).

Real ``torchrun`` (two CPU ranks over gloo), real ``accelerate launch``, real multiprocessing
workers (spawn and fork) and real pytest, against a real server started for each test.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import ServerProcess, overmind_run, runs_forked, wait_warm

BIN = Path(sys.executable).parent
TIMEOUT = 300

ONE_LINE = "import overmind.api\novermind.api.monkey_patch_all()\n"

RANKS = ONE_LINE + '''import os, sys
import torch
import torch.distributed as dist
from overmind.shared.protocol.contexts import in_warm_run
dist.init_process_group("gloo")
total = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(total)
rank = dist.get_rank()
# One write per line: under torchrun's -u, print() writes the text and its newline apart, and two
# ranks sharing a pipe interleave them (plain python's as much as ours).
sys.stdout.write(f"rank {rank}/{dist.get_world_size()} local {os.environ['LOCAL_RANK']} sum {total.item()}\\n")
sys.stderr.write(f"warm {rank} {in_warm_run()}\\n")
dist.destroy_process_group()
sys.exit(3 if rank == 0 else 0)
'''

WORKERS = ONE_LINE + '''import multiprocessing as mp
import os, sys


def square(x):
    return x * x


if __name__ == "__main__":
    from overmind.shared.protocol.contexts import in_warm_run
    import torch  # what the script's loads would import; the workers inherit it (fork) or import it (spawn)
    for method in ("spawn", "fork"):
        with mp.get_context(method).Pool(2) as pool:
            print(method, pool.map(square, range(5)), flush=True)
    print("warm", in_warm_run(), file=sys.stderr, flush=True)
    sys.exit(5)
'''


def _launch(argv: list, env: dict, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT)


def _warm_lines(stderr: str) -> list[str]:
    return sorted(line for line in stderr.splitlines() if line.startswith("warm "))


def _curve(server: ServerProcess, argv: list, cwd: Path, runs: int = 2, **env) -> list[subprocess.CompletedProcess]:
    """Plain (OVERMIND_WARM_START=0, the drop-in) once, then runs 1..``runs`` of the default."""
    environ = server.client_env(**env)
    done = [_launch(argv, {**environ, "OVERMIND_WARM_START": "0"}, cwd)]
    for _ in range(runs):
        done.append(_launch(argv, environ, cwd))
        server.wait_idle()
        wait_warm(server)
    return done


@pytest.mark.skipif(not (BIN / "torchrun").exists(), reason="torchrun is not installed")
def test_torchrun_ranks_are_each_forked_warm_from_run_2_with_plains_output_and_status(server, tmp_path):
    (tmp_path / "ranks.py").write_text(RANKS)
    argv = [str(BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", str(29500 + os.getpid() % 1000),
            "ranks.py"]
    plain, first, second = _curve(server, argv, tmp_path)
    before = runs_forked(server)
    third = _launch(argv, server.client_env(), tmp_path)
    for proc in (plain, first, second, third):
        assert proc.returncode != 0 and "exitcode  : 3" in proc.stderr, proc.stderr[-3000:]  # rank 0's status
        assert sorted(proc.stdout.splitlines()) == ["rank 0/2 local 0 sum 3.0", "rank 1/2 local 1 sum 3.0"]
    assert _warm_lines(plain.stderr) == ["warm 0 False", "warm 1 False"]
    assert _warm_lines(second.stderr) == ["warm 0 True", "warm 1 True"], server.log()[-4000:]
    assert runs_forked(server) == before + 2


@pytest.mark.skipif(not (BIN / "accelerate").exists(), reason="accelerate is not installed")
def test_accelerate_launch_is_warm_from_run_2_with_plains_output_and_status(server, tmp_path):
    (tmp_path / "train.py").write_text(ONE_LINE + "import sys\nfrom overmind.shared.protocol.contexts import in_warm_run\n"
                                       "import torch\nprint('sum', torch.arange(4).sum().item())\n"
                                       "print('warm', in_warm_run(), file=sys.stderr)\nsys.exit(4)\n")
    argv = [str(BIN / "accelerate"), "launch", "--cpu", "--num_processes", "1", "--num_machines", "1",
            "--mixed_precision", "no", "--dynamo_backend", "no", "train.py"]
    plain, first, second = _curve(server, argv, tmp_path, HOME=str(tmp_path))
    assert plain.returncode == 1 and "returned non-zero exit status 4" in plain.stderr  # accelerate's own report
    for proc in (plain, first, second):
        assert proc.returncode == plain.returncode and proc.stdout == "sum 6\n", proc.stderr[-3000:]
        assert "returned non-zero exit status 4" in proc.stderr
    assert _warm_lines(plain.stderr) == ["warm False"] and _warm_lines(second.stderr) == ["warm True"]


def test_multiprocessing_workers_by_spawn_and_fork_work_in_a_warm_run(server, tmp_path):
    (tmp_path / "workers.py").write_text(WORKERS)
    argv = [sys.executable, "workers.py"]
    plain, first, second = _curve(server, argv, tmp_path)
    for proc in (plain, first, second):
        assert proc.returncode == 5, proc.stderr[-3000:]
        assert proc.stdout == "spawn [0, 1, 4, 9, 16]\nfork [0, 1, 4, 9, 16]\n"
    assert _warm_lines(second.stderr) == ["warm True"], second.stderr[-3000:]


TEST_MODULE = ONE_LINE + '''import torch


def test_sums():
    assert torch.arange(4).sum().item() == 6


def test_fails():
    assert torch.arange(3).sum().item() == 4
'''


def _pytest_output(text: str) -> str:
    """pytest's report without what differs from one plain run to the next: timings (and the
    rule's width around them), addresses and the root folder."""
    text = re.sub(r"=* (.*) in [0-9.]+s(?: \([0-9:]+\))? =*", r"\1 in Ts", text)
    text = re.sub(r"0x[0-9a-f]+", "0x?", text)
    return re.sub(r"rootdir: \S+", "rootdir: R", text)


def test_pytest_prints_what_plain_pytest_prints_run_plainly_and_through_overmind_run(server, tmp_path):
    (tmp_path / "test_one_line.py").write_text(TEST_MODULE)
    args = ["-m", "pytest", "-p", "no:cacheprovider", "-p", "no:randomly", "test_one_line.py"]
    env = server.client_env()
    env.pop("PYTEST_ADDOPTS", None)
    plain = _launch([sys.executable, *args], {**env, "OVERMIND_DISABLE": "1"}, tmp_path)
    assert plain.returncode == 1 and "1 failed, 1 passed" in plain.stdout, plain.stdout[-3000:]
    for _ in range(2):
        proc = _launch([sys.executable, *args], env, tmp_path)
        assert (proc.returncode, _pytest_output(proc.stdout)) == (1, _pytest_output(plain.stdout))
        server.wait_idle()
    for run in range(3):
        before = runs_forked(server)
        proc = overmind_run(server, *args, env=env, cwd=tmp_path, timeout=TIMEOUT)
        assert "RewriteWarning" not in proc.stdout + proc.stderr, proc.stdout[-3000:]
        assert (proc.returncode, _pytest_output(proc.stdout)) == (1, _pytest_output(plain.stdout))
        forked = runs_forked(server) > before
        server.wait_idle()
        wait_warm(server)
    assert forked, server.log()[-4000:]  # the last was warm


def test_a_pytest_run_goes_plain_from_an_interpreter_that_imported_a_package_pytest_rewrites(server, tmp_path):
    """anyio is a pytest plugin's package that transformers imports: Note [pytest rewrites what it imports]."""
    pytest.importorskip("anyio")
    (tmp_path / "uses_anyio.py").write_text("import sys, transformers\nassert 'anyio' in sys.modules\n")
    (tmp_path / "test_plain.py").write_text("def test_one():\n    assert 1 + 1 == 3\n")
    env = server.client_env()
    for _ in range(3):  # the interpreter learns anyio
        assert overmind_run(server, "uses_anyio.py", env=env, cwd=tmp_path).returncode == 0
        server.wait_idle()
        wait_warm(server)
    args = ["-m", "pytest", "-p", "no:cacheprovider", "test_plain.py"]
    plain = _launch([sys.executable, *args], env, tmp_path)
    before = runs_forked(server)
    proc = overmind_run(server, *args, env=env, cwd=tmp_path, timeout=TIMEOUT)
    assert (proc.returncode, _pytest_output(proc.stdout)) == (1, _pytest_output(plain.stdout))
    assert "RewriteWarning" not in proc.stdout + proc.stderr and runs_forked(server) == before
    assert "pytest would rewrite anyio" in server.log()
