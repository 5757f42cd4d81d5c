"""A static verify forward: fixed shapes, K/V written in place at explicit slots, one function.

``StaticForward`` holds a llama-shaped model's weights (llama, qwen2, mistral without a sliding
window) and preallocated K/V buffers ``[kv heads, capacity, head dim]`` per layer, and runs one
verify forward as pure tensor operations: no ``nn.Module`` calls, no cache object, no Python that
depends on the data between the inputs and the logits. Its inputs are padded to a fixed set of
sizes (``SIZES``) and the keys it reads to a fixed set of context lengths (``context_bucket``), so
``torch.compile(fullgraph=True)`` traces it once per (size, context) pair and a CUDA graph could
capture each. Padding nodes sit at slots past every real node, see nothing but themselves and
are never read: their logits are dropped, their K/V overwritten by the next forward.

``tree_inputs_static`` builds the inputs from a tree's parents array in one function: token ids,
positions (``n_cached + depth``), the slots written (``n_cached + i``) and the additive mask
``[size, context]`` (0 where node i sees slot j: the committed prefix, its ancestors, itself).

Numerics: the same operations as transformers' eager llama forward in float32 (RMSNorm in float32,
rotary embedding from the model's own ``inv_freq`` and ``attention_scaling``, softmax in float32),
but products of other shapes, so logits agree to rounding, not to the bit:
``tests/test_static_forward.py`` holds greedy decoding to transformers' tokens.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

SIZES = (1, 2, 4, 8, 16, 32, 64)  # tree tokens per forward (root included), padded up to one of these
CONTEXT_STEP = 256  # the keys a forward reads: the context rounded up to a multiple of this


def padded_size(n: int) -> int:
    """The smallest of ``SIZES`` holding ``n`` tokens (past the largest: ``n`` rounded up to a
    multiple of it)."""
    for size in SIZES:
        if n <= size:
            return size
    return -(-n // SIZES[-1]) * SIZES[-1]


def context_bucket(tokens: int, capacity: int) -> int:
    """The keys a forward over ``tokens`` slots reads: rounded up to ``CONTEXT_STEP``, at most
    ``capacity``."""
    return min(capacity, -(-tokens // CONTEXT_STEP) * CONTEXT_STEP)


def tree_inputs_static(token_ids: Sequence[int], parents: Sequence[int], n_cached: int, size: int, context: int,
                       *, dtype=torch.float32):
    """The static forward's inputs for a tree of ``len(token_ids)`` nodes (node 0 the root,
    ``parents[i] < i``) after ``n_cached`` committed slots, padded to ``size`` nodes and
    ``context`` key slots: ``(ids, positions, slots, mask)``. Padding nodes take token 0 at the
    next slots and see only themselves.

    >>> ids, pos, slots, mask = tree_inputs_static([7, 8, 9], [-1, 0, 0], 2, 4, 8)
    >>> pos.tolist(), slots.tolist()
    ([2, 3, 3, 2], [2, 3, 4, 5])
    >>> (mask == 0).int().tolist()   # node 2 sees the prefix, the root and itself, not its sibling
    [[1, 1, 1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 1, 0, 0, 0], [0, 0, 0, 0, 0, 1, 0, 0]]
    """
    n = len(token_ids)
    if n > size or n_cached + size > context:
        raise ValueError(f"tree_inputs_static: {n} nodes after {n_cached} slots do not fit {size} x {context}")
    depth = np.zeros(size, dtype=np.int64)
    allowed = np.zeros((size, context), dtype=bool)
    allowed[:n, :n_cached] = True
    for i in range(n):
        p = parents[i]
        if i:
            depth[i] = depth[p] + 1
            allowed[i, n_cached: n_cached + n] = allowed[p, n_cached: n_cached + n]
        allowed[i, n_cached + i] = True
    for i in range(n, size):  # padding: itself only
        allowed[i, n_cached + i] = True
    ids = np.zeros(size, dtype=np.int64)
    ids[:n] = token_ids
    positions = n_cached + depth
    positions[n:] = n_cached
    slots = n_cached + np.arange(size, dtype=np.int64)
    mask = torch.zeros((size, context), dtype=dtype)
    mask.masked_fill_(torch.from_numpy(~allowed), torch.finfo(dtype).min)
    return torch.from_numpy(ids), torch.from_numpy(positions), torch.from_numpy(slots), mask


class StaticForward(torch.nn.Module):
    """One verify forward of a llama-shaped causal LM with static shapes (module docstring).

    ``forward(ids [S], positions [S], slots [S], mask [S, C])`` writes the S new keys and values
    at ``slots`` and returns the logits ``[S, vocab]``, reading the first ``C`` slots of the
    buffer (``C`` = ``mask.shape[1]``). Weights are the model's own tensors (not copied)."""

    def __init__(self, model, capacity: int) -> None:
        super().__init__()
        config = model.config
        if config.model_type not in ("llama", "qwen2", "mistral"):
            raise ValueError(f"StaticForward: {config.model_type!r} is not a llama-shaped model")
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"StaticForward: activation {config.hidden_act!r} (only silu)")
        if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
            raise ValueError("StaticForward: sliding-window attention is not supported")
        body = model.model
        self.layers = len(body.layers)
        attn = body.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.scaling = attn.scaling
        self.eps = body.norm.variance_epsilon
        self.capacity = capacity
        self.embed = body.embed_tokens.weight
        self.final_norm = body.norm.weight
        self.lm_head = model.lm_head.weight
        rotary = body.rotary_emb
        self.register_buffer("inv_freq", rotary.inv_freq.detach().float().clone(), persistent=False)
        self.attention_scaling = float(getattr(rotary, "attention_scaling", 1.0))
        self.weights = []
        for layer in body.layers:
            a, m = layer.self_attn, layer.mlp
            self.weights.append((layer.input_layernorm.weight, a.q_proj.weight, a.q_proj.bias, a.k_proj.weight,
                                 a.k_proj.bias, a.v_proj.weight, a.v_proj.bias, a.o_proj.weight,
                                 layer.post_attention_layernorm.weight, m.gate_proj.weight, m.up_proj.weight,
                                 m.down_proj.weight))
        dtype = self.embed.dtype
        # one buffer per layer and K/V (not views of one): a compiled graph then writes each in
        # place, where a view of a shared base is written back whole
        self.keys, self.values = [], []
        for layer in range(self.layers):
            for name, store in (("k", self.keys), ("v", self.values)):
                buffer = torch.zeros(self.kv_heads, capacity, self.head_dim, dtype=dtype, device=self.embed.device)
                self.register_buffer(f"{name}{layer}", buffer, persistent=False)
                store.append(buffer)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * x.to(dtype)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        size, context = mask.shape
        hidden = F.embedding(ids, self.embed)  # [S, H]
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.attention_scaling).to(hidden.dtype)[None]  # [1, S, D]
        sin = (emb.sin() * self.attention_scaling).to(hidden.dtype)[None]
        group = self.heads // self.kv_heads
        for layer, (n1, wq, bq, wk, bk, wv, bv, wo, n2, wg, wu, wd) in enumerate(self.weights):
            x = self._norm(hidden, n1)
            q = F.linear(x, wq, bq).view(size, self.heads, self.head_dim).transpose(0, 1)  # [Hq, S, D]
            k = F.linear(x, wk, bk).view(size, self.kv_heads, self.head_dim).transpose(0, 1)  # [Hkv, S, D]
            v = F.linear(x, wv, bv).view(size, self.kv_heads, self.head_dim).transpose(0, 1)
            q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
            key_buffer, value_buffer = self.keys[layer], self.values[layer]
            key_buffer[:, slots] = k
            value_buffer[:, slots] = v
            keys = key_buffer[:, :context]  # [Hkv, C, D]
            values = value_buffer[:, :context]
            q = q.reshape(self.kv_heads, group * size, self.head_dim)  # the group's queries share their keys
            scores = torch.matmul(q, keys.transpose(1, 2)) * self.scaling  # [Hkv, G*S, C]
            scores = scores.view(self.kv_heads, group, size, context) + mask
            probs = torch.softmax(scores.float(), dim=-1).to(q.dtype).view(self.kv_heads, group * size, context)
            out = torch.matmul(probs, values).view(self.heads, size, self.head_dim)  # [Hq, S, D]
            out = out.transpose(0, 1).reshape(size, self.heads * self.head_dim)
            hidden = hidden + F.linear(out, wo)
            x = self._norm(hidden, n2)
            hidden = hidden + F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd)
        hidden = self._norm(hidden, self.final_norm)
        return F.linear(hidden, self.lm_head)

    def prefill(self, token_ids: Sequence[int], chunk: int = 64) -> torch.Tensor:
        """The prompt's K/V written at slots ``0 .. len - 1`` in chunks of ``chunk`` tokens (a
        causal chain each); the last token's logits."""
        n = len(token_ids)
        if n > self.capacity:
            raise ValueError(f"StaticForward: {n} prompt tokens exceed the capacity {self.capacity}")
        logits = None
        for start in range(0, n, chunk):
            part = list(token_ids[start: start + chunk])
            size = padded_size(len(part))
            context = context_bucket(start + size, self.capacity)
            inputs = tree_inputs_static(part, list(range(-1, len(part) - 1)), start, size, context,
                                        dtype=self.embed.dtype)
            logits = self(*(t.to(self.embed.device) for t in inputs))[len(part) - 1]
        return logits


@torch.inference_mode()
def greedy_static(forward, static: StaticForward, prompt: Sequence[int], max_new_tokens: int,
                  eos: int | None = None) -> list[int]:
    """Plain greedy decoding on ``static`` (one token per forward through ``forward``, e.g.
    ``torch.compile(static, fullgraph=True)``): the reference loop the tests hold to
    transformers' ``generate``."""
    logits = static.prefill(prompt)
    out = [int(logits.argmax())]
    n_cached = len(prompt)
    while len(out) < max_new_tokens and out[-1] != eos and n_cached + 1 < static.capacity:
        context = context_bucket(n_cached + 1, static.capacity)
        inputs = tree_inputs_static([out[-1]], [-1], n_cached, 1, context, dtype=static.embed.dtype)
        logits = forward(*(t.to(static.embed.device) for t in inputs))
        out.append(int(logits[0].argmax()))
        n_cached += 1
    return out
