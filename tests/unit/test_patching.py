"""Tests for overmind.shared.patching.

Every patching scenario runs in a fresh interpreter (as gevent's monkey tests do),
so sys.modules, sys.meta_path and the patch registry start clean each time; the
script asserts and prints OK, and the test checks its exit code and output.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from overmind.shared.patching import PatchPoint, parse_patch_specs

SRC = Path(__file__).resolve().parents[2] / "src"

# A small library with the shapes the real targets have: classmethods inherited
# by subclasses, a staticmethod, module functions, and a loader that calls
# other patched entry points internally (as DiffusionPipeline.from_pretrained does).
FAKELIB = '''
"""Fake model library."""

class Base:
    @classmethod
    def from_pretrained(cls, path, *args, flag=False, **kwargs):
        """Load a Base from path."""
        if path == "boom":
            raise FileNotFoundError(path)
        return ("loaded", cls, path, flag)

    @staticmethod
    def helper(x, y=1):
        return x * 2 + y


class Child(Base):
    pass


def load(f, map_location=None):
    """Load a checkpoint."""
    return ("load", f, map_location)


def load_pipeline(path):
    return [Base.from_pretrained(path), load(path)]
'''

PRELUDE = '''
import functools, inspect, logging, sys, threading
from overmind.shared import patching
from overmind.shared.patching import PatchPoint

CALLS = []

def factory(point, original, is_classmethod):
    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        CALLS.append((str(point), args[0] if is_classmethod else None, patching.in_patched_call()))
        return original(*args, **kwargs)
    return wrapper

def P(spec):
    return PatchPoint.parse(spec)

SENTINEL = object()
def sentinel_factory(point, original, is_classmethod):
    assert is_classmethod
    @functools.wraps(original)
    def wrapper(cls, *args, **kwargs):
        CALLS.append((str(point), cls, args, kwargs))
        return SENTINEL  # never load a real model
    return wrapper
'''


def run_script(code: str, tmp_path: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run PRELUDE + code in a fresh interpreter; fail with its output unless it prints OK."""
    env = dict(os.environ)
    paths = [str(SRC)] + ([str(tmp_path)] if tmp_path else [])
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONDONTWRITEBYTECODE="1")
    env.update(TRANSFORMERS_VERBOSITY="error", DIFFUSERS_VERBOSITY="error", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(code) + "\nprint('OK')\n"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    output = f"--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    assert proc.returncode == 0, output
    assert proc.stdout.rstrip().endswith("OK"), output
    return proc


@pytest.fixture
def fakelib(tmp_path: Path) -> Path:
    (tmp_path / "fakelib").mkdir()
    (tmp_path / "fakelib" / "__init__.py").write_text("")
    (tmp_path / "fakelib" / "loaders.py").write_text(FAKELIB)
    return tmp_path


def needs(*modules: str) -> pytest.MarkDecorator:
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    return pytest.mark.skipif(bool(missing), reason=f"not installed: {', '.join(missing)}")


# --- specs ----------------------------------------------------------------------------


def test_parse_splits_module_and_qualname_and_round_trips() -> None:
    point = PatchPoint.parse("  diffusers.pipelines.pipeline_utils::DiffusionPipeline.from_pretrained ")
    assert point == PatchPoint("diffusers.pipelines.pipeline_utils", "DiffusionPipeline.from_pretrained")
    assert str(point) == "diffusers.pipelines.pipeline_utils::DiffusionPipeline.from_pretrained"
    assert PatchPoint.parse(str(point)) == point
    assert PatchPoint.parse("torch::load") == PatchPoint("torch", "load")
    assert len({point, PatchPoint.parse(str(point))}) == 1  # hashable, usable as a key
    with pytest.raises(AttributeError):
        point.module = "x"  # type: ignore[misc]  # frozen


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        ("", "exactly one '::'"),
        ("torch.load", "exactly one '::'"),
        ("torch:load", "exactly one '::'"),
        ("a::b::c", "exactly one '::'"),
        ("::load", "empty module name"),
        ("torch::", "empty qualname"),
        ("1torch::load", "invalid module name"),
        ("torch.::load", "invalid module name"),
        ("torch::load()", "invalid qualname"),
        ("torch::Class..attr", "invalid qualname"),
        ("torch::class.attr", "invalid qualname"),
    ],
)
def test_parse_rejects_malformed_spec_naming_the_problem(spec: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem) as info:
        PatchPoint.parse(spec)
    assert repr(spec) in str(info.value)


