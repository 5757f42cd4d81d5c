"""The target model: prefill, the tree forward (4D ancestor mask, sliding windows), KV commit,
and the start-up probe that falls back to one chain per step where a model rejects the mask."""
from __future__ import annotations

import logging
from typing import Sequence

import numpy as np
import torch

from lookupdec.model.cache import (PrefixStore, commit_accepted, common_prefix, crop_cache, emptied_cache,
                                   new_cache)
from lookupdec.model.kernels import (FastHead, fast_head_for, fused_norms_for, fused_rotary_for, grouped_attention,
                                     kernel_forms, packed_linears_for, seed_kernel_forms, skinny_threaded, swapped)
from lookupdec.model.lean import lean_layers_for
from lookupdec.model.native_forward import NATIVE_MAX_NODES, native_forward_for
from lookupdec.reference import model as reference_model
from lookupdec.sampling import PartialLogits, top_tokens_compiled
from lookupdec.tree import TokenTree

log = logging.getLogger("lookupdec")

# Tolerance of the start-up probe comparing tree logits with one-path logits, relative to the
# spread of the logits: loose enough for bf16 noise, far below what a wrong mask produces.
PROBE_REL_TOL = 0.02
_MASK_FILL: dict = {}  # dtype -> the bytes of its minimum (the additive mask's "hidden")



PREFIX_MIN = 16  # shared tokens worth keeping from the last request's prefill (TargetModel.prefill)


def reusable_prefix(kept: Sequence[int], kept_weights, token_ids: Sequence[int], weights) -> int:
    """How many leading tokens of ``token_ids`` may keep the K/V computed for ``kept``: what
    both share, if at least ``PREFIX_MIN`` and the weights' state is the same; else 0 (the one
    rule of ``TargetModel.prefill`` and ``BatchTarget.add``)."""
    if kept_weights is None or weights != kept_weights:
        return 0
    common = common_prefix(kept, token_ids)
    return common if common >= PREFIX_MIN else 0


def start_from_prefix(token_ids: Sequence[int], weights, in_place, prefixes: PrefixStore, fresh):
    """The cache a prefill of ``token_ids`` starts from and the tokens it keeps (the one rule of
    ``TargetModel.prefill`` and ``BatchTarget.add``): ``in_place`` (``(cache, its tokens, their
    weights' state)`` or None) cut to what it shares (``reusable_prefix``), or, where a prompt
    kept in ``prefixes`` shares more, a fresh cache (``fresh()``) holding that one's copy;
    ``(None, 0)`` where neither shares enough. The last token is never kept: its forward gives
    the logits of the request's first new token (``TargetModel.prefill(last_logits=True)``)."""
    last = len(token_ids) - 1
    common = reusable_prefix(in_place[1], in_place[2], token_ids, weights) if in_place is not None else 0
    common = min(common, last)
    entry, stored = prefixes.find(token_ids, weights)
    stored = min(stored, last)
    if stored > common:
        cache = fresh()
        prefixes.restore(entry, stored, cache)
        return cache, stored
    if common:
        crop_cache(in_place[0], common)
        return in_place[0], common
    return None, 0


