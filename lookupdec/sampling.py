"""Logits processing and acceptance. Pure torch, no model.

Vocabulary (used with these meanings everywhere in lookupdec):

- **draft tokens**: tokens proposed by the proposers, the non-root nodes of a ``TokenTree``.
- **accepted tokens**: draft tokens kept after verification (a root-to-node path of the tree).
- **bonus token**: the target's own next token after the last accepted node when that node has
  no children left to try (a leaf of the tree) — the token a plain decoder would emit there.
- **recovered token**: the token emitted at a node whose children were all rejected; drawn from
  the target distribution at that node (for point-mass drafts, the draw that matched no child).

Every step therefore emits ``len(accepted) + 1`` tokens.

Exactness. Row ``u`` of the verify logits is the target's distribution for the child of node
``u`` given the node's own prefix (context + the path to ``u``). Greedy acceptance follows the
child whose token is the argmax of the processed row and emits the argmax at the first node
without such a child: the output equals plain greedy decoding token for token. Sampling
acceptance draws ``y ~ target_probs[u]``; if a child of ``u`` carries ``y`` it moves there,
otherwise it emits ``y`` and stops. Each emitted token is thus a draw from the target's
processed distribution at its true prefix, so the output sequence has exactly the target's
distribution; lookup drafts are point masses, for which this rule is also the optimal one for a
fixed tree. The tree never depends on the generator's draws.

Draft-model children (``tree.samples[u] = (q, x_1..x_k)``, the x_i drawn i.i.d. from q by the
draft model). At such a node the point-mass children (lookups) are tried first with the draw
``y ~ p`` as above. If ``y`` is none of them, the residual is ``r = p`` with those tokens removed,
renormalised, and the samples are tried in order by recursive rejection sampling: accept
``x_i`` with probability ``min(1, r(x_i) / q(x_i))``; after a rejection ``r <- norm(max(0, r - q))``.
If none is accepted, ``z ~ r`` is the recovered token. (The code computes that stage's exact
output distribution, ``rejection_distribution``, and draws from it once: the same law.) Each
stage is exact, so the token emitted at the node has distribution ``p`` (averaged over the
draft's draws); the walk then
continues into the child carrying the emitted token if the tree has one, else stops there
(an accepted sample whose node was pruned is emitted and ends the step).
"""
from __future__ import annotations

import time
from typing import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from lookupdec.tree import TokenTree
from lookupdec.validate import check_sampling


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int | None = None  # keep the k most likely tokens
    top_p: float | None = None  # keep the smallest set with at least this mass, in (0, 1]
    repetition_penalty: float | None = None  # > 0; 1.0 or None = off (HF/CTRL definition)

    def __post_init__(self) -> None:  # the checks every entry point shares (ParamError naming the field)
        check_sampling(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                       repetition_penalty=self.repetition_penalty)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_prefix(self) -> bool:
        return self.repetition_penalty is not None and self.repetition_penalty != 1.0


def process_row(
    logits: torch.Tensor,  # [vocab] raw target logits for one node
    prefix_ids: torch.Tensor | None,  # [m] token ids of the node's own prefix (rep. penalty)
    params: SamplingParams,
) -> torch.Tensor:
    """Processed logits for one node, in transformers' order: repetition penalty,
    temperature, top-k, top-p. Masked entries are ``-inf``."""
    scores = logits.float()
    if params.uses_prefix and prefix_ids is not None and prefix_ids.numel():
        seen = scores.gather(0, prefix_ids)
        seen = torch.where(seen < 0, seen * params.repetition_penalty, seen / params.repetition_penalty)
        scores = scores.scatter(0, prefix_ids, seen)
    if params.greedy:
        return scores
    scaled = scores / params.temperature
    if bool(torch.isposinf(scaled).any()) or bool(torch.isnan(scaled).any()):
        scaled = _scaled_in_the_limit(scores, params.temperature)
    scores = scaled
    if params.top_k is not None and params.top_k < scores.numel():
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p is not None and params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=False)
        cum = sorted_scores.softmax(-1).cumsum(-1)
        remove_sorted = cum <= 1 - params.top_p
        remove_sorted[-1] = False  # keep at least one token
        remove = remove_sorted.scatter(0, order, remove_sorted)
        scores = scores.masked_fill(remove, float("-inf"))
    return scores


