"""The per-step budget: ``choose_num_nodes`` against brute force, ``DraftBudget``'s request size,
and the engine asking its proposers for the adapted budget without changing the output."""
from __future__ import annotations

import itertools
import random

import pytest

from conftest import cached_references, cached_tiny
from helpers import FakeTokenizer, SpyProposer
from lookupdec import Engine, EngineConfig
from lookupdec.proposers import build_proposers
from lookupdec.budget import DRAFT_BUDGET_MIN, CostModel, DraftBudget, choose_num_nodes


def _rate(values, n, cost, overhead):
    return (1 + sum(values[:n])) / (cost(1 + n) + overhead)


@pytest.mark.parametrize("seed", range(20))
def test_choose_num_nodes_is_the_best_prefix(seed):
    rng = random.Random(seed)
    values = sorted((rng.random() ** 2 for _ in range(rng.randint(1, 40))), reverse=True)
    cost = CostModel([1, 2, 4, 8, 16, 32, 64], sorted(rng.uniform(1, 6) for _ in range(7)))
    overhead = rng.uniform(0, 1)
    chosen = choose_num_nodes(values, cost, overhead, len(values))
    best = max(range(len(values) + 1), key=lambda n: (_rate(values, n, cost, overhead), -n))
    assert _rate(values, chosen, cost, overhead) == pytest.approx(_rate(values, best, cost, overhead))


def test_choose_num_nodes_respects_max_nodes_and_flat_cost():
    assert choose_num_nodes([0.9] * 10, CostModel.flat(), 0.0, 4) == 4  # free nodes: as many as allowed
    assert choose_num_nodes([0.01] * 10, CostModel([1, 2], [1.0, 2.0]), 0.0, 10) == 0  # never worth it


def test_draft_budget_follows_what_was_kept():
    budget = DraftBudget()
    assert budget.nodes(128) == 128  # nothing kept yet
    for _ in range(100):
        budget.observe(3)
    assert budget.nodes(128) == DRAFT_BUDGET_MIN  # 2 x 3 rounds up to the floor
    for _ in range(100):
        budget.observe(50)
    assert budget.nodes(128) == 128  # 2 x 50 -> 128
    assert budget.nodes(64) == 64  # capped by max_nodes
    assert all(budget.nodes(m) & (budget.nodes(m) - 1) == 0 for m in (16, 32, 64, 128))  # powers of 2


def test_engine_asks_the_adapted_budget_and_output_is_unchanged():
    model = cached_tiny("llama")
    config = EngineConfig(max_nodes=128, budget="auto")
    counting = [SpyProposer(p) for p in build_proposers(config, tokenizer=FakeTokenizer())]
    engine = Engine(model, FakeTokenizer(), config, proposers=counting)
    for prompt, n, expected in itertools.islice(cached_references("llama"), 6):
        assert engine.generate(prompt, max_new_tokens=n).token_ids == expected
    asked = [b for p in counting for b in p.asked]
    assert asked[0] == 128  # the first step asks for everything
    assert all(DRAFT_BUDGET_MIN <= b <= 128 for b in asked)
    assert engine.draft_budget.mean_kept is not None
