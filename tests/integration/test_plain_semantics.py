"""A hit behaves as the plain call would have, in the caller's process.

One script holds every case and runs in fresh processes: plainly (OVERMIND_DISABLE=1),
patched to fill the cache (twice), and patched again to hit. It prints what the caller can observe (weights,
exceptions, warnings, log records, the generators' next draws) and whether its result was
served from the cache; the hit must print exactly what the plain run printed.
Note [Process-global state of a load] in overmind.shared.calls.callstate.
"""

from __future__ import annotations

import json
import os

import pytest

from ..conftest import age_files
from .conftest import last_json

PRELUDE = r'''
import json, logging, sys, warnings
PATCHED = sys.argv[1] != "plain"
if PATCHED:
    import overmind.api
    overmind.api.monkey_patch_all()
import torch

def served_from_cache(model):
    """True when the model's first weight lives in an overmind segment (a memfd mapping: the
    server settles its file segments at once, OVERMIND_SETTLE_AFTER=0)."""
    tensor = next(iter(model.parameters())) if hasattr(model, "parameters") else next(iter(model.values()))
    ptr = tensor.untyped_storage().data_ptr()
    with open("/proc/self/maps") as maps:
        for line in maps:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= ptr < hi:
                return "memfd:" in line
    return False

def head(t):
    return [round(float(x), 6) for x in t.detach().flatten()[:6]]

out = {}
'''


SCRIPT = PRELUDE + r"""
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, Qwen2Config, Qwen2Model
from diffusers import UNet2DConditionModel
import mylib

records = []

class Keep(logging.Handler):
    def emit(self, record):
        records.append([record.name, record.levelname, record.getMessage()[:200], record.funcName])

for name in ("transformers", "mylib", "noisy"):
    logging.getLogger(name).addHandler(Keep())
logging.getLogger("mylib").setLevel(logging.INFO)
lm, unet, pt = sys.argv[2:5]

# A new head drawn from the caller's seed, twice; the generator's next draws after it.
for seed in (0, 1):
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_pretrained(lm, num_labels=2)
    out[f"new_head_{seed}"] = {"cached": served_from_cache(model), "score": head(model.score.weight),
                               "base": head(model.model.embed_tokens.weight), "next_draw": head(torch.rand(4))}
del records[:]

# The same load in a process whose generator was seeded from OS entropy (as torch does by default).
torch.seed()
model = AutoModelForSequenceClassification.from_pretrained(lm, num_labels=2)
out["unseeded"] = {"cached": served_from_cache(model)}
del records[:]

# No checkpoint at all: every weight drawn from the caller's seed.
torch.manual_seed(7)
cfg = Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1)
model = Qwen2Model.from_pretrained(None, config=cfg, state_dict={})
out["no_checkpoint"] = {"cached": served_from_cache(model), "weights": [head(p) for p in model.parameters()],
                        "next_draw": head(torch.rand(4))}
del records[:]

# A load that draws nothing: the next draws are the seed's own.
torch.manual_seed(3)
model = AutoModelForCausalLM.from_pretrained(lm)
out["draws_nothing"] = {"cached": served_from_cache(model), "next_draw": head(torch.rand(4))}

# The same load under a meta device context.
try:
    with torch.device("meta"):
        AutoModelForCausalLM.from_pretrained(lm)
    out["meta_device"] = "returned"
except Exception as err:
    out["meta_device"] = [type(err).__name__, str(err)[:120]]

# The default dtype.
torch.set_default_dtype(torch.float64)
model = UNet2DConditionModel.from_pretrained(unet)
torch.set_default_dtype(torch.float32)
out["default_dtype"] = {"cached": served_from_cache(model), "dtype": str(model.conv_in.weight.dtype)}

# Warnings and log records of a load (a custom patch point), through the caller's filters.
del records[:]
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    state = mylib.load(pt)
out["replayed"] = {"cached": served_from_cache(state), "records": list(records),
                   "warnings": [[w.category.__name__, str(w.message), w.filename, w.lineno] for w in caught]}
with warnings.catch_warnings():
    warnings.simplefilter("error", FutureWarning)
    try:
        mylib.load(pt)
        out["error_filter"] = None
    except FutureWarning as err:
        out["error_filter"] = str(err)
    warnings.simplefilter("ignore")
    out["error_filter_cached"] = served_from_cache(mylib.load(pt))

# A load that imports a module which warns and logs while imported: once per process, as plain.
del records[:]
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    states = [mylib.load_noisy(pt) for _ in range(3)]
out["import_warning"] = {"cached": served_from_cache(states[-1]), "records": list(records),
                         "warnings": [str(w.message) for w in caught]}

# The load report transformers logs for a new head.
del records[:]
model = AutoModelForSequenceClassification.from_pretrained(lm, num_labels=3)
out["load_report"] = {"cached": served_from_cache(model), "records": list(records)}
print(json.dumps(out))
"""

