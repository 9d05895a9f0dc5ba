"""A hit is served only to a caller that could read the model's files itself, now.

The test runs as root in CI, and root reads everything: the caller drops the capabilities
that bypass file permissions (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH) before it starts, keeping
uid 0, so the server's SO_PEERCRED check still lets it in.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from ..conftest import REPO, age_files

CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH = 1, 2
PR_CAPBSET_DROP = 24

LOAD = """
import json, sys
import overmind.api
overmind.api.monkey_patch_all()
from transformers import AutoModelForCausalLM
with open("/proc/self/status") as f:
    caps = int(next(line for line in f if line.startswith("CapEff:")).split()[1], 16)
try:
    open({weights!r}, "rb").close()
    can_open = True
except PermissionError:
    can_open = False
try:
    model = AutoModelForCausalLM.from_pretrained({folder!r})
    outcome = {{"loaded": sum(p.numel() for p in model.parameters())}}
except Exception as err:
    outcome = {{"raised": type(err).__name__, "message": str(err)}}
print(json.dumps({{"caps": caps, "can_open": can_open, **outcome}}))
"""


def _drop_dac_capabilities() -> None:
    """Run in the child before exec: take both capabilities out of its bounding set. An exec by
    uid 0 gets the bounding set as its permitted and effective sets, so the interpreter holds
    neither (and cannot get them back)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH):
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def _bypasses_permissions(caps: int) -> bool:
    return bool(caps & ((1 << CAP_DAC_OVERRIDE) | (1 << CAP_DAC_READ_SEARCH)))


def _own_caps() -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("CapEff:")).split()[1], 16)


def _run(code: str, env: dict, *, unprivileged: bool) -> dict:
    """``code`` in a fresh interpreter; ``unprivileged``: without the capabilities to bypass file
    permissions (dropped in the child when we hold them)."""
    preexec = _drop_dac_capabilities if unprivileged and _bypasses_permissions(_own_caps()) else None
    try:
        proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                              env=env, timeout=180, cwd=REPO, preexec_fn=preexec)
    except subprocess.SubprocessError as err:  # the preexec_fn failed: no CAP_SETPCAP
        pytest.skip(f"cannot drop the capabilities that bypass file permissions here: {err}")
    if unprivileged and "No module named 'overmind'" in proc.stderr:  # root's caps dropped, in a checkout it does not own
        pytest.skip("without its capabilities this uid cannot read the checkout")
    assert proc.returncode == 0, proc.stderr[-6000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["stderr"] = proc.stderr
    if unprivileged and _bypasses_permissions(result["caps"]):
        pytest.skip("the child still bypasses file permissions")
    return result


def test_a_hit_is_refused_to_a_caller_that_cannot_read_the_weights_and_it_raises_as_plain(server, tmp_path):
    from overmind import modelgen

    folder = modelgen.save_lm(tmp_path / "lm", seed=9)
    age_files(folder)
    weights = folder / "model.safetensors"
    code = LOAD.format(folder=str(folder), weights=str(weights))
    env = server.client_env(OVERMIND_COLD="wait")
    assert "loaded" in _run(code, env, unprivileged=False)  # cached
    weights.chmod(0)
    if os.geteuid() == 0:  # a caller that may read it anyway fills and hits the entry for the file as it is now
        assert "loaded" in _run(code, env, unprivileged=False)
        hits = server.status()["hits"]
        assert "loaded" in _run(code, env, unprivileged=False)
        assert server.status()["hits"] == hits + 1

    plain = _run(code, server.client_env(OVERMIND_DISABLE="1"), unprivileged=True)
    assert plain["can_open"] is False and "raised" in plain
    cached = _run(code, env, unprivileged=True)
    assert {k: cached.get(k) for k in ("can_open", "raised", "message")} == \
        {k: plain[k] for k in ("can_open", "raised", "message")}
    assert "overmind" not in cached["stderr"]  # silent: plain raises too

    weights.chmod(0o644)
    age_files(folder)
    assert "loaded" in _run(code, env, unprivileged=True)  # readable again: no exception
