"""Which side may import which. The folders of ``src/overmind`` are the processes: ``client`` (with
``api``, the user's process), ``server``, ``warm`` (warm interpreters and their loaders),
``frontend`` (the commands), and ``shared``, which every side imports and which imports no side.
No side imports another side's modules; the warm interpreter may import ``overmind.api``, the
public face its runs will use.

Note [The loader is handed its references] in overmind.server.loaders: a loader gets the entries
its call refers to from the server, so neither it nor the server imports the user API or the
client's connection code. The runtime checks run in a fresh interpreter; the static ones read
every import of every module, those inside functions too. No module of overmind reaches itself
through imports either: a cycle hidden in a function is still a cycle, and a module in one can
never be read, tested or moved alone.
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


def _module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules(package: Path) -> set[str]:
    return {_module_name(path, package) for path in package.rglob("*.py")}


def _imports(path: Path, package: Path = PACKAGE, modules: frozenset[str] | set[str] = frozenset()) -> list[tuple[str, int]]:
    """Every import of overmind in ``path``, at any depth (in functions, under ``if``), as
    (module, line): ``from overmind.shared import patching`` is ``overmind.shared.patching`` (a
    name in ``modules``, default: those of ``package``), a name that is no module (``from
    overmind import __version__``) is its package, and a relative import is made absolute."""
    modules = modules or _modules(package)
    here = _module_name(path, package).split(".")
    parent = here if path.name == "__init__.py" else here[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # from . import x; from ..shared import y
                base = ".".join([*parent[:len(parent) - node.level + 1], *filter(None, [node.module])])
            for alias in node.names:
                found.append((f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base, node.lineno))
    return [(name, line) for name, line in found if name == "overmind" or name.startswith("overmind.")]


def test_no_side_imports_another_and_shared_imports_no_side():
    wrong = []
    modules = _modules(PACKAGE)
    for path in sorted(PACKAGE.rglob("*.py")):
        me = _side(_module_name(path))
        if me == "top":
            continue
        for name, line in _imports(path, PACKAGE, modules):
            other = _side(name)
            if other in (me, "shared") or name in ("overmind", "overmind._C"):
                continue
            if name in ALLOWED_FACES.get(me, ()):
                continue
            wrong.append(f"{path.relative_to(PACKAGE.parent)}:{line} ({me}) imports {name} ({other})")
    assert not wrong, "imports across sides:\n" + "\n".join(wrong)


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The import cycles of ``graph`` (module -> {module it imports: line}), one per strongly
    connected group of modules: the shortest loop through its first module, sorted by name."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups = []

    def visit(module: str) -> None:  # Tarjan's strongly connected components
        index[module] = low[module] = len(index)
        stack.append(module)
        for other in graph.get(module, ()):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            group = []
            while not group or group[-1] != module:
                group.append(stack.pop())
            if len(group) > 1 or module in graph.get(module, ()):
                groups.append(sorted(group))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    loops = []
    for group in sorted(groups):
        start, paths = group[0], {group[0]: [group[0]]}
        todo = [start]
        while todo:  # breadth first inside the group, back to its start
            module = todo.pop(0)
            for other in sorted(graph[module]):
                if other == start:
                    loops.append(paths[module] + [start])
                    todo = []
                    break
                if other in group and other not in paths:
                    paths[other] = paths[module] + [other]
                    todo.append(other)
    return loops


def _import_graph(package: Path) -> dict[str, dict[str, int]]:
    """module -> {each module of ``package`` it imports, anywhere in it: the line of the first}.
    Only what the code names: importing ``overmind.shared.protocol.base`` runs the package's
    ``__init__`` first, which is no arrow (a package that hands on its modules' names would
    otherwise be in a cycle with each); ``import overmind.bench`` in its own module is one."""
    modules = _modules(package)
    graph: dict[str, dict[str, int]] = {}
    for path in sorted(package.rglob("*.py")):
        edges = graph.setdefault(_module_name(path, package), {})
        for name, line in _imports(path, package, modules):
            if name in modules:
                edges.setdefault(name, line)
    return graph


def test_no_module_imports_itself_through_others_even_inside_a_function():
    graph = _import_graph(PACKAGE)
    loops = [" -> ".join(f"{a}, line {graph[a][b]}," for a, b in zip(loop, loop[1:])) + f" -> {loop[-1]}"
             for loop in _cycles(graph)]
    assert not loops, "import cycles (each module, then the line of its import of the next):\n" + "\n".join(loops)


def test_the_cycle_check_sees_a_cycle_through_imports_in_functions(tmp_path):
    """The check above would pass on a reader that missed imports: it must see one in a function,
    a relative one, and a module taken from its package by name."""
    package = tmp_path / "overmind"
    (package / "side").mkdir(parents=True)
    for name, text in {"__init__.py": "", "side/__init__.py": "",
                       "side/a.py": "def f():\n    from overmind.side import b\n",
                       "side/b.py": "from . import c\n",
                       "side/c.py": "import overmind.side.a\n"}.items():
        (package / name).write_text(text)
    assert _cycles(_import_graph(package)) == [["overmind.side.a", "overmind.side.b", "overmind.side.c", "overmind.side.a"]]
    (package / "side" / "c.py").write_text("import overmind.side\n")
    assert _cycles(_import_graph(package)) == []


def test_the_sides_are_the_folders():
    """Every module lives in a side's folder or is one of the package's few faces."""
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert top == ["__init__.py", "__main__.py", "api.py", "modelgen.py"], top
    assert all((PACKAGE / side / "__init__.py").is_file() for side in (*SIDES, "shared"))


# The rooms of ``shared``, bottom first: a room imports its own modules and the rooms of lower
# floors; rooms on one floor import none of each other (the map in overmind/shared/__init__.py).
SHARED_FLOORS = (("settings",), ("process",), ("segments", "calls", "patching"), ("protocol",))


def _room(module: str) -> str:
    """``overmind.shared.segments.memfd`` -> ``segments``; "" for ``overmind.shared`` itself."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["overmind", "shared"] else ""


