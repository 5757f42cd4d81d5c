"""A small causal LM sharing the target's tokenizer, drafting where lookups find nothing good.

It keeps its own KV cache in step with the committed tokens: each call crops the cache to the
longest common prefix of what it holds and the current context (so draft tokens the target
accepted are not recomputed), feeds the rest in one forward, then drafts a chain of
``max_tokens`` tokens, one forward each. At every level it also offers ``branch - 1``
alternatives as leaves: greedy, the next most likely tokens; sampling, further i.i.d. draws.

Greedy drafts are point masses like lookups. Sampling drafts carry the draft distribution ``q``
at each level and the tokens drawn from it in order (``Draft.samples``); acceptance then tries
them by recursive rejection sampling against the target's residual (``sampling.py``), which is
exact for i.i.d. draws and accepts ``sum(min(p, q))`` of the mass instead of ``p(x)``. Scores
are the draft model's own path probabilities (calibrated online like every source's).
"""
from __future__ import annotations

from typing import Sequence

import torch

from lookupdec.config import DraftConfig
from lookupdec.model import DraftLM
from lookupdec.proposers.base import Draft, RequestRegistry
from lookupdec.sampling import SamplingParams, process_row


class _State:
    def __init__(self, lm: DraftLM) -> None:
        self.lm_state = lm.new_state()  # the draft model's KV cache and the tokens in it
        self.params = SamplingParams()
        self.generator: torch.Generator | None = None


class DraftModelProposer:
    name = "draft"

    def __init__(self, model, config: DraftConfig | None = None, *, vocab_size: int | None = None) -> None:
        self.lm = DraftLM(model, vocab_size=vocab_size)
        self.config = config or DraftConfig()
        self.device = self.lm.device
        self.vocab_size = self.lm.vocab_size
        self.max_context = self.lm.max_context
        self._requests = RequestRegistry("DraftModelProposer")

    @property
    def forwards(self) -> int:
        """Draft-model forward passes, for stats."""
        return self.lm.forwards

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self, request_id: str, prompt_ids: Sequence[int]) -> None:
        self._requests.add(request_id, _State(self.lm))

    def set_sampling(self, request_id: str, params: SamplingParams, seed: int | None) -> None:
        """Draw draft samples for this request with ``params``; a seeded request seeds them too
        (same seed, same drafts, same output)."""
        state: _State = self._requests.get(request_id)
        state.params = params
        if not params.greedy:
            state.generator = torch.Generator(device=self.device)
            if seed is None:
                state.generator.seed()
            else:
                state.generator.manual_seed((seed * 2654435761 + 97) % (2**63))

    def observe(self, request_id: str, new_ids: Sequence[int]) -> None:
        self._requests.get(request_id)  # the cache catches up lazily, on the next propose

    def stop(self, request_id: str) -> None:
        self._requests.pop(request_id)

    # -- drafting -------------------------------------------------------------------------------
    def propose(self, request_id: str, context: Sequence[int], max_nodes: int) -> list[Draft]:
        state: _State = self._requests.get(request_id)
        depth = min(self.config.max_tokens, max_nodes)
        if depth <= 0 or (self.max_context and len(context) + depth > self.max_context):
            return []
        logits = self.lm.advance(state.lm_state, context)
        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []
        samples: dict = {}
        parent, parent_score = -1, 1.0
        for level in range(depth):
            q = self._distribution(logits, state.params)
            if state.params.greedy:
                drawn = torch.topk(q, min(self.config.branch, q.numel())).indices.tolist()
            else:
                drawn = torch.multinomial(q, self.config.branch, replacement=True, generator=state.generator).tolist()
                samples[parent] = (q, tuple(drawn))
            chain_node = None
            for tok in dict.fromkeys(drawn):  # distinct, in order of first draw
                if len(tokens) == max_nodes:
                    break
                tokens.append(tok)
                parents.append(parent)
                scores.append(parent_score * float(q[tok]))
                if chain_node is None:
                    chain_node = len(tokens) - 1
            if chain_node is None or level == depth - 1 or len(tokens) == max_nodes:
                break
            parent, parent_score = chain_node, scores[chain_node]
            logits = self.lm.feed(state.lm_state, [tokens[chain_node]])
        return [Draft(tuple(tokens), tuple(parents), tuple(scores), self.name, 0, samples or None)] if tokens else []

    def _distribution(self, logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """The draft's processed distribution over the target's vocabulary.  [vocab]"""
        logits = logits.float()
        if logits.numel() > self.vocab_size:
            logits = logits[: self.vocab_size]
        elif logits.numel() < self.vocab_size:
            pad = torch.full((self.vocab_size - logits.numel(),), float("-inf"), device=logits.device)
            logits = torch.cat([logits, pad])
        if params.greedy:
            return logits.softmax(-1)
        return process_row(logits, None, params).softmax(-1)

    def cached_tokens(self, request_id: str) -> list[int]:
        return list(self._requests.get(request_id).lm_state.tokens)

    def cache_of(self, request_id: str):
        return self._requests.get(request_id).lm_state.cache
