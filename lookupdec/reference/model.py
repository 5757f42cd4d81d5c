"""The definitions of the model side's fast paths (``lookupdec/model/``): the verify forward's
inputs (``target.tree_inputs`` and ``BatchTarget.inputs``, compiled in ``csrc/tree/``), the K/V cache's writes and
slot moves (``cache.SlotStore``, ``BatchStore``, ``PrefixStore``; ``gather_slots`` in
``csrc/kernels/``), and the tree attention's mask plan and attention (``kernels.attention_plan``,
``core_attention``; ``csrc/kernels/attention*``), in torch.

The model modules fall back on them where the fast path does not take the input (the extension
not built, another device, dtype or layout, sliding-window masks, a cache without the slot
buffer: each call says which). Nothing here imports ``lookupdec.model``: a store or cache is read
through its buffer, lengths and layers, and ``attention_plan`` returns ``kernels.AttentionPlan``'s
fields. ``tests/model/test_target.py``, ``test_kernels.py``, ``test_cache_prefix.py`` and
``tests/test_batch.py`` compare each with its fast path (bit for bit; the attention within float
rounding of its float64 definition).
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch

from lookupdec.reference import tree as reference_tree


# -- the verify forward's inputs ---------------------------------------------------------------------
def tree_inputs(tree, n_cached: int, *, device, dtype, windows: dict | None = None, tree_mode: bool = True):
    """Defines ``model.tree_inputs`` (compiled: ``TokenTree.verify_inputs(_at)``, into
    ``InputBuffers``): ``input_ids`` [1, 1+n], ``position_ids`` [1, 1+n] (``n_cached + depth``) and
    the additive mask (``tree_mask``; None for a chain or without ``tree_mode``), by definition:
    the boolean mask over every slot, then made additive."""
    ids = torch.tensor([tree.token_ids], device=device)
    depth = torch.tensor(tree.depth, device=device)
    positions = (n_cached + depth)[None]
    mask = None
    if tree_mode and not tree.is_chain:
        mask = tree_mask(tree, n_cached, positions[0], device=device, dtype=dtype, windows=windows)
    return ids, positions, mask


def tree_mask(tree, n_cached: int, positions: torch.Tensor, *, device, dtype, windows: dict | None = None):
    """Defines ``model.tree_inputs``' mask: additive 4D mask(s) [1, 1, 1+n, n_cached+1+n], 0 where
    node i sees slot j (the prefix, itself, its ancestors: ``reference.tree.ancestor_mask``), the
    dtype's minimum elsewhere; with sliding ``windows`` (layer type -> window or None) a dict per
    layer type where they differ (``tree_inputs`` takes these: no fast form)."""
    allowed = torch.ones((len(tree), n_cached + len(tree)), dtype=torch.bool, device=device)
    allowed[:, n_cached:] = torch.from_numpy(reference_tree.ancestor_mask(tree.parents)).to(device)
    if not windows:
        return _additive(allowed, dtype)
    key_pos = torch.cat([torch.arange(n_cached, device=device), positions])
    masks = {}
    for layer_type, window in windows.items():
        visible = allowed if window is None else allowed & (positions[:, None] - key_pos[None, :] < window)
        masks[layer_type] = _additive(visible, dtype)
    return masks.get(None) if set(masks) == {None} else masks


def batch_inputs(trees, lengths: Sequence[int], slots: int, width: int, *, device, dtype):
    """Defines ``BatchTarget.inputs`` (compiled: ``native.tree.batch_tree_inputs_at``):
    ``input_ids`` and ``position_ids`` [rows, width] and the additive mask [rows, 1, width, slots
    + width] of one batched verify forward. Row b's nodes sit at columns ``slots + i`` after
    ``slots`` prefix columns of which its first ``lengths[b]`` are its own (the rest: holes, hidden);
    a node sees its prefix, itself and its ancestors; padding nodes (past the row's tree) repeat
    the root's token at the root's position and see their prefix and themselves."""
    rows = len(trees)
    lengths = np.asarray(lengths, dtype=np.int64)
    ids = np.empty((rows, width), dtype=np.int64)
    positions = np.repeat(lengths[:, None], width, axis=1)
    allowed = np.zeros((rows, width, slots + width), dtype=bool)
    allowed[:, :, :slots] = np.arange(slots)[None, None, :] < lengths[:, None, None]
    diagonal = np.arange(width)
    allowed[:, diagonal, slots + diagonal] = True  # padding sees itself (a node sees itself anyway)
    for b, tree in enumerate(trees):
        n = len(tree)
        ids[b, :n] = tree.token_ids
        ids[b, n:] = tree.token_ids[0]
        positions[b, :n] += np.asarray(tree.depth, dtype=np.int64)
        allowed[b, :n, slots:slots + n] = reference_tree.ancestor_mask(tree.parents)
    mask = torch.zeros((rows, 1, width, slots + width), dtype=dtype)
    mask.masked_fill_(torch.from_numpy(~allowed)[:, None], torch.finfo(dtype).min)
    return torch.from_numpy(ids).to(device), torch.from_numpy(positions).to(device), mask.to(device)


def _additive(allowed: torch.Tensor, dtype) -> torch.Tensor:
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


# -- the K/V cache -----------------------------------------------------------------------------------
def write(store, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Defines ``SlotStore.write`` and ``BatchStore.write`` (every layer's views made at once):
    append ``keys``/``values`` [rows, heads, new, head dim] to ``layer`` of ``store``'s buffer (its
    first ``rows`` batch rows; room made by ``store.reserve``) by indexing the buffer for the one
    layer; the layer's whole K, V."""
    start = store.lengths[layer]
    end = start + keys.shape[-2]
    store.reserve(end, keys)
    rows, buffer = keys.shape[0], store.buffer
    buffer[layer, 0, :rows, :, start:end] = keys
    buffer[layer, 1, :rows, :, start:end] = values
    store.lengths[layer] = end
    return buffer[layer, 0, :rows, :, :end], buffer[layer, 1, :rows, :, :end]


def gather(store, slots: Sequence[int], start: int) -> None:
    """Defines ``SlotStore.gather`` (compiled: ``native.kernels.gather_slots``, in place): copy
    ``slots`` of every layer of ``store``'s buffer to ``start, start + 1, ...`` (slots increasing,
    each at or after its target) by torch indexing (any device): one copy of every layer's slots."""
    buffer = store.buffer
    rows = buffer.view(-1, buffer.shape[4], buffer.shape[5])  # [layers*2*batch*heads, slots, dim]
    count, first = len(slots), slots[0]
    if slots[-1] - first == count - 1 and first >= start + count:  # one run, not overlapping its target
        rows.narrow(1, start, count).copy_(rows.narrow(1, first, count))
        return
    src = torch.from_numpy(np.array(slots, dtype=np.int64)).to(buffer.device)
    rows.narrow(1, start, count).copy_(rows.index_select(1, src))


def gather_row(store, row: int, slots: Sequence[int], start: int) -> None:
    """Defines ``BatchStore.gather_row`` (compiled: ``native.kernels.gather_slots``, in place): copy
    ``slots`` of batch row ``row`` (every layer) of ``store``'s buffer to ``start, start + 1, ...``
    (slots >= their targets; those already there left alone) by torch indexing (any device)."""
    skip = 0
    while skip < len(slots) and slots[skip] == start + skip:
        skip += 1
    slots, start = slots[skip:], start + skip
    if not len(slots):
        return
    buf = store.buffer[:, :, row]  # [layers, 2, heads, capacity, head dim]
    src = torch.from_numpy(np.array(slots, dtype=np.int64)).to(buf.device)
    buf[:, :, :, start:start + len(slots)] = buf.index_select(3, src)


def copy_prefix(cache, length: int) -> torch.Tensor:
    """Defines ``SlotStore.copy_prefix`` (one strided copy of the slot buffer) for any cache: each
    layer's first ``length`` slots of K and V stacked, [layers, 2, batch, kv heads, length, head
    dim] (``PrefixStore.save`` takes it for a cache without the slot buffer)."""
    return torch.stack([torch.stack((layer.keys[:, :, :length], layer.values[:, :, :length]))
                        for layer in cache.layers])


def restore(kv: torch.Tensor, length: int, cache) -> None:
    """Defines ``SlotStore.load`` (one copy into the slot buffer) for any cache: the first
    ``length`` slots of ``kv`` (``copy_prefix``'s layout) appended by each layer's ``update``
    (``PrefixStore.restore`` takes it for a cache without the slot buffer)."""
    for layer in range(kv.shape[0]):
        cache.update(kv[layer, 0, :, :, :length], kv[layer, 1, :, :, :length], layer)


# -- tree attention ----------------------------------------------------------------------------------
def attention_plan(mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Defines ``kernels.attention_plan`` (compiled: ``native.kernels.attention_plan_at``) in torch
    calls: ``kernels.AttentionPlan``'s fields ``(cols, counts, common, bias, live)`` of a 4D mask
    [B, 1, Q, L] (additive, a slot hidden at the dtype's minimum or -inf, or boolean, True: seen):
    per row its visible slots (first those every live query sees with bias 0, ``common`` of them,
    then the rest, each run ascending), their ``counts``, each query's bias at those slots (-inf
    where it does not see one) and whether it sees any; the rows as wide as the largest count."""
    m = mask[:, 0]
    if m.dtype == torch.bool:
        seen = m
        values = torch.zeros(m.shape, dtype=torch.float32)
    else:
        seen = m > torch.finfo(m.dtype).min
        values = m.float()
    live = seen.any(-1)  # [B, Q]
    plain = (seen & (values == 0)) | ~live[:, :, None]
    common = plain.all(1) & seen.any(1)  # [B, L]
    tail = seen.any(1) & ~common
    slots = m.shape[-1]
    rank = torch.where(common, 0, torch.where(tail, 1, 2)) * slots + torch.arange(slots)
    counts = (common | tail).sum(1)
    cmax = int(counts.max()) if counts.numel() else 0
    cols = torch.argsort(rank, dim=1)[:, :cmax]
    gathered = cols[:, None, :].expand(m.shape[0], m.shape[1], cmax)
    bias = torch.where(seen.gather(2, gathered), values.gather(2, gathered), -math.inf)
    return (cols.to(torch.int32).contiguous(), counts.to(torch.int32), common.sum(1).to(torch.int32),
            bias.contiguous(), live.to(torch.uint8).contiguous())


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
              scale: float) -> torch.Tensor:
    """Defines ``kernels.core_attention`` (compiled: ``native.kernels.tree_attention_at``) in
    float64: each query head against its K/V head (``h // (H / KVH)``), softmax over the slots its
    mask row shows (bias added), zeros for a query that sees none; [B, Q, H, D] float32."""
    batch, heads, q, dim = query.shape
    groups = heads // key.shape[1]
    k = key.double().repeat_interleave(groups, dim=1)
    v = value.double().repeat_interleave(groups, dim=1)
    m = mask[:, 0]
    seen = m if m.dtype == torch.bool else m > torch.finfo(m.dtype).min
    bias = torch.zeros(m.shape, dtype=torch.float64) if m.dtype == torch.bool else m.double()
    scores = query.double() @ k.transpose(-1, -2) * scale + bias[:, None]
    scores = scores.masked_fill(~seen[:, None], -math.inf)
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return (weights @ v).transpose(1, 2).float()