def _wrong_ways(package: Path) -> list[str]:
    floor = {room: level for level, rooms in enumerate(SHARED_FLOORS) for room in rooms}
    wrong = []
    for path in sorted((package / "shared").rglob("*.py")):
        me = _room(_module_name(path, package))
        for name, line in _imports(path, package):
            other = _room(name)
            if not me or not other or other == me:
                continue
            if other not in floor or floor[other] >= floor.get(me, -1):
                wrong.append(f"{path.relative_to(package.parent)}:{line} ({me}) imports {name} ({other})")
    return wrong


def test_the_rooms_of_shared_import_downwards_only():
    assert sorted(p.parent.name for p in (PACKAGE / "shared").glob("*/__init__.py")) == \
        sorted(room for rooms in SHARED_FLOORS for room in rooms), "a room of shared is missing from SHARED_FLOORS"
    assert [p.name for p in (PACKAGE / "shared").glob("*.py")] == ["__init__.py"], "shared holds rooms, not modules"
    wrong = _wrong_ways(PACKAGE)
    assert not wrong, "imports against the floors of shared:\n" + "\n".join(wrong)


def test_the_floor_check_sees_an_import_up_and_one_across(tmp_path):
    package = tmp_path / "overmind"
    for room in ("settings", "segments", "calls"):
        (package / "shared" / room).mkdir(parents=True)
        (package / "shared" / room / "__init__.py").write_text("")
    (package / "shared" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "shared" / "settings" / "config.py").write_text("def f():\n    from overmind.shared.segments import memfd\n")
    (package / "shared" / "segments" / "memfd.py").write_text("from overmind.shared.calls import keys\n")
    (package / "shared" / "calls" / "keys.py").write_text("from overmind.shared.settings import config\n")
    wrong = _wrong_ways(package)
    assert len(wrong) == 2 and "(segments) imports overmind.shared.calls.keys" in wrong[0], wrong
    assert "(settings) imports overmind.shared.segments.memfd" in wrong[1], wrong


CLIENT_SIDE_PREFIXES = ("overmind.api", "overmind.client")

# What a loader imports to run a job (overmind.warm.loader.run_job), besides the module itself.
LOADER_RUN = ["overmind.shared.calls.callstate", "overmind.shared.segments.quirks", "overmind.shared.calls.keys",
              "overmind.warm.dedup", "overmind.shared.segments.reductions", "overmind.shared.calls.replay",
              "overmind.shared.segments.memfd"]


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
