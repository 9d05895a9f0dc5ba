"""The deployment files (deploy/*.yaml, systemd/overmind-hugepages.conf) agree with the code.

Each test reads a setting the code relies on (an environment variable overmind.shared.settings.config
reads, the sysfs file overmind.shared.segments.hugepages reads, the console script pyproject installs,
the uid the server accepts) and checks the example against it, running the examples' own
shell scripts and server command against temp paths where they can run here.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

import pytest
import yaml

from overmind.server import options
from overmind.shared.settings import config
from overmind.shared.segments import hugepages
from overmind.shared.settings.config import Config, ensure_private_dir
from overmind.shared.settings.config import parse_size

from ..conftest import REPO, child_env

DAEMONSET = REPO / "deploy/overmind-daemonset.yaml"
EXAMPLE_POD = REPO / "deploy/example-pod.yaml"
TMPFILES = REPO / "systemd/overmind-hugepages.conf"
UNIT = REPO / "systemd/overmind.service"


def _one(path: Path, kind: str) -> dict:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    assert [d["kind"] for d in docs] == [kind], path
    return docs[0]


@pytest.fixture(scope="module")
def daemonset() -> dict:
    return _one(DAEMONSET, "DaemonSet")["spec"]["template"]["spec"]


@pytest.fixture(scope="module")
def pod() -> dict:
    return _one(EXAMPLE_POD, "Pod")["spec"]


def _container(spec: dict, name: str, init: bool = False) -> dict:
    found = [c for c in spec["initContainers" if init else "containers"] if c["name"] == name]
    assert len(found) == 1, f"no single container {name!r}"
    return found[0]


def _server(spec: dict) -> dict:
    return _container(spec, "overmind-server")


def _inference(spec: dict) -> dict:
    return _container(spec, "inference")


def _env(container: dict) -> dict[str, str]:
    return {e["name"]: str(e["value"]) for e in container.get("env", [])}


def _server_config(container: dict) -> Config:
    """What the server container's command and environment give the server (a flag wins)."""
    return Config.from_env(options.parse(container["command"][1:], _env(container))[1])


def _with_flag(argv: list[str], flag: str, value: str) -> list[str]:
    """``argv`` with ``flag``'s value replaced by ``value``."""
    at = argv.index(flag)
    return [*argv[:at + 1], value, *argv[at + 2:]]


def _mount(spec: dict, container: dict, volume: str) -> tuple[str, str]:
    """(mountPath in the container, hostPath on the node) of ``volume``."""
    mounts = [m["mountPath"] for m in container["volumeMounts"] if m["name"] == volume]
    host = [v["hostPath"]["path"] for v in spec["volumes"] if v["name"] == volume]
    assert len(mounts) == 1 and len(host) == 1, volume
    return mounts[0], host[0]


def _identity(spec: dict, container: dict) -> tuple[int, int]:
    """The (uid, gid) the container runs as: its own securityContext, else the pod's."""
    ids = {**spec.get("securityContext", {}), **container.get("securityContext", {})}
    return ids["runAsUser"], ids["runAsGroup"]


def _sh(container: dict, env: dict[str, str]) -> subprocess.CompletedProcess:
    """Run an init container's own shell command here, with ``env`` in place of its paths."""
    argv = container["command"]
    assert argv[:2] == ["sh", "-c"], argv
    return subprocess.run(["sh", "-c", argv[2]], env={"PATH": os.environ["PATH"], **_env(container), **env},
                          capture_output=True, text=True, timeout=30)


def test_every_overmind_variable_the_examples_set_is_one_overmind_config_reads(daemonset, pod):
    source = Path(config.__file__).read_text()
    for container in (_server(daemonset), _inference(pod)):
        names = [n for n in _env(container) if n.startswith("OVERMIND_")]
        assert names
        for name in names:
            assert f'"{name}"' in source, f"{name} is not a setting of overmind.shared.settings.config"


