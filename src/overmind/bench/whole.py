"""The whole-process scenario: a user's script run from the shell, start to ready model and to
first use of every weight, plain ``python`` against ``overmind run``.

    results = WholeProcess(plan, paths, server, log_dir).run()   # report.document() wraps it

What a user waits for is the process, not the load call: ``python script.py`` spends most of
its seconds importing torch, diffusers and transformers before any load starts. This scenario
writes small scripts into a temporary folder (:data:`SCRIPTS`: the ControlNet pipeline,
a Llama-style LM, and ``-c "import torch, diffusers, transformers"``) and times each as a fresh
process started from this one, in four modes (:data:`MODES`; the first run of a context
with the page cache warm only):

- ``plain``: ``python script.py``, no overmind at all;
- ``patched``: ``OVERMIND=1 python script.py``: the drop-in alone. The script calls
  ``monkey_patch_all()`` after its ``import os``, so the run is never handed to a warm
  interpreter (code ran first: Note [When a warm start applies] in overmind.client.warm_start),
  as with ``OVERMIND_WARM_START=0``; every load hits the (warm) cache. README's one line, handed
  over, is the warm-up curve's ``patched`` mode (overmind.bench.curve);
- ``run``: ``OVERMIND=1 overmind run script.py``: forked from the warm interpreter of its
  context, which learned the script's modules in warm-up runs; every load a hit;
- ``first_run``: ``overmind run`` in a context that has no warm interpreter yet (a fresh value
  of :data:`CONTEXT_VAR`, an environment variable that selects the interpreter): the server
  refuses the run, the front end executes plain python, and the server starts an interpreter
  for that context behind it. Its loads hit the cache (the cache is shared by contexts).

Each script prints a marker with ``time.monotonic()`` (one clock for every process of the
machine) when its model is ready (loaded and ``.to('cpu')``) and when it has read one byte of
every page of every weight (*used*); *exit* is when the process has exited and closed its
output, as the shell sees it. All three count from just before the process is started.

Note [Every run proves its mode]
A number is only worth its mode, so each run is checked against the server's counters and
the script's own pids, and a run that is not what its mode claims fails the script: a
``run`` was forked (the server's ``runs`` counter grew by one; the script's pid is not the
front end's), its loads were hits (``hits`` grew by the script's loads, no miss); a
``patched`` run hit too but was not forked; a ``plain`` run touched no cache; a ``first_run``
was refused (no fork: the front end became python itself) and made the server start an
interpreter for the new context. A fallback warning of overmind's on stderr also fails it.

Note [Warm-up fills both modes' keys]
A forked run's interpreter imported transformers before the script's ``monkey_patch_all()``;
a plain ``python`` imports it after. The two need not reach the cache through the same patched
call (transformers copies ``_BaseAutoModelClass.from_pretrained`` into each ``AutoModel*``
class as the class is made: made before the patch, ``AutoModelForCausalLM.from_pretrained``
is the original, and the cache sees the inner ``LlamaForCausalLM.from_pretrained`` call
instead), so their keys differ. The warm-up therefore runs both modes, each waiting for the
cache on a miss; the timed runs then check that every call hit (Note [Every run proves its
mode]).

Note [Quiet between runs]
After a run, the server may still be busy for seconds: a warm interpreter imports the modules
the run reported (Note [Warm interpreters learn] in overmind.warm.interpreter), a new context's
interpreter imports torch. On a small machine that work would compete with the next timed
process, so before each run the server's process tree must have used (almost) no CPU for a
second. The first run of a new context measures the opposite case on purpose: its
interpreter starts *during* that run, which is what a user's first ``overmind run`` meets.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from overmind.bench.harness import BenchServer, base_env, drop_page_cache
from overmind.bench.models import model_files

__all__ = ["SCRIPTS", "MODES", "CONTEXT_VAR", "Script", "WholeProcess", "front_end", "read_marks", "script_files",
           "script_source"]

MODES = ("plain", "patched", "run", "first_run")
MARK = "@overmind-bench-whole"
CONTEXT_VAR = "HF_BENCH_CONTEXT"  # in config.ENV_PREFIXES: a new value is a new context
RUN_TIMEOUT = 900.0
FALLBACK_MARK = "Warning: overmind:"


@dataclass(frozen=True)
class Script:
    name: str
    title: str
    models: tuple[str, ...]  # overmind.bench.models names
    loads: int  # cache calls one run makes (hits expected in the patched and run modes)
    modes: tuple[str, ...] = MODES
    code: str = ""  # a `-c` command instead of a script file

    def command(self, front: str) -> str:
        """The command as a user types it (``front``: ``python`` or ``overmind run``)."""
        return f"{front} -c {self.code!r}".replace("'", '"') if self.code else f"{front} {self.name}.py"


SCRIPTS: dict[str, Script] = {s.name: s for s in (
    Script("controlnet", "2 x ControlNetModel + AutoencoderKL + StableDiffusionControlNetPipeline("
           "vae=vae, controlnet=[depth, edge]), fp16, .to('cpu')", ("sd", "controlnet_a", "controlnet_b"), 4),
    Script("lm", "AutoModelForCausalLM.from_pretrained(..., bf16), Llama layout, .to('cpu')", ("lm",), 1),
    # No load: nothing for monkey_patch_all() to do, hence no patched mode.
    Script("imports", "the libraries alone", (), 0, ("plain", "run", "first_run"),
           code="import torch, diffusers, transformers"),
)}

_PRELUDE = '''\
import os
import time

if os.environ.get("OVERMIND") == "1":  # the bench's patched and run modes
    import overmind.api

    overmind.api.monkey_patch_all()


def mark(what, *more):
    print("{mark}", what, repr(time.monotonic()), os.getpid(), os.getppid(), *more, flush=True)


def touch(modules):
    """First use: read one byte of every page of every weight; (bytes, the sum of those read)."""
    seen, nbytes, total = set(), 0, 0
    for module in modules:
        for tensor in [*module.parameters(), *module.buffers()]:
            storage = tensor.untyped_storage()
            if storage.data_ptr() in seen or storage.nbytes() == 0:
                continue
            seen.add(storage.data_ptr())
            nbytes += storage.nbytes()
            raw = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
            total += (raw[::4096].sum() + raw[-1]).item()
    return nbytes, total


import torch
'''

_BODIES = {
    "controlnet": '''\
from diffusers import AutoencoderKL, ControlNetModel, StableDiffusionControlNetPipeline

SD, DEPTH, EDGE = {sd!r}, {controlnet_a!r}, {controlnet_b!r}
depth = ControlNetModel.from_pretrained(DEPTH, torch_dtype=torch.float16)
edge = ControlNetModel.from_pretrained(EDGE, torch_dtype=torch.float16)
vae = AutoencoderKL.from_pretrained(SD, subfolder="vae", torch_dtype=torch.float16)
pipe = StableDiffusionControlNetPipeline.from_pretrained(
    SD, vae=vae, controlnet=[depth, edge], torch_dtype=torch.float16, safety_checker=None)
pipe.to({device!r})
{sync}mark("ready")
mark("used", *touch(m for m in pipe.components.values() if isinstance(m, torch.nn.Module)))
''',
    "lm": '''\
from transformers import AutoModelForCausalLM

model = AutoModelForCausalLM.from_pretrained({lm!r}, {dtype_keyword}=torch.bfloat16)
model.to({device!r})
{sync}mark("ready")
mark("used", *touch([model]))
''',
}


def _dtype_keyword() -> str:
    # transformers 4.56 renamed torch_dtype to dtype (scenarios._dtype_keyword, without importing it).
    from importlib import metadata

    try:
        major, minor = (int(x) for x in metadata.version("transformers").split(".")[:2])
    except (metadata.PackageNotFoundError, ValueError):
        return "torch_dtype"
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"


def script_source(name: str, paths: dict, device: str = "cpu", imports: tuple = ()) -> str:
    """The text of a script that loads from ``paths`` (model name -> path) and moves the model
    to ``device`` (``overmind-bench --device``) before it is ready; ``imports`` (``--imports``):
    modules it imports right after torch, as a user's script imports its own libraries."""
    fields = {k: str(v) for k, v in paths.items()}
    sync = "torch.cuda.synchronize()\n" if device.startswith("cuda") else ""
    own = "".join(f"import {module}\n" for module in imports)
    return _PRELUDE.format(mark=MARK) + own + "\n" + _BODIES[name].format(dtype_keyword=_dtype_keyword(), device=device,
                                                                     sync=sync, **fields)


