"""Prefix reuse across requests (``EngineConfig.prefix_cache``, ``TargetModel.prefill(reuse=True)``):
a prompt that shares its start with the last request's prompt (an instruction, a chat template)
keeps the K/V computed then and prefills only the rest. Outputs stay those of ``transformers``
for every prompt; a weight written since, a prompt sharing too little, or the option off means
a fresh prefill."""
from __future__ import annotations

import random

import pytest
import torch

from conftest import cached_tiny
from helpers import FakeTokenizer, first_difference, hf_greedy
from lookupdec import Engine, EngineConfig
from lookupdec.model.cache import common_prefix
from lookupdec.model.target import PREFIX_MIN
from tiny_models import FAMILIES, tiny_model

SAMPLING = dict(temperature=0.8, top_k=20, top_p=0.9)


def shared_prompts(seed: int, shared: int = 24, count: int = 5) -> list[list[int]]:
    """``count`` prompts opening with the same ``shared`` tokens (an instruction), then their own
    records (repetitive, so drafts are accepted); the last repeats the one before it."""
    rng = random.Random(seed)
    instruction = [rng.randrange(3, 90) for _ in range(shared)]
    prompts = []
    for _ in range(count - 1):
        record = [rng.randrange(3, 90) for _ in range(rng.randrange(4, 9))]
        prompts.append(instruction + record * 3)
    return prompts + [list(prompts[-1])]


