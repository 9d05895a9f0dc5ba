"""``overmind run`` sees the settings plain python would, whatever the warm interpreter's imports
read from the environment (Note [Settings an import read] in overmind.shared.settings.import_env).

Real server, real front end, real torch; and a real installed module of our own.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import pytest

from .conftest import overmind_run, plain_python, runs_forked, started_warm_server, wait_warm

INDUCTOR = {"TORCHINDUCTOR_FX_GRAPH_CACHE": "0", "TORCHINDUCTOR_COMPILE_THREADS": "1",
            "TORCHINDUCTOR_MAX_AUTOTUNE": "1", "TORCHDYNAMO_VERBOSE": "1"}

SETTINGS = """
import json, sys
held = "torch._inductor.config" in sys.modules
import torch._inductor.config as inductor, torch._dynamo.config as dynamo
print(json.dumps({"held": held, "settings": [inductor.fx_graph_cache, inductor.compile_threads,
                                             inductor.max_autotune, dynamo.verbose]}))
"""


@pytest.fixture(scope="module")
def env_server():  # a server of its own: what its interpreters learn stays out of test_run's
    yield from started_warm_server("om-env-")


def _until_warm_and_held(server, args, env, cwd, check, timeout: float = 150) -> list:
    """Run until a run was forked from an interpreter that held the module; every output on the
    way is checked by ``check`` (plain or warm, each must see its own settings)."""
    seen = []
    deadline = time.monotonic() + timeout
    while True:
        wait_warm(server)
        before = runs_forked(server)
        proc = overmind_run(server, *args, env=env, cwd=cwd)
        assert proc.returncode == 0, proc.stderr[-3000:]
        forked = runs_forked(server) > before
        seen.append((forked, proc.stdout))
        check(proc.stdout)
        if forked and proc.stdout.startswith(("{\"held\": true", "True ")):
            return seen
        assert time.monotonic() < deadline, f"never warm with the module held: {seen}\n{server.log()[-3000:]}"
        time.sleep(0.3)


def test_inductor_and_dynamo_settings_are_plain_pythons_after_an_interpreter_learned_them_without(env_server,
                                                                                                    tmp_path):
    script = tmp_path / "settings.py"
    script.write_text(SETTINGS)
    env_without = env_server.client_env()
    env_with = env_server.client_env(**INDUCTOR)
    plain_without = json.loads(plain_python(str(script), env=env_without, cwd=tmp_path).stdout)["settings"]
    plain_with = json.loads(plain_python(str(script), env=env_with, cwd=tmp_path).stdout)["settings"]
    assert plain_with != plain_without  # the settings do change what plain python sees

    def sees(expected):
        return lambda out: (json.loads(out)["settings"] == expected
                            or pytest.fail(f"saw {out.strip()}, plain python sees {expected}"))

    # The interpreter learns torch._inductor.config from runs without the settings...
    _until_warm_and_held(env_server, [str(script)], env_without, tmp_path, sees(plain_without))
    # ...then a run with them sees them (plain once, saying why), and soon runs warm with them.
    runs = _until_warm_and_held(env_server, [str(script)], env_with, tmp_path, sees(plain_with))
    assert not runs[0][0], runs  # never from the interpreter imported without them
    # The first interpreter still serves the environment it imported under.
    _until_warm_and_held(env_server, [str(script)], env_without, tmp_path, sees(plain_without))


LIBRARY = """
import os
FLAVOUR = os.environ.get("{name}_FLAVOUR", "plain")  # a keyed read, of a name no list holds
EXTRAS = sorted(k for k, v in os.environ.items() if k.startswith("{name}_EXTRA_"))  # an iteration
"""


def _prefix() -> str:
    return f"ENVLIB{os.getpid()}"  # matches no prefix overmind keys on (nor OVERMIND_, never recorded)


@pytest.fixture
def envlib():
    """A module under site-packages (installed code a warm interpreter may hold) that keeps
    settings of arbitrary names read at import."""
    name = f"overmind_test_envlib_{os.getpid()}"
    path = Path(sysconfig.get_paths()["purelib"]) / f"{name}.py"
    path.write_text(LIBRARY.format(name=_prefix()))
    os.utime(path, (time.time() - 60, time.time() - 60))
    yield name
    path.unlink()


def test_an_installed_librarys_own_setting_read_at_import_is_the_runs_own(env_server, tmp_path, envlib):
    script = tmp_path / "flavour.py"
    script.write_text(f"import sys\nheld = {envlib!r} in sys.modules\nimport {envlib} as lib\n"
                      "print(held, lib.FLAVOUR, lib.EXTRAS)\n")
    upper = _prefix()

    def sees(flavour, extras):
        return lambda out: (out.split(" ", 1)[1] == f"{flavour} {extras}\n"
                            or pytest.fail(f"saw {out.strip()!r}, plain python sees {flavour} {extras}"))

    _until_warm_and_held(env_server, [str(script)], env_server.client_env(), tmp_path, sees("plain", []))
    spicy = env_server.client_env(**{f"{upper}_FLAVOUR": "spicy"})
    _until_warm_and_held(env_server, [str(script)], spicy, tmp_path, sees("spicy", []))
    extra = env_server.client_env(**{f"{upper}_EXTRA_A": "1"})  # no name read: a prefix iterated
    _until_warm_and_held(env_server, [str(script)], extra, tmp_path, sees("plain", [f"{upper}_EXTRA_A"]))


def test_the_first_run_of_a_context_starts_an_interpreter_under_its_settings_so_no_later_run_goes_plain(
        tmp_path, envlib, make_server):  # the server stops before envlib's module goes
    """Note [A run's interpreter imports under the run's environment] in overmind.server.pool: a
    shell that sets a variable some installed import reads (TORCHINDUCTOR_CACHE_DIR, say) gets its
    warm runs from the second on, not a second plain run while another interpreter imports."""
    script = tmp_path / "flavour.py"
    script.write_text(f"import sys\nheld = {envlib!r} in sys.modules\nimport {envlib} as lib\n"
                      "print(held, lib.FLAVOUR, lib.EXTRAS)\n")
    server = make_server()
    spicy = server.client_env(**{f"{_prefix()}_FLAVOUR": "spicy"})
    first = overmind_run(server, str(script), env=spicy, cwd=tmp_path)  # no interpreter yet: plain, and one starts
    assert first.returncode == 0 and first.stdout == "False spicy []\n", first.stderr[-3000:]
    assert runs_forked(server) == 0
    runs = _until_warm_and_held(server, [str(script)], spicy, tmp_path,
                                lambda out: out.split(" ", 1)[1] == "spicy []\n" or pytest.fail(out))
    assert all(forked for forked, _ in runs), f"a run went plain on the way: {runs}\n{server.log()[-3000:]}"
    assert len([z for z in server.status()["interpreters"] if z["alive"]]) == 1, server.status()["interpreters"]


class _Autostarted:
    """The server the first `overmind run` of a shell started, as the tests' ServerProcess is used."""

    def __init__(self, env: dict) -> None:
        self.env = env

    def client_env(self) -> dict:
        return dict(self.env)

    def status(self) -> dict:
        from overmind.shared import protocol as P
        from overmind.client.connection import LoadingConnection
        from overmind.shared.settings.config import Config

        with LoadingConnection.open(Config.from_env(self.env), role="cli", autostart=False) as conn:
            return conn.simple(P.Status(), P.StatusReply).info

    def log(self) -> str:
        try:
            return (Path(self.env["OVERMIND_RUNTIME_DIR"]) / "server.log").read_text()
        except OSError:
            return ""

    def wait_listening(self, timeout: float = 60) -> None:
        """Until the server the first run started (detached) listens."""
        socket_path = Path(self.env["OVERMIND_RUNTIME_DIR"]) / "server.sock"
        deadline = time.monotonic() + timeout
        while not socket_path.exists() and time.monotonic() < deadline:
            time.sleep(0.02)

    def shutdown(self, check: bool = False) -> None:
        subprocess.run([sys.executable, "-m", "overmind.frontend.cli", "shutdown"], env=self.env, capture_output=True,
                       timeout=60, check=check)