def test_direct_construction_validates_names() -> None:
    with pytest.raises(ValueError, match="invalid module name"):
        PatchPoint("not a module", "load")


def test_parse_patch_specs_skips_comments_and_blanks_and_splits_commas() -> None:
    text = """
    # overmind patch points
    torch::load   # the checkpoint loader

    safetensors.torch::load_file, transformers.modeling_utils::PreTrainedModel.from_pretrained
    torch::load
    """
    assert parse_patch_specs(text) == [
        PatchPoint("torch", "load"),
        PatchPoint("safetensors.torch", "load_file"),
        PatchPoint("transformers.modeling_utils", "PreTrainedModel.from_pretrained"),
    ]
    assert parse_patch_specs("torch::load,,safetensors.torch::load_file,") == [
        PatchPoint("torch", "load"),
        PatchPoint("safetensors.torch", "load_file"),
    ]
    assert parse_patch_specs("") == []
    assert parse_patch_specs("# nothing\n\n") == []


def test_parse_patch_specs_error_names_line_number() -> None:
    with pytest.raises(ValueError, match=r"line 3: invalid patch spec 'torch\.load'"):
        parse_patch_specs("torch::load\n# ok\ntorch.load\n")


# --- mechanics, on a fake library and the stdlib -------------------------------------------


def test_patch_on_unimported_module_waits_for_users_import(tmp_path: Path) -> None:
    run_script(
        """
        assert "colorsys" not in sys.modules
        point = P("colorsys::rgb_to_hsv")
        patching.patch([point], factory)
        assert "colorsys" not in sys.modules, "patch() must not import its target"
        assert patching.pending_points() == [point] and patching.patched_points() == []
        assert not patching.is_patched(point)
        assert isinstance(sys.meta_path[0], patching._PatchFinder)

        import colorsys
        assert patching.is_patched(point) and patching.patched_points() == [point]
        assert patching.pending_points() == []
        assert colorsys.rgb_to_hsv(1.0, 0.0, 0.0) == (0.0, 1.0, 1.0)
        assert CALLS == [("colorsys::rgb_to_hsv", None, True)], CALLS
        # the import hook leaves no trace on the module
        loader = type(colorsys.__loader__).__name__
        assert loader == "SourceFileLoader", loader
        assert colorsys.__spec__.loader is colorsys.__loader__
        """
    )


def test_patch_on_module_imported_through_importlib_applies(tmp_path: Path) -> None:
    run_script(
        """
        import importlib
        patching.patch([P("fractions::Fraction.from_float")], factory)
        assert "fractions" not in sys.modules
        fractions = importlib.import_module("fractions")
        assert patching.is_patched(fractions.Fraction.from_float)
        assert fractions.Fraction.from_float(0.5) == fractions.Fraction(1, 2)
        assert CALLS == [("fractions::Fraction.from_float", fractions.Fraction, True)], CALLS
        """
    )


def test_patch_on_imported_module_applies_immediately(fakelib: Path) -> None:
    run_script(
        """
        from fakelib import loaders
        original = loaders.load
        patching.patch([P("fakelib.loaders::load")], factory)
        assert loaders.load is not original and loaders.load.__wrapped__ is original
        assert loaders.load("ckpt", map_location="cpu") == ("load", "ckpt", "cpu")
        assert CALLS == [("fakelib.loaders::load", None, True)]
        assert patching.pending_points() == []
        """,
        fakelib,
    )


def test_classmethod_wrapper_receives_subclass_and_looks_like_original(fakelib: Path) -> None:
    run_script(
        """
        from fakelib import loaders
        before = inspect.signature(loaders.Child.from_pretrained)
        raw_before = loaders.Base.__dict__["from_pretrained"]
        patching.patch([P("fakelib.loaders::Base.from_pretrained")], factory)

        raw = loaders.Base.__dict__["from_pretrained"]
        assert isinstance(raw, classmethod) and raw is not raw_before
        assert loaders.Child.from_pretrained("p", flag=True) == ("loaded", loaders.Child, "p", True)
        assert CALLS == [("fakelib.loaders::Base.from_pretrained", loaders.Child, True)], CALLS

        bound = loaders.Child.from_pretrained
        assert bound.__name__ == "from_pretrained"
        assert bound.__qualname__ == "Base.from_pretrained"
        assert bound.__doc__ == "Load a Base from path."
        assert bound.__wrapped__ is raw_before.__func__
        assert inspect.signature(bound) == before, inspect.signature(bound)
        assert patching.get_original("fakelib.loaders", "Base.from_pretrained") is raw_before.__func__
        """,
        fakelib,
    )