def _scaled_in_the_limit(scores: torch.Tensor, temperature: float) -> torch.Tensor:
    """``scores / temperature`` when that overflows or is undefined (a temperature like 1e-40 or
    1e300, which float32 holds as 0 or inf; a repetition penalty like 1e-300 that made some
    scores infinite): the same distribution computed without
    overflow, ``(scores - max) / temperature`` (largest entries 0); if some scores are already
    ``+inf``, the limit, uniform over them. The ordinary path never comes here."""
    top = scores.max()
    if torch.isposinf(top):
        return torch.where(torch.isposinf(scores), 0.0, float("-inf"))
    below = scores - top  # <= 0; the temperature may be 0 in float32 (1e-300): the top entries stay 0
    scaled = torch.where(below == 0, 0.0, below / temperature)
    return torch.where(torch.isnan(scaled), float("-inf"), scaled)  # -inf / inf (1e300 in float32): still masked


def target_probs(logits: torch.Tensor, prefix_ids: torch.Tensor | None, params: SamplingParams) -> torch.Tensor:
    """The processed target distribution of one node.  [vocab]"""
    return process_row(logits, prefix_ids, params).softmax(-1)


@dataclass(slots=True)  # (not frozen: a frozen dataclass's __init__ costs more, every step)
class Acceptance:
    accepted: list[int]  # accepted node indices, root's child first (root excluded)
    next_token: int  # the bonus or recovered token emitted after them
    bonus: bool  # True: next_token is a bonus token (emitted at a leaf); else recovered
    # with ``accept(top_k=k)`` on the compiled greedy path: the k best token ids of every row the
    # walk visited (the root's, then each accepted node's), best first; else None
    tops: list | None = None
    # where the compiled walk ran: the token ids of the root and of each accepted node (what
    # ``tree.tokens_of([0, *accepted])`` returns); else None
    tokens: list | None = None


def residual(r: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``norm(max(0, r - q))``: what is left of ``r`` after rejecting a draw from ``q``.  [vocab]

    >>> residual(torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0.2, 0.6, 0.2])).tolist()
    [1.0, 0.0, 0.0]
    """
    left = (r - q).clamp_min(0)
    total = left.sum()
    return left / total if total > 0 else r  # total == 0 only if r == q: then nothing is rejected


def rejection_distribution(r: torch.Tensor, q: torch.Tensor, drawn) -> torch.Tensor:
    """The distribution of the token that recursive rejection sampling emits against ``r``
    given the draft's draws ``drawn`` (i.i.d. from ``q``): ``x_i`` is accepted with probability
    ``min(1, r(x_i)/q(x_i))`` after all earlier ones were rejected, ``r`` becoming
    ``residual(r, q)`` at each rejection; if all are rejected the token is drawn from the last
    ``r``. Drawing once from this distribution is the same as running the draws one by one.
    Averaged over the draws, it is ``r`` itself (the tests check this in closed form).  [vocab]
    """
    out = torch.zeros_like(r)
    stay = 1.0  # probability that every draw so far was rejected
    for x in drawn:
        a = min(1.0, float(r[x]) / float(q[x])) if q[x] > 0 else 0.0
        out[x] += stay * a
        stay *= 1.0 - a
        if stay <= 0.0:
            return out
        r = residual(r, q)
    return out + stay * r


def node_distribution(p: torch.Tensor, lookup_tokens, q: torch.Tensor, drawn) -> torch.Tensor:
    """The distribution of the token emitted at a node with point-mass children
    ``lookup_tokens`` (tried first: each is taken with its probability under ``p``) and draft
    draws ``drawn`` from ``q`` (rejection sampling against the rest of ``p``).  [vocab]"""
    p = p.double()
    q = q.to(p.device, torch.float64)
    lookup = list(lookup_tokens)
    out = torch.zeros_like(p)
    rest = p.clone()
    if lookup:
        out[lookup] = p[lookup]
        rest[lookup] = 0.0
    mass = float(rest.sum())
    if mass <= 0.0:
        return out
    return out + mass * rejection_distribution(rest / mass, q, drawn)


def _rejection_sample(tree: TokenTree, node: int, y: int, p: torch.Tensor, generator) -> int:
    """The token emitted at a node with draft-model samples, given the point-mass draw ``y ~ p``:
    ``y`` if a lookup child carries it, else a draw from the rejection stage's distribution
    (``rejection_distribution`` of the rest of ``p``; fresh randomness, so exact)."""
    lookup = [tok for tok, child in tree.children[node].items() if tree.point_mass[child]]
    if y in lookup:
        return y
    q, drawn = tree.samples[node]
    rest = p.double().clone()
    if lookup:
        rest[lookup] = 0.0
    dist = rejection_distribution(rest / rest.sum(), q.to(p.device, torch.float64), drawn)
    return int(torch.multinomial(dist, 1, generator=generator))


class PrefixTracker:
    """Token ids of each node's own prefix, for repetition penalty.  Built lazily."""

    def __init__(self, context_ids: torch.Tensor, tree: TokenTree) -> None:
        self.context_ids = context_ids  # [c] committed token ids (root included), any order
        self.tree = tree

    def of(self, node: int) -> torch.Tensor:
        path = self.tree.path_to(node)
        if not path:
            return self.context_ids
        extra = torch.tensor([self.tree.token_ids[i] for i in path], device=self.context_ids.device)
        # duplicates are harmless: gather/scatter of one token read and write the same value
        return torch.cat([self.context_ids, extra])


