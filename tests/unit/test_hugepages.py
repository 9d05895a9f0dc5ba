"""overmind.shared.segments.hugepages reads the kernel's shmem huge-page setting and counters.

Each test writes a small sysfs/proc tree in the kernel's own format under a temp root, so
every setting value is covered without changing this machine's (machine-global) setting.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from overmind.shared.segments import hugepages

KERNEL_VALUES = ("always", "within_size", "advise", "never", "deny", "force")  # as 6.x prints them
SIZE_VALUES = ("always", "inherit", "within_size", "advise", "never")  # hugepages-<size>kB/shmem_enabled

MEMINFO = """MemTotal:       24576000 kB
Shmem:              8872 kB
AnonHugePages:         0 kB
ShmemHugePages:    {huge} kB
ShmemPmdMapped:    {mapped} kB
FileHugePages:         0 kB
HugePages_Total:       0
Hugepagesize:       2048 kB
"""


def _choices(values: tuple[str, ...], chosen: str) -> str:
    return " ".join(f"[{v}]" if v == chosen else v for v in values) + "\n"


def make_root(tmp_path: Path, setting: str | None, *, size_setting: str | None = None, huge_kb: int = 0,
              mapped_kb: int = 0, pmd_size: int | None = 2 << 20) -> str:
    """A root holding the files hugepages reads; ``None`` leaves a file out, as kernels do."""
    thp = tmp_path / "sys/kernel/mm/transparent_hugepage"
    thp.mkdir(parents=True)
    if setting is not None:
        (thp / "shmem_enabled").write_text(_choices(KERNEL_VALUES, setting))
    if pmd_size is not None:
        (thp / "hpage_pmd_size").write_text(f"{pmd_size}\n")
    if size_setting is not None:
        size_dir = thp / f"hugepages-{(pmd_size or 2 << 20) // 1024}kB"
        size_dir.mkdir()
        (size_dir / "shmem_enabled").write_text(_choices(SIZE_VALUES, size_setting))
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/meminfo").write_text(MEMINFO.format(huge=huge_kb, mapped=mapped_kb))
    return str(tmp_path)


@pytest.mark.parametrize("setting,enabled", [("always", True), ("within_size", True), ("advise", True),
                                             ("force", True), ("never", False), ("deny", False)])
def test_each_kernel_setting_is_read_from_its_brackets_and_judged(tmp_path, setting, enabled):
    hp = hugepages.read_status(make_root(tmp_path, setting, size_setting="inherit"))
    assert hp.setting == setting
    assert hp.enabled is enabled
    assert (hp.why_not is None) is enabled
    if not enabled:
        assert repr(setting) in hp.why_not and hugepages.SHMEM_ENABLED in hp.why_not
    assert hp.command == "echo advise | sudo tee /sys/kernel/mm/transparent_hugepage/shmem_enabled"


def test_meminfo_counters_are_reported_in_bytes(tmp_path):
    hp = hugepages.read_status(make_root(tmp_path, "advise", huge_kb=2097152, mapped_kb=4096))
    assert hp.shmem_huge_bytes == 2 << 30
    assert hp.shmem_pmd_mapped_bytes == 4 << 20


def test_a_kernel_without_thp_is_unavailable_and_off_with_a_reason(tmp_path):
    hp = hugepages.read_status(make_root(tmp_path, None, pmd_size=None))
    assert (hp.setting, hp.enabled, hp.size_setting) == ("unavailable", False, None)
    assert "missing" in hp.why_not
    assert hp.page_size == hugepages.PMD_SIZE


def test_a_missing_meminfo_reads_as_zero_bytes(tmp_path):
    root = make_root(tmp_path, "always")
    (tmp_path / "proc/meminfo").unlink()
    hp = hugepages.read_status(root)
    assert (hp.enabled, hp.shmem_huge_bytes, hp.shmem_pmd_mapped_bytes) == (True, 0, 0)


@pytest.mark.parametrize("size_setting,enabled", [("inherit", True), ("always", True), ("within_size", True),
                                                  ("advise", True), ("never", False)])
def test_the_pmd_size_setting_overrides_the_top_level_one_unless_it_inherits(tmp_path, size_setting, enabled):
    # Note [The 2 MiB size has its own shmem setting]
    hp = hugepages.read_status(make_root(tmp_path, "advise", size_setting=size_setting))
    assert (hp.size_setting, hp.enabled) == (size_setting, enabled)
    if not enabled:
        assert "hugepages-2048kB/shmem_enabled" in hp.why_not
        assert hp.command.startswith("echo inherit | sudo tee /sys/kernel/mm/transparent_hugepage/hugepages-2048kB/")
        assert "echo advise" not in hp.command  # the top level already allows them


def test_a_pmd_size_that_allows_does_not_rescue_a_top_level_never_unless_it_overrides(tmp_path):
    on = hugepages.read_status(make_root(tmp_path / "a", "never", size_setting="always"))
    off = hugepages.read_status(make_root(tmp_path / "b", "never", size_setting="never"))
    assert on.enabled and not off.enabled
    assert off.command.startswith("echo inherit") and "echo advise" in off.command  # both settings need changing


def test_the_pmd_size_is_read_from_the_kernel(tmp_path):
    hp = hugepages.read_status(make_root(tmp_path, "advise", size_setting="never", pmd_size=512 << 20))  # arm64 64K
    assert hp.page_size == 512 << 20
    assert "hugepages-524288kB" in hp.why_not and "512 MiB" in hp.cost


def test_the_cost_says_what_is_paid_and_where_it_is_measured(tmp_path):
    hp = hugepages.read_status(make_root(tmp_path, "never"))
    assert "first use" in hp.cost and "4 KiB" in hp.cost and "512 faults" in hp.cost
    assert "overmind-bench" in hp.cost


def test_as_dict_is_json_ready_and_names_every_field(tmp_path):
    import json

    d = hugepages.read_status(make_root(tmp_path, "never", size_setting="inherit")).as_dict()
    assert json.loads(json.dumps(d)) == d
    assert set(d) == {"setting", "size_setting", "enabled", "shmem_huge_bytes", "shmem_pmd_mapped_bytes",
                      "page_size", "why_not", "cost", "command"}


def test_this_machine_reads_as_its_own_files_say():
    # Read-only: the real files, compared with a plain parse of them (the value may be anything).
    path = Path("/") / hugepages.SHMEM_ENABLED
    if not path.exists():
        assert hugepages.read_setting() == "unavailable"
        return
    text = path.read_text()
    assert f"[{hugepages.read_setting()}]" in text
    assert hugepages.read_status().setting == hugepages.read_setting()


def test_status_text_when_off_says_why_what_it_costs_and_the_command(tmp_path):
    from overmind.frontend.cli import _huge_page_lines

    lines = _huge_page_lines(hugepages.read_status(make_root(tmp_path, "never", size_setting="inherit")))
    assert lines[0] == ("huge pages  off (shmem_enabled never): segments use 4 KiB pages; "
                        "0 B of shared memory in huge pages (machine-wide)")
    text = "\n".join(lines)
    assert "why:      /sys/kernel/mm/transparent_hugepage/shmem_enabled is 'never'" in text
    assert "cost:" in text and "overmind-bench" in text
    assert "turn on:  echo advise | sudo tee /sys/kernel/mm/transparent_hugepage/shmem_enabled" in text


def test_status_text_when_on_is_one_line_with_the_bytes_and_names_an_overriding_size_setting(tmp_path):
    from overmind.frontend.cli import _huge_page_lines

    on = _huge_page_lines(hugepages.read_status(make_root(tmp_path / "a", "advise", huge_kb=2097152)))
    assert on == ["huge pages  on (shmem_enabled advise): 2.1 GB of shared memory in huge pages (machine-wide)"]
    off = _huge_page_lines(hugepages.read_status(make_root(tmp_path / "b", "advise", size_setting="never")))
    assert off[0].startswith("huge pages  off (shmem_enabled advise, 2048 kB size never)")
    assert "turn on:  echo inherit | sudo tee /sys/kernel/mm/transparent_hugepage/hugepages-2048kB/" in off[-1]


@pytest.mark.parametrize("setting,enabled", [("deny", False), ("force", True)])
def test_a_top_level_deny_or_force_overrides_every_size_setting(tmp_path, setting, enabled):
    # Note [The 2 MiB size has its own shmem setting]: the testing values win over the per-size knob.
    hp = hugepages.read_status(make_root(tmp_path, setting, size_setting="always" if setting == "deny" else "never"))
    assert hp.enabled is enabled
    if not enabled:
        assert hp.command == hugepages.ENABLE_COMMAND and repr(setting) in hp.why_not


def test_status_text_when_on_notes_a_cache_filled_before_huge_pages_were_on(tmp_path):
    from overmind.frontend.cli import STALE_FILL_HINT_BYTES, _huge_page_lines

    none_huge = hugepages.read_status(make_root(tmp_path / "a", "advise"))
    assert "overmind evict --all" in _huge_page_lines(none_huge, 3_580_000_000)[-1]
    assert len(_huge_page_lines(none_huge, STALE_FILL_HINT_BYTES - 1)) == 1  # small caches may fit no huge page
    some_huge = hugepages.read_status(make_root(tmp_path / "b", "advise", huge_kb=4096))
    assert len(_huge_page_lines(some_huge, 3_580_000_000)) == 1
