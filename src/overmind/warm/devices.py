"""The GPUs a warm interpreter's imports ask about, answered by a process of their own.

Runs in the warm interpreter (overmind.warm.fork_safety installs it while the interpreter
imports)::

    devices = nvml_devices()   # [Device(uuid, capability), ...], [] without a driver, None if unknown

Note [NVML answered from outside]
Imports ask whether CUDA is there (``torch.cuda.is_available()`` in diffusers.utils, bitsandbytes,
torch._inductor and more), and a warm interpreter has them ask NVML rather than CUDA (Note [Warm
interpreters never touch CUDA] in overmind.server.pool). But NVML starts a driver thread of its
own at ``nvmlInit`` (named ``cuda`` and hex digits), and ``nvmlShutdown`` does not end it: seen
on an H100 (driver 580, benchmarks/gpu_check.sh, 2026-11-28), where the first import to ask
started it, the interpreter could not fork past it (Note [Threads libraries start] in
overmind.warm.fork_safety), and each successor kept one more asking module out; no run forked.
So while a warm interpreter imports, torch's NVML questions (how many devices, their UUIDs,
their compute capability) are answered by a short-lived process that asks NVML and exits, once
per interpreter. The answers are the hardware's: the ones NVML gives in-process, from which
torch applies ``CUDA_VISIBLE_DEVICES`` itself. Where the machine has no NVML and no CUDA driver
(a CUDA build of torch on a machine without a GPU), there are no devices, as CUDA would say. A
child forked for a run asks NVML or CUDA itself, as plain python does.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import NamedTuple, Optional

__all__ = ["Device", "nvml_devices", "raw_count", "raw_uuids", "capability"]

PROBE_TIMEOUT = 30.0

# Stdlib only, run as `python -I -S -c`: nothing of the venv is imported, and no thread it
# starts outlives it.
PROBE = r"""
import ctypes, json
answer = {}
try:
    nvml = ctypes.CDLL("libnvidia-ml.so.1")
except OSError as err:
    answer["error"] = f"no NVML: {err}"
    try:
        ctypes.CDLL("libcuda.so.1")
        answer["driver"] = True
    except OSError:
        answer["driver"] = False
else:
    if nvml.nvmlInit_v2() != 0:
        answer["error"] = "nvmlInit failed"
    else:
        count = ctypes.c_uint()
        if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
            answer["error"] = "nvmlDeviceGetCount failed"
        else:
            answer["devices"] = []
            for index in range(count.value):
                handle, major, minor = ctypes.c_void_p(), ctypes.c_int(), ctypes.c_int()
                uuid = ctypes.create_string_buffer(96)
                if nvml.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(index), ctypes.byref(handle)) != 0:
                    answer["devices"].append(None)
                    continue
                got_uuid = nvml.nvmlDeviceGetUUID(handle, uuid, ctypes.c_uint(96)) == 0
                got_cap = nvml.nvmlDeviceGetCudaComputeCapability(handle, ctypes.byref(major), ctypes.byref(minor)) == 0
                answer["devices"].append({"uuid": uuid.value.decode("ascii") if got_uuid else None,
                                          "capability": [major.value, minor.value] if got_cap else None})
        nvml.nvmlShutdown()
print(json.dumps(answer))
"""


class Device(NamedTuple):
    uuid: Optional[str]
    capability: Optional[tuple[int, int]]


_answer: Optional[dict] = None  # the probe's, once asked


def _probe() -> dict:
    global _answer
    if _answer is None:
        try:
            proc = subprocess.run([sys.executable, "-I", "-S", "-c", PROBE], capture_output=True, text=True,
                                  timeout=PROBE_TIMEOUT, stdin=subprocess.DEVNULL)
            _answer = json.loads(proc.stdout.strip().splitlines()[-1])
        except (OSError, subprocess.SubprocessError, ValueError, IndexError) as err:
            _answer = {"error": f"the probe failed: {type(err).__name__}: {err}"}
    return _answer


def nvml_devices() -> Optional[list[Optional[Device]]]:
    """Every GPU NVML lists, by physical index (None where it would not say); [] where the
    machine has neither NVML nor a CUDA driver; None where NVML could not answer."""
    answer = _probe()
    if "devices" in answer:
        return [None if d is None else Device(d["uuid"], d["capability"] and tuple(d["capability"]))
                for d in answer["devices"]]
    return [] if answer.get("driver") is False else None


def raw_count() -> int:
    """``torch.cuda._raw_device_count_nvml()``: the devices, or -1 where NVML cannot tell."""
    devices = nvml_devices()
    return -1 if devices is None else len(devices)


def raw_uuids() -> Optional[list[str]]:
    """``torch.cuda._raw_device_uuid_nvml()``: every device's UUID, or None."""
    devices = nvml_devices()
    if devices is None or any(d is None or d.uuid is None for d in devices):
        return None
    return [d.uuid for d in devices]


def capability(index: int) -> Optional[tuple[int, int]]:
    """Device ``index``'s (physical) compute capability, or None where NVML cannot tell."""
    devices = nvml_devices()
    if devices is None or not 0 <= index < len(devices) or devices[index] is None:
        return None
    return devices[index].capability
