"""overmind-bench: plain vs overmind model loads, cold and warm, memory and start-up.

The command (``overmind-bench``, ``python -m overmind.bench``) is :func:`main`, which hands
``argv`` to overmind.bench.cli: its docstring is ``overmind-bench --help`` (the scenarios,
their modes, the models and the exit status); a scenario's own module says how it measures.
"""

from __future__ import annotations

from typing import Optional

__all__ = ["main"]


def main(argv: Optional[list] = None) -> int:
    from overmind.bench.cli import main as cli_main

    return cli_main(argv)