def _install_grouped_attention() -> None:
    """``kernels.grouped_attention`` as transformers' "sdpa" attention (once; it wraps whatever is
    there, and outside ``swapped(gqa=True)`` on its thread hands every call to it)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    current = ALL_ATTENTION_FUNCTIONS.get("sdpa")
    if current is not None and not hasattr(current, "__grouped_original__"):
        ALL_ATTENTION_FUNCTIONS["sdpa"] = grouped_attention(current)


class TargetModel:
    """A causal LM with a KV cache of the committed prefix, verifying token trees."""

    def __init__(self, model, *, verify: str = "auto", fast_head: bool = True, partial_head: bool = True,
                 prefix_bytes: int = 0) -> None:
        """``fast_head``: ``EngineConfig.fast_kernels`` (model/kernels.py); ``partial_head``:
        ``EngineConfig.partial_logits`` (where the model allows it: ``_probe_partial_head``);
        ``prefix_bytes``: the size of ``prefixes`` (``EngineConfig.prefix_cache_mb``)."""
        self.model = model
        # the output projection by the fastest product form per row count (CPU float32; model/kernels.py)
        self.fast_head = fast_head_for(model) if fast_head else None
        self.body = packed_linears_for(model) if fast_head else None  # its linears in the fastest form (idem)
        self.norms = fused_norms_for(model) if fast_head else []  # RMS norms in one ATen call, bit for bit (idem)
        self.rotary = fused_rotary_for(model) if fast_head else None  # rotary embedding in one call, bit for bit (idem)
        self.layers = lean_layers_for(model) if fast_head else []  # decoder layers as one call each, bit for bit (lean.py)
        skinny = "skinny-mt" if skinny_threaded() else "skinny"  # (a threaded product: measured apart)
        body_forms = [skinny if f == "skinny" else f for f in self.body.forms if f != "linear"] if self.body is not None else []
        head = [f"head-{skinny}" if "skinny" in self.fast_head.forms else "head"] if self.fast_head is not None else []
        lean = ["lean"] if self.layers else []  # (the lean layers make every forward cheaper: another curve)
        # trees of up to NATIVE_MAX_NODES nodes through the compiled decoder (model/native_forward.py)
        self.native = native_forward_for(model, self.body) if fast_head and self.layers else None
        lean += ["native"] if self.native is not None else []
        self.kernels = "+".join(head + body_forms + lean) or "plain"  # the forms on offer: the cost and form caches' keys
        self.config = model.config
        self.device = next(model.parameters()).device
        self._gqa = fast_head and self.device.type == "cpu"  # K/V heads not copied per query group (model/kernels.py)
        if self._gqa:
            _install_grouped_attention()
        self.dtype = next(model.parameters()).dtype
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.max_context = model_max_context(self.config)
        self._windows = _sliding_windows(self.config)
        # a SlotCache (model/cache.py) where the layer count is known: KV commit in one operation
        self._num_layers = getattr(self.config.get_text_config(decoder=True), "num_hidden_layers", None)
        self.cache = None
        self.n_cached = 0
        # the tokens of the last prefill, whose K/V stay in slots [0, len) until the next prefill
        # or reset (a request's steps write only after them), and the weights they were computed
        # with (``prefill(reuse=True)``)
        self._prefix: list[int] = []
        self._prefix_weights: tuple | None = None
        # copies of earlier prompts' K/V (``prefill(reuse=True)``), shared with the batched step's
        # rows (``BatchTarget.add``)
        self.prefixes = PrefixStore(prefix_bytes, PREFIX_MIN)
        self._inputs = InputBuffers()  # the CPU tree forward's ids, positions and mask, reused per step
        self.last_prepare_s = 0.0
        self.last_logits: torch.Tensor | None = None  # the last prefill's (``prefill(last_logits=True)``)
        if verify == "auto":
            verify = "tree" if self._probe_tree_mask() else "chain"
            if verify == "chain":
                log.warning("%s cannot take a custom 4D attention mask: verifying one draft chain per step",
                            self.config.model_type)
        self.tree_mode = verify == "tree"
        self.partial_head = False  # verify(rows=...) may leave rows to compute on demand
        self.partial_head = partial_head and self._probe_partial_head()

    # -- cache lifecycle ------------------------------------------------------------------------
    def reset(self) -> None:
        self.cache = new_cache(self._num_layers)
        self.n_cached = 0
        self._prefix, self._prefix_weights = [], None

    @torch.inference_mode()
    def prefill(self, token_ids: Sequence[int], reuse: bool = False, *, last_logits: bool = False) -> int:
        """Put ``token_ids`` in the cache (a request's prompt). With ``reuse``
        (``EngineConfig.prefix_cache``), the longest common prefix with the last prefill's tokens
        keeps the K/V computed then, in place, or, where an earlier prompt kept in ``prefixes``
        shares more, starts from a copy of that one's (at least ``PREFIX_MIN`` tokens, the weights
        unchanged); only the rest is computed: requests that share an instruction, a chat template
        or a file skip its forward. The prompt's K/V are then kept in ``prefixes`` too.
        ``last_logits``: the last token is computed whatever is reused, and its logits [vocab]
        (float32) are left in ``self.last_logits``: the next token's distribution, the request's
        first token (``RequestCore.first``). Returns the tokens reused (0: a fresh cache)."""
        token_ids = list(token_ids)
        weights = self._weights_state() if reuse else None
        cache, common = None, 0
        if reuse:
            in_place = (self.cache, self._prefix, self._prefix_weights) if self.cache is not None else None
            cache, common = start_from_prefix(token_ids, weights, in_place, self.prefixes, self._emptied)
        # the last prefill's tokens: none until the fill below ends (a failed one leaves nothing to reuse)
        self.cache, self._prefix = (cache if cache is not None else self._emptied()), []
        self.n_cached = common
        self.last_logits = None
        logits = self.fill(self.cache, token_ids[common:])
        if last_logits:
            self.last_logits = logits
        self.n_cached = len(token_ids)
        self._prefix, self._prefix_weights = token_ids, weights
        if reuse:
            self.prefixes.save(token_ids, weights, self.cache)
        return common

    def _emptied(self):
        """This model's cache emptied for a new prompt (``emptied_cache``: its slot buffer kept)."""
        return emptied_cache(self.cache, self._num_layers)

    def forward_kernels(self, tokens: int, head=None, gqa: bool = False):
        """``kernels.swapped`` for one of this model's own forwards of ``tokens`` tokens: ``head``
        (default ``fast_head``) as the output projection, the body's, norms' and rotation's fast
        forms; ``gqa``: grouped K/V heads to SDPA (a masked forward on a CPU: ``self._gqa``)."""
        return swapped(self.model, self.fast_head if head is None else head, gqa=gqa, body=self.body,
                       tokens=tokens, norms=self.norms, rotary=self.rotary, layers=self.layers)

    def _weights_state(self) -> tuple:
        """Every parameter's identity and version: a weight replaced or written in place since the
        last prefill changes it (its K/V are then not reused)."""
        return tuple((id(w), w.data_ptr(), w._version) for w in self.model.parameters())

    @torch.inference_mode()
    def fill(self, cache, token_ids: Sequence[int]) -> torch.Tensor | None:
        """One forward appending ``token_ids`` to ``cache`` (this model's own, or a batch row's
        one-sequence cache, ``model/batch.py``); weights changed since the last request are
        packed again first. Returns the last token's logits [vocab] (float32; None: no tokens)."""
        if self.body is not None:
            self.body.refresh()
        if self.native is not None:
            self.native.refresh()
        if not len(token_ids):
            return None
        ids = torch.tensor([list(token_ids)], device=self.device)
        with self.forward_kernels(len(token_ids)):
            out = self.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        self.take_excess()  # a prefill is no verify forward: its trials' excess is not one's either
        return out.logits[0, -1].float()

    def prepare(self, n: int) -> float:
        """Get ready for forwards of ``n`` tokens (``FastHead.prepare``); the seconds it took."""
        return self.fast_head.prepare(n) if self.fast_head is not None else 0.0

    def kernel_forms(self) -> dict:
        """The kernel forms chosen so far (``model/kernels.kernel_forms``; {} without fast kernels)."""
        return kernel_forms(self.fast_head, self.body)

    def seed_kernel_forms(self, forms: dict) -> int:
        """Start from an earlier process's kernel forms (``model/kernels.seed_kernel_forms``)."""
        return seed_kernel_forms(self.fast_head, self.body, forms)

    def take_excess(self) -> float:
        """Seconds the output projection's and the body's form trials took beyond their best
        forms since the last call (``FastHead.take_excess``, ``PackedLinears.take_excess``): like
        ``prepare``'s, not the forward's cost."""
        head = self.fast_head.take_excess() if self.fast_head is not None else 0.0
        return head + (self.body.take_excess() if self.body is not None else 0.0)

    @torch.inference_mode()
    def verify(self, tree: TokenTree, rows: Sequence[int] | None = None, picks: int = 0):
        """One forward over the tree's nodes. Returns logits [1 + n, vocab] (float32); with
        ``rows`` (where ``partial_head``), a ``PartialLogits`` holding only those nodes' rows and
        the hidden states for any other (``sampling.head_rows`` picks them), and with ``picks`` >
        0 each row's ``picks`` best token ids where the output projection makes them as it writes
        the rows (``FastHead.project``; ``PartialLogits.tops``).
        ``last_prepare_s``: time it spent in ``prepare`` (not the forward's cost)."""
        n = len(tree)
        # (every row with picks asked: the same product, which in the skinny form makes the rows'
        # best tokens as it writes them)
        partial = rows is not None and self.partial_head and (len(rows) < n or picks > 0)
        self.last_prepare_s = self.prepare(len(rows) if partial else n)
        store = self._native_store() if n <= NATIVE_MAX_NODES else None
        if store is not None:
            return self._verify_native(tree, rows if partial else None, picks, store)
        # A chain gets no custom mask (tree_inputs): the model's own causal mask, and its fastest
        # attention path, the one plain decoding takes, is exactly the tree mask then.
        ids, positions, mask = tree_inputs(tree, self.n_cached, device=self.device, dtype=self.dtype,
                                           windows=self._windows, tree_mode=self.tree_mode, buffers=self._inputs)
        head = _RowsHead(self._head, self.fast_head or self._head, rows, picks) if partial else self.fast_head
        with self.forward_kernels(n, head, gqa=self._gqa):
            out = self.model(input_ids=ids, position_ids=positions, attention_mask=mask,
                             past_key_values=self.cache, use_cache=True)
        self.n_cached += n
        self.last_prepare_s += self.take_excess()
        if partial:
            return PartialLogits(tree, list(rows), out.logits[0].float(), head.hidden[0], self._project, tops=head.tops)
        return out.logits[0].float()

    def _native_store(self):
        """The slot store the compiled decoder appends a forward's K/V to, where it takes the
        forward (built for this model, the cache a slot cache holding ``n_cached`` slots); else None."""
        store = getattr(self.cache, "slot_store", None)
        if self.native is None or store is None or store.lengths[0] != self.n_cached:
            return None
        return store

    def _verify_native(self, tree: TokenTree, rows: Sequence[int] | None, picks: int, store):
        """``verify`` through the compiled decoder (``NativeForward``): the final hidden states,
        then the output projection the eager forward would make of them (``_RowsHead`` where
        ``rows`` are given)."""
        positions = torch.from_numpy(np.asarray(tree.depth, dtype=np.int64) + self.n_cached)
        hidden = self.native.hidden(tree.token_ids, tree.parents, positions, store)
        self.n_cached += len(tree)
        compute = self.fast_head or self._head
        if rows is None:
            logits = compute(hidden[None])[0].float()
            self.last_prepare_s += self.take_excess()
            return logits
        head = _RowsHead(self._head, compute, rows, picks)
        logits = head.forward(hidden[None])[0]
        self.last_prepare_s += self.take_excess()
        return PartialLogits(tree, list(rows), logits.float(), hidden, self._project, tops=head.tops)

    @torch.inference_mode()
    def verify_root(self, token: int, picks: int) -> np.ndarray | None:
        """``verify`` of a tree of the root alone (``token``) for greedy acceptance, through the
        compiled decoder: the root's ``picks`` best token ids (int32, best first: the first of
        equal values, as the greedy walk reads them), its K/V appended, nothing else made (no
        tree, no logits object); the same forward and projection as ``verify(tree, rows=[0],
        picks=picks)``. None, with nothing run, where that forward is not the compiled decoder's or
        the output projection is not a ``FastHead`` (the caller verifies the tree as any other)."""
        store, head = self._native_store(), self.fast_head
        if store is None or head is None or not self.partial_head:
            return None
        self.last_prepare_s = self.prepare(1)
        hidden = self.native.hidden((token,), _ROOT_PARENTS, torch.tensor([self.n_cached]), store)
        self.n_cached += 1
        logits, tops = head.project(hidden, picks)
        if tops is None:  # the form chosen for one row is not the skinny product: the row's own picks
            tops = np.asarray(top_tokens_compiled(logits, (0,), picks), dtype=np.int32)
        self.last_prepare_s += self.take_excess()
        return tops[0]

    @torch.inference_mode()
    def _project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, float]:
        """Logits [m, vocab] of final hidden states [m, d] (``PartialLogits.fill``), and the
        seconds of them spent in ``prepare``."""
        prepared = self.prepare(len(hidden))
        head = self.fast_head or self._head
        logits = head(hidden[None])[0].float()
        return logits, prepared + self.take_excess()

    @property
    def num_layers(self) -> int | None:
        """Decoder layers whose K/V the slot cache holds (None: a model it does not know)."""
        return self._num_layers

    @property
    def batchable(self) -> bool:
        """Whether several sequences can share a forward (``model.batch.BatchTarget``): tree
        masks, no sliding windows, a known layer count."""
        return self.tree_mode and not self._windows and self._num_layers is not None

    @property
    def _head(self) -> torch.nn.Module:
        return self.fast_head.head if self.fast_head is not None else self.model.get_output_embeddings()

    @torch.inference_mode()
    def _probe_partial_head(self) -> bool:
        """Whether the logits are the output projection of the final hidden states and nothing
        more (no soft-capping or scaling after it), so ``verify(rows=...)`` may compute the rest
        later: a tree forward's row must equal, bit for bit, the projection of its hidden state."""
        if self.device.type != "cpu" or any(getattr(self.config, name, None) for name in _LOGIT_POSTPROCESSING):
            return False
        if self.model.get_output_embeddings() is None or not hasattr(self.model, "set_output_embeddings"):
            return False
        vocab = min(self.vocab_size, 100)
        tree = TokenTree(token_ids=[7 % vocab, 11 % vocab, 3 % vocab], parents=[-1, 0, 0])
        self.partial_head = True
        fast, self.fast_head = self.fast_head, None  # the model's own projection both times: the same sums
        try:
            self.prefill([1 % vocab, 5 % vocab, 9 % vocab])
            got = self.verify(tree, rows=[0, 2])
            again, _ = self._project(got.hidden[[0, 2]])
            return bool(torch.equal(got.logits, again))
        except Exception as exc:  # a model whose forward does not call its output embeddings
            log.debug("partial-head probe failed: %r", exc)
            return False
        finally:
            self.partial_head = False
            self.fast_head = fast
            self.reset()

    @torch.inference_mode()
    def commit(self, tree: TokenTree, accepted: Sequence[int]) -> None:
        """Keep the root and the accepted nodes' K/V in contiguous slots; drop the rest."""
        self.n_cached = commit_accepted(self.cache, self.n_cached - len(tree), accepted)

    def sync(self) -> None:
        """Wait for the device (for timings)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def chain_forward_timer(self, prefix_len: int | None = None, root_picks: int = 0):
        """A function ``f(n)`` running one verify forward of ``n`` chain tokens, then cropping the
        cache back, for measuring the cost curve. ``prefix_len``: after a fresh dummy prefix of
        that length (call ``reset()`` when done); None: on the cache as it is (a request's own
        context, left as it was). ``root_picks`` > 0: one token is verified as a greedy step
        verifies the root alone (``verify_root`` with that many picks, where the target takes
        it): a curve's t(1) must be the path its steps take, which is up to a tenth faster
        than a one-node tree's, or every one-node draft looks nearly free."""
        vocab = self.vocab_size
        if prefix_len is not None:
            self.prefill([(7 * i + 3) % vocab for i in range(prefix_len)])
        base = self.n_cached

        def forward(n: int) -> float:
            if n == 1 and root_picks > 0 and self.verify_root(1 % vocab, root_picks) is not None:
                crop_cache(self.cache, base)
                self.n_cached = base
                return self.last_prepare_s
            tree = TokenTree(token_ids=[(5 * i + 1) % vocab for i in range(n)], parents=list(range(-1, n - 1)))
            self.verify(tree)
            self.sync()
            crop_cache(self.cache, base)  # back to the prefix: every call sees the same context
            self.n_cached = base
            return self.last_prepare_s  # kernel choices, not the forward's cost (CostModel.measure)

        return forward

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


