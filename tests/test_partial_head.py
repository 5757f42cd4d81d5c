"""Verify forwards that project only the likely nodes' hidden states (``sampling.PartialLogits``,
``TargetModel.verify(rows=...)``): the walk over them equals the walk over every row, rows it
reaches without logits are computed then, and models that change their logits after the output
projection never take this path."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from conftest import cached_tiny
from helpers import FakeTokenizer, hf_greedy
from lookupdec import Engine, EngineConfig
from lookupdec.automaton import compiled_available
from lookupdec.engine import top_tokens_reference
from lookupdec.model.kernels import _bucket
from lookupdec.model.target import TargetModel
from lookupdec.sampling import PartialLogits, SamplingParams, accept, accept_reference, head_rows
from lookupdec.tree import TokenTree
from tiny_models import tiny_model

needs_core = pytest.mark.skipif(not compiled_available(), reason="compiled core not built")


def _random_tree(rng, n: int) -> TokenTree:
    parents = [-1] + [int(rng.integers(max(0, i - 3), i)) for i in range(1, n)]  # deep paths
    tokens = [0] + [parents[1:i].count(parents[i]) for i in range(1, n)]  # siblings distinct
    expected = [1.0] + [float(rng.random()) ** 3 for _ in range(1, n)]
    for i in range(1, n):  # a path is never likelier than its prefix, as in a merged tree
        expected[i] = min(expected[i], expected[parents[i]])
    return TokenTree(token_ids=tokens, parents=parents, expected=expected)


@needs_core
@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("top_k", [0, 4])
@pytest.mark.parametrize("picked", [False, True])
def test_walk_over_partial_rows_equals_the_walk_over_every_row(seed, top_k, picked):
    """``picked``: the rows' best ids come with them (``PartialLogits.tops``, as the skinny
    product makes them) and rows computed on demand get theirs."""
    rng = np.random.default_rng(seed)
    n, d, vocab = 40, 16, 64
    tree = _random_tree(rng, n)
    hidden = torch.from_numpy(rng.standard_normal((n, d)).astype(np.float32))
    weight = torch.from_numpy(rng.standard_normal((vocab, d)).astype(np.float32))
    weight[:3] *= 4.0  # tokens 0-2 usually win: the walk goes deep, past the rows computed up front
    dense = hidden @ weight.T
    project = lambda h: (h @ weight.T, 0.0)  # noqa: E731
    rows = [0] if seed % 2 else head_rows(range(n), tree.expected, min_rows=2)
    tops = np.asarray(top_tokens_reference(dense, rows, max(top_k, 1)), dtype=np.int32) if picked else None
    partial = PartialLogits(tree, rows, dense[rows], hidden, project, tops=tops)
    got = accept(tree, partial, SamplingParams(), top_k=top_k)
    want = accept_reference(tree, dense, SamplingParams())
    assert (got.accepted, got.next_token, got.bonus) == (want.accepted, want.next_token, want.bonus)
    if top_k:
        assert got.tops == top_tokens_reference(dense, [0, *got.accepted], top_k)
    # the path's tokens, across walks resumed after a miss too
    assert got.tokens == [tree.token_ids[u] for u in [0, *got.accepted]]
    computed = partial.row_of >= 0
    assert computed[[0, *got.accepted]].all()  # every visited row was computed, each once
    assert partial.computed == int(computed.sum())
    if rows == [0] and got.accepted:
        assert partial.misses >= 1 and partial.computed < n
    if picked:  # the rows computed on demand got their picks too
        assert partial.tops.shape == (partial.computed, max(top_k, 1))
        assert partial.tops.tolist() == top_tokens_reference(partial.logits, range(partial.computed), max(top_k, 1))
    # every other path sees every row, in node order
    assert torch.equal(partial.dense(), dense)


@needs_core
def test_the_walk_reads_the_picks_not_the_rows():
    """With ``tops`` the walk follows the picks made as the rows were written: given rows of
    zeros (whose argmax is token 0) and picks naming token 1 at the root, it takes the root's
    child with token 1, and hands recycling the picks."""
    tree = TokenTree(token_ids=[9, 0, 1], parents=[-1, 0, 0], expected=[1.0, 0.5, 0.5])
    zeros = torch.zeros(3, 5)
    tops = np.array([[1, 2], [3, 4], [4, 0]], dtype=np.int32)
    got = accept(tree, PartialLogits(tree, [0, 1, 2], zeros, torch.zeros(3, 2), None, tops=tops), SamplingParams(),
                 top_k=2)
    assert (got.accepted, got.next_token, got.tops) == ([2], 4, [[1, 2], [4, 0]])
    assert tree.greedy_walk(None, 2, None, 0, tops)[:4] == ([2], 4, True, [[1, 2], [4, 0]])  # no rows needed
    with pytest.raises(ValueError, match="logits or choices"):
        tree.greedy_walk(None, 2)


@needs_core
def test_sampling_on_partial_logits_takes_every_row():
    rng = np.random.default_rng(0)
    tree = _random_tree(rng, 12)
    hidden = torch.from_numpy(rng.standard_normal((12, 8)).astype(np.float32))
    weight = torch.from_numpy(rng.standard_normal((20, 8)).astype(np.float32))
    dense = hidden @ weight.T
    params = SamplingParams(temperature=0.8)
    got = accept(tree, PartialLogits(tree, [0], dense[[0]], hidden, lambda h: (h @ weight.T, 0.0)), params,
                 generator=torch.Generator().manual_seed(3))
    want = accept(tree, dense, params, generator=torch.Generator().manual_seed(3))
    assert (got.accepted, got.next_token) == (want.accepted, want.next_token)


def test_head_rows_keep_the_likely_nodes_and_a_floor():
    expected = [1.0, 0.9, 0.05, 0.3, 0.01, 0.2]
    assert head_rows(range(6), expected, min_rows=2) == [0, 1, 3, 5]
    assert head_rows(range(6), expected, min_rows=5) == [0, 1, 2, 3, 5]
    assert head_rows(range(3), expected, min_rows=8) == [0, 1, 2]
    assert head_rows([3, 4], expected, base=0.3, min_rows=1, threshold=0.1) == [3]  # 0.01 < 0.1 x 0.3


@pytest.mark.parametrize("family", ["llama", "phi", "gpt2"])
def test_verify_rows_gives_the_full_forward_rows(family):
    model = cached_tiny(family)
    target = TargetModel(model, verify="tree")
    assert target.partial_head
    rng = np.random.default_rng(1)
    tree = _random_tree(rng, 20)
    prompt = [int(t) for t in rng.integers(3, 90, size=15)]
    target.prefill(prompt)
    full = target.verify(tree)
    target.prefill(prompt)
    rows = [0, 2, 5]
    partial = target.verify(tree, rows)
    assert isinstance(partial, PartialLogits) and partial.computed == 3
    torch.testing.assert_close(partial.logits, full[rows], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(partial.dense(), full, rtol=1e-5, atol=1e-5)
    target.prefill(prompt)
    assert isinstance(target.verify(tree, list(range(len(tree)))), torch.Tensor)  # every row: a plain forward
    if target.fast_head is not None and "skinny" in target.fast_head.forms:
        # every row with picks (a small greedy tree, RequestCore.head_rows): the same rows, each one's
        # best ids with it where the head's form is the skinny product
        key = (_bucket(len(tree)), torch.get_num_threads())
        target.fast_head.choice[key] = "skinny"
        target.fast_head._chooser._best.pop(key, None)
        target.prefill(prompt)
        every = target.verify(tree, list(range(len(tree))), picks=4)
        assert isinstance(every, PartialLogits) and every.computed == len(tree)
        torch.testing.assert_close(every.logits, full, rtol=1e-5, atol=1e-5)
        assert every.tops.tolist() == top_tokens_reference(every.logits, range(len(tree)), 4)
    if target.fast_head is not None and "skinny" in target.fast_head.forms:  # the head picks as it writes
        key = (3, torch.get_num_threads())
        # (the head is the model's, shared with earlier tests that timed this bucket: with a best
        # time on record a check of another form may fall due on this call; without one, none does)
        target.fast_head.choice[key] = "skinny"
        target.fast_head._chooser._best.pop(key, None)
        target.prefill(prompt)
        picked = target.verify(tree, rows, picks=4)
        torch.testing.assert_close(picked.logits, full[rows], rtol=1e-5, atol=1e-5)
        assert picked.tops.tolist() == top_tokens_reference(picked.logits, range(3), 4)


class _ScaledLogits(transformers.LlamaForCausalLM):
    """Logits changed after the output projection (as soft-capping or scaling models do)."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * 0.5
        return out


def test_models_that_change_their_logits_after_the_projection_compute_every_row():
    config = cached_tiny("llama").config
    scaled = _ScaledLogits(config).eval()
    scaled.load_state_dict(cached_tiny("llama").state_dict())
    assert not TargetModel(scaled, verify="tree").partial_head  # found by the bit-for-bit probe
    capped = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, vocab_size=96, final_logit_softcapping=30.0)).eval()
    assert not TargetModel(capped, verify="tree").partial_head  # named in its config


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