def test_staticmethod_stays_static(fakelib: Path) -> None:
    run_script(
        """
        from fakelib import loaders
        original = loaders.Base.__dict__["helper"].__func__
        seen = []
        def factory2(point, original, is_classmethod):
            seen.append(is_classmethod)
            return factory(point, original, is_classmethod)
        patching.patch([P("fakelib.loaders::Child.helper")], factory2)
        assert seen == [False]
        assert isinstance(loaders.Child.__dict__["helper"], staticmethod)
        assert loaders.Child.helper(3) == 7 and loaders.Child().helper(3, y=0) == 6
        assert len(CALLS) == 2, CALLS
        assert inspect.signature(loaders.Child.helper) == inspect.signature(original)
        """,
        fakelib,
    )


def test_patch_twice_wraps_once(fakelib: Path) -> None:
    run_script(
        """
        made = []
        def counting_factory(point, original, is_classmethod):
            made.append(point)
            return factory(point, original, is_classmethod)
        points = [P("fakelib.loaders::load"), P("fakelib.loaders::Base.from_pretrained")]
        patching.patch(points, counting_factory)
        patching.patch(points, counting_factory)  # still pending: no second registration
        from fakelib import loaders
        installed = loaders.load, loaders.Base.__dict__["from_pretrained"]
        patching.patch(points, counting_factory)  # applied: no-op
        patching.patch(points[::-1], factory)
        assert (loaders.load, loaders.Base.__dict__["from_pretrained"]) == installed
        assert made == points, made
        loaders.load("x")
        loaders.Base.from_pretrained("y")
        assert len(CALLS) == 2, CALLS
        assert loaders.load.__wrapped__ is patching.get_original("fakelib.loaders", "load")
        """,
        fakelib,
    )


def test_unpatch_all_restores_exact_originals_and_removes_hook(fakelib: Path) -> None:
    run_script(
        """
        from fakelib import loaders
        original_load = loaders.load
        original_cm = loaders.Base.__dict__["from_pretrained"]
        original_sm = loaders.Base.__dict__["helper"]
        patching.patch(
            [P("fakelib.loaders::load"), P("fakelib.loaders::Base.from_pretrained"),
             P("fakelib.loaders::Base.helper"), P("colorsys::rgb_to_hsv")],
            factory,
        )
        stale = loaders.load
        assert patching.is_patched(stale) and patching.is_patched(original_load)
        assert len(patching.patched_points()) == 3 and len(patching.pending_points()) == 1

        patching.unpatch_all()
        assert loaders.load is original_load
        assert loaders.Base.__dict__["from_pretrained"] is original_cm
        assert loaders.Base.__dict__["helper"] is original_sm
        assert not patching.is_patched(P("fakelib.loaders::load"))
        assert not patching.is_patched(stale) and not patching.is_patched(original_load)
        assert patching.patched_points() == [] and patching.pending_points() == []
        assert not any(isinstance(f, patching._PatchFinder) for f in sys.meta_path)

        import colorsys  # its pending patch was dropped
        assert not patching.is_patched(P("colorsys::rgb_to_hsv"))
        colorsys.rgb_to_hsv(0.0, 0.0, 0.0)
        stale("kept reference")  # a wrapper kept past unpatch_all() acts as the original
        assert CALLS == [], CALLS

        patching.patch([P("fakelib.loaders::load")], factory)  # patching again works
        loaders.load("again")
        assert CALLS == [("fakelib.loaders::load", None, True)], CALLS
        """,
        fakelib,
    )


def test_inherited_attribute_is_patched_on_subclass_and_removed_on_unpatch(fakelib: Path) -> None:
    run_script(
        """
        from fakelib import loaders
        base_raw = loaders.Base.__dict__["from_pretrained"]
        patching.patch([P("fakelib.loaders::Child.from_pretrained")], factory)
        assert "from_pretrained" in loaders.Child.__dict__
        assert loaders.Base.__dict__["from_pretrained"] is base_raw
        loaders.Base.from_pretrained("b")
        loaders.Child.from_pretrained("c")
        assert CALLS == [("fakelib.loaders::Child.from_pretrained", loaders.Child, True)], CALLS
        patching.unpatch_all()
        assert "from_pretrained" not in loaders.Child.__dict__

        # the same attribute reached through a second point is not wrapped twice
        patching.patch([P("fakelib.loaders::Base.from_pretrained")], factory)
        patching.patch([P("fakelib.loaders::Child.from_pretrained")], factory)
        assert "from_pretrained" not in loaders.Child.__dict__
        assert patching.is_patched(P("fakelib.loaders::Child.from_pretrained"))
        assert patching.patched_points() == [P("fakelib.loaders::Base.from_pretrained")]
        """,
        fakelib,
    )


