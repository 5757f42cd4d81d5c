"""The KV cache's layout: the only code that knows it (``DynamicCache``, ``cache.layers[i].keys
/ .values``), for the target (``TargetModel.commit``) and a draft model (``DraftLM``)."""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from lookupdec.native import kernels as native_kernels  # None where not built: the torch gather runs
from lookupdec.reference import model as reference_model

# -- the KV cache's layout: the only code that knows it ---------------------------------------------
INITIAL_SLOTS = 256  # slots of a SlotCache's first buffer (it grows by GROWTH, copying once)
GROWTH = 1.5


def new_cache(num_layers: int | None = None):
    """An empty cache (no config: full-length layers; sliding windows live in our masks). With
    ``num_layers`` (the target's), a ``SlotCache``: one preallocated buffer for every layer, so a
    step's KV commit is one gather and a length change, not two tensor operations per layer."""
    from transformers import DynamicCache

    if num_layers:
        return _slot_cache_class()(num_layers)
    return DynamicCache()


def emptied_cache(cache, num_layers: int | None = None):
    """``cache`` emptied for a new prompt where it has a slot buffer (kept: on a CPU a new
    buffer's pages cost their first touch, about what copying them does), else ``new_cache``.
    The caller guarantees nothing still reads ``cache``'s K/V."""
    if cache is not None and getattr(cache, "slot_store", None) is not None:
        crop_cache(cache, 0)
        return cache
    return new_cache(num_layers)


def crop_cache(cache, length: int) -> None:
    """Keep the first ``length`` slots of every layer. By slicing: ``DynamicCache.crop``'s
    meaning changed across releases (in 5.23 it takes a negative count of tokens to drop)."""
    store = getattr(cache, "slot_store", None)
    if store is not None:
        store.crop(length)
        return
    for layer in cache.layers:
        layer.keys = layer.keys[:, :, :length]
        layer.values = layer.values[:, :, :length]


def gather_cache(cache, slots: Sequence[int], start: int) -> None:
    """Copy the K/V of ``slots`` (in order) to the contiguous slots from ``start`` on."""
    slots = list(slots)
    skip = 0  # slots already in place (the accepted path's first nodes are often the first nodes)
    while skip < len(slots) and slots[skip] == start + skip:
        skip += 1
    if skip == len(slots):
        return
    store = getattr(cache, "slot_store", None)
    if store is not None:
        store.gather(slots[skip:], start + skip)
        return
    src = torch.tensor(slots[skip:], device=cache.layers[0].keys.device)
    begin, end = start + skip, start + len(slots)
    for layer in cache.layers:
        layer.keys[:, :, begin:end] = layer.keys[:, :, src]
        layer.values[:, :, begin:end] = layer.values[:, :, src]


def commit_accepted(cache, root_slot: int, accepted: Sequence[int]) -> int:
    """After a verify forward whose root went to ``root_slot`` (node i at ``root_slot + i``):
    move the ``accepted`` nodes' K/V to the slots right after the root, drop everything after
    them, and return the number of slots kept."""
    keep = root_slot + 1 + len(accepted)
    skip = 0  # nodes already in their slots (node k + 1 at slot root_slot + k + 1: often the path's first)
    for node in accepted:
        if node != skip + 1:
            break
        skip += 1
    if skip < len(accepted):  # (gather_cache skips the slots in place itself; here no list is made for them)
        gather_cache(cache, [root_slot + node for node in accepted[skip:]], root_slot + 1 + skip)
    crop_cache(cache, keep)
    return keep