def accept(
    tree: TokenTree,
    logits: torch.Tensor,  # [1 + n, vocab] verify logits, row u = distribution after node u
    params: SamplingParams,
    *,
    context_ids: torch.Tensor | None = None,  # [c] unique committed ids (for repetition penalty)
    generator: torch.Generator | None = None,
    top_k: int = 0,
) -> Acceptance:
    """Walk the tree from the root, keeping draft tokens the target agrees with.

    Greedy without a repetition penalty takes the argmax of only the rows the walk visits on
    the CPU (a row's argmax costs a small share of the whole tensor's, and the walk visits the
    accepted nodes plus one), in one call into the compiled core for float32 logits
    (``TokenTree.greedy_walk``); on an accelerator, one argmax over every row and one transfer.
    ``lookupdec.reference.sampling.accept`` defines these greedy walks (every row's argmax
    first); they give its result.

    ``top_k`` > 0 asks for the ``top_k`` best tokens of every visited row too (token recycling's
    input), read in the walk's own pass over each row: ``Acceptance.tops`` where the compiled
    greedy walk ran, else None (the caller then takes them itself, ``engine.top_tokens``)."""
    return _accept(tree, logits, params, context_ids=context_ids, generator=generator, top_k=top_k)


def top_tokens_compiled(logits: torch.Tensor, rows, k: int) -> list[list[int]] | None:
    """The ``k`` highest-scoring token ids of each of ``rows`` of CPU float32 ``logits`` [n,
    vocab], best first, as repeated argmax picks them (``engine.top_tokens``: first of equal
    values, NaN as the largest): one pass per row in the compiled core. None where it does not
    apply (another device or dtype, no core)."""
    from lookupdec.native import tree as native_tree

    if (native_tree is None or logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.dim() != 2
            or logits.stride(-1) != 1):
        return None
    return native_tree.top_tokens(logits.detach().numpy(), list(rows), k)


HEAD_MIN_ROWS = 8  # rows the output projection computes as fast as one on a CPU (its weights' read dominates)
HEAD_ROW_THRESHOLD = 0.1  # a node's row is computed up front when the walk reaches it this likely


class GreedyChoices:
    """What greedy acceptance reads of a tree's logits, taken for a whole batch at once: every
    node's argmax and, for token recycling, its ``k`` best tokens (``of_batch``). On an
    accelerator each sequence's own argmax and top-k would wait for the device twice per row
    and step; the batch waits once. ``accept`` walks these as it walks the logits (greedy
    without a repetition penalty only)."""

    def __init__(self, argmax: list[int], tops: list[list[int]] | None) -> None:
        self.argmax, self.tops = argmax, tops

    @staticmethod
    def of_batch(logits: torch.Tensor, lengths: Sequence[int], k: int) -> list["GreedyChoices"]:
        """One ``GreedyChoices`` per row of ``logits`` [rows, width, vocab], its first
        ``lengths[b]`` nodes; ``k`` > 0: the ``k`` best tokens too. One transfer from the device."""
        argmax = logits.argmax(-1)  # the first of equal maxima, as torch.argmax of each row alone
        picked = torch.cat([argmax[..., None], logits.topk(k, dim=-1).indices], -1) if k else argmax[..., None]
        picked = picked.tolist()
        return [GreedyChoices([node[0] for node in row[:n]], [node[1:] for node in row[:n]] if k else None)
                for row, n in zip(picked, lengths)]


