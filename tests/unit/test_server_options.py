"""overmind-server's flags (overmind.server.options): one for each server setting, its variable the
fallback, checked as the variable is. Each test runs the real parser and reads the result with
Config.from_env, as overmind.server.daemon.main does."""

from __future__ import annotations

import subprocess
import sys
import pytest

from overmind.server import options
from overmind.server.options import SETTINGS
from overmind.shared.settings import config
from overmind.shared.settings.config import Config

from ..conftest import REPO, child_env, run_python

# Config's fields that only clients read: every other field is the server's and needs a flag.
CLIENT_FIELDS = {"disable", "strict", "timeout", "reply_timeout", "autostart", "cold_wait"}

# Two good values of each flag, neither its default; a flag added to SETTINGS needs its pair here.
VALUES = {
    "--runtime-dir": ("/tmp/om-a", "/tmp/om-b"),
    "--state-dir": ("/tmp/om-state-a", "/tmp/om-state-b"),
    "--max-memory": ("40G", "512M"),
    "--restore": ("1G", "50%"),
    "--settle-after": ("5", "never"),
    "--fill-yield": ("0", "7.5"),
    "--workers": ("3", "5"),
    "--loader-timeout": ("60", "90"),
    "--warm-max": ("1", "7"),
    "--warm-memory": ("1G", "2G"),
    "--warm-idle": ("10", "20"),
    "--headroom": ("2G", "5%"),
    "--log-level": ("debug", "ERROR"),
}
YES_NO = {"--keep-file-pages"}

BAD = [
    ("--max-memory", "lots", "40G, 512M, 60% or a number of bytes"),
    ("--warm-memory", "0%", "40G, 512M, 60% of the memory this process may use or a number of bytes"),
    ("--headroom", "lots", "use 40G, 512M, 60% or a number of bytes"),
    ("--restore", "half", "40G, 512M, a number of bytes, 60% of the memory budget, or 0"),
    ("--settle-after", "-1", "a number of seconds, at least 0, or never; default 30"),
    ("--fill-yield", "soon", "a number of seconds, at least 0; default 120"),
    ("--workers", "2.5", "a whole number, at least 1; default 2"),
    ("--loader-timeout", "inf", "a number of seconds, at least 1; default 3600"),
    ("--warm-max", "0", "a whole number, at least 1; default 4"),
    ("--warm-idle", "nan", "a number of seconds, at least 1; default 1800"),
    ("--log-level", "LOUD", "DEBUG, INFO, WARNING, ERROR, CRITICAL; default INFO"),
]


def _config(argv: list[str], environ: dict | None = None) -> Config:
    args, env = options.parse(argv, environ or {})
    return Config.from_env(env)


def _changed(config: Config) -> set[str]:
    default = Config.from_env({})
    return {name for name in Config.__slots__ if getattr(config, name) != getattr(default, name)}


def test_every_server_setting_has_a_flag_named_after_its_variable():
    flags = {s.flag for s in SETTINGS}
    assert flags == set(VALUES) | YES_NO
    for s in SETTINGS:
        assert s.flag == "--" + s.variable.removeprefix("OVERMIND_").lower().replace("_", "-")
    # Each flag sets a field, and together they set every field the server reads.
    covered = set()
    for flag, values in VALUES.items():
        for value in values:
            changed = _changed(_config([flag, value]))
            assert changed and not changed & CLIENT_FIELDS, (flag, value, changed)
            covered |= changed
    covered |= _changed(_config(["--no-keep-file-pages"]))
    assert covered == set(Config.__slots__) - CLIENT_FIELDS


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: s.flag)
def test_a_flag_wins_over_its_variable_and_the_variable_is_the_fallback(setting):
    if setting.metavar is None:  # yes/no: --name and --no-name, either way round
        for variable, argv, expected in (("0", [setting.flag], True), ("1", ["--no-" + setting.flag[2:]], False)):
            environ = {setting.variable: variable}
            assert getattr(_config(argv, environ), setting.dest) is expected
            assert getattr(_config([], environ), setting.dest) is not expected
        return
    by_env, by_flag = VALUES[setting.flag]
    environ = {setting.variable: by_env}
    assert _config([setting.flag, by_flag], environ) == Config.from_env({setting.variable: by_flag})
    assert _config([], environ) == Config.from_env(environ) != Config.from_env({setting.variable: by_flag})
    # The other variables stay as they were.
    assert options.parse([setting.flag, by_flag], {"HOME": "/h", "OVERMIND_COLD": "wait"})[1] == \
        {"HOME": "/h", "OVERMIND_COLD": "wait", setting.variable: by_flag}