# config attributes of models that change the logits after the output projection
_LOGIT_POSTPROCESSING = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


_ROOT_PARENTS = (-1,)


class _RowsHead(torch.nn.Module):
    """The output projection during a ``verify(rows=...)`` (one sequence, or a batch:
    ``BatchTarget``): keeps the final hidden states [rows, Q, d] (``hidden``) and projects only
    the ``rows`` positions (``b * Q + node``) of them, in one product; with ``picks`` > 0 and a
    ``FastHead``, each row's ``picks`` best token ids too where its form makes them (``tops``)."""

    def __init__(self, head: torch.nn.Module, compute, rows: Sequence[int], picks: int = 0) -> None:
        super().__init__()
        self.head = head  # the model's own, which ``swapped`` puts back
        self.compute = compute
        self.rows = torch.tensor(list(rows), dtype=torch.long)
        self.picks = picks if isinstance(compute, FastHead) else 0
        self.hidden: torch.Tensor | None = None
        self.tops: np.ndarray | None = None

    @property
    def weight(self) -> torch.Tensor:
        return self.head.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.hidden = x
        picked = x.reshape(-1, x.shape[-1])[self.rows]
        if self.picks:
            out, self.tops = self.compute.project(picked, self.picks)
            return out[None]
        return self.compute(picked[None])