def test_nested_patched_call_skips_inner_wrapper(fakelib: Path) -> None:
    run_script(
        """
        patching.patch(
            [P("fakelib.loaders::load_pipeline"), P("fakelib.loaders::Base.from_pretrained"),
             P("fakelib.loaders::load")],
            factory,
        )
        from fakelib import loaders
        assert not patching.in_patched_call()
        result = loaders.load_pipeline("p")
        assert result == [("loaded", loaders.Base, "p", False), ("load", "p", None)]
        assert CALLS == [("fakelib.loaders::load_pipeline", None, True)], CALLS
        assert not patching.in_patched_call()

        # the guard unwinds on exceptions, which reach the caller unchanged
        try:
            loaders.Child.from_pretrained("boom")
        except FileNotFoundError as exc:
            assert exc.args == ("boom",)
        else:
            raise AssertionError("exception swallowed")
        assert not patching.in_patched_call()
        loaders.load("after")
        assert [c[0] for c in CALLS[1:]] == ["fakelib.loaders::Base.from_pretrained",
                                            "fakelib.loaders::load"], CALLS
        """,
        fakelib,
    )


def test_reentrancy_guard_is_per_thread(fakelib: Path) -> None:
    run_script(
        """
        entered, release = threading.Event(), threading.Event()
        def blocking_factory(point, original, is_classmethod):
            def wrapper(*args, **kwargs):
                CALLS.append(threading.current_thread().name)
                if threading.current_thread().name == "slow":
                    entered.set()
                    release.wait(10)
                return original(*args, **kwargs)
            return functools.wraps(original)(wrapper)
        patching.patch([P("fakelib.loaders::load")], blocking_factory)
        from fakelib import loaders
        slow = threading.Thread(target=loaders.load, args=("a",), name="slow")
        slow.start()
        assert entered.wait(10)
        assert not patching.in_patched_call()
        loaders.load("b")  # another thread's patched call does not bypass ours
        release.set()
        slow.join(10)
        assert CALLS == ["slow", "MainThread"], CALLS
        """,
        fakelib,
    )


def test_missing_attribute_warns_once_and_does_not_raise(fakelib: Path) -> None:
    run_script(
        """
        class Collect(logging.Handler):
            records = []
            def emit(self, record):
                self.records.append(record)
        logging.getLogger("overmind.shared.patching").addHandler(Collect())
        points = [P("fakelib.loaders::Base.nope"), P("fakelib.loaders::Missing.from_pretrained"),
                  P("fakelib.loaders::load")]
        patching.patch(points, factory)
        from fakelib import loaders  # patches apply from the import hook: must not raise
        patching.patch(points, factory)  # applied immediately this time
        warnings = [r for r in Collect.records if r.levelno == logging.WARNING]
        messages = [r.getMessage() for r in warnings]
        assert len(warnings) == 2, messages
        assert "fakelib.loaders::Base.nope" in messages[0], messages
        assert "fakelib.loaders::Missing.from_pretrained" in messages[1], messages
        assert patching.patched_points() == [P("fakelib.loaders::load")]
        loaders.load("x")
        assert len(CALLS) == 1
        """,
        fakelib,
    )


def test_failing_factory_in_import_hook_does_not_break_import(fakelib: Path) -> None:
    run_script(
        """
        def broken(point, original, is_classmethod):
            raise RuntimeError("factory bug")
        patching.patch([P("fakelib.loaders::load")], broken)
        from fakelib import loaders
        assert loaders.load("x") == ("load", "x", None)
        assert not patching.is_patched(P("fakelib.loaders::load"))
        try:
            patching.patch([P("fakelib.loaders::Base.helper")], broken)
        except RuntimeError:
            pass  # applied directly, the bug surfaces to the caller
        else:
            raise AssertionError("factory error hidden")
        """,
        fakelib,
    )