class PartialLogits:
    """A verify forward's logits for some of the tree's nodes, the rest computed on demand.

    The output projection is a sixth of SmolLM2's forward, and a verify forward needs the row of
    only the root and the nodes accepted. ``TargetModel.verify(tree, rows=...)`` computes the
    rows of the nodes likeliest to be reached (``head_rows``) and keeps the final hidden states,
    so the walk can ask for any other row (``fill``), the same projection of the same hidden
    state. ``accept`` walks these directly (greedy, compiled); any other path takes ``dense()``.
    """

    def __init__(self, tree: TokenTree, rows: list[int], logits: torch.Tensor, hidden: torch.Tensor, head,
                 tops: np.ndarray | None = None) -> None:
        self.tree = tree
        self.hidden = hidden  # [1 + n, d] final hidden states (after the model's last norm)
        self.head = head  # hidden rows [m, d] -> (float32 logits [m, vocab], seconds of it spent preparing)
        self.logits = logits.contiguous()  # [len(rows), vocab] (the walk reads rows as arrays)
        self.float32 = logits.dtype == torch.float32  # (the compiled walk's dtype: read once, not per step)
        # [len(rows), k] int32: each row's k best token ids (top_tokens' order), made by the output
        # projection as it wrote the rows (TargetModel.verify(picks=k)); the walk reads these
        self.tops = tops
        self.row_of = np.full(len(tree), -1, dtype=np.int32)
        self.row_of[rows] = np.arange(len(rows), dtype=np.int32)
        self.misses = 0  # walks that reached a node without a row
        self.extra_s = 0.0  # seconds spent computing rows on demand

    @property
    def computed(self) -> int:
        return len(self.logits)

    def fill(self, nodes) -> None:
        """Compute the rows of ``nodes`` (those not computed yet)."""
        nodes = [u for u in nodes if self.row_of[u] < 0]
        if not nodes:
            return
        t = time.perf_counter()
        extra, prepared = self.head(self.hidden[nodes])
        self.row_of[nodes] = np.arange(len(self.logits), len(self.logits) + len(nodes), dtype=np.int32)
        self.logits = torch.cat([self.logits, extra])
        if self.tops is not None:  # the new rows' picks, read while they are in cache
            picked = top_tokens_compiled(extra, range(len(nodes)), self.tops.shape[1])
            self.tops = None if picked is None else np.concatenate([self.tops, np.asarray(picked, dtype=np.int32)])
        self.extra_s += time.perf_counter() - t - prepared

    def fill_from(self, node: int) -> None:
        """A walk reached ``node`` without its row: compute it and the rows below it likeliest to be
        reached from it (at least ``HEAD_MIN_ROWS``, as cheap as one)."""
        self.misses += 1
        parents, expected = self.tree.parents, self.tree.expected
        below = [False] * len(parents)
        below[node] = True
        sub = [node]
        for i in range(node + 1, len(parents)):
            if below[parents[i]]:
                below[i] = True
                sub.append(i)
        self.fill(head_rows(sub, expected, base=max(expected[node], 1e-12)))

    def dense(self) -> torch.Tensor:
        """Every node's row, in node order [1 + n, vocab]."""
        self.fill(range(len(self.row_of)))
        return self.logits[torch.from_numpy(self.row_of.astype(np.int64))]