def front_end() -> list[str]:
    """``overmind run`` as this interpreter's venv has it."""
    front = Path(sys.executable).with_name("overmind")
    return [str(front), "run"] if front.exists() else [sys.executable, "-m", "overmind.frontend.run"]


def script_files(script: Script, paths: dict) -> list[Path]:
    """The model files ``script`` reads (``paths``: model name -> path)."""
    return sorted({f for name in script.models for f in model_files(paths[name])})


def read_marks(stdout: str, start: float) -> dict:
    """The script's markers: what -> (seconds since ``start``, pid, parent pid, [more fields])."""
    marks = {}
    for line in stdout.splitlines():
        at = line.find(MARK)
        try:
            what, t, pid, ppid, *more = line[at + len(MARK):].split() if at >= 0 else ()
            marks[what] = (float(t) - start, int(pid), int(ppid), more)
        except ValueError:  # not a line of ours (or cut short): the caller's checks say so
            continue
    return marks


def time_script(argv: list, env: dict, cwd: str) -> dict:
    """One run of a script of :data:`SCRIPTS` from the shell: seconds to its model ``ready`` and
    to its ``exit``, and its weights' checksum; RuntimeError, with its stderr, if it failed."""
    start = time.monotonic()
    proc = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=RUN_TIMEOUT)
    end = time.monotonic() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode}: {proc.stderr[-3000:]}")
    marks = read_marks(proc.stdout, start)
    return {"ready": marks["ready"][0], "exit": end, "weights": marks["used"][3][1]}


