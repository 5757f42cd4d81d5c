"""The compiled decoder forward (``lookupdec/model/native_forward.py``, ``csrc/kernels/forward.hpp``):
a tree's hidden states and K/V as the model's own forward with the tree mask makes them, greedy
decoding through it equal to transformers', weights changed between requests followed, and the
models it does not take left to the eager forward."""
from __future__ import annotations

import random

import pytest
import torch
import transformers

from helpers import FakeTokenizer, greedy_alone_and_batched, hf_greedy
from lookupdec import Engine, EngineConfig
from lookupdec.model import native_forward
from lookupdec.model.native_forward import native_forward_for
from lookupdec.native import kernels as native_kernels

pytestmark = pytest.mark.skipif(native_kernels is None, reason="compiled core not built")


def head16(family: str, seed: int = 0, **extra):
    """A tiny llama-shaped model whose head size the kernel takes (16), grouped K/V heads."""
    torch.manual_seed(seed)
    config_class = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[family]
    config = config_class(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=96, max_position_embeddings=512, bos_token_id=1,
                          eos_token_id=2, pad_token_id=0, tie_word_embeddings=False, **extra)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)  # clear argmaxes
        for layer in model.model.layers:  # qwen2's q/k/v biases not zero
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                if proj.bias is not None:
                    proj.bias.normal_(0, 0.5)
    return model


def engine_of(model, **config) -> Engine:
    engine = Engine(model, FakeTokenizer(), EngineConfig(**config))
    assert engine.target.native is not None
    return engine


@pytest.mark.parametrize("seed", range(6))
def test_tree_hidden_states_and_kv_equal_the_models_forward_with_the_tree_mask(seed):
    from lookupdec.model import tree_inputs
    from lookupdec.tree import TokenTree

    rng = random.Random(seed)
    model = head16(("llama", "qwen2")[seed % 2], seed)
    engine = engine_of(model)
    target = engine.target
    vocab = model.config.vocab_size
    prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(3, 60))]
    n = rng.randint(1, 24)
    parents = [-1] + [rng.randrange(i) for i in range(1, n)]
    tokens = [rng.randrange(3, vocab)]
    for i in range(1, n):  # siblings hold different tokens (a trie)
        taken = {tokens[j] for j in range(1, i) if parents[j] == parents[i]}
        tokens.append(rng.choice([t for t in range(3, vocab) if t not in taken]))
    tree = TokenTree(token_ids=tokens, parents=parents)
    target.prefill(prompt)
    before = target.n_cached
    calls = native_forward.CALLS[0]
    got = target.verify(tree)  # logits [n, vocab] through the compiled decoder
    assert native_forward.CALLS[0] == calls + 1 and target.n_cached == before + n
    kv = target.cache.slot_store.buffer[:, :, 0, :, : before + n].clone()
    with torch.inference_mode():
        cache = transformers.DynamicCache()
        model(input_ids=torch.tensor([prompt]), past_key_values=cache, use_cache=True)
        ids, positions, mask = tree_inputs(tree, len(prompt), device=torch.device("cpu"), dtype=torch.float32)
        if mask is None:  # a chain: the model's own causal mask
            mask = torch.full((1, 1, n, len(prompt) + n), 0.0)
            mask[0, 0, :, len(prompt):] = torch.full((n, n), torch.finfo(torch.float32).min).triu(1)
        want = model(input_ids=ids, position_ids=positions, attention_mask=mask, past_key_values=cache,
                     use_cache=True).logits[0]
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4), (got - want).abs().max()
    for layer in range(model.config.num_hidden_layers):
        for kind, held in enumerate((cache.layers[layer].keys, cache.layers[layer].values)):
            assert torch.allclose(kv[layer, kind], held[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("budget", ["auto", "fixed"])
def test_greedy_through_the_compiled_decoder_equals_transformers(family, budget):
    model = head16(family, 7)
    engine = engine_of(model, budget=budget, max_nodes=16)
    prompts = [[5, 6, 7, 5, 6, 8, 5, 6, 9, 5, 6], [11, 12, 13, 11, 12, 14, 11, 12, 13], [20, 21, 22, 20, 21, 23, 20]]
    greedy_alone_and_batched(engine, model, prompts, native_forward.CALLS, tokens=40, batched=False)
    for prompt in prompts[1:]:
        assert engine.generate(prompt, max_new_tokens=40).token_ids == hf_greedy(model, prompt, 40)


def test_weights_changed_between_requests_are_followed():
    """A weight written in place (panels packed again) and a norm weight replaced by a new tensor
    (its address taken again): the next request decodes the changed model."""
    model = head16("llama", 3)
    engine = engine_of(model)
    prompt = [5, 6, 7, 5, 6, 8, 5, 6, 9]
    assert engine.generate(prompt, max_new_tokens=30).token_ids == hf_greedy(model, prompt, 30)
    before = hf_greedy(model, prompt, 30)
    with torch.no_grad():
        layer = model.model.layers[0]
        layer.input_layernorm.weight = torch.nn.Parameter(layer.input_layernorm.weight * -2.5)
    want = hf_greedy(model, prompt, 30)
    assert want != before and engine.generate(prompt, max_new_tokens=30).token_ids == want
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.mul_(-3.0)
    want = hf_greedy(model, prompt, 30)
    assert want != before and engine.generate(prompt, max_new_tokens=30).token_ids == want


@pytest.mark.parametrize("what", ["head size 8", "sliding window", "gelu", "bfloat16", "mlp bias"])
def test_models_the_kernel_does_not_take_keep_the_eager_forward(what):
    from lookupdec.model.kernels import packed_linears_for

    if what == "head size 8":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=96)).eval()
    elif what == "sliding window":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(
            hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=96, sliding_window=24)).eval()
    elif what == "gelu":
        model = head16("llama", hidden_act="gelu")
    elif what == "mlp bias":
        model = head16("llama", mlp_bias=True)
    else:
        model = head16("llama").to(torch.bfloat16)
    assert native_forward_for(model, packed_linears_for(model)) is None