def test_loader_without_exec_module_is_skipped(fakelib: Path) -> None:
    run_script(
        """
        import importlib.machinery, types, warnings
        warnings.simplefilter("ignore")

        class LegacyLoader:  # only the pre-PEP 451 protocol
            def load_module(self, name):
                module = sys.modules[name] = types.ModuleType(name)
                module.load = lambda f: ("legacy", f)
                return module

        class LegacyFinder:
            def find_spec(self, name, path=None, target=None):
                if name == "legacy_mod":
                    return importlib.machinery.ModuleSpec(name, LegacyLoader())
                return None

        sys.meta_path.append(LegacyFinder())
        patching.patch([P("legacy_mod::load")], factory)
        import legacy_mod
        assert legacy_mod.load("x") == ("legacy", "x")
        assert not patching.is_patched(P("legacy_mod::load"))
        assert patching.pending_points() == [P("legacy_mod::load")]
        patching.patch([P("legacy_mod::load")], factory)  # now imported: applies
        assert patching.is_patched(P("legacy_mod::load"))
        """,
        fakelib,
    )


def test_get_original_of_unpatched_point_returns_current_attribute(fakelib: Path) -> None:
    run_script(
        """
        original = patching.get_original("fakelib.loaders", "Base.from_pretrained")
        from fakelib import loaders
        assert original is loaders.Base.__dict__["from_pretrained"].__func__
        assert patching.get_original("fakelib.loaders", "load") is loaders.load
        try:
            patching.get_original("fakelib.loaders", "nope")
        except AttributeError:
            pass
        else:
            raise AssertionError("missing attribute not reported")
        """,
        fakelib,
    )


# --- names bound before patching: Note [Names bound before patching] in overmind.shared.patching.bound_names

# A module that copied the loader into its globals when it was imported, as peft does with
# ``from safetensors.torch import load_file as safe_load_file``.
USER = """
from fakelib.loaders import load as fetch
from fakelib.loaders import load

class Holder:
    kept = staticmethod(load)  # a class attribute: looked up through the class, left alone

def use(path):
    return fetch(path)
"""


@pytest.fixture
def fakeuser(fakelib: Path) -> Path:
    (fakelib / "fakelib" / "user.py").write_text(USER)
    return fakelib


def test_names_bound_before_patching_get_the_wrapper_and_unpatch_restores_them(fakeuser: Path) -> None:
    run_script(
        """
        from fakelib import loaders, user
        original = loaders.load
        patching.patch([P("fakelib.loaders::load")], factory)
        guard = loaders.load
        assert user.fetch is guard and user.load is guard
        assert user.use("ckpt") == ("load", "ckpt", None)  # the module's own code looks the name up
        assert CALLS == [("fakelib.loaders::load", None, True)], CALLS
        assert user.Holder.__dict__["kept"].__func__ is original
        assert patching.get_original("fakelib.loaders", "load") is original

        patching.unpatch_all()
        assert loaders.load is original and user.fetch is original and user.load is original
        user.use("after")
        assert len(CALLS) == 1, CALLS
        """,
        fakeuser,
    )


def test_a_warm_interpreters_index_finds_names_bound_before_and_after_it_without_a_whole_pass(fakeuser: Path) -> None:
    (fakeuser / "fakelib" / "late.py").write_text("from fakelib.loaders import load as late_load\n")
    run_script(
        """
        import sys
        from fakelib import loaders, user
        patching.index_bound_names([P("fakelib.loaders::load")])  # the warm interpreter, before it forks
        from fakelib import late  # the child imports more before it patches
        from overmind.shared.patching import bound_names
        passes = []
        whole = bound_names._bound_in
        bound_names._bound_in = lambda modules, targets: passes.append(len(modules)) or whole(modules, targets)
        patching.patch([P("fakelib.loaders::load")], factory)
        guard = loaders.load
        assert user.fetch is guard and user.load is guard and late.late_load is guard
        assert passes == [1], passes  # only the module imported after the index
        patching.unpatch_all()
        assert late.late_load is loaders.load and user.fetch is loaders.load

        # A module indexed is gone and one is new, at the same count: the tail cannot be told
        # from the rest, so the whole pass again.
        del sys.modules["fakelib.late"], sys.modules["fakelib.user"]
        import importlib
        late = importlib.import_module("fakelib.late")
        patching.patch([P("fakelib.loaders::load")], factory)
        assert late.late_load is loaders.load and len(passes) == 2 and passes[-1] > 1, passes
        """,
        fakeuser,
    )