def _summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def _tree_cpu(pid: int) -> float:
    """CPU seconds used so far by ``pid`` and its descendants (the server, its interpreters)."""
    import psutil

    total = 0.0
    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    for proc in procs:
        try:
            times = proc.cpu_times()
            total += times.user + times.system
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return total


class WholeProcess:
    def __init__(self, plan, paths: dict, server: BenchServer, log_dir: Path, cwd: Optional[str] = None,
                 echo=None) -> None:
        self.plan, self.paths, self.server, self.log_dir = plan, paths, server, Path(log_dir)
        self.echo = echo or (lambda line: print(line, file=sys.stderr, flush=True))
        self.dir = Path(tempfile.mkdtemp(prefix="overmind-bench-scripts-", dir=cwd))
        self.python = sys.executable
        self.front = front_end()
        self.results: dict = {}
        self.counter = 0
        self._last: dict = {}

    # -- one run ---------------------------------------------------------------------------

    def argv(self, script: Script, mode: str) -> list[str]:
        front = [self.python] if mode in ("plain", "patched") else list(self.front)
        return [*front, "-c", script.code] if script.code else [*front, f"{script.name}.py"]

    def env(self, mode: str) -> dict:
        env = base_env({"OVERMIND_RUNTIME_DIR": str(self.server.runtime_dir), "OVERMIND_NO_AUTOSTART": "1"})
        env.pop(CONTEXT_VAR, None)
        if mode != "plain":
            env["OVERMIND"] = "1"
        if mode == "first_run":
            env[CONTEXT_VAR] = uuid.uuid4().hex  # Note [Every run proves its mode]
        return env

    def files(self, script: Script) -> list[Path]:
        return script_files(script, self.paths)

    def once(self, script: Script, mode: str, label: str, env: Optional[dict] = None,
             argv: Optional[list] = None) -> dict:
        """Start one fresh process from here and time it; its checks (Note [Every run proves its
        mode]) are in ``problems``."""
        self.wait_quiet()
        before = self.server.status()
        contexts = {z.get("context") for z in before.get("interpreters") or []}
        argv = argv or self.argv(script, mode)
        start = time.monotonic()
        proc = subprocess.Popen(argv, cwd=self.dir, env=env or self.env(mode), stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = proc.communicate(timeout=RUN_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        wall = time.monotonic() - start
        after = self.server.status()
        self.counter += 1
        log = self.log_dir / f"whole-{self.counter:03d}-{label}.log"
        log.write_text(f"$ {' '.join(argv)}\n--- stdout\n{out}\n--- stderr\n{err}")
        marks = read_marks(out, start)
        run = {"status": proc.returncode, "ready": marks["ready"][0] if "ready" in marks else None,
               "used": marks["used"][0] if "used" in marks else None, "wall": wall,
               "forked": after["runs"] - before["runs"] == 1,
               "hits": after["hits"] - before["hits"], "misses": after["misses"] - before["misses"],
               "plain_loads": after.get("plain_loads", 0) - before.get("plain_loads", 0)}
        nbytes = int(marks["used"][3][0]) if "used" in marks and marks["used"][3] else None
        problems = []
        if proc.returncode != 0:
            problems.append(f"exited with status {proc.returncode}")
        if not script.code and set(marks) != {"ready", "used"}:
            problems.append(f"printed markers {sorted(marks)}, not ready and used")
        own = [m[1] == proc.pid for m in marks.values()]  # the script is the process we started
        forks = after["runs"] - before["runs"]
        if mode == "run":
            if forks != 1 or not all(not o for o in own):
                problems.append(f"was not forked from a warm interpreter ({forks} runs forked; pid "
                                f"{[m[1] for m in marks.values()]}, the front end's {proc.pid})")
        elif forks != 0 or not all(own):
            problems.append(f"{mode} run was forked ({forks} runs forked)")
        want = 0 if mode == "plain" else script.loads
        if (run["hits"], run["misses"], run["plain_loads"]) != (want, 0, 0):
            problems.append(f"{run['hits']} hits, {run['misses']} misses and {run['plain_loads']} plain loads, "
                            f"not {want}, 0 and 0")
        if mode == "first_run" and not {z.get("context") for z in after.get("interpreters") or []} - contexts:
            problems.append("the server started no interpreter for the new context")
        if mode != "plain" and FALLBACK_MARK in err:
            problems.append(next(ln for ln in err.splitlines() if FALLBACK_MARK in ln).strip())
        if problems:
            problems.append(f"log: {log}\n{err[-3000:]}")
        return {"run": run, "tensor_bytes": nbytes, "problems": problems}

    def wait_quiet(self, quiet_s: float = 0.6, share: float = 0.03, timeout: float = 300.0) -> None:
        """Note [Quiet between runs]: at most ``share`` of a core used by the server's process
        tree over ``quiet_s``, with no load in flight and every interpreter ready."""
        deadline = time.monotonic() + timeout
        step = quiet_s / 4
        calm, last = 0, _tree_cpu(self.server.pid)
        while time.monotonic() < deadline:
            time.sleep(step)
            now = _tree_cpu(self.server.pid)
            calm = calm + 1 if now - last <= share * step else 0
            last = now
            if calm >= 4:
                status = self.server.status()
                interpreters = status.get("interpreters") or []
                if status.get("loading", 0) == 0 and all(z.get("ready") for z in interpreters):
                    return
                calm = 0
        self.echo(f"whole process: the server was still busy after {timeout:.0f} s; timing anyway")

    # -- the plan ----------------------------------------------------------------------------

    def _entry(self, script: Script) -> dict:
        if script.name not in self.results:
            self.results[script.name] = {"script": script, "runs": {}, "status": "ok", "reason": None,
                                         "tensor_bytes": None,
                                         "file_bytes": sum(p.stat().st_size for p in self.files(script)),
                                         "command": script.command("python")}
        return self.results[script.name]

    def _fail(self, script: Script, reason: str) -> None:
        entry = self._entry(script)
        if entry["status"] == "ok":
            entry["status"], entry["reason"] = "failed", reason
            self.echo(f"whole process {script.name}: FAILED: {reason.splitlines()[0]}")

    def warm_up(self, script: Script) -> None:
        """Let the interpreter learn the script's modules: ``overmind run`` until
        ``plan.whole_warmup`` runs were forked (at most twice as many runs); then one patched
        ``python`` run. Misses wait for the cache (``OVERMIND_COLD=wait``), so both modes find
        it warm: they need not make the same calls (Note [Warm-up fills both modes' keys])."""
        forked, attempt = 0, 0
        while forked < self.plan.whole_warmup and attempt < 2 * self.plan.whole_warmup:
            attempt += 1
            if not self._warm_up_once(script, "run", attempt):
                return
            forked += self._last["forked"]
        if "patched" in self.plan.whole_modes and "patched" in script.modes:
            self._warm_up_once(script, "patched", attempt + 1)

    def _warm_up_once(self, script: Script, mode: str, attempt: int) -> bool:
        env = {**self.env(mode), "OVERMIND_COLD": "wait"}
        done = self.once(script, mode, f"{script.name}-warmup-{attempt}-{mode}", env=env)
        self._last = done["run"]
        if done["run"]["status"] != 0 or (done["run"]["used"] is None and not script.code):
            self._fail(script, "warm-up run failed: " + "; ".join(done["problems"]))
            return False
        self.echo(f"whole process {script.name:<10} warm-up {attempt} ({mode}): exit {done['run']['wall']:.2f} s"
                  f"{' (not forked)' if mode == 'run' and not done['run']['forked'] else ''}")
        return True

    def run(self) -> dict:
        plan = self.plan
        scripts = [SCRIPTS[n] for n in plan.whole_scripts]
        for script in scripts:
            if not script.code:
                (self.dir / f"{script.name}.py").write_text(
                    script_source(script.name, {n: self.paths[n] for n in script.models}, plan.device,
                                  plan.script_imports))
        # The context's interpreter starts now (the first run of a context goes plain).
        self.once(SCRIPTS["imports"], "run", "start-interpreter", argv=[*self.front, "-c", "pass"])
        for script in scripts:
            self._entry(script)
            self.warm_up(script)
        for cache_state in plan.page_cache:
            for script in scripts:
                if cache_state == "cold" and not script.models:
                    continue  # it reads no model file: the same as page cache warm
                if cache_state == "warm":
                    _read_files(self.files(script))
                # The first run of a context is a plain run beside an interpreter's start: with
                # the model's files evicted it is plain's cold run plus that; timed warm only.
                modes = [m for m in plan.whole_modes if m in script.modes
                         and not (cache_state == "cold" and m == "first_run")]
                # Note [Rounds interleave the modes] in overmind.bench.runner
                for round_ in range(plan.whole_runs):
                    for mode in modes:
                        if self._entry(script)["status"] != "ok":
                            break
                        self._time(script, mode, cache_state, round_)
        return {"scripts": self.results, "dir": str(self.dir)}

    def _time(self, script: Script, mode: str, cache_state: str, round_: int) -> None:
        if cache_state == "cold":
            drop_page_cache(self.files(script))
        done = self.once(script, mode, f"{script.name}-{mode}-pagecache-{cache_state}-{round_ + 1}")
        entry = self._entry(script)
        if done["problems"]:
            self._fail(script, f"{mode} run, page cache {cache_state}: " + "; ".join(done["problems"]))
            return
        entry["tensor_bytes"] = done["tensor_bytes"] or entry["tensor_bytes"]
        entry["runs"].setdefault((mode, cache_state), []).append(
            {k: done["run"][k] for k in ("ready", "used", "wall", "forked", "hits", "misses", "plain_loads")})
        r = done["run"]
        times = ", ".join(f"{k} {r[k]:.2f} s" for k in ("ready", "used", "wall") if r[k] is not None)
        self.echo(f"whole process {script.name:<10} {mode:<9} page cache {cache_state:<4} run {round_ + 1}: {times}")

    def close(self) -> None:
        import shutil

        shutil.rmtree(self.dir, ignore_errors=True)


def _read_files(files: list[Path]) -> None:
    for path in files:
        with open(path, "rb") as f:
            while f.read(1 << 24):
                pass


def summarize(results: dict, plan) -> list[dict]:
    """The ``whole_process.scripts`` list of the JSON document (schema in overmind.bench.report)."""
    out = []
    for name in plan.whole_scripts:
        entry = results["scripts"].get(name)
        script = SCRIPTS[name]
        item = {"name": name, "title": script.title, "command": script.command("python"),
                "run_command": script.command("overmind run"), "models": list(script.models),
                "loads": script.loads, "tensor_bytes": None, "file_bytes": 0, "status": "ok", "reason": None,
                "results": []}
        if entry is None:
            item.update(status="skipped", reason="not run")
            out.append(item)
            continue
        item.update(status=entry["status"], reason=entry["reason"], tensor_bytes=entry["tensor_bytes"],
                    file_bytes=entry["file_bytes"])
        for (mode, cache_state), runs in entry["runs"].items():
            summary = {k: (_summary([r[k] for r in runs]) if all(r[k] is not None for r in runs) else None)
                       for k in ("ready", "used", "wall")}
            item["results"].append({"mode": mode, "page_cache": cache_state, "runs": runs, "summary": summary,
                                    "x_plain": {"ready": None, "used": None, "wall": None}})
        order = {m: i for i, m in enumerate(MODES)}
        item["results"].sort(key=lambda r: (("warm", "cold").index(r["page_cache"]), order[r["mode"]]))
        for r in item["results"]:
            base = next((b for b in item["results"] if b["mode"] == "plain" and b["page_cache"] == r["page_cache"]),
                        None)
            for k in ("ready", "used", "wall"):
                if base is not None and r["summary"][k] and base["summary"][k]:
                    r["x_plain"][k] = r["summary"][k]["median"] / base["summary"][k]["median"]
        out.append(item)
    return out
