"""overmind.shared.settings.host_memory finds the memory limit that binds us and what is left under it.

Each test writes a small /proc and /sys/fs/cgroup tree in the kernel's own formats under a
temp root; one test reads this machine's real files.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from overmind.shared.settings.host_memory import HostMemory, Limit, Stall, mem_available, ram_total

GiB = 1 << 30
MiB = 1 << 20
RAM = 64 * GiB
FREE = 40 * GiB  # MemAvailable
V1_NONE = "9223372036854771712\n"  # what v1 prints for no limit
PSI = "some avg10={some:.2f} avg60=0.50 avg300=0.10 total={total}\nfull avg10=0.25 avg60=0.00 avg300=0.00 total=77\n"


def mount(point: str, fstype: str, superopts: str = "rw", root: str = "/", optional: str = "shared:9") -> str:
    """One mountinfo line; ``optional`` is the variable-length optional fields before ``-``."""
    return f"35 24 0:30 {root} {point} rw,nosuid,nodev,noexec,relatime {optional} - {fstype} {fstype} {superopts}\n"


V2_MOUNT = mount("/sys/fs/cgroup", "cgroup2", "rw,nsdelegate,memory_recursiveprot")
HYBRID_MOUNTS = (mount("/sys/fs/cgroup/unified", "cgroup2", "rw,nsdelegate", optional="shared:4 master:1")
                 + mount("/sys/fs/cgroup/memory", "cgroup", "rw,memory", optional=""))
V1_MOUNT = mount("/sys/fs/cgroup/memory", "cgroup", "rw,memory")


def build(tmp_path: Path, files: dict[str, str | bytes], free: int = FREE) -> str:
    """Write ``files`` (paths relative to the fake root) plus /proc/meminfo; return the root."""
    meminfo = f"MemTotal:       {RAM // 1024} kB\nMemFree:         1024 kB\nMemAvailable:   {free // 1024} kB\n"
    for rel, text in {"proc/meminfo": meminfo, **files}.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return str(tmp_path)


def v2_host(tmp_path: Path, cgroup: str, files: dict[str, str | bytes], free: int = FREE) -> str:
    """A v2-only host: our cgroup is ``cgroup``; ``files`` are relative to /sys/fs/cgroup."""
    return build(tmp_path, {"proc/self/cgroup": f"0::{cgroup}\n", "proc/self/mountinfo": V2_MOUNT,
                            "sys/fs/cgroup/cgroup.controllers": "cpuset cpu io memory hugetlb pids\n",
                            **{f"sys/fs/cgroup/{k}": v for k, v in files.items()}}, free)


def v1_host(tmp_path: Path, cgroup: str, files: dict[str, str | bytes], free: int = FREE) -> str:
    """A v1 host: ``files`` are relative to /sys/fs/cgroup/memory."""
    return build(tmp_path, {"proc/self/cgroup": f"5:memory:{cgroup}\n4:cpu,cpuacct:/\n0::/\n",
                            "proc/self/mountinfo": V1_MOUNT,
                            **{f"sys/fs/cgroup/memory/{k}": v for k, v in files.items()}}, free)


def cgroup_limits(memory: HostMemory) -> list[tuple[int, str]]:
    return [(limit.bytes, limit.source) for limit in memory.limits[1:]]


def test_meminfo_values_are_read_in_bytes(tmp_path):
    root = build(tmp_path, {})
    assert (ram_total(root), mem_available(root)) == (RAM, FREE)


def test_v2_parent_limit_binds_when_our_cgroup_says_max(tmp_path):
    root = v2_host(tmp_path, "/user.slice/job", {"user.slice/memory.max": f"{12 * GiB}\n",
                                                 "user.slice/job/memory.max": "max\n",
                                                 "user.slice/job/memory.high": "max\n"})
    memory = HostMemory.read(root)
    assert memory.limits[0] == Limit(RAM, "RAM", None, 0)
    assert memory.limit == Limit(12 * GiB, "cgroup v2 memory.max of /user.slice",
                                 os.path.join(root, "sys/fs/cgroup/user.slice"), 2)
    assert memory.describe() == {"limit": 12 * GiB, "limit_from": "cgroup v2 memory.max of /user.slice",
                                 "ram": RAM, "cgroup": 2}


def test_v2_all_max_leaves_ram_as_the_limit(tmp_path):
    root = v2_host(tmp_path, "/user.slice/job", {"user.slice/memory.max": "max\n", "user.slice/memory.high": "max\n",
                                                 "user.slice/job/memory.max": "max\n"})
    memory = HostMemory.read(root)
    assert memory.limits == [Limit(RAM, "RAM", None, 0)]
    assert memory.describe() == {"limit": RAM, "limit_from": "RAM", "ram": RAM, "cgroup": 2}


def test_v2_lists_every_finite_level_from_ours_upward_even_above_ram(tmp_path):
    root = v2_host(tmp_path, "/a/b", {"a/b/memory.max": f"{8 * GiB}\n", "a/memory.max": f"{2 * RAM}\n"})
    assert cgroup_limits(HostMemory.read(root)) == [(8 * GiB, "cgroup v2 memory.max of /a/b"),
                                                    (2 * RAM, "cgroup v2 memory.max of /a")]


def test_v2_memory_high_below_memory_max_is_the_limit(tmp_path):
    root = v2_host(tmp_path, "/user.slice/job", {"user.slice/job/memory.max": f"{8 * GiB}\n",
                                                 "user.slice/job/memory.high": f"{6 * GiB}\n"})
    memory = HostMemory.read(root)
    assert (memory.limit.bytes, memory.limit.source) == (6 * GiB, "cgroup v2 memory.high of /user.slice/job")


def test_hybrid_host_without_v2_memory_controller_uses_v1(tmp_path):
    root = build(tmp_path, {
        "proc/self/cgroup": "12:pids:/\n4:memory:/job\n2:name=memorywatch:/x\n1:name=systemd:/job\n0::/job\n",
        "proc/self/mountinfo": HYBRID_MOUNTS,
        "sys/fs/cgroup/unified/cgroup.controllers": "\n",
        "sys/fs/cgroup/unified/job/memory.max": f"{1 * GiB}\n",  # not a memory hierarchy: never read
        "sys/fs/cgroup/memory/job/memory.limit_in_bytes": f"{4 * GiB}\n",
    })
    memory = HostMemory.read(root)
    assert cgroup_limits(memory) == [(4 * GiB, "cgroup v1 memory.limit_in_bytes of /job")]
    assert memory.describe()["cgroup"] == 1


def test_v1_limit_at_our_level_with_unlimited_parents(tmp_path):
    root = v1_host(tmp_path, "/docker/abc", {"memory.limit_in_bytes": V1_NONE, "docker/memory.limit_in_bytes": V1_NONE,
                                             "docker/abc/memory.limit_in_bytes": f"{3 * GiB}\n"})
    memory = HostMemory.read(root)
    assert cgroup_limits(memory) == [(3 * GiB, "cgroup v1 memory.limit_in_bytes of /docker/abc")]
    assert memory.limit.cgroup_dir == os.path.join(root, "sys/fs/cgroup/memory/docker/abc")


def test_v1_hierarchical_limit_covers_ancestors_we_cannot_see(tmp_path):
    root = v1_host(tmp_path, "/x", {"x/memory.limit_in_bytes": V1_NONE,
                                    "x/memory.stat": f"cache 0\nhierarchical_memory_limit {5 * GiB}\n"})
    memory = HostMemory.read(root)
    assert (memory.limit.bytes, memory.limit.source) == (5 * GiB, "cgroup v1 hierarchical_memory_limit of /x")


def test_v1_hierarchical_limit_equal_to_a_level_found_is_not_listed_twice(tmp_path):
    root = v1_host(tmp_path, "/x", {"x/memory.limit_in_bytes": f"{5 * GiB}\n",
                                    "x/memory.stat": f"hierarchical_memory_limit {5 * GiB}\n"})
    assert cgroup_limits(HostMemory.read(root)) == [(5 * GiB, "cgroup v1 memory.limit_in_bytes of /x")]


def test_v1_unlimited_hierarchical_limit_is_no_limit(tmp_path):
    root = v1_host(tmp_path, "/x", {"x/memory.stat": f"hierarchical_memory_limit {V1_NONE}"})
    assert HostMemory.read(root).limits == [Limit(RAM, "RAM", None, 0)]


def test_container_mount_root_is_stripped_from_our_cgroup_path(tmp_path):
    root = build(tmp_path, {
        "proc/self/cgroup": "0::/docker/abc/sub\n",
        "proc/self/mountinfo": mount("/sys/fs/cgroup", "cgroup2", root="/docker/abc"),
        "sys/fs/cgroup/cgroup.controllers": "memory pids\n",
        "sys/fs/cgroup/sub/memory.max": f"{2 * GiB}\n",
        "sys/fs/cgroup/memory.max": f"{7 * GiB}\n",
        "sys/fs/cgroup/docker/abc/sub/memory.max": f"{1 * GiB}\n",  # the host path, not ours
    })
    assert cgroup_limits(HostMemory.read(root)) == [(2 * GiB, "cgroup v2 memory.max of /sub"),
                                                    (7 * GiB, "cgroup v2 memory.max of /")]


def test_path_not_under_mount_root_reads_the_mount_point_and_nothing_above(tmp_path):
    root = build(tmp_path, {
        "proc/self/cgroup": "0::/other\n",
        "proc/self/mountinfo": mount("/sys/fs/cgroup", "cgroup2", root="/docker/abc"),
        "sys/fs/cgroup/cgroup.controllers": "memory\n",
        "sys/fs/cgroup/memory.max": f"{3 * GiB}\n",
        "sys/fs/cgroup/other/memory.max": f"{1 * GiB}\n",  # /other is not below the mount's root
        "sys/fs/memory.max": f"{1 * GiB}\n",  # above the mount point
    })
    assert cgroup_limits(HostMemory.read(root)) == [(3 * GiB, "cgroup v2 memory.max of /")]


def test_walk_never_goes_above_the_mount_point(tmp_path):
    root = v2_host(tmp_path, "/job", {"job/memory.max": "max\n"})
    Path(root, "sys/fs/memory.max").write_text(f"{1 * GiB}\n")
    Path(root, "sys/memory.max").write_text(f"{1 * GiB}\n")
    assert HostMemory.read(root).limits == [Limit(RAM, "RAM", None, 0)]


def test_cgroup_dir_missing_under_the_mount_reads_the_mount_point(tmp_path):
    root = v2_host(tmp_path, "/gone/job", {"memory.max": f"{3 * GiB}\n"})
    memory = HostMemory.read(root)
    assert cgroup_limits(memory) == [(3 * GiB, "cgroup v2 memory.max of /")]
    assert memory.cgroup_dir == os.path.join(root, "sys/fs/cgroup")


def test_of_two_memory_mounts_the_one_showing_our_cgroup_is_used(tmp_path):
    root = build(tmp_path, {
        "proc/self/cgroup": "0::/pod/c1\n",
        "proc/self/mountinfo": mount("/host/cgroup", "cgroup2", root="/other") + mount("/sys/fs/cgroup", "cgroup2"),
        "host/cgroup/cgroup.controllers": "memory\n", "host/cgroup/memory.max": f"{1 * GiB}\n",
        "sys/fs/cgroup/cgroup.controllers": "memory\n", "sys/fs/cgroup/pod/c1/memory.max": f"{5 * GiB}\n",
    })
    assert cgroup_limits(HostMemory.read(root)) == [(5 * GiB, "cgroup v2 memory.max of /pod/c1")]


def test_mount_point_with_octal_escaped_space_is_decoded(tmp_path):
    root = build(tmp_path, {
        "proc/self/cgroup": "3:memory:/job\n",
        "proc/self/mountinfo": mount("/sys/fs/my\\040cgroup", "cgroup", "rw,memory", optional="shared:1 master:2"),
        "sys/fs/my cgroup/job/memory.limit_in_bytes": f"{3 * GiB}\n",
    })
    assert HostMemory.read(root).limit.cgroup_dir == os.path.join(root, "sys/fs/my cgroup/job")


def test_missing_cgroup_files_leave_ram_only(tmp_path):
    memory = HostMemory.read(build(tmp_path, {}))
    assert memory.limits == [Limit(RAM, "RAM", None, 0)]
    assert memory.describe() == {"limit": RAM, "limit_from": "RAM", "ram": RAM, "cgroup": None}
    assert memory.available() == FREE
    assert memory.pressure() is None


@pytest.mark.parametrize("value", ["lots\n", "-5\n", "0\n", "\n", "12.5G\n", b"\xff\xfe1\n"])
def test_garbage_limit_values_are_skipped(tmp_path, value):
    v2 = HostMemory.read(v2_host(tmp_path / "v2", "/job", {"job/memory.max": value, "job/memory.high": value,
                                                           "memory.max": f"{9 * GiB}\n"}))
    v1 = HostMemory.read(v1_host(tmp_path / "v1", "/job", {"job/memory.limit_in_bytes": value,
                                                           "job/memory.stat": b"hierarchical_memory_limit " + (
                                                               value if isinstance(value, bytes) else value.encode()),
                                                           "memory.limit_in_bytes": f"{9 * GiB}\n"}))
    assert [limit.bytes for limit in v2.limits] == [limit.bytes for limit in v1.limits] == [RAM, 9 * GiB]


@pytest.mark.parametrize("free, expected", [(FREE, GiB // 2), (100 * MiB, 100 * MiB)],
                         ids=["parent-level-tightest", "mem-available-tightest"])
def test_v2_available_is_the_least_left_over_every_level_and_memavailable(tmp_path, free, expected):
    root = v2_host(tmp_path, "/slice/job", {
        # our level: 8 - 7 + 2 = 3 GiB left
        "slice/job/memory.max": f"{8 * GiB}\n", "slice/job/memory.current": f"{7 * GiB}\n",
        "slice/job/memory.stat": f"anon 0\nfile 0\ninactive_file {2 * GiB}\nactive_file 0\n",
        # the parent: 12 - 11.5 + 0 = 0.5 GiB left
        "slice/memory.max": f"{12 * GiB}\n", "slice/memory.current": f"{12 * GiB - GiB // 2}\n",
        "slice/memory.stat": "inactive_file 0\n",
    }, free)
    assert HostMemory.read(root).available() == expected


def test_v2_available_under_memory_high_counts_inactive_file(tmp_path):
    root = v2_host(tmp_path, "/job", {"job/memory.high": f"{4 * GiB}\n", "job/memory.current": f"{4 * GiB}\n",
                                      "job/memory.stat": f"inactive_file {GiB}\n"})
    assert HostMemory.read(root).available() == GiB


def test_v1_available_uses_usage_and_total_inactive_file(tmp_path):
    root = v1_host(tmp_path, "/job", {
        "job/memory.limit_in_bytes": f"{4 * GiB}\n", "job/memory.usage_in_bytes": f"{3 * GiB}\n",
        "job/memory.stat": f"inactive_file {100 * MiB}\ntotal_inactive_file {GiB}\n",
        "memory.limit_in_bytes": f"{6 * GiB}\n", "memory.usage_in_bytes": f"{5 * GiB}\n",
        "memory.stat": f"total_inactive_file {GiB // 2}\n",
    })
    assert HostMemory.read(root).available() == GiB + GiB // 2  # the parent's 6 - 5 + 0.5


def test_v1_available_falls_back_to_inactive_file(tmp_path):
    root = v1_host(tmp_path, "/job", {"job/memory.limit_in_bytes": f"{4 * GiB}\n",
                                      "job/memory.usage_in_bytes": f"{3 * GiB}\n",
                                      "job/memory.stat": f"inactive_file {GiB // 4}\n"})
    assert HostMemory.read(root).available() == GiB + GiB // 4


def test_available_is_clamped_at_zero_over_the_limit(tmp_path):
    root = v2_host(tmp_path, "/job", {"job/memory.max": f"{GiB}\n", "job/memory.current": f"{2 * GiB}\n",
                                      "job/memory.stat": "inactive_file 0\n"})
    assert HostMemory.read(root).available() == 0


def test_available_skips_a_level_whose_files_vanished(tmp_path):
    root = v2_host(tmp_path, "/slice/job", {
        "slice/job/memory.max": f"{2 * GiB}\n", "slice/job/memory.current": f"{2 * GiB}\n",
        "slice/job/memory.stat": "inactive_file 0\n",
        "slice/memory.max": f"{8 * GiB}\n", "slice/memory.current": f"{5 * GiB}\n",
        "slice/memory.stat": "inactive_file 0\n",
    })
    memory = HostMemory.read(root)
    assert memory.available() == 0
    Path(root, "sys/fs/cgroup/slice/job/memory.current").unlink()
    assert memory.available() == 3 * GiB  # the parent still bounds it
    Path(root, "sys/fs/cgroup/slice/memory.stat").write_text("inactive_file lots\n")
    Path(root, "proc/meminfo").unlink()
    assert memory.available() == 2 * GiB  # nothing readable: the limit, never an exception


def test_pressure_prefers_our_v2_cgroups_memory_pressure(tmp_path):
    root = v2_host(tmp_path, "/job", {"job/memory.pressure": PSI.format(some=12.5, total=4242)})
    Path(root, "proc/pressure").mkdir()
    Path(root, "proc/pressure/memory").write_text(PSI.format(some=1.0, total=1))
    assert HostMemory.read(root).pressure() == Stall(12.5, 4242, 0.25, 77,
                                                     os.path.join(root, "sys/fs/cgroup/job/memory.pressure"))


@pytest.mark.parametrize("cgroup_file", [None, "", "some avg10=x total=1\n", "some avg10=1.00 total=5\n"],
                         ids=["absent", "empty", "garbage", "no-full-line"])
def test_pressure_falls_back_to_proc_pressure_memory(tmp_path, cgroup_file):
    files = {} if cgroup_file is None else {"job/memory.pressure": cgroup_file}
    root = v2_host(tmp_path, "/job", files)
    Path(root, "proc/pressure").mkdir()
    Path(root, "proc/pressure/memory").write_text(PSI.format(some=3.25, total=99))
    assert HostMemory.read(root).pressure() == Stall(3.25, 99, 0.25, 77, os.path.join(root, "proc/pressure/memory"))


@pytest.mark.parametrize("proc_file", [None, "", "psi disabled\n", "some avg10=0.00 total=1\nfull avg10=0.00\n"],
                         ids=["absent", "empty", "garbage", "no-full-total"])
def test_pressure_is_none_without_a_parsable_psi_file(tmp_path, proc_file):
    files = {} if proc_file is None else {"proc/pressure/memory": proc_file}
    root = v1_host(tmp_path, "/job", files)
    assert HostMemory.read(root).pressure() is None


@pytest.mark.skipif(not os.path.exists("/proc/meminfo"), reason="needs Linux /proc")
def test_real_host_reads_ram_first_and_has_memory_available():
    memory = HostMemory.read()
    assert memory.limits[0] == Limit(ram_total(), "RAM", None, 0)
    assert all(limit.bytes > 0 for limit in memory.limits)
    assert 0 < memory.available() <= memory.limit.bytes
