"""Cancelling a generation (``cancel=`` on ``Engine.generate`` / ``Engine.stream``, used by the
server when a client disconnects): it ends before the next step with finish_reason "cancelled",
the text so far is exactly the start of the uncancelled output, and the request's proposer
state is released — also when the consumer just closes the stream."""
from __future__ import annotations

import threading

import pytest

from conftest import cached_tiny
from helpers import FakeTokenizer, SpyProposer
from lookupdec import Engine, EngineConfig
from lookupdec.proposers import build_proposers

PROMPT = [5, 6, 7, 8, 9, 10, 11, 5, 6, 7]
MAX_NEW = 48


@pytest.fixture()
def engine():
    # fixed budget and only the n-gram proposer: no cost calibration, steps of known shape
    config = EngineConfig(budget="fixed", proposers=("ngram",))
    return Engine(cached_tiny("llama"), FakeTokenizer(), config,
                  proposers=[SpyProposer(p) for p in build_proposers(config, tokenizer=FakeTokenizer())])


def released(engine) -> bool:
    spy = engine.proposers[0]
    return bool(spy.started) and spy.started == spy.stopped


def test_uncancelled_output_is_long_enough(engine):
    full = engine.generate(PROMPT, max_new_tokens=MAX_NEW)
    assert full.finish_reason == "length" and full.stats.steps >= 3, "the cases below need several steps"


def test_event_set_mid_stream_stops_before_next_step(engine):
    full = engine.generate(PROMPT, max_new_tokens=MAX_NEW)
    cancel = threading.Event()
    stream = engine.stream(PROMPT, max_new_tokens=MAX_NEW, cancel=cancel)
    pieces = []
    for piece in stream:
        pieces.append(piece)
        cancel.set()  # the client left after the first piece
    gen = stream.generation
    assert gen.finish_reason == "cancelled"
    # the first piece is the prefill's token (``RequestCore.first``): no step after it
    assert gen.stats.steps == 0 and gen.stats.prefill_tokens == 1, "no step after the first piece"
    assert full.token_ids[: len(gen.token_ids)] == gen.token_ids and len(gen.token_ids) < MAX_NEW
    assert "".join(pieces) == gen.text and full.text.startswith(gen.text)
    assert released(engine)


def test_callable_checked_once_per_step(engine):
    calls = []

    def cancelled() -> bool:
        calls.append(1)
        return len(calls) > 2  # two steps run, the third check cancels

    gen = engine.generate(PROMPT, max_new_tokens=MAX_NEW, cancel=cancelled)
    # checked before the prefill's token and before each step
    assert gen.finish_reason == "cancelled" and gen.stats.prefill_tokens == 1 and gen.stats.steps == 1
    assert len(calls) == 3
    assert released(engine)


def test_cancelled_before_start_runs_no_step(engine):
    cancel = threading.Event()
    cancel.set()
    gen = engine.generate(PROMPT, max_new_tokens=MAX_NEW, cancel=cancel)
    assert gen.finish_reason == "cancelled" and gen.token_ids == [] and gen.stats.steps == 0
    assert released(engine)


def test_unset_event_changes_nothing(engine):
    full = engine.generate(PROMPT, max_new_tokens=MAX_NEW)
    gen = engine.generate(PROMPT, max_new_tokens=MAX_NEW, cancel=threading.Event())
    assert (gen.token_ids, gen.finish_reason) == (full.token_ids, full.finish_reason)


def test_closing_the_stream_releases_the_request(engine):
    pieces = iter(engine.stream(PROMPT, max_new_tokens=MAX_NEW))
    next(pieces)
    assert not released(engine), "still running"
    pieces.close()
    assert released(engine)
    assert engine.generate(PROMPT, max_new_tokens=4).finish_reason == "length", "the engine is free again"


@pytest.mark.parametrize("bad", ["yes", 1, object()])
def test_bad_cancel_names_the_field(engine, bad):
    with pytest.raises(ValueError, match="cancel="):
        engine.stream(PROMPT, max_new_tokens=4, cancel=bad)
