"""Greedy output identical to ``transformers`` ``generate(do_sample=False)``, token for token, for
100% of the prompts, on every tiny family and with every kind of drafts: none, prompt n-gram, an
oracle (must be fully accepted), an oracle hidden behind wrong branches (accepting it gathers
non-contiguous KV slots; its drafts also run past EOS and max_new_tokens), an adversary (nothing
may be accepted) and random trees. Then the real stories260K model: identity on story prompts and
more than one token per step on a repetitive one.
"""
from __future__ import annotations

import functools
import logging

import pytest

from conftest import cached_references, cached_tiny, load_stories
from helpers import (AdversarialProposer, FakeTokenizer, OracleProposer, RandomTreeProposer, TreeMaskRejectingModel,
                     first_difference, hf_greedy, oracle_expectation)
from lookupdec import Engine, EngineConfig
from lookupdec.budget import CostModel
from tiny_models import FAMILIES

# Oracle runs: small trees so that a generation takes several steps with an exact step count.
ORACLE_MAX_NODES = 16
ORACLE_MAX_DEPTH = 7
ORACLE_K = min(ORACLE_MAX_NODES, ORACLE_MAX_DEPTH)  # draft tokens accepted per full step

SETTINGS = ["none", "ngram", "oracle", "oracle_behind_distractors", "adversarial", "random_tree"]


class FlatCost(CostModel):
    def observe(self, n, seconds):
        pass


def make_engine(family: str, setting: str, truths: dict) -> Engine:
    model = cached_tiny(family)
    if setting == "ngram":  # the default configuration: budget chosen per step by the cost model
        engine = Engine(model, FakeTokenizer(), EngineConfig())
        # ... a flat curve that learns nothing: on a tiny model a forward's time is Python's, and
        # a measured curve (or one an earlier test cached) may keep every root alone, so that
        # the drafts this test means to exercise never run
        flat = FlatCost([1, 2, 4, 8, 16, 32, 64, 128], [1.0] * 8, [100.0] * 8)
        engine.cost_model = lambda bucket, **kwargs: engine._costs.setdefault(bucket, flat)
        return engine
    # a fixed budget: up to max_nodes nodes every step, so that step counts are exact
    if setting.startswith("oracle"):
        config = EngineConfig(proposers=(), budget="fixed", max_nodes=ORACLE_MAX_NODES, max_depth=ORACLE_MAX_DEPTH)
    else:
        config = EngineConfig(proposers=(), budget="fixed")
    proposers = {
        "none": [],
        "oracle": [OracleProposer(truths)],
        "oracle_behind_distractors": [OracleProposer(truths, distractors=2, overrun=5)],
        "adversarial": [AdversarialProposer(truths)],
        "random_tree": [RandomTreeProposer(truths, seed=sum(map(ord, family)))],
    }[setting]
    return Engine(model, FakeTokenizer(), config, proposers=proposers)


