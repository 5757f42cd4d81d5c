"""``model/lean.py``: a llama-shaped decoder layer run as one function gives its own forward's
outputs and cache bit for bit, inside the engine's forwards only; other families, hooked layers
and layers whose probe fails keep their own forward; the engine's output stays transformers'."""
from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from conftest import cached_tiny
from helpers import FakeTokenizer, greedy_alone_and_batched
from lookupdec import Engine, EngineConfig
from lookupdec.model import lean
from lookupdec.model.kernels import swapped
from tiny_models import FAMILIES, tiny_model

LEAN_FAMILIES = ("llama", "mistral", "qwen2")


@pytest.mark.parametrize("family", FAMILIES)
def test_which_families_take_the_lean_layers(family):
    model = cached_tiny(family)
    layers = lean.lean_layers_for(model)
    if family in LEAN_FAMILIES:
        assert [layer for layer, _ in layers] == list(model.get_decoder().layers)
    else:
        assert layers == []
    assert lean.lean_layers_for(model) is layers  # shared per model
    target = Engine(model, FakeTokenizer(), EngineConfig()).target  # the cost and form caches' keys name them
    assert ("lean" in target.kernels.split("+")) == (family in LEAN_FAMILIES)


def _forward(model, ids, mask, layers):
    """``model``'s logits for ``ids`` [B, T] after 5 cached tokens per row, with ``mask`` [B, 1,
    T, 5 + T], inside ``swapped`` with ``layers`` (None: each layer's own forward), and the cache."""
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=torch.arange(3, 8).repeat(ids.shape[0], 1), past_key_values=cache, use_cache=True)
        positions = torch.arange(5, 5 + ids.shape[1]).repeat(ids.shape[0], 1)
        with swapped(model, None, layers=layers):
            out = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                        use_cache=True).logits
    return out, cache


@pytest.mark.parametrize("family", LEAN_FAMILIES)
def test_the_lean_layers_compute_the_model_bit_for_bit(family):
    """A tree-like forward (2 rows of 4 tokens, a mask with holes, after a cached prefix): the
    logits and every layer's cached K/V equal the layers' own to the bit, and the lean forwards
    are set on the layers inside the block only."""
    model = cached_tiny(family)
    layers = lean.lean_layers_for(model)
    ids = torch.tensor([[9, 10, 11, 12], [20, 21, 22, 23]])
    mask = torch.zeros(2, 1, 4, 9)
    mask[:, :, :, 5:] = torch.finfo(torch.float32).min
    for row, parents in enumerate(([-1, 0, 0, 2], [-1, 0, 1, 2])):  # each token sees its ancestors
        for t in range(4):
            p = t
            while p >= 0:
                mask[row, 0, t, 5 + p] = 0.0
                p = parents[p]
    mask[1, 0, :, 1] = torch.finfo(torch.float32).min  # a hole in the prefix of row 1
    want, want_cache = _forward(model, ids, mask, None)
    seen = []
    originals = {id(layer): forward for layer, forward in layers}

    def spy(layer):
        def forward(*args, **kwargs):
            seen.append(layer)
            return originals[id(layer)](*args, **kwargs)
        return forward

    got, got_cache = _forward(model, ids, mask, [(layer, spy(layer)) for layer, _ in layers])
    assert torch.equal(got, want)
    for a, b in zip(got_cache.layers, want_cache.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    assert seen == [layer for layer, _ in layers]
    assert all("forward" not in layer.__dict__ for layer, _ in layers)


def test_a_layer_whose_probe_fails_keeps_its_own_forward(monkeypatch):
    """A lean forward that differs from the layer's own in the last bit fails the probe; a layer
    with a hook on one of its parts is not probed at all; one that raises keeps its own."""
    model = tiny_model("llama", seed=3)
    layer = model.get_decoder().layers[0]
    forward = lean.lean_forward(layer, None)
    assert lean._probe(model, layer, forward)
    assert not lean._probe(model, layer, lambda *a, **k: forward(*a, **k) * (1 + 2 ** -20))
    handle = model.get_decoder().layers[1].self_attn.k_proj.register_forward_hook(lambda *a: None)
    found = lean.lean_layers_for(model)
    assert [layer for layer, _ in found] == [model.get_decoder().layers[0]]
    handle.remove()
    other = tiny_model("qwen2", seed=3)
    monkeypatch.setattr(lean, "_probe", lambda *a: 1 / 0)
    assert lean.lean_layers_for(other) == []


def test_the_lean_forward_hands_what_it_does_not_repeat_to_the_layer():
    """With autograd on, the layer's own forward runs (gradients flow as they would)."""
    model = tiny_model("llama", seed=4)
    layer = model.get_decoder().layers[0]
    forward = lean.lean_forward(layer, None)
    rows = torch.randn(1, 2, model.config.hidden_size, requires_grad=True)
    embeddings = model.get_decoder().rotary_emb(rows, torch.arange(2)[None])
    out = forward(rows, position_embeddings=embeddings)
    out = out[0] if isinstance(out, tuple) else out
    out.sum().backward()
    assert rows.grad is not None


@pytest.mark.parametrize("family", LEAN_FAMILIES)
def test_the_engine_with_lean_layers_stays_transformers_greedy(family):
    """Alone (past mistral's sliding window) and batched (``BatchDecoder``), the engine's output
    with the lean layers is ``transformers``' greedy, and the lean layers ran."""
    model = cached_tiny(family)
    engine = Engine(model, FakeTokenizer(), EngineConfig(budget="fixed", max_nodes=8))
    assert engine.target.layers == lean.lean_layers_for(model) != []
    layer, forward = engine.target.layers[-1]
    calls = [0]

    def counted(*args, **kwargs):
        calls[0] += 1
        return forward(*args, **kwargs)

    engine.target.layers = [*engine.target.layers[:-1], (layer, counted)]
    prompts = [[5, 6, 7, 5, 6, 8, 5, 6, 9, 5, 6], [11, 12, 13, 11, 12, 14, 11, 12]]
    # (mistral's 24-token sliding window: passed alone; batches take no windows)
    greedy_alone_and_batched(engine, model, prompts, calls, tokens=24, batched=not engine.target._windows)
