"""The ``overmind`` command against a real overmind-server subprocess."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from overmind.shared.segments import hugepages

from ..conftest import REPO, age_files, build_shared_library, child_env

LOAD_UNET = """
import overmind.api
overmind.api.monkey_patch_all()
from diffusers import UNet2DConditionModel
UNet2DConditionModel.from_pretrained({path!r})
"""

LOAD_TENSORS = """
import overmind.api
overmind.api.monkey_patch_all()
import torch
for path in {paths!r}:
    torch.load(path)
"""


def _json(proc: subprocess.CompletedProcess):
    return json.loads(proc.stdout)


def _load_unet(server, models) -> None:
    # Strict: a fallback to a plain load would leave the cache untouched and hide the failure.
    server.run(LOAD_UNET.format(path=str(models["unet"])), env=server.client_env(OVERMIND_STRICT="1"))


def _cli_without_server(runtime_dir, *args: str) -> subprocess.CompletedProcess:
    env = child_env(OVERMIND_RUNTIME_DIR=str(runtime_dir), OVERMIND_NO_AUTOSTART="1")
    return subprocess.run([sys.executable, "-m", "overmind.frontend.cli", *args], env=env, capture_output=True, text=True,
                          timeout=60, cwd=REPO)


def _huge_pages_around(run) -> tuple[object, list[str]]:
    """Run ``run`` and the settings read just before and after it: the setting is machine-wide,
    and a benchmark may switch it (and back) while a test runs."""
    before = hugepages.read_status()
    result = run()
    return result, [before.setting, hugepages.read_status().setting]


def _check_huge_pages(report: dict, settings: list[str]) -> None:
    assert report["setting"] in settings
    assert report == {**hugepages.read_status().as_dict(), **{k: report[k] for k in VARYING}}
    if report["size_setting"] in (None, "inherit"):  # else the 2 MiB size's own setting decides
        assert report["enabled"] is (report["setting"] in hugepages.ALLOWING)
    assert report["command"] == "echo advise | sudo tee /sys/kernel/mm/transparent_hugepage/shmem_enabled"
    assert report["why_not"] is None if report["enabled"] else "shmem_enabled" in report["why_not"]


# What changes from one reading to the next on a shared machine.
VARYING = ("setting", "enabled", "why_not", "shmem_huge_bytes", "shmem_pmd_mapped_bytes")


def _check_huge_page_text(out: str, settings: list[str]) -> None:
    line = next(line for line in out.splitlines() if line.startswith("huge pages"))
    shown = re.match(r"huge pages  (on|off) \(shmem_enabled (\w+)", line)
    assert shown and shown[2] in settings, line
    assert "of shared memory in huge pages" in line
    if shown[1] == "off":
        assert shown[2] not in hugepages.ALLOWING or hugepages.read_status().size_setting not in (None, "inherit")
        assert "why:" in out and "cost:" in out and "overmind-bench" in out
        assert "turn on:  echo advise | sudo tee /sys/kernel/mm/transparent_hugepage/shmem_enabled" in out
    else:
        assert "turn on:" not in out


def test_status_json_on_fresh_server_reports_its_pid_and_zero_counters(server):
    proc, settings = _huge_pages_around(lambda: server.cli("status", "--json"))
    info = _json(proc)
    assert info["pid"] == server.pid
    assert (info["entries"], info["hits"], info["misses"]) == (0, 0, 0)
    assert info["torch_imported"] is False
    # The server's info dict as is, plus the huge-page report the CLI reads itself.
    now = server.status()  # what is available changes from one look to the next
    assert info == {**now, "uptime": info["uptime"], "interpreters": info["interpreters"],
                    "peers": info["peers"], "huge_pages": info["huge_pages"],
                    "memory": {**now["memory"], "available": info["memory"]["available"]}}
    assert info["memory"]["limit"] > 0 and info["memory"]["headroom"] > 0 and info["memory"]["events"] == 0
    assert info["peers"] == {"cli": 1}  # this connection; status() above made the next
    _check_huge_pages(info["huge_pages"], settings)


def test_status_human_output_shows_pid_entries_and_huge_pages(server):
    proc, settings = _huge_pages_around(lambda: server.cli("status"))
    out = proc.stdout
    assert str(server.pid) in out
    assert "entries" in out
    assert "uptime" in out
    _check_huge_page_text(out, settings)


def test_list_and_status_reflect_a_cached_load_and_then_a_hit(server, models):
    assert _json(server.cli("list", "--json")) == []
    _load_unet(server, models)
    lines = server.cli("list").stdout.strip().splitlines()
    assert len(lines) == 2, lines  # header + one entry
    assert "UNet2DConditionModel" in lines[1]
    entries = _json(server.cli("list", "--json"))
    assert len(entries) == 1 and lines[1].startswith(entries[0]["key"][:16])
    info = _json(server.cli("status", "--json"))
    assert (info["entries"], info["misses"], info["hits"]) == (1, 1, 0)
    assert info["bytes"] > 0
    status = server.cli("status").stdout
    for field in ("used", "budget", "evictions", "stale_misses", "OWNED", "SHARED", "HITS", "LAST USE"):
        assert field in status, status
    assert entries[0]["key"][:16] in status and "UNet2DConditionModel" in status

    _load_unet(server, models)
    info = _json(server.cli("status", "--json"))
    assert (info["entries"], info["misses"], info["hits"]) == (1, 1, 1)
    assert _json(server.cli("list", "--json"))[0]["hits"] == 1
    assert "UNet2DConditionModel" in server.cli("evict", entries[0]["key"]).stdout  # says what it evicted


def test_evict_by_prefix_removes_only_that_entry_and_evict_all_empties_the_cache(server, tmp_path):
    # Two small torch.load entries from one client run: a second entry without a second slow import.
    import torch

    paths = [tmp_path / "a.pt", tmp_path / "b.pt"]
    for i, path in enumerate(paths):
        torch.save({"w": torch.full((64, 64), float(i))}, path)
    age_files(*paths)
    server.run(LOAD_TENSORS.format(paths=[str(p) for p in paths]), env=server.client_env(OVERMIND_STRICT="1"))
    entries = _json(server.cli("list", "--json"))
    assert len(entries) == 2
    first, second = entries[0]["key"], entries[1]["key"]
    out = server.cli("evict", first[:10]).stdout
    assert first[:16] in out and second[:16] not in out
    assert entries[0]["description"] in out  # says what it evicted: torch:load('.../a.pt')
    assert [e["key"] for e in _json(server.cli("list", "--json"))] == [second]
    assert _json(server.cli("status", "--json"))["entries"] == 1

    out = server.cli("evict", "--all").stdout
    assert second[:16] in out
    assert _json(server.cli("list", "--json")) == []
    info = _json(server.cli("status", "--json"))
    assert (info["entries"], info["evictions"]) == (0, 2)


def test_evict_of_an_unknown_key_exits_nonzero_with_a_message(server):
    proc = server.cli("evict", "nonexistent", check=False)
    assert proc.returncode == 1
    assert "nonexistent" in proc.stderr and "no cached entry" in proc.stderr


def test_shutdown_stops_the_server_and_removes_its_socket(server):
    proc = server.cli("shutdown")
    assert str(server.pid) in proc.stdout
    assert server.proc.wait(timeout=15) == 0
    assert not server.socket_path.exists()
    again = server.cli("shutdown", check=False)  # nothing left to stop: not an error
    assert again.returncode == 0 and "no server running" in again.stderr


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0]
    except OSError:
        return "gone"


def test_shutdown_returns_only_once_the_server_process_is_gone(make_server, runtime_dir, tmp_path):
    """The instance lock goes with the process, so a server started right after `overmind
    shutdown` (a restart) must not find it held. The server is stopped (SIGSTOP, from a
    preloaded shim: tests/shims/stop_after_unlink.c) the moment its socket file is gone, before
    it could exit, so the check does not depend on who is faster."""
    shim = build_shared_library(REPO / "tests" / "shims" / "stop_after_unlink.c", tmp_path / "libstop.so")
    server = make_server({"LD_PRELOAD": str(shim), "STOP_AFTER_UNLINK": str(runtime_dir / "server.sock")},
                         stop_signal=signal.SIGKILL)  # on SIGTERM it would stop again at the unlink
    cli_env = {k: v for k, v in server.env.items() if k not in ("LD_PRELOAD", "STOP_AFTER_UNLINK")}
    cli = subprocess.Popen([sys.executable, "-m", "overmind.frontend.cli", "shutdown"], env=cli_env,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        deadline = time.monotonic() + 30
        while _state(server.pid) != "T" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _state(server.pid) == "T" and not server.socket_path.exists(), _state(server.pid)
        time.sleep(0.5)
        assert cli.poll() is None, f"shutdown returned while the server still ran: {cli.communicate()}"
        os.kill(server.pid, signal.SIGCONT)
        out, err = cli.communicate(timeout=30)
        assert cli.returncode == 0, err
        assert server.proc.poll() == 0  # exited when shutdown returned
        make_server().stop()  # the lock is free at once
    finally:
        cli.kill()
        cli.wait(timeout=30)


def test_status_without_a_server_exits_3_naming_the_socket_and_still_reports_huge_pages(runtime_dir):
    proc, settings = _huge_pages_around(lambda: _cli_without_server(runtime_dir, "status"))
    assert proc.returncode == 3
    assert f"overmind: no server running at {runtime_dir / 'server.sock'}" in proc.stderr
    _check_huge_page_text(proc.stdout, settings)
    assert "pid" not in proc.stdout and "entries" not in proc.stdout

    proc, settings = _huge_pages_around(lambda: _cli_without_server(runtime_dir, "status", "--json"))
    assert proc.returncode == 3 and "no server running" in proc.stderr
    info = _json(proc)
    assert list(info) == ["huge_pages"]
    _check_huge_pages(info["huge_pages"], settings)


def test_runtime_dir_option_overrides_the_environment(server, runtime_dir, tmp_path):
    # The environment points elsewhere; --runtime-dir (before or after the command) wins.
    env = child_env(OVERMIND_RUNTIME_DIR=str(tmp_path / "elsewhere"), OVERMIND_NO_AUTOSTART="1")
    for argv in (["--runtime-dir", str(runtime_dir), "status", "--json"],
                 ["status", "--json", "--runtime-dir", str(runtime_dir)]):
        proc = subprocess.run([sys.executable, "-m", "overmind.frontend.cli", *argv], env=env, capture_output=True,
                              text=True, timeout=60, cwd=REPO)
        assert proc.returncode == 0, proc.stderr
        assert _json(proc)["pid"] == server.pid


# -- the command behaves as users expect of a Unix command -----------------------------------

OVERMIND = str(Path(sys.executable).parent / "overmind")
COMMANDS = ("status", "list", "evict", "shutdown", "run", "preload")


def _overmind(*args: str, env: dict, **kwargs) -> subprocess.CompletedProcess:
    if "stdout" not in kwargs:
        kwargs["capture_output"] = True
    return subprocess.run([OVERMIND, *args], env=env, text=True, timeout=120, cwd=REPO, **kwargs)


def test_help_lists_every_command_and_run_has_its_own_help(runtime_dir):
    env = child_env(OVERMIND_RUNTIME_DIR=str(runtime_dir), OVERMIND_NO_AUTOSTART="1")
    for argv in ([OVERMIND, "--help"], [sys.executable, "-m", "overmind", "--help"]):
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, cwd=REPO)
        assert proc.returncode == 0 and proc.stdout.startswith("usage: overmind "), proc.stderr
        listed = re.findall(r"^    (\w+) ", proc.stdout, re.MULTILINE)
        assert sorted(listed) == sorted(COMMANDS), proc.stdout
    for flag in ("--help", "-h"):
        for argv in (["run", flag], ["run", "--python", sys.executable, flag], ["--runtime-dir", "/x", "run", flag]):
            proc = _overmind(*argv, env=env)
            assert proc.returncode == 0 and proc.stderr == "", (argv, proc.stderr)
            assert proc.stdout.startswith("usage: overmind run [-h] [--python PATH]") and "--python PATH" in proc.stdout
    # After what to run, -h is the script's own.
    proc = _overmind("run", "-c", "import sys; print(sys.argv[1:])", "-h", env=env)
    assert proc.returncode == 0 and proc.stdout == "['-h']\n", proc.stderr


def test_python_dash_m_overmind_is_the_overmind_command(server, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "overmind", "status", "--json"], env=server.env, capture_output=True,
                          text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 0 and _json(proc)["pid"] == server.pid, proc.stderr
    proc = subprocess.run([sys.executable, "-m", "overmind", "run", "-c", "print('ran')"], env=server.env,
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0 and proc.stdout == "ran\n", proc.stderr


def test_global_options_before_run_reach_the_run_and_its_script(server, tmp_path):
    # The environment points elsewhere: --runtime-dir (in any form argparse takes) wins, for the
    # front end and for the script's own monkey_patch_all(), which reads the environment.
    env = child_env(OVERMIND_RUNTIME_DIR=str(tmp_path / "elsewhere"), OVERMIND_NO_AUTOSTART="1")
    show = "import os; print(os.environ['OVERMIND_RUNTIME_DIR'])"
    runs = server.status()["runs"] + server.status()["runs_plain"]  # forked, or refused and run plainly
    for option in (["--runtime-dir", str(server.runtime_dir)], [f"--runtime-dir={server.runtime_dir}"],
                   ["--runtime", str(server.runtime_dir)]):
        proc = _overmind(*option, "run", "-c", show, env=env)
        assert proc.returncode == 0 and proc.stdout == f"{server.runtime_dir}\n", (option, proc.stderr)
    status = server.status()
    assert status["runs"] + status["runs_plain"] == runs + 3, server.log()[-3000:]  # each asked this server
    assert not (tmp_path / "elsewhere").exists()


def test_unknown_commands_and_options_are_usage_errors_with_status_2(runtime_dir):
    env = child_env(OVERMIND_RUNTIME_DIR=str(runtime_dir), OVERMIND_NO_AUTOSTART="1")
    for argv, said in [(["frob"], "invalid choice: 'frob'"), (["status", "--frob"], "unrecognized arguments: --frob"),
                       (["--frob", "run", "x.py"], "unrecognized arguments"), ([], "required: COMMAND"),
                       (["run", "--frob", "x.py"], "unknown option --frob"), (["run"], "nothing to run"),
                       (["run", "--python"], "--python needs a path")]:
        proc = _overmind(*argv, env=env)
        assert proc.returncode == 2 and said in proc.stderr and "usage: overmind" in proc.stderr, (argv, proc.stderr)
        assert proc.stdout == "" and "Traceback" not in proc.stderr


def test_a_reader_that_left_ends_the_command_quietly_as_unix_tools_do(server, tmp_path):
    # `overmind status | head -1`: it used to say "lost the server at ...: Broken pipe" and exit 1
    # (or print "Exception ignored ... BrokenPipeError" at exit). The reader of this real pipe has
    # left before the command starts, so every write to it fails: no race with the reader.
    torch_file = tmp_path / "w.pt"
    server.run(f"import torch; torch.save(torch.ones(4), {str(torch_file)!r})")
    age_files(torch_file)
    server.run(LOAD_TENSORS.format(paths=[str(torch_file)]), env=server.client_env(OVERMIND_STRICT="1"))
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        for argv in (["status"], ["status", "--json"], ["list"], ["list", "--json"], ["run", "--help"]):
            proc = _overmind(*argv, env=server.env, stdout=write_end, stderr=subprocess.PIPE)
            # Killed by SIGPIPE, as `yes | head -1` leaves `yes`: shells do not report it.
            assert proc.returncode == -signal.SIGPIPE and proc.stderr == "", (argv, proc.returncode, proc.stderr)
    finally:
        os.close(write_end)
    assert server.status()["pid"] == server.pid
    # Through a shell, as users type it; the command's output is whole up to where head stopped.
    proc = subprocess.run(f"{shlex.quote(OVERMIND)} status | head -c 3", shell=True, env=server.env, capture_output=True,
                          text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 0 and proc.stdout == "pid" and proc.stderr == "", proc.stderr


# A real overmind-server, made to speak protocol 4 as the server of an older overmind does.
_OLD_SERVER = """
import sys
import overmind.shared.protocol as P
import overmind.shared.protocol.base as base
import overmind.shared.protocol.frames as frames
base.PROTOCOL_VERSION = P.PROTOCOL_VERSION = frames.PROTOCOL_VERSION = P.PROTOCOL_VERSION - 1
from overmind.server.daemon import main
sys.exit(main(["--foreground"]))
"""


def test_shutdown_stops_a_server_of_an_older_protocol_as_after_an_upgrade(make_server, runtime_dir):
    # After `pip install -U overmind` the running server speaks the old protocol: every command
    # says "restart overmind-server (overmind shutdown)", so shutdown must still stop it (by its pid).
    old = make_server(code=_OLD_SERVER)  # ready: it printed its readiness line
    status = _cli_without_server(runtime_dir, "status")
    assert status.returncode != 0 and "protocol version mismatch" in status.stderr, status.stderr
    proc = _cli_without_server(runtime_dir, "shutdown")
    assert proc.returncode == 0, proc.stderr
    assert f"overmind-server pid {old.pid} stopped (it speaks another protocol version" in proc.stdout
    assert old.proc.wait(timeout=15) is not None
