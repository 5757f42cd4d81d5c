"""Prompt n-gram lookup: the docstring's worked example with hand-written arrays (comments on the
ties, as in vLLM's test_ngram.py), periodic continuation, budget splitting, scores, a brute-force
reference over random contexts, loud lifecycle misuse, and the compiled index against its
definition, ``lookupdec.reference.drafting.NgramIndex`` (drafts bit for bit, and budget shares for
any decays)."""
from __future__ import annotations

import random

import pytest

from helpers import needs_core
from lookupdec.config import NgramConfig
from lookupdec.proposers.ngram import BRANCH_DECAY, CONTINUE_PROB, NgramProposer
from lookupdec.reference import drafting as reference_drafting
from lookupdec.reference.drafting import periodic_continuation
from lookupdec.tokens import SEPARATOR
from random_inputs import random_stream

BIG = 1000  # a node budget that cuts nothing


def propose_once(context, budget=BIG, **config):
    proposer = NgramProposer(NgramConfig(**config))
    proposer.start("r", context)
    drafts = proposer.propose("r", context, budget)
    proposer.stop("r")
    return drafts


def test_docstring_worked_example():
    context = [5, 1, 2, 3, 9, 1, 2, 4, 7, 1, 2]
    drafts = propose_once(context, min_ngram=1, max_ngram=3, max_branches=2, max_draft_tokens=3)
    # the 3-gram [7, 1, 2] never occurred before; the 2-gram [1, 2] ended at 7 and at 3: a tie in
    # match length, broken by recency, so [4, 7, 1] (after the later occurrence) comes first, not
    # [3, 9, 1]. The 1-gram [2] points at the same two places and adds no branch.
    assert [list(d.token_ids) for d in drafts] == [[4, 7, 1], [3, 9, 1]]
    assert all(d.parents == (-1, 0, 1) and d.source == "ngram" for d in drafts)
    first = 2 / 3  # match length 2: L / (L + 1)
    assert drafts[0].scores == pytest.approx([first * CONTINUE_PROB**d for d in range(3)])
    assert drafts[1].scores == pytest.approx([first * BRANCH_DECAY * CONTINUE_PROB**d for d in range(3)])


def test_longer_match_wins_over_a_more_recent_one():
    context = [1, 2, 3, 4, 9, 2, 3, 5, 1, 2, 3]
    drafts = propose_once(context, min_ngram=1, max_ngram=3, max_branches=3, max_draft_tokens=3)
    # the 3-gram [1, 2, 3] ended at 3 -> [4, 9, 2]; the 2-gram [2, 3] also ended at 7, later, but a
    # shorter match: [4, 9, 2] first, not [5, 1, 2]
    assert [list(d.token_ids) for d in drafts][:2] == [[4, 9, 2], [5, 1, 2]]
    assert drafts[0].scores[0] == pytest.approx(3 / 4)
    assert drafts[1].scores[0] == pytest.approx(2 / 3 * BRANCH_DECAY)


def test_periodic_continuation():
    assert periodic_continuation([1, 2, 3, 1, 2], 2, 4) == [3, 1, 2, 3]  # the docstring's example
    # a repeating context drafts past its own end with the period the match implies
    context = [7, 1, 2, 3, 1, 2, 3]
    drafts = propose_once(context, max_draft_tokens=10, max_branches=1)
    assert list(drafts[0].token_ids) == [1, 2, 3, 1, 2, 3, 1, 2, 3, 1]


def test_draft_length_is_capped_by_max_draft_tokens_and_budget():
    context = list(range(3, 40)) * 2
    assert len(propose_once(context, max_draft_tokens=5)[0].token_ids) == 5
    assert len(propose_once(context, budget=4, max_draft_tokens=32)[0].token_ids) == 4
    assert propose_once(context, budget=0) == []
    drafts = propose_once([1, 2, 9, 1, 2, 8, 1, 2], budget=5, max_draft_tokens=4, max_branches=2)
    assert sum(len(d.token_ids) for d in drafts) <= 5


def test_lengths_within_budget():
    lengths_within_budget = reference_drafting.lengths_within_budget
    assert lengths_within_budget([0.9, 0.3], 10, 12, CONTINUE_PROB) == [10, 2]  # the docstring's example
    assert lengths_within_budget([0.9, 0.3], 5, 12, CONTINUE_PROB) == [5, 5]  # everything fits
    # 0.5 * 0.95**7 = 0.35 > 0.3: every token of branch 0 beats branch 1's first
    assert lengths_within_budget([0.5, 0.5 * BRANCH_DECAY], 8, 8, CONTINUE_PROB) == [8, 0]
    lengths = lengths_within_budget([0.8, 0.48, 0.288], 20, 17, CONTINUE_PROB)
    assert sum(lengths) == 17 and lengths[0] >= lengths[1] >= lengths[2]


