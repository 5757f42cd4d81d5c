"""The target's forwards (``model/target.py``, ``TargetModel``) against their definitions:

- one tree forward over a 4D mask == each root-to-node path run through the model on its own;
- KV commit (gather the accepted nodes into contiguous slots, crop the rest) == a fresh prefill of
  the committed tokens == feeding those tokens one at a time; and the next logits agree;
- ``tree_inputs`` (and into the engine's kept ``InputBuffers``) == ``reference.model.tree_inputs``
  (ids, positions, additive 4D masks);
- ``verify(rows=...)`` (partial logits: only the likely nodes projected) gives the full forward's
  rows, and models that change their logits after the output projection never take that path.

Float32 throughout; mistral's prefixes cross its sliding window of 24.
"""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import transformers

from conftest import cached_tiny
from lookupdec.model import TargetModel, tree_inputs
from lookupdec.model.kernels import _bucket
from lookupdec.reference import model as reference_model
from lookupdec.reference import request as reference_request
from lookupdec.sampling import PartialLogits
from lookupdec.tree import TokenTree
from random_inputs import random_scored_tree, random_trie
from tiny_models import FAMILIES, VOCAB, tiny_model

ATOL = 1e-4  # float32 logits of a tree forward vs separate runs (observed ~1e-6)
KV_ATOL = 1e-5  # float32 K/V after commit vs a fresh prefill


def random_tree(rng: random.Random, root: int, size: int, max_depth: int) -> TokenTree:
    """A random trie: each node hangs under a random earlier node (depth capped)."""
    token_ids, parents, depth = [root], [-1], [0]
    while len(token_ids) < size + 1:
        parent = rng.randrange(len(token_ids))
        if depth[parent] >= max_depth:
            continue
        taken = {token_ids[i] for i in range(1, len(token_ids)) if parents[i] == parent}
        token = rng.randrange(VOCAB)
        if token in taken:
            continue
        token_ids.append(token)
        parents.append(parent)
        depth.append(depth[parent] + 1)
    return TokenTree(token_ids=token_ids, parents=parents)


@torch.inference_mode()
def path_logits(model, prefix: list[int], tree: TokenTree) -> torch.Tensor:
    """Reference: row i = last logits of a plain forward over prefix + path to node i.  [1+n, V]
    (``prefix`` ends with the root token)."""
    rows = []
    for node in range(len(tree)):
        ids = prefix + [tree.token_ids[i] for i in tree.path_to(node)]
        rows.append(model(input_ids=torch.tensor([ids])).logits[0, -1].float())
    return torch.stack(rows)


def prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(length)]


# prefix lengths: mistral's sliding window is 24, so 40 puts the window's edge inside the prefix
CASES = [(family, 9) for family in FAMILIES] + [(family, 40) for family in ("mistral", "llama", "gpt2")]


@pytest.mark.parametrize("family,prefix_len", CASES)
def test_tree_forward_equals_one_path_at_a_time(family, prefix_len):
    model = cached_tiny(family)
    target = TargetModel(model, verify="tree")
    rng = random.Random(prefix_len * 31 + len(family))
    for trial in range(3):
        prefix = prompt(rng, prefix_len)
        tree = random_tree(rng, prefix[-1], size=rng.randint(1, 14), max_depth=rng.randint(1, 6))
        target.prefill(prefix[:-1])
        got = target.verify(tree)
        want = path_logits(model, prefix, tree)
        assert got.shape == (len(tree), VOCAB) and got.dtype == torch.float32
        err = (got - want).abs().max().item()
        assert err < ATOL, f"{family} trial {trial}: tree logits differ from path logits by {err:.2e}"


def test_sliding_window_matters_here():
    """Power check for the test above: mistral's logits at these lengths do depend on its window,
    so a tree mask that forgot the window would fail it."""
    rng = random.Random(5)
    ids = torch.tensor([prompt(rng, 40)])
    windowed = cached_tiny("mistral")
    unwindowed = tiny_model("mistral", tie_word_embeddings=False)
    unwindowed.config.sliding_window = None
    with torch.inference_mode():
        diff = (windowed(input_ids=ids).logits[0, -1] - unwindowed(input_ids=ids).logits[0, -1]).abs().max()
    assert diff > 100 * ATOL


def cache_kv(target: TargetModel) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in target.cache.layers]


def assert_same_cache(got: TargetModel, want: TargetModel, what: str) -> None:
    assert got.n_cached == want.n_cached, what
    for i, ((k, v), (k_ref, v_ref)) in enumerate(zip(cache_kv(got), cache_kv(want), strict=True)):
        assert k.shape == k_ref.shape and k.shape[2] == want.n_cached, f"{what}: layer {i}: {k.shape} vs {k_ref.shape}"
        assert torch.allclose(k, k_ref, atol=KV_ATOL), f"{what}: layer {i} keys off by {(k - k_ref).abs().max():.2e}"
        assert torch.allclose(v, v_ref, atol=KV_ATOL), f"{what}: layer {i} values off by {(v - v_ref).abs().max():.2e}"


def one_by_one(model, tokens: list[int]) -> TargetModel:
    """Reference: prefill the first token, then verify single-node trees, committing each."""
    target = TargetModel(model, verify="tree")
    target.prefill(tokens[:1])
    for tok in tokens[1:]:
        tree = TokenTree(token_ids=[tok], parents=[-1])
        target.verify(tree)
        target.commit(tree, [])
    return target


