"""The definitions of the lookups' compiled drafting (``csrc/drafting/``, ``lookupdec.native.drafting``):
the n-gram index (``NgramIndex``), the recycling table (``RecycleTable``) and the suffix
automaton's drafts (``suffix_drafts``).

Each has the compiled call's interface (arguments, the bytes it returns), so the proposers take
it where the core is absent as they take the compiled one (``proposers/ngram.py``,
``proposers/recycle.py``; ``ReferenceAutomaton.suffix_drafts`` for ``proposers/suffix.py``); the
constants the core takes as arguments (decays, rank priors, match parameters) are arguments
here too. ``tests/proposers/test_ngram.py``, ``test_recycle.py`` and ``test_suffix.py`` compare
each with its compiled twin: the same drafts, arrays bit for bit.
"""
from __future__ import annotations

import heapq
import operator
from array import array
from typing import Sequence

INT32_MAX = 2**31 - 1
# RecycleTable's match lengths (a draft's ``match_length``; the compiled table's own):
PAIR_MATCH = 2  # the root's successors came from the (previous, last) pair
TOKEN_MATCH = 1  # ... from the last token alone


def _as_bytes(tokens: Sequence[int], parents: Sequence[int], scores: Sequence[float]) -> tuple[bytes, bytes, bytes]:
    """A draft's arrays as the compiled calls return them (``Draft.packed()``: int32, int32, float64)."""
    return array("i", tokens).tobytes(), array("i", parents).tobytes(), array("d", scores).tobytes()


# -- the n-gram index -------------------------------------------------------------------------------
class NgramIndex:
    """Defines ``native.drafting.NgramIndex`` (``csrc/drafting/ngram.cpp``), ``NgramProposer``'s
    per-request index: every n-gram of ``min_ngram`` to ``max_ngram`` tokens of the context and
    the positions it ended at; ``propose`` ranks earlier occurrences of the context's suffix
    (longest match, then latest) and drafts what followed them (module docstring of
    ``proposers/ngram.py``: branches, scores, periodic continuation)."""

    def __init__(self, min_ngram: int, max_ngram: int) -> None:
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self.tokens: list[int] = []
        self.ends: dict[tuple[int, ...], list[int]] = {}  # n-gram -> end positions

    def size(self) -> int:
        return len(self.tokens)

    def extend(self, new_ids: Sequence[int]) -> None:
        """Append tokens; a ValueError for an id outside [0, 2**31 - 1], with nothing kept."""
        new_ids = [operator.index(t) for t in new_ids]
        if any(t < 0 or t > INT32_MAX for t in new_ids):
            raise ValueError("token ids must be in [0, 2**31 - 1]")
        tokens, ends = self.tokens, self.ends
        lo, hi = self.min_ngram, self.max_ngram
        for tok in new_ids:
            tokens.append(tok)
            end = len(tokens)
            for n in range(lo, min(hi, end) + 1):
                ends.setdefault(tuple(tokens[end - n : end]), []).append(end)

    def occurrences(self):
        """(match length, end position) of earlier occurrences, longest match then latest first."""
        tokens, n = self.tokens, len(self.tokens)
        for match_len in range(min(self.max_ngram, n - 1), self.min_ngram - 1, -1):
            ends = self.ends.get(tuple(tokens[n - match_len :]), ())
            for end in reversed(ends):
                if end < n:  # the context's own suffix is not an earlier occurrence
                    yield match_len, end

    def propose(self, max_draft_tokens: int, max_branches: int, max_nodes: int, branch_decay: float,
                continue_prob: float) -> list[tuple[bytes, bytes, bytes, int]]:
        """Per draft (a chain): ``(token_ids, parents, scores, match_length)``, the arrays as bytes.
        Branch ``r`` found with match length ``L`` scores ``L / (L + 1) * branch_decay**r`` at its
        first token, each further token times ``continue_prob``; the ``max_nodes`` best-scored
        tokens are kept (``lengths_within_budget``)."""
        length = min(max_draft_tokens, max_nodes)
        found, seen = [], set()  # (first score, continuation start, match length)
        for match_len, end in self.occurrences():
            key = tuple(periodic_continuation(self.tokens, end, length))  # same draft, same branch
            if key in seen:
                continue
            seen.add(key)
            found.append((match_len / (match_len + 1) * branch_decay ** len(found), end, match_len))
            if len(found) == max_branches:
                break
        lengths = lengths_within_budget([first for first, _, _ in found], length, max_nodes, continue_prob)
        return [(*_as_bytes(periodic_continuation(self.tokens, end, n), range(-1, n - 1),
                          [first * continue_prob**d for d in range(n)]), match_len)
                for (first, end, match_len), n in zip(found, lengths) if n]


