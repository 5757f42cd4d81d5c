"""The sampling exactness tests' reference (``test_sampling.py``, ``proposers/test_draft_model.py``):
a fixed synthetic target on ``V`` tokens, plain sampling's distribution by ``transformers``' own
logits processors, and total-variation distances with a bound for Monte Carlo draws."""
from __future__ import annotations

import math
from collections import Counter

import torch
from transformers.generation.logits_process import (LogitsProcessorList, RepetitionPenaltyLogitsProcessor,
                                                    TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

from lookupdec.sampling import SamplingParams

V = 6  # the synthetic target's vocabulary
FAILURE_PROB = 1e-6  # of each Monte Carlo bound


def synthetic_logits(prefix: tuple[int, ...]) -> torch.Tensor:
    """A fixed 'target model' on V tokens: deterministic random logits per prefix.  [V]"""
    seed = 0
    for tok in prefix:
        seed = (seed * 1_000_003 + tok + 1) % (2**31 - 1)
    return 2.5 * torch.randn(V, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).float()


def hf_processors(params: SamplingParams) -> LogitsProcessorList:
    procs = LogitsProcessorList()
    if params.repetition_penalty is not None:
        procs.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    procs.append(TemperatureLogitsWarper(params.temperature))
    if params.top_k is not None:
        procs.append(TopKLogitsWarper(params.top_k))
    if params.top_p is not None:
        procs.append(TopPLogitsWarper(params.top_p))
    return procs


def plain_probs(logits: torch.Tensor, prefix: list[int], params: SamplingParams) -> torch.Tensor:
    """What plain sampling draws from after ``prefix``, by transformers' processors.  [V]"""
    scores = hf_processors(params)(torch.tensor([prefix]), logits[None].clone())
    return scores[0].softmax(-1).double()


def tv_bound(probs, n: int, failure_prob: float = FAILURE_PROB) -> float:
    """Upper bound on the total variation between the empirical distribution of ``n`` draws and
    the true one ``probs``, holding with probability >= 1 - failure_prob:

    E[TV] = 1/2 sum_i E|X_i/n - p_i| <= 1/2 sum_i sqrt(p_i (1 - p_i) / n)   (Jensen), and TV is a
    function of n independent draws that changes by at most 1/n when one draw changes, so by
    McDiarmid P(TV >= E[TV] + t) <= exp(-2 n t^2): t = sqrt(ln(1 / failure_prob) / (2 n)).
    """
    mean = 0.5 * sum(math.sqrt(p * (1 - p) / n) for p in probs)
    return mean + math.sqrt(math.log(1 / failure_prob) / (2 * n))


def total_variation(counts: Counter, exact: dict, n: int) -> float:
    keys = set(counts) | set(exact)
    return 0.5 * sum(abs(counts.get(k, 0) / n - exact.get(k, 0.0)) for k in keys)


def tv_between(a: dict, b: dict) -> float:
    return 0.5 * sum(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in set(a) | set(b))
