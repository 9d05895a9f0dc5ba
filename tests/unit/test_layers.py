"""Which side may import which: the server and its loaders never reach the client side.

Note [The loader is handed its references] in overmind.cold_loads: a loader gets the entries its
call refers to from the server, so neither it nor the server imports the user API or the
client's connection code. Each check runs in a fresh interpreter.
"""

from __future__ import annotations

import json

import pytest

from ..conftest import run_python

CLIENT_SIDE = {"overmind.api", "overmind.client", "overmind.patching", "overmind.prefetch", "overmind.cache"}

# What a loader imports to run a job (overmind.loader.run_job), besides the module itself.
LOADER_RUN = ["overmind.callstate", "overmind.quirks", "overmind.calls", "overmind.dedup", "overmind.reductions",
              "overmind.replay", "overmind.memfd"]


def _imported_by(modules: list[str]) -> set[str]:
    out = run_python(f"""
        import importlib, json, sys
        for name in {modules!r}:
            importlib.import_module(name)
        print(json.dumps(sorted(m for m in sys.modules if m.startswith("overmind"))))
    """)
    return set(json.loads(out.stdout.splitlines()[-1]))


@pytest.mark.parametrize("modules", [
    ["overmind.server"],
    ["overmind.loader", *LOADER_RUN],
    ["overmind.zygote"],
], ids=["server", "loader", "warm-interpreter"])
def test_server_side_modules_import_nothing_of_the_client_side(modules):
    reached = _imported_by(modules) & CLIENT_SIDE
    assert not reached, f"{modules[0]} imports {sorted(reached)}"