def test_common_prefix():
    assert common_prefix([1, 2, 3, 4], [1, 2, 5]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([], [1]) == 0 and common_prefix([7], [8]) == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_reused_prefix_keeps_every_output(family):
    model = cached_tiny(family)
    prompts = shared_prompts(seed=hash(family) % 1000)
    engine = Engine(model, FakeTokenizer(), EngineConfig())
    reused = []
    for i, prompt in enumerate(prompts):
        want = hf_greedy(model, prompt, 20)
        gen = engine.generate(prompt, max_new_tokens=20)
        assert gen.token_ids == want, f"{family} prompt {i}: first difference at {first_difference(gen.token_ids, want)}"
        reused.append(gen.stats.prefix_reused)
    assert reused[0] == 0  # nothing before it
    # the most any earlier prompt shares (the last one's K/V in place, earlier ones' kept copies)
    # (never the prompt's last token: its logits give the first new token, ``RequestCore.first``)
    assert reused[1:-1] == [min(max(common_prefix(a, b) for a in prompts[:i]), len(b) - 1)
                            for i, b in enumerate(prompts[1:-1], start=1)]
    assert all(r >= 24 for r in reused[1:-1]), reused  # the instruction (and any record start it shares)
    assert reused[-1] == len(prompts[-1]) - 1  # the same prompt again: all but its last token


def test_prefix_reuse_matches_a_fresh_prefill_exactly_in_sampling():
    model = cached_tiny("llama")
    prompts = shared_prompts(seed=5)
    on, off = Engine(model, FakeTokenizer()), Engine(model, FakeTokenizer(), EngineConfig(prefix_cache=False))
    for i, prompt in enumerate(prompts):
        a = on.generate(prompt, max_new_tokens=16, seed=40 + i, **SAMPLING)
        b = off.generate(prompt, max_new_tokens=16, seed=40 + i, **SAMPLING)
        assert a.token_ids == b.token_ids
        assert b.stats.prefix_reused == 0
    assert a.stats.prefix_reused > 0


def test_kv_of_a_reused_prefix_is_the_fresh_prefills():
    engine = Engine(cached_tiny("qwen2"), FakeTokenizer())
    target = engine.target
    first, second = list(range(3, 40)), list(range(3, 30)) + [93, 92, 91]
    assert target.prefill(first, reuse=True) == 0
    assert target.prefill(second, reuse=True) == 27
    kept = [v.clone() for v in (target.cache.slot_store.view(0, 0), target.cache.slot_store.view(1, 1))]
    assert target.n_cached == len(second) and kept[0].shape[-2] == len(second)
    assert target.prefill(second) == 0  # reuse off: a fresh cache
    fresh = (target.cache.slot_store.view(0, 0), target.cache.slot_store.view(1, 1))
    for a, b in zip(kept, fresh):
        torch.testing.assert_close(a, b)


def test_too_little_shared_or_weights_written_means_a_fresh_prefill():
    model = tiny_model("llama", tie_word_embeddings=False)  # (its own: a weight is written below)
    engine = Engine(model, FakeTokenizer())
    target = engine.target
    base = list(range(3, 3 + PREFIX_MIN + 8))
    target.prefill(base, reuse=True)
    assert target.prefill(base[: PREFIX_MIN - 1] + [1, 2, 3], reuse=True) == 0  # shares 15 < PREFIX_MIN
    target.prefill(base, reuse=True)
    assert target.prefill(base + [7], reuse=True) == len(base)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(1.5)  # written in place: its K/V are stale
    assert target.prefill(base + [7], reuse=True) == 0
    want = hf_greedy(model, base + [7, 8], 12)
    assert engine.generate(base + [7, 8], max_new_tokens=12).token_ids == want  # (reuses the fresh prefill)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.mul_(0.5)
    gen = engine.generate(base + [7, 9], max_new_tokens=12)
    assert gen.stats.prefix_reused == 0 and gen.token_ids == hf_greedy(model, base + [7, 9], 12)


def batch_reuse(model, prompts, config, *, rows: int, label: str) -> list[int]:
    """``prompts`` through a ``BatchDecoder`` of ``rows`` rows, every output checked against
    ``transformers``; the prompt tokens each reused."""
    from lookupdec.batch import BatchDecoder, BatchRequest

    decoder = BatchDecoder(Engine(model, FakeTokenizer(), config), rows)
    for prompt in prompts:
        decoder.submit(BatchRequest(prompt, 16))
    outs = decoder.run()
    for i, (gen, prompt) in enumerate(zip(outs, prompts)):
        want = hf_greedy(model, prompt, 16)
        assert gen.token_ids == want, f"{label} prompt {i}: first difference at {first_difference(gen.token_ids, want)}"
    return [g.stats.prefix_reused for g in outs]


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen2"])
def test_batch_rows_reuse_a_shared_prefix(family):
    """A batch row joining alone prefills on the last row's one-row cache cut to what their
    contexts share (``BatchTarget.add``): every output is still ``transformers``', rows joining
    as others leave included."""
    model = cached_tiny(family)
    prompts = shared_prompts(seed=11, count=6)
    for config in (EngineConfig(), EngineConfig(prefix_cache=False)):
        reused = batch_reuse(model, prompts, config, rows=2, label=family)
        if config.prefix_cache:
            assert reused[0] == 0 and all(r >= 24 for r in reused[1:]), reused
        else:
            assert not any(reused)


def test_batch_row_kv_with_a_reused_prefix_is_its_own_prefills():
    from lookupdec.model.batch import BatchTarget

    engine = Engine(cached_tiny("llama"), FakeTokenizer())
    contexts = [list(range(3, 40)), list(range(3, 30)) + [80, 81], list(range(3, 30)) + [80, 82, 83], [5] * 10]
    reused, fresh = BatchTarget(engine.target, 4, prefix_cache=True), BatchTarget(engine.target, 4)
    kept = []
    for ids in contexts:
        reused.add(ids)
        fresh.add(ids)
        kept.append(reused.last_reused)
    assert kept == [0, 27, 28, 0] and fresh.last_reused == 0
    for b, n in enumerate(reused.lengths):
        torch.testing.assert_close(reused.store.buffer[:, :, b, :, :n], fresh.store.buffer[:, :, b, :, :n])


# -- earlier prompts kept (EngineConfig.prefix_cache_mb, model/cache.PrefixStore) -------------------

def interleaved_prompts(seed: int) -> list[list[int]]:
    """Two clients taking turns (a, b, a', b', a''), each resending its own long file with a new
    ending: a prompt shares its file with the one before the last, only a short opening with the
    last."""
    rng = random.Random(seed)
    opening = [rng.randrange(3, 90) for _ in range(4)]
    files = [opening + [rng.randrange(3, 90) for _ in range(40)] for _ in range(2)]
    prompts = []
    for turn in range(5):
        record = [rng.randrange(3, 90) for _ in range(rng.randrange(3, 7))]
        prompts.append(files[turn % 2] + record * 2)
    return prompts


@pytest.mark.parametrize("family", FAMILIES)
def test_interleaved_clients_start_from_their_own_earlier_prompt(family):
    model = cached_tiny(family)
    prompts = interleaved_prompts(seed=hash(family) % 1000)
    for mb in (256.0, 0.0):
        engine = Engine(model, FakeTokenizer(), EngineConfig(prefix_cache_mb=mb))
        reused = []
        for i, prompt in enumerate(prompts):
            gen = engine.generate(prompt, max_new_tokens=16)
            want = hf_greedy(model, prompt, 16)
            assert gen.token_ids == want, f"{family} {mb} MiB, prompt {i}: first difference at {first_difference(gen.token_ids, want)}"
            reused.append(gen.stats.prefix_reused)
        ctx = [p[:-1] for p in prompts]
        if mb:  # the most any earlier prompt shares: its own file (44 tokens or more)
            assert reused == [0, 0] + [max(common_prefix(a, b) for a in ctx[:i]) for i, b in enumerate(ctx[2:], start=2)]
            assert all(r >= 44 for r in reused[2:]), reused
            assert engine.target.prefixes.hits == 3
        else:  # the last prompt only: the 4-token opening, too short to keep
            assert reused == [0] * 5 and engine.target.prefixes.entries == []


def test_kv_restored_from_an_earlier_prompt_is_a_fresh_prefills():
    engine = Engine(cached_tiny("qwen2"), FakeTokenizer())
    target = engine.target
    a, b = list(range(3, 50)), [2] + list(range(60, 90))
    target.prefill(a, reuse=True)
    target.prefill(b, reuse=True)
    again = a[:40] + [91, 92]
    assert target.prefill(again, reuse=True) == 40  # from a's copy (b shares nothing)
    kept = [target.cache.slot_store.view(layer, kind).clone() for layer in (0, 1) for kind in (0, 1)]
    assert target.prefill(again) == 0
    for k, (layer, kind) in zip(kept, [(0, 0), (0, 1), (1, 0), (1, 1)]):
        torch.testing.assert_close(k, target.cache.slot_store.view(layer, kind))


def test_prefix_copy_and_restore_match_their_references():
    """``SlotStore.copy_prefix``/``load`` (one copy of every layer) against each layer's K and V
    stacked and restored one layer at a time (their definitions, ``reference.model.copy_prefix`` and
    ``reference.model.restore``, which ``PrefixStore`` takes for a cache without the slot buffer):
    the same values, bit for bit, also restored into a plain ``DynamicCache``."""
    from lookupdec.model.cache import PrefixStore, new_cache
    from lookupdec.reference import model as reference_model

    engine = Engine(cached_tiny("qwen2"), FakeTokenizer())
    target = engine.target
    target.prefill(list(range(3, 60)))
    store = target.cache.slot_store
    fast, reference = store.copy_prefix(41), reference_model.copy_prefix(target.cache, 41)
    assert fast.shape == reference.shape and torch.equal(fast, reference)
    with pytest.raises(ValueError, match="fewer slots"):
        store.copy_prefix(58)
    slots, plain = new_cache(target._num_layers), new_cache()
    prefixes = PrefixStore(1 << 30)
    prefixes.entries = [(list(range(3, 44)), (), fast)]
    prefixes.restore(0, 30, plain)  # (no slot store: each layer's update)

    def refused(*args):
        raise AssertionError("a slot cache took the per-layer path")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(reference_model, "restore", refused)
        prefixes.restore(0, 30, slots)  # one copy into the slot buffer
        assert slots.get_seq_length() == plain.get_seq_length() == 30 and prefixes.hits == 2
        for layer in range(target._num_layers):
            assert slots.layers[layer].is_initialized and slots.layers[layer].dtype == fast.dtype
            assert torch.equal(slots.layers[layer].keys, plain.layers[layer].keys)
            assert torch.equal(slots.layers[layer].values, reference[layer, 1, :, :, :30])
        with pytest.raises(ValueError, match="not empty"):
            slots.slot_store.load(fast, 10)
        buffer = slots.slot_store.buffer
        slots.slot_store.crop(0)
        prefixes.restore(0, 20, slots)  # an emptied store keeps its buffer where it holds the slots
        assert slots.slot_store.buffer is buffer and slots.get_seq_length() == 20
        assert torch.equal(slots.layers[1].keys, reference[1, 0, :, :, :20])


@pytest.mark.parametrize("reuse", [True, False])
def test_a_new_prompt_fills_the_buffer_already_there(reuse):
    """A prompt sharing nothing, or starting from a kept copy, is written into the buffer the last
    prompt used (emptied), not a new one; outputs stay transformers' either way."""
    model = cached_tiny("llama")
    engine = Engine(model, FakeTokenizer(), EngineConfig(prefix_cache=reuse))
    a, b = list(range(3, 50)), [2] + list(range(60, 90))
    engine.generate(a, max_new_tokens=4)
    buffer = engine.target.cache.slot_store.buffer
    for prompt in (b, a[:40] + [91, 92]):  # nothing shared; then (with reuse) a's kept copy
        gen = engine.generate(prompt, max_new_tokens=8)
        assert engine.target.cache.slot_store.buffer is buffer
        assert gen.token_ids == hf_greedy(model, prompt, 8)
    assert gen.stats.prefix_reused == (40 if reuse else 0)


def test_prefix_store_bounds_and_replaces_entries():
    from lookupdec.model.cache import PrefixStore

    engine = Engine(cached_tiny("llama"), FakeTokenizer(), EngineConfig(prefix_cache_mb=0))
    target = engine.target
    target.prefill(list(range(3, 23)), reuse=True)  # (the store is off: 0 MiB)
    assert target.prefixes.entries == []
    per_token = sum(2 * v.numel() * v.element_size() for v in (layer.keys[:, :, :1] for layer in target.cache.layers))
    store = target.prefixes = PrefixStore(per_token * 50, PREFIX_MIN)
    weights = target._weights_state()
    target.prefill(list(range(3, 23)), reuse=True)  # 20 tokens
    target.prefill(list(range(3, 28)), reuse=True)  # extends it: replaces it
    assert [len(t) for t, _, _ in store.entries] == [25]
    target.prefill(list(range(3, 18)) + [1], reuse=True)  # shares 15 with the 25: kept beside it
    target.prefill(list(range(3, 24)), reuse=True)  # 21 tokens, held by the 25-token entry: no copy
    assert [len(t) for t, _, _ in store.entries] == [16, 25]
    target.prefill([2] * 30, reuse=True)  # 16 + 25 + 30 > 50 tokens: the least recently used go first
    assert [len(t) for t, _, _ in store.entries] == [30]
    assert store.bytes == 30 * per_token
    target.prefill([2] * 60, reuse=True)  # larger than the whole store: not kept (the 30 it extends dropped)
    assert store.entries == []
    target.prefill([2] * 20, reuse=True)
    assert store.find([2] * 25, weights) == (0, 20) and store.find([2] * 25, ("other",)) == (-1, 0)
    assert store.find([2] * 10, weights) == (-1, 0)  # shares fewer than PREFIX_MIN


def test_prefix_store_forgets_prompts_of_other_weights():
    model = tiny_model("llama", tie_word_embeddings=False)  # (its own: a weight is written below)
    engine = Engine(model, FakeTokenizer())
    a, b = list(range(3, 40)), [2] + list(range(50, 80))
    engine.target.prefill(a, reuse=True)
    engine.target.prefill(b, reuse=True)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(1.5)
    gen = engine.generate(a + [7, 8], max_new_tokens=12)
    assert gen.stats.prefix_reused == 0 and gen.token_ids == hf_greedy(model, a + [7, 8], 12)
    assert len(engine.target.prefixes.entries) == 1  # the two of the old weights dropped


def test_batch_rows_start_from_earlier_prompts():
    # one row: every prompt joins alone
    reused = batch_reuse(cached_tiny("llama"), interleaved_prompts(seed=3), EngineConfig(), rows=1, label="llama")
    assert reused[:2] == [0, 0] and all(r >= 44 for r in reused[2:]), reused


def test_prefix_cache_mb_is_checked():
    with pytest.raises(ValueError, match="prefix_cache_mb"):
        EngineConfig(prefix_cache_mb=-1)
