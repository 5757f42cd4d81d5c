"""What one request's decoding needs beyond the step, shared by one sequence and a batch's rows.

``Engine`` (one sequence, ``engine.py``) and ``BatchDecoder`` (many per forward, ``batch.py``)
both decode requests through this module, so that a request gives the same tokens alone or in a
batch: ``RequestCore`` (one per engine, ``Engine.request_core``) holds the request-level rules
bound to the engine's target and proposers (room left in the context, the first token from the
prefill's logits, exact acceptance and its clip, the head rows a verify computes, token
recycling's width, the cost curves' context bucket); ``GenerationStats``, ``Generation``,
``StepTimer``, ``count_step`` and ``finish_stats`` are a request's result and how it is counted;
``cancel_check`` reads a request's cancel flag. Neither ``engine`` nor ``batch`` imports the
other's internals: the batch decoder takes an engine and uses its public attributes only.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Sequence

import torch

from lookupdec.reference import request as reference_request
from lookupdec.sampling import HEAD_MIN_ROWS, PartialLogits, accept, head_rows, top_tokens_compiled
from lookupdec.step import StepResult
from lookupdec.tree import TokenTree
from lookupdec.validate import bad

MIN_CALIBRATION_CONTEXT = 64  # cost curves are kept per context length rounded up to a power of 2


@dataclass
class GenerationStats:
    steps: int = 0  # target verify forwards
    new_tokens: int = 0  # tokens emitted (the prefill's first, then accepted + one bonus/recovered per step)
    prefill_tokens: int = 0  # tokens taken from the prefill's logits, in no step (1: the first)
    mean_accepted: float = 0.0  # new tokens per target verify forward (the prefill's first not counted)
    accepted_by_source: dict = field(default_factory=dict)  # proposer -> accepted draft tokens
    nodes_by_source: dict = field(default_factory=dict)  # proposer -> draft nodes verified (its share of the budget)
    draft_model_steps: int = 0  # steps on which the draft model ran
    mean_tree_nodes: float = 0.0  # draft nodes verified per step (root not counted)
    predicted_accepted: float = 0.0  # per step: draft tokens the calibrated tree promised ...
    realised_accepted: float = 0.0  # ... and draft tokens accepted (mean_accepted - 1 unless cut)
    draft_us: float = 0.0  # per step: proposers' time (with the merge where the lookups are fused: Mixture.plan)
    overhead_us: float = 0.0  # per step: drafting + tree + acceptance + KV commit + observe
    forward_ms: float = 0.0  # per step: the verify forward
    logit_rows: float = 0.0  # per step: tree nodes whose logits the forward computed (greedy: the likely ones)
    logit_misses: int = 0  # times a walk reached a node whose logits were not computed (computed then)
    prefill_ms: float = 0.0  # the prompt's forward
    prefix_reused: int = 0  # prompt tokens whose K/V the last request's prefill left (EngineConfig.prefix_cache)
    kernel_ms: float = 0.0  # in all: kernel-form trials and checks inside verify forwards (model/kernels.py),
    # in tokens_per_s but in neither forward_ms nor overhead_us (a batch's: those of the forwards it shared)
    tokens_per_s: float = 0.0  # new tokens / (prefill + all steps)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Generation:
    text: str  # output text, ending exactly before a stop string if one was hit
    token_ids: list[int]  # generated tokens (EOS included when it ended the output)
    finish_reason: str  # "stop" (stop string), "length" (max_new_tokens or context), "eos", "cancelled"
    stats: GenerationStats


class StepTimer:
    """Accumulates a request's per-step time by phase."""

    def __init__(self) -> None:
        self.draft = self.forward = self.total = 0.0
        self.prepare = 0.0  # one-time kernel choices inside verify (model/kernels.py): neither forward nor overhead
        self.nodes = self.steps = 0
        self.predicted = 0.0
        self.accepted = 0
        self.head_rows = self.head_misses = 0  # logits rows computed; walks that reached a row not computed

    def overhead_s(self) -> float:
        """Mean time per step outside the verify forward, so far (0 before the first step)."""
        return (self.total - self.forward - self.prepare) / self.steps if self.steps else 0.0


