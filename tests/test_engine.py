"""The public API: bad input raises ValueError with a message naming the problem (raised by the
call itself, also for ``stream``, not at the first ``next``), and the result's documented fields."""
from __future__ import annotations

import pytest

from conftest import cached_references, cached_tiny
from helpers import FakeTokenizer, SpyProposer, hf_greedy
from lookupdec import Engine, EngineConfig, Generation, GenerationStats
from lookupdec.proposers import build_proposers
from lookupdec.validate import ParamError

CONTEXT = 512  # max_position_embeddings of the tiny models


@pytest.fixture(scope="module")
def engine():
    return Engine(cached_tiny("llama"), FakeTokenizer(), EngineConfig(budget="fixed"))


BAD_CALLS = [
    ("empty id list", dict(prompt=[]), "prompt is empty"),
    ("empty string", dict(prompt=""), "prompt is empty"),
    ("max_new_tokens 0", dict(max_new_tokens=0), "max_new_tokens"),
    ("max_new_tokens < 0", dict(max_new_tokens=-3), "max_new_tokens"),
    ("max_new_tokens float", dict(max_new_tokens=2.5), "max_new_tokens"),
    ("prompt fills the context", dict(prompt=[5] * CONTEXT), "context"),
    ("prompt longer than the context", dict(prompt=[5] * (CONTEXT + 40)), "context"),
    ("temperature < 0", dict(temperature=-0.1), "temperature"),
    ("temperature NaN", dict(temperature=float("nan")), "temperature"),
    ("top_p 0", dict(temperature=1.0, top_p=0.0), "top_p"),
    ("top_p > 1", dict(temperature=1.0, top_p=1.5), "top_p"),
    ("top_p < 0", dict(temperature=1.0, top_p=-0.2), "top_p"),
    ("top_k 0", dict(temperature=1.0, top_k=0), "top_k"),
    ("repetition_penalty 0", dict(repetition_penalty=0.0), "repetition_penalty"),
    ("empty stop string", dict(stop=[""]), "stop"),
    ("token id outside the vocabulary", dict(prompt=[5, 96]), "vocabulary"),
    ("negative token id", dict(prompt=[-1, 5]), "vocabulary"),
]