def lengths_within_budget(firsts: Sequence[float], length: int, max_nodes: int, continue_prob: float) -> list[int]:
    """How many tokens of each branch are among the ``max_nodes`` best-scored draft tokens, when
    branch ``r``'s token ``d`` scores ``firsts[r] * continue_prob**d``.

    >>> lengths_within_budget([0.9, 0.3], length=10, max_nodes=12, continue_prob=0.95)  # 0.3 ~ 0.9 * 0.95**21
    [10, 2]
    """
    if len(firsts) * length <= max_nodes:
        return [length] * len(firsts)
    scored = sorted(((f * continue_prob**d, r) for r, f in enumerate(firsts) for d in range(length)), reverse=True)
    lengths = [0] * len(firsts)
    for _, r in scored[:max_nodes]:
        lengths[r] += 1
    return lengths


def periodic_continuation(tokens: Sequence[int], start: int, length: int) -> list[int]:
    """``length`` tokens from ``tokens[start:]``, repeating with period ``len(tokens) - start``.

    >>> periodic_continuation([1, 2, 3, 1, 2], 2, 4)   # [1, 2] also ended at 2: period 3
    [3, 1, 2, 3]
    """
    out: list[int] = []
    n = len(tokens)
    for i in range(length):
        j = start + i
        out.append(tokens[j] if j < n else out[j - n])
    return out


# -- the recycling table ----------------------------------------------------------------------------
class RecycleTable:
    """Defines ``native.drafting.RecycleTable`` (``csrc/drafting/recycle.cpp``), the recycling
    proposer's table: the target's top ``successors`` tokens after each (previous, token) pair
    and each token alone, best first; past ``max_entries`` pairs the pair table starts over.
    ``propose`` grows a draft best-first from the context's last two tokens, a node scoring its
    parent's times ``rank_prior`` of its rank among the successors."""

    def __init__(self, successors: int, max_entries: int, rank_prior: Sequence[float]) -> None:
        self.successors, self.max_entries, self.rank_prior = successors, max_entries, tuple(rank_prior)
        self.by_pair: dict[tuple[int, int], tuple[int, ...]] = {}  # (previous, token) -> successors, best first
        self.by_token: dict[int, tuple[int, ...]] = {}  # token -> successors, best first

    def num_pairs(self) -> int:
        return len(self.by_pair)

    def num_tokens(self) -> int:
        return len(self.by_token)

    def observe(self, previous: Sequence[int], tokens: Sequence[int], successors: Sequence[Sequence[int]]) -> None:
        """The target's top tokens after each ``(previous[i], tokens[i])``, best first."""
        if len(self.by_pair) > self.max_entries:
            self.by_pair.clear()
        for prev, token, after in zip(previous, tokens, successors):
            after = tuple(after[: self.successors])
            self.by_pair[(prev, token)] = after
            self.by_token[token] = after

    def observe_path(self, prev: int, tokens: Sequence[int], successors: Sequence[Sequence[int]]) -> None:
        """``observe`` of a walked path: ``tokens``, each preceded by the one before it (``prev``
        before the first)."""
        self.observe([prev, *tokens[:-1]], tokens, successors)

    def lookup(self, prev: int, token: int) -> tuple[tuple[int, ...], int]:
        """The recorded successors of ``token`` after ``prev`` and the match length they rest on
        (``PAIR_MATCH``, ``TOKEN_MATCH``, or 0 with none)."""
        found = self.by_pair.get((prev, token))
        if found is not None:
            return found, PAIR_MATCH
        found = self.by_token.get(token)
        return (found, TOKEN_MATCH) if found is not None else ((), 0)

    def propose(self, prev: int, root: int, limit: int, max_depth: int) -> tuple[bytes, bytes, bytes, int]:
        """The draft under ``root`` (after ``prev``) of at most ``limit`` nodes and ``max_depth``
        levels: ``(token_ids, parents, scores, match_length)``, the arrays as bytes (empty: no
        successors recorded; the match length is ``lookup``'s all the same)."""
        first, match = self.lookup(prev, root)
        if not first or limit <= 0:
            return b"", b"", b"", match
        prior = self.rank_prior
        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []
        # heap of (-score, order, parent node, previous token, token, depth)
        heap = [(-prior[min(r, len(prior) - 1)], r, -1, root, t, 1) for r, t in enumerate(first)]
        heapq.heapify(heap)
        order = len(heap)
        while heap and len(tokens) < limit:
            neg, _, parent, before, token, depth = heapq.heappop(heap)
            node = len(tokens)
            tokens.append(token)
            parents.append(parent)
            scores.append(-neg)
            if depth < max_depth:
                for r, t in enumerate(self.lookup(before, token)[0]):
                    heapq.heappush(heap, (neg * prior[min(r, len(prior) - 1)], order, node, token, t, depth + 1))
                    order += 1
        return (*_as_bytes(tokens, parents, scores), match)