def cancel_check(cancel):
    """``cancel`` (None, a ``threading.Event`` or a zero-argument callable) as a callable or None."""
    if cancel is None or callable(cancel):
        return cancel
    if callable(getattr(cancel, "is_set", None)):
        return cancel.is_set
    raise bad("cancel", cancel, "expected a threading.Event or a zero-argument callable")


def count_step(stats: GenerationStats, timer: StepTimer, step: StepResult, t0: float) -> None:
    """One step of a request into its ``stats`` and ``timer`` (``t0``: when the step began)."""
    stats.steps += 1
    step.count_sources(stats.accepted_by_source, stats.nodes_by_source)
    timer.draft += step.propose_s
    timer.total += time.perf_counter() - t0
    timer.nodes += step.tree.num_draft_nodes
    timer.steps += 1
    timer.predicted += step.predicted
    timer.accepted += len(step.accepted)


def finish_stats(stats: GenerationStats, timer: StepTimer, elapsed: float, n_tokens: int) -> None:
    """A finished request's ``stats``: its ``n_tokens`` and the per-step means of ``timer``."""
    stats.new_tokens = n_tokens
    if stats.steps:
        stats.mean_accepted = max(0, n_tokens - stats.prefill_tokens) / stats.steps
        stats.mean_tree_nodes = timer.nodes / stats.steps
        stats.predicted_accepted = timer.predicted / stats.steps
        stats.realised_accepted = timer.accepted / stats.steps
        stats.draft_us = timer.draft / stats.steps * 1e6
        stats.overhead_us = timer.overhead_s() * 1e6
        stats.forward_ms = timer.forward / stats.steps * 1e3
        stats.logit_rows = timer.head_rows / stats.steps
        stats.logit_misses = timer.head_misses
    stats.kernel_ms = timer.prepare * 1e3
    stats.tokens_per_s = n_tokens / elapsed if elapsed > 0 else 0.0


def top_tokens(logits: torch.Tensor, rows: Sequence[int], k: int) -> list[list[int]]:
    """The ``k`` highest-scoring token ids of each of ``rows`` of ``logits`` [n, vocab], best
    first: one pass per row in the compiled core (CPU float32), else (another device or dtype, the
    extension not built) its definition, ``reference.request.top_tokens``."""
    fast = top_tokens_compiled(logits, rows, k)  # one pass per row in the compiled core (CPU float32)
    if fast is not None:
        return fast
    return reference_request.top_tokens(logits, rows, k)


