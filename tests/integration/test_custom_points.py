"""Custom patch points from ``overmind.cfg`` beside the calling package and from OVERMIND_PATCH."""

from __future__ import annotations

import json
import textwrap

import torch

from ..conftest import age_files, run_python
from .conftest import last_json

LIBRARY = '''
import torch

CALLS = []


class Weights:
    @classmethod
    def open(cls, path):
        CALLS.append(path)
        return {"w": torch.load(path, weights_only=True)["w"] * 2}


def load_state(path):
    CALLS.append(path)
    return torch.load(path, weights_only=True)
'''

APP = '''
import json, sys
import overmind.api
overmind.api.monkey_patch_all()
import mylib
a = mylib.Weights.open(sys.argv[1])
b = mylib.load_state(sys.argv[1])
print(json.dumps({"a": a["w"].tolist(), "b": b["w"].tolist(), "local_calls": len(mylib.CALLS),
                  "patched": [overmind.api.is_patched("mylib::Weights.open"), overmind.api.is_patched("mylib::load_state")]}))
'''


def test_overmind_cfg_and_env_points_are_cached(server, tmp_path):
    (tmp_path / "mylib.py").write_text(textwrap.dedent(LIBRARY))
    app = tmp_path / "app"
    app.mkdir()
    (app / "__init__.py").write_text("")
    (app / "main.py").write_text(textwrap.dedent(APP))
    (app / "overmind.cfg").write_text("# custom loaders of this app\nmylib::Weights.open\n")
    weights = tmp_path / "w.pt"
    torch.save({"w": torch.arange(4.0)}, weights)
    age_files(weights)
    code = f"import runpy, sys; sys.path[:0] = [{str(tmp_path)!r}]; sys.argv = ['main', {str(weights)!r}]; " \
           f"runpy.run_path({str(app / 'main.py')!r}, run_name='__main__')"
    env = server.client_env(OVERMIND_PATCH="mylib::load_state", OVERMIND_STRICT="1")

    first = last_json(run_python(code, env=env))
    server.wait_idle()
    second = last_json(run_python(code, env=env))
    assert first["patched"] == second["patched"] == [True, True]
    assert first["a"] == second["a"] == [0.0, 2.0, 4.0, 6.0]
    assert first["b"] == second["b"] == [0.0, 1.0, 2.0, 3.0]
    # strict mode waits for the loader on a miss, so neither run calls the loaders in-process
    assert first["local_calls"] == second["local_calls"] == 0
    status = server.status()
    assert status["misses"] == 2 and status["hits"] == 2, json.dumps(status)
