"""Token recycling (``proposers/recycle.py``): the table it keeps from the target's top tokens,
the best-first draft it grows from it, the compiled table against its definition
(``lookupdec.reference.drafting.RecycleTable``), and, through the engine, exact greedy output with it."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import cached_tiny
from helpers import FakeTokenizer
from lookupdec import Engine, EngineConfig
from lookupdec.automaton import compiled_available
from lookupdec.config import RecycleConfig
from lookupdec.engine import top_tokens
from lookupdec.proposers.recycle import PAIR_MATCH, RANK_PRIOR, TOKEN_MATCH, RecycleProposer
from lookupdec.reference import drafting as reference_drafting


def tables(config: RecycleConfig) -> tuple:
    """The compiled table and its definition, made alike."""
    from lookupdec.native import drafting as native_drafting

    args = (config.successors, config.max_entries, list(RANK_PRIOR))
    return native_drafting.RecycleTable(*args), reference_drafting.RecycleTable(*args)


def observe(table, visits) -> None:
    """``RecycleProposer.observe_successors``' call of the table."""
    previous, tokens, successors = zip(*visits) if visits else ((), (), ())
    table.observe(previous, tokens, successors)


def draft_of(table, config: RecycleConfig, context, budget: int):
    """``RecycleProposer.propose``'s call of the table (its arrays as bytes), None where it calls none."""
    limit = min(budget, config.max_nodes)
    if limit <= 0 or not context:
        return None
    return table.propose(context[-2] if len(context) > 1 else -1, context[-1], limit, config.max_depth)


def test_nothing_recorded_nothing_drafted():
    p = RecycleProposer()
    assert p.propose("r", [1, 2, 3], 16) == []


def test_draft_follows_the_recorded_successors_best_first():
    p = RecycleProposer(RecycleConfig(successors=2, max_nodes=4, max_depth=3))
    p.observe_successors([(1, 2, [5, 6, 7]), (2, 5, [8, 9]), (5, 8, [3])])
    (draft,) = p.propose("r", [1, 2], 16)
    assert draft.source == "recycle" and draft.match_length == PAIR_MATCH
    # root 2 (after 1) -> 5 (.45), 6 (.15); 5 (after 2) -> 8 (.45^2), 9; 8 (after 5) -> 3 (.45^3)
    assert draft.token_ids == (5, 8, 6, 3) and draft.parents == (-1, 0, -1, 1)
    assert draft.scores == pytest.approx((RANK_PRIOR[0], RANK_PRIOR[0] ** 2, RANK_PRIOR[1], RANK_PRIOR[0] ** 3))
    assert all(len(set(draft.token_ids[i] for i in range(len(draft.parents)) if draft.parents[i] == p)) ==
               sum(1 for q in draft.parents if q == p) for p in set(draft.parents))  # siblings distinct


def test_token_table_is_the_fallback_and_limits_hold():
    p = RecycleProposer(RecycleConfig(successors=3, max_nodes=3, max_depth=1))
    p.observe_successors([(9, 2, [5, 6, 7, 8])])
    (draft,) = p.propose("r", [4, 2], 16)  # (4, 2) never seen: the token 2's row
    assert draft.match_length == TOKEN_MATCH and draft.token_ids == (5, 6, 7)  # 3 successors kept
    assert p.propose("r", [4, 2], 0) == []
    assert len(p.propose("r", [4, 2], 2)[0].token_ids) == 2


def test_pair_table_is_bounded():
    config = RecycleConfig(max_entries=3)
    p = RecycleProposer(config)
    ref = reference_drafting.RecycleTable(config.successors, config.max_entries, RANK_PRIOR)  # the definition alike
    for i in range(10):
        p.observe_successors([(i, i + 1, [1])])
        observe(ref, [(i, i + 1, [1])])
        assert p.num_pairs == ref.num_pairs() <= 4
    assert p.num_pairs < 4 or p.propose("r", [0, 1], 8) == []  # (0, 1) went with the first clear
    assert ref.num_pairs() < 4 or ref.lookup(0, 1)[1] != PAIR_MATCH


@pytest.mark.skipif(not compiled_available(), reason="compiled core not built")
def test_compiled_table_keeps_the_pair_whose_key_marks_empty_slots():
    """The pair (-1, -1) packs to a key with every bit set, the compiled table's mark of an
    empty slot: it is kept apart, found, overwritten and counted like any other."""
    config = RecycleConfig(successors=2, max_nodes=8, max_depth=3)
    fast, ref = tables(config)
    for visits in ([(-1, -1, [4, 5]), (3, -1, [6])], [(-1, -1, [7])], [(-1, 4, [-1, 2])]):
        observe(ref, visits)
        observe(fast, visits)
        assert fast.num_pairs() == ref.num_pairs()
        for context in ([-1], [-1, -1], [3, -1], [-1, 4], [9, 9]):
            assert draft_of(fast, config, context, 8) == draft_of(ref, config, context, 8)


