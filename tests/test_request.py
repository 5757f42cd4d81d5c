"""What one sequence and a batch's rows share (``lookupdec/request.py``): the recycling proposer's
successors (compiled ``top_tokens`` against its definition, ``reference.request.top_tokens``), and the rows a greedy verify forward
projects (``RequestCore.head_rows``): a small tree every row with its picks, a larger one only the
likely rows, the output ``transformers``' greedy either way."""
from __future__ import annotations

import random

import pytest
import torch

from conftest import cached_tiny
from helpers import FakeTokenizer, hf_greedy, needs_core
from lookupdec import Engine, EngineConfig


@needs_core
@pytest.mark.parametrize("seed", range(100))
def test_top_tokens_equal_the_reference(seed):
    """The recycling proposer's successors: compiled top-k vs repeated argmax (ties, NaN, -inf
    rows with fewer than k finite entries, k above the vocabulary)."""
    from lookupdec.reference import request as reference_request
    from lookupdec.request import top_tokens

    rng = random.Random(seed)
    vocab = rng.choice((1, 3, 10, 300, 1031))  # 300, 1031: the compiled scan's blocks of 32 and its tail
    logits = torch.randint(-2, 3, (6, vocab)).float() if rng.random() < 0.5 else torch.randn(6, vocab)
    for _ in range(rng.randint(0, 6)):
        logits[rng.randrange(6), rng.randrange(vocab)] = rng.choice((float("nan"), float("-inf"), float("inf")))
    if rng.random() < 0.2:
        logits[rng.randrange(6)] = float("-inf")
    rows = [rng.randrange(6) for _ in range(rng.randint(0, 6))]
    k = rng.choice((1, 2, 4, 8, vocab + 2))
    assert top_tokens(logits, rows, k) == reference_request.top_tokens(logits, rows, k)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_small_greedy_trees_compute_every_row_with_its_picks(family, monkeypatch):
    """A tree of at most ``HEAD_MIN_ROWS`` nodes: every row (as cheap as one) and each row's
    best ids asked for, which the skinny product makes as it writes the rows, so the walk reads
    no row of the vocabulary's width; the output stays ``transformers``' greedy."""
    from lookupdec.sampling import HEAD_MIN_ROWS

    model = cached_tiny(family)
    engine = Engine(model, FakeTokenizer(), EngineConfig(budget="fixed", max_nodes=4))
    head = engine.target.fast_head
    assert engine.target.partial_head and head is not None
    if "skinny" not in head.forms:
        pytest.skip("no skinny product on this machine")
    # the skinny product for every call (the head is the model's: other tests timed its buckets,
    # and a check of another form could fall due)
    monkeypatch.setattr(head._chooser, "pick", lambda key: "skinny")
    seen = []
    verify = engine.target.verify

    def spy(tree, rows=None, picks=0):
        out = verify(tree, rows, picks)
        seen.append((len(tree), rows, picks, getattr(out, "tops", None) is not None))
        return out

    engine.target.verify = spy
    prompt = [5, 6, 7, 8] * 6
    gen = engine.generate(prompt, max_new_tokens=30)
    assert gen.token_ids == hf_greedy(model, prompt, 30)[: len(gen.token_ids)]
    assert seen and all(n <= HEAD_MIN_ROWS for n, _, _, _ in seen)
    assert all(rows == list(range(n)) and picks >= 1 and tops for n, rows, picks, tops in seen), seen


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_engine_greedy_output_is_exact_and_skips_rows(family):
    model = cached_tiny(family)
    config = EngineConfig(budget="fixed", max_nodes=48)
    engine = Engine(model, FakeTokenizer(), config)
    assert engine.target.partial_head
    computed = nodes = 0
    for i, prompt in enumerate([[5, 6, 7, 8] * 6, [9, 10, 11, 9, 10, 12] * 4, [20 + j % 7 for j in range(30)]]):
        gen = engine.generate(prompt, max_new_tokens=40)
        assert gen.token_ids == hf_greedy(model, prompt, 40)[: len(gen.token_ids)], i
        computed += gen.stats.logit_rows * gen.stats.steps
        nodes += (gen.stats.mean_tree_nodes + 1) * gen.stats.steps
    assert computed < nodes  # some rows were never computed
    engine.target.partial_head = False
    gen = engine.generate([5, 6, 7, 8] * 6, max_new_tokens=40)
    assert gen.stats.logit_rows == gen.stats.mean_tree_nodes + 1
