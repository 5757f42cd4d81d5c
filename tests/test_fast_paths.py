"""The per-step fast paths outside the tree merge (``test_tree_core.py`` has that one) against
their references, on many random inputs:

- the n-gram proposer's compiled index and drafts vs its pure-Python reference;
- the suffix proposer's compiled drafts (``automaton_drafts``) vs ``automaton_drafts_reference``:
  the same drafts (tokens, parents, bit-identical scores, match lengths), best chains and
  certain-step bookkeeping, over random streams with separators, request and global automata;
- greedy ``accept`` (argmax of the visited rows) vs ``accept_reference`` (every row's argmax),
  ties and NaN included;
- ``model.tree_inputs`` vs ``tree_inputs_reference`` (ids, positions, additive 4D masks);
- the engine's ``SlotCache`` vs transformers' ``DynamicCache`` through random forwards and
  KV commits (the model-level check is ``test_model_kv.py``).
"""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from lookupdec.automaton import compiled_available
from lookupdec.config import NgramConfig, SuffixConfig
from lookupdec.model import commit_accepted, crop_cache, new_cache, tree_inputs, tree_inputs_reference
from lookupdec.proposers.ngram import NgramProposer
from lookupdec.proposers.suffix import SEPARATOR, SuffixProposer
from lookupdec.sampling import SamplingParams, accept, accept_reference
from lookupdec.tree import TokenTree

needs_core = pytest.mark.skipif(not compiled_available(), reason="compiled core not built (pip install -e .)")


def random_stream(rng: random.Random, length: int, vocab: int) -> list[int]:
    """Repetitive text: copies of earlier spans, fresh tokens and a few separators."""
    out: list[int] = []
    while len(out) < length:
        if out and rng.random() < 0.6:
            start = rng.randrange(len(out))
            out += out[start:start + rng.randint(1, 12)]
        else:
            out.append(SEPARATOR if rng.random() < 0.03 else rng.randrange(vocab))
    return out[:length]


@needs_core
@pytest.mark.parametrize("seed", range(60))
def test_compiled_ngram_drafts_equal_the_reference(seed):
    rng = random.Random(seed)
    min_ngram = rng.randint(1, 3)
    config = NgramConfig(min_ngram=min_ngram, max_ngram=rng.randint(min_ngram, 6),
                         max_draft_tokens=rng.choice((1, 3, 10, 48, 60)), max_branches=rng.randint(1, 5))
    fast, ref = NgramProposer(config), NgramProposer(config, backend="reference")
    assert fast.backend == "compiled"
    vocab = rng.choice((2, 4, 20))
    context = random_stream(rng, rng.randint(1, 200), vocab)
    context = [t if t != SEPARATOR else 0 for t in context]
    for p in (fast, ref):
        p.start("r", context)
    for _ in range(rng.randint(1, 20)):
        max_nodes = rng.choice((0, 1, 2, 5, 17, 64, 100))
        assert comparable(fast.propose("r", context, max_nodes)) == comparable(ref.propose("r", context, max_nodes))
        new = [t if t != SEPARATOR else 1 for t in random_stream(rng, rng.randint(1, 8), vocab)]
        for p in (fast, ref):
            p.observe("r", new)
        context += new
    with pytest.raises(ValueError, match="observe"):
        fast.propose("r", context[:-1], 8)


@needs_core
@pytest.mark.parametrize("branch_decay,continue_prob", [(0.6, 0.95), (0.6, 1.0), (1.0, 1.0), (0.6, 1.05),
                                                        (-0.6, 0.95), (0.6, 0.0), (0.6, 0.5), (0.6, -0.9)])