MYLIB = """
import logging, warnings
import torch
log = logging.getLogger("mylib.loading")

def load(path):
    warnings.warn("mylib: this format is deprecated", FutureWarning, stacklevel=2)
    warnings.warn("mylib: a library-internal notice", UserWarning)
    log.warning("mylib: %s lacks 1 tensor", path)
    log.info("mylib: read 2 tensors")
    log.debug("mylib: not recorded, not enabled")
    return torch.load(path, weights_only=True)

def load_noisy(path):
    import noisy, quiet
    quiet.notice()
    return torch.load(path, weights_only=True)
"""

QUIET = """
import warnings

def notice():
    warnings.warn("quiet: notice", UserWarning)
"""

NOISY = """
import logging, warnings
warnings.warn("noisy: imported", UserWarning)
logging.getLogger("noisy").warning("noisy: imported")
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory, models):
    """The script plain, patched twice to fill (the second fills what the first's seeds did not
    reach: Note [Loads that draw random numbers]), then patched to hit, against one server."""
    import subprocess
    import sys

    import torch

    from ..conftest import REPO
    from .conftest import running_server

    root = tmp_path_factory.mktemp("plain_semantics")
    (root / "mylib.py").write_text(MYLIB)
    (root / "noisy.py").write_text(NOISY)
    (root / "quiet.py").write_text(QUIET)
    torch.save({"w": torch.arange(6.0)}, root / "w.pt")
    age_files(root)
    pythonpath = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p)
    with running_server(env={"PYTHONPATH": pythonpath, "OVERMIND_PATCH": "mylib::load,mylib::load_noisy",
                             "OVERMIND_SETTLE_AFTER": "0"}) as server:
        outs = {}
        for run in ("plain", "fill", "fill again", "hit"):
            env = server.client_env(**({"OVERMIND_DISABLE": "1"} if run == "plain" else {}))
            proc = subprocess.run([sys.executable, "-c", SCRIPT, run, str(models["lm"]), str(models["unet"]),
                                   str(root / "w.pt")], capture_output=True, text=True, env=env, timeout=300, cwd=REPO)
            assert proc.returncode == 0, f"{run}: {proc.stderr[-4000:]}"
            outs[run] = last_json(proc)
            server.wait_settled()
        outs["entries"] = json.loads(server.cli("list", "--json").stdout)
        yield outs


def same_as_plain(runs, case: str):
    plain, hit = dict(runs["plain"][case]), dict(runs["hit"][case])
    assert hit.pop("cached"), f"{case}: the last run was not served from the cache"
    plain.pop("cached")
    assert hit == plain, case
    return plain


# -- random numbers ---------------------------------------------------------------------------


def test_a_new_head_after_a_seed_is_that_seeds_head_and_leaves_the_generator_where_plain_does(runs):
    heads = [same_as_plain(runs, f"new_head_{seed}") for seed in (0, 1)]
    assert heads[0]["score"] != heads[1]["score"] and heads[0]["base"] == heads[1]["base"]


def test_a_model_built_from_no_checkpoint_draws_from_the_callers_seed(runs):
    same_as_plain(runs, "no_checkpoint")


def test_a_load_that_draws_nothing_is_shared_by_every_seed(runs):
    same_as_plain(runs, "draws_nothing")
    lm_loads = [e for e in runs["entries"] if "AutoModelForCausalLM" in e.get("description", "")]
    assert len(lm_loads) == 1, lm_loads


def test_an_unseeded_process_loads_plainly_and_files_nothing(runs):
    assert not any(run["unseeded"]["cached"] for run in (runs["fill"], runs["fill again"], runs["hit"]))
    heads = [e for e in runs["entries"] if "num_labels=2" in e.get("description", "")]
    assert len(heads) == 2, heads  # seeds 0 and 1 only


# -- global defaults --------------------------------------------------------------------------


def test_a_load_under_a_meta_device_context_raises_as_plain_even_when_cached(runs):
    assert runs["plain"]["meta_device"][0] == "RuntimeError"
    assert runs["hit"]["meta_device"] == runs["plain"]["meta_device"]
    assert runs["hit"]["draws_nothing"]["cached"]  # the same call outside the context was a hit


def test_the_default_dtype_reaches_the_load(runs):
    assert same_as_plain(runs, "default_dtype") == {"dtype": "torch.float64"}


# -- warnings and log records -----------------------------------------------------------------


def test_warnings_and_log_records_of_a_load_are_replayed_on_a_hit(runs):
    expected = same_as_plain(runs, "replayed")
    assert [w[0] for w in expected["warnings"]] == ["FutureWarning", "UserWarning"]
    assert expected["warnings"][0][2] == "<string>"  # stacklevel=2 names the caller's line
    assert [r[1] for r in expected["records"]] == ["WARNING", "INFO"]  # DEBUG is not enabled


def test_a_replayed_warning_obeys_the_callers_filters(runs):
    assert runs["plain"]["error_filter"] == runs["hit"]["error_filter"] == "mylib: this format is deprecated"
    assert runs["hit"]["error_filter_cached"]


def test_a_warning_of_an_import_inside_a_load_is_replayed_once_per_process_as_plain(runs):
    expected = same_as_plain(runs, "import_warning")
    assert expected["warnings"] == ["noisy: imported"] + ["quiet: notice"] * 3, expected
    assert [r[2] for r in expected["records"]] == ["noisy: imported"], expected


def test_the_load_report_of_a_new_head_is_logged_on_a_hit(runs):
    expected = same_as_plain(runs, "load_report")
    assert any("MISSING" in r[2] and r[1] == "WARNING" for r in expected["records"]), expected


# -- a generator the load imports ---------------------------------------------------------------

NUMPY_SCRIPT = PRELUDE + r"""
from transformers import AutoModelForCausalLM
if sys.argv[3] == "numpy first":
    import numpy.random
