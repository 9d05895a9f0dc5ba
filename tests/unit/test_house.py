"""The house keeps itself: what drifts when nobody looks fails here instead.

- every ``Note [X]`` citation names a Note that is written where it says (or, bare, somewhere
  in ``src/``), and no Note's text is interrupted by another's;
- words the glossary (ARCHITECTURE.md, "Words with one meaning") retired stay retired;
- code and docs cite no issue number, work-log count or commit as evidence;
- every dotted name ARCHITECTURE.md gives exists in the code;
- no module is over MAX_MODULE_LINES and no class over MAX_CLASS_LINES.

Each check is a function over text, so its test also plants the defect it guards against.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "overmind"
DOCS = [ROOT / "README.md", ROOT / "ARCHITECTURE.md", *sorted((ROOT / "docs").glob("*.md")),
        *sorted((ROOT / "benchmarks").glob("*.md"))]
MAX_MODULE_LINES = 600
MAX_CLASS_LINES = 300

NAME = r"((?:[^\[\]]|\[[^\]]*\])+)"  # a Note's name may hold one pair of brackets: sys.path[0]
# A Note is written where a line (a comment, or a docstring's first line) begins with its name,
# alone or followed by a colon; anywhere else its name is a citation.
DEFINITION = re.compile(r"^\s*(?:#\s*)?(?:[rRbBuU]?\"\"\"|\'\'\')?Note \[" + NAME + r"\](?::|\s*$)")
CITATION = re.compile(r"Note \[" + NAME + r"\](?:,? in (?:``|`)?(overmind(?:[./]\w+)+)(?:``|`)?(?=[\s.,;:)\"'\]]|$))?")


def _sources() -> dict[Path, str]:
    return {p: p.read_text(encoding="utf-8") for p in sorted(SRC.rglob("*.py"))}


def _flat(text: str) -> str:
    """The text as one line: comment markers and indentation gone, so a name or a module split
    over lines reads whole."""
    return " ".join(line.strip().lstrip("#").strip() for line in text.splitlines())


def definitions(text: str) -> set[str]:
    return {m.group(1) for line in text.splitlines() if (m := DEFINITION.match(line))}


def _module_file(module: str) -> Path | None:
    parts = module.removesuffix(".py").replace("/", ".").split(".")[1:]
    for candidate in (SRC.joinpath(*parts).with_suffix(".py"), SRC.joinpath(*parts, "__init__.py")):
        if candidate.is_file():
            return candidate
    return None


def bad_citations(text: str, defined: dict[Path, set[str]]) -> list[str]:
    """Citations in ``text`` of Notes that are not where they say, or nowhere (bare)."""
    everywhere = set().union(*defined.values())
    bad = []
    for m in CITATION.finditer(_flat(text)):
        name, module = m.group(1), m.group(2)
        if module is None:
            if name not in everywhere:
                bad.append(f"Note [{name}] is written nowhere in src/")
            continue
        path = _module_file(module)
        if path is None:
            bad.append(f"Note [{name}] in {module}: no such module")
        elif name not in defined.get(path, set()):
            where = [str(p.relative_to(SRC)) for p, names in defined.items() if name in names]
            bad.append(f"Note [{name}] in {module}: not there (it is in {where or 'no module'})")
    return bad


def interrupted_notes(text: str) -> list[str]:
    """Notes whose first line follows a line of running text in the same comment or docstring:
    spliced into another Note's (or paragraph's) sentence."""
    lines = text.splitlines()
    bad = []
    for i, line in enumerate(lines):
        m = DEFINITION.match(line)
        if not m or i == 0:
            continue
        before = lines[i - 1].strip()
        in_comment = line.strip().startswith("#")
        if in_comment and before.startswith("#") and before.lstrip("#").strip() \
                and not before.rstrip().endswith((".", ":", ")")):
            bad.append(f"line {i + 1}: Note [{m.group(1)}] interrupts the comment above it")
        if not in_comment and before and before not in ('"""', "'''", 'r"""') and not before.startswith("#") \
                and not before.endswith((".", ":", '"""')):
            bad.append(f"line {i + 1}: Note [{m.group(1)}] interrupts the text above it")
    return bad


def test_every_note_citation_names_a_note_where_it_says():
    sources = _sources()
    defined = {p: definitions(t) for p, t in sources.items()}
    bad = [f"{p.relative_to(ROOT)}: {b}" for p, t in sources.items() for b in bad_citations(t, defined)]
    bad += [f"{p.relative_to(ROOT)}: {b}" for p in DOCS for b in bad_citations(p.read_text(), defined)]
    assert bad == []


def test_no_note_is_interrupted_by_another():
    bad = [f"{p.relative_to(ROOT)}: {b}" for p, t in _sources().items() for b in interrupted_notes(t)]
    assert bad == []


def test_the_note_checks_catch_what_they_guard_against():
    defined = {SRC / "warm" / "match.py": {"A hand-over is the same process or none"}}
    good = "# see Note [A hand-over is the same\n# process or none] in\n# overmind.warm.match\n"
    assert bad_citations(good, defined) == []
    assert bad_citations(good.replace("warm.match", "warm.script"), defined)  # the wrong address
    assert bad_citations("Note [Nobody wrote this]", defined)
    assert bad_citations("Note [A hand-over is the same process or none] in overmind.nowhere", defined)
    spliced = '"""One sentence that goes on\nNote [Spliced]\nand ends here."""\n'
    assert interrupted_notes(spliced) and not interrupted_notes('"""Done.\n\nNote [Alone]\ntext\n"""\n')
    assert interrupted_notes("# a comment that runs on\n# Note [Spliced]\n")


# -- retired words -------------------------------------------------------------------------

RETIRED = [
    (re.compile(r"zygote", re.I), "a warm interpreter is a warm interpreter (glossary: not a zygote)"),
    (re.compile(r"\b(?:warm|spare|ready|idle) loaders?\b", re.I), "a loader is one cold load's process, "
                                                                   "not the warm interpreter"),
]
SETTLER_HOMES = ("server/", "frontend/cli.py", "shared/settings/config.py", "bench/")  # the settler and who shows it


def retired_words(path: str, text: str) -> list[str]:
    bad = [f"{path}: {m.group(0)!r}: {why}" for pattern, why in RETIRED for m in pattern.finditer(text)]
    if path.endswith(".py") and not path.startswith(SETTLER_HOMES) and not path.startswith("tests/"):
        try:
            tree = ast.parse(text)
        except SyntaxError:
            return bad
        for node in ast.walk(tree):
            name = getattr(node, "name", None) or getattr(node, "attr", None) or getattr(node, "id", None)
            if isinstance(name, str) and "settl" in name.lower():
                bad.append(f"{path}:{getattr(node, 'lineno', '?')}: {name!r}: settling is the server's copy of a "
                           "file segment into sealed memory (glossary), nothing else")
    return bad


def test_retired_words_stay_retired():
    files = [*SRC.rglob("*.py"), *(ROOT / "tests").rglob("*.py"), *DOCS]
    bad = []
    for p in files:
        if p == Path(__file__):
            continue
        rel = str(p.relative_to(SRC)) if SRC in p.parents else str(p.relative_to(ROOT))
        bad += retired_words(rel, p.read_text(encoding="utf-8"))
    assert bad == []


def test_the_word_check_catches_what_it_guards_against():
    assert retired_words("warm/x.py", "class Zygote: pass\n")
    assert retired_words("warm/x.py", "# the spare loader of a context\n")
    assert retired_words("shared/settings/import_env.py", "def settle(self):\n    pass\n")
    assert not retired_words("server/settle.py", "def settle_one(self):\n    pass\n")


# -- citations as evidence -----------------------------------------------------------------

EVIDENCE = [
    (re.compile(r"\bissues? #?\d+\b", re.I), "an issue number"),
    (re.compile(r"\b(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth)"
                r" session\b", re.I), "the work log"),
    (re.compile(r"\bthe seed(?:'s)? (?:workload|script|write-up|text)\b", re.I), "the write-up the idea came from"),
    (re.compile(r"(?<![\w./-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,12}(?![\w-])"), "a commit"),
]


def cited_as_evidence(text: str) -> list[str]:
    return [f"{m.group(0)!r} ({what})" for pattern, what in EVIDENCE for m in pattern.finditer(text)]


def test_code_and_docs_cite_no_issue_work_log_or_commit():
    files = [*SRC.rglob("*.py"), *(ROOT / "tests").rglob("*.py"), *(ROOT / "benchmarks").glob("*.*"), *DOCS]
    bad = [f"{p.relative_to(ROOT)}: {b}" for p in files if p != Path(__file__) and p.suffix in (".py", ".sh", ".md")
           for b in cited_as_evidence(p.read_text(encoding="utf-8"))]
    assert bad == []


def test_the_evidence_check_catches_what_it_guards_against():
    assert cited_as_evidence("as issue 36 asked") and cited_as_evidence("at 0c7271f, the ninth session")
    assert cited_as_evidence("in the seed's workload")
    assert not cited_as_evidence("sha256 of the file, 16 hex digits, seed=3, the seed's own draws")


# -- ARCHITECTURE.md's names ---------------------------------------------------------------

def _code_names() -> tuple[set[str], set[str]]:
    """(every def, class and attribute name bound in src/, every module name)."""
    names: set[str] = set()
    modules: set[str] = set()
    for p, text in _sources().items():
        modules.add(p.stem if p.stem != "__init__" else p.parent.name)
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
    return names, modules


def missing_names(text: str, names: set[str], modules: set[str]) -> list[str]:
    """Dotted names in backticks (``Registry.add``, ``cache._rebuild``, ``server/fills.Fill``)
    that start at a class or module of ours and go on to a name that is not in the code."""
    bad = []
    for token in re.findall(r"`([A-Za-z_/][\w/]*(?:\.[A-Za-z_]\w*)+)(?:\(\))?`", text):
        if token.endswith((".py", ".md", ".json", ".yaml", ".service", ".sh", ".c", ".cpp")):
            continue
        head, *rest = token.split(".")
        head = head.rsplit("/", 1)[-1]
        if head not in names and head not in modules and head != "overmind":
            continue  # another library's (`weight.mul_`)
        bad += [f"`{token}`: no {part!r}" for part in rest if part not in names and part not in modules]
    return bad


def test_architecture_names_only_what_exists():
    names, modules = _code_names()
    assert missing_names((ROOT / "ARCHITECTURE.md").read_text(), names, modules) == []


def test_the_name_check_catches_what_it_guards_against():
    names, modules = _code_names()
    assert missing_names("`LoadingConnection.map_segments`", names, modules) == []
    assert missing_names("`Connection.map_segments_now`", names, modules)
    assert missing_names("`cache._tell_plain_seconds`", names, modules)


# -- sizes ---------------------------------------------------------------------------------

def oversized(path: str, text: str) -> list[str]:
    bad = []
    lines = text.count("\n") + (not text.endswith("\n"))
    if lines > MAX_MODULE_LINES:
        bad.append(f"{path}: {lines} lines (at most {MAX_MODULE_LINES})")
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
            bad.append(f"{path}: class {node.name} is {node.end_lineno - node.lineno + 1} lines "
                       f"(at most {MAX_CLASS_LINES})")
    return bad


def test_no_module_over_600_lines_and_no_class_over_300():
    bad = [b for p, t in _sources().items() for b in oversized(str(p.relative_to(SRC)), t)]
    assert bad == []


def test_the_size_check_catches_what_it_guards_against():
    assert oversized("x.py", "x = 1\n" * 601) and not oversized("x.py", "x = 1\n" * 600)
    assert oversized("x.py", "class Big:\n" + "    x = 1\n" * 300)


# -- tests share helpers through conftest.py and tests/helpers -----------------------------

def imports_of_test_modules(text: str) -> list[str]:
    """Imports of another test module (``from .test_run import _run``)."""
    return [m.group(0) for m in re.finditer(r"^\s*from\s+(?:\.+|tests\.\w+\.)test_\w+\s+import\b.*$", text, re.M)]


def test_no_test_module_imports_another():
    bad = [f"{p.relative_to(ROOT)}: {b}" for p in (ROOT / "tests").rglob("test_*.py")
           for b in imports_of_test_modules(p.read_text(encoding="utf-8"))]
    assert bad == []


def test_the_import_check_catches_what_it_guards_against():
    assert imports_of_test_modules("from .test_run import _run, _runs\n")
    assert not imports_of_test_modules("from .conftest import overmind_run\nfrom ..helpers.clients import PRELUDE\n")