def test_a_child_patches_from_the_index_while_another_thread_imports(fakeuser: Path) -> None:
    """The warm-up thread that monkey_patch_all()'s first wrapper starts (or the user's own) imports
    while the child reads the index: neither reading the tail of sys.modules nor the globals of a
    module being executed may fail ("dictionary changed size during iteration" made
    monkey_patch_all() raise in a warm run)."""
    (fakeuser / "fakelib" / "late.py").write_text("from fakelib.loaders import load as late_load\n")
    run_script(
        """
        import sys, threading, types
        from fakelib import loaders, user
        patching.index_bound_names([P("fakelib.loaders::load")])  # the warm interpreter, before it forks
        for i in range(2000):  # the child imported its script's modules before it patches
            sys.modules[f"_om_new_{i}"] = types.ModuleType(f"_om_new_{i}")
        from fakelib import late
        busy = sys.modules["_om_busy"] = types.ModuleType("_om_busy")  # being executed by the thread
        stop = threading.Event()

        def imports():  # another thread importing (and dropping, to stay bounded) all along
            churn = types.ModuleType("_om_churn")
            while not stop.is_set():  # one change per dict per pass: a switch can come after either
                if sys.modules.pop("_om_churn", None) is None:
                    sys.modules["_om_churn"] = churn
                if busy.__dict__.pop("value", None) is None:
                    busy.value = 1
        sys.setswitchinterval(1e-5)  # switch often: the window is one bytecode wide
        thread = threading.Thread(target=imports)
        thread.start()
        try:
            for _ in range(1000):
                patching.patch([P("fakelib.loaders::load")], factory)
                guard = loaders.load
                assert late.late_load is guard and user.fetch is guard and user.load is guard
                patching.unpatch_all()
                assert late.late_load is loaders.load and user.fetch is loaders.load
        finally:
            stop.set()
            thread.join()
        """,
        fakeuser,
    )


def test_monkey_patch_all_undoes_a_failed_patch_warns_and_lets_the_script_run(fakeuser: Path) -> None:
    """A fault in patching must not stop the user's script at its first line (Note [Never worse than
    no cache]): nothing stays patched, one warning says why; OVERMIND_STRICT=1 raises."""
    run_script(
        """
        import os, warnings
        os.environ.update(OVERMIND_PRESTART="0", OVERMIND_QUICK_EXIT="0")
        import overmind.api
        from fakelib import loaders, user
        original = loaders.load

        def fault(modules, targets):
            raise RuntimeError("injected fault")
        from overmind.shared.patching import bound_names
        bound_names._bound_in = fault  # the pass over names bound before patching
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            overmind.api.monkey_patch_all(extra=["fakelib.loaders::load"])
        assert loaders.load is original and user.fetch is original and user.load is original
        assert not patching.patched_points() and not patching.pending_points()
        assert not any(isinstance(f, patching._PatchFinder) for f in sys.meta_path)
        messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        assert len(messages) == 1 and "injected fault" in messages[0] \
            and "running without the cache" in messages[0], messages

        os.environ["OVERMIND_STRICT"] = "1"
        try:
            overmind.api.monkey_patch_all(extra=["fakelib.loaders::load"])
        except RuntimeError as err:
            assert "injected fault" in str(err)
        else:
            raise AssertionError("OVERMIND_STRICT=1 must raise")
        assert loaders.load is original and not patching.patched_points()
        """,
        fakeuser,
    )


def test_unpatch_leaves_an_alias_rebound_since_patching(fakeuser: Path) -> None:
    run_script(
        """
        from fakelib import loaders, user
        original = loaders.load
        patching.patch([P("fakelib.loaders::load")], factory)
        mine = lambda path: ("mine", path)
        user.fetch = mine
        patching.unpatch_all()
        assert user.fetch is mine and user.load is original
        """,
        fakeuser,
    )


def test_names_bound_after_patching_come_from_the_import_hook_path(fakeuser: Path) -> None:
    run_script(
        """
        patching.patch([P("fakelib.loaders::load")], factory)
        from fakelib import user  # imports fakelib.loaders first: patched before user binds it
        from fakelib import loaders
        assert user.fetch is loaders.load and patching.is_patched(user.fetch)
        patching.unpatch_all()  # a name bound to the wrapper keeps it, and it acts as the original
        assert not patching.is_patched(user.fetch) and user.fetch("x") == ("load", "x", None)
        assert CALLS == [], CALLS
        """,
        fakeuser,
    )


