"""benchmarks/wrong_model_stress.py exercises the cache it stresses: a check that loads
everything plainly would report "0 wrong" and prove nothing."""

from __future__ import annotations

import json
import subprocess
import sys

from ..conftest import REPO, child_env


def test_the_wrong_model_stress_check_serves_its_loads_from_the_cache(tmp_path):
    # Without the evictor every load waits for its fill and is then a hit, whether its tensors
    # lie in a memfd or in the model file; the budget (1.5 entries) still makes A and B evict
    # each other. Its budget once assumed an entry is the size of the file, and every load
    # fell back (TOO_LARGE) while the check passed.
    out = tmp_path / "stress.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "wrong_model_stress.py"), "--loads", "24",
                           "--evict-every", "0", "--widen-ms", "0", "--json", str(out)],
                          capture_output=True, text=True, env=child_env(), cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(out.read_text())
    assert (results["loads"], results["correct"], results["cached"]) == (24, 24, 24), results
    assert results["entry_bytes"] <= results["budget"] < 2 * results["entry_bytes"], results
    assert results["server_evictions"] > 0 and results["server_hits"] > 0, results
