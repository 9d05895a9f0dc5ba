"""The drop-in leaves quickly and loses nothing: Note [The drop-in leaves quickly] in overmind.shared.process.teardown.

A real python process: ``monkey_patch_all()``, a file left open and unflushed in a reference
cycle (only the collector would free it), a garbage cycle with a finalizer, atexit callbacks
registered before and after the patch, ``sys.exit(3)``. What the user can observe (status,
output, the file's bytes) must be plain python's; that the teardown skipped the long-lived heap
is asserted as the decision (the heap was frozen before the last callbacks ran), not as a time.
"""

from __future__ import annotations

import sys
import subprocess

import pytest

from ..conftest import REPO, child_env

SCRIPT = r'''
import atexit, gc, io, sys
atexit.register(lambda: print("earliest callback, heap frozen:", gc.get_freeze_count() > 0, flush=True))
import overmind.api
overmind.api.monkey_patch_all()
atexit.register(lambda: print("later callback", flush=True))


class Holder:
    def __init__(self, path):
        self.file = open(path, "w")  # buffered; never flushed nor closed
        self.me = self  # a cycle: only the collector would free it


class Noisy:
    def __del__(self):
        print("cyclic garbage finalized", flush=True)


class Buffered(io.BufferedWriter):  # a subclass, two levels down from the io type
    pass


class Deeper(Buffered):
    pass


kept = Holder(sys.argv[1])
kept.file.write("kept in a cycle\n" * 100)
kept.raw = Deeper(io.FileIO(sys.argv[1] + ".bin", "w"))  # in the same cycle, unflushed
kept.raw.write(b"binary, in a subclass\n" * 100)
noisy = Noisy()
noisy.me = noisy
del noisy
print("unflushed last line", end="")
sys.exit(3)
'''


def _run(tmp_path, name: str, **env: str) -> tuple[subprocess.CompletedProcess, bytes]:
    script, out = tmp_path / "script.py", tmp_path / f"{name}.txt"
    script.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, str(script), str(out)], capture_output=True, text=True, timeout=120,
                          cwd=REPO, env=child_env(OVERMIND_PRESTART="0", OVERMIND_NO_AUTOSTART="1", **env))
    return proc, out.read_bytes() + out.with_suffix(".txt.bin").read_bytes()


@pytest.mark.parametrize("setting", ["", "1", "yes"])
def test_the_drop_in_skips_the_teardowns_sweep_and_keeps_plains_status_output_finalizers_and_files(tmp_path, setting):
    plain, plain_file = _run(tmp_path, "plain", OVERMIND_DISABLE="1")
    quick, quick_file = _run(tmp_path, "quick", OVERMIND_QUICK_EXIT=setting)
    assert plain.returncode == quick.returncode == 3, quick.stderr
    assert quick_file == plain_file == b"kept in a cycle\n" * 100 + b"binary, in a subclass\n" * 100
    lines = quick.stdout.splitlines()
    assert sorted(lines) == sorted(plain.stdout.replace("frozen: False", "frozen: True").splitlines()), \
        (plain.stdout, quick.stdout)
    assert "earliest callback, heap frozen: True" in lines  # the teardown will not walk the old heap
    assert quick.stderr == plain.stderr == ""


def test_overmind_quick_exit_0_leaves_the_teardown_as_it_is(tmp_path):
    proc, data = _run(tmp_path, "off", OVERMIND_QUICK_EXIT="0")
    assert proc.returncode == 3 and data == b"kept in a cycle\n" * 100 + b"binary, in a subclass\n" * 100
    assert "earliest callback, heap frozen: False" in proc.stdout
