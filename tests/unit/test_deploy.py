"""The deployment files (deploy/*.yaml, systemd/overmind-hugepages.conf) agree with the code.

Each test reads a setting the code relies on (an environment variable overmind.shared.config
reads, the sysfs file overmind.shared.hugepages reads, the console script pyproject installs,
the uid the server accepts) and checks the example against it, running the examples' own
shell scripts and server command against temp paths where they can run here.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

import pytest
import yaml

from overmind.shared import config, hugepages
from overmind.shared.config import Config, ensure_private_dir
from overmind.shared.config import parse_size

from ..conftest import REPO, child_env

DAEMONSET = REPO / "deploy/overmind-daemonset.yaml"
EXAMPLE_POD = REPO / "deploy/example-pod.yaml"
TMPFILES = REPO / "systemd/overmind-hugepages.conf"


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
            assert f'"{name}"' in source, f"{name} is not a setting of overmind.shared.config"


def test_server_and_pods_name_the_same_host_directory_as_their_runtime_dir(daemonset, pod):
    server_mount, server_host = _mount(daemonset, _server(daemonset), "overmind-runtime")
    pod_mount, pod_host = _mount(pod, _inference(pod), "overmind-runtime")
    assert server_host == pod_host
    for env, mount in ((_env(_server(daemonset)), server_mount), (_env(_inference(pod)), pod_mount)):
        assert Config.from_env(env).runtime_dir == Path(mount)
    # One socket for both: the same path in the same host directory.
    assert Config.from_env(_env(_server(daemonset))).socket_path == Config.from_env(_env(_inference(pod))).socket_path


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
        proc = subprocess.Popen([str(bin_dir / command[0]), *command[1:]], env=env, stdout=subprocess.PIPE,
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
    budget = parse_size(_env(server)["OVERMIND_MAX_MEMORY"])
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
    assert Config.from_env(_env(server)).state_dir == Path(mount)
    assert not host.startswith(("/run", "/tmp", "/dev/shm"))  # tmpfs: emptied at reboot
    init = _container(daemonset, "state-dir", init=True)
    uid, gid = _identity(daemonset, server)
    assert _env(init)["OWNER"] == f"{uid}:{gid}" and _env(init)["STATE_DIR"] == mount
    state_dir = tmp_path / "node-var-lib-overmind"
    proc = _sh(init, {"STATE_DIR": str(state_dir), "OWNER": f"{os.getuid()}:{os.getgid()}"})
    assert proc.returncode == 0, proc.stderr
    os.close(open_state_dir(state_dir))  # raises if others can write it or it is not ours


def test_unit_keeps_its_state_dir_and_waits_for_the_restore():
    unit = (REPO / "systemd/overmind.service").read_text()
    lines = [line.strip() for line in unit.splitlines() if not line.startswith("#")]
    assert "StateDirectory=overmind" in lines and "Environment=OVERMIND_STATE_DIR=%S/overmind" in lines
    post = [line for line in lines if line.startswith("ExecStartPost=")]
    assert len(post) == 1 and "overmind status --wait-ready --timeout" in post[0]
    assert post[0].startswith("ExecStartPost=-")  # a slow restore never fails the unit
