"""A context whose interpreter cannot start: the client hears why, and loads plainly.

The client runs through a link to the venv's python, then replaces that link with a program
that exits at once (a venv deleted or rebuilt under a running script). The server's warm
interpreter for that context then dies before it is ready; the load must still return plain's
result, with one warning that names the interpreter and its exit status.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig

from ..conftest import REPO, age_files

CLIENT = r'''
import json, os, sys, warnings
exe = sys.executable
os.unlink(exe)
with open(exe, "w") as f:
    f.write("#!/bin/sh\nexit 7\n")
os.chmod(exe, 0o755)
import overmind.api
overmind.api.monkey_patch_all()
import torch
out = {}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    out["weights"] = torch.load(sys.argv[1], weights_only=True)["w"].tolist()
out["warnings"] = [str(w.message) for w in caught if "overmind" in str(w.message)]
print(json.dumps(out))
'''


def test_an_interpreter_that_exits_at_once_is_named_with_its_status_and_the_load_is_plain(server, tmp_path):
    import torch

    data = tmp_path / "w.pt"
    torch.save({"w": torch.arange(4.0)}, data)
    age_files(data)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    exe = bin_dir / "python"
    os.symlink(os.path.realpath(sys.executable), exe)
    pythonpath = os.pathsep.join([str(REPO / "src"), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    env = server.client_env(PYTHONPATH=pythonpath, OVERMIND_COLD="wait")  # wait: the client hears the fill's end
    proc = subprocess.run([str(exe), "-c", CLIENT, str(data)], capture_output=True, text=True, env=env, timeout=120,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["weights"] == [0.0, 1.0, 2.0, 3.0]
    assert len(out["warnings"]) == 1, out["warnings"]
    warning = out["warnings"][0]
    assert str(exe) in warning and "exit status 7" in warning, warning
    assert server.proc.poll() is None, "the server must survive"
