"""Which side may import which. The folders of ``src/overmind`` are the processes: ``client`` (with
``api``, the user's process), ``server``, ``warm`` (warm interpreters and their loaders),
``frontend`` (the commands), and ``shared``, which every side imports and which imports no side.
No side imports another side's modules; the warm interpreter may import ``overmind.api``, the
public face its runs will use.

Note [The loader is handed its references] in overmind.server.cold_loads: a loader gets the entries
its call refers to from the server, so neither it nor the server imports the user API or the
client's connection code. The runtime checks run in a fresh interpreter; the static one reads
every import of every module, those inside functions too.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from ..conftest import run_python

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "overmind"
SIDES = ("client", "server", "warm", "frontend")
# A side's own modules, shared code, and these public faces of others: a warm interpreter, and
# the process `overmind preload` starts, are where user code calls the API.
ALLOWED_FACES = {"warm": {"overmind.api"}, "frontend": {"overmind.api"}}


def _side(module: str) -> str:
    """``client``, ``server``, ``warm``, ``frontend``, ``shared``, or ``top`` (the package's faces:
    ``overmind``, ``__main__``, ``modelgen``, ``bench``); ``api`` belongs to the client."""
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in (*SIDES, "shared"):
        return parts[1]
    return "client" if module == "overmind.api" else "top"


def _imports(path: Path) -> list[tuple[str, int]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "overmind":  # from overmind import api, __version__
                found += [(f"overmind.{alias.name}", node.lineno) for alias in node.names]
            else:
                found.append((node.module, node.lineno))
    return [(name, line) for name, line in found if name == "overmind" or name.startswith("overmind.")]


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_side_imports_another_and_shared_imports_no_side():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        me = _side(_module_name(path))
        if me == "top":
            continue
        for name, line in _imports(path):
            other = _side(name)
            if other in (me, "shared") or name in ("overmind", "overmind.__version__", "overmind._C"):
                continue
            if name in ALLOWED_FACES.get(me, ()):
                continue
            wrong.append(f"{path.relative_to(PACKAGE.parent)}:{line} ({me}) imports {name} ({other})")
    assert not wrong, "imports across sides:\n" + "\n".join(wrong)


def test_the_sides_are_the_folders():
    """Every module lives in a side's folder or is one of the package's few faces."""
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert top == ["__init__.py", "__main__.py", "api.py", "modelgen.py"], top
    assert all((PACKAGE / side / "__init__.py").is_file() for side in (*SIDES, "shared"))


CLIENT_SIDE_PREFIXES = ("overmind.api", "overmind.client")

# What a loader imports to run a job (overmind.warm.loader.run_job), besides the module itself.
LOADER_RUN = ["overmind.shared.callstate", "overmind.shared.quirks", "overmind.shared.calls", "overmind.warm.dedup", "overmind.shared.reductions",
              "overmind.shared.replay", "overmind.shared.memfd"]


def _imported_by(modules: list[str]) -> set[str]:
    out = run_python(f"""
        import importlib, json, sys
        for name in {modules!r}:
            importlib.import_module(name)
        print(json.dumps(sorted(m for m in sys.modules if m.startswith("overmind"))))
    """)
    return set(json.loads(out.stdout.splitlines()[-1]))


@pytest.mark.parametrize("modules", [
    ["overmind.server.daemon"],
    ["overmind.warm.loader", *LOADER_RUN],
    ["overmind.warm.interpreter"],
], ids=["server", "loader", "warm-interpreter"])
def test_server_side_modules_import_nothing_of_the_client_side(modules):
    reached = {m for m in _imported_by(modules) if m.startswith(CLIENT_SIDE_PREFIXES)}
    assert not reached, f"{modules[0]} imports {sorted(reached)}"