@pytest.mark.parametrize("patched", [False, True], ids=["plain script", "monkey_patch_all at its top"])
def test_a_setting_of_the_users_shell_reaches_the_interpreter_of_a_server_its_first_run_autostarted(tmp_path, envlib,
                                                                                                    patched):
    """Note [A run's interpreter imports under the run's environment] in overmind.server.pool, when
    no server runs yet: run 1 starts one and goes plain, and its report (the first run's Prepare)
    carries the run's environment, so run 2 is forked and sees the shell's value. So does the
    Prepare of ``monkey_patch_all()``, which may reach the server first."""
    from ..conftest import child_env

    script = tmp_path / "flavour.py"
    # torch first, as the scripts of users do: the run outlasts the start of the server it started.
    script.write_text(("import overmind.api\novermind.api.monkey_patch_all()\n" if patched else "") +
                      f"import sys\nheld = {envlib!r} in sys.modules\nimport torch\nimport {envlib} as lib\n"
                      "print(held, lib.FLAVOUR, lib.EXTRAS)\n")
    runtime = Path(tempfile.mkdtemp(prefix="om-env-auto-", dir="/tmp"))
    env = child_env(OVERMIND_RUNTIME_DIR=str(runtime), **{f"{_prefix()}_FLAVOUR": "spicy"})
    server = _Autostarted(env)
    try:
        first = overmind_run(server, str(script), env=env, cwd=tmp_path)  # no server: starts one, runs plainly
        assert first.returncode == 0 and first.stdout == "False spicy []\n", first.stderr[-3000:]
        server.wait_listening()
        runs = _until_warm_and_held(server, [str(script)], env, tmp_path,
                                    lambda out: out.split(" ", 1)[1] == "spicy []\n" or pytest.fail(out))
        assert all(forked for forked, _ in runs), f"a run went plain on the way: {runs}\n{server.log()[-3000:]}"
    finally:
        server.shutdown()
        shutil.rmtree(runtime, ignore_errors=True)