def head_rows(nodes, expected, *, base: float = 1.0, threshold: float = HEAD_ROW_THRESHOLD,
              min_rows: int = HEAD_MIN_ROWS) -> list[int]:
    """Of ``nodes`` (the first one always), those whose chance of being reached (``expected``,
    relative to ``base``) is at least ``threshold``, and at least ``min_rows`` of the likeliest.

    >>> head_rows([0, 1, 2, 3], [1.0, 0.9, 0.05, 0.3], min_rows=2)
    [0, 1, 3]
    """
    nodes = list(nodes)
    if len(nodes) <= min_rows:
        return nodes
    rest = sorted(nodes[1:], key=lambda u: -expected[u])
    keep = max(min_rows - 1, sum(1 for u in rest if expected[u] >= threshold * base))
    return sorted([nodes[0], *rest[:keep]])


def _greedy_rows(logits: torch.Tensor):
    """``pick(node)``: the argmax of row ``node`` (the first of equal maxima, as ``torch.argmax``)."""
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64):
        rows = logits.detach().numpy()  # a view: numpy's argmax of one row is the fastest on a CPU
        return lambda node: int(rows[node].argmax())
    choice = logits.argmax(-1).tolist()  # one sync for the whole tree
    return choice.__getitem__


def _accept(tree: TokenTree, logits, params: SamplingParams, *, context_ids, generator, top_k: int = 0) -> Acceptance:
    if isinstance(logits, GreedyChoices):
        if not params.greedy or params.uses_prefix or (top_k and logits.tops is None):
            raise ValueError("GreedyChoices: greedy acceptance without a repetition penalty only")
        accepted, node, children = [], 0, tree.children
        while True:
            token = logits.argmax[node]
            child = children[node].get(token)
            if child is None:
                tops = [logits.tops[u] for u in (0, *accepted)] if top_k else None
                return Acceptance(accepted, token, bonus=not children[node], tops=tops)
            accepted.append(child)
            node = child
    if isinstance(logits, PartialLogits):
        if logits.float32 and params.greedy and not params.uses_prefix:
            accepted, tops, tokens, start = [], [] if top_k else None, [], 0
            while True:  # walk the rows computed; a node reached without one gets its rows, and the walk goes on
                choices = logits.tops if logits.tops is not None and logits.tops.shape[1] >= max(top_k, 1) else None
                rows = logits.logits.numpy() if choices is None else None  # (only when needed: a cold .numpy() is not free)
                walked = tree.greedy_walk(rows, top_k, logits.row_of.tobytes(), start, choices)
                if walked is None:
                    break
                more, token, bonus, more_tops, missing, path = walked
                if missing < 0 and not start:  # (the walk's own lists: no row was missing)
                    return Acceptance(more, token, bonus, more_tops, path)
                accepted += more
                if top_k:
                    tops += more_tops
                tokens += path[1:] if start else path  # (a walk resumed at ``start`` repeats its token)
                if missing < 0:
                    return Acceptance(accepted, token, bonus, tops, tokens)
                logits.fill_from(missing)
                start = missing
        logits = logits.dense()
    if (params.greedy and not params.uses_prefix and logits.device.type == "cpu"
            and logits.dtype == torch.float32 and logits.dim() == 2 and logits.stride(-1) == 1):
        # one call, one pass over each visited row (its argmax, or its top_k whose first is that)
        walked = tree.greedy_walk(logits.detach().numpy(), top_k)
        if walked is not None:
            return Acceptance(*walked[:4], tokens=walked[5])
    probs_cache: dict[int, torch.Tensor] = {}
    if params.greedy and not params.uses_prefix:
        pick = _greedy_rows(logits)
    else:
        prefixes = PrefixTracker(context_ids, tree) if params.uses_prefix else None

        def pick(node: int) -> int:
            row = process_row(logits[node], prefixes.of(node) if prefixes else None, params)
            if params.greedy:
                return int(row.argmax())
            probs_cache[node] = row.softmax(-1)
            return int(torch.multinomial(probs_cache[node], 1, generator=generator))

    def probs_of(node: int) -> torch.Tensor:
        return probs_cache[node]

    children = tree.children
    sampled = bool(tree.samples) and not params.greedy
    accepted, node = [], 0
    while True:
        token = pick(node)
        if sampled and node in tree.samples:
            token = _rejection_sample(tree, node, token, probs_of(node), generator)
        child = children[node].get(token)
        if child is None:
            return Acceptance(accepted, token, bonus=not children[node])
        accepted.append(child)
        node = child
