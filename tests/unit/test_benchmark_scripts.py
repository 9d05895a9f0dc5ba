"""Every script in benchmarks/ is a command a user types: ``--help`` prints its usage and exits 0,
without running the benchmark (fingerprint.py once ran, and failed, instead)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ..conftest import REPO, child_env

NOT_COMMANDS = {"_common.py", "hf_suites_plugin.py"}  # a shared module and a pytest plugin
SCRIPTS = sorted(p.name for p in (REPO / "benchmarks").iterdir()
                 if p.suffix in (".py", ".sh") and p.name not in NOT_COMMANDS)


def test_the_list_is_the_folders_own():
    assert "fingerprint.py" in SCRIPTS and "real_envs.sh" in SCRIPTS, SCRIPTS


@pytest.mark.parametrize("name", SCRIPTS)
def test_help_prints_usage_and_exits_0(name):
    path = REPO / "benchmarks" / name
    argv = ["bash", str(path), "--help"] if name.endswith(".sh") else [sys.executable, str(path), "--help"]
    proc = subprocess.run(argv, capture_output=True, text=True, env=child_env(), cwd=REPO, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    if name.endswith(".py"):
        assert proc.stdout.startswith(f"usage: {name}"), proc.stdout[:300]
    else:  # the script's own header comment
        assert proc.stdout.strip() and f"benchmarks/{name}" in proc.stdout, proc.stdout[:300]
