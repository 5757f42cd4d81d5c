"""Peer drafting methods wrapped as lookupdec proposers, for side-by-side replays.

- ``TransformersPromptLookup``: transformers' own ``PromptLookupCandidateGenerator`` (the code
  behind ``generate(prompt_lookup_num_tokens=...)``), called on the same context each step.
- ``SuffixDecodingPeer``: ArcticInference's ``SuffixDecodingCache`` (SuffixDecoding), per-request
  prompt trees plus a global tree of earlier responses, tree speculation on.

Both follow the ``Proposer`` protocol, so ``lookupdec.simulate.replay`` treats them exactly like
lookupdec's own proposers (same tree merge, same acceptance rule, same budget).
"""
from __future__ import annotations

from typing import Sequence

from lookupdec.proposers.base import Draft


class TransformersPromptLookup:
    """transformers' prompt lookup at its defaults (2-gram, first match) with a chain length."""

    def __init__(self, num_output_tokens: int = 10, max_matching_ngram_size: int = 2) -> None:
        import torch
        from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

        self._torch = torch
        self.name = f"pld{num_output_tokens}"
        self._gen = PromptLookupCandidateGenerator(num_output_tokens=num_output_tokens,
                                                   max_matching_ngram_size=max_matching_ngram_size,
                                                   max_length=1 << 30)

    def start(self, request_id: str, prompt_ids: Sequence[int]) -> None:
        pass

    def observe(self, request_id: str, new_ids: Sequence[int]) -> None:
        pass

    def stop(self, request_id: str) -> None:
        pass

    def propose(self, request_id: str, context: Sequence[int], budget: int) -> list[Draft]:
        ids = self._torch.tensor([list(context)])
        candidates, _ = self._gen.get_candidates(ids)
        chain = candidates[0, len(context):].tolist()[:budget]
        return [Draft.chain(chain, [1.0] * len(chain), self.name)] if chain else []


class SuffixDecodingPeer:
    """SuffixDecoding (arctic-inference 0.3.0) at its defaults, tree speculation on."""

    def __init__(self, max_tree_depth: int = 64, max_spec_factor: float = 1.0, min_token_prob: float = 0.1,
                 name: str = "suffixdecoding") -> None:
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        self.name = name
        self._cache = SuffixDecodingCache(max_tree_depth=max_tree_depth, max_cached_requests=-1)
        self._spec = {"max_spec_factor": max_spec_factor, "min_token_prob": min_token_prob}
        self._serial = 0
        self._live: dict[str, str] = {}  # our request id -> a unique id in the cache

    def start(self, request_id: str, prompt_ids: Sequence[int]) -> None:
        self._serial += 1
        self._live[request_id] = f"{request_id}#{self._serial}"
        self._cache.start_request(self._live[request_id], list(prompt_ids))

    def observe(self, request_id: str, new_ids: Sequence[int]) -> None:
        self._cache.add_active_response(self._live[request_id], list(new_ids))

    def stop(self, request_id: str) -> None:
        self._cache.stop_request(self._live.pop(request_id))

    def propose(self, request_id: str, context: Sequence[int], budget: int) -> list[Draft]:
        draft = self._cache.speculate(self._live[request_id], list(context), max_spec_tokens=budget,
                                      use_tree_spec=True, **self._spec)
        if not draft.token_ids:
            return []
        scores = [min(1.0, float(p)) for p in draft.probs]
        return [Draft(tuple(draft.token_ids), tuple(draft.parents), tuple(scores), self.name)]


def suffixdecoding_available() -> bool:
    try:
        import arctic_inference.suffix_decoding  # noqa: F401
    except ImportError:
        return False
    return True
