"""The verify forward in one call of the compiled core (``csrc/kernels/forward.hpp``).

For a llama-shaped model (llama, qwen2, mistral without a sliding window; SiLU MLP; float32 on
a CPU) with the skinny product available, ``NativeForward.hidden`` runs a tree of a few nodes
through every layer in C++: the same kernels as the engine's eager forward (skinny products on
the same panels, the core's RMS norm and rotation, tree attention), without the Python and
dispatcher work around each of a forward's ~400 small calls. It writes the nodes' K/V into the
target's slot cache (``model/cache.SlotStore``) and returns the final hidden states; the output
projection stays with ``FastHead`` (its row picks and partial rows unchanged).

Rules: the rotary embedding's cos and sin come from the model's own ``rotary_emb`` at the
nodes' positions (any rope scaling it implements); a model, dtype, device or head size the
kernel does not take gets None from ``native_forward_for`` and keeps the eager forward.
"""
from __future__ import annotations

import weakref
from typing import Sequence

import torch

from lookupdec.native import kernels as native_kernels

_FAMILIES = ("llama", "qwen2", "mistral")
NATIVE_MAX_NODES = 65  # trees of at most this many nodes: a root and the default budget (max_nodes 64)
CALLS = [0]  # forwards run by the compiled decoder (the tests see which path ran)
_SHARED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> NativeForward | None


class NativeForward:
    """``model``'s decoder as one compiled call (module docstring); its linears' panels come from
    ``body`` (``kernels.PackedLinears.panels``)."""

    def __init__(self, model, body) -> None:
        decoder = model.get_decoder()
        config = model.config
        attn = decoder.layers[0].self_attn
        self.model, self.body, self.decoder = model, body, decoder
        self.layers = len(decoder.layers)
        self.head_dim = attn.head_dim
        self.kv_heads = config.num_key_value_heads
        self.shape = [self.layers, config.hidden_size, config.num_attention_heads, self.kv_heads, self.head_dim,
                      config.intermediate_size]
        self.eps = float(decoder.norm.variance_epsilon)
        self.scaling = float(attn.scaling)
        self._pointers: list[int] | None = None  # refresh()
        self._held: list[torch.Tensor] = []  # the tensors whose addresses _pointers holds
        self._generation = -1

    def refresh(self) -> None:
        """Take the weights' addresses again (forward.hpp's order, 12 per layer): called once per
        request (``TargetModel.fill``, after the body's ``refresh``), as a replaced parameter
        tensor or new panels move them; a forward checks only that the body made no new panels
        since (``PackedLinears.generation``)."""
        body = self.body
        body.make_copies("skinny")
        pointers = []
        held = []
        for layer in self.decoder.layers:
            a, m = layer.self_attn, layer.mlp
            parts = (layer.input_layernorm.weight, body.panels(a.q_proj), body.panels(a.k_proj),
                     body.panels(a.v_proj), a.q_proj.bias, a.k_proj.bias, a.v_proj.bias, body.panels(a.o_proj),
                     layer.post_attention_layernorm.weight, body.panels(m.gate_proj), body.panels(m.up_proj),
                     body.panels(m.down_proj))
            held += [t for t in parts if t is not None]
            pointers += [0 if t is None else t.data_ptr() for t in parts]
        self.embed, self.final_norm = self.decoder.embed_tokens.weight, self.decoder.norm.weight
        self._held, self._pointers, self._generation = held, pointers, body.generation

    def _addresses(self) -> list[int]:
        if self._pointers is None or self._generation != self.body.generation:
            self.refresh()
        return self._pointers

    @torch.inference_mode()
    def hidden(self, token_ids: Sequence[int], parents: Sequence[int], positions: torch.Tensor, store) -> torch.Tensor:
        """The final hidden states [m, hidden] of a tree (``token_ids``, ``parents``) whose nodes sit
        at ``positions`` [m] (int64), after the ``store``'s committed slots (every layer holding
        the same count), the nodes' K/V appended there."""
        m = len(token_ids)
        n_cached = store.lengths[0]
        like = torch.empty(1, self.kv_heads, m, self.head_dim)
        store.reserve(n_cached + m, like)
        buffer = store.buffer
        if (buffer.shape[2] != 1 or buffer.stride(4) != self.head_dim or buffer.stride(5) != 1
                or buffer.dtype != torch.float32 or buffer.device.type != "cpu"):
            raise ValueError(f"NativeForward: a one-row float32 CPU slot buffer, got {tuple(buffer.shape)} {buffer.dtype}")
        pointers = self._addresses()
        decoder, embed = self.decoder, self.embed
        cos, sin = decoder.rotary_emb(embed[:1][None], positions[None])
        cos, sin = cos[0].contiguous(), sin[0].contiguous()
        out = torch.empty(m, self.shape[1])
        native_kernels.decoder_forward_at(
            self.shape, self.eps, self.scaling, pointers, embed.data_ptr(), self.final_norm.data_ptr(),
            buffer.data_ptr(), [buffer.stride(0), buffer.stride(1), buffer.stride(3), buffer.shape[4]],
            list(token_ids), list(parents), n_cached, cos.data_ptr(), sin.data_ptr(), out.data_ptr())
        store.lengths = [n_cached + m] * self.layers
        CALLS[0] += 1
        return out


def native_forward_for(model, body) -> NativeForward | None:
    """``model``'s ``NativeForward`` (shared per model) where the compiled forward takes it: the
    core built with the kernel, a family of ``_FAMILIES`` without sliding windows, SiLU, float32
    on a CPU, head size a multiple of 16 in [16, 128], the body's skinny panels (``body``);
    else None."""
    if model in _SHARED:
        return _SHARED[model]
    found = None
    try:
        config = model.config
        decoder = model.get_decoder()
        weight = decoder.embed_tokens.weight
        layers = decoder.layers
        biases = [getattr(part, "bias", None) for layer in layers
                  for part in (layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj)]
        ok = (native_kernels is not None and hasattr(native_kernels, "decoder_forward_at")
              and body is not None and "skinny" in body.forms
              and config.model_type in _FAMILIES and getattr(config, "hidden_act", None) == "silu"
              and not (getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True))
              and weight.dtype == torch.float32 and weight.device.type == "cpu"
              and all(b is None for b in biases))
        if ok:
            head_dim = decoder.layers[0].self_attn.head_dim
            ok = head_dim % 16 == 0 and 16 <= head_dim <= 128
        if ok:
            found = NativeForward(model, body)
    except AttributeError:  # a model shaped otherwise than these families
        found = None
    _SHARED[model] = found
    return found
