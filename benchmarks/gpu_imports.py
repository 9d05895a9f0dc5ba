"""Import census for a GPU machine: which import starts native threads, maps libcuda, initialises CUDA.

    python3 benchmarks/gpu_imports.py [--passes list,probe] [--modules a,b:attr,c|d] [--timeout 240]

Standalone (stdlib; torch only in the children), importable without a GPU. Each pass runs in a
fresh interpreter started the way a warm interpreter is (overmind.server.warm_process.WarmProcess,
overmind.warm.interpreter): ``python -c``, cwd ``/``, a session of its own, stdin from
/dev/null, the environment without ``OVERMIND_*`` but ``OVERMIND_DISABLE=1`` and
``PYTORCH_NVML_BASED_CUDA_CHECK=1`` (Note [Warm interpreters never touch CUDA] in
overmind.server.pool: ``torch.cuda.is_available()`` then asks NVML, which does not run cuInit).

- ``list``: imports :data:`STEPS` one by one (``mod:attr`` also reads the attribute, which is how
  diffusers' and transformers' lazy modules import the real thing; ``a|b``: the first that
  exists). After each: the native threads started since the step before (``/proc/self/task/<tid>/comm``),
  those still alive once every mapped OpenBLAS pool was stopped as the warm interpreter stops
  them (``blas_thread_shutdown_``, Note [Threads libraries start] in overmind.warm.fork_safety),
  ``torch.cuda.is_initialized()``, and for every libcuda in ``/proc/self/maps`` the answer of
  ``cuDeviceGetCount`` (3, CUDA_ERROR_NOT_INITIALIZED: cuInit never ran in this process; 0: it did).
  Last, ``torch.cuda.is_available()`` itself, checked the same way.
- ``probe``: the same imports with a finder first on ``sys.meta_path`` that wraps every module's
  loader and checks CUDA and the thread list before each module is imported and after each has
  run (every module, not only the steps). The first check that finds CUDA initialised names the
  module: the one that just finished running, or, when found before a nested import, the
  innermost module still running. Also where libcuda was first mapped, and who started each thread.

Output: JSON lines on stdout, one per step and event, then one ``{"pass": "summary", ...}``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import time

STEPS = (
    "torch",
    # what overmind.warm.interpreter imports right after torch, when overmind is installed
    "overmind.shared.segments.quirks", "overmind.shared.segments.reductions", "overmind.warm.script",
    "safetensors.torch",
    "diffusers",
    "diffusers.utils.torch_utils",
    "diffusers.models.autoencoders",
    "diffusers.models.unets.unet_2d_condition",
    "diffusers.models.controlnets|diffusers.models.controlnet",
    "diffusers.pipelines",
    # the ControlNet script: `from diffusers import AutoencoderKL, ControlNetModel, StableDiffusionControlNetPipeline`
    "diffusers:AutoencoderKL", "diffusers:ControlNetModel", "diffusers:StableDiffusionControlNetPipeline",
    "transformers",
    "transformers.models.clip",
    "transformers:CLIPTextModel", "transformers:AutoModelForCausalLM",
    "accelerate",
    "triton",
    "torch._inductor",
    "bitsandbytes",
    "peft",
    "scipy.stats",
    "pandas",
    "pyarrow",
)
NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"
NOT_INITIALIZED = 3  # CUDA_ERROR_NOT_INITIALIZED
# Libraries worth naming when they appear in /proc/self/maps.
LIBS = ("libcuda.", "libnvidia-ml", "libcudart", "libnvrtc", "libcublas", "libcudnn", "libnccl", "libtorch_cuda",
        "openblas", "libgomp", "libiomp", "jemalloc", "libtriton", "bitsandbytes", "libarrow")


def emit(record: dict) -> None:
    print(json.dumps(record, default=str), flush=True)


# -- what a child looks at ---------------------------------------------------------------------


def thread_ids() -> set:
    try:
        return set(os.listdir("/proc/self/task"))
    except OSError:
        return set()


def comm(tid: str) -> str:
    try:
        with open(f"/proc/self/task/{tid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"  # it ended meanwhile


def describe(tids) -> list:
    return [{"tid": int(t), "comm": comm(t)} for t in sorted(tids, key=int)]


def mapped(words=LIBS) -> set:
    found = set()
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rpartition(" ")[2].strip()
                name = os.path.basename(path)
                if path.startswith("/") and ".so" in name and any(w in name for w in words):
                    found.add(path)
    except OSError:
        pass
    return found


def driver_answer(path: str):
    """cuDeviceGetCount's return code and count, through the already loaded ``path`` (None: not callable)."""
    try:
        lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | getattr(os, "RTLD_LOCAL", 0))
        count = ctypes.c_int(-1)
        return int(lib.cuDeviceGetCount(ctypes.byref(count))), count.value
    except (OSError, AttributeError):
        return None


