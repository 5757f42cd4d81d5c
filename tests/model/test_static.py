"""The static verify forward (``lookupdec/model/static.py``): the same tokens as transformers,
a tree's logits as the model's own forward with the tree mask makes them, padding that changes
nothing, and one graph under ``torch.compile(fullgraph=True)``."""
from __future__ import annotations

import random

import pytest
import torch

from conftest import cached_references, cached_tiny, load_stories
from lookupdec.model.static import (SIZES, StaticForward, context_bucket, greedy_static, padded_size,
                                    tree_inputs_static)

FAMILIES = ("llama", "qwen2")  # the llama-shaped families without a sliding window


def test_sizes_and_buckets():
    assert [padded_size(n) for n in (1, 2, 3, 5, 64, 65, 130)] == [1, 2, 4, 8, 64, 128, 192]
    assert SIZES[0] == 1 and list(SIZES) == sorted(SIZES)
    assert context_bucket(1, 4096) == 256 and context_bucket(257, 4096) == 512 and context_bucket(9000, 4096) == 4096


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_transformers_on_tiny_families(family):
    model = cached_tiny(family)
    static = StaticForward(model, 512)
    for prompt, n, want in cached_references(family):
        got = greedy_static(static, static, prompt, n, eos=model.config.eos_token_id)
        assert got == want, (prompt, got, want)


def test_greedy_equals_transformers_on_stories260k():
    model, _tokenizer = load_stories()
    prompt = [1, 400, 37, 99, 250, 12, 7]
    with torch.inference_mode():
        want = model.generate(torch.tensor([prompt]), max_new_tokens=60, do_sample=False,
                              eos_token_id=None)[0, len(prompt):].tolist()
    static = StaticForward(model, 512)
    assert greedy_static(static, static, prompt, 60, eos=None) == want


@pytest.mark.parametrize("seed", range(6))
def test_tree_logits_equal_the_models_forward_with_the_tree_mask(seed):
    """A random tree after a prompt, padded to the next size: each real node's logits equal the
    model's own forward over the same tokens with the tree's 4D mask (float32 rounding); the
    padding nodes change none of them and what they write is past every real slot."""
    from lookupdec.model import new_cache, tree_inputs
    from lookupdec.tree import TokenTree

    rng = random.Random(seed)
    model = cached_tiny(FAMILIES[seed % 2])
    vocab = model.config.vocab_size
    prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(3, 40))]
    n = rng.randint(1, 20)
    parents = [-1] + [rng.randrange(i) for i in range(1, n)]
    tokens = [rng.randrange(3, vocab)]
    for i in range(1, n):  # siblings hold different tokens (a trie)
        taken = {tokens[j] for j in range(1, i) if parents[j] == parents[i]}
        tokens.append(rng.choice([t for t in range(3, vocab) if t not in taken]))
    tree = TokenTree(token_ids=tokens, parents=parents)
    with torch.inference_mode():
        cache = new_cache()
        model(input_ids=torch.tensor([prompt]), past_key_values=cache, use_cache=True)
        ids, positions, mask = tree_inputs(tree, len(prompt), device="cpu", dtype=torch.float32)
        want = model(input_ids=ids, position_ids=positions, attention_mask=mask, past_key_values=cache,
                     use_cache=True).logits[0]
        static = StaticForward(model, 256)
        static.prefill(prompt)
        size = padded_size(n)
        got = static(*tree_inputs_static(tokens, parents, len(prompt), size, context_bucket(len(prompt) + size, 256)))
    assert got.shape == (size, vocab)
    torch.testing.assert_close(got[:n], want, rtol=1e-4, atol=1e-4)


def test_inputs_refuse_what_does_not_fit():
    with pytest.raises(ValueError, match="do not fit"):
        tree_inputs_static([1, 2, 3], [-1, 0, 1], 0, 2, 8)
    with pytest.raises(ValueError, match="do not fit"):
        tree_inputs_static([1], [-1], 8, 1, 8)


def test_refuses_other_families():
    with pytest.raises(ValueError, match="llama-shaped"):
        StaticForward(cached_tiny("gpt2"), 64)
    with pytest.raises(ValueError, match="sliding-window"):
        StaticForward(cached_tiny("mistral"), 64)


def test_compiles_as_one_graph_and_decodes_the_same_tokens():
    """``torch.compile(fullgraph=True)`` traces the whole forward (a graph break raises), once
    per (size, context) shape, and decodes transformers' tokens."""
    model = cached_tiny("llama")
    prompt, n, want = cached_references("llama")[0]
    static = StaticForward(model, 256)
    torch._dynamo.reset()
    compiled = torch.compile(static, fullgraph=True, dynamic=False)
    got = greedy_static(compiled, static, prompt, n, eos=model.config.eos_token_id)
    assert got == want
