"""The caller's side of the one line's hand-over: which command lines and which ``__main__`` a
warm child can reproduce (Note [When a warm start applies] in overmind.client.warm_start).
End to end, through a real server: tests/integration/test_warm_start.py."""

from __future__ import annotations

import sys
import types

import pytest

from overmind.client import warm_start


@pytest.mark.parametrize("argv, expected", [
    (["python", "train.py", "--epochs", "3"], ("script", "train.py", ["--epochs", "3"], ())),
    (["python", "-u", "train.py"], ("script", "train.py", [], ("-u",))),
    (["python", "-u", "-u", "-m", "pkg.main", "x"], ("module", "pkg.main", ["x"], ("-u",))),
    (["python", "-c", "print(1)", "a"], ("code", "print(1)", ["a"], ())),
    (["python", "-X", "dev", "train.py"], None),
    (["python", "-O", "train.py"], None),
    (["python", "-uB", "train.py"], None),
    (["python", "-i", "train.py"], None),
    (["python"], None),
    (["python", "-u"], None),
])
def test_only_options_a_warm_child_reproduces_are_accepted(monkeypatch, argv, expected):
    monkeypatch.setattr(sys, "orig_argv", argv)
    assert warm_start._command() == expected


def _main(**attrs) -> types.ModuleType:
    main = types.ModuleType("__main__")
    main.__dict__.update(attrs)
    return main


def test_main_must_be_what_the_command_line_names(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    link = tmp_path / "link.py"
    link.symlink_to(script)
    assert warm_start._is_the_command(_main(__file__=str(script)), "script", str(link))
    assert not warm_start._is_the_command(_main(__file__=str(script)), "script", "/usr/bin/coverage")
    spec = types.SimpleNamespace(name="pkg.main")
    assert warm_start._is_the_command(_main(__spec__=spec), "module", "pkg.main")
    assert warm_start._is_the_command(_main(__spec__=types.SimpleNamespace(name="pkg.__main__")), "module", "pkg")
    assert not warm_start._is_the_command(_main(__spec__=types.SimpleNamespace(name="cProfile")), "module", "pkg")
    assert not warm_start._is_the_command(_main(__spec__=None), "module", "pkg")  # pdb rewrote __main__
    assert warm_start._is_the_command(_main(), "code", "print(1)")
    assert not warm_start._is_the_command(_main(__file__=str(script)), "code", "print(1)")


@pytest.mark.parametrize("source, line, expected", [
    ('"""doc"""\nfrom __future__ import annotations\nimport overmind.api\novermind.api.monkey_patch_all()\n', 4, True),
    ("import overmind.api\nfrom overmind import api\napi.monkey_patch_all()\n", 3, True),
    ("import os\nimport overmind.api\novermind.api.monkey_patch_all()\n", 3, False),
    ("import overmind.api, os\novermind.api.monkey_patch_all()\n", 2, False),
    ("x = 1\nimport overmind.api\novermind.api.monkey_patch_all()\n", 3, False),
])
def test_only_a_docstring_future_and_overmind_imports_may_come_first(source, line, expected):
    assert warm_start._only_overmind_before(source, line) is expected


def test_a_trace_function_or_profile_function_declines(monkeypatch):
    assert warm_start._watched() == ""
    monkeypatch.setattr(sys, "gettrace", lambda: (lambda *a: None))
    assert "trace or profile function" in warm_start._watched()
