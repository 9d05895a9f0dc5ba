"""A run's child is its caller's process or none: the traits read, compared and taken on.

Note [A hand-over is the same process or none] in overmind.warm.match. Taking on runs in a real
fresh interpreter (``take_on`` changes the process it runs in); cgroups are read from fixture
trees, never changed (the machine's cgroups are not a test's to move).
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import subprocess
import sys
import textwrap

import pytest

from overmind.shared.process.traits import Traits, differences, status_fields, tracer_pid
from overmind.warm.match import cgroup_procs_file

from ..conftest import child_env


def test_traits_survive_the_wire_and_equal_themselves():
    own = Traits.own()
    again = Traits.from_wire(json.loads(json.dumps(own.to_wire())))
    assert again == own and differences(own, again) == []
    assert own.uids[1] == os.geteuid() and own.affinity == tuple(sorted(os.sched_getaffinity(0)))
    assert own.rlimits["nofile"] == resource.getrlimit(resource.RLIMIT_NOFILE)


@pytest.mark.parametrize("field, bad", [
    ("uids", "0"), ("groups", [True]), ("namespaces", {"bogus": "x"}), ("cgroups", "0::/"),
    ("rlimits", {"nofile": [1]}), ("rlimits", {"nofile": [1, "2"]}), ("nice", None), ("seccomp", [0]),
    ("affinity", list(range(70000))),
])
def test_a_bad_trait_on_the_wire_is_named(field, bad):
    wire = Traits.own().to_wire()
    wire[field] = bad
    with pytest.raises(ValueError, match=field):
        Traits.from_wire(wire)


@pytest.mark.parametrize("change, says", [
    (dict(uids=(1, 1, 1, 1)), "uids"),
    (dict(groups=(4242,)), "groups"),
    (dict(namespaces={"uts": "uts:[1]"}), "the uts namespace uts:[1]"),
    (dict(cgroups=("0::/elsewhere",)), "cgroups 0::/elsewhere"),
    (dict(rlimits={"nofile": (512, 1024)}), "RLIMIT_NOFILE 512:1024"),
    (dict(nice=7), "nice 7"),
    (dict(policy=os.SCHED_BATCH), "scheduling policy"),
    (dict(affinity=(0, 1, 2, 3, 8)), "CPU affinity 0-3,8"),
    (dict(no_new_privs=1), "no_new_privs 1"),
    (dict(seccomp=(2, 1)), "seccomp mode 2 with 1 filters"),
])
def test_every_trait_that_differs_is_named(change, says):
    own = Traits.own()
    if "namespaces" in change:
        change = dict(namespaces={**own.namespaces, **change["namespaces"]})
    if "rlimits" in change:
        change = dict(rlimits={**own.rlimits, **change["rlimits"]})
    caller = dataclasses.replace(own, **change)
    found = differences(caller, own)
    assert len(found) == 1 and found[0].startswith(says), found


def test_the_tracer_pid_is_read_from_the_status_file(tmp_path):
    status = tmp_path / "status"
    status.write_text("Name:\tpython\nTracerPid:\t4242\nNoNewPrivs:\t1\n")
    fields = status_fields(str(status))
    assert tracer_pid(fields) == 4242 and fields["NoNewPrivs"] == "1"
    assert tracer_pid() == 0  # nothing traces the tests


def _fixture_root(tmp_path, mountinfo: str, dirs: list[str]):
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/mountinfo").write_text(mountinfo)
    for d in dirs:
        (tmp_path / d.lstrip("/")).mkdir(parents=True)
    return str(tmp_path)


def test_a_v2_cgroup_is_found_below_a_mount_that_shows_part_of_the_tree(tmp_path):
    # A container's cgroup namespace-less mount: the mount's root is the pod's cgroup.
    root = _fixture_root(tmp_path, "41 31 0:38 /kubepods/pod1 /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n",
                         ["/sys/fs/cgroup/job"])
    assert cgroup_procs_file("0::/kubepods/pod1/job", root) == f"{root}/sys/fs/cgroup/job/cgroup.procs"
    assert cgroup_procs_file("0::/elsewhere/job", root) is None  # not below what the mount shows
    assert cgroup_procs_file("0::/kubepods/pod1/gone", root) is None  # removed meanwhile


def test_a_v1_cgroup_is_found_on_the_mount_of_its_controllers(tmp_path):
    mounts = ("32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct\n"
              "35 31 0:32 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n"
              "40 31 0:37 / /sys/fs/cgroup/systemd rw - cgroup cgroup rw,xattr,name=systemd\n")
    root = _fixture_root(tmp_path, mounts, ["/sys/fs/cgroup/memory/job", "/sys/fs/cgroup/cpu,cpuacct/job",
                                             "/sys/fs/cgroup/systemd/user.slice"])
    assert cgroup_procs_file("4:memory:/job", root) == f"{root}/sys/fs/cgroup/memory/job/cgroup.procs"
    assert cgroup_procs_file("2:cpu,cpuacct:/job", root) == f"{root}/sys/fs/cgroup/cpu,cpuacct/job/cgroup.procs"
    assert cgroup_procs_file("9:name=systemd:/user.slice", root).endswith("systemd/user.slice/cgroup.procs")
    assert cgroup_procs_file("5:pids:/job", root) is None  # no mount of ours has that controller


TAKE_ON = """
import json, sys
from overmind.shared.process.traits import Traits
from overmind.warm.match import CannotMatch, take_on
caller = Traits.from_wire(json.loads(sys.argv[1]))
try:
    take_on(caller)