def test_no_match_no_draft():
    assert propose_once([5, 6, 7, 8]) == []
    assert propose_once([5]) == []


def brute_force(tokens, config: NgramConfig, budget: int) -> list[list[int]]:
    """Reference ranking by plain scanning: longest match first, then latest occurrence."""
    n, length = len(tokens), min(config.max_draft_tokens, budget)
    found, seen = [], set()
    for match_len in range(min(config.max_ngram, n - 1), config.min_ngram - 1, -1):
        for end in range(n - 1, match_len - 1, -1):
            if tokens[end - match_len : end] != tokens[n - match_len :]:
                continue
            key = tuple(periodic_continuation(tokens, end, length))  # the draft itself, periodic tail included
            if key in seen:
                continue
            seen.add(key)
            found.append((match_len / (match_len + 1) * BRANCH_DECAY ** len(found), end))
            if len(found) == config.max_branches:
                break
        if len(found) == config.max_branches:
            break
    lengths = reference_drafting.lengths_within_budget([f for f, _ in found], length, budget, CONTINUE_PROB)
    return [periodic_continuation(tokens, end, k) for (_, end), k in zip(found, lengths) if k]


@pytest.mark.parametrize("seed", range(30))
def test_random_contexts_against_brute_force(seed):
    """The incremental index (start, then observe in blocks) drafts what a plain scan finds."""
    rng = random.Random(seed)
    config = NgramConfig(min_ngram=rng.randint(1, 2), max_ngram=rng.randint(2, 5),
                         max_branches=rng.randint(1, 4), max_draft_tokens=rng.randint(1, 12))
    proposer = NgramProposer(config)
    vocab = rng.randint(2, 6)  # small: many repeats
    context = [rng.randrange(vocab) for _ in range(rng.randint(1, 20))]
    proposer.start("r", context)
    for _ in range(15):
        budget = rng.randint(1, 30)
        got = [list(d.token_ids) for d in proposer.propose("r", context, budget)]
        assert got == brute_force(context, config, budget), f"context {context}, budget {budget}"
        new = [rng.randrange(vocab) for _ in range(rng.randint(1, 5))]
        proposer.observe("r", new)
        context = context + new
    proposer.stop("r")


def test_lifecycle_misuse_raises_naming_the_request():
    proposer = NgramProposer()
    with pytest.raises(ValueError, match="'ghost'"):
        proposer.propose("ghost", [1, 2, 3], 8)
    with pytest.raises(ValueError, match="'ghost'"):
        proposer.observe("ghost", [1])
    with pytest.raises(ValueError, match="'ghost'"):
        proposer.stop("ghost")
    proposer.start("a", [1, 2, 3])
    with pytest.raises(ValueError, match="'a'.*already started"):
        proposer.start("a", [1, 2, 3])
    with pytest.raises(ValueError, match="'a'"):  # context grew without observe()
        proposer.propose("a", [1, 2, 3, 4], 8)
    proposer.observe("a", [4])
    assert proposer.propose("a", [1, 2, 3, 4], 8) == []
    proposer.start("b", [9, 9])  # requests are independent
    proposer.stop("a")
    with pytest.raises(ValueError, match="'a'"):
        proposer.propose("a", [1, 2, 3, 4], 8)
    with pytest.raises(ValueError, match="'a'"):
        proposer.stop("a")
    assert [list(d.token_ids) for d in proposer.propose("b", [9, 9], 3)] == [[9, 9, 9]]


def test_branches_are_distinct_continuations():
    drafts = propose_once([5, 1, 2, 1, 2, 1, 2], budget=30, max_draft_tokens=24)
    chains = [d.token_ids for d in drafts]
    for i, a in enumerate(chains):
        for b in chains[i + 1 :]:
            shorter = min(len(a), len(b))
            assert a[:shorter] != b[:shorter], f"{b} repeats {a}"
    assert len(chains[0]) == 24