def test_server_and_pods_name_the_same_host_directory_as_their_runtime_dir(daemonset, pod):
    server_mount, server_host = _mount(daemonset, _server(daemonset), "overmind-runtime")
    pod_mount, pod_host = _mount(pod, _inference(pod), "overmind-runtime")
    assert server_host == pod_host
    server, client = _server_config(_server(daemonset)), Config.from_env(_env(_inference(pod)))
    assert server.runtime_dir == Path(server_mount) and client.runtime_dir == Path(pod_mount)
    # One socket for both: the same path in the same host directory.
    assert server.socket_path == client.socket_path


def test_hugepages_init_container_writes_an_enabling_value_to_the_file_hugepages_reads(daemonset, tmp_path):
    init = _container(daemonset, "hugepages", init=True)
    assert init["securityContext"]["privileged"] is True  # /sys is read-only otherwise
    assert _env(init)["SHMEM_ENABLED"] == "/" + hugepages.SHMEM_ENABLED
    target = tmp_path / hugepages.SHMEM_ENABLED
    target.parent.mkdir(parents=True)
    target.write_text("always within_size advise [never] deny force\n")
    proc = _sh(init, {"SHMEM_ENABLED": str(target)})
    assert proc.returncode == 0, proc.stderr
    status = hugepages.read_status(str(tmp_path))  # a regular file keeps what was written: "advise"
    assert status.enabled and status.setting == _env(init)["SETTING"]
    # A node without THP still gets its server: the script says so and succeeds.
    missing = _sh(init, {"SHMEM_ENABLED": str(tmp_path / "absent")})
    assert missing.returncode == 0 and "missing" in missing.stdout


def test_runtime_dir_init_container_leaves_a_directory_overmind_accepts_for_the_servers_uid(daemonset, tmp_path):
    init = _container(daemonset, "runtime-dir", init=True)
    server = _server(daemonset)
    uid, gid = _identity(daemonset, server)
    assert _env(init)["OWNER"] == f"{uid}:{gid}"
    assert _env(init)["RUNTIME_DIR"] == _mount(daemonset, init, "overmind-runtime")[0] \
        == _mount(daemonset, server, "overmind-runtime")[0]
    runtime_dir = tmp_path / "node-run-overmind"
    proc = _sh(init, {"RUNTIME_DIR": str(runtime_dir), "OWNER": f"{os.getuid()}:{os.getgid()}"})
    assert proc.returncode == 0, proc.stderr
    ensure_private_dir(runtime_dir)  # raises if not 0700 and ours
    assert runtime_dir.stat().st_mode & 0o777 == 0o700