def test_bad_trees_are_refused_by_the_kernel():
    model = head16("llama")
    engine = engine_of(model)
    target = engine.target
    target.prefill([5, 6, 7])
    store = target.cache.slot_store
    positions = torch.tensor([3, 4])
    with pytest.raises(ValueError, match="parents"):
        target.native.hidden([5, 6], [-1, 1], positions, store)
    with pytest.raises(ValueError, match="parents"):
        target.native.hidden([5, 6], [0, 0], positions, store)
    assert store.lengths[0] == 3  # nothing appended


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_the_root_alone_gives_what_its_tree_verify_gives(family):
    """``TargetModel.verify_root``: a tree of the root alone's best tokens and K/V, as
    ``verify(tree, rows=[0], picks=k)`` makes them, with no tree, walk or logits object."""
    from lookupdec.request import top_tokens
    from lookupdec.tree import TokenTree

    model = head16(family, 3)
    fast, general = engine_of(model).target, engine_of(model).target
    prompt = [5, 9, 14, 3, 22, 41, 7]
    token = 17
    for target in (fast, general):
        target.prefill(prompt)
    calls = native_forward.CALLS[0]
    tops = fast.verify_root(token, 4)
    assert native_forward.CALLS[0] == calls + 1 and fast.n_cached == len(prompt) + 1
    got = general.verify(TokenTree([token], [-1]), rows=[0], picks=4)
    # (the picks the projection made, or where its form for one row makes none, the row's own)
    want = got.tops[0].tolist() if got.tops is not None else top_tokens(got.logits, [0], 4)[0]
    assert tops.tolist() == want
    assert int(tops[0]) == int(got.logits[0].argmax())
    n = len(prompt) + 1
    assert torch.equal(fast.cache.slot_store.buffer[:, :, :, :, :n], general.cache.slot_store.buffer[:, :, :, :, :n])
    assert fast.cache.slot_store.lengths == general.cache.slot_store.lengths == [n] * model.config.num_hidden_layers


def test_plain_decoding_takes_the_root_path_and_equals_transformers(monkeypatch):
    """``EngineConfig(proposers=())``: every step verifies the root alone, through
    ``TargetModel.verify_root`` (no tree merged, no walk, no commit) and no cost curve (nothing to
    choose); the output is ``transformers``' greedy one. Sampling keeps the general path."""
    model = head16("llama", 5)
    engine = engine_of(model, proposers=())
    taken = []
    verify_root = engine.target.verify_root
    monkeypatch.setattr(engine.target, "verify_root", lambda *a: taken.append(1) or verify_root(*a))
    prompt = [5, 6, 7, 5, 6, 8, 5, 6, 9]
    out = engine.generate(prompt, max_new_tokens=30)
    assert out.token_ids == hf_greedy(model, prompt, 30)
    assert len(taken) == out.stats.steps == len(out.token_ids) - 1 > 10  # every step: all but the prefill's token
    assert engine._costs == {}  # no curve seeded or learnt
    taken.clear()
    sampled = engine.generate(prompt, max_new_tokens=10, temperature=0.8, seed=3)
    assert taken == [] and sampled.stats.steps > 0


def test_a_seeded_curve_times_one_token_on_the_root_path(monkeypatch, tmp_path):
    """A new context bucket's curve is seeded by one forward of each ``SEED_SIZES``: its one
    token through ``verify_root``, the path a greedy step verifying the root alone takes (a
    one-node tree's forward is slower: timed there, t(1) ~ t(2) and every one-node draft looks
    free), the others as trees; the cache is left where it was."""
    from lookupdec.budget import SEED_SIZES

    monkeypatch.setenv("LOOKUPDEC_COST_CACHE", str(tmp_path / "costs.json"))
    engine = engine_of(head16("llama", 2))
    roots, trees = [], []
    verify_root, verify = engine.target.verify_root, engine.target.verify
    monkeypatch.setattr(engine.target, "verify_root", lambda *a: roots.append(a) or verify_root(*a))
    monkeypatch.setattr(engine.target, "verify", lambda tree, *a: trees.append(len(tree)) or verify(tree, *a))
    engine.target.prefill([5, 6, 7, 8])
    engine.cost_model(4, in_place=True)
    picks = engine.request_core.picks()
    assert engine.cost_origin == {64: "measured"}
    assert roots == [(1, picks)] and trees == [n for n in SEED_SIZES if n > 1]
    assert engine.target.n_cached == 4 and engine.target.cache.slot_store.lengths[0] == 4