@pytest.mark.skipif(not compiled_available(), reason="compiled core not built")
@pytest.mark.parametrize("seed", range(6))
def test_compiled_table_drafts_equal_the_reference(seed):
    """Random visits (small vocabulary: pairs and tokens recur, entries are overwritten, the pair
    table is cleared) and random configs: every draft identical, its arrays bit for bit; the
    proposer's drafts are the compiled table's."""
    rng = np.random.default_rng(seed)
    config = RecycleConfig(successors=int(rng.integers(1, 6)), max_nodes=int(rng.integers(1, 40)),
                           max_depth=int(rng.integers(1, 10)), max_entries=int(rng.integers(1, 60)))
    fast, ref = tables(config)
    proposer = RecycleProposer(config)
    vocab = int(rng.integers(3, 30))
    for _ in range(80):
        visits = [(int(rng.integers(-1, vocab)), int(rng.integers(0, vocab)),
                   [int(t) for t in rng.integers(0, vocab, size=int(rng.integers(0, 8)))])
                  for _ in range(int(rng.integers(0, 6)))]
        if visits and rng.random() < 0.5:  # a walked path (RequestCore.accept's hand-off): each token's previous is the one before
            prev, tokens, tops = visits[0][0], [v[1] for v in visits], [v[2] for v in visits]
            for table in (fast, ref):
                table.observe_path(prev, tokens, tops)
            proposer.observe_path(prev, tokens, tops)
        else:
            for table in (fast, ref):
                observe(table, visits)
            proposer.observe_successors(visits)
        assert fast.num_pairs() == ref.num_pairs() == proposer.num_pairs
        context = [int(t) for t in rng.integers(0, vocab, size=int(rng.integers(1, 4)))]
        budget = int(rng.integers(0, 48))
        want = draft_of(ref, config, context, budget)
        assert draft_of(fast, config, context, budget) == want
        drafts = proposer.propose("r", context, budget)
        assert [(*d.packed(), d.match_length) for d in drafts] == ([want] if want and want[0] else [])
        assert all(d.source == "recycle" for d in drafts)


@pytest.mark.parametrize("rows", [[0], [0, 2, 3]])
def test_top_tokens_equal_topk(rows):
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(1))
    want = logits[rows].topk(4, dim=-1).indices.tolist()
    assert top_tokens(logits, rows, 4) == want
    assert np.isfinite(logits.numpy()).all()  # the rows were copied, not overwritten


@pytest.mark.skipif(not compiled_available(), reason="compiled core not built")
@pytest.mark.parametrize("seed", range(4))
def test_greedy_walk_top_k_is_the_walk_and_top_tokens_of_its_rows(seed):
    """``accept(top_k=k)``: the walk's one pass over each visited row gives the same accepted
    nodes as ``reference.sampling.accept`` and the same top tokens as ``reference.request.top_tokens``
    (ties, NaN and -inf rows included)."""
    from lookupdec.reference import request as reference_request
    from lookupdec.reference import sampling as reference_sampling
    from lookupdec.sampling import SamplingParams, accept
    from lookupdec.tree import TokenTree

    rng = np.random.default_rng(seed)
    vocab, n = 40, 12
    parents = [-1] + [int(rng.integers(0, i)) for i in range(1, n)]
    tokens = [0] + [parents[1:i].count(parents[i]) for i in range(1, n)]  # siblings distinct: 0, 1, 2, ...
    tree = TokenTree(token_ids=tokens, parents=parents)
    logits = torch.from_numpy(rng.integers(0, 3, size=(n, vocab)).astype(np.float32))  # many ties
    logits[:, :2] += 5.0  # the walk goes deep
    if seed == 1:
        logits[0, 7] = float("nan")
    if seed == 2:
        logits[0] = float("-inf")
    for k in (1, 3, 4):
        got = accept(tree, logits, SamplingParams(), top_k=k)
        want = reference_sampling.accept(tree, logits, SamplingParams())
        assert (got.accepted, got.next_token, got.bonus) == (want.accepted, want.next_token, want.bonus)
        assert got.tops == reference_request.top_tokens(logits, [0, *got.accepted], k)
        assert got.tokens == [tree.token_ids[u] for u in [0, *got.accepted]]  # the dense walk's path too
    assert accept(tree, logits, SamplingParams()).tops is None


def test_engine_with_recycling_is_exact_and_uses_it():
    model = cached_tiny("llama")
    prompt = [5, 6, 7, 8, 9, 10, 11, 12]
    ref = Engine(model, FakeTokenizer(), EngineConfig(proposers=(), budget="fixed")).generate(prompt, max_new_tokens=40)
    engine = Engine(model, FakeTokenizer(), EngineConfig(proposers=("recycle",), budget="fixed"))
    engine.generate(prompt, max_new_tokens=40)  # fills the table
    gen = engine.generate(prompt, max_new_tokens=40)
    assert gen.token_ids == ref.token_ids
    assert gen.stats.accepted_by_source.get("recycle", 0) > 0  # the second time, its drafts are accepted


def test_observe_path_is_observe_successors_of_the_path():
    """``observe_path(prev, tokens, tops)`` records (prev, t0), (t0, t1), ...: the same table as
    ``observe_successors`` of those entries, in the proposer and in the reference table."""
    config = RecycleConfig()
    by_path, by_entries = RecycleProposer(config), RecycleProposer(config)
    tokens, tops = [5, 6, 7], [[6, 1], [7, 2], [8, 3]]
    by_path.observe_path(4, tokens, tops)
    by_entries.observe_successors([(4, 5, [6, 1]), (5, 6, [7, 2]), (6, 7, [8, 3])])
    ref_path, ref_entries = (reference_drafting.RecycleTable(config.successors, config.max_entries, RANK_PRIOR)
                             for _ in range(2))
    ref_path.observe_path(4, tokens, tops)
    observe(ref_entries, [(4, 5, [6, 1]), (5, 6, [7, 2]), (6, 7, [8, 3])])
    for context in ([4, 5], [5, 6], [6, 7], [9, 7]):
        want = by_entries.propose("r", context, 8)
        assert [(d.token_ids, d.scores, d.match_length) for d in by_path.propose("r", context, 8)] == \
               [(d.token_ids, d.scores, d.match_length) for d in want] and want
        assert draft_of(ref_path, config, context, 8) == draft_of(ref_entries, config, context, 8) == \
               (*want[0].packed(), want[0].match_length)