out["numpy_imported_before_the_load"] = "numpy.random" in sys.modules
model = AutoModelForCausalLM.from_pretrained(sys.argv[2])
import numpy
out["cached"] = served_from_cache(model)
out["draws"] = [float(x) for x in numpy.random.rand(3)]
print(json.dumps(out))
"""


@pytest.fixture
def settling_server(make_server):
    """A server that settles file segments at once, so hits map memfds (served_from_cache)."""
    return make_server({"OVERMIND_SETTLE_AFTER": "0"})


def test_numpys_generator_after_a_hit_starts_from_fresh_entropy_and_the_key_ignores_its_import(settling_server, models):
    import subprocess
    import sys

    from ..conftest import REPO

    server = settling_server

    def run(order: str) -> dict:
        proc = subprocess.run([sys.executable, "-c", NUMPY_SCRIPT, "patched", str(models["lm"]), order],
                              capture_output=True, text=True, env=server.client_env(), timeout=300, cwd=REPO)
        assert proc.returncode == 0, proc.stderr[-4000:]
        server.wait_settled()
        return last_json(proc)

    fill = run("numpy after")
    assert not fill["numpy_imported_before_the_load"], "the load must be the one to import numpy.random"
    hits = [run("numpy after"), run("numpy after"), run("numpy first")]
    assert all(hit["cached"] for hit in hits), hits
    draws = [tuple(hit["draws"]) for hit in [fill, *hits]]
    assert len(set(draws)) == len(draws), f"numpy's draws repeat across processes: {draws}"
    entries = json.loads(server.cli("list", "--json").stdout)
    assert len(entries) == 1, entries  # importing numpy first asks for the same entry