# -- the suffix automaton's drafts ------------------------------------------------------------------
def suffix_drafts(automaton, context: Sequence[int], max_nodes: int, min_match: int, levels: int,
                  shorter_divisor: int, separator: int, empty_confidence: float, match_prior: float,
                  certain_step: float) -> list[tuple]:
    """Defines ``native.drafting.Automaton.suffix_drafts`` (``csrc/drafting/suffix_drafts.cpp``),
    the suffix proposer's drafts (``proposers.suffix.automaton_drafts``), over the queries of
    ``automaton`` (``match``, ``continuation_count``, ``expand_tree``, ``suffix_link``,
    ``state_len``: a ``ReferenceAutomaton`` core, or a ``SuffixAutomaton`` over either core):
    drafts from the longest match of ``context`` and up to ``levels - 1`` shorter ones along
    suffix links (fewer context tokens, more occurrences, more varied continuations), a shorter
    one of ``max_nodes // shorter_divisor`` nodes (at least 1). A match of length ``L`` scales
    its subtree by ``(L + empty_confidence) / (L + empty_confidence + match_prior)``; a step every
    occurrence agreed on counts ``certain_step`` (``decay_certain_steps``); separator nodes are
    dropped with their descendants. Per draft,
    ``(token_ids, parents, scores, match_length, chain, chain_certain)``: the arrays as bytes; the
    first draft's best chain (the best-scored child from the root, the first of equals) and its
    certain-step flags as lists, None for the others. (As the compiled call: an id past int32 is
    a TypeError, which the wrapper names; a negative one a ValueError.)"""
    context = [operator.index(t) for t in context]
    if any(t > INT32_MAX for t in context):
        raise TypeError("suffix_drafts: token ids must fit int32")
    if any(t < 0 for t in context):
        raise ValueError("token ids must be in [0, 2**31 - 1]")
    state, length = automaton.match(context)
    out = []
    while state >= 0 and length >= min_match and len(out) < levels:
        if automaton.continuation_count(state):
            level_nodes = max_nodes if not out else max(1, max_nodes // shorter_divisor)
            # no depth cap of its own: n nodes are at most n deep (the step's merge caps the depth)
            token_ids, parents, raw = automaton.expand_tree(state, max_nodes=level_nodes, max_depth=level_nodes)
            tokens, parents, raw = without_separator(token_ids, parents, raw, separator)
            if tokens:
                confidence = (length + empty_confidence) / (length + empty_confidence + match_prior)
                scores, certain = decay_certain_steps(parents, raw, confidence, certain_step)
                chain = flags = None
                if not out:  # (the pending chain: the longest match's)
                    nodes = best_chain(parents, scores)
                    chain, flags = [tokens[u] for u in nodes], [certain[u] for u in nodes]
                out.append((*_as_bytes(tokens, parents, scores), length, chain, flags))
        state = automaton.suffix_link(state)
        length = automaton.state_len(state) if state >= 0 else -1
    return out


def decay_certain_steps(parents: Sequence[int], scores: Sequence[float], scale: float,
                        certain_step: float) -> tuple[list[float], list[bool]]:
    """Scores times ``scale``, where a step every earlier occurrence agreed on (conditional
    frequency 1, often a single occurrence) counts ``certain_step`` instead of 1: copying goes
    on with high but not total probability, learnt per workload. Also returns which nodes are
    such certain steps.

    >>> s, c = decay_certain_steps([-1, 0, 1], [1.0, 1.0, 0.5], 0.5, 0.9)
    >>> [round(x, 3) for x in s], c
    ([0.45, 0.405, 0.203], [True, True, False])
    """
    out: list[float] = []
    certain: list[bool] = []
    for i, p in enumerate(parents):
        parent_raw = 1.0 if p < 0 else scores[p]
        parent_new = scale if p < 0 else out[p]
        cond = scores[i] / parent_raw if parent_raw > 0 else 0.0
        certain.append(cond >= 1.0 - 1e-9)
        out.append(parent_new * (certain_step if certain[-1] else cond))
    return out, certain


def best_chain(parents: Sequence[int], scores: Sequence[float]) -> list[int]:
    """The nodes of the path that follows the best-scored child from the root (the first of
    equal scores), as ``Draft.best_chain`` takes it."""
    children: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        children.setdefault(p, []).append(i)
    nodes, node = [], -1
    while node in children:
        node = max(children[node], key=lambda i: scores[i])
        nodes.append(node)
    return nodes


def without_separator(token_ids, parents, scores, separator: int) -> tuple[list[int], list[int], list[float]]:
    """Drop ``separator`` nodes and their descendants; renumber parents.

    >>> without_separator([5, 0, 7, 8], [-1, -1, 1, 0], [.9, .5, .5, .8], separator=0)
    ([5, 8], [-1, 0], [0.9, 0.8])
    """
    token_ids, parents = token_ids.tolist() if hasattr(token_ids, "tolist") else list(token_ids), list(parents)
    scores = scores.tolist() if hasattr(scores, "tolist") else list(scores)
    if separator not in token_ids:
        return token_ids, [int(p) for p in parents], scores
    new_index, out_t, out_p, out_s = {}, [], [], []
    for i, (tok, par) in enumerate(zip(token_ids, parents)):
        if tok == separator or (par >= 0 and par not in new_index):
            continue
        new_index[i] = len(out_t)
        out_t.append(tok)
        out_p.append(-1 if par < 0 else new_index[par])
        out_s.append(scores[i])
    return out_t, out_p, out_s