def test_server_command_is_the_installed_console_script_and_serves_the_pods_socket(daemonset, pod):
    server = _server(daemonset)
    command = server["command"]
    # The console scripts pip installed from pyproject's [project.scripts] (what an image has).
    scripts = {ep.name: ep.value for ep in metadata.distribution("overmind").entry_points
               if ep.group == "console_scripts"}
    assert scripts[command[0]] == "overmind.server.daemon:main"
    probe = server["readinessProbe"]["exec"]["command"]
    assert scripts[probe[0]] == "overmind.frontend.run:command" and probe[1:3] == ["status", "--wait-ready"]
    assert probe[3] == "--timeout" and float(probe[4]) < server["readinessProbe"]["timeoutSeconds"]
    bin_dir = Path(sys.executable).parent
    runtime_dir = Path(tempfile.mkdtemp(prefix="om-deploy-", dir="/tmp"))  # short: AF_UNIX paths
    try:
        env = {**child_env(), **_env(server), "OVERMIND_RUNTIME_DIR": str(runtime_dir),
               "PATH": f"{bin_dir}:{os.environ['PATH']}"}
        argv = _with_flag(command[1:], "--state-dir", str(runtime_dir / "state"))  # not the node's path
        proc = subprocess.Popen([str(bin_dir / command[0]), *argv], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        try:
            line = proc.stdout.readline()
            assert "ready" in line, (line, proc.stderr.read() if proc.poll() is not None else "")
            pod_env = {**child_env(), **_env(_inference(pod)), "OVERMIND_RUNTIME_DIR": str(runtime_dir)}
            assert Config.from_env(pod_env).socket_path.is_socket()
            ready = subprocess.run([str(bin_dir / probe[0]), *probe[1:]], env=env, capture_output=True, text=True,
                                   timeout=60)
            assert ready.returncode == 0, ready.stderr
            assert f"overmind-server pid {proc.pid} ready" in ready.stdout, ready.stdout
        finally:
            proc.terminate()
            proc.wait(timeout=30)
            proc.stdout.close()
            proc.stderr.close()
    finally:
        shutil.rmtree(runtime_dir, ignore_errors=True)


def test_pods_run_as_the_servers_uid_with_its_image_and_model_paths(daemonset, pod):
    server, inference = _server(daemonset), _inference(pod)
    assert _identity(pod, inference) == _identity(daemonset, server)  # SO_PEERCRED: one uid
    assert _identity(daemonset, server)[0] != 0
    assert inference["image"] == server["image"]  # loaders run the pod's interpreter path
    assert _mount(pod, inference, "models") == _mount(daemonset, server, "models")


def test_pods_never_start_a_server_of_their_own_and_need_no_host_pid_or_privileges(daemonset, pod):
    assert Config.from_env(_env(_inference(pod))).autostart is False
    assert not pod.get("hostPID") and not _inference(pod).get("securityContext", {}).get("privileged")
    # Segments cross PID namespaces over the socket (Note [Segments across PID namespaces]).
    assert not daemonset.get("hostPID")


def _quantity(text: str) -> int:
    match = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti|K|M|G|T)?", text)
    assert match, text
    units = {None: 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
             "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}
    return int(match[1]) * units[match[2]]


def test_the_cache_budget_fits_in_the_server_containers_memory_limit(daemonset):
    server = _server(daemonset)
    budget = _server_config(server).max_memory
    assert budget == parse_size(server["command"][server["command"].index("--max-memory") + 1])
    limit = _quantity(server["resources"]["limits"]["memory"])
    assert budget + (2 << 30) <= limit  # segments are charged to this cgroup; loaders need room too


def _tmpfiles_lines() -> list[list[str]]:
    return [line.split() for line in TMPFILES.read_text().splitlines() if line.strip() and not line.startswith("#")]


def test_tmpfiles_line_writes_an_enabling_value_to_the_file_hugepages_reads(tmp_path):
    [[kind, path, mode, user, group, age, argument]] = _tmpfiles_lines()
    assert (kind, path) == ("w", "/" + hugepages.SHMEM_ENABLED)
    assert (mode, user, group, age) == ("-", "-", "-", "-")
    assert argument in hugepages.ALLOWING
    tool = shutil.which("systemd-tmpfiles")
    if tool:  # the real tool, under a temp root: this machine's setting is never touched
        target = tmp_path / hugepages.SHMEM_ENABLED
        target.parent.mkdir(parents=True)
        target.write_text("")  # `w` writes only to a file that exists
        proc = subprocess.run([tool, f"--root={tmp_path}", "--create", str(TMPFILES)], capture_output=True,
                              text=True, timeout=30)
        assert proc.returncode == 0, proc.stderr
        assert hugepages.read_status(str(tmp_path)).setting == argument


def test_readme_and_unit_point_to_the_files_by_their_names():
    readme = (REPO / "README.md").read_text()
    for path in (TMPFILES, DAEMONSET, EXAMPLE_POD):
        assert str(path.relative_to(REPO)) in readme
    assert TMPFILES.name in (REPO / "systemd/overmind.service").read_text()
    assert hugepages.ENABLE_COMMAND in readme


def test_state_dir_survives_the_pod_and_its_init_container_leaves_one_overmind_accepts(daemonset, tmp_path):
    """Warm after a restart (overmind.server.state): the server's state directory is a hostPath on disk,
    named by OVERMIND_STATE_DIR, made private and the server's by the `state-dir` init container."""
    from overmind.server.state import open_state_dir

    server = _server(daemonset)
    mount, host = _mount(daemonset, server, "overmind-state")
    assert _server_config(server).state_dir == Path(mount)
    assert not host.startswith(("/run", "/tmp", "/dev/shm"))  # tmpfs: emptied at reboot
    init = _container(daemonset, "state-dir", init=True)
    uid, gid = _identity(daemonset, server)
    assert _env(init)["OWNER"] == f"{uid}:{gid}" and _env(init)["STATE_DIR"] == mount
    state_dir = tmp_path / "node-var-lib-overmind"
    proc = _sh(init, {"STATE_DIR": str(state_dir), "OWNER": f"{os.getuid()}:{os.getgid()}"})
    assert proc.returncode == 0, proc.stderr
    os.close(open_state_dir(state_dir))  # raises if others can write it or it is not ours


def test_the_server_gets_its_settings_as_flags_where_a_flag_exists(daemonset):
    """overmind-server's flags (overmind.server.options): the examples set the server's settings on its
    command line; only the runtime directory stays a variable in the container, where `overmind status`
    (the readiness probe, `kubectl exec`) reads it too."""
    server = _server(daemonset)
    flags = {s.variable: s.flag for s in options.SETTINGS}
    assert {n for n in _env(server) if n in flags} == {"OVERMIND_RUNTIME_DIR"}
    assert {"--max-memory", "--state-dir"} <= set(server["command"])
    unit = _unit_lines()
    assert not [line for line in unit if line.startswith("Environment=") and line.split("=")[1] in flags], unit


def _unit_lines() -> list[str]:
    return [line.strip() for line in UNIT.read_text().splitlines() if line.strip() and not line.startswith("#")]


def _unit_command(key: str, runtime: str, state: str) -> list[str]:
    """The unit's ``key=`` command line, with systemd's %t and %S in place (systemd.unit, Specifiers)."""
    [line] = [line for line in _unit_lines() if line.startswith(f"{key}=")]
    argv = shlex.split(line[len(key) + 1:].lstrip("-"))
    assert argv[0] == "/usr/bin/env", argv
    return [arg.replace("%t", runtime).replace("%S", state) for arg in argv[1:]]


def test_unit_keeps_its_state_dir_and_waits_for_the_restore():
    lines = _unit_lines()
    assert "StateDirectory=overmind" in lines
    post = [line for line in lines if line.startswith("ExecStartPost=")]
    assert len(post) == 1 and "overmind status --runtime-dir %t/overmind --wait-ready --timeout" in post[0]
    assert post[0].startswith("ExecStartPost=-")  # a slow restore never fails the unit
    # The server's flags name systemd's StateDirectory= (%S/overmind) and the runtime directory clients
    # find by default ($XDG_RUNTIME_DIR, which is %t in a user service).
    start = _unit_command("ExecStart", "/run/user/1000", "/home/u/.local/state")
    assert start[:2] == ["overmind-server", "--foreground"]
    server = Config.from_env(options.parse(start[1:], {})[1])
    assert server.state_dir == Path("/home/u/.local/state/overmind")
    assert server.runtime_dir == Config.from_env({"XDG_RUNTIME_DIR": "/run/user/1000"}).runtime_dir
    status = _unit_command("ExecStartPost", "/run/user/1000", "/home/u/.local/state")
    assert status[status.index("--runtime-dir") + 1] == str(server.runtime_dir)


def test_unit_commands_start_a_server_and_wait_for_it_here(tmp_path):
    """ExecStart= and ExecStartPost= as systemd runs them, with %t and %S in temp directories."""
    bin_dir = Path(sys.executable).parent
    runtime = tempfile.mkdtemp(prefix="om-unit-", dir="/tmp")  # short: AF_UNIX paths
    env = {**child_env(), "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    try:
        start = _unit_command("ExecStart", runtime, str(tmp_path))
        proc = subprocess.Popen([str(bin_dir / start[0]), *start[1:]], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        try:
            line = proc.stdout.readline()
            assert f"socket {runtime}/overmind/server.sock" in line, (line, proc.poll() and proc.stderr.read())
            post = _unit_command("ExecStartPost", runtime, str(tmp_path))
            ready = subprocess.run([str(bin_dir / post[0]), *post[1:]], env=env, capture_output=True, text=True,
                                   timeout=60)
            assert ready.returncode == 0 and f"overmind-server pid {proc.pid} ready" in ready.stdout, ready
            assert (tmp_path / "overmind").is_dir()  # --state-dir %S/overmind
        finally:
            proc.terminate()
            proc.wait(timeout=30)
            proc.stdout.close()
            proc.stderr.close()
    finally:
        shutil.rmtree(runtime, ignore_errors=True)
