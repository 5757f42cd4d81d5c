"""Batched verification (``lookupdec/batch.py``, ``model/batch.py``): every sequence of a batch
gets the output it gets alone, whatever else the batch holds.

- greedy: identical to ``transformers`` ``generate`` for every prompt of every tiny family
  (float32), prompts of different lengths and output lengths in one batch, more prompts than
  rows (continuous batching: rows are reused as sequences finish);
- sampled: the same output as alone for the same seed, greedy and sampled requests mixed;
- per-request stop strings and cancel flags, and the batch rows' K/V bookkeeping.
"""
from __future__ import annotations

import threading

import pytest
import torch

from conftest import cached_references, cached_tiny
from helpers import FakeTokenizer, first_difference
from lookupdec import Engine, EngineConfig
from lookupdec.batch import BatchDecoder, BatchRequest, WidthCosts, choose_width
from lookupdec.budget import CostModel
from lookupdec.model.cache import BatchStore, SlotStore
from tiny_models import FAMILIES

SAMPLING = dict(temperature=0.8, top_k=20, top_p=0.9)


def run_batch(engine: Engine, requests: list[BatchRequest], max_batch: int):
    decoder = BatchDecoder(engine, max_batch)
    for r in requests:
        decoder.submit(r)
    return decoder.run(), decoder


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_batch_equals_transformers(family):
    model = cached_tiny(family)
    refs = cached_references(family)[:10]
    engine = Engine(model, FakeTokenizer(), EngineConfig())
    requests = [BatchRequest(list(prompt), n) for prompt, n, _ in refs]
    if not engine.batchable:  # the reference path: one at a time
        outs = engine.generate_batch([r.prompt for r in requests], max_new_tokens=min(n for _, n, _ in refs))
        assert all(g.token_ids == want[: len(g.token_ids)] for g, (_, _, want) in zip(outs, refs))
        return
    outs, decoder = run_batch(engine, requests, max_batch=4)
    for i, (gen, (prompt, n, want)) in enumerate(zip(outs, refs)):
        assert gen.token_ids == want, f"{family} prompt {i}: first difference at {first_difference(gen.token_ids, want)}"
    assert max(decoder.widths) > 1  # trees were verified, not only roots
    assert decoder.target.rows == 0 and decoder.idle


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_fixed_budget_batch_equals_transformers(family):
    model = cached_tiny(family)
    refs = cached_references(family)[:6]
    engine = Engine(model, FakeTokenizer(), EngineConfig(budget="fixed", max_nodes=12))
    outs, _ = run_batch(engine, [BatchRequest(list(p), n) for p, n, _ in refs], max_batch=3)
    assert [g.token_ids for g in outs] == [want for _, _, want in refs]


@pytest.mark.parametrize("family", ["llama", "gpt_neox"])
def test_sampled_batch_equals_alone_for_a_seed(family):
    model = cached_tiny(family)
    prompts = [[5, 9, 13, 17, 21] * 3, [7, 8, 9, 7, 8, 9, 7, 8], [3, 4, 5, 6, 3, 4, 5, 6, 3, 4, 5], [11, 12, 13] * 5]
    alone_engine = Engine(model, FakeTokenizer())
    alone = []
    for i, p in enumerate(prompts):
        params = SAMPLING if i % 2 == 0 else {}  # sampled and greedy requests in one batch
        alone.append(alone_engine.generate(p, max_new_tokens=25, seed=100 + i, **params).token_ids)
    requests = [BatchRequest(p, 25, seed=100 + i, **(SAMPLING if i % 2 == 0 else {})) for i, p in enumerate(prompts)]
    outs, _ = run_batch(Engine(model, FakeTokenizer()), requests, max_batch=3)
    assert [g.token_ids for g in outs] == alone


def test_generate_batch_api_and_seeds():
    model = cached_tiny("llama")
    engine = Engine(model, FakeTokenizer())
    prompts = [[5, 6, 7, 5, 6, 7], [9, 10, 11, 12]]
    outs = engine.generate_batch(prompts, max_new_tokens=12, seed=[1, 2], **SAMPLING)
    assert [g.token_ids for g in outs] == [engine.generate(p, max_new_tokens=12, seed=s, **SAMPLING).token_ids
                                           for p, s in zip(prompts, [1, 2])]
    assert all(g.finish_reason in ("length", "eos") and g.stats.steps > 0 for g in outs)
    with pytest.raises(ValueError, match="seed"):
        engine.generate_batch(prompts, max_new_tokens=4, seed=[1])
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.generate_batch(prompts, max_new_tokens=0)


