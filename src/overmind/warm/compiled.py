"""Compiled code in a warm interpreter: Inductor's per-process probes, made once before forking,
and the check that nothing a fork breaks was started. Runs in the warm interpreter
(overmind.warm.interpreter) only::

    if runs_made_the_probes and compiled.compile_stack_held():
        priming = compiled.Priming()               # once; then, between forks, until .done:
        priming.step(reads)                        # one probe; .files: what the answers depend on

Note [Inductor's probes, made once]
A ``torch.compile`` script whose kernels are all in Inductor's on-disk caches still spends
about a second of every process asking the machine what it already told the last one, each
answer kept only for the process (``functools.cache``): which vector ISAs work (six
subprocesses that ``dlopen`` a test library, ~0.14 s each: a fresh ``python`` plus
``libtorch_cpu``, and ``subprocess``'s polling wait), a hash of torch's source (~0.13 s), the
compiler's path and version (``g++ --version``, ``g++ -v``), and the precompiled header's
check (``g++ -E`` of ``cpp_prefix.h`` and ``openssl sha512`` of the result, ~0.2 s). A warm
interpreter whose context's runs made those probes themselves (they compiled, or loaded an
AOTInductor package: the mark ``overmind.shared.calls.compiled.USED`` in their module reports;
importing ``torch._inductor`` says nothing, ``transformers`` does it) asks once, after its
imports, so every child it forks starts with the answers; an AOTInductor package's load asks
the same ISA question. Nothing here runs a kernel or leaves a thread running (Note [No
thread pool before a fork]; the ISA probes' threads are gone before it goes on: Note [The ISA
probes at once]): the probes are subprocesses, file reads and hashes. The answers are what a plain process would compute now, as long as their inputs stay:
- settings read from the environment (``CXX``, ``PATH``, ``TORCHINDUCTOR_CACHE_DIR``,
  ``TMPDIR``, ``ATEN_CPU_CAPABILITY``...) are recorded while priming, as while importing, so a
  run whose values differ is not forked from this interpreter (Note [Settings an import read]
  in overmind.shared.settings.import_env);
- the compiler binary and the header behind the precompiled one are files the interpreter
  checks before each fork, as it checks its modules (Note [Warm interpreters] in
  overmind.warm.interpreter): a compiler or torch upgrade retires it;
- Inductor's settings (``torch._inductor.config``) changed by the script itself are seen: only
  answers cached per the setting they depend on are kept (each ISA's probe per
  ``config.cpp.vec_isa_ok``, the compiler per ``config.cpp.cxx``, the header per command line);
  ``valid_vec_isa_list()`` and the AVX512/AMX classes' own ``__bool__``, cached whatever the
  setting was at their first call, are dropped in every child (:func:`forget_isa_list`), so a
  run that sets ``vec_isa_ok`` first sees no ISA, as plain does (their extra bf16/AMX probes,
  on CPUs that have those, are made again in each run).
The header is primed for the command line of a CPU kernel with the best ISA (what Inductor
compiles for a plain ``torch.compile`` on CPU); any other command line is a miss that costs
the run what plain pays. Replicating that command line reaches into Inductor's internals:
a torch whose internals moved makes priming fail (logged), never the run.

Note [The ISA probes at once]
Each vector ISA's probe (``VecISA.__bool__``: compile and ``dlopen`` a test library, a fresh
``python`` for each ``dlopen``), as ``valid_vec_isa_list()`` makes them on x86, but not that list
itself: it is cached whatever ``config.cpp.vec_isa_ok`` was at its first call, and a script may
set that first. They wait on subprocesses, one after another in Inductor (1.39 s for the three
of this machine, measured by hand), so the warm interpreter makes them at once, a thread each,
joined, and waits until the kernel no longer lists those threads before it goes on (a fork
checks for threads: Note [No thread pool before a fork]). It does so as the first step of
priming and before preloading an AOTInductor package, whose load makes the same probes: that
load is what the second ``overmind run`` of an AOTInductor script waits for when it comes
right after the first. The answers cached whatever the setting are dropped in each child
(:func:`forget_isa_list`, from ``_in_child`` in overmind.warm.interpreter), not in the
interpreter: dropped there after the package's load, the header's step made the classes' own
checks again, a step of 0.46-1.0 s that the next run's fork waited for.

Note [Priming waits for a pause]
A step of priming cannot be cut short, and a fork that comes meanwhile waits for it (up to
0.27 s for the header's check). Runs come back to back, and the server's messages say when:
a run's report of its modules (``Warm``) comes as it exits, the next run's ``Fork`` a tenth of
a second later. So a step starts only after PRIME_AFTER_QUIET (0.5 s) without a message,
inside a run rather than between two. An AOTInductor script's runs (0.2-0.4 s each, their
package handed over: they need no probe) may then leave priming for later; a
``torch.compile`` run lasts long enough for the steps to go on beside it. Before, run 2 of
the AOTInductor script came as run 1's report set priming off and waited for a step: 0.45-0.72 s
(``overmind-bench --scenarios compiled``, several sessions' tries).

Note [No thread pool before a fork]
A fork copies only the calling thread. OpenMP's pool (torch's intra-op parallelism on CPU)
and at::launch's inter-op pool are started by the first kernel large enough to run in
parallel, and neither survives a fork: a child of a parent that ran a model once waits in its
first parallel region for threads that do not exist, for ever (3 of 3 children hung when
tried; ``OMP_NUM_THREADS=1`` in the parent avoided it). So a warm interpreter never
runs a kernel (it imports, primes probes and loads AOTInductor packages without calling them:
overmind.warm.compiled), and before each fork the thread census (Note [Threads libraries start] in
overmind.warm.fork_safety) finds any thread started since it was ready that no fork handler
stops: such a pool makes the interpreter refuse to fork (``NOT_FORKABLE``). A refusal is never
a hang. Threads are the check because neither OpenMP nor ATen says whether its pool was
started; ``torch.get_num_threads()`` only reports the size it would have.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import threading
import time

from overmind.shared.calls.compiled import fingerprint, forget, held, hold, refusal_name, spec_key
from overmind.warm.fork_safety import started_since, thread_ids

logger = logging.getLogger(__name__)

__all__ = ["compile_stack_held", "Priming", "prime_inductor", "forget_isa_list", "PRIMING", "preload", "preload_warm"]

COMPILE_STACK = "torch._inductor"
# The name a failed or thread-starting priming is refused under (Note [Threads libraries start]
# in overmind.warm.fork_safety): the server hands it to the context's next interpreter, which
# then does not prime.
PRIMING = "overmind.warm.compiled:prime_inductor"

_primed = False


def compile_stack_held() -> bool:
    """Whether this interpreter imported the compile stack (its context's runs did)."""
    return COMPILE_STACK in sys.modules


class Priming:
    """Note [Inductor's probes, made once], one probe a step: the warm interpreter makes a step
    between forks, so a run waiting for its fork goes first (as learned imports do: Note [Warm
    interpreters learn] in overmind.warm.interpreter) and makes whatever probe is left itself."""

    def __init__(self) -> None:
        self.steps: list | None = None  # None: not planned yet
        self.files: list[str] = []  # what the answers depend on: checked before each fork
        self.refuse = False  # it failed or started a thread: the context's next interpreters do not prime
        self.started = time.monotonic()

    @property
    def done(self) -> bool:
        return self.steps == []

    def step(self, reads) -> None:
        """One probe, the settings it reads recorded into ``reads`` (Note [Settings an import
        read] in overmind.shared.settings.import_env). Never raises."""
        from overmind.shared.settings.import_env import recording

        before = thread_ids()
        try:
            with recording(reads):
                if self.steps is None:
                    self.steps = self._plan()
                elif self.steps:
                    self.steps.pop(0)()
        except Exception as err:  # noqa: BLE001 - priming is a head start; the run asks itself
            logger.warning("priming Inductor's probes failed (runs will make them): %r", err)
            self.steps, self.refuse = [], True
        if started_since(before):
            logger.warning("priming Inductor's probes started a thread: this interpreter will not fork again")
            self.steps, self.refuse = [], True
        if self.done and not self.refuse:
            logger.info("primed Inductor's probes in %.2f s", time.monotonic() - self.started)

    def run(self, reads) -> None:
        while not self.done:
            self.step(reads)

    def _plan(self) -> list:
        from torch._inductor import codecache, config, cpp_builder

        candidates = _isa_candidates()

        def compiler() -> None:
            name = cpp_builder.get_cpp_compiler()
            cpp_builder.get_compiler_version_info(name)
            binary = shutil.which(name)
            if binary:
                self.files.append(os.path.realpath(binary))

        def header() -> None:
            valid = [isa for isa in candidates if isa]  # answered by the steps before
            if config.cpp_cache_precompile_headers and valid:
                self.files.extend(_prime_header(codecache, config, cpp_builder, valid[0]))

        return [probe_vector_isas, codecache.torch_key, compiler, header]


def _isa_candidates() -> list:
    """The vector ISAs valid_vec_isa_list() would probe on this machine (x86 only: elsewhere it
    probes none)."""
    import platform

    from torch._inductor import cpu_vec_isa

    if platform.machine() not in ("x86_64", "AMD64"):
        return []
    flags = cpu_vec_isa.x86_isa_checker()
    return [i for i in cpu_vec_isa.supported_vec_isa_list if all(f in flags for f in str(i).split())]


def probe_vector_isas() -> None:
    """Note [The ISA probes at once]. Raises what a probe raised."""
    candidates = _isa_candidates()
    failures: list = []

    def probe(isa) -> None:
        try:
            bool(isa)
        except BaseException as err:  # noqa: BLE001 - raised below, in the calling thread
            failures.append(err)

    threads = [threading.Thread(target=probe, args=(isa,), name="overmind-isa-probe") for isa in candidates]
    for thread in threads:
        thread.start()
    ids = {str(thread.native_id) for thread in threads}
    for thread in threads:
        thread.join()
    deadline = time.monotonic() + 5.0
    while ids & thread_ids() and time.monotonic() < deadline:
        time.sleep(0.001)  # joined, but the kernel may list an exiting thread a moment longer
    if failures:
        raise failures[0]


def prime_inductor(reads=None) -> Priming:
    """Every probe now (Note [Inductor's probes, made once]); the warm interpreter steps instead."""
    from overmind.shared.settings.import_env import Reads

    priming = Priming()
    priming.run(reads if reads is not None else Reads())
    return priming


def forget_isa_list() -> None:
    """Drop the ISA answers cached whatever ``config.cpp.vec_isa_ok`` is: ``valid_vec_isa_list()``
    and the ``__bool__`` of ISA classes that cache it per instance only (AVX512, AMX: their own
    extra checks), so a run that sets ``vec_isa_ok`` before its first compile sees what plain
    would. The probe each relies on stays, cached per that setting (``VecISA.__bool__impl``;
    Note [Inductor's probes, made once])."""
    cpu_vec_isa = sys.modules.get("torch._inductor.cpu_vec_isa")
    if cpu_vec_isa is None:
        return
    if hasattr(cpu_vec_isa.valid_vec_isa_list, "cache_clear"):
        cpu_vec_isa.valid_vec_isa_list.cache_clear()
    todo = [cpu_vec_isa.VecISA]
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        own = cls.__dict__.get("__bool__")
        if hasattr(own, "cache_clear"):
            own.cache_clear()


def _prime_header(codecache, config, cpp_builder, isa) -> list[str]:
    """The precompiled header's check, for the command line of a CPU kernel's Python binding
    (CppPythonBindingsCodeCache.load_async: main code with the vector ISA, not min-optimized)."""
    cls = codecache.CppPythonBindingsCodeCache
    header = cls._get_uncompiled_header("cpu")
    if not header:
        return []
    command = {**cls.cpp_compile_command_flags, "device_type": "cpu", "extra_flags": (),
               "use_relative_path": config.is_fbcode(), "vec_isa": isa}
    option = cpp_builder.CppTorchDeviceOptions(compile_only=False, min_optimize=False, **command)
    command_line = cpp_builder.CppBuilder(name="o", sources="i", BuildOption=option).get_command_line()
    codecache._precompile_header(header, command_line, min_optimize=False, **command)
    import torch

    source = os.path.join(os.path.dirname(torch.__file__), "include", header)
    return [source] if os.path.exists(source) else []


# -- AOTInductor packages loaded, never run: Note [AOTInductor packages are handed over] in
# overmind.shared.calls.compiled; refused = preload_warm(spec, reads, refused) ----------------------

_failed: set = set()  # (spec_key, fingerprint) that raised when preloaded


def _cpu_package(path: str, kwargs: dict) -> bool:
    """Whether every model of the package runs on the CPU, from its metadata: loading a CUDA one
    would initialise CUDA in the warm interpreter."""
    import json
    import zipfile

    try:
        with zipfile.ZipFile(path) as archive:
            devices = [json.loads(archive.read(name)).get("AOTI_DEVICE_KEY") for name in archive.namelist()
                       if "/data/aotinductor/" in name and name.endswith("_metadata.json")]
    except (OSError, ValueError, zipfile.BadZipFile, KeyError):
        return False
    return bool(devices) and all(d == "cpu" for d in devices)


def _resolve(point: str):
    import importlib

    module, _, name = point.partition("::")
    return getattr(importlib.import_module(module), name)


def preload(spec: dict) -> str:
    """Load the package of ``spec`` here, without running it; "" or why not. In a warm
    interpreter only (it never patches, so the attribute is the original)."""
    key = spec_key(spec)
    found = fingerprint(spec["path"])
    if found is None:
        return "missing, unreadable or just written"
    holding = held(spec)
    if holding is not None and holding[1] == found:
        return ""
    if spec["point"] == "torch._inductor::aoti_load_package" and not _cpu_package(spec["path"], spec["kwargs"]):
        return "not a CPU package"
    attempt = (key, found)
    if attempt in _failed:
        return "it failed to load before"
    forget(spec)  # a changed file: its old runner goes
    _failed.add(attempt)  # until it loads: a package that raises is not tried again each run
    probe_vector_isas()  # what the load asks first, at once: Note [The ISA probes at once]
    runner = _resolve(spec["point"])(spec["path"], **spec["kwargs"])
    _failed.discard(attempt)
    if fingerprint(spec["path"]) != found:
        return "changed while it loaded"
    hold(spec, runner, found)
    return ""


def preload_warm(spec: dict, reads, refused) -> list[str]:
    """:func:`preload` in a warm interpreter, the settings it reads recorded into ``reads``
    (Note [Settings an import read] in overmind.shared.settings.import_env); the names to refuse: the
    package's, if loading it started a thread nobody vouches for (Note [Threads libraries start]
    in overmind.warm.fork_safety)."""
    from overmind.shared.settings.import_env import recording

    name = refusal_name(spec)
    if name in refused:
        return []
    before = thread_ids()
    try:
        with recording(reads):
            why = preload(spec)
    except Exception as err:  # noqa: BLE001 - the run's call loads it plainly
        why = repr(err)
    if why:
        logger.info("not preloading %s: %s", spec["path"], why)
    else:
        logger.info("preloaded %s", spec["path"])
    if started_since(before):
        logger.warning("loading %s started a thread: this interpreter will not fork again", spec["path"])
        return [name]
    return []