def test_compiled_ngram_budget_shares_equal_the_reference_for_any_decays(monkeypatch, branch_decay, continue_prob):
    """Where the branches' tokens outnumber the budget, the compiled proposer takes each branch's
    best tokens one by one while its scores never rise (else it sorts them all, as the
    reference does): the same lengths for ties (equal decays), rising scores (a continue
    probability past 1) and negative ones."""
    from lookupdec.proposers import ngram

    monkeypatch.setattr(ngram, "BRANCH_DECAY", branch_decay)
    monkeypatch.setattr(ngram, "CONTINUE_PROB", continue_prob)
    rng = random.Random(int(1000 * (branch_decay + 3 * continue_prob)))
    config = NgramConfig(min_ngram=1, max_ngram=3, max_draft_tokens=rng.choice((10, 48)), max_branches=5)
    fast, ref = NgramProposer(config), NgramProposer(config, backend="reference")
    context = [rng.randrange(3) for _ in range(120)]
    for p in (fast, ref):
        p.start("r", context)
    binding, branched = 0, 0
    for max_nodes in (1, 2, 5, 9, 17, 33, 64, 100):
        got, want = fast.propose("r", context, max_nodes), ref.propose("r", context, max_nodes)
        assert comparable(got) == comparable(want), max_nodes
        binding += sum(len(d.token_ids) for d in want) == max_nodes
        branched += len(want) > 1
    assert binding >= 4 and branched >= 2  # budgets the branches had to share


def comparable(drafts):
    return [(d.token_ids, d.parents, d.scores, d.source, d.match_length, d.best_chain()) for d in drafts]


@needs_core
@pytest.mark.parametrize("seed", range(40))
def test_compiled_suffix_drafts_equal_the_reference(seed):
    rng = random.Random(seed)
    vocab = rng.choice((3, 8, 30))
    config = SuffixConfig(global_min_match=rng.choice((0, 1, 2)), min_match=rng.choice((1, 2)))
    fast, ref = SuffixProposer(config), SuffixProposer(config, drafting="reference")
    for request in range(3):
        prompt = [t for t in random_stream(rng, rng.randint(1, 80), vocab) if t != SEPARATOR] or [1]
        context = list(prompt)
        for p in (fast, ref):
            p.start(f"r{request}", prompt)
        for _ in range(rng.randint(1, 25)):
            max_nodes = rng.choice((0, 1, 2, 5, 16, 64))
            got = fast.propose(f"r{request}", context, max_nodes)
            want = ref.propose(f"r{request}", context, max_nodes)
            assert comparable(got) == comparable(want)
            assert fast._requests.get(f"r{request}").pending == ref._requests.get(f"r{request}").pending
            new = random_stream(rng, rng.randint(1, 6), vocab)
            new = [t for t in new if t != SEPARATOR] or [0]
            for p in (fast, ref):
                p.observe(f"r{request}", new)
            context += new
            for source in fast.certain_step:
                assert fast.certain_step[source].value == ref.certain_step[source].value
        for p in (fast, ref):
            p.stop(f"r{request}")


def test_packed_arrays_and_pending_chain_are_the_drafts_own():
    p = SuffixProposer()
    prompt = [5, 6, 7, 8, 9, 1, 2, 5, 6, 7, 3, 5, 6]
    p.start("r", prompt)
    drafts = p.propose("r", prompt, 8)
    assert drafts
    chain, certain = p._requests.get("r").pending["suffix"]  # the longest match's, checked after the step
    assert chain == drafts[0].best_chain()[0] and len(certain) == len(chain)
    for draft in drafts:
        tokens, parents, scores = draft.packed()
        assert np.frombuffer(tokens, np.int32).tolist() == list(draft.token_ids)
        assert np.frombuffer(parents, np.int32).tolist() == list(draft.parents)
        assert np.frombuffer(scores, np.float64).tolist() == list(draft.scores)
        fresh = type(draft)(draft.token_ids, draft.parents, draft.scores, draft.source, draft.match_length)
        assert draft.best_chain() == fresh.best_chain()