def assert_same(out, ref, what: str) -> None:
    at = first_difference(out, ref)
    assert at is None, (f"{what}: first difference at output token {at}: "
                        f"lookupdec {out[at:at + 8]} vs transformers {ref[at:at + 8]}")


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_identity(family, setting):
    refs = cached_references(family)
    truths = {tuple(prompt): prompt + ref for prompt, _, ref in refs}
    engine = make_engine(family, setting, truths)
    assert engine.target.tree_mode, f"{family}: the tree-mask probe failed (chain fallback)"
    accepted_total = 0
    for i, (prompt, n, ref) in enumerate(refs):
        gen = engine.generate(prompt, max_new_tokens=n)
        what = f"{family}/{setting} prompt #{i} (len {len(prompt)}, max_new_tokens {n})"
        assert_same(gen.token_ids, ref, what)
        assert not any(getattr(p, "active", ()) for p in engine.proposers), f"{what}: proposer not stopped"
        assert gen.finish_reason == ("eos" if ref[-1] == 2 else "length"), what
        stats = gen.stats
        accepted = sum(stats.accepted_by_source.values())
        accepted_total += accepted
        assert stats.new_tokens == len(ref), what
        # the first token is the prefill's (its last logits, as transformers takes it), in no step
        assert stats.prefill_tokens == 1, what
        stepped = len(ref) - 1
        # every step emits its accepted tokens + one bonus/recovered token (the last one may be cut)
        assert stepped - stats.steps <= accepted <= stepped - stats.steps + 1, what
        assert stats.mean_accepted == (pytest.approx(stepped / stats.steps) if stats.steps else 0.0), what
        if setting in ("none", "adversarial"):
            assert stats.steps == stepped and stats.mean_accepted in (0.0, 1.0) and accepted == 0, what
        if setting.startswith("oracle"):
            steps, oracle_accepted = oracle_expectation(stepped, ORACLE_K)
            counted = {"oracle": oracle_accepted} if oracle_accepted else {}
            assert (stats.steps, stats.accepted_by_source) == (steps, counted), what
    if setting in ("ngram", "random_tree"):  # the drafts did get used somewhere
        assert accepted_total > 0, f"{family}/{setting}: no draft token accepted on any prompt"
    if setting not in ("none", "ngram"):
        assert engine.proposers[0].calls > 0, "the injected proposer was never asked"


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen2"])
def test_first_token_comes_from_the_prefill(family):
    """The first new token is the prefill's (the logits of the prompt's last token), as
    ``transformers`` takes it: a one-token answer runs no verify forward, a prompt of one token
    included, and the same prompt again (its prefix reused but for the last token) gives the
    same token; an unseen prompt's prefill is not reused."""
    model = cached_tiny(family)
    engine = Engine(model, FakeTokenizer(), EngineConfig(budget="fixed"))  # (no cost curve measured)
    calls = []
    verify = engine.target.verify
    engine.target.verify = lambda *a, **k: calls.append(1) or verify(*a, **k)
    for prompt in ([5], [9, 4, 4, 7, 3] * 5, [9, 4, 4, 7, 3] * 5, [9, 4, 4, 7, 3] * 5 + [8]):
        gen = engine.generate(prompt, max_new_tokens=1)
        assert gen.token_ids == hf_greedy(model, prompt, 1), (family, prompt)
        assert gen.stats.steps == 0 and gen.stats.prefill_tokens == 1 and not calls
        assert gen.stats.prefix_reused <= len(prompt) - 1
    assert gen.stats.prefix_reused == 25  # the prompt before it shares 25 of its 26 tokens
    gen = engine.generate([9, 4, 4, 7, 3] * 5, max_new_tokens=8)
    assert gen.token_ids == hf_greedy(model, [9, 4, 4, 7, 3] * 5, 8) and gen.stats.prefix_reused == 24


@pytest.mark.parametrize("family", ["llama", "mistral", "gpt2", "gpt_neox"])
def test_chain_verification_identity(family):
    """verify="chain" (the fallback for models that reject a 4D mask): best chain per step."""
    refs = cached_references(family)[::3]
    truths = {tuple(prompt): prompt + ref for prompt, _, ref in refs}
    engine = Engine(cached_tiny(family), FakeTokenizer(), EngineConfig(proposers=(), verify="chain", budget="fixed"),
                    proposers=[RandomTreeProposer(truths, seed=7), OracleProposer(truths, distractors=2)])
    assert not engine.target.tree_mode
    for i, (prompt, n, ref) in enumerate(refs):
        assert_same(engine.generate(prompt, max_new_tokens=n).token_ids, ref, f"{family} chain prompt #{i}")


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_context_limit(family):
    """Near the end of the model's context (512 positions) drafts are cut to the room left and the
    output is the same with or without drafts: it stops with the context full, "length"."""
    model = cached_tiny(family)
    limit = 512
    prompt = [(7 * i) % 90 + 3 for i in range(limit - 9)]  # periodic: drafts up to the end
    outputs = {}
    for setting in ("none", "ngram", "oracle"):
        # oracle: the truth is the no-draft output, padded past the end
        truths = {tuple(prompt): prompt + outputs["none"] + [5] * 20} if setting == "oracle" else {}
        engine = make_engine(family, setting, truths)
        gen = engine.generate(prompt, max_new_tokens=40)
        outputs[setting] = gen.token_ids
        assert len(prompt) + len(gen.token_ids) <= limit, f"{setting}: output runs past the context"
        assert gen.finish_reason in ("length", "eos")
    assert outputs["ngram"] == outputs["none"] == outputs["oracle"]
    ref = hf_greedy(model, prompt, len(outputs["none"]))
    assert_same(outputs["none"], ref, f"{family} at the context limit")


