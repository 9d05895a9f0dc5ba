"""overmind.bench.pressure without a server: the job's brakes, its output, the targets, the wiring."""

from __future__ import annotations

import json

import pytest

from overmind.bench import cli, pressure
from overmind.bench.pressure import GiB, MiB, Brake, check_targets, job_summary, read_meminfo


def test_brake_lets_the_job_grow_while_memory_is_available():
    brake = Brake()
    assert [brake.check(2 * GiB, t) for t in (0.0, 10.0, 100.0)] == [None, None, None]


def test_brake_stops_growth_only_after_five_seconds_under_one_gib():
    brake = Brake()
    assert brake.check(900 * MiB, 0.0) is None
    assert brake.check(900 * MiB, 4.9) is None
    why = brake.check(900 * MiB, 5.0)
    assert why is not None and "for 5 s" in why and not why.startswith("floor")


def test_brake_forgets_a_low_spell_once_memory_comes_back():
    brake = Brake()
    brake.check(900 * MiB, 0.0)
    assert brake.check(2 * GiB, 3.0) is None  # the cache let go
    assert brake.check(900 * MiB, 4.0) is None
    assert brake.check(900 * MiB, 8.9) is None
    assert brake.check(900 * MiB, 9.0) is not None


def test_brake_stops_at_once_under_the_floor():
    why = Brake().check(200 * MiB, 0.0)
    assert why is not None and why.startswith("floor")


def test_read_meminfo_gives_bytes():
    info = read_meminfo("MemTotal:       24684096 kB\nMemAvailable:   1024 kB\nHugePages_Total:       0\n")
    assert info == {"MemTotal": 24684096 * 1024, "MemAvailable": 1024 * 1024, "HugePages_Total": 0}
    assert read_meminfo()["MemAvailable"] > 0


def test_job_touches_its_target_and_reports_done(capsys):
    assert pressure.job(8 * MiB, 0.0) == 0
    lines = capsys.readouterr().out.splitlines()
    done = json.loads(lines[-1])
    assert (done["done"], done["got"], done["target"], done["stopped_early"]) == (True, 8 * MiB, 8 * MiB, None)
    assert job_summary(lines, 0, 1.0)["got"] == 8 * MiB


def test_job_under_the_floor_takes_nothing_and_skips_its_hold(capsys):
    assert pressure.job(8 * MiB, 60.0, Brake(floor=1 << 60)) == 0  # would hold a minute
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert not any("holding" in line for line in lines)
    assert lines[-1]["got"] == 0 and lines[-1]["stopped_early"].startswith("floor")


def test_job_summary_of_a_killed_job_keeps_its_last_progress():
    lines = [json.dumps({"got": 256 * MiB, "available": GiB, "t": 0.1}), "noise", json.dumps({"got": 512 * MiB})]
    summary = job_summary(lines, -9, 2.0)
    assert (summary["got"], summary["killed_by_signal"], summary["returncode"]) == (512 * MiB, 9, -9)
    assert "did not finish" in summary["stopped_early"]


def results(**beside) -> dict:
    return {"target_bytes": 10 * GiB,
            "job_beside_cache": {"got": 10 * GiB, "min_available_while_cache_held": GiB, "oom_kills": 0,
                                 "returncode": 0, "server_alive": True, **beside},
            "warm_again": {"seconds": 12.0}, "runs": {"run_over_plain": 0.1, "weights_equal": True}}


def test_targets_all_pass_when_the_cache_gives_way():
    rows = check_targets(results())
    assert set(rows) == set(pressure.TARGETS)
    assert all(row["pass"] is True for row in rows.values()), rows


def test_targets_fail_a_job_short_of_its_target_or_too_little_memory_left():
    rows = check_targets(results(got=9 * GiB, min_available_while_cache_held=100 * MiB))
    assert rows["job_got_ratio"]["value"] == pytest.approx(0.9) and rows["job_got_ratio"]["pass"] is False
    assert rows["min_available_while_cache_held"]["pass"] is False


def test_targets_missing_values_fail_but_unreadable_dmesg_is_unknown():
    doc = results(oom_kills=None, server_alive=False)
    doc["warm_again"] = {"seconds": None}
    del doc["runs"]
    rows = check_targets(doc)
    assert rows["oom_kills"]["pass"] is None
    assert rows["server_alive"]["pass"] is False
    assert rows["warm_again_seconds"]["pass"] is False and rows["run_over_plain"]["pass"] is False


def test_help_exits_zero():
    with pytest.raises(SystemExit) as exit_:
        pressure.main(["--help"])
    assert exit_.value.code == 0


def test_overmind_bench_hands_memory_pressure_to_its_runner(monkeypatch):
    seen = []
    monkeypatch.setattr(pressure, "main", lambda argv, command: seen.append((argv, command)) or 0)
    argv = ["--scenarios", "memory_pressure", "--scale", "small", "--margin", "8", "--hold", "1", "--pairs", "2"]
    assert cli.main(argv) == 0
    assert seen == [(argv, ["overmind-bench", *argv])]  # the command its document gives