class SlotStore:
    """K and V of every layer in one buffer ``[layers, 2, batch, kv heads, capacity, head dim]``;
    layer ``i`` holds slots ``[0, lengths[i])``. Appending writes in place (no concatenation of
    the whole cache per layer and step, as ``DynamicLayer`` does); ``gather`` moves slots of every
    layer in one indexing operation; ``crop`` only sets lengths."""

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self.buffer: torch.Tensor | None = None
        self.lengths = [0] * num_layers
        self._spans: _Spans | None = None  # the views ``write`` hands out, made for every layer at once

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``keys``/``values`` [batch, heads, new, head dim] to ``layer``; its whole K, V.
        Every layer of a forward appends at the same slots: the views of them (and of each
        layer's whole K, V) are made once for all layers (``_Spans``), where indexing the buffer
        per layer (its definition, ``reference.model.write``) made four a layer, every forward
        (``bench/overhead_bench.py`` times the two)."""
        start = self.lengths[layer]
        end = start + keys.shape[-2]
        spans = self._spans
        if not (spans is not None and spans.buffer is self.buffer and spans.start == start and spans.end == end
                and spans.fits(keys)):
            spans = self._spans = self._span(keys, start, end)
        i = 2 * layer
        spans.new[i].copy_(keys)
        spans.new[i + 1].copy_(values)
        self.lengths[layer] = end
        return spans.whole[i], spans.whole[i + 1]

    def reserve(self, slots: int, like: torch.Tensor) -> None:
        """Room for ``slots`` slots in K/V shaped like ``like`` [batch, heads, new, head dim]: the
        buffer grown (or made) where it does not hold them as it is (``_grow``)."""
        if not _holds(self.buffer, like, slots):
            self._grow(like, slots)

    def _span(self, keys: torch.Tensor, start: int, end: int) -> "_Spans":
        """``write``'s views for slots ``[start, end)`` of K/V shaped like ``keys`` (the buffer
        grown or made first where it does not hold them)."""
        buffer = self.buffer
        if not _holds(buffer, keys, end):
            buffer = self._grow(keys, end)
        return _Spans(buffer, start, end, keys.shape[0])

    def copy_prefix(self, length: int) -> torch.Tensor:
        """A copy of every layer's first ``length`` slots, ``[layers, 2, batch, kv heads, length,
        head dim]`` (``PrefixStore``'s entry layout): one allocation and one strided copy, where
        stacking each layer's K and V (its definition, ``reference.model.copy_prefix``) makes two
        copies and 31 allocations."""
        if self.buffer is None or min(self.lengths) < length:
            raise ValueError(f"copy_prefix({length}): a layer holds fewer slots ({min(self.lengths)})")
        return self.buffer[:, :, :, :, :length].clone()

    def load(self, kv: torch.Tensor, length: int) -> None:
        """Fill this empty store with the first ``length`` slots of ``kv`` (``copy_prefix``'s
        layout) in one copy: every layer then holds ``length`` slots."""
        if any(self.lengths):
            raise ValueError("load: the store is not empty")
        if kv.shape[0] != self.num_layers:
            raise ValueError(f"load: {kv.shape[0]} layers of K/V for a store of {self.num_layers}")
        keys = kv[0, 0, :, :, :length]
        buffer = self.buffer if _holds(self.buffer, keys, length) else self._grow(keys, length)
        buffer[:, :, :, :, :length].copy_(kv[:, :, :, :, :length])
        self.lengths = [length] * self.num_layers

    def view(self, layer: int, kind: int) -> torch.Tensor | None:
        if self.buffer is None:
            return None
        return self.buffer[layer, kind, :, :, : self.lengths[layer]]

    def gather(self, slots: Sequence[int], start: int) -> None:
        """Copy ``slots`` of every layer to ``start, start + 1, ...`` (slots increasing, each at or
        after its target): on a CPU buffer in place by the compiled core (``gather_slots``: no
        temporary), else (another device, the extension not built) by its definition's torch
        indexing, ``reference.model.gather``."""
        buffer = self.buffer  # every (layer, K/V, batch row, head)'s row of slots
        if not _gather_in_place(buffer, 0, (buffer.numel() // buffer.stride(3), buffer.stride(3)), (1, 0), slots, start):
            reference_model.gather(self, slots, start)

    def crop(self, length: int) -> None:
        lengths = self.lengths
        if lengths and min(lengths) >= length:  # (after a forward every layer holds its slots: one C-level pass)
            self.lengths = [length] * len(lengths)
        else:
            self.lengths = [min(n, length) for n in lengths]

    def _grow(self, keys: torch.Tensor, needed: int) -> torch.Tensor:
        old = self.buffer
        same = (old is not None and old.shape[2:4] == keys.shape[:2] and old.shape[5] == keys.shape[3]
                and old.dtype == keys.dtype and old.device == keys.device)
        if old is not None and not same and any(self.lengths):
            raise ValueError(f"SlotStore: layers of one cache must share K/V shapes, dtype and device; got "
                             f"{tuple(keys.shape)} {keys.dtype} after {tuple(old.shape)} {old.dtype}")
        capacity = max(INITIAL_SLOTS, int(needed * GROWTH), int(old.shape[4] * GROWTH) if same else 0)
        batch, heads, _, head_dim = keys.shape
        self.buffer = torch.empty((self.num_layers, 2, batch, heads, capacity, head_dim), dtype=keys.dtype,
                                  device=keys.device)
        if same:
            kept = max(self.lengths)
            self.buffer[:, :, :, :, :kept] = old[:, :, :, :, :kept]
        return self.buffer


class BatchStore(SlotStore):
    """The K/V of up to ``max_rows`` sequences in one buffer ``[layers, 2, max_rows, kv heads,
    capacity, head dim]``, the batched step's cache (``model/batch.py``). The forward sees the
    first ``rows`` rows; every row shares the slot count ``lengths[layer]`` (the longest row's),
    and a shorter row's slots beyond its own length are holes its mask hides. A hole is never
    NaN (an additive mask does not hide a NaN key): every slot below the shared count of a row
    in use holds K/V the model wrote or zeros (``put_row`` zeroes the holes a row's joining
    makes).

    On a CPU memory is paid at its pages' first touch, which can be dear (on a VM especially):
    zeroing a whole new buffer of ``max_rows`` rows puts every row's first touch on the one
    request whose growth made it, though a client alone uses one row. So a new buffer is uninitialised
    (``new_buffer``; rows no sequence uses cost nothing), a growth copies the rows in use only,
    and ``put_row`` zeroes the holes a joining row makes. A joining row reserves room for its
    request (``put_row(room=)``), so growths come as rows join, not in the middle of a step."""

    def copy_prefix(self, length: int) -> torch.Tensor:
        raise NotImplementedError("a batch's rows are copied by put_row/move_row, not as one prompt's K/V")

    def load(self, kv: torch.Tensor, length: int) -> None:
        raise NotImplementedError("a batch's rows are filled by put_row, not as one prompt's K/V")

    def __init__(self, num_layers: int, max_rows: int) -> None:
        super().__init__(num_layers)
        self.max_rows = max_rows
        self.rows = 0

    def _span(self, keys: torch.Tensor, start: int, end: int) -> "_Spans":
        self.reserve(end, keys)
        return _Spans(self.buffer, start, end, keys.shape[0])

    def view(self, layer: int, kind: int) -> torch.Tensor | None:
        if self.buffer is None:
            return None
        return self.buffer[layer, kind, : self.rows, :, : self.lengths[layer]]

    def reserve(self, slots: int, like: torch.Tensor) -> None:
        """Room for ``slots`` slots in K/V shaped like ``like`` [rows, heads, new, head dim]: where
        the buffer is shorter, a new one of ``GROWTH`` times what is needed, the rows in use (or
        ``like``'s, a forward's) copied into it."""
        old = self.buffer
        if old is not None and slots <= old.shape[4]:
            return
        _, heads, _, head_dim = like.shape
        capacity = max(INITIAL_SLOTS, int(slots * GROWTH), int(old.shape[4] * GROWTH) if old is not None else 0)
        # (zeroed whole or not, many clients arriving in one process ran as fast: zeroing buys nothing)
        self.buffer = new_buffer((self.num_layers, 2, self.max_rows, heads, capacity, head_dim), like.dtype, like.device)
        rows = max(self.rows, like.shape[0])
        kept = max(self.lengths) if old is not None else 0
        if kept and rows:
            self.buffer[:, :, :rows, :, :kept] = old[:, :, :rows, :, :kept]

    def put_row(self, row: int, source: SlotStore, length: int, source_row: int = 0, room: int = 0) -> None:
        """Copy the first ``length`` slots of ``source``'s row ``source_row`` (a one-sequence
        store's only row, or a row of another batch store) into ``row``; the shared slot count
        grows to ``length`` if it was shorter. The holes that makes are zeroed (never NaN): the
        row's slots up to the shared count, or the other rows' slots up to ``length``. ``room``:
        slots beyond ``length`` the row will take (its request's tokens and trees), reserved now:
        a buffer grown in the middle of a batch's step stalls every row."""
        keys = source.buffer[0, 0, source_row : source_row + 1, :, :length]
        self.reserve(length + room, keys)
        shared = max(self.lengths)
        if length > shared and self.rows:
            self.buffer[:, :, : self.rows, :, shared:length] = 0
        self.buffer[:, :, row, :, :length] = source.buffer[:, :, source_row, :, :length]
        if shared > length:
            self.buffer[:, :, row, :, length:shared] = 0
        self.lengths = [max(n, length) for n in self.lengths]

    def move_row(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` slots of row ``src`` to row ``dst``."""
        self.buffer[:, :, dst, :, :length] = self.buffer[:, :, src, :, :length]

    def gather_rows(self, moves: Sequence[tuple[int, Sequence[int], int]], at_once: bool | None = None) -> None:
        """``gather_row(row, slots, start)`` for every ``(row, slots, start)`` of ``moves`` (rows
        distinct). ``at_once`` (None: on an accelerator) in one gather and one scatter, with one
        index transfer to the device instead of one per row (a GPU waits for each); on a CPU row
        by row is faster (indexing two dimensions at once is a generic gather)."""
        if at_once is None:
            at_once = self.buffer is not None and self.buffer.device.type != "cpu"
        if not at_once:
            for row, slots, start in moves:
                self.gather_row(row, slots, start)
            return
        rows, src, dst = [], [], []
        for row, slots, start in moves:
            skip = _in_place(slots, start)
            rows += [row] * (len(slots) - skip)
            src += slots[skip:]
            dst += range(start + skip, start + len(slots))
        if not rows:
            return
        index = torch.from_numpy(np.array([rows, src, dst], dtype=np.int64)).to(self.buffer.device)
        # (gathered whole before any write: a slot read may be another's target)
        self.buffer[:, :, index[0], :, index[2]] = self.buffer[:, :, index[0], :, index[1]]

    def gather_row(self, row: int, slots: Sequence[int], start: int) -> None:
        """Copy ``slots`` of ``row`` (every layer) to ``start, start + 1, ...`` (slots >= their
        targets): on a CPU buffer in place by the compiled core, else (another device, the
        extension not built) by its definition's torch indexing, ``reference.model.gather_row``."""
        buffer = self.buffer  # this row's (layer, K/V) x head rows of slots
        if not _gather_in_place(buffer, row * buffer.stride(2), (buffer.shape[0] * buffer.shape[1], buffer.stride(1)),
                                (buffer.shape[3], buffer.stride(3)), slots, start):
            reference_model.gather_row(self, row, slots, start)


def new_buffer(shape: tuple, dtype, device) -> torch.Tensor:
    """A new ``BatchStore`` buffer, uninitialised (``BatchStore`` zeroes the holes it makes;
    tests fill it with NaN to show nothing else is read)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _holds(buffer: torch.Tensor | None, keys: torch.Tensor, end: int) -> bool:
    """Whether ``buffer`` [layers, 2, batch, heads, capacity, head dim] takes K/V shaped like
    ``keys`` [batch, heads, new, head dim] up to slot ``end`` as it is (else ``SlotStore._grow``)."""
    return (buffer is not None and end <= buffer.shape[4] and buffer.shape[2:4] == keys.shape[:2]
            and buffer.shape[5] == keys.shape[3] and buffer.dtype == keys.dtype and buffer.device == keys.device)


class _Spans:
    """``SlotStore.write``'s views of ``buffer`` [layers, 2, batch, heads, capacity, head dim],
    its first ``rows`` batch rows, for appending at slots ``[start, end)``: per layer and K/V
    (index ``2 * layer + kind``) the new slots (``new``) and slots ``[0, end)`` (``whole``),
    each tuple made by one ``unbind``."""

    __slots__ = ("buffer", "start", "end", "lead", "dim", "dtype", "device", "new", "whole")

    def __init__(self, buffer: torch.Tensor, start: int, end: int, rows: int) -> None:
        self.buffer, self.start, self.end = buffer, start, end
        part = buffer if rows == buffer.shape[2] else buffer.narrow(2, 0, rows)
        self.lead = part.shape[2:4]  # (rows, heads): what keys.shape[:2] must be
        self.dim, self.dtype, self.device = buffer.shape[5], buffer.dtype, buffer.device
        self.new = part.narrow(4, start, end - start).flatten(0, 1).unbind(0)
        self.whole = part.narrow(4, 0, end).flatten(0, 1).unbind(0)

    def fits(self, keys: torch.Tensor) -> bool:
        """Whether ``keys`` [rows, heads, new, head dim] go in these views as they are."""
        shape = keys.shape
        return (shape[:2] == self.lead and shape[3] == self.dim and keys.dtype == self.dtype
                and keys.device == self.device)


def _gather_in_place(buffer: torch.Tensor, offset: int, outer: tuple[int, int], inner: tuple[int, int],
                     slots: Sequence[int], start: int) -> bool:
    """``SlotStore.gather``'s copy in the compiled core, in place (slots in place are left alone),
    over the rows of slots of a store's ``buffer`` [..., capacity, head dim] at ``offset + o *
    outer[1] + i * inner[1]`` elements, o < outer[0], i < inner[0]; False where the core cannot
    (not built, not a contiguous CPU buffer): the caller's torch definition then (``reference.model``). (Counts and
    strides, not a view: a view's dispatch, cold after a forward, was a large share of a commit.)"""
    if native_kernels is None or buffer.device.type != "cpu" or not buffer.is_contiguous():
        return False
    size = buffer.element_size()
    native_kernels.gather_slots(buffer.data_ptr() + offset * size, outer[0], outer[1] * size, inner[0],
                                inner[1] * size, buffer.stride(4) * size, buffer.shape[4], list(slots), start)
    return True


def _in_place(slots: Sequence[int], start: int) -> int:
    """How many of ``slots`` already sit at ``start, start + 1, ...`` (the root; often the
    accepted path's first nodes): nothing to move for them."""
    skip = 0
    while skip < len(slots) and slots[skip] == start + skip:
        skip += 1
    return skip


def new_batch_cache(num_layers: int, max_rows: int):
    """A cache for the batched step: a ``SlotCache`` over a ``BatchStore``."""
    return _slot_cache_class()(num_layers, BatchStore(num_layers, max_rows))


def _slot_cache_class():
    """``SlotCache``, a ``DynamicCache`` whose layers live in one ``SlotStore`` (defined on first
    use: transformers is imported lazily)."""
    global _SLOT_CACHE
    if _SLOT_CACHE is not None:
        return _SLOT_CACHE
    from transformers import DynamicCache
    from transformers.cache_utils import Cache, DynamicLayer

    class SlotLayer(DynamicLayer):
        """One layer's K/V: views of the shared store (``keys``/``values`` are read-only)."""

        def __init__(self, store: SlotStore, index: int) -> None:
            self.store, self.index = store, index
            super().__init__()

        keys = property(lambda self: self.store.view(self.index, 0), lambda self, value: _only_none(value))
        values = property(lambda self: self.store.view(self.index, 1), lambda self, value: _only_none(value))

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.dtype, self.device, self.is_initialized = key_states.dtype, key_states.device, True
            return self.store.write(self.index, key_states, value_states)

        def get_seq_length(self) -> int:
            return self.store.lengths[self.index]

        def crop(self, tokens_to_remove: int) -> None:  # transformers' convention: a negative count
            if tokens_to_remove > 0:
                raise ValueError("crop takes a negative number of tokens to remove")
            n = self.store.lengths[self.index]
            self.store.lengths[self.index] = max(0, n + tokens_to_remove)

        def reset(self) -> None:
            self.store.lengths[self.index] = 0

    class SlotCache(DynamicCache):
        def __init__(self, num_layers: int, store: SlotStore | None = None) -> None:
            self.slot_store = store if store is not None else SlotStore(num_layers)
            Cache.__init__(self, layers=[SlotLayer(self.slot_store, i) for i in range(num_layers)])

        def load(self, kv: torch.Tensor, length: int) -> None:
            """``SlotStore.load`` into this (empty) cache, every layer marked as its first update
            marks it."""
            self.slot_store.load(kv, length)
            for layer in self.layers:
                if not layer.is_initialized:
                    layer.dtype, layer.device, layer.is_initialized = kv.dtype, kv.device, True

    _SLOT_CACHE = SlotCache
    return SlotCache


_SLOT_CACHE = None


def _only_none(value) -> None:
    if value is not None:
        raise AttributeError("a SlotCache layer's keys and values are views of its store: use crop_cache/gather_cache")


class DraftLM:
    """A small causal LM that drafts: one KV cache per request (``new_state``) kept in step with
    a token list, fed incrementally."""

    class State:
        def __init__(self) -> None:
            self.cache = new_cache()
            self.tokens: list[int] = []  # tokens whose K/V are in the cache, in order

    def __init__(self, model, *, vocab_size: int | None = None) -> None:
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.vocab_size = vocab_size or model.get_output_embeddings().weight.shape[0]
        self.max_context = getattr(model.config, "max_position_embeddings", None)
        self.forwards = 0  # forward passes, for stats

    def new_state(self) -> "DraftLM.State":
        return DraftLM.State()

    @torch.inference_mode()
    def advance(self, state: "DraftLM.State", context: Sequence[int]) -> torch.Tensor:
        """Crop the cache to what still agrees with ``context`` (at most all but its last
        token), feed the rest in one forward; the logits after ``context``.  [vocab]"""
        context = list(context)
        common = 0
        for a, b in zip(state.tokens, context):
            if a != b:
                break
            common += 1
        keep = min(common, len(context) - 1)
        if keep < len(state.tokens):
            crop_cache(state.cache, keep)
            del state.tokens[keep:]
        return self.feed(state, context[keep:])

    @torch.inference_mode()
    def feed(self, state: "DraftLM.State", ids: Sequence[int]) -> torch.Tensor:
        """Append ``ids`` to the cache in one forward; the logits after the last.  [vocab]"""
        out = self.model(input_ids=torch.tensor([list(ids)], device=self.device), past_key_values=state.cache,
                         use_cache=True, logits_to_keep=1)
        state.tokens.extend(ids)
        self.forwards += 1
        return out.logits[0, -1]


class PrefixStore:
    """Copies of earlier prompts' K/V, least recently used dropped first past ``max_bytes``: the
    prompts a request may start from besides the last one, whose K/V stay in place
    (``TargetModel.prefill``, ``BatchTarget.add``; ``EngineConfig.prefix_cache_mb``). Editors that
    share a server resend their own file with every completion, a rewrite pipeline alternates
    instructions: the last prompt alone shares only a chat template with the next.

    Entries are ``(tokens, weights' state, K/V [layers, 2, 1, kv heads, len, head dim])``; one is
    used only with the same weights' state (``TargetModel._weights_state``), and only for the
    tokens it shares with a prompt (at least ``min_tokens``)."""

    def __init__(self, max_bytes: int = 0, min_tokens: int = 1) -> None:
        self.max_bytes = int(max_bytes)
        self.min_tokens = min_tokens
        self.entries: list[tuple[list[int], tuple, torch.Tensor]] = []  # least recently used first
        self.hits = 0  # prompts that started from an entry

    @property
    def bytes(self) -> int:
        return sum(kv.numel() * kv.element_size() for _, _, kv in self.entries)

    def find(self, token_ids: Sequence[int], weights) -> tuple[int, int]:
        """(entry index, tokens shared) of the entry sharing the most leading tokens with
        ``token_ids`` (at least ``min_tokens``, the same weights), else (-1, 0)."""
        best, best_common = -1, 0
        for i, (tokens, state, _) in enumerate(self.entries):
            if state != weights:
                continue
            common = common_prefix(tokens, token_ids)
            if common >= self.min_tokens and common > best_common:
                best, best_common = i, common
        return best, best_common

    def restore(self, entry: int, length: int, cache) -> None:
        """Append the first ``length`` slots of entry ``entry`` to ``cache`` (an empty one, every
        layer) and mark the entry used last."""
        found = self.entries.pop(entry)
        self.entries.append(found)
        kv = found[2]
        store = getattr(cache, "slot_store", None)
        if store is not None and not any(store.lengths):  # one copy into the cache's buffer
            cache.load(kv, length)
        else:  # (no slot buffer: each layer's update, the definition)
            reference_model.restore(kv, length, cache)
        self.hits += 1

    def save(self, token_ids: Sequence[int], weights, cache) -> None:
        """Keep a copy of ``cache``'s K/V of ``token_ids`` (its first slots, every layer) unless an
        entry already holds them (that one is marked used last); entries they extend, or computed
        with other weights, are dropped."""
        token_ids = list(token_ids)
        if self.max_bytes <= 0 or len(token_ids) < self.min_tokens:
            return
        kept, held = [], None
        for entry in self.entries:
            tokens, state, _ = entry
            if state != weights:
                continue
            common = common_prefix(tokens, token_ids)
            if common == len(token_ids) and held is None:  # already held (in this entry or one it begins)
                held = entry
            elif common < len(tokens):  # the new one does not extend it
                kept.append(entry)
        if held is not None:
            kept.append(held)  # used last
        else:
            n, store = len(token_ids), getattr(cache, "slot_store", None)
            if sum(2 * layer.keys[:, :, :n].numel() * layer.keys.element_size() for layer in cache.layers) <= self.max_bytes:
                kept.append((token_ids, weights, store.copy_prefix(n) if store is not None
                             else reference_model.copy_prefix(cache, n)))  # (no slot buffer: the definition)
        self.entries = kept
        self._evict()

    def report(self) -> dict:
        """``/health``'s view: prompts kept, their MiB, prompts that started from one (safe to
        call from another thread: it reads a snapshot of the entries)."""
        entries = list(self.entries)
        held = sum(kv.numel() * kv.element_size() for _, _, kv in entries)
        return {"prompts": len(entries), "mib": round(held / 2**20, 1), "hits": self.hits}

    def clear(self) -> None:
        self.entries = []

    def _evict(self) -> None:
        while self.entries and self.bytes > self.max_bytes:
            self.entries.pop(0)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n], dtype=np.int64) != np.asarray(b[:n], dtype=np.int64))
    return int(diff[0]) if len(diff) else n
