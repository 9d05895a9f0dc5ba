"""overmind-bench: plain vs overmind model loads, cold and warm, memory and start-up.

    overmind-bench --quick                        # a small version of everything, about a minute
    overmind-bench --json bench.json --plot bench.png          # SD1.5 sizes and a 1.1 B LM
    overmind-bench --loader diffusers:DiffusionPipeline --model PATH_OR_ID --dtype float16
    python -m overmind.bench ...                  # the same

Models are generated on this machine with random weights (no hub access) into a reusable
cache folder (``--cache-dir``, default ``~/.cache/overmind-bench``). Scenarios:

- ``whole_process``: what a user waits for: a script started from the shell, to its model
  ready and to first use of every weight, as ``python script.py``, ``python script.py`` with
  ``monkey_patch_all()`` (cache warm), ``overmind run script.py`` (cache and interpreter warm)
  and the first ``overmind run`` of a new context (:mod:`overmind.bench.whole`);
- ``controlnet``: a ControlNet workload: AutoencoderKL, two ControlNetModels and
  StableDiffusionControlNetPipeline(vae=vae, controlnet=[edge, depth]), fp16 safetensors;
- ``lm``: a Llama-style causal LM in bf16 (1.1 B parameters at the default scale);
- ``fp32_as_fp16``: a UNet saved in fp32 and loaded with ``torch_dtype=torch.float16``;
- ``pickle_bin``: the LM as a ``pytorch_model.bin``;
- ``single_file``: ``StableDiffusionPipeline.from_single_file`` of one original-layout file;
- ``custom``: your ``--loader`` and ``--model``;
- ``memory``: K processes hold a model, plain vs overmind: summed PSS and used memory;
- ``startup``: what ``import overmind.api; monkey_patch_all()`` adds to an interpreter.
- ``compiled`` and ``restart``, each alone (their own runners): a ``torch.compile`` and an
  AOTInductor script under ``overmind run`` (:mod:`overmind.bench.compiled`), and how warm a
  restarted server is, and how much its restore slows a client (:mod:`overmind.bench.restart`).

Each load of the load scenarios runs in a fresh process in three modes: plain
(``OVERMIND_DISABLE=1``), overmind cold (after evicting the cache) and overmind warm; with
``--drop-page-cache`` each mode (of every scenario) runs again with the model's files evicted
from the page cache. Every call is timed, then ``.to(device)``, then the first use of every
weight. The bench starts its own
overmind-server in a private runtime directory and stops it at the end: it never touches
your server or its cache. The table and JSON say which
``/sys/kernel/mm/transparent_hugepage/shmem_enabled`` value the loads ran under (``advise``
lets overmind back its segments with huge pages, which makes the first use of a warm model
cheap); as root, ``--shmem-enabled never,advise`` runs the load scenarios under each value
in turn and restores the original afterwards. ``--json FILE`` writes every figure (schema:
:mod:`overmind.bench.report`); ``--plot FILE.png`` draws them (needs matplotlib:
``pip install 'overmind[bench]'``).

Exit status: 0 done (skipped scenarios say why); 1 a scenario failed (its worker logs are
kept and named); 2 bad usage.
"""

from __future__ import annotations

from typing import Optional

__all__ = ["main"]


def main(argv: Optional[list] = None) -> int:
    from overmind.bench.cli import main as cli_main

    return cli_main(argv)