class InputBuffers:
    """Where ``tree_inputs`` writes a CPU verify forward's inputs, kept across steps (a
    ``TargetModel`` holds one). A fresh mask [1+n, n_cached+1+n] per step costs its page faults
    and a write of every prefix column (0.5 MB at a 2000-token context); here the
    mask is a view of a zeroed buffer [rows, cols] whose prefix columns are never written: a step
    clears the last step's tree block and writes its own ([1+n, 1+n], ``native.tree.tree_inputs_at``).
    The tensors returned are views, valid until the next call (a forward reads them at once)."""

    def __init__(self) -> None:
        self.dtype = None
        self.rows = self.cols = 0
        self.last = (0, 0)  # (rows, column) of the tree block the mask holds

    def make(self, tree: TokenTree, n_cached: int, dtype, fill: bytes):
        """``tree_inputs``' three for ``tree`` (``fill``: the bytes of the mask's hidden value), or
        None without the compiled core."""
        n, width = len(tree), n_cached + len(tree)
        if dtype != self.dtype or n > self.rows or width > self.cols:
            same = dtype == self.dtype
            self._grow(max(n, 2 * self.rows if same else 0, 65), max(width, 2 * self.cols if same else 0, 1024), dtype)
        written = tree.verify_inputs_at(n_cached, fill, self._addresses[0], self._addresses[1], self._addresses[2],
                                        self.rows, self.cols, *self.last)
        if written is None:  # no compiled core
            return None
        self.last = (n, n_cached) if written else (0, 0)
        views = self._views.get(n)
        if views is None:  # per tree size, made once: a view made per step costs more than its cells
            views = self._views[n] = (self.ids[None, :n], self.positions[None, :n])
        return (*views, self.mask.as_strided((1, 1, n, width), self._mask_strides) if written else None)

    def _grow(self, rows: int, cols: int, dtype) -> None:
        self.dtype, self.rows, self.cols, self.last = dtype, rows, cols, (0, 0)
        self.ids = torch.zeros(rows, dtype=torch.int64)
        self.positions = torch.zeros(rows, dtype=torch.int64)
        self.mask = torch.zeros((1, 1, rows, cols), dtype=dtype)
        self._mask_strides = self.mask.stride()
        self._addresses = (self.ids.data_ptr(), self.positions.data_ptr(), self.mask.data_ptr())
        self._views: dict[int, tuple] = {}  # tree size -> views of ids and positions


