"""Compiled code in a warm interpreter: Inductor's per-process probes, made once before forking,
and the check that nothing a fork breaks was started. Runs in the warm interpreter
(overmind.zygote) only::

    if compiled.compile_stack_held():
        files, error = compiled.prime_inductor()   # once; ``files``: what the answers depend on
    why = compiled.pool_started(threads_when_ready)  # "" or why a child forked now would hang

Note [Inductor's probes, made once]
A ``torch.compile`` script whose kernels are all in Inductor's on-disk caches still spends
about a second of every process asking the machine what it already told the last one, each
answer kept only for the process (``functools.cache``): which vector ISAs work (six
subprocesses that ``dlopen`` a test library, ~0.14 s each: a fresh ``python`` plus
``libtorch_cpu``, and ``subprocess``'s polling wait), a hash of torch's source (~0.13 s), the
compiler's path and version (``g++ --version``, ``g++ -v``), and the precompiled header's
check (``g++ -E`` of ``cpp_prefix.h`` and ``openssl sha512`` of the result, ~0.2 s). A warm
interpreter whose context learned the compile stack (its runs imported ``torch._inductor``)
asks once, after its imports, so every child it forks starts with the answers; an
AOTInductor package's load asks the same ISA question. Nothing here runs a kernel or starts a
thread (Note [No thread pool before a fork]): the probes are subprocesses, file reads and
hashes. The answers are what a plain process would compute now, as long as their inputs stay:
- settings read from the environment (``CXX``, ``PATH``, ``TORCHINDUCTOR_CACHE_DIR``,
  ``TMPDIR``, ``ATEN_CPU_CAPABILITY``...) are recorded while priming, as while importing, so a
  run whose values differ is not forked from this interpreter (Note [Settings an import read]
  in overmind.import_env);
- the compiler binary and the header behind the precompiled one are files the interpreter
  checks before each fork, as it checks its modules (Note [Warm interpreters] in
  overmind.zygote): a compiler or torch upgrade retires it;
- Inductor's settings (``torch._inductor.config``) changed by the script itself are seen: the
  ISA answer is cached per ``config.cpp.vec_isa_ok``, the header per command line, so a run
  with other flags asks again, as plain would.
The header is primed for the command line of a CPU kernel with the best ISA (what Inductor
compiles for a plain ``torch.compile`` on CPU); any other command line is a miss that costs
the run what plain pays. Replicating that command line reaches into Inductor's internals:
a torch whose internals moved makes priming fail (logged), never the run.

Note [No thread pool before a fork]
A fork copies only the calling thread. OpenMP's pool (torch's intra-op parallelism on CPU)
and at::launch's inter-op pool are started by the first kernel large enough to run in
parallel, and neither survives a fork: a child of a parent that ran a model once waits in its
first parallel region for threads that do not exist, for ever (3 of 3 children hung in
issue 24's test; ``OMP_NUM_THREADS=1`` in the parent avoided it). So a warm interpreter never
runs a kernel (it imports, primes probes and loads AOTInductor packages without calling them:
overmind.aoti), and before each fork :func:`pool_started` counts the native threads against
those it had when ready: one more means something started a pool (or any thread), and the
interpreter refuses to fork (``NOT_FORKABLE``); the run goes plain with a log line saying
why, and the server starts a fresh interpreter without the module that did it. A refusal is
never a hang. Thread counting is the check because neither OpenMP nor ATen says whether its
pool was started; ``torch.get_num_threads()`` only reports the size it would have.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import threading
import time

logger = logging.getLogger(__name__)

__all__ = ["compile_stack_held", "prime_inductor", "prime_warm", "pool_started", "native_threads", "PRIMING"]

COMPILE_STACK = "torch._inductor"
# The name a failed or thread-starting priming is refused under (Note [Forking past torch's
# thread] in overmind.zygote): the server hands it to the context's next interpreter, which
# then does not prime.
PRIMING = "overmind.compiled:prime_inductor"

_primed = False


def native_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def compile_stack_held() -> bool:
    """Whether this interpreter imported the compile stack (its context's runs did)."""
    return COMPILE_STACK in sys.modules


def pool_started(threads_when_ready: int) -> str:
    """Why forking now would leave the child a thread pool it cannot use, or "" (Note [No
    thread pool before a fork])."""
    if threading.active_count() != 1:
        return (f"{threading.active_count()} Python threads (Note [Forking past torch's thread] in "
                "overmind.zygote)")
    now = native_threads()
    if threads_when_ready and now > threads_when_ready:
        return (f"{now} native threads, {threads_when_ready} when ready: a thread pool (OpenMP / intra-op) "
                "or another thread was started here, and a child forked past it would hang in its first "
                "parallel kernel (Note [No thread pool before a fork] in overmind.compiled)")
    return ""


def prime_warm(reads) -> tuple[list[str], bool]:
    """:func:`prime_inductor` in a warm interpreter, the settings it reads recorded into
    ``reads`` (Note [Settings an import read] in overmind.import_env): (the files its answers
    depend on, whether to refuse priming in this context: it failed, or started a thread)."""
    from overmind.import_env import recording

    before = native_threads()
    with recording(reads):
        files, error = prime_inductor()
    started = native_threads() != before
    if started:
        logger.warning("priming Inductor's probes started a thread: this interpreter will not fork again")
    return files, bool(error) or started


def prime_inductor() -> tuple[list[str], str]:
    """Note [Inductor's probes, made once]: ask Inductor's per-process questions now. Returns
    (the files the answers depend on, "" or why priming failed). Idempotent; never raises."""
    global _primed
    if _primed:
        return [], ""
    _primed = True
    started = time.monotonic()
    files: list[str] = []
    try:
        from torch._inductor import codecache, config, cpp_builder, cpu_vec_isa

        isa = cpu_vec_isa.pick_vec_isa()  # valid_vec_isa_list(): the dlopen probes
        codecache.torch_key()
        compiler = cpp_builder.get_cpp_compiler()
        cpp_builder.get_compiler_version_info(compiler)
        binary = shutil.which(compiler)
        if binary:
            files.append(os.path.realpath(binary))
        if config.cpp_cache_precompile_headers and isa:
            files += _prime_header(codecache, config, cpp_builder, isa)
    except Exception as err:  # noqa: BLE001 - priming is a head start; the run asks itself
        logger.warning("priming Inductor's probes failed (runs will make them): %r", err)
        return files, repr(err)
    logger.info("primed Inductor's probes in %.2f s", time.monotonic() - started)
    return files, ""


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
