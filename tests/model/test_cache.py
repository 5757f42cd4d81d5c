"""The K/V layout (``model/cache.py``): the engine's ``SlotCache`` (one buffer, in-place appends,
one gather for every layer) against ``transformers``' ``DynamicCache`` through random forwards and
KV commits. The model-level checks of a commit are in ``test_target.py``, the prefix store's in
``test_cache_prefix.py``, the batch store's in the top-level ``test_batch.py``."""
from __future__ import annotations

import random

import pytest
import torch

from lookupdec.model import commit_accepted, crop_cache, new_cache


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
