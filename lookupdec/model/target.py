"""The target model: prefill, the tree forward (4D ancestor mask, sliding windows), KV commit,
and the start-up probe that falls back to one chain per step where a model rejects the mask."""
from __future__ import annotations

import logging
from typing import Sequence

import torch

from lookupdec.model.cache import crop_cache, gather_cache, new_cache
from lookupdec.model.head import fast_head_for, swapped
from lookupdec.tree import TokenTree

log = logging.getLogger("lookupdec")

# Tolerance of the start-up probe comparing tree logits with one-path logits, relative to the
# spread of the logits: loose enough for bf16 noise, far below what a wrong mask produces.
PROBE_REL_TOL = 0.02



class TargetModel:
    """A causal LM with a KV cache of the committed prefix, verifying token trees."""

    def __init__(self, model, *, verify: str = "auto", fast_head: bool = True) -> None:
        """``fast_head``: ``EngineConfig.fast_kernels`` (model/head.py)."""
        self.model = model
        # the output projection by the fastest product form per row count (CPU float32; model/head.py)
        self.fast_head = fast_head_for(model) if fast_head else None
        self.config = model.config
        self.device = next(model.parameters()).device
        self._gqa = fast_head and self.device.type == "cpu"  # K/V heads not copied per query group (model/head.py)
        self.dtype = next(model.parameters()).dtype
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.max_context = _max_context(self.config)
        self._windows = _sliding_windows(self.config)
        self.cache = None
        self.n_cached = 0
        self.last_prepare_s = 0.0
        if verify == "auto":
            verify = "tree" if self._probe_tree_mask() else "chain"
            if verify == "chain":
                log.warning("%s cannot take a custom 4D attention mask: verifying one draft chain per step",
                            self.config.model_type)
        self.tree_mode = verify == "tree"

    # -- cache lifecycle ------------------------------------------------------------------------
    def reset(self) -> None:
        self.cache = new_cache()
        self.n_cached = 0

    @torch.inference_mode()
    def prefill(self, token_ids: Sequence[int]) -> None:
        """Put ``token_ids`` in a fresh cache (everything but the root)."""
        self.reset()
        if len(token_ids):
            ids = torch.tensor([list(token_ids)], device=self.device)
            with swapped(self.model, self.fast_head):
                self.model(input_ids=ids, past_key_values=self.cache, use_cache=True, logits_to_keep=1)
            self.n_cached = len(token_ids)

    def prepare(self, n: int) -> float:
        """Get ready for forwards of ``n`` tokens (``FastHead.prepare``); the seconds it took."""
        return self.fast_head.prepare(n) if self.fast_head is not None else 0.0

    @torch.inference_mode()
    def verify(self, tree: TokenTree) -> torch.Tensor:
        """One forward over the tree's nodes. Returns logits [1 + n, vocab] (float32).
        ``last_prepare_s``: time it spent in ``prepare`` (not the forward's cost)."""
        n = len(tree)
        self.last_prepare_s = self.prepare(n)
        ids = torch.tensor([tree.token_ids], device=self.device)
        depth = torch.tensor(tree.depth, device=self.device)
        positions = (self.n_cached + depth)[None]
        # A chain needs no custom mask: the model's own causal mask (and its fastest attention
        # path, the one plain decoding takes) is exactly the tree mask then.
        mask = self._tree_mask(tree, positions[0]) if self.tree_mode and not tree.is_chain else None
        with swapped(self.model, self.fast_head, gqa=self._gqa):
            out = self.model(input_ids=ids, position_ids=positions, attention_mask=mask,
                             past_key_values=self.cache, use_cache=True)
        self.n_cached += n
        return out.logits[0].float()

    @torch.inference_mode()
    def commit(self, tree: TokenTree, accepted: Sequence[int]) -> None:
        """Keep the root and the accepted nodes' K/V in contiguous slots; drop the rest."""
        base = self.n_cached - len(tree)  # slot of the root
        keep = base + 1 + len(accepted)
        gather_cache(self.cache, [base + node for node in accepted], base + 1)
        crop_cache(self.cache, keep)
        self.n_cached = keep

    def sync(self) -> None:
        """Wait for the device (for timings)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def chain_forward_timer(self, prefix_len: int | None = None):
        """A function ``f(n)`` running one verify forward of ``n`` chain tokens, then cropping the
        cache back, for measuring the cost curve. ``prefix_len``: after a fresh dummy prefix of
        that length (call ``reset()`` when done); None: on the cache as it is (a request's own
        context, left as it was)."""
        vocab = self.vocab_size
        if prefix_len is not None:
            self.prefill([(7 * i + 3) % vocab for i in range(prefix_len)])
        base = self.n_cached

        def forward(n: int) -> None:
            tree = TokenTree(token_ids=[(5 * i + 1) % vocab for i in range(n)], parents=list(range(-1, n - 1)))
            self.verify(tree)
            self.sync()
            crop_cache(self.cache, base)  # back to the prefix: every call sees the same context
            self.n_cached = base

        return forward

    # -- masks ----------------------------------------------------------------------------------
    def _tree_mask(self, tree: TokenTree, positions: torch.Tensor):
        """Additive 4D mask(s) [1, 1, 1+n, n_cached+1+n]; a dict per layer type where needed."""
        allowed = torch.ones((len(tree), self.n_cached + len(tree)), dtype=torch.bool, device=self.device)
        allowed[:, self.n_cached :] = torch.from_numpy(tree.ancestor_mask()).to(self.device)
        if not self._windows:
            return self._additive(allowed)
        key_pos = torch.cat([torch.arange(self.n_cached, device=self.device), positions])
        masks = {}
        for layer_type, window in self._windows.items():
            visible = allowed if window is None else allowed & (positions[:, None] - key_pos[None, :] < window)
            masks[layer_type] = self._additive(visible)
        return masks.get(None) if set(masks) == {None} else masks

    def _additive(self, allowed: torch.Tensor) -> torch.Tensor:
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device)
        mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)
        return mask[None, None]

    @torch.inference_mode()
    def _probe_tree_mask(self) -> bool:
        """Two sibling branches in one tree forward must give the logits of two separate runs."""
        vocab = min(self.vocab_size, 100)
        prefix, branch_a, branch_b = [1 % vocab, 5 % vocab, 9 % vocab], [11 % vocab, 3 % vocab], [17 % vocab, 2 % vocab]
        tree = TokenTree(token_ids=[7 % vocab] + branch_a + branch_b, parents=[-1, 0, 1, 0, 3])
        self.tree_mode = True
        try:
            self.prefill(prefix)
            got = self.verify(tree)
            want = []
            for branch in (branch_a, branch_b):
                ids = torch.tensor([prefix + [tree.token_ids[0]] + branch], device=self.device)
                want.append(self.model(input_ids=ids).logits[0, len(prefix):].float())
            want = torch.cat([want[0], want[1][1:]])
        except Exception as exc:  # a model type whose attention rejects the mask
            log.debug("tree-mask probe failed: %r", exc)
            return False
        finally:
            self.reset()
        scale = want.std().clamp_min(1e-6)
        return bool(((got - want).abs().max() / scale) < PROBE_REL_TOL)


def _max_context(config) -> int | None:
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _sliding_windows(config) -> dict:
    """Window per layer type for the 4D mask: {} (none), {None: w} (one mask), or per type."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        if "sliding_attention" not in layer_types or not window:
            return {}
        return {"full_attention": None, "sliding_attention": int(window)}
    if window and getattr(config, "use_sliding_window", True):
        return {None: int(window)}
    return {}