def test_chain_fallback_when_tree_masks_are_rejected(caplog):
    refs = cached_references("llama")[::4]
    with caplog.at_level(logging.WARNING, logger="lookupdec"):
        engine = Engine(TreeMaskRejectingModel(cached_tiny("llama")), FakeTokenizer(), EngineConfig())
        for prompt, n, ref in refs:
            assert engine.generate(prompt, max_new_tokens=n).token_ids == ref
    assert not engine.target.tree_mode
    warnings = [r for r in caplog.records if "4D" in r.getMessage()]
    assert len(warnings) == 1, "the fallback is logged once"


@pytest.mark.parametrize("family", ["llama", "mistral", "gpt2"])
def test_greedy_repetition_penalty_identity(family):
    """Greedy with a repetition penalty: each node's row is penalised with that node's own prefix
    (context + path), as transformers does for the sequence it has at that point."""
    model = cached_tiny(family)
    cases = [(p, n, hf_greedy(model, p, n, repetition_penalty=1.3)) for p, n, _ in cached_references(family)[:10]]
    truths = {tuple(p): p + r for p, _, r in cases}
    for setting in ("none", "ngram", "oracle", "random_tree"):
        engine = make_engine(family, setting, truths)
        for i, (prompt, n, ref) in enumerate(cases):
            out = engine.generate(prompt, max_new_tokens=n, repetition_penalty=1.3).token_ids
            assert_same(out, ref, f"{family}/{setting} repetition penalty, prompt #{i}")
    plain = [r for _, _, r in cached_references(family)[:10]]
    assert plain != [r for _, _, r in cases], "the penalty changed nothing: the test would prove nothing"


# -- the real model ---------------------------------------------------------------------------
STORY_PROMPTS = [
    "Once upon a time",
    "Lily and Tom went to the park.",
    "The little dog was sad because",
    "One day, a big bird",
    "Sam had a red ball. He",
    "There was a girl who liked to sing.",
    "The sun was hot, so",
    "Mom said, \"Let's bake a cake!\"",
    "A cat saw a fish in the pond.",
    "Ben wanted to fly like a bird.",
    "Tim",
]
STORY_TOKENS = 60
REPETITIVE = ("Tom said: the cat sat on the mat. the cat sat on the mat. the cat sat on the mat. "
              "the cat sat on the mat. the cat sat on the mat.")


@functools.cache
def stories_reference(prompt: str) -> list[int]:
    model, tokenizer = load_stories()
    return hf_greedy(model, tokenizer(prompt).input_ids, STORY_TOKENS)


@pytest.mark.parametrize("config", [EngineConfig(proposers=(), budget="fixed"), EngineConfig()],
                         ids=["no drafts", "default (n-gram, auto budget)"])
def test_stories_greedy_identity(stories, config):
    model, tokenizer = stories
    engine = Engine(model, tokenizer, config)
    for prompt in STORY_PROMPTS + [REPETITIVE]:
        ref = stories_reference(prompt)
        gen = engine.generate(prompt, max_new_tokens=STORY_TOKENS)
        assert_same(gen.token_ids, ref, f"stories260K {prompt!r}")
        assert gen.text == tokenizer.decode(ref, skip_special_tokens=True)


# stories260K seldom copies its prompt; on this one it gives 1.44 tokens per step with a fixed
# budget (deterministic; the first token is the prefill's, in no step) and 1.18-1.31 with
# budget="auto" (12 runs: the chosen trees depend on the cost curve measured on the machine): the
# floors leave room for that and still fail an engine whose drafts are accepted only now and then
# (1.0 would pass with a single accepted token).
@pytest.mark.parametrize("budget,floor", [("fixed", 1.25), ("auto", 1.1)])
def test_stories_ngram_accepts_more_than_one_token_per_step(stories, budget, floor):
    model, tokenizer = stories
    gen = Engine(model, tokenizer, EngineConfig(budget=budget)).generate(REPETITIVE, max_new_tokens=STORY_TOKENS)
    assert gen.token_ids == stories_reference(REPETITIVE)
    assert gen.stats.mean_accepted > floor, gen.stats
    assert gen.stats.accepted_by_source.get("ngram", 0) > 0
    assert gen.stats.steps < gen.stats.new_tokens