def random_trie(rng: random.Random, size: int, vocab: int) -> TokenTree:
    token_ids, parents, taken = [rng.randrange(vocab)], [-1], set()
    while len(token_ids) < size + 1 and len(taken) < size * vocab:
        parent, token = rng.randrange(len(token_ids)), rng.randrange(vocab)
        if (parent, token) in taken:
            continue
        taken.add((parent, token))
        token_ids.append(token)
        parents.append(parent)
    return TokenTree(token_ids=token_ids, parents=parents)


@pytest.mark.parametrize("seed", range(100))
def test_greedy_accept_equals_the_reference(seed):
    rng = random.Random(seed)
    # 1031, 3072, 3100: the compiled argmax's blocks of 1024, whole and with a tail
    vocab = rng.choice((2, 4, 50, 1031, 3072, 3100))
    tree = random_trie(rng, rng.randint(0, 30), vocab)
    if rng.random() < 0.5:  # integer logits: many tied maxima (the first one wins in both)
        logits = torch.randint(0, 3, (len(tree), vocab)).float()
    else:
        logits = torch.randn(len(tree), vocab, dtype=rng.choice((torch.float32, torch.float64)))
    if rng.random() < 0.2:
        logits[rng.randrange(len(tree)), rng.randrange(vocab)] = float("nan")
    for _ in range(rng.randint(0, 3)):  # a maximum tied at two places, maybe blocks apart; inf, -inf rows
        row, (a, b) = rng.randrange(len(tree)), sorted(rng.sample(range(vocab), 2))
        logits[row, a] = logits[row, b] = rng.choice((10.0, float("inf")))
    if rng.random() < 0.1:
        logits[rng.randrange(len(tree))] = float("-inf")
    # walk along the tree: each visited row's argmax is a child's token most of the time
    node = 0
    while tree.children[node] and rng.random() < 0.8:
        token, child = rng.choice(sorted(tree.children[node].items()))
        logits[node, token] = logits[node].nan_to_num(0.0).max() + 1.0
        node = child
    params = SamplingParams()
    got, want = accept(tree, logits, params), accept_reference(tree, logits, params)
    assert (got.accepted, got.next_token, got.bonus) == (want.accepted, want.next_token, want.bonus)
    view = torch.randn(len(tree), 2 * vocab)[:, ::2]  # a strided view takes the same path
    got, want = accept(tree, view, params), accept_reference(tree, view, params)
    assert (got.accepted, got.next_token) == (want.accepted, want.next_token)


@pytest.mark.parametrize("seed", range(60))
def test_tree_inputs_equal_the_reference(seed):
    rng = random.Random(seed)
    tree = random_trie(rng, rng.randint(0, 40), rng.choice((2, 5, 100)))
    n_cached = rng.choice((0, 1, 7, 300))
    dtype = rng.choice((torch.float32, torch.float16, torch.bfloat16, torch.float64))
    windows = rng.choice(({}, {None: 4}, {"full_attention": None, "sliding_attention": 3}))
    tree_mode = rng.random() < 0.9
    got = tree_inputs(tree, n_cached, device="cpu", dtype=dtype, windows=windows, tree_mode=tree_mode)
    want = tree_inputs_reference(tree, n_cached, device="cpu", dtype=dtype, windows=windows, tree_mode=tree_mode)
    for g, w in zip(got[:2], want[:2]):
        assert g.dtype == w.dtype and torch.equal(g, w)
    if want[2] is None:
        assert got[2] is None
    elif isinstance(want[2], dict):
        assert got[2].keys() == want[2].keys() and all(torch.equal(got[2][k], want[2][k]) for k in want[2])
    else:
        assert got[2].dtype == want[2].dtype and got[2].shape == want[2].shape and torch.equal(got[2], want[2])