def test_the_defining_module_and_overminds_own_modules_keep_the_original(fakeuser: Path) -> None:
    (fakeuser / "fakelib" / "__init__.py").write_text("from .loaders import load\n")
    run_script(
        """
        import types
        import fakelib
        from fakelib import loaders, user
        original = loaders.load
        ours = sys.modules["overmind._test_holder"] = types.ModuleType("overmind._test_holder")
        ours.load = original
        patching.patch([P("fakelib::load")], factory)  # a re-export: the definition stays
        assert patching.is_patched(fakelib.load) and user.fetch is fakelib.load
        assert loaders.load is original and ours.load is original
        patching.unpatch_all()
        assert fakelib.load is original and user.fetch is original
        """,
        fakeuser,
    )


@needs("torch", "safetensors", "peft")
def test_peft_imported_before_patching_loads_adapters_through_the_wrapper() -> None:
    # What a warm `overmind run` child sees: peft was imported before monkey_patch_all().
    run_script(
        """
        import torch, safetensors.torch
        import peft.utils.save_and_load as save_and_load
        original = safetensors.torch.load_file
        assert save_and_load.safe_load_file is original
        patching.patch([P("safetensors.torch::load_file"), P("torch::load")], factory)
        assert save_and_load.safe_load_file is safetensors.torch.load_file
        assert patching.is_patched(save_and_load.safe_load_file)
        assert torch.serialization.load is patching.get_original("torch", "load")  # the definition
        patching.unpatch_all()
        assert save_and_load.safe_load_file is original and safetensors.torch.load_file is original
        """
    )


# --- the real libraries -------------------------------------------------------------------


@needs("torch", "safetensors", "diffusers", "transformers")
def test_torch_only_script_never_imports_diffusers_or_transformers(tmp_path: Path) -> None:
    run_script(
        f"""
        import io
        points = patching.parse_patch_specs('''
            torch::load
            safetensors.torch::load_file
            diffusers.pipelines.pipeline_utils::DiffusionPipeline.from_pretrained
            diffusers.models.modeling_utils::ModelMixin.from_pretrained
            transformers.modeling_utils::PreTrainedModel.from_pretrained
        ''')
        patching.patch(points, factory)
        assert not any(m in sys.modules for m in ("torch", "diffusers", "transformers"))

        import torch
        assert "diffusers" not in sys.modules and "transformers" not in sys.modules
        assert patching.is_patched(P("torch::load"))
        assert torch.serialization.load is torch.load.__wrapped__  # the alias is untouched
        buf = io.BytesIO()
        torch.save({{"w": torch.arange(3)}}, buf)
        buf.seek(0)
        assert torch.equal(torch.load(buf, weights_only=True)["w"], torch.arange(3))
        assert CALLS == [("torch::load", None, True)], CALLS

        import safetensors.torch
        assert patching.is_patched(safetensors.torch.load_file)
        path = {str(tmp_path / "t.safetensors")!r}
        safetensors.torch.save_file({{"w": torch.ones(2)}}, path)
        assert torch.equal(safetensors.torch.load_file(path)["w"], torch.ones(2))
        assert CALLS[-1] == ("safetensors.torch::load_file", None, True), CALLS
        assert "diffusers" not in sys.modules and "transformers" not in sys.modules
        assert len(patching.pending_points()) == 3
        """
    )




@needs("torch", "diffusers", "transformers")
def test_diffusers_lazy_import_patches_pipeline_and_model_classmethods() -> None:
    run_script(
        """
        patching.patch(
            [P("diffusers.pipelines.pipeline_utils::DiffusionPipeline.from_pretrained"),
             P("diffusers.models.modeling_utils::ModelMixin.from_pretrained")],
            sentinel_factory,
        )
        from diffusers import DiffusionPipeline  # through diffusers' _LazyModule
        assert patching.is_patched(DiffusionPipeline.from_pretrained)
        assert patching.pending_points() == [], patching.pending_points()  # pipeline_utils imports ModelMixin
        from diffusers import StableDiffusionPipeline, UNet2DConditionModel
        assert StableDiffusionPipeline.from_pretrained("some/repo", torch_dtype=None) is SENTINEL
        assert UNet2DConditionModel.from_pretrained("other/repo", subfolder="unet") is SENTINEL
        assert CALLS == [
            ("diffusers.pipelines.pipeline_utils::DiffusionPipeline.from_pretrained",
             StableDiffusionPipeline, ("some/repo",), {"torch_dtype": None}),
            ("diffusers.models.modeling_utils::ModelMixin.from_pretrained",
             UNet2DConditionModel, ("other/repo",), {"subfolder": "unet"}),
        ], CALLS
        original = patching.get_original(
            "diffusers.pipelines.pipeline_utils", "DiffusionPipeline.from_pretrained")
        assert DiffusionPipeline.from_pretrained.__wrapped__ is original
        assert StableDiffusionPipeline.from_pretrained.__name__ == "from_pretrained"
        patching.unpatch_all()
        assert DiffusionPipeline.__dict__["from_pretrained"].__func__ is original
        """
    )