def torch_initialized():
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None) if torch is not None else None
    try:
        return bool(cuda.is_initialized()) if cuda is not None else None
    except Exception as err:  # noqa: BLE001 -- a half-imported torch
        return f"error: {err}"


def cuda_state() -> dict:
    libs = []
    for path in sorted(p for p in mapped(("libcuda.",)) if os.path.basename(p).startswith("libcuda.")):
        answer = driver_answer(path)
        libs.append({"path": path, "cuDeviceGetCount": None if answer is None else answer[0],
                     "devices": None if answer is None else answer[1]})
    codes = [x["cuDeviceGetCount"] for x in libs if x["cuDeviceGetCount"] is not None]
    if not libs:
        driver = "libcuda not mapped"
    elif any(c != NOT_INITIALIZED for c in codes):
        driver = "initialised (cuInit ran)"
    elif codes:
        driver = "mapped, not initialised"
    else:
        driver = "mapped, cuDeviceGetCount not callable"
    return {"torch_initialized": torch_initialized(), "driver": driver, "libcuda": libs}


def initialised(state: dict) -> bool:
    return state["torch_initialized"] is True or state["driver"].startswith("initialised")


_blas: dict = {}


def stop_openblas_pools() -> int:
    """As overmind.warm.fork_safety.stop_openblas_pools: what a warm interpreter does before it counts."""
    stopped = 0
    for path in mapped(("openblas",)):
        if path not in _blas:
            try:
                _blas[path] = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | getattr(os, "RTLD_LOCAL", 0)).blas_thread_shutdown_
            except (OSError, AttributeError):
                _blas[path] = None
        if _blas[path] is not None:
            _blas[path]()
            stopped += 1
    return stopped