@pytest.mark.parametrize("seed", range(12))
def test_tree_inputs_into_kept_buffers_equal_the_reference_step_after_step(seed):
    """``InputBuffers`` (the engine's: a mask buffer kept across steps, each step clearing the last
    step's tree block and writing its own) gives every step of a sequence of trees, chains, growing
    contexts and dtypes what ``tree_inputs_reference`` builds from nothing; each step's views are
    compared before the next step writes."""
    from lookupdec.model.target import InputBuffers

    rng = random.Random(seed)
    buffers = InputBuffers()
    dtype = rng.choice((torch.float32, torch.bfloat16))
    n_cached = rng.choice((0, 5, 900))
    for _ in range(25):
        if rng.random() < 0.1:
            dtype = rng.choice((torch.float32, torch.float16, torch.bfloat16, torch.float64))
        tree = random_trie(rng, rng.choice((0, 1, rng.randint(2, 90))), rng.choice((1, 2, 5, 100)))
        n_cached = max(0, n_cached + rng.choice((-3, 0, 1, 4, 40, 700)))
        got = tree_inputs(tree, n_cached, device="cpu", dtype=dtype, buffers=buffers)
        want = tree_inputs_reference(tree, n_cached, device="cpu", dtype=dtype)
        for g, w in zip(got[:2], want[:2]):
            assert g.dtype == w.dtype and torch.equal(g, w)
        if want[2] is None:
            assert got[2] is None
        else:
            assert got[2].dtype == want[2].dtype and got[2].shape == want[2].shape and torch.equal(got[2], want[2])


@pytest.mark.parametrize("seed", range(30))
def test_slot_cache_commit_equals_the_dynamic_cache(seed):
    """The engine's SlotCache (one buffer, in-place appends, one gather for every layer) holds
    the same K/V as transformers' DynamicCache after random forwards and commits."""
    rng = random.Random(seed)
    layers, heads, dim = rng.randint(1, 4), rng.randint(1, 3), rng.choice((2, 8))
    fast, ref = new_cache(layers), new_cache()
    n_cached = 0
    for step in range(rng.randint(1, 12)):
        width = rng.randint(1, 300) if step == 0 else rng.randint(1, 40)  # a prefill, then trees
        for layer in range(layers):
            k, v = torch.randn(1, heads, width, dim), torch.randn(1, heads, width, dim)
            got, want = fast.update(k, v, layer), ref.update(k, v, layer)
            assert all(torch.equal(g, w) for g, w in zip(got, want))
        if step:  # a tree of `width` nodes at n_cached: accept a random increasing set of them
            accepted = sorted(rng.sample(range(1, width), rng.randint(0, width - 1)))
            if rng.random() < 0.5:
                accepted = list(range(1, 1 + len(accepted)))  # already in place
            n_cached = commit_accepted(fast, n_cached, accepted)
            assert commit_accepted(ref, n_cached - 1 - len(accepted), accepted) == n_cached
        else:
            n_cached = width - 1  # everything but a root
            for cache in (fast, ref):
                crop_cache(cache, n_cached)
        assert fast.get_seq_length() == ref.get_seq_length() == n_cached
        for a, b in zip(fast.layers, ref.layers):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


@needs_core
@pytest.mark.parametrize("seed", range(100))
def test_top_tokens_equal_the_reference(seed):
    """The recycling proposer's successors: compiled top-k vs repeated argmax (ties, NaN, -inf
    rows with fewer than k finite entries, k above the vocabulary)."""
    from lookupdec.engine import top_tokens, top_tokens_reference

    rng = random.Random(seed)
    vocab = rng.choice((1, 3, 10, 300, 1031))  # 300, 1031: the compiled scan's blocks of 32 and its tail
    logits = torch.randint(-2, 3, (6, vocab)).float() if rng.random() < 0.5 else torch.randn(6, vocab)
    for _ in range(rng.randint(0, 6)):
        logits[rng.randrange(6), rng.randrange(vocab)] = rng.choice((float("nan"), float("-inf"), float("inf")))
    if rng.random() < 0.2:
        logits[rng.randrange(6)] = float("-inf")
    rows = [rng.randrange(6) for _ in range(rng.randint(0, 6))]
    k = rng.choice((1, 2, 4, 8, vocab + 2))
    assert top_tokens(logits, rows, k) == top_tokens_reference(logits, rows, k)
