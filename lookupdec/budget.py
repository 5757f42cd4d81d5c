"""How many draft nodes to verify per step: measured cost against calibrated acceptance.

Two parts, both cheap enough for the hot path:

- ``CostModel``: the time of one verify forward for ``n`` tree tokens, ``t(n)``, measured once
  per engine on the machine in use (a few forwards at start-up, bounded by
  ``CALIBRATION_SECONDS``) and interpolated linearly between measured sizes.
- ``AcceptanceCalibrator``: per proposer, how far its scores (estimated acceptance
  probabilities) are from what happens. After every step it checks the step's best draft chain
  against the tokens actually committed — whether that chain was verified or not — so a source
  whose drafts were dropped keeps being measured at no cost ("shadow" checking). The factor
  multiplies each node's conditional probability (score / parent score), so a failing source's
  deep nodes fade fastest.

``choose_num_nodes`` then takes the ``n`` best nodes maximising expected new tokens per second,
``(1 + sum of the n best calibrated scores) / (t(1 + n) + overhead)``: the expected number of
accepted tokens is the sum over nodes of their acceptance probabilities, plus one bonus or
recovered token. Only history enters these choices (committed tokens, timings), never the
current step's random draws, so sampling stays exact.
"""
from __future__ import annotations

import bisect
import time
from dataclasses import replace
from typing import Callable, Sequence

from lookupdec.proposers.base import Draft

CALIBRATION_SECONDS = 1.5  # start-up budget for measuring t(n)
CALIBRATION_REPEATS = 3  # forwards per size; the minimum is kept (least noisy)
PRIOR_WEIGHT = 4.0  # pseudo-observations behind the initial factor of 1.0
HISTORY_DECAY = 0.95  # per-step decay of old observations (half-life about 14 steps)
MAX_FACTOR = 1.5  # a source's scores are never trusted more than this


class CostModel:
    """``t(n)``: seconds for one verify forward of ``n`` tokens (the root included)."""

    def __init__(self, sizes: Sequence[int], seconds: Sequence[float]) -> None:
        if not sizes or list(sizes) != sorted(sizes) or len(sizes) != len(seconds):
            raise ValueError("CostModel: sizes must be increasing and match seconds")
        self.sizes, self.seconds = list(sizes), list(seconds)

    @classmethod
    def flat(cls) -> "CostModel":
        """Every size costs the same: verify as many nodes as allowed."""
        return cls([1], [1.0])

    @classmethod
    def measure(cls, forward: Callable[[int], None], max_tokens: int) -> "CostModel":
        """Time ``forward(n)`` for n = 1, 2, 4, ... up to ``max_tokens`` within the time budget."""
        sizes, seconds, start = [], [], time.perf_counter()
        n = 1
        while True:
            best = float("inf")
            for _ in range(CALIBRATION_REPEATS):
                t = time.perf_counter()
                forward(n)
                best = min(best, time.perf_counter() - t)
            sizes.append(n)
            seconds.append(best)
            if n >= max_tokens or time.perf_counter() - start > CALIBRATION_SECONDS:
                break
            n = min(2 * n, max_tokens)
        return cls(sizes, seconds)

    def __call__(self, n: int) -> float:
        i = bisect.bisect_left(self.sizes, n)
        if i < len(self.sizes) and self.sizes[i] == n:
            return self.seconds[i]
        if i == 0:
            return self.seconds[0]
        if i == len(self.sizes):  # extrapolate from the last two sizes (linear in n)
            if len(self.sizes) == 1:
                return self.seconds[0]
            i -= 1
        n0, n1 = self.sizes[i - 1], self.sizes[i]
        t0, t1 = self.seconds[i - 1], self.seconds[i]
        return t0 + (t1 - t0) * (n - n0) / (n1 - n0)

    def to_dict(self) -> dict:
        return {"sizes": self.sizes, "seconds": self.seconds}


class AcceptanceCalibrator:
    """Per-source factor on conditional acceptance probabilities, learnt from committed tokens."""

    def __init__(self) -> None:
        self._predicted: dict[str, float] = {}  # decayed sum of predicted conditional probs
        self._matched: dict[str, float] = {}  # decayed count of nodes that matched

    def factor(self, source: str) -> float:
        predicted = self._predicted.get(source, 0.0) + PRIOR_WEIGHT
        matched = self._matched.get(source, 0.0) + PRIOR_WEIGHT
        return min(MAX_FACTOR, matched / predicted)

    def rescale(self, drafts: Sequence[Draft]) -> list[Draft]:
        """Drafts with each node's conditional probability multiplied by its source's factor."""
        out = []
        for d in drafts:
            f = self.factor(d.source)
            if f == 1.0:
                out.append(d)
                continue
            scores = []
            for i, p in enumerate(d.parents):
                parent_raw = 1.0 if p < 0 else d.scores[p]
                parent_new = 1.0 if p < 0 else scores[p]
                cond = d.scores[i] / parent_raw if parent_raw > 0 else 0.0
                scores.append(parent_new * min(1.0, f * cond))
            out.append(replace(d, scores=tuple(scores)))
        return out

    def observe(self, chain: Sequence[int], cond_probs: Sequence[float], source: str,
                committed: Sequence[int]) -> None:
        """Check a draft chain (raw conditional probs) against the tokens committed after it."""
        for s in self._predicted:
            self._predicted[s] *= HISTORY_DECAY
            self._matched[s] *= HISTORY_DECAY
        if not chain:
            return
        predicted = matched = 0.0
        for token, prob, actual in zip(chain, cond_probs, committed):
            predicted += prob
            if token != actual:
                break
            matched += 1
        self._predicted[source] = self._predicted.get(source, 0.0) + predicted
        self._matched[source] = self._matched.get(source, 0.0) + matched


def choose_num_nodes(sorted_scores: Sequence[float], cost: CostModel, overhead_s: float, max_nodes: int) -> int:
    """The ``n`` (0..max_nodes) maximising (1 + sum of the n best scores) / (t(1 + n) + overhead).

    >>> cost = CostModel([1, 2, 4], [1.0, 1.1, 1.3])
    >>> choose_num_nodes([0.9, 0.8, 0.01], cost, 0.0, 3)   # the third node is not worth 0.1
    2
    """
    best_n, best_rate, expected = 0, 1.0 / (cost(1) + overhead_s), 1.0
    for n, score in enumerate(sorted_scores[:max_nodes], start=1):
        expected += score
        rate = expected / (cost(1 + n) + overhead_s)
        if rate > best_rate:
            best_n, best_rate = n, rate
    return best_n
