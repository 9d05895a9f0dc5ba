"""overmind.shared.settings.config: every bad OVERMIND_* value is named with what is accepted, and never raises
where a script reads it (Note [A bad setting never stops a script]). Each case runs in a fresh
interpreter: a bad value is told once per process, so a process is the unit that counts."""

from __future__ import annotations

import json

import pytest

from ..conftest import child_env, run_python

READ = """
import json, warnings
warnings.simplefilter("always")
caught = []
warnings.showwarning = lambda message, category, *a, **k: caught.append(f"{{category.__name__}}: {{message}}")
from overmind.shared import patching
from overmind.shared.settings import config
values = [{call} for _ in range(3)]  # read three times: told once
print(json.dumps({{"values": values, "warnings": caught}}))
"""


def _read(call: str, **env: str) -> dict:
    proc = run_python(READ.format(call=call), env=child_env(**env))
    return json.loads(proc.stdout)


@pytest.mark.parametrize("value, expected", [("1", True), ("TRUE", True), (" yes ", True), ("On", True),
                                             ("0", False), ("false", False), ("NO", False), ("off", False),
                                             ("", None)])
@pytest.mark.parametrize("default", [False, True])
def test_every_accepted_yes_no_spelling_reads_without_a_warning_and_empty_is_the_default(value, expected, default):
    out = _read(f'config.flag("OVERMIND_STRICT", default={default})', OVERMIND_STRICT=value)
    assert out == {"values": [default if expected is None else expected] * 3, "warnings": []}


@pytest.mark.parametrize("name, call, default", [
    ("OVERMIND_STRICT", 'config.flag("OVERMIND_STRICT")', False),
    ("OVERMIND_DISABLE", "config.patching_disabled()", False),
    ("OVERMIND_PRESTART", "config.prestart_enabled()", True),
    ("OVERMIND_NO_AUTOSTART", "config.Config.from_env().autostart", True),
])
def test_a_bad_yes_no_value_warns_once_naming_it_and_the_spellings_and_acts_as_the_default(name, call, default):
    out = _read(call, **{name: "banana"})
    assert out["values"] == [default] * 3
    [warning] = out["warnings"]
    assert warning.startswith(f"RuntimeWarning: overmind: {name}='banana' is not a yes/no value"), warning
    assert "1, true, yes, on; 0, false, no, off or empty" in warning


def test_bad_patch_points_are_left_out_with_one_warning_each_and_the_good_ones_kept():
    out = _read("patching.env_patch_points()", OVERMIND_PATCH="garbage, json::loads ,a.b::")
    assert out["values"] == ["json::loads"] * 3
    assert len(out["warnings"]) == 2, out["warnings"]
    assert all("OVERMIND_PATCH" in w and "module::Qualname.attr" in w for w in out["warnings"])
    assert "'garbage'" in out["warnings"][0] and "'a.b::'" in out["warnings"][1]


@pytest.mark.parametrize("name, value, accepted", [
    ("OVERMIND_LOG_LEVEL", "LOUD", "DEBUG, INFO, WARNING, ERROR, CRITICAL"),
    ("OVERMIND_COLD", "maybe", "background, wait"),
    ("OVERMIND_TIMEOUT", "abc", "a number of seconds, at least 0.1"),
    ("OVERMIND_REPLY_TIMEOUT", "inf", "a number of seconds, at least 0.1"),
    ("OVERMIND_FILL_YIELD", "nan", "a number of seconds, at least 0"),
    ("OVERMIND_SETTLE_AFTER", "-1", "a number of seconds, at least 0, or never; default 30"),
    ("OVERMIND_WORKERS", "2.5", "a whole number, at least 1"),
    ("OVERMIND_WARM_MAX", "0", "a whole number, at least 1"),
    ("OVERMIND_MAX_MEMORY", "lots", "40G, 512M, 60%"),
    ("OVERMIND_WARM_MEMORY", "0%", "40G, 512M, 60%"),
])
def test_a_bad_value_is_a_config_error_naming_the_variable_and_what_is_accepted(name, value, accepted):
    from overmind.shared.settings.config import Config, ConfigError

    with pytest.raises(ConfigError) as err:
        Config.from_env({name: value})
    assert str(err.value).startswith(f"{name}={value!r} ") and accepted in str(err.value), str(err.value)


def test_idle_settling_waits_30_s_by_default_never_or_empty_turns_it_off_and_zero_means_at_once():
    from overmind.shared.settings.config import Config

    assert Config.from_env({}).settle_after == 30.0  # Note [Settling file segments] in overmind.server.settle
    assert Config.from_env({"OVERMIND_SETTLE_AFTER": " "}).settle_after is None
    assert Config.from_env({"OVERMIND_SETTLE_AFTER": "Never"}).settle_after is None
    assert Config.from_env({"OVERMIND_SETTLE_AFTER": "0"}).settle_after == 0.0
    assert Config.from_env({"OVERMIND_SETTLE_AFTER": "7.5"}).settle_after == 7.5
    assert Config.from_env({}).keep_file_pages and not Config.from_env({"OVERMIND_KEEP_FILE_PAGES": "0"}).keep_file_pages


def test_every_bad_value_is_named_at_once_and_good_values_are_read_in_any_case():
    from overmind.shared.settings.config import Config, ConfigError

    with pytest.raises(ConfigError) as err:
        Config.from_env({"OVERMIND_COLD": "maybe", "OVERMIND_LOG_LEVEL": "LOUD", "OVERMIND_WORKERS": "-1"})
    assert all(name in str(err.value) for name in ("OVERMIND_COLD", "OVERMIND_LOG_LEVEL", "OVERMIND_WORKERS"))
    config = Config.from_env({"OVERMIND_COLD": " Wait ", "OVERMIND_LOG_LEVEL": "debug", "OVERMIND_WORKERS": "3"})
    assert (config.cold_wait, config.log_level, config.workers) == (True, "DEBUG", 3)


def test_the_server_gets_bad_yes_no_values_as_notes_to_log_not_as_warnings():
    from overmind.shared.settings.config import Config

    notes: list[str] = []
    config = Config.from_env({"OVERMIND_STRICT": "banana"}, notes=notes)
    assert config.strict is False and len(notes) == 1 and "OVERMIND_STRICT='banana'" in notes[0]


def test_the_environment_that_selects_an_interpreter_leaves_a_terminals_own_variables_out():
    from overmind.shared.settings.config import selecting_environment

    env = {"TORCH_HOME": "/t", "HF_HUB_OFFLINE": "1", "PYTHONPATH": "/p", "OMP_NUM_THREADS": "2",
           "DISPLAY": ":0", "SSH_TTY": "/dev/pts/1", "TERM": "xterm", "MY_SCRIPT_FLAG": "x"}
    assert selecting_environment(env) == {"TORCH_HOME": "/t", "HF_HUB_OFFLINE": "1", "PYTHONPATH": "/p",
                                          "OMP_NUM_THREADS": "2"}


def test_an_empty_environment_reads_as_the_defaults_a_config_is_built_with():
    from overmind.shared.settings.config import Config

    read = Config.from_env({"HOME": "/home/someone"})
    built = Config(read.runtime_dir, state_dir=read.state_dir)
    assert read == built, (read, built)
