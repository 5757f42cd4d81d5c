"""The definition of the compiled suffix automaton (``csrc/drafting/automaton.cpp``,
``lookupdec.native.drafting.Automaton``): a pure-Python automaton core.

APPEND-ONLY, like the compiled core: a change in the middle needs a rebuild.

It has the compiled core's interface, so ``lookupdec.automaton.SuffixAutomaton`` wraps either
(this one where the extension is absent; ``tests/automaton/test_automaton.py`` hands one in to
compare them), and builds the same states in the same order (the classic online construction:
the new state first, then a clone), so state ids agree between the two. It favours obviousness
over speed: transitions are dicts, and counts and end positions are recomputed from scratch
after every extend (by sorting the states by length), never maintained. Use it for tests and
small inputs only.
"""
from __future__ import annotations

import heapq
import itertools
from typing import Sequence

import numpy as np

from lookupdec.reference import drafting

ROOT = 0


class ReferenceAutomaton:
    """Defines ``native.drafting.Automaton`` (its states, counts, end positions, best-first
    trees and the suffix proposer's drafts)."""

    def __init__(self) -> None:
        self._tokens: list[int] = []
        self._len: list[int] = [0]  # [num_states] length of the longest string of each state
        self._link: list[int] = [-1]  # [num_states] suffix link
        self._next: list[dict[int, int]] = [{}]  # [num_states] token -> target state
        self._is_clone: list[bool] = [False]  # [num_states]
        self._last = ROOT
        self._counts: list[int] | None = None  # [num_states] |endpos|, None = stale
        self._last_ends: list[int] = []  # [num_states] most recent end position

    # ------------------------------------------------------------ construction

    def extend(self, tokens: Sequence[int]) -> None:
        tokens = [int(t) for t in tokens]
        if any(t < 0 for t in tokens):
            raise ValueError("token ids must be >= 0")
        for token in tokens:
            self._extend_one(token)
        self._counts = None

    def _new_state(self, length: int, is_clone: bool) -> int:
        self._len.append(length)
        self._link.append(-1)
        self._next.append({})
        self._is_clone.append(is_clone)
        return len(self._len) - 1

    def _extend_one(self, token: int) -> None:
        self._tokens.append(token)
        cur = self._new_state(self._len[self._last] + 1, False)
        p = self._last
        while p != -1 and token not in self._next[p]:
            self._next[p][token] = cur
            p = self._link[p]
        if p == -1:
            self._link[cur] = ROOT
        else:
            q = self._next[p][token]
            if self._len[p] + 1 == self._len[q]:
                self._link[cur] = q
            else:
                clone = self._new_state(self._len[p] + 1, True)
                self._next[clone] = dict(self._next[q])
                self._link[clone] = self._link[q]
                while p != -1 and self._next[p].get(token) == q:
                    self._next[p][token] = clone
                    p = self._link[p]
                self._link[q] = self._link[cur] = clone
        self._last = cur

    # ------------------------------------------------------------ sizes

    def size(self) -> int:
        return len(self._tokens)

    def num_states(self) -> int:
        return len(self._len)

    def num_edges(self) -> int:
        return sum(len(edges) for edges in self._next)

    def last_state(self) -> int:
        return self._last

    def tokens(self) -> np.ndarray:
        return np.asarray(self._tokens, dtype=np.int32)  # [n], a copy

    # ------------------------------------------------------------ counts

    def _is_leaf(self, state: int) -> bool:
        return state != ROOT and not self._is_clone[state]

    def _recount(self) -> None:
        """count = leaves in the suffix-link subtree; last_end = newest leaf's end position
        (a leaf of length L ends at position L)."""
        counts = [1 if self._is_leaf(s) else 0 for s in range(self.num_states())]
        last_ends = [self._len[s] if self._is_leaf(s) else 0 for s in range(self.num_states())]
        for s in sorted(range(1, self.num_states()), key=lambda s: -self._len[s]):
            parent = self._link[s]
            counts[parent] += counts[s]
            last_ends[parent] = max(last_ends[parent], last_ends[s])
        self._counts, self._last_ends = counts, last_ends

    def _fresh_counts(self) -> list[int]:
        if self._counts is None:
            self._recount()
        return self._counts

    # ------------------------------------------------------------ queries

    def _check_state(self, state: int) -> None:
        if not 0 <= state < self.num_states():
            raise IndexError(f"state {state} out of range [0, {self.num_states()})")

    def match(self, context: Sequence[int]) -> tuple[int, int]:
        state, length = ROOT, 0
        for token in context:
            token = int(token)
            while state != ROOT and token not in self._next[state]:
                state = self._link[state]
                length = self._len[state]
            if token in self._next[state]:
                state, length = self._next[state][token], length + 1
            else:
                length = 0
        return state, length

    def state_len(self, state: int) -> int:
        self._check_state(state)
        return self._len[state]

    def suffix_link(self, state: int) -> int:
        self._check_state(state)
        return self._link[state]

    def count(self, state: int) -> int:
        self._check_state(state)
        return self._fresh_counts()[state]

    def continuation_count(self, state: int) -> int:
        at_end = self.size() > 0 and self.most_recent_end(state) == self.size()
        return self.count(state) - int(at_end)

    def most_recent_end(self, state: int) -> int:
        self._check_state(state)
        self._fresh_counts()
        return self._last_ends[state]

    def end_positions(self, state: int, limit: int) -> np.ndarray:
        self._check_state(state)
        children: dict[int, list[int]] = {}
        for s in range(1, self.num_states()):
            children.setdefault(self._link[s], []).append(s)
        ends, stack = [], [state]
        while stack:
            s = stack.pop()
            if self._is_leaf(s):
                ends.append(self._len[s])
            stack.extend(children.get(s, []))
        return np.asarray(sorted(ends, reverse=True)[:max(limit, 0)], dtype=np.int32)

    def next_counts(self, state: int) -> tuple[np.ndarray, np.ndarray]:
        self._check_state(state)
        counts = self._fresh_counts()
        tokens = list(self._next[state])
        return (np.asarray(tokens, dtype=np.int32),
                np.asarray([counts[self._next[state][t]] for t in tokens], dtype=np.int32))

    def expand_tree(self, state: int, max_nodes: int, max_depth: int):
        """Best-first: pop the candidate with the highest score (ties: pushed first); children
        of a node are pushed in order of count (desc), then token (asc), ALL of them (the
        compiled core pushes only as many as can still be taken: same result)."""
        self._check_state(state)
        counts = self._fresh_counts()
        heap: list[tuple[float, int, int, int, int, int]] = []  # -score, seq, parent, state,
        #                                                            token, depth
        order = itertools.count()  # push order, breaks ties of score
        token_ids, parents, scores = [], [], []

        def push_children(s: int, node: int, score: float, depth: int) -> None:
            children = sorted(((counts[t], tok, t) for tok, t in self._next[s].items()),
                              key=lambda c: (-c[0], c[1]))
            total = sum(c[0] for c in children)
            for count, tok, target in children:
                child_score = score * (count / total)
                heapq.heappush(heap, (-child_score, next(order), node, target, tok, depth))

        if max_depth >= 1:
            push_children(state, -1, 1.0, 1)
        while heap and len(token_ids) < max_nodes:
            neg_score, _, parent, target, tok, depth = heapq.heappop(heap)
            token_ids.append(tok)
            parents.append(parent)
            scores.append(-neg_score)
            if depth < max_depth:
                push_children(target, len(token_ids) - 1, -neg_score, depth + 1)
        return (np.asarray(token_ids, dtype=np.int32), np.asarray(parents, dtype=np.int32),
                np.asarray(scores, dtype=np.float64))

    def propose_tree(self, context: Sequence[int], max_nodes: int, max_depth: int,
                     min_match: int, min_count: int):
        """match, then suffix links while fewer than min_count occurrences continue, then
        expand_tree; empty if the match is shorter than min_match."""
        state, length = self.match(context)
        while length > 0 and self.continuation_count(state) < min_count:
            state = self._link[state]
            length = self._len[state]
        if length < min_match:
            return self.expand_tree(state, 0, 0)  # empty arrays
        return self.expand_tree(state, max_nodes, max_depth)

    def suffix_drafts(self, context: Sequence[int], max_nodes: int, min_match: int, levels: int,
                      shorter_divisor: int, separator: int, empty_confidence: float, match_prior: float,
                      certain_step: float) -> list[tuple]:
        """The suffix proposer's drafts in one call: ``reference.drafting.suffix_drafts`` over
        this automaton."""
        return drafting.suffix_drafts(self, context, max_nodes, min_match, levels, shorter_divisor, separator,
                                      empty_confidence, match_prior, certain_step)

    # ------------------------------------------------------------ checks

    def check_invariants(self) -> str:
        for s in range(1, self.num_states()):
            if self._len[self._link[s]] >= self._len[s]:
                return f"state {s}: len(link) >= len"
            for tok, t in self._next[s].items():
                if self._len[t] < self._len[s] + 1:
                    return f"state {s}: edge {tok} to a state with len < len + 1"
        if self.match(self._tokens) != (self._last, self.size()):
            return "the whole stream does not lead to the last state"
        return ""

    def memory_report(self) -> dict[str, int]:
        return {}  # not measured: the reference is not meant to be small