@pytest.mark.parametrize("bad", [-1, 2**31])
def test_a_token_id_outside_int32_is_a_value_error_and_keeps_nothing(bad):
    index = reference_drafting.NgramIndex(1, 3)  # the reference index alike (the proposer's where not built)
    index.extend([1, 2])
    with pytest.raises(ValueError, match="token ids must be in"):
        index.extend([3, bad])
    assert index.size() == 2
    proposer = NgramProposer()
    with pytest.raises(ValueError, match="token ids must be in"):
        proposer.start("r", [1, 2, bad])
    proposer.start("r", [1, 2])  # the rejected start left no request behind
    proposer.start("s", [1, 2, 3, 1, 2])
    with pytest.raises(ValueError, match="token ids must be in"):
        proposer.observe("s", [3, bad])
    # the rejected observe kept nothing: the request still sees its 5 prompt tokens
    assert [list(d.token_ids[:3]) for d in proposer.propose("s", [1, 2, 3, 1, 2], 8)][0] == [3, 1, 2]


# -- the compiled index against its definition ------------------------------------------------------
@needs_core
@pytest.mark.parametrize("seed", range(60))
def test_compiled_ngram_drafts_equal_the_reference(seed):
    """The compiled index (the proposer's) and ``reference.drafting.NgramIndex`` extended alike
    draft the same arrays, bit for bit, for every budget."""
    from lookupdec.native import drafting as native_drafting

    rng = random.Random(seed)
    min_ngram = rng.randint(1, 3)
    config = NgramConfig(min_ngram=min_ngram, max_ngram=rng.randint(min_ngram, 6),
                         max_draft_tokens=rng.choice((1, 3, 10, 48, 60)), max_branches=rng.randint(1, 5))
    fast = native_drafting.NgramIndex(config.min_ngram, config.max_ngram)
    ref = reference_drafting.NgramIndex(config.min_ngram, config.max_ngram)
    proposer = NgramProposer(config)
    vocab = rng.choice((2, 4, 20))
    context = random_stream(rng, rng.randint(1, 200), vocab)
    context = [t if t != SEPARATOR else 0 for t in context]
    proposer.start("r", context)
    for index in (fast, ref):
        index.extend(context)
    for _ in range(rng.randint(1, 20)):
        max_nodes = rng.choice((1, 2, 5, 17, 64, 100))
        args = (config.max_draft_tokens, config.max_branches, max_nodes, BRANCH_DECAY, CONTINUE_PROB)
        want = ref.propose(*args)
        assert fast.propose(*args) == want
        assert [(*d.packed(), d.match_length) for d in proposer.propose("r", context, max_nodes)] == want
        new = [t if t != SEPARATOR else 1 for t in random_stream(rng, rng.randint(1, 8), vocab)]
        proposer.observe("r", new)
        for index in (fast, ref):
            index.extend(new)
        context += new
    assert fast.size() == ref.size() == len(context)
    with pytest.raises(ValueError, match="observe"):
        proposer.propose("r", context[:-1], 8)


@needs_core
@pytest.mark.parametrize("branch_decay,continue_prob", [(0.6, 0.95), (0.6, 1.0), (1.0, 1.0), (0.6, 1.05),
                                                        (-0.6, 0.95), (0.6, 0.0), (0.6, 0.5), (0.6, -0.9)])
def test_compiled_ngram_budget_shares_equal_the_reference_for_any_decays(branch_decay, continue_prob):
    """Where the branches' tokens outnumber the budget, the compiled index takes each branch's
    best tokens one by one while its scores never rise (else it sorts them all, as the
    reference does): the same lengths for ties (equal decays), rising scores (a continue
    probability past 1) and negative ones."""
    from lookupdec.native import drafting as native_drafting

    rng = random.Random(int(1000 * (branch_decay + 3 * continue_prob)))
    max_draft_tokens = rng.choice((10, 48))
    fast, ref = native_drafting.NgramIndex(1, 3), reference_drafting.NgramIndex(1, 3)
    context = [rng.randrange(3) for _ in range(120)]
    for index in (fast, ref):
        index.extend(context)
    binding, branched = 0, 0
    for max_nodes in (1, 2, 5, 9, 17, 33, 64, 100):
        args = (max_draft_tokens, 5, max_nodes, branch_decay, continue_prob)
        want = ref.propose(*args)
        assert fast.propose(*args) == want, max_nodes
        binding += sum(len(tokens) // 4 for tokens, _, _, _ in want) == max_nodes
        branched += len(want) > 1
    assert binding >= 4 and branched >= 2  # budgets the branches had to share