def test_the_server_a_first_run_autostarts_starts_that_runs_interpreter_at_once_and_no_run_sees_how(tmp_path):
    """Note [The server a first run starts prepares its interpreter] in overmind.server.daemon: the
    server that run 1 starts starts run 1's warm interpreter as it starts (this run 1 ends before
    it could report anything), run 2 forks from that one interpreter, and the variable that named
    it reaches neither run."""
    from overmind.shared.settings.config import PREPARE_VARIABLE
    from ..conftest import child_env

    script = tmp_path / "named.py"
    script.write_text(f"import os\nprint(os.environ.get({PREPARE_VARIABLE!r}))\n")
    runtime = Path(tempfile.mkdtemp(prefix="om-env-first-", dir="/tmp"))
    env = child_env(OVERMIND_RUNTIME_DIR=str(runtime))
    server = _Autostarted(env)
    try:
        first = overmind_run(server, str(script), env=env, cwd=tmp_path)  # no server: starts one, runs plainly
        assert first.returncode == 0 and first.stdout == "None\n", first.stderr[-3000:]
        server.wait_listening()
        wait_warm(server)
        second = overmind_run(server, str(script), env=env, cwd=tmp_path)
        assert second.returncode == 0 and second.stdout == "None\n", second.stderr[-3000:]
        assert runs_forked(server) == 1, server.log()[-3000:]  # forked
        lines = server.log().splitlines()
        started = [line for line in lines if "started warm interpreter" in line]
        assert len(started) == 1 and "0 modules to import" in started[0], "\n".join(lines[-40:])
    finally:
        server.shutdown()
        shutil.rmtree(runtime, ignore_errors=True)