@pytest.mark.parametrize("flag, value, accepted", BAD, ids=[b[0] for b in BAD])
def test_a_bad_flag_value_exits_2_naming_the_flag_and_what_is_accepted(flag, value, accepted, capsys):
    with pytest.raises(SystemExit) as exit:
        options.parse([flag, value], {})
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert f"overmind-server: error: argument {flag}: {value!r} " in err and accepted in err, err


def test_every_flag_with_a_value_is_checked():
    assert {flag for flag, _, _ in BAD} == set(VALUES) - {"--runtime-dir", "--state-dir"}  # paths: any


def test_help_lists_every_flag_with_its_variable_and_default_and_exits_0():
    proc = subprocess.run([sys.executable, "-m", "overmind.server", "--help"], env=child_env(), capture_output=True,
                          text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())  # argparse wraps lines
    for s in SETTINGS:
        assert s.flag in text and s.variable in text, s
    assert "--no-keep-file-pages" in text and "--foreground" in text and "--daemon" in text
    for said in ("(default 4; OVERMIND_WARM_MAX)", "(default 8G; OVERMIND_WARM_MEMORY)", "(default 30; OVERMIND_SETTLE",
                 "(default 50% of that memory; OVERMIND_MAX_MEMORY)", "(default --keep-file-pages; OVERMIND_KEEP_FILE_PAGES)"):
        assert said in text, said


def test_a_bad_flag_stops_the_real_server_before_it_starts(tmp_path):
    runtime_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "overmind.server", "--foreground", "--runtime-dir", str(runtime_dir),
                           "--workers", "0"], env=child_env(), capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 2 and "argument --workers: '0' is out of range" in proc.stderr, proc.stderr
    assert not runtime_dir.exists()


def test_the_config_docstring_names_the_server_settings_of_the_table_and_no_test_seam_is_in_readme():
    doc = config.__doc__
    server_part = doc[doc.index("The server's settings"):doc.index("Seams for tests")]
    named = {word.strip("`,.") for word in server_part.split() if word.strip("`,.").startswith("OVERMIND_")}
    assert named == {s.variable for s in SETTINGS}
    readme = (REPO / "README.md").read_text()
    table = readme[readme.index("## Settings"):].split("\n## ")[0]
    for seam in ("OVERMIND_PRESTART", "OVERMIND_QUICK_EXIT", "OVERMIND_NO_AUTOSTART"):
        assert seam not in table and seam in doc[doc.index("Seams for tests"):]
    for s in SETTINGS:  # README's table names every server setting by its flag
        assert f"`{s.flag}`" in table, s.flag


def test_the_server_with_its_parser_imports_the_standard_library_only():
    out = run_python("""
        import sys
        from overmind.server.daemon import Config
        from overmind.server.options import parse
        Config.from_env(parse(["--max-memory", "40G", "--log-level", "debug"], {})[1])
        print(sorted({m.partition(".")[0] for m in sys.modules} - set(sys.stdlib_module_names)
              - {"overmind", "__main__", "_distutils_hack"}))  # the latter: setuptools' .pth hook at start-up
    """)
    assert out.stdout.splitlines()[-1] == "[]", out.stdout
