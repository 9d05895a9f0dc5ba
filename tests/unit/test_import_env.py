"""Note [Settings an import read] in overmind.shared.settings.import_env: what recording sees, in a fresh interpreter."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

PROBE = """
import json, os
from overmind.shared.settings.import_env import Reads, recording
os.environ.pop("IMPORT_ENV_ABSENT", None)
os.environ["IMPORT_ENV_PRESENT"] = "yes"
reads = Reads()
with recording(reads):
    {body}
print(json.dumps({{"names": reads.names, "prefixes": sorted(reads.prefixes), "unbounded": bool(reads.unbounded),
                  "restored": type(os.environ) is os._Environ}}))
"""


def _record(body: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE.format(body=body)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_keyed_reads_are_recorded_with_the_value_seen_unset_included():
    got = _record("os.getenv('IMPORT_ENV_ABSENT'); 'IMPORT_ENV_PRESENT' in os.environ")
    assert got["names"] == {"IMPORT_ENV_ABSENT": None, "IMPORT_ENV_PRESENT": "yes"}
    assert not got["unbounded"] and got["restored"]


def test_an_iteration_filtered_by_startswith_records_the_prefix_not_every_name():
    got = _record("{k: v for k, v in os.environ.items() if k.startswith('IMPORT_ENV_')}")
    assert got["prefixes"] == ["IMPORT_ENV_"] and got["names"] == {} and not got["unbounded"]


@pytest.mark.parametrize("body", ["os.environ.copy()", "dict(os.environ)", "list(os.environ)",
                                  "[k.lower() for k in os.environ]"])
def test_an_iteration_or_copy_that_cannot_be_followed_is_unbounded(body):
    assert _record(body)["unbounded"]


def test_what_the_interpreter_sets_for_itself_is_never_a_difference():
    # The warm interpreter sets PYTORCH_NVML_BASED_CUDA_CHECK for its own imports (Note [Warm
    # interpreters never touch CUDA]); torch reads it there on a CUDA build, and the run's own
    # value (usually unset) must not refuse the fork.
    from overmind.shared.settings.import_env import INTERPRETERS_OWN, differs

    got = _record("os.environ.get('PYTORCH_NVML_BASED_CUDA_CHECK'); os.getenv('IMPORT_ENV_ABSENT')")
    assert got["names"] == {"IMPORT_ENV_ABSENT": None}
    own = {"PYTORCH_NVML_BASED_CUDA_CHECK": "1", "PYTORCH_X": "a"}
    assert "PYTORCH_NVML_BASED_CUDA_CHECK" in INTERPRETERS_OWN
    assert differs({"PYTORCH_X": "a"}, own, {}, ["PYTORCH_"]) == ""
    assert "PYTORCH_X" in differs({}, own, {}, ["PYTORCH_"])