@needs("torch", "transformers")
def test_transformers_lazy_import_patches_pretrained_model_classmethod() -> None:
    run_script(
        """
        import types
        patching.patch([P("transformers.modeling_utils::PreTrainedModel.from_pretrained")],
                       sentinel_factory)
        assert "transformers" not in sys.modules
        from transformers import GPT2LMHeadModel  # through transformers' _LazyModule
        from transformers.modeling_utils import PreTrainedModel
        assert patching.is_patched(P("transformers.modeling_utils::PreTrainedModel.from_pretrained"))
        assert GPT2LMHeadModel.from_pretrained("gpt2", revision="main") is SENTINEL
        assert CALLS == [("transformers.modeling_utils::PreTrainedModel.from_pretrained",
                          GPT2LMHeadModel, ("gpt2",), {"revision": "main"})], CALLS
        original = patching.get_original("transformers.modeling_utils",
                                         "PreTrainedModel.from_pretrained")
        assert (inspect.signature(GPT2LMHeadModel.from_pretrained)
                == inspect.signature(types.MethodType(original, GPT2LMHeadModel)))
        """
    )


@needs("torch", "transformers")
def test_auto_classes_created_before_patching_are_patched_and_restored() -> None:
    # A warm interpreter imported transformers before the run's monkey_patch_all(): each Auto
    # class already holds its own copy of the original from_pretrained (copy_func).
    run_script(
        """
        from transformers import AutoModelForCausalLM, AutoModel
        copied = AutoModelForCausalLM.__dict__["from_pretrained"]
        point = P("transformers.models.auto.auto_factory::_BaseAutoModelClass.from_pretrained")
        patching.patch([point], sentinel_factory)
        assert AutoModelForCausalLM.from_pretrained("/models/lm", dtype="bfloat16") is SENTINEL
        assert AutoModel.from_pretrained("/models/enc") is SENTINEL
        assert [c[1] for c in CALLS] == [AutoModelForCausalLM, AutoModel], CALLS
        patching.unpatch_all()
        assert AutoModelForCausalLM.__dict__["from_pretrained"] is copied
        """
    )


# --- upstream signatures the wrappers rely on ----------------------------------------------------


def _params(func: object) -> list[str]:
    return list(inspect.signature(func).parameters)  # type: ignore[arg-type]


@needs("torch")
def test_torch_load_signature_unchanged() -> None:
    import torch

    params = inspect.signature(torch.load).parameters
    assert _params(torch.load)[:2] == ["f", "map_location"]
    assert params["weights_only"].kind is inspect.Parameter.KEYWORD_ONLY
    assert params["mmap"].kind is inspect.Parameter.KEYWORD_ONLY
    assert torch.load is torch.serialization.load
    assert _params(torch.jit.load)[:2] == ["f", "map_location"]


@needs("torch", "safetensors")
def test_safetensors_load_file_signature_unchanged() -> None:
    import safetensors.torch

    assert _params(safetensors.torch.load_file)[:2] == ["filename", "device"]


@needs("torch", "diffusers")
def test_diffusers_from_pretrained_signatures_unchanged() -> None:
    from diffusers.models.modeling_utils import ModelMixin
    from diffusers.pipelines.pipeline_utils import DiffusionPipeline

    for cls in (DiffusionPipeline, ModelMixin):
        assert isinstance(cls.__dict__["from_pretrained"], classmethod), cls
        assert _params(cls.from_pretrained)[0] == "pretrained_model_name_or_path", cls
    params = inspect.signature(DiffusionPipeline.from_pretrained).parameters
    assert [p.kind for p in params.values()] == [
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
        inspect.Parameter.VAR_KEYWORD,
    ]


@needs("torch", "transformers")
def test_transformers_from_pretrained_signature_unchanged() -> None:
    from transformers.modeling_utils import PreTrainedModel

    assert isinstance(PreTrainedModel.__dict__["from_pretrained"], classmethod)
    params = inspect.signature(PreTrainedModel.from_pretrained).parameters
    assert list(params)[:2] == ["pretrained_model_name_or_path", "model_args"]
    assert params["model_args"].kind is inspect.Parameter.VAR_POSITIONAL