def test_a_server_stopped_while_the_interpreter_it_started_imports_logs_no_warning(tmp_path):
    """Shutting down the server a first run started, before the warm interpreter it started for
    that run is ready, ends that interpreter and the wait for it quietly."""
    from ..conftest import child_env

    runtime = Path(tempfile.mkdtemp(prefix="om-env-stop-", dir="/tmp"))
    env = child_env(OVERMIND_RUNTIME_DIR=str(runtime))
    server = _Autostarted(env)
    try:
        first = overmind_run(server, "-c", "pass", env=env, cwd=tmp_path)  # no server: starts one
        assert first.returncode == 0, first.stderr[-3000:]
        server.wait_listening()
        server.shutdown(check=True)
        log = (runtime / "server.log").read_text()
        assert "starting the warm interpreter" in log and "overmind-server stopped" in log, log[-3000:]
        assert [line for line in log.splitlines() if " WARNING " in line] == [], log[-3000:]
    finally:
        shutil.rmtree(runtime, ignore_errors=True)


def test_a_learned_module_whose_import_failed_fails_later_imports_as_plain_python_does(tmp_path, make_server):
    """Note [A failed import is not a refusal] in overmind.warm.interpreter: a report named a
    module whose import failed (it was in sys.modules while it imported); the interpreter's
    later import of a module that catches that ImportError succeeds, as in plain python, rather
    than failing part-way after registering itself, which killed the runs forked from it."""
    from overmind.shared import protocol as P
    from overmind.shared.settings.config import Config, selecting_environment
    from overmind.shared.protocol.connect import Connection

    tag = os.getpid()
    registry, missing, guarded = (f"overmind_test_{what}_{tag}" for what in ("registry", "needs_more", "guarded"))
    sources = {
        registry: "REGISTERED = set()\n",
        missing: "raise ImportError('needs a package that is not installed')\n",
        guarded: (f"import {registry} as registry\nassert 'g' not in registry.REGISTERED, 'registered twice'\n"
                  f"registry.REGISTERED.add('g')\ntry:\n    import {missing}\nexcept ImportError:\n"
                  "    HAS = False\nelse:\n    HAS = True\n"),
    }
    purelib = Path(sysconfig.get_paths()["purelib"])
    for name, source in sources.items():
        (purelib / f"{name}.py").write_text(source)
        os.utime(purelib / f"{name}.py", (time.time() - 60, time.time() - 60))
    script = tmp_path / "guarded.py"
    script.write_text(f"import sys\nheld = {guarded!r} in sys.modules\nimport {guarded} as g\nprint(held, g.HAS)\n")
    server = make_server()
    try:
        overmind_run(server, "-c", "pass")  # refused: starts the warm interpreter
        wait_warm(server)
        env = server.client_env()
        context = {"python": os.path.abspath(sys.executable), "env": selecting_environment(env),
                   "cwd": str(tmp_path), "sys_path": list(sys.path)}
        with Connection.open(Config.from_env(env), autostart=False) as conn:  # what such a report says
            conn.simple(P.Prepare(context, modules=[missing, guarded]), P.Ok)
        seen = []
        deadline = time.monotonic() + 120
        while not seen or seen[-1] != (True, "True False\n"):
            assert time.monotonic() < deadline, f"never forked with {guarded} held: {seen}\n{server.log()[-3000:]}"
            before = runs_forked(server)
            proc = overmind_run(server, str(script), env=env, cwd=tmp_path)
            assert proc.returncode == 0 and proc.stdout.endswith(" False\n"), (proc.stderr[-3000:], seen)
            seen.append((runs_forked(server) > before, proc.stdout))
            time.sleep(0.3)
    finally:
        server.stop()
        for name in sources:
            (purelib / f"{name}.py").unlink()


READ_ENV = """
import os


def read(name):
    return {"value": os.environ.get(name)}
"""