@pytest.mark.parametrize("what,kwargs,message", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
@pytest.mark.parametrize("method", ["generate", "stream"])
def test_bad_input_raises_value_error(engine, method, what, kwargs, message):
    call = dict(prompt=[5, 6, 7], max_new_tokens=4) | kwargs
    prompt = call.pop("prompt")
    with pytest.raises(ValueError, match=message) as info:
        getattr(engine, method)(prompt, **call)  # stream raises here, before any iteration
    assert "\n" not in str(info.value), "one-line message"


EXPECTED_FIELD = {"vocabulary": "prompt", "context": "prompt", "prompt is empty": "prompt"}


@pytest.mark.parametrize("what,kwargs,message", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_check_request_names_the_field_without_running(engine, what, kwargs, message):
    """``Engine.check_request`` is the public form of what ``generate``/``stream`` check: the same
    calls fail with a ``ParamError`` whose ``.field`` names the argument (``field`` renames the
    prompt's, as a server does for ``messages``; a prompt too long then says it is the chat
    template's)."""
    call = dict(prompt=[5, 6, 7], max_new_tokens=4) | kwargs
    prompt = call.pop("prompt")
    with pytest.raises(ParamError, match=message) as info:
        engine.check_request(prompt, **call)
    assert info.value.field == EXPECTED_FIELD.get(message, message)
    if info.value.field == "prompt":
        with pytest.raises(ParamError, match=message) as renamed:
            engine.prompt_ids(prompt, field="messages")
        assert renamed.value.field == "messages"
        if message == "context":  # the prompt a chat template made: said so, not "prompt has"
            assert str(renamed.value) == str(info.value).replace(
                "prompt has", "the prompt the chat template makes of the messages has", 1)
        else:
            assert str(renamed.value) == str(info.value)


def test_check_request_returns_the_prompt_ids(engine):
    assert engine.check_request([5, 6, 7], max_new_tokens=4) == [5, 6, 7]
    assert engine.check_request("5 6 7", max_new_tokens=4, temperature=0.5, stop="x") == engine.prompt_ids("5 6 7")


def test_proposers_are_a_constructor_argument_not_a_setter():
    spy = SpyProposer(build_proposers(EngineConfig(proposers=("ngram",)), tokenizer=FakeTokenizer())[0])
    engine = Engine(cached_tiny("llama"), FakeTokenizer(), EngineConfig(budget="fixed"), proposers=[spy])
    assert engine.proposers == [spy]
    engine.generate([5, 6, 7, 5, 6], max_new_tokens=3)
    assert spy.started and spy.started == spy.stopped
    with pytest.raises(AttributeError):
        engine.proposers = []


def test_good_edge_values_are_accepted(engine):
    ref = cached_references("llama")[0]
    longest = [5] * (CONTEXT - 1)  # the longest prompt that fits: room for exactly one token
    gen = engine.generate(longest, max_new_tokens=3)
    assert gen.token_ids == hf_greedy(engine.target.model, longest, 1) and gen.finish_reason in ("length", "eos")
    # top_k=1 keeps only the argmax: sampling at its edge values is greedy decoding
    sampled = engine.generate([5, 6], max_new_tokens=4, temperature=1.0, top_p=1.0, top_k=1, seed=0)
    assert sampled.token_ids == hf_greedy(engine.target.model, [5, 6], 4)
    assert engine.generate(" ".join(map(str, ref[0])), max_new_tokens=ref[1]).token_ids == ref[2]  # a string


def test_bad_config_raises_value_error_naming_the_field():
    for kwargs, field in [(dict(max_nodes=-1), "max_nodes"), (dict(max_depth=0), "max_depth"),
                          (dict(budget="huge"), "budget"), (dict(verify="maybe"), "verify"),
                          (dict(proposers=("telepathy",)), "proposers")]:
        with pytest.raises(ValueError, match=field):
            EngineConfig(**kwargs)


def test_generation_fields(engine):
    prompt, n, ref = cached_references("llama")[3]
    gen = engine.generate(prompt, max_new_tokens=n)
    assert isinstance(gen, Generation) and isinstance(gen.stats, GenerationStats)
    assert gen.token_ids == ref and gen.text == FakeTokenizer().decode(ref)
    assert gen.finish_reason in ("length", "eos")
    stats = gen.stats.to_dict()
    for key in ("steps", "new_tokens", "mean_accepted", "accepted_by_source", "draft_us", "overhead_us",
                "forward_ms", "tokens_per_s"):
        assert key in stats, key
    assert stats["steps"] >= 1 and stats["new_tokens"] == len(ref)
    assert stats["forward_ms"] > 0 and stats["tokens_per_s"] > 0 and stats["overhead_us"] >= stats["draft_us"] >= 0


def test_kernel_time_is_reported_apart_from_forward_and_overhead():
    """``kernel_ms``: what the request's verify forwards spent on kernel-form trials and checks
    (``TargetModel.last_prepare_s``), kept out of ``forward_ms`` and ``overhead_us``. Whether
    real trials fall in this request depends on the forms' state left by earlier tests, so
    every forward reports a microsecond of check excess besides."""
    engine = Engine(cached_tiny("llama"), FakeTokenizer(), EngineConfig(budget="fixed"))
    prompt, n, ref = cached_references("llama")[3]
    target, seen = engine.target, []
    verify, take_excess = target.verify, target.take_excess
    target.take_excess = lambda: take_excess() + 1e-6

    def counted(*args, **kwargs):
        out = verify(*args, **kwargs)
        seen.append(target.last_prepare_s)
        return out

    target.verify = counted
    try:
        target.take_excess()
        gen = engine.generate(prompt, max_new_tokens=n)
    finally:
        del target.verify, target.take_excess
    assert gen.token_ids == ref and len(seen) == gen.stats.steps
    assert sum(seen) >= 1e-6 * len(seen)
    assert gen.stats.kernel_ms == pytest.approx(sum(seen) * 1e3)


def test_length_and_eos_finish_reasons(engine):
    refs = cached_references("llama")
    eos_case = next((r for r in refs if r[2][-1] == 2 and len(r[2]) < r[1]), None)
    length_case = next(r for r in refs if len(r[2]) == r[1] and r[2][-1] != 2)
    gen = engine.generate(length_case[0], max_new_tokens=length_case[1])
    assert gen.finish_reason == "length" and len(gen.token_ids) == length_case[1]
    if eos_case is not None:
        gen = engine.generate(eos_case[0], max_new_tokens=eos_case[1])
        assert gen.finish_reason == "eos" and gen.token_ids[-1] == 2 and gen.token_ids == eos_case[2]
