"""The caller's global state a load depends on (overmind.shared.calls.callstate) and the replay of what a
load emitted (overmind.shared.calls.replay), without a daemon."""

from __future__ import annotations

import logging
import random
import warnings

import pytest
import torch

from overmind.shared.calls import callstate
from overmind.shared.calls.keys import Target, Uncacheable, encode_call
from overmind.shared.calls.replay import Recorder, replay


def key_of(path: str = "/nonexistent/model.pt") -> str:
    return encode_call(Target.of(torch.load), (path,), {}, lambda obj: None).key


def test_a_fresh_process_state_adds_nothing_to_the_key():
    assert callstate.keyed_state() == {}


def test_default_dtype_grad_mode_and_determinism_are_keyed():
    plain = key_of()
    torch.set_default_dtype(torch.float64)
    try:
        assert callstate.keyed_state() == {"default_dtype": torch.float64}
        assert key_of() != plain
    finally:
        torch.set_default_dtype(torch.float32)
    with torch.no_grad():
        assert key_of() != plain
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        assert callstate.keyed_state()["deterministic"] == (True, True)
        assert key_of() != plain
    finally:
        torch.use_deterministic_algorithms(False)
    assert key_of() == plain


class UserClass:
    pass


def test_safe_globals_the_user_added_are_keyed_and_library_ones_are_not():
    plain = key_of()
    with torch.serialization.safe_globals([UserClass]):
        assert callstate.keyed_state()["safe_globals"] == [UserClass]
        assert key_of() != plain
    assert key_of() == plain
    import transformers.modeling_utils  # noqa: F401  (registers its own safe globals)

    assert "safe_globals" not in callstate.keyed_state()


@pytest.mark.parametrize("context", ["meta", "inference", "init_empty_weights", "no_init_weights", "diffusers_no_init"])
def test_states_the_loader_cannot_reproduce_go_to_the_original(context):
    import contextlib

    if context == "meta":
        manager = torch.device("meta")
    elif context == "inference":
        manager = torch.inference_mode()
    elif context == "init_empty_weights":
        from accelerate import init_empty_weights

        manager = init_empty_weights()
    elif context == "no_init_weights":
        from transformers.initialization import no_init_weights

        manager = no_init_weights()
    else:
        from diffusers.models.modeling_utils import no_init_weights

        manager = no_init_weights()
    assert callstate.bypass_reason() is None
    with manager if manager is not None else contextlib.nullcontext():
        reason = callstate.bypass_reason()
        with pytest.raises(Uncacheable):
            key_of()
    assert reason, context
    assert callstate.bypass_reason() is None


def test_the_generator_digest_covers_only_the_generators_a_load_drew_from():
    torch.manual_seed(5)
    first = callstate.rng_state()
    random.seed(1234)  # another process: Python's generator is seeded from the OS
    torch.manual_seed(5)
    second = callstate.rng_state()
    assert first["random"] != second["random"]
    assert callstate.rng_digest(first, ["torch"]) == callstate.rng_digest(second, ["torch"])
    assert callstate.rng_digest(first, ["torch", "random"]) != callstate.rng_digest(second, ["torch", "random"])
    torch.manual_seed(6)
    assert callstate.rng_digest(callstate.rng_state(), ["torch"]) != callstate.rng_digest(first, ["torch"])


def test_generator_states_round_trip_through_their_encoding():
    torch.manual_seed(11)
    state = callstate.decode_rng(callstate.encode_rng(callstate.rng_state()))
    expected = torch.rand(3), random.random()
    callstate.set_rng_state(state)
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]


def test_recorded_warnings_and_records_replay_through_the_callers_filters_and_levels(caplog):
    logger = logging.getLogger("overmind_test_lib")
    with Recorder() as recorder:
        warnings.warn("first", DeprecationWarning)
        logger.warning("a %s record", "warning")
        logger.info("an info record")
        logger.debug("a debug record")
    kinds = [(e[0], e[1]) if e[0] == "warning" else (e[0], e[2]) for e in recorder.events]
    assert kinds == [("warning", "builtins:DeprecationWarning"), ("log", logging.WARNING), ("log", logging.INFO)]

    with caplog.at_level(logging.WARNING, logger="overmind_test_lib"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        replay(recorder.events)
    assert [(w.category, str(w.message)) for w in caught] == [(DeprecationWarning, "first")]
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [("WARNING", "a warning record")]

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="overmind_test_lib"), warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(DeprecationWarning):
            replay(recorder.events)
        warnings.simplefilter("ignore")
        replay(recorder.events)
    assert [r.levelname for r in caplog.records] == ["WARNING", "INFO"]


def test_a_warning_once_record_is_replayed_once_per_process(caplog):
    from transformers.utils import logging as hf_logging

    logger = hf_logging.get_logger("overmind_test_once")
    with Recorder() as recorder:
        logger.warning_once("said once")
        logger.warning("said every time")
    with caplog.at_level(logging.WARNING, logger="overmind_test_once"):
        replay(recorder.events)
        replay(recorder.events)
    assert [r.getMessage() for r in caplog.records] == ["said once", "said every time", "said every time"]
