"""``model/head.py``: the output projection's three product forms give the same logits (float
rounding apart), the fastest is chosen once per row count outside any timing, the swap is
confined to the block, and the engine's output is unchanged with the kernels on or off."""
from __future__ import annotations

import os

import pytest
import torch

from conftest import cached_tiny
from helpers import FakeTokenizer
from lookupdec import Engine, EngineConfig
from lookupdec.model.head import FORMS, GQA_SWITCH, FastHead, fast_head_for, swapped


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 17, 40])
def test_every_form_computes_the_projection(rows):
    head = torch.nn.Linear(24, 300, bias=False)
    fast = FastHead(head)
    x = torch.randn(1, rows, 24)
    want = head(x)
    for form in FORMS:
        got = fast._form(form, x.reshape(-1, 24)).reshape(1, rows, 300)
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), form
    assert torch.allclose(fast(x), want, rtol=1e-5, atol=1e-5)
    assert fast.choice and set(fast.choice.values()) <= set(FORMS)
    assert fast.prepare(rows) == 0.0  # chosen once


def test_swap_is_confined_to_the_block_and_shared_per_model():
    model = cached_tiny("llama")
    head = model.get_output_embeddings()
    fast = fast_head_for(model)
    assert fast is not None and fast_head_for(model) is fast  # one per head: forms timed once
    before = os.environ.get(GQA_SWITCH)
    with swapped(model, fast, gqa=True):
        assert model.get_output_embeddings() is fast and os.environ[GQA_SWITCH] == "1"
    assert model.get_output_embeddings() is head and os.environ.get(GQA_SWITCH) == before
    with pytest.raises(RuntimeError):
        with swapped(model, fast, gqa=True):
            raise RuntimeError("a failing forward")
    assert model.get_output_embeddings() is head and os.environ.get(GQA_SWITCH) == before


def test_engine_output_is_the_same_with_kernels_on_and_off():
    model = cached_tiny("qwen2")  # grouped K/V heads
    prompt = [5, 6, 7, 5, 6, 7, 5, 6, 9, 10]
    on = Engine(model, FakeTokenizer(), EngineConfig(fast_kernels=True)).generate(prompt, max_new_tokens=40)
    off = Engine(model, FakeTokenizer(), EngineConfig(fast_kernels=False)).generate(prompt, max_new_tokens=40)
    assert on.token_ids == off.token_ids