def test_stop_strings_and_cancel_are_per_request():
    model = cached_tiny("llama")
    engine = Engine(model, FakeTokenizer())
    prompt = [5, 9, 13, 17, 21] * 3
    alone = engine.generate(prompt, max_new_tokens=30)
    stop_at = alone.text[5:8]
    cancel = threading.Event()
    cancel.set()
    pieces: list[str] = []
    requests = [BatchRequest(prompt, 30, stop=[stop_at]), BatchRequest(prompt, 30, cancel=cancel),
                BatchRequest(prompt, 30, on_text=pieces.append)]
    outs, _ = run_batch(engine, requests, max_batch=3)
    assert outs[0].finish_reason == "stop" and outs[0].text == alone.text[: alone.text.index(stop_at)]
    assert outs[1].finish_reason == "cancelled" and outs[1].token_ids == []
    assert outs[2].token_ids == alone.token_ids and "".join(pieces) == alone.text


def test_batch_store_rows():
    layers, heads, dim = 2, 3, 4
    one = SlotStore(layers)
    for layer in range(layers):
        one.write(layer, torch.arange(5 * heads * dim, dtype=torch.float32).view(1, heads, 5, dim) + layer,
                  torch.zeros(1, heads, 5, dim))
    store = BatchStore(layers, max_rows=3)
    store.put_row(0, one, 5)
    store.put_row(1, one, 3)
    store.rows = 2
    assert store.lengths == [5, 5]
    assert torch.equal(store.view(0, 0)[1, :, :3], one.view(0, 0)[0, :, :3])
    assert torch.count_nonzero(store.view(0, 0)[1, :, 3:]) == 0  # a hole is zeros, never garbage
    store.gather_row(0, [3, 4], 1)  # slots 3, 4 of row 0 to 1, 2
    assert torch.equal(store.view(1, 0)[0, :, 1:3], one.view(1, 0)[0, :, 3:5])
    store.move_row(0, 1, 5)
    assert torch.equal(store.buffer[:, :, 1, :, :5], store.buffer[:, :, 0, :, :5])


def test_choose_width():
    cost = WidthCosts(CostModel([1, 2, 4, 8, 16], [1.0, 1.0, 1.05, 1.1, 3.0]), rows=2)
    assert choose_width([[0.9, 0.9, 0.9], [0.9, 0.9, 0.9]], cost, 0.0, 8) == 4  # 8 tokens for 1.1
    assert choose_width([[0.01, 0.01], [0.01]], WidthCosts(CostModel([1, 2, 4], [1.0, 1.5, 2.0]), 2), 0.0, 8) == 1
    assert choose_width([[], []], cost, 0.0, 8) == 1
    assert choose_width([[0.9] * 10], WidthCosts(cost.seed, 1), 0.0, 3) <= 4  # max_nodes caps the width


def test_width_costs_learn_and_move_on():
    """An untried width is never dearer than its seed (so each gets tried); a timed width keeps
    its own estimate, and one estimated too cheap is dropped once timed (no envelope)."""
    cost = WidthCosts(CostModel([1, 64], [1.0, 4.0]), rows=4)
    seed16 = 1.0 + 3.0 * 15 / 63
    assert cost(4) == pytest.approx(seed16)
    cost.observe(4, 3.0)  # dearer than the seed: untried widths stay at their seeds
    assert cost(4) == 3.0 and cost(2) == pytest.approx(1.0 + 3.0 * 7 / 63)
    cheap = WidthCosts(CostModel([1, 64], [1.0, 4.0]), rows=4)
    cheap.observe(4, seed16 / 2)  # cheaper than the seed: untried widths scale down with it
    assert cheap(2) == pytest.approx((1.0 + 3.0 * 7 / 63) / 2)
    gains = [[0.9] * 40] * 4
    first = choose_width(gains, cost, 0.0, 64)
    cost.observe(first, 500.0)  # far dearer than estimated
    assert cost(first) == 500.0 and choose_width(gains, cost, 0.0, 64) != first
    for _ in range(20):
        cost.observe(4, 1.0)
    assert cost(4) < 1.1
