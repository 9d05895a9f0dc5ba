"""The benchmark's child process: a fresh interpreter that loads what the parent asks.

    python -m overmind.bench.worker        (started by overmind.bench.harness.Worker)

Start-up, as a user's script would: ``import overmind.api; monkey_patch_all()`` first (a no-op
under ``OVERMIND_DISABLE=1``, the plain mode), so that with the default settings a warm run is
handed to a warm interpreter as the user's would be (Note [When a warm start applies] in
overmind.client.warm_start), then the scenario's libraries and model classes
(``OVERMIND_BENCH_PRELOAD``), so import costs stay off the load clock. It then reports
``import_s``, the time since the parent started it (``OVERMIND_BENCH_T0``, a
``time.monotonic()`` value: the clock is shared by every process of the machine).

Then one JSON job per stdin line, one reply per job on stdout, prefixed with
``REPLY_PREFIX`` so that whatever a library prints cannot be mistaken for a reply:

- ``{"op": "load", "scenario", "paths", "options", "device", "hold"}``: run the scenario's
  loader calls (each timed), ``.to(device)``, then first use of every weight; reply
  ``{"ok": true, "phases": {...}, "tensor_bytes": n}``. ``hold`` keeps the object alive
  (the memory scenario measures holders); otherwise it is dropped before the next job.
- ``{"op": "drop"}``: let go of every held object, and give the freed heap back to the kernel.
- ``{"op": "unpatch"}`` / ``{"op": "patch"}``: ``overmind.api.unpatch_all()`` /
  ``monkey_patch_all()``: the memory scenario's holders load plainly, then through overmind.
- ``{"op": "exit"}``: leave at once (``os._exit``: interpreter teardown is not measured).
"""

from __future__ import annotations

if __name__ == "__main__":  # first, as in a user's script; importing this module (harness does) does nothing
    import overmind.api

    overmind.api.monkey_patch_all()

import os  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

T0 = time.monotonic()
REPLY_PREFIX = "@overmind-bench "
PAGE = 4096


def _reply(message: dict) -> None:
    import json

    sys.stdout.write(REPLY_PREFIX + json.dumps(message) + "\n")
    sys.stdout.flush()


def modules_of(obj) -> list:
    """The torch modules a loaded object consists of (a pipeline's components, or itself)."""
    import torch

    if isinstance(obj, torch.nn.Module):
        return [obj]
    components = getattr(obj, "components", None)
    if isinstance(components, dict):
        return [m for m in components.values() if isinstance(m, torch.nn.Module)]
    raise TypeError(f"do not know where the weights of a {type(obj).__name__} are")


def touch(modules: list) -> int:
    """First use of every weight: read one byte of every page of every storage, which
    faults in whatever a load mapped lazily (file pages, shared memory). Returns the bytes
    of the distinct storages."""
    import torch

    seen: set = set()
    nbytes = 0
    for module in modules:
        for tensor in [*module.parameters(), *module.buffers()]:
            storage = tensor.untyped_storage()
            key = (storage.device, storage.data_ptr())
            if key in seen or storage.nbytes() == 0:
                continue
            seen.add(key)
            nbytes += storage.nbytes()
            raw = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
            (raw[::PAGE].sum() + raw[-1]).item()  # the last byte: a storage need not start on a page
    return nbytes


def _load(job: dict, held: list) -> dict:
    import contextlib

    from overmind.bench import scenarios

    phases: dict[str, float] = {}

    @contextlib.contextmanager
    def clock(name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            phases[name] = time.perf_counter() - start

    start = time.perf_counter()
    obj = scenarios.run(job["scenario"], job["paths"], clock, job.get("options"))
    with clock("to_device"):
        moved = obj.to(job["device"])
        obj = moved if moved is not None else obj
    if job["device"].startswith("cuda"):
        import torch

        torch.cuda.synchronize()
    phases["total"] = time.perf_counter() - start
    with clock("first_use"):
        nbytes = touch(modules_of(obj))
    if job.get("hold"):
        held.append(obj)
    return {"ok": True, "phases": phases, "tensor_bytes": nbytes}


def _give_back_freed_memory() -> None:
    """After a drop, hand the heap the objects freed back to the kernel: glibc keeps freed
    chunks of a converting load (``fp32_as_fp16``'s casts) in the process, and the memory
    scenario's next baseline would count GBs that its next loads then reuse or trim away."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: nothing to trim


def main() -> None:
    import importlib
    import json

    start = float(os.environ.get("OVERMIND_BENCH_T0", T0))
    import overmind.api
    import torch  # noqa: F401

    from overmind.bench.scenarios import resolve_loader

    for spec in filter(None, os.environ.get("OVERMIND_BENCH_PRELOAD", "").split(",")):
        try:
            resolve_loader(spec)
        except (ImportError, AttributeError, ValueError) as err:
            _reply({"ready": False, "error": f"cannot import {spec}: {err}"})
            os._exit(1)
    _reply({"ready": True, "import_s": time.monotonic() - start, "pid": os.getpid()})
    held: list = []
    for line in sys.stdin:
        job = json.loads(line)
        op = job.get("op")
        if op == "exit":
            break
        try:
            if op == "load":
                _reply(_load(job, held))
                continue
            if op == "drop":
                held.clear()
                _give_back_freed_memory()
            elif op == "unpatch":
                overmind.api.unpatch_all()
            elif op == "patch":
                overmind.api.monkey_patch_all()
            else:
                raise ValueError(f"unknown op {op!r}")
            _reply({"ok": True})
        except BaseException as err:  # reported to the parent, which decides
            import traceback

            _reply({"ok": False, "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()})
        finally:
            if not job.get("hold"):
                import gc

                gc.collect()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
