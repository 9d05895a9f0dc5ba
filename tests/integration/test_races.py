"""A segment is what it claims to be (ARCHITECTURE.md, invariant 7), even when its entry goes away.

An ``Entry`` reply names segments by the server's fd numbers, and the server reuses a
number the moment eviction closes it. Each test here replays the race step by step,
against a real server, with two same-size fine-tunes of one architecture (so the numbers
and sizes of their segments coincide): reply for A, evict A, load B, then open A's
segments. The client must notice (``SegmentChanged``) and never map B's bytes as A's.
"""

from __future__ import annotations

import json

import pytest

from overmind import modelgen

from ..conftest import age_files
from .conftest import last_json


@pytest.fixture(scope="module")
def twin(models, tmp_path_factory):
    """A second tiny LM, same architecture and size as models["lm"], other weights."""
    path = modelgen.save_lm(tmp_path_factory.mktemp("twin") / "lm_b", seed=6)
    age_files(path)
    return path


RACE = r"""
import json, os, sys
import torch
from transformers import LlamaForCausalLM
from overmind.shared import protocol as P
from overmind.shared.protocol.contexts import caller_context
from overmind.shared.calls.keys import Target, encode_call
from overmind.client.connection import LoadingConnection, SegmentChanged, _slot_handles
from overmind.shared.settings.config import Config

path_a, path_b, rounds, via = ARGS
config = Config.from_env()
target = Target.of(LlamaForCausalLM.from_pretrained)

def call(path):
    return encode_call(target, (path,), {}, lambda obj: None)

def fill(conn, c):
    # wait=True: answered once the server holds the entry (a hit if it did already)
    return conn.load(P.Load(c.key, target.name, c.description, caller_context(), modules=target.modules, wait=True), c.blob)

def weights(model):
    return float(sum(t.double().sum() for t in model.state_dict().values()))

a, b = call(path_a), call(path_b)
plain = {}
os.environ["OVERMIND_DISABLE"] = "1"
plain["a"] = weights(LlamaForCausalLM.from_pretrained(path_a))
plain["b"] = weights(LlamaForCausalLM.from_pretrained(path_b))
del os.environ["OVERMIND_DISABLE"]

results = []
with LoadingConnection.open(config) as conn, LoadingConnection.open(config, role="cli") as admin:
    for _ in range(rounds):
        fill(conn, a)
        reply, skeleton = fill(conn, a)                      # 1. the reply for A (a hit)
        admin.simple(P.Evict(key=a.key), P.Evicted)          # 2. A is evicted: its fds are closed
        reply_b, _ = fill(conn, b)                           # 3. B is loaded: same sizes, likely same fds
        admin.simple(P.Evict(key=b.key), P.Evicted) if via == "reloaded" else None
        fill(conn, a) if via == "reloaded" else None         #    (or A itself again, in new segments)
        same_numbers = [s[:2] for s in reply.segments if s] == [s[:2] for s in reply_b.segments if s]
        if via == "proc" and not same_numbers:
            # fd numbering depends on what else the server opened meanwhile (a loader's connection);
            # when B did not land on A's numbers by itself, name B's numbers in A's reply, as the
            # race does: A's identity, the numbers that now hold B's segments.
            reply.segments = [[b[0], b[1], a[2], a[3]] if a and b else a for a, b in zip(reply.segments, reply_b.segments)]
        try:                                                 # 4. only now open A's segments
            if via == "proc":
                mappings = conn.map_segments(reply)
            else:
                mappings = conn._map_received(reply, _slot_handles(reply))
        except SegmentChanged as err:
            results.append({"outcome": "refused", "same_numbers": same_numbers, "why": str(err)})
            continue
        from overmind.shared.segments.reductions import unpack
        got = weights(unpack(skeleton, mappings))
        results.append({"outcome": "a" if got == plain["a"] else "b" if got == plain["b"] else "garbage",
                        "same_numbers": same_numbers})

# And through the user's API: the retry gets the right model (or a plain load), never B's.
import overmind.api
overmind.api.monkey_patch_all()
model = LlamaForCausalLM.from_pretrained(path_a)
print(json.dumps({"results": results, "api": weights(model) == plain["a"]}))
"""


@pytest.mark.parametrize("via", ["proc", pytest.param("scm_rights", marks=pytest.mark.slow),
                                 pytest.param("reloaded", marks=pytest.mark.slow)])
def test_an_entry_evicted_between_reply_and_open_never_maps_another_models_segments(server, models, twin, via):
    env = server.client_env(OVERMIND_COLD="wait")
    args = repr((str(models["lm"]), str(twin), 3, via))
    out = last_json(server.run(RACE.replace("ARGS", args), env=env))
    results = out["results"]
    assert results and all(r["outcome"] in ("refused", "a") for r in results), json.dumps(results)
    assert all(r["outcome"] == "refused" for r in results), json.dumps(results)
    assert out["api"], "the user's call returned something other than A's weights"
