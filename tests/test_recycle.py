"""Token recycling (``proposers/recycle.py``): the table it keeps from the target's top tokens,
the best-first draft it grows from it, and, through the engine, exact greedy output with it."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import cached_tiny
from helpers import FakeTokenizer
from lookupdec import Engine, EngineConfig
from lookupdec.config import RecycleConfig
from lookupdec.engine import top_tokens
from lookupdec.proposers.recycle import PAIR_MATCH, RANK_PRIOR, TOKEN_MATCH, RecycleProposer


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
    p = RecycleProposer(RecycleConfig(max_entries=3))
    for i in range(10):
        p.observe_successors([(i, i + 1, [1])])
    assert len(p.by_pair) <= 4


@pytest.mark.parametrize("rows", [[0], [0, 2, 3]])
def test_top_tokens_equal_topk(rows):
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(1))
    want = logits[rows].topk(4, dim=-1).indices.tolist()
    assert top_tokens(logits, rows, 4) == want
    assert np.isfinite(logits.numpy()).all()  # the rows were copied, not overwritten


def test_engine_with_recycling_is_exact_and_uses_it():
    model = cached_tiny("llama")
    prompt = [5, 6, 7, 8, 9, 10, 11, 12]
    ref = Engine(model, FakeTokenizer(), EngineConfig(proposers=(), budget="fixed")).generate(prompt, max_new_tokens=40)
    engine = Engine(model, FakeTokenizer(), EngineConfig(proposers=("recycle",), budget="fixed"))
    engine.generate(prompt, max_new_tokens=40)  # fills the table
    gen = engine.generate(prompt, max_new_tokens=40)
    assert gen.token_ids == ref.token_ids
    assert gen.stats.accepted_by_source.get("recycle", 0) > 0  # the second time, its drafts are accepted