except CannotMatch as err:
    print(json.dumps({"refused": str(err)}))
else:
    print(json.dumps({"now": Traits.own().to_wire()}))
"""


def _take_on(caller: Traits) -> dict:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(TAKE_ON), json.dumps(caller.to_wire())],
                          capture_output=True, text=True, timeout=60, env=child_env())
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_a_child_takes_on_a_lower_limit_a_higher_nice_and_fewer_cpus():
    own = Traits.own()
    soft, hard = own.rlimits["nofile"]
    caller = dataclasses.replace(own, rlimits={**own.rlimits, "nofile": (min(soft, 256), min(hard, 512))},
                                 nice=min(own.nice + 3, 19), affinity=own.affinity[:1])
    now = Traits.from_wire(_take_on(caller)["now"])
    assert differences(caller, now) == []
    assert now.rlimits["nofile"] == (min(soft, 256), min(hard, 512)) and now.affinity == own.affinity[:1]


@pytest.mark.parametrize("change, says", [
    (lambda own: dict(namespaces={**own.namespaces, "uts": "uts:[1]"}), "the uts namespace"),
    (lambda own: dict(rlimits={**own.rlimits, "as": (8 << 30, resource.RLIM_INFINITY)}), "RLIMIT_AS"),
    (lambda own: dict(groups=(*own.groups, 4242)), "groups"),
    (lambda own: dict(seccomp=(2, 3)), "seccomp"),
])
def test_a_child_that_cannot_become_its_caller_says_why(change, says):
    own = Traits.own()
    answer = _take_on(dataclasses.replace(own, **change(own)))
    assert says in answer.get("refused", ""), answer


@pytest.mark.skipif(os.geteuid() == 0, reason="root may raise a hard limit")
def test_a_hard_limit_above_the_childs_is_a_difference_for_an_unprivileged_child():
    own = Traits.own()
    soft, hard = own.rlimits["core"]
    if hard == resource.RLIM_INFINITY:
        pytest.skip("the core limit is already unlimited here")
    answer = _take_on(dataclasses.replace(own, rlimits={**own.rlimits, "core": (soft, resource.RLIM_INFINITY)}))
    assert "RLIMIT_CORE" in answer.get("refused", ""), answer
