"""The fast paths of ``lookupdec.model`` against their reference paths:

- one tree forward over a 4D mask == each root-to-node path run through the model on its own;
- KV commit (gather the accepted nodes into contiguous slots, crop the rest) == a fresh prefill of
  the committed tokens == feeding those tokens one at a time; and the next logits agree.

Float32 throughout; mistral's prefixes cross its sliding window of 24.
"""
from __future__ import annotations

import random

import pytest
import torch

from conftest import cached_tiny
from lookupdec.model import TargetModel
from lookupdec.tree import TokenTree
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
