"""What a warm interpreter's imports learn of the GPUs comes from a process of its own (Note [NVML
answered from outside] in overmind.warm.devices): the answers are NVML's, and the interpreter
never maps NVML."""

from __future__ import annotations

import json

from ..conftest import child_env, run_python

ASK = """
import json, torch
from overmind.warm import devices, fork_safety
with fork_safety._cuda_refused():  # as while a warm interpreter imports
    inside = [torch.cuda._raw_device_count_nvml(), torch.cuda._raw_device_uuid_nvml(), torch.cuda._device_count_nvml()]
    try:
        capability = list(fork_safety._capability())  # get_device_capability's answer there (CUDA builds)
    except fork_safety.Refused as err:
        capability = str(err)
mapped = "libnvidia-ml" in open("/proc/self/maps").read()
try:
    outside = [torch.cuda._raw_device_count_nvml(), torch.cuda._raw_device_uuid_nvml()]
except OSError as err:  # no NVML on this machine: torch's own question fails here
    outside = str(err)
cuda = list(torch.cuda.get_device_capability()) if torch.cuda.is_available() else None  # CUDA's own, last
print(json.dumps({"inside": inside, "capability": capability, "cuda": cuda, "mapped": mapped, "outside": outside,
                  "probe": devices._answer}))
"""


def test_torchs_nvml_questions_are_answered_by_a_probe_process_while_importing():
    found = json.loads(run_python(ASK, env=child_env(PYTORCH_NVML_BASED_CUDA_CHECK="1")).stdout.splitlines()[-1])
    count, uuids, visible = found["inside"]
    assert not found["mapped"], "the interpreter itself started NVML"
    if isinstance(found["outside"], list):  # a machine with NVML: the same answers as torch's own
        assert [count, uuids] == found["outside"] and count == len(found["probe"]["devices"])
        assert visible <= count  # CUDA_VISIBLE_DEVICES may hide some
        if found["cuda"] is not None:
            assert found["capability"] == found["cuda"]
    else:  # neither NVML nor a CUDA driver: no devices, as CUDA would say
        assert found["probe"]["driver"] is False, found["probe"]
        assert (count, uuids, visible) == (0, [], 0)
        assert "NVML cannot tell device 0's compute capability" in found["capability"]