@pytest.mark.parametrize("family", FAMILIES)
def test_kv_commit_equals_feeding_accepted_tokens(family):
    """Several steps of random trees with a random accepted path each (often a later branch, so
    slots are gathered); then the cache must equal a fresh prefill of everything committed and a
    one-token-at-a-time run, and the next logits must agree with a plain forward."""
    model = cached_tiny(family)
    rng = random.Random(sum(map(ord, family)))
    target = TargetModel(model, verify="tree")
    committed = prompt(rng, 20 if family != "mistral" else 30)
    target.prefill(committed[:-1])
    gathered = 0
    for step in range(5):
        tree = random_tree(rng, committed[-1], size=rng.randint(1, 12), max_depth=4)
        target.verify(tree)
        node = rng.randrange(len(tree))  # the last accepted node (0: every draft rejected)
        accepted = tree.path_to(node)
        gathered += accepted != list(range(1, len(accepted) + 1))
        target.commit(tree, accepted)  # called as the engine calls it (no inference_mode here)
        bonus = rng.randrange(3, VOCAB)
        committed = committed + [tree.token_ids[i] for i in accepted] + [bonus]
        assert target.n_cached == len(committed) - 1, f"step {step}: the bonus token is the new root"
    assert gathered, "no step needed a gather: pick another seed"

    fresh = TargetModel(model, verify="tree")
    fresh.prefill(committed[:-1])
    assert_same_cache(target, fresh, f"{family}: commit vs fresh prefill")
    assert_same_cache(target, one_by_one(model, committed[:-1]), f"{family}: commit vs one by one")

    last = TokenTree(token_ids=[committed[-1]], parents=[-1])
    with torch.inference_mode():
        want = model(input_ids=torch.tensor([committed])).logits[0, -1].float()
    err = (target.verify(last)[0] - want).abs().max().item()
    assert err < ATOL, f"{family}: next logits after commits differ by {err:.2e}"


def test_commit_nothing_accepted_drops_the_whole_tree():
    model = cached_tiny("llama")
    target = TargetModel(model, verify="tree")
    target.prefill([5, 6, 7])
    tree = TokenTree(token_ids=[8, 9, 10, 11], parents=[-1, 0, 0, 2])
    target.verify(tree)
    assert target.n_cached == 3 + 4
    target.commit(tree, [])
    assert target.n_cached == 4  # prefix + root
    assert all(k.shape[2] == 4 and v.shape[2] == 4 for k, v in cache_kv(target))
    fresh = TargetModel(model, verify="tree")
    fresh.prefill([5, 6, 7, 8])
    assert_same_cache(target, fresh, "nothing accepted")


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_prefill_resets_between_requests(family):
    """A second prefill starts from an empty cache (no K/V left from the previous request)."""
    model = cached_tiny(family)
    target = TargetModel(model, verify="tree")
    target.prefill(list(range(3, 40)))
    target.verify(TokenTree(token_ids=[4, 5], parents=[-1, 0]))
    target.prefill([7, 8, 9])
    fresh = TargetModel(model, verify="tree")
    fresh.prefill([7, 8, 9])
    assert_same_cache(target, fresh, "second prefill")


# -- the verify forward's inputs ---------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(60))
def test_tree_inputs_equal_the_reference(seed):
    rng = random.Random(seed)
    tree = random_trie(rng, rng.randint(0, 40), rng.choice((2, 5, 100)))
    n_cached = rng.choice((0, 1, 7, 300))
    dtype = rng.choice((torch.float32, torch.float16, torch.bfloat16, torch.float64))
    windows = rng.choice(({}, {None: 4}, {"full_attention": None, "sliding_attention": 3}))
    tree_mode = rng.random() < 0.9
    got = tree_inputs(tree, n_cached, device="cpu", dtype=dtype, windows=windows, tree_mode=tree_mode)
    want = reference_model.tree_inputs(tree, n_cached, device="cpu", dtype=dtype, windows=windows, tree_mode=tree_mode)
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
    contexts and dtypes what ``reference.model.tree_inputs`` builds from nothing; each step's views are
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
        want = reference_model.tree_inputs(tree, n_cached, device="cpu", dtype=dtype)
        for g, w in zip(got[:2], want[:2]):
            assert g.dtype == w.dtype and torch.equal(g, w)
        if want[2] is None:
            assert got[2] is None
        else:
            assert got[2].dtype == want[2].dtype and got[2].shape == want[2].shape and torch.equal(got[2], want[2])


# -- partial logits: verify(rows=...) ---------------------------------------------------------------
@pytest.mark.parametrize("family", ["llama", "phi", "gpt2"])
def test_verify_rows_gives_the_full_forward_rows(family):
    model = cached_tiny(family)
    target = TargetModel(model, verify="tree")
    assert target.partial_head
    rng = np.random.default_rng(1)
    tree = random_scored_tree(rng, 20)
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
        assert every.tops.tolist() == reference_request.top_tokens(every.logits, range(len(tree)), 4)
    if target.fast_head is not None and "skinny" in target.fast_head.forms:  # the head picks as it writes
        key = (3, torch.get_num_threads())
        # (the head is the model's, shared with earlier tests that timed this bucket: with a best
        # time on record a check of another form may fall due on this call; without one, none does)
        target.fast_head.choice[key] = "skinny"
        target.fast_head._chooser._best.pop(key, None)
        target.prefill(prompt)
        picked = target.verify(tree, rows, picks=4)
        torch.testing.assert_close(picked.logits, full[rows], rtol=1e-5, atol=1e-5)
        assert picked.tops.tolist() == reference_request.top_tokens(picked.logits, range(3), 4)


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