def alive(tid: str) -> bool:
    try:
        with open(f"/proc/self/task/{tid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] not in ("X", "Z")
    except (OSError, IndexError):
        return False


def resolve(step: str):
    """(module, attribute or None); ``a|b``: the first module that exists (None: none does)."""
    import importlib.util

    module, _, attr = step.partition(":")
    for name in module.split("|"):
        try:
            if importlib.util.find_spec(name) is not None:
                return name, attr or None
        except (ImportError, ValueError):
            continue
    return None, attr or None


def run_step(step: str):
    """Import one step; (module, status, error)."""
    import importlib

    module, attr = resolve(step)
    if module is None:
        return step.partition(":")[0], "missing", None
    try:
        obj = importlib.import_module(module)
        if attr:
            getattr(obj, attr)
        return module, "ok", None
    except BaseException as err:  # noqa: BLE001 -- anything an import raises is a finding
        return module, "error", f"{type(err).__name__}: {str(err)[:400]}"


# -- the list pass -----------------------------------------------------------------------------


def list_pass(steps, stop_blas: bool) -> None:
    main = str(os.getpid())
    seen = thread_ids()
    libs = mapped()
    emit({"pass": "list", "event": "start", "pid": os.getpid(), "python": sys.version.split()[0],
          "executable": sys.executable, "cwd": os.getcwd(), NVML_CHECK: os.environ.get(NVML_CHECK),
          "threads": describe(seen), "cuda": cuda_state()})
    for i, step in enumerate([*steps, "<torch.cuda.is_available()>"]):
        before = len(sys.modules)
        start = time.perf_counter()
        if step == "<torch.cuda.is_available()>":
            torch = sys.modules.get("torch")
            if torch is None:
                continue
            try:
                module, status, error = "torch.cuda", "ok", None
                available = torch.cuda.is_available()
            except Exception as err:  # noqa: BLE001
                module, status, error, available = "torch.cuda", "error", f"{type(err).__name__}: {err}", None
        else:
            module, status, error = run_step(step)
            available = None
        seconds = time.perf_counter() - start
        time.sleep(0.05)  # threads a library starts from a thread of its own
        now = thread_ids()
        new = describe(now - seen)  # named now: a pool stopped below is gone
        stopped = stop_openblas_pools() if stop_blas else 0
        if stopped:
            deadline = time.monotonic() + 0.5
            while time.monotonic() < deadline and any(not alive(t) for t in thread_ids() - {main}):
                time.sleep(0.005)
        left = {t for t in thread_ids() - {main} if alive(t)}
        seen = thread_ids()
        now_libs = mapped()
        record = {"pass": "list", "step": i, "name": step, "module": module, "status": status, "error": error,
                  "seconds": round(seconds, 4), "modules_added": len(sys.modules) - before,
                  "new_threads": new, "openblas_pools_stopped": stopped,
                  "threads_a_fork_would_miss": describe(left),
                  "new_libraries": sorted(os.path.basename(p) for p in now_libs - libs), "cuda": cuda_state()}
        if available is not None:
            record["cuda_available"] = available
        libs = now_libs
        emit(record)


# -- the probe pass ----------------------------------------------------------------------------


class Probe:
    """First on sys.meta_path: finds each module through the finders after it, wraps the loader it
    returns, and looks at CUDA and the threads before each import and after each module ran."""

    def __init__(self) -> None:
        self.running: list = []  # modules whose code (or extension init) is running, innermost last
        self.step = ""
        self.threads = thread_ids()
        self.libcuda = None  # (path, how it was found)
        self.cuda_at = None  # the first check that found CUDA initialised
        self.births: list = []
        self.modules = 0
        self.busy = False

    # the finder
    def find_spec(self, name, path=None, target=None):
        self.check(f"before importing {name}", self.running[-1] if self.running else None)
        for finder in sys.meta_path:
            if finder is self:
                continue
            find = getattr(finder, "find_spec", None)
            if find is None:
                continue
            spec = find(name, path, target)
            if spec is not None:
                self._wrap(spec, name)
                return spec
        return None

    def _wrap(self, spec, name: str) -> None:
        loader = spec.loader
        if loader is None or isinstance(loader, type) or getattr(loader, "_gpu_census_wrapped", False):
            return  # built-in and frozen modules: their loaders are classes shared by all of them
        probe = self
        create, execute = getattr(loader, "create_module", None), getattr(loader, "exec_module", None)
        if execute is None:
            return

        def create_module(spec_):
            probe.running.append(spec_.name)
            try:
                return create(spec_) if create is not None else None
            except BaseException:
                probe.running.pop()
                raise

        def exec_module(module):
            me = module.__name__
            pushed = not (probe.running and probe.running[-1] == me)
            if pushed:
                probe.running.append(me)
            try:
                execute(module)
            finally:
                if probe.running and probe.running[-1] == me:
                    probe.running.pop()
                probe.modules += 1
                probe.check(f"after {me} ran", me)

        try:
            loader.create_module = create_module
            loader.exec_module = exec_module
            loader._gpu_census_wrapped = True
        except (AttributeError, TypeError):
            pass

    @staticmethod
    def innermost_code() -> str:
        """The innermost frame that is not this file's nor the import machinery's: module:function."""
        frame = sys._getframe(1)
        while frame is not None:
            name = frame.f_globals.get("__name__")
            filename = frame.f_code.co_filename
            if (filename != __file__ and not filename.startswith("<frozen") and isinstance(name, str)
                    and not name.startswith("importlib") and name != "__main__"):
                return f"{name}:{frame.f_code.co_name}"
            frame = frame.f_back
        return ""

    def _driver(self):
        """(path, cuDeviceGetCount's answer) of a loaded libcuda, cheaply: dlopen with RTLD_NOLOAD by soname."""
        if self.libcuda is None:
            for soname in ("libcuda.so.1", "libcuda.so"):
                try:
                    ctypes.CDLL(soname, mode=os.RTLD_NOLOAD | getattr(os, "RTLD_LOCAL", 0))
                except OSError:
                    continue
                paths = sorted(mapped(("libcuda.",)))
                self.libcuda = (paths[0] if paths else soname)
                break
            else:
                return None
        answer = driver_answer(self.libcuda)
        return self.libcuda, None if answer is None else answer[0]

    def check(self, where: str, blame) -> None:
        if self.busy:  # an import of ours, while checking
            return
        self.busy = True
        try:
            self._check(where, blame)
        finally:
            self.busy = False

    def _check(self, where: str, blame) -> None:
        now = thread_ids()
        new = now - self.threads
        self.threads = now
        code = self.innermost_code() if new or self.cuda_at is None else ""
        if new:
            self.births.append({"threads": describe(new), "where": where, "blame": blame or f"step {self.step}",
                                "innermost_code": code, "running": list(self.running), "step": self.step})
            emit({"pass": "probe", "event": "threads", **self.births[-1]})
        if self.cuda_at is not None:
            return
        had = self.libcuda is not None
        driver = self._driver()
        if driver is not None and not had:
            emit({"pass": "probe", "event": "libcuda mapped", "path": driver[0], "where": where,
                  "blame": blame or f"step {self.step}", "innermost_code": code, "running": list(self.running),
                  "step": self.step})
        torch_init = torch_initialized()
        if torch_init is True or (driver is not None and driver[1] not in (None, NOT_INITIALIZED)):
            self.cuda_at = {"module": blame or f"step {self.step} (its own code, outside any module's import)",
                            "where": where, "innermost_code": code, "running": list(self.running),
                            "step": self.step, "torch_initialized": torch_init,
                            "cuDeviceGetCount": None if driver is None else driver[1],
                            "libcuda": None if driver is None else driver[0]}
            emit({"pass": "probe", "event": "CUDA initialised", **self.cuda_at})


def probe_pass(steps) -> None:
    probe = Probe()
    sys.meta_path.insert(0, probe)
    emit({"pass": "probe", "event": "start", "pid": os.getpid(), NVML_CHECK: os.environ.get(NVML_CHECK)})
    try:
        for i, step in enumerate(steps):
            probe.step = step
            before = probe.modules
            start = time.perf_counter()
            module, status, error = run_step(step)
            seconds = time.perf_counter() - start
            probe.check(f"end of step {step}", None)
            emit({"pass": "probe", "step": i, "name": step, "module": module, "status": status, "error": error,
                  "seconds": round(seconds, 4), "modules_run": probe.modules - before,
                  "cuda_initialised": probe.cuda_at is not None})
    finally:
        sys.meta_path.remove(probe)
    emit({"pass": "probe", "event": "end", "modules_run": probe.modules, "first_cuda_init": probe.cuda_at,
          "libcuda": probe.libcuda, "thread_births": len(probe.births)})


# -- the parent --------------------------------------------------------------------------------


def child_env() -> dict:
    """The warm interpreter's: the caller's environment without OVERMIND_*, as overmind.server.warm_process
    starts it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OVERMIND_")}
    env.update({"OVERMIND_DISABLE": "1", NVML_CHECK: "1", "HF_HUB_OFFLINE": env.get("HF_HUB_OFFLINE", "1"),
                "TOKENIZERS_PARALLELISM": env.get("TOKENIZERS_PARALLELISM", "false")})
    return env


def run_pass(name: str, steps, timeout: float, stop_blas: bool) -> tuple:
    code = ("import runpy, sys\n"
            "if sys.path and sys.path[0] in ('', '/'):\n"
            "    del sys.path[0]\n"  # as overmind.warm.interpreter does
            f"sys.argv = [{__file__!r}, '--child', {name!r}, '--modules', {','.join(steps)!r}"
            f"{', ' + repr('--no-stop-openblas') if not stop_blas else ''}]\n"
            f"runpy.run_path({os.path.abspath(__file__)!r}, run_name='__main__')\n")
    records = []
    proc = subprocess.Popen([sys.executable, "-c", code], cwd="/", env=child_env(), stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=None, text=True, start_new_session=True)
    deadline = time.monotonic() + timeout
    import threading

    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    try:
        for line in proc.stdout:
            line = line.rstrip("\n")
            print(line, flush=True)
            if line.startswith("{"):
                try:
                    records.append(json.loads(line))
                except ValueError:
                    pass
        proc.wait()
    finally:
        timer.cancel()
    timed_out = time.monotonic() >= deadline and proc.returncode != 0
    return proc.returncode, timed_out, records


def summarize(results: dict) -> dict:
    out: dict = {"pass": "summary", "python": sys.version.split()[0], "executable": sys.executable}
    lst = [r for r in results.get("list", {}).get("records", []) if "step" in r]
    if lst:
        out["steps"] = {r["name"]: r["status"] for r in lst}
        first = next((r for r in lst if initialised(r["cuda"])), None)
        out["list_first_step_with_cuda_initialised"] = first and first["name"]
        mapped_at = next((r for r in lst if r["cuda"]["libcuda"]), None)
        out["list_first_step_with_libcuda_mapped"] = mapped_at and mapped_at["name"]
        out["threads_started_by_step"] = {r["name"]: sorted({t["comm"] for t in r["new_threads"]})
                                          for r in lst if r["new_threads"]}
        out["threads_a_fork_would_miss_at_end"] = lst[-1]["threads_a_fork_would_miss"]
        out["cuda_at_end"] = lst[-1]["cuda"]
    end = next((r for r in results.get("probe", {}).get("records", []) if r.get("event") == "end"), None)
    if end is not None:
        out["probe_first_cuda_init"] = end["first_cuda_init"]
        out["probe_libcuda"] = end["libcuda"]
    lib = next((r for r in results.get("probe", {}).get("records", []) if r.get("event") == "libcuda mapped"), None)
    out["probe_libcuda_mapped_by"] = lib and {k: lib[k] for k in ("blame", "where", "innermost_code", "step")}
    out["passes"] = {k: {"rc": v["rc"], "timed_out": v["timed_out"]} for k, v in results.items()}
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--passes", default="list,probe")
    parser.add_argument("--modules", default=",".join(STEPS), help="comma-separated steps (mod, mod:attr, a|b)")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per pass")
    parser.add_argument("--no-stop-openblas", action="store_true",
                        help="list pass: leave OpenBLAS pools running (the warm interpreter stops them)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    steps = [s.strip() for s in args.modules.split(",") if s.strip()]
    if args.child == "list":
        list_pass(steps, stop_blas=not args.no_stop_openblas)
        return 0
    if args.child == "probe":
        probe_pass(steps)
        return 0
    results = {}
    for name in [p.strip() for p in args.passes.split(",") if p.strip()]:
        if name not in ("list", "probe"):
            parser.error(f"unknown pass {name!r}")
        rc, timed_out, records = run_pass(name, steps, args.timeout, not args.no_stop_openblas)
        results[name] = {"rc": rc, "timed_out": timed_out, "records": records}
    summary = summarize(results)
    emit(summary)
    return 0 if all(v["rc"] == 0 for v in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
