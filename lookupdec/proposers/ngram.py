"""Prompt n-gram lookup: copy what followed earlier occurrences of the context's suffix.

The context is the prompt plus the output so far. For match lengths ``max_ngram`` down to
``min_ngram``, the last ``L`` tokens are looked up in an index of every earlier n-gram; each
occurrence proposes the tokens that followed it. Occurrences are ranked by match length, then
recency (latest first); up to ``max_branches`` distinct continuations become branches of the
draft tree. A continuation that runs into the end of the context continues periodically (the
text is assumed to repeat with the period the match implies), so a repeating pattern drafts
long chains.

Worked example (min_ngram=1, max_ngram=3, max_branches=2, max_draft_tokens=3)::

    context = [5, 1, 2, 3, 9, 1, 2, 4, 7, 1, 2]
    the 3-gram [7, 1, 2] never occurred before; the 2-gram [1, 2] ended at 7 and at 3:
    branch 0 (latest):  [4, 7, 1]
    branch 1:           [3, 9, 1]

Scores estimate acceptance: the first token of branch ``r`` found with match length ``L`` gets
``L / (L + 1) * BRANCH_DECAY**r`` and each further token multiplies by ``CONTINUE_PROB``.

The index and the drafts run in the compiled core (``csrc/drafting/ngram.cpp``: the same ranking, ties
and float operations) when it is built; ``backend="reference"`` runs the pure-Python definition
below (``tests/proposers/test_ngram.py`` compares them).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from lookupdec.automaton import _int32_tokens, compiled_available
from lookupdec.config import NgramConfig
from lookupdec.proposers.base import Draft, RequestRegistry

BRANCH_DECAY = 0.6  # score ratio between consecutive branches of one lookup
CONTINUE_PROB = 0.95  # probability that a copied continuation keeps matching one more token


@dataclass
class _NgramIndex:
    tokens: list[int] = field(default_factory=list)
    ends: dict[tuple[int, ...], list[int]] = field(default_factory=dict)  # n-gram -> end positions


class NgramProposer:
    name = "ngram"
    fused_kind = "n"  # Mixture.plan's code for it (compiled_lookup)

    def __init__(self, config: NgramConfig | None = None, *, backend: str = "auto") -> None:
        """``backend``: "auto" (the compiled index when built, else the reference), "compiled"
        or "reference" (the pure-Python index and ranking below; the same drafts)."""
        if backend not in ("auto", "compiled", "reference"):
            raise ValueError(f"backend must be 'auto', 'compiled' or 'reference', got {backend!r}")
        if backend == "compiled" and not compiled_available():
            raise ImportError("lookupdec's compiled core (lookupdec._native) is not built: run `pip install -e .`")
        self.config = config or NgramConfig()
        self.backend = "compiled" if backend != "reference" and compiled_available() else "reference"
        self._requests = RequestRegistry("NgramProposer")

    def start(self, request_id: str, prompt_ids: Sequence[int]) -> None:
        if request_id in self._requests:
            self._requests.add(request_id, None)  # raises, naming the request
        if self.backend == "compiled":
            from lookupdec.native import drafting as native_drafting

            state = native_drafting.NgramIndex(self.config.min_ngram, self.config.max_ngram)
        else:
            state = _NgramIndex()
        self._extend(state, prompt_ids)  # first: a rejected prompt leaves no request behind
        self._requests.add(request_id, state)

    def observe(self, request_id: str, new_ids: Sequence[int]) -> None:
        self._extend(self._requests.get(request_id), new_ids)

    def stop(self, request_id: str) -> None:
        self._requests.pop(request_id)

    def propose(self, request_id: str, context: Sequence[int], max_nodes: int) -> list[Draft]:
        state = self._requests.get(request_id)
        seen = len(state.tokens) if isinstance(state, _NgramIndex) else state.size()
        if seen != len(context):
            raise ValueError(f"NgramProposer: request {request_id!r} saw {seen} tokens, "
                             f"context has {len(context)} (observe() missed?)")
        if max_nodes <= 0:
            return []
        if not isinstance(state, _NgramIndex):
            config = self.config
            return [Draft._trusted(None, None, None, self.name, match_len, packed=(tokens, parents, scores))
                    for tokens, parents, scores, match_len in state.propose(
                        config.max_draft_tokens, config.max_branches, max_nodes, BRANCH_DECAY, CONTINUE_PROB)]
        length = min(self.config.max_draft_tokens, max_nodes)
        found, seen = [], set()  # (first score, continuation start)
        for match_len, end in self._occurrences(state):
            key = tuple(periodic_continuation(state.tokens, end, length))  # same draft, same branch
            if key in seen:
                continue
            seen.add(key)
            found.append((match_len / (match_len + 1) * BRANCH_DECAY ** len(found), end, match_len))
            if len(found) == self.config.max_branches:
                break
        lengths = lengths_within_budget([first for first, _, _ in found], length, max_nodes)
        return [
            Draft.chain(periodic_continuation(state.tokens, end, n),
                        [first * CONTINUE_PROB**d for d in range(n)], self.name, match_length=match_len)
            for (first, end, match_len), n in zip(found, lengths) if n
        ]

    def compiled_lookup(self, request_id: str) -> tuple | None:
        """For ``Mixture.plan`` (the lookups' drafts and their merge in one compiled call): the
        request's compiled index and ``propose``'s parameters; None on the reference backend."""
        if self.backend != "compiled":
            return None
        config = self.config
        return self._requests.get(request_id), (config.max_draft_tokens, config.max_branches, BRANCH_DECAY,
                                                CONTINUE_PROB)

    def _occurrences(self, state: _NgramIndex):
        """(match length, end position) of earlier occurrences, longest match then latest first."""
        tokens, n = state.tokens, len(state.tokens)
        for match_len in range(min(self.config.max_ngram, n - 1), self.config.min_ngram - 1, -1):
            ends = state.ends.get(tuple(tokens[n - match_len :]), ())
            for end in reversed(ends):
                if end < n:  # the context's own suffix is not an earlier occurrence
                    yield match_len, end

    def _extend(self, state, new_ids: Sequence[int]) -> None:
        if not isinstance(state, _NgramIndex):
            try:
                state.extend(new_ids if type(new_ids) is list else _int32_tokens(new_ids).tolist())
            except TypeError:
                _int32_tokens(new_ids)  # raises the ValueError naming ids outside int32
                raise
            return
        _int32_tokens(new_ids)  # the compiled index's check: ids outside [0, 2**31 - 1] are a ValueError
        tokens, ends = state.tokens, state.ends
        lo, hi = self.config.min_ngram, self.config.max_ngram
        for tok in new_ids:
            tokens.append(int(tok))
            end = len(tokens)
            for n in range(lo, min(hi, end) + 1):
                ends.setdefault(tuple(tokens[end - n : end]), []).append(end)


def lengths_within_budget(firsts: Sequence[float], length: int, max_nodes: int) -> list[int]:
    """How many tokens of each branch are among the ``max_nodes`` best-scored draft tokens, when
    branch ``r``'s token ``d`` scores ``firsts[r] * CONTINUE_PROB**d``.

    >>> lengths_within_budget([0.9, 0.3], length=10, max_nodes=12)  # 0.3 ~ 0.9 * 0.95**21
    [10, 2]
    """
    if len(firsts) * length <= max_nodes:
        return [length] * len(firsts)
    scored = sorted(((f * CONTINUE_PROB**d, r) for r, f in enumerate(firsts) for d in range(length)), reverse=True)
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
