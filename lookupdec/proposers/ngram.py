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
and float operations) when it is built, else in their pure-Python definition,
``lookupdec.reference.drafting.NgramIndex``, which ``tests/proposers/test_ngram.py`` compares with it.
"""
from __future__ import annotations

from typing import Sequence

from lookupdec.automaton import _int32_tokens
from lookupdec.config import NgramConfig
from lookupdec.native import drafting as native_drafting  # None where not built: the reference index
from lookupdec.proposers.base import Draft, RequestRegistry
from lookupdec.reference import drafting as reference_drafting

BRANCH_DECAY = 0.6  # score ratio between consecutive branches of one lookup
CONTINUE_PROB = 0.95  # probability that a copied continuation keeps matching one more token


class NgramProposer:
    name = "ngram"
    fused_kind = "n"  # Mixture.plan's code for it (compiled_lookup)

    def __init__(self, config: NgramConfig | None = None) -> None:
        self.config = config or NgramConfig()
        self._requests = RequestRegistry("NgramProposer")

    def start(self, request_id: str, prompt_ids: Sequence[int]) -> None:
        if request_id in self._requests:
            self._requests.add(request_id, None)  # raises, naming the request
        # the request's index: compiled, else (the extension not built) its definition
        index = native_drafting.NgramIndex if native_drafting is not None else reference_drafting.NgramIndex
        state = index(self.config.min_ngram, self.config.max_ngram)
        self._extend(state, prompt_ids)  # first: a rejected prompt leaves no request behind
        self._requests.add(request_id, state)

    def observe(self, request_id: str, new_ids: Sequence[int]) -> None:
        self._extend(self._requests.get(request_id), new_ids)

    def stop(self, request_id: str) -> None:
        self._requests.pop(request_id)

    def propose(self, request_id: str, context: Sequence[int], max_nodes: int) -> list[Draft]:
        state = self._requests.get(request_id)
        seen = state.size()
        if seen != len(context):
            raise ValueError(f"NgramProposer: request {request_id!r} saw {seen} tokens, "
                             f"context has {len(context)} (observe() missed?)")
        if max_nodes <= 0:
            return []
        config = self.config
        return [Draft._trusted(None, None, None, self.name, match_len, packed=(tokens, parents, scores))
                for tokens, parents, scores, match_len in state.propose(
                    config.max_draft_tokens, config.max_branches, max_nodes, BRANCH_DECAY, CONTINUE_PROB)]

    def compiled_lookup(self, request_id: str) -> tuple | None:
        """For ``Mixture.plan`` (the lookups' drafts and their merge in one compiled call): the
        request's compiled index and ``propose``'s parameters; None where the index is the
        reference (the extension not built)."""
        state = self._requests.get(request_id)
        if isinstance(state, reference_drafting.NgramIndex):
            return None
        config = self.config
        return state, (config.max_draft_tokens, config.max_branches, BRANCH_DECAY, CONTINUE_PROB)

    def _extend(self, state, new_ids: Sequence[int]) -> None:
        try:
            state.extend(new_ids if type(new_ids) is list else _int32_tokens(new_ids).tolist())
        except TypeError:
            _int32_tokens(new_ids)  # raises the ValueError naming ids outside int32
            raise
