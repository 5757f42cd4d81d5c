"""One engine used from two places.

The contract (README, "Python API"): an ``Engine`` runs one request at a time. Other threads'
requests wait their turn (each output is the one it has alone); a second request on the same
thread while a stream of it is neither exhausted nor closed raises ``EngineBusy`` naming that
stream, never gives another request's text.
"""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from conftest import cached_tiny
from helpers import FakeTokenizer
from lookupdec import Engine, EngineConfig
from lookupdec.engine import EngineBusy
from lookupdec.validate import ParamError

PROMPTS = ([5, 6, 7, 8, 5, 6], [9, 3, 9, 3, 11])


@pytest.fixture(scope="module")
def engine():
    return Engine(cached_tiny("llama"), FakeTokenizer(), EngineConfig())


@pytest.fixture(scope="module")
def alone(engine):
    return [engine.generate(p, max_new_tokens=24).token_ids for p in PROMPTS]


def test_two_streams_read_in_turn_raise_naming_the_live_one(engine, alone):
    a = iter(engine.stream(PROMPTS[0], max_new_tokens=24))
    b = iter(engine.stream(PROMPTS[1], max_new_tokens=24))
    next(a)
    with pytest.raises(EngineBusy, match=r"still running the stream of \[5, 6, 7, 8, 5, 6\] on this thread"):
        next(b)
    with pytest.raises(EngineBusy, match="stream of"):  # a request after it on this thread: the same
        engine.generate(PROMPTS[1], max_new_tokens=4)
    rest = list(a)  # the first stream goes on untouched
    assert a.gi_frame is None and rest is not None
    assert engine.turn.holder is None
    assert engine.generate(PROMPTS[0], max_new_tokens=24).token_ids == alone[0]


def test_a_closed_or_dropped_stream_lets_the_engine_go(engine, alone):
    stream = engine.stream(PROMPTS[0], max_new_tokens=24)
    pieces = iter(stream)
    next(pieces)
    stream.close()
    assert engine.turn.holder is None
    with engine.stream(PROMPTS[1], max_new_tokens=24) as s:
        next(iter(s))
    assert engine.turn.holder is None
    pieces = iter(engine.stream(PROMPTS[1], max_new_tokens=24))
    next(pieces)
    del pieces  # (CPython closes a generator that nothing refers to)
    assert engine.generate(PROMPTS[1], max_new_tokens=24).token_ids == alone[1]


def test_a_batch_step_on_the_thread_of_a_live_stream_raises(engine):
    from lookupdec.batch import BatchDecoder, BatchRequest

    pieces = iter(engine.stream(PROMPTS[0], max_new_tokens=24))
    next(pieces)
    decoder = BatchDecoder(engine, 2)
    decoder.submit(BatchRequest(PROMPTS[1], 4))
    with pytest.raises(EngineBusy):
        decoder.step()
    pieces.close()
    assert decoder.run()[0].token_ids == engine.generate(PROMPTS[1], max_new_tokens=4).token_ids


def test_generate_from_several_threads_gives_each_its_own_output(engine, alone):
    results, errors = {}, []

    def run(i):
        try:
            results[i] = engine.generate(PROMPTS[i % 2], max_new_tokens=24).token_ids
        except Exception as exc:  # noqa: BLE001 -- reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert [results[i] for i in range(6)] == [alone[i % 2] for i in range(6)]


def test_a_stream_and_a_batch_on_two_threads_each_as_alone(engine, alone):
    out = {}

    def batch():
        out["batch"] = [g.token_ids for g in engine.generate_batch(list(PROMPTS), max_new_tokens=24)]

    thread = threading.Thread(target=batch)
    pieces = iter(engine.stream(PROMPTS[1], max_new_tokens=24))
    thread.start()
    out["stream"] = list(pieces)
    thread.join(timeout=120)
    assert out["batch"] == alone


@pytest.mark.parametrize("make", [np.array, torch.tensor, lambda p: np.array(p, dtype=np.int32), tuple])
def test_generate_batch_takes_the_prompts_generate_takes(engine, make):
    want = engine.generate(PROMPTS[0], max_new_tokens=6).token_ids
    # (between two others: finding its row compared it with another sequence, and so its array)
    got = engine.generate_batch([list(PROMPTS[1]), make(PROMPTS[0]), list(PROMPTS[1])], max_new_tokens=6)
    assert got[1].token_ids == want


@pytest.mark.parametrize("prompt, says", [
    ([1, 2.7], "2.7 is not an integer token id"),
    ([True, 3], "True is not an integer token id"),
    (b"Once", "got bytes"),
    (np.array([[1, 2]]), "shape (1, 2)"),
])
def test_bad_token_id_prompts_are_refused_alone_and_in_a_batch(engine, prompt, says):
    with pytest.raises(ParamError, match=f"^prompts\\[1\\]: .*{__import__('re').escape(says)}") as err:
        engine.generate_batch([PROMPTS[0], prompt], max_new_tokens=4)
    assert err.value.field == "prompts[1]"
    with pytest.raises(ParamError, match=__import__("re").escape(says)):
        engine.generate(prompt, max_new_tokens=4)


def test_a_too_long_token_id_prompt_says_prompt_not_chat_template(engine):
    limit = engine.target.max_context
    with pytest.raises(ParamError) as err:
        engine.generate_batch([[5] * limit], max_new_tokens=4)
    assert "chat template" not in str(err.value) and f"prompt has {limit} tokens" in str(err.value)
