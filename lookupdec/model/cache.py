"""The KV cache's layout: the only code that knows it (``DynamicCache``, ``cache.layers[i].keys
/ .values``), for the target (``TargetModel.commit``) and a draft model (``DraftLM``)."""
from __future__ import annotations

from typing import Sequence

import torch

# -- the KV cache's layout: the only code that knows it ---------------------------------------------
def new_cache():
    """An empty cache (no config: full-length layers; sliding windows live in our masks)."""
    from transformers import DynamicCache

    return DynamicCache()


def crop_cache(cache, length: int) -> None:
    """Keep the first ``length`` slots of every layer. By slicing: ``DynamicCache.crop``'s
    meaning changed across releases (in 5.23 it takes a negative count of tokens to drop)."""
    for layer in cache.layers:
        layer.keys = layer.keys[:, :, :length]
        layer.values = layer.values[:, :, :length]


def gather_cache(cache, slots: Sequence[int], start: int) -> None:
    """Copy the K/V of ``slots`` (in order) to the contiguous slots from ``start`` on."""
    end = start + len(slots)
    if list(slots) == list(range(start, end)):
        return
    src = torch.tensor(list(slots), device=cache.layers[0].keys.device)
    for layer in cache.layers:
        layer.keys[:, :, start:end] = layer.keys[:, :, src]
        layer.values[:, :, start:end] = layer.values[:, :, src]


def commit_accepted(cache, root_slot: int, accepted: Sequence[int]) -> int:
    """After a verify forward whose root went to ``root_slot`` (node i at ``root_slot + i``):
    move the ``accepted`` nodes' K/V to the slots right after the root, drop everything after
    them, and return the number of slots kept."""
    keep = root_slot + 1 + len(accepted)
    gather_cache(cache, [root_slot + node for node in accepted], root_slot + 1)
    crop_cache(cache, keep)
    return keep


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
