"""Decoder layers without ``nn.Module.__call__`` between their parts: the engine's own forwards
(inside ``kernels.swapped``) run each llama-shaped layer as one function that calls its norms,
projections, rotation, cache update, attention and MLP directly, in the order and with the
arguments transformers' own forward uses (its ``forward`` read for transformers 5.20-5.23), so the
result is the same to the bit. What it saves is Python: a SmolLM2 layer makes twelve sublayer
calls, each through ``_call_impl``, and the attention's keyword plumbing: an overhead per layer
that every forward pays whatever its token count (``bench/forward_parts.py`` measures it).

Only classes whose forward was read and repeated here take it (``_FAMILIES``: llama, qwen2,
mistral; the three differ only in the sliding window their attention passes on), and each layer
only after a probe: its own forward and the lean one on the same random rows, mask, positions and
a cache each, outputs and cached K/V equal bit for bit (``lean_layers_for``). A call the lean
forward does not repeat (training, autograd, attention weights asked for, no position
embeddings) goes to the layer's own forward. CPU only: on a GPU the same calls would launch the
same kernels, but no GPU has measured it.
"""
from __future__ import annotations

import sys
import weakref

import torch

# (module, class) of a decoder layer -> what its attention passes as ``sliding_window`` (None: nothing)
_FAMILIES = {
    ("transformers.models.llama.modeling_llama", "LlamaDecoderLayer"): None,
    ("transformers.models.qwen2.modeling_qwen2", "Qwen2DecoderLayer"): lambda attn: attn.sliding_window,
    ("transformers.models.mistral.modeling_mistral", "MistralDecoderLayer"):
        lambda attn: getattr(attn.config, "sliding_window", None),
}
_PARTS = ("input_layernorm", "post_attention_layernorm", "self_attn", "mlp", "self_attn.q_proj", "self_attn.k_proj",
          "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "mlp.act_fn")

_SHARED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> [(layer, its lean forward)]


def lean_forward(layer, window):
    """``layer``'s forward as one function (``window``: ``_FAMILIES``' entry for its class)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    own = type(layer).forward
    attn, mlp = layer.self_attn, layer.mlp
    module = sys.modules[type(attn).__module__]  # its apply_rotary_pos_emb (swapped for the core's) and eager attention
    norm1, norm2 = layer.input_layernorm, layer.post_attention_layernorm
    q_proj, k_proj, v_proj, o_proj = attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj
    gate, up, down, act = mlp.gate_proj, mlp.up_proj, mlp.down_proj, mlp.act_fn

    def forward(hidden_states, attention_mask=None, position_ids=None, past_key_values=None, use_cache=False,
                position_embeddings=None, **kwargs):
        if (position_embeddings is None or layer.training or torch.is_grad_enabled()
                or kwargs.get("output_attentions")):
            return own(layer, hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                       past_key_values=past_key_values, use_cache=use_cache,
                       position_embeddings=position_embeddings, **kwargs)
        residual = hidden_states
        hidden = norm1.forward(hidden_states)
        input_shape = hidden.shape[:-1]
        shape = (*input_shape, -1, attn.head_dim)
        query = q_proj.forward(hidden).view(shape).transpose(1, 2)
        key = k_proj.forward(hidden).view(shape).transpose(1, 2)
        value = v_proj.forward(hidden).view(shape).transpose(1, 2)
        cos, sin = position_embeddings
        query, key = module.apply_rotary_pos_emb(query, key, cos, sin)
        if past_key_values is not None:
            key, value = past_key_values.update(key, value, attn.layer_idx)
        interface = ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation,
                                                          module.eager_attention_forward)
        kwargs["position_ids"], kwargs["use_cache"] = position_ids, use_cache  # (as the layer hands them on)
        if window is not None:
            kwargs["sliding_window"] = window(attn)
        out, _ = interface(attn, query, key, value, attention_mask, dropout=0.0, scaling=attn.scaling, **kwargs)
        hidden_states = residual + o_proj.forward(out.reshape(*input_shape, -1).contiguous())
        residual = hidden_states
        hidden = norm2.forward(hidden_states)
        return residual + down.forward(act.forward(gate.forward(hidden)) * up.forward(hidden))

    return forward


def _hooked(layer) -> bool:
    """Whether a forward hook sits on ``layer``'s parts (the lean forward would skip it)."""
    from torch.nn.modules import module as nn_module

    if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
        return True
    return any(part._forward_hooks or part._forward_pre_hooks for part in (layer.get_submodule(p) for p in _PARTS))


def _probe(model, layer, forward) -> bool:
    """``layer``'s own forward and ``forward`` on the same random rows (2 x 3 tokens), causal
    float mask, positions and a fresh cache each: outputs and the layer's cached K/V equal bit
    for bit."""
    from transformers import DynamicCache

    weight = layer.input_layernorm.weight
    hidden_size = weight.shape[0]
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(2, 3, hidden_size, generator=g).to(device=weight.device, dtype=weight.dtype)
    positions = torch.arange(3, device=weight.device)[None].expand(2, 3)
    mask = torch.full((2, 1, 3, 3), torch.finfo(weight.dtype).min, dtype=weight.dtype, device=weight.device).triu(1)
    rotary = model.get_decoder().rotary_emb
    idx = layer.self_attn.layer_idx
    with torch.inference_mode():
        embeddings = rotary(rows, positions)
        results = []
        for run in (lambda **kw: type(layer).forward(layer, rows, **kw), lambda **kw: forward(rows, **kw)):
            cache = DynamicCache(config=model.config)
            out = run(attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True,
                      position_embeddings=embeddings)
            out = out[0] if isinstance(out, tuple) else out
            results.append((out, cache.layers[idx].keys, cache.layers[idx].values))
    return all(torch.equal(a, b) for a, b in zip(*results))


def lean_layers_for(model) -> list:
    """``(layer, lean forward)`` for each decoder layer of ``model`` that takes one: a class of
    ``_FAMILIES``, on a CPU, no hooks on its parts, and the probe passed (``_probe``); shared per
    model. Layers whose probe fails or raises keep their own forward. A hook added to a part
    later is not run inside the engine's forwards (``swapped``), which this list serves; every
    other call of the layer is its own forward."""
    if model in _SHARED:
        return _SHARED[model]
    found = []
    for layer in model.modules():
        key = (type(layer).__module__, type(layer).__name__)
        if key not in _FAMILIES:
            continue
        try:
            if layer.input_layernorm.weight.device.type != "cpu" or _hooked(layer):
                continue
            forward = lean_forward(layer, _FAMILIES[key])
            if _probe(model, layer, forward):
                found.append((layer, forward))
        except Exception:  # noqa: BLE001 (a layer shaped otherwise than the class read: its own forward)
            continue
    _SHARED[model] = found
    return found