class RequestCore:
    """The request-level rules of one engine (``Engine.request_core``): what one sequence
    (``Engine``) and a batch's rows (``BatchDecoder``) both apply to a request, on the engine's
    ``target`` (a ``TargetModel``), step (``StepCore``), proposers (``Mixture``) and ``config``
    (``EngineConfig``), with the tokenizer's ``eos_token_ids``."""

    def __init__(self, target, step_core, mixture, config, eos_token_ids) -> None:
        self.target = target
        self.step_core = step_core
        self.mixture = mixture
        self.config = config
        self.eos_token_ids = eos_token_ids

    def room(self, context) -> int:
        """How many more positions fit in the model's context (a large number if unbounded)."""
        limit = self.target.max_context
        return (1 << 30) if limit is None else limit - len(context)

    def clip(self, new: list[int], room: int) -> list[int]:
        """``new`` cut to ``room`` tokens and after its first EOS."""
        new = new[:room]
        for i, tok in enumerate(new):
            if tok in self.eos_token_ids:
                return new[: i + 1]
        return new

    def seen_ids(self, seen: set) -> torch.Tensor:
        """The distinct token ids ``seen`` so far (repetition penalty) as a tensor on the target's device."""
        return torch.tensor(sorted(seen), device=self.target.device)

    def first(self, rid: str, context: list[int], logits: torch.Tensor, params, generator, seen: set,
              limit: int) -> list[int]:
        """A request's first new token from its prefill's last ``logits`` [vocab]: exactly what a
        step verifying a tree of the root alone (the prompt's last token) accepts, the same
        draws from ``generator``, without that step's forward (a whole forward, a large share of
        a short answer's time); the proposers observe it, as after a step. One
        sequence (``Engine._steps``) and a batch's joining rows (``batch.py``) both take it here,
        so a seeded request draws the same alone or in a batch."""
        root = TokenTree([context[-1]], [-1])
        prev = context[-2] if len(context) > 1 else -1
        _, new, successors = self.accept(root, logits[None], params, generator, seen, limit, prev)
        self.step_core.first(rid, new, successors)
        return new

    def head_rows(self, tree: TokenTree, params) -> list[int] | None:
        """The nodes whose logits the verify forward computes up front (``sampling.head_rows``),
        or None for all: greedy acceptance on the compiled walk needs only the root's and the
        accepted nodes' rows, and asks for any other it reaches (``PartialLogits``)."""
        if not (self.target.partial_head and params.greedy and not params.uses_prefix):
            return None
        if len(tree) <= HEAD_MIN_ROWS:
            # every row (as cheap as one), with picks asked: where the head's form is the skinny
            # product it makes each row's best tokens as it writes the row (FastHead.project), and
            # the walk reads those, not rows of the vocabulary's width that the forward pushed out
            # of the caches (a step visits one to four)
            return list(range(len(tree))) if self.target.fast_head is not None else None
        return head_rows(range(len(tree)), tree.expected)

    def recycle_successors(self) -> int:
        """How many top tokens of each visited row token recycling keeps (0: none)."""
        return self.config.recycle.successors if self.mixture.successor_sinks else 0

    def picks(self) -> int:
        """The best token ids the output projection picks per row it writes: the greedy walk's
        argmax and recycling's top tokens (at least 1)."""
        return max(self.recycle_successors(), 1)

    def accept(self, tree: TokenTree, logits: torch.Tensor, params, generator, seen: set, limit: int,
               prev: int) -> tuple[list[int], list[int], tuple | None]:
        """Exact acceptance of ``tree`` against its ``logits`` (the KV commit is the caller's, one
        sequence or a batch); returns the accepted nodes, the new tokens cut to ``limit`` and
        after the first EOS, and token recycling's input (``Verdict.successors``: ``prev``, the
        token before the root, the visited nodes' tokens and the target's top tokens at each;
        None without recycling), which the step hands over with the observe (``Mixture.finish``)."""
        recycle = self.recycle_successors()
        result = accept(tree, logits, params, generator=generator,
                        context_ids=self.seen_ids(seen) if params.uses_prefix else None, top_k=recycle)
        nodes = [0, *result.accepted]  # the root, then each accepted node
        visited = result.tokens if result.tokens is not None else tree.tokens_of(nodes)
        successors = None
        if recycle:
            if result.tops is not None:
                tops = result.tops
            elif isinstance(logits, PartialLogits):  # the visited rows, computed where the walk had none
                logits.fill(nodes)
                tops = top_tokens(logits.logits, [int(logits.row_of[u]) for u in nodes], recycle)
            else:
                tops = top_tokens(logits, nodes, recycle)
            successors = (prev, visited, tops)
        return result.accepted, self.clip(visited[1:] + [result.next_token], limit), successors

    def cost_bucket(self, context_tokens: int) -> int:
        """The context-length bucket of a request (a power of 2, at least 64, at most half the
        model's context)."""
        limit = self.target.max_context or 1 << 20
        bucket = MIN_CALIBRATION_CONTEXT
        while bucket < context_tokens and bucket * 2 <= limit // 2:
            bucket *= 2
        return min(bucket, max(1, limit // 2))