def mask_fill(dtype) -> bytes:
    """The bytes of an additive mask's hidden entry (the dtype's minimum), as the compiled core
    writes it."""
    fill = _MASK_FILL.get(dtype)
    if fill is None:
        fill = _MASK_FILL[dtype] = torch.tensor([torch.finfo(dtype).min], dtype=dtype).view(torch.uint8).numpy().tobytes()
    return fill


def tree_inputs(tree: TokenTree, n_cached: int, *, device, dtype, windows: dict | None = None,
                tree_mode: bool = True, buffers: InputBuffers | None = None):
    """What one verify forward of ``tree`` takes after ``n_cached`` committed slots, no model
    needed: ``input_ids`` [1, 1+n], ``position_ids`` [1, 1+n] (``n_cached + depth``: siblings
    share a position) and the attention mask: None for a chain (the model's own causal mask is
    the tree mask then, on its fastest path) or without ``tree_mode``, else the additive 4D
    mask [1, 1, 1+n, n_cached+1+n] (0 where node i sees slot j: the prefix, itself, its
    ancestors; the dtype's minimum elsewhere), a dict per layer type with sliding ``windows``
    (``_sliding_windows``). On the CPU without windows, one call into the compiled core writes
    all three (``csrc/tree/tree.cpp``; into ``buffers`` when given: views of them are returned);
    elsewhere a handful of tensor operations, none per node. Defined by
    ``reference.model.tree_inputs``, whose masks it takes with sliding windows (no fast form)."""
    fill = mask_fill(dtype)
    on_cpu = not windows and (device == "cpu" or getattr(device, "type", None) == "cpu")
    made = buffers.make(tree, n_cached, dtype, fill) if on_cpu and buffers is not None and tree_mode else None
    if made is not None:
        return made
    made = tree.verify_inputs(n_cached, fill) if on_cpu else None
    if made is not None:
        ids, positions, mask = made
        n = len(tree)
        ids, positions = torch.frombuffer(ids, dtype=torch.int64)[None], torch.frombuffer(positions, dtype=torch.int64)[None]
        if mask is None or not tree_mode:
            return ids, positions, None
        return ids, positions, torch.frombuffer(mask, dtype=dtype).view(1, 1, n, n_cached + n)
    ids = torch.from_numpy(np.array([tree.token_ids], dtype=np.int64)).to(device)
    positions = torch.from_numpy(np.array([tree.depth], dtype=np.int64) + n_cached).to(device)
    if not tree_mode or tree.is_chain:
        return ids, positions, None
    if windows:  # (sliding windows: the definition's masks)
        return ids, positions, reference_model.tree_mask(tree, n_cached, positions[0], device=device, dtype=dtype,
                                                         windows=windows)
    n = len(tree)
    mask = torch.zeros((1, 1, n, n_cached + n), dtype=dtype, device=device)
    hidden = torch.from_numpy(~tree.ancestor_mask()).to(device)  # [1+n, 1+n] True: not an ancestor
    mask[0, 0, :, n_cached:].masked_fill_(hidden, torch.finfo(dtype).min)
    return ids, positions, mask


def model_max_context(config) -> int | None:
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