def test_a_load_forked_from_an_interpreter_a_run_started_sees_its_contexts_environment_not_that_runs(
        tmp_path, make_server):
    """The first run's interpreter imports under that run's whole environment; a loader forked
    from it for another client's load keeps only what selects the context (overmind.warm.loader)."""
    (tmp_path / "readenv.py").write_text(READ_ENV)
    name = f"SHELL_ONLY_{os.getpid()}"  # no prefix overmind keys on
    server = make_server()
    first = overmind_run(server, "-c", "pass", env=server.client_env(**{name: "the first shell's"}), cwd=tmp_path)
    assert first.returncode == 0 and runs_forked(server) == 0, first.stderr[-3000:]  # plain; an interpreter starts
    wait_warm(server)
    client = ("import json, overmind.api, readenv\n"
              f"print(json.dumps(overmind.api.load(readenv.read, {name!r})))\n")
    proc = subprocess.run([sys.executable, "-c", client], env=server.client_env(OVERMIND_COLD="wait", OVERMIND_STRICT="1"),
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout) == {"value": None}, server.log()[-3000:]  # the loader's answer, waited for
    assert len([z for z in server.status()["interpreters"] if z["alive"]]) == 1, server.status()["interpreters"]


def test_a_lineage_keeps_one_interpreter_for_runs_and_loads_and_one_started_for_a_load_imports_under_the_last_run(
        tmp_path, envlib, make_server):
    """Note [One interpreter per lineage] in overmind.server.interpreters: once runs were forked (the
    interpreter is filed under its own value of the setting its imports read), a client's load
    forks from it rather than starting a second; and after it retired, the interpreter a load
    starts imports under the last run's environment, so the next run is forked, not plain."""
    (tmp_path / "readenv.py").write_text(READ_ENV)
    script = tmp_path / "flavour.py"
    script.write_text(f"import sys\nheld = {envlib!r} in sys.modules\nimport {envlib} as lib\n"
                      "print(held, lib.FLAVOUR, lib.EXTRAS)\n")
    server = make_server({"OVERMIND_WARM_MAX": "1"})

    def load(name: str, **extra) -> None:
        client = f"import json, overmind.api, readenv\nprint(json.dumps(overmind.api.load(readenv.read, {name!r})))\n"
        proc = subprocess.run([sys.executable, "-c", client], cwd=tmp_path, capture_output=True, text=True,
                              timeout=120, env=server.client_env(OVERMIND_COLD="wait", OVERMIND_STRICT="1", **extra))
        assert proc.returncode == 0 and json.loads(proc.stdout) == {"value": None}, proc.stderr[-3000:]

    def started() -> int:
        return server.log().count("started warm interpreter")

    spicy = server.client_env(**{f"{_prefix()}_FLAVOUR": "spicy"})
    first = overmind_run(server, str(script), env=spicy, cwd=tmp_path)  # plain; an interpreter starts under it
    assert first.returncode == 0 and first.stdout == "False spicy []\n", first.stderr[-3000:]
    _until_warm_and_held(server, [str(script)], spicy, tmp_path,
                         lambda out: out.split(" ", 1)[1] == "spicy []\n" or pytest.fail(out))
    before = runs_forked(server)
    again = overmind_run(server, str(script), env=spicy, cwd=tmp_path)  # forked from it, now filed under its value
    assert again.stdout == "True spicy []\n" and runs_forked(server) == before + 1, server.log()[-3000:]
    assert started() == 1, server.log()[-3000:]
    load("A")
    assert started() == 1, server.log()[-3000:]  # the load forked from the runs' interpreter
    load("B", OPENBLAS_NUM_THREADS="1")  # another context: its interpreter retires ours (OVERMIND_WARM_MAX=1)
    assert started() == 2 and "retiring warm interpreter" in server.log(), server.log()[-3000:]
    load("C")  # the lineage has none now: this load starts one
    assert started() == 3, server.log()[-3000:]
    wait_warm(server)
    before = runs_forked(server)
    proc = overmind_run(server, str(script), env=spicy, cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout == "True spicy []\n", proc.stderr[-3000:]
    assert runs_forked(server) == before + 1, f"the run went plain\n{server.log()[-3000:]}"
