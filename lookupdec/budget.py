"""How many draft nodes to verify per step: measured cost against calibrated acceptance.

Two parts, both cheap enough for the hot path:

- ``CostModel``: the time of one verify forward for ``n`` tree tokens, ``t(n)``, learnt online
  from the engine's own timed forwards, per context-length bucket, seeded from the cost cache
  or a few forwards (``SEED_SIZES``, one each) the first time an engine meets a bucket.
- ``AcceptanceCalibrator``: per proposer, how far its scores (estimated acceptance
  probabilities) are from what happens. After every step it checks the step's best draft chain
  against the tokens actually committed — whether that chain was verified or not — so a source
  whose drafts were dropped keeps being measured at no cost ("shadow" checking); and every
  verified node whose parent was reached is counted in its (source, match bucket, depth, sibling
  rank) cell. The factor multiplies each node's conditional probability (score / parent
  score), so a failing source's deep nodes fade fastest.

``choose_num_nodes`` then takes the ``n`` best nodes maximising expected new tokens per second,
``(1 + sum of the n best calibrated scores) / (t(1 + n) + overhead)``: the expected number of
accepted tokens is the sum over nodes of their acceptance probabilities, plus one bonus or
recovered token. Only history enters these choices (committed tokens, timings), never the
current step's random draws, so sampling stays exact.
"""
from __future__ import annotations

import bisect
import hashlib
import json
import logging
import os
import platform
import time
from typing import Callable, Sequence

import numpy as np

from lookupdec import cache_file
from lookupdec.native import tree as _core  # the compiled core's tree submodule, None where not built
from lookupdec.tree import (CELLS_PER_ROW, COND_MIDS, MATCH_BUCKETS, Calibration, Draft, calibration_row_key,
                            observe_draft)


log = logging.getLogger("lookupdec")

CALIBRATION_SECONDS = 2.0  # cap on a full measurement (``CostModel.measure``, benchmarks)
SEED_SIZES = (1, 4, 16, 64)  # an engine's first context bucket: one forward each, then learnt online
COST_CACHE_VERSION = 5  # 3: the key names the kernels (model/kernels.py); 4: the body packs only where faster;
# 5: kernel forms re-checked while running (curves cached before measured choices since corrected)
MAX_CACHED_CURVES = 32  # the cost cache keeps the curves updated last
CALIBRATION_REPEATS = 3  # forwards per size; the minimum is kept (least noisy)
COST_LEARNING_RATE = 0.1  # an observed forward moves its size's estimate this far (after the first few)
COST_SPIKE = 2.0  # an observation above this many times the estimate counts as this many times
# The chooser takes a size observed c times as costing (1 - COST_OPTIMISM / sqrt(c)) of its
# estimate: a size over-measured once (a noisy forward) is tried again, and so re-measured, where
# it would otherwise never be chosen, hence never corrected (one slow measurement of a size kept
# the default budget off it for good). Small, since exploration (EXPLORE_EVERY below) re-measures
# stale sizes: a larger optimism, with decayed counts, priced sizes chosen now and then well
# below what they measured, and the default's forwards cost more per step than a fixed budget's.
COST_OPTIMISM = 0.05
# A size the chooser stopped taking was never re-measured, so an estimate made under other
# conditions (a kernel form since replaced, a cached curve, the seed's single forward) stuck: a
# size priced too dear kept the default on a smaller tree that verified slower than a fixed
# budget of the avoided size would, and weak drafts kept small trees of a slow size. So the
# counts behind each estimate decay (COUNT_DECAY per forward of the curve, whatever its size: a
# size seen every step settles near 200, one not seen for 500 forwards at 8% of that), an
# old estimate gives way fast when observed again (its rate is 1 / count), and every
# EXPLORE_EVERY choices one step verifies the size, among one token fewer and up to EXPLORE_SPAN
# more (and twice the nodes plus one, below), that was observed least lately (if under
# EXPLORE_MIN_COUNT): a step in 32, never more.
# A step in 32 at a neighbouring size could not leave a high plateau of stale estimates (a cached
# curve holding a run of sizes at several times what such forwards cost, at counts below 1): the
# default kept half the nodes a fresh curve chose, and ran slower than a fixed budget of those.
# So exploration also tries twice the nodes chosen plus one (``explore``), and a curve read
# from the cache or taken for another bucket keeps only the sizes observed at least
# CACHED_MIN_COUNT times lately (``CostModel.trusted``; the rest are interpolated from those and
# measured again when chosen or explored) and explores at its first choice.
COUNT_DECAY = 0.995
RESCALE_BELOW = 1e-3  # CostModel folds its running count scale into the raw sums below this (every ~1400 observes)
EXPLORE_EVERY = 32
EXPLORE_SPAN = 4
EXPLORE_MIN_COUNT = 3.0
EXPLORE_ROOT = True  # the root alone explored where a stale curve prices it as dear as the tree chosen (``explore``)
CACHED_COUNT_CAP = 4.0  # a curve read from the cost cache counts as this many forwards at most per size
CACHED_MIN_COUNT = 0.5  # ... and keeps only sizes observed this many times lately (a size seen once: for 138 forwards)
# Within a process a size's estimate still outlived what made it where the chooser stopped taking
# that size and exploration (around the sizes chosen) never reached it: one slow forward of 4
# tokens (another process, a cold cache) priced 4 nodes at twice their cost, so weak drafts got
# the root alone or a large tree, never a small one (``bench/cost_replay.py`` replays SmolLM2's own
# outputs model-free on a measured curve with noisy observations, a few of them doubled: stale
# estimates lost much of the speedup the chooser reaches on the true curve). So the choosers
# read ``CostModel.prices``: a size's estimate drawn down towards the line through its
# neighbours observed at least TRUST_COUNT times lately, weighted as SHRINK_COUNT forwards
# against its own decayed count (``shrunk``): a stale high estimate drifts back to what its
# neighbours say, is taken again and measured again. Never up: a low estimate is taken, so
# measured, anyway, and a size cheaper than its neighbours (found by exploration) stays so; a
# size whose kernels are slow (a bump in the curve) is re-measured now and then. In the same
# replay this wins back most of what stale estimates lost, bumps included.
SHRINK_COUNT = 1.0
TRUST_COUNT = 1.0
SHRINK_BELOW = 8.0  # a size observed this many times lately keeps its own estimate
PRICES_EVERY = 16  # observations between two full computations of the prices (the observed size's: each time)
HISTORY_DECAY = 0.95  # per-step decay of old observations (half-life about 14 steps)
MAX_FACTOR = 1.5  # a source's scores are never trusted more than this
DRAFT_BUDGET_HEADROOM = 2.0  # proposers are asked for this many times the nodes lately kept
DRAFT_BUDGET_MIN = 16  # ... but never fewer than this many
DRAFT_BUDGET_DECAY = 0.9  # per-step decay of the running mean of kept nodes


class CostModel:
    """``t(n)``: seconds for one verify forward of ``n`` tokens (the root included), learnt.

    Seeded by a few timed forwards (``measure``) or from the cost cache, then refined by every
    verify forward the engine times (``observe``): each size keeps a running estimate, spikes
    (another process, a cold cache) clipped. Between observed sizes ``t`` is interpolated
    linearly. Costs need not grow with ``n`` (a CPU's matrix kernels for a few rows can be
    slower than for a few more): ``choose_num_nodes`` weighs
    every size at its own cost, and where a caller pads smaller trees (a batch's width),
    ``n`` tokens cost the cheapest of any size ``>= n`` (``__call__``, ``dense(padded=True)``). Sizes
    the chooser no longer takes are re-measured now and then (``explore``), and the counts behind
    the estimates decay (``COUNT_DECAY``), so an old estimate gives way fast.
    """

    def __init__(self, sizes: Sequence[int], seconds: Sequence[float], counts: Sequence[int] | None = None) -> None:
        if not sizes or list(sizes) != sorted(set(sizes)) or len(sizes) != len(seconds):
            raise ValueError("CostModel: sizes must be increasing and match seconds")
        self.sizes, self.seconds = [int(n) for n in sizes], [float(t) for t in seconds]
        # observations per size (``counts``), decayed: raw sums times one running scale, so an
        # observe changes one size's sum and the scale, not every size's count (a list of them
        # made anew would cost every step, cold after the forward); the compiled chooser and curve
        # take the two as they are (``choose_tree_nodes``, ``dense``) and multiply
        self.raw_counts = [float(c) for c in counts] if counts is not None else [1.0] * len(self.sizes)
        self.count_scale = 1.0
        self._since_explore = 0  # choices since the last exploration (``explore``)
        self._root_explored = 0  # the size chosen when ``explore`` last took the root alone instead (0: none pending)
        self._curves: dict[tuple[bool, bool], np.ndarray] = {}  # (optimistic, padded) -> dense()
        self._prices: list[float] | None = None  # ``prices()``
        self._lines: list[float | None] = []  # each size's neighbours' line behind its price (``shrunk``)
        self._since_prices = 0  # observations since the prices were computed whole

    @property
    def counts(self) -> list[float]:
        """The decayed number of forwards behind each size's estimate (``COUNT_DECAY`` per
        ``observe``), a new list."""
        scale = self.count_scale
        return [c * scale for c in self.raw_counts]

    @classmethod
    def flat(cls) -> "CostModel":
        """Every size costs the same: verify as many nodes as allowed."""
        return cls([1], [1.0])

    def copy(self) -> "CostModel":
        """The same estimates and counts (to be learnt apart); another process's or bucket's
        curve goes through ``trusted`` instead."""
        return CostModel(self.sizes, self.seconds, self.counts)

    def trusted(self, max_count: float = CACHED_COUNT_CAP, min_count: float = CACHED_MIN_COUNT) -> "CostModel | None":
        """What another process or context bucket hands on: the sizes observed at least
        ``min_count`` times lately (decayed counts), each counting as ``max_count`` forwards at
        most; None where fewer than two sizes are left (measure instead). An estimate last seen
        long ago may have been made on a busy machine, and a size the chooser avoids for it is
        never observed again to correct it; dropped, it is interpolated from the sizes seen
        lately until a forward of it is timed; the curve's first choice explores (``explore``).

        >>> CostModel([1, 4, 16, 17], [0.05, 0.06, 0.25, 0.26], counts=[90, 20, 0.3, 0.4]).trusted().sizes
        [1, 4]
        """
        keep = [j for j, c in enumerate(self.counts) if c >= min_count]
        if len(keep) < 2:
            return None
        cost = CostModel([self.sizes[j] for j in keep], [self.seconds[j] for j in keep],
                         [min(self.counts[j], max_count) for j in keep])
        cost._since_explore = EXPLORE_EVERY - 1  # its first choice explores: the kept sizes may be stale too
        return cost

    @classmethod
    def measure(cls, forward: Callable[[int], None], max_tokens: int, sizes: Sequence[int] | None = None,
                repeats: int = CALIBRATION_REPEATS) -> "CostModel":
        """Time ``forward(n)`` for each of ``sizes`` (default n = 1, 2, 4, ... ``max_tokens``;
        sizes above ``max_tokens`` are dropped) in ``repeats`` interleaved rounds, keeping each
        size's fastest (noise only adds time). ``forward`` may return seconds of its call that
        are not the forward's cost (one-time kernel choices): they are not counted. Stops once
        ``CALIBRATION_SECONDS`` are spent."""
        if sizes is None:
            sizes = [1]
            while sizes[-1] < max_tokens:
                sizes.append(min(2 * sizes[-1], max_tokens))
        sizes = sorted({n for n in sizes if n <= max_tokens} | {1})
        best = [float("inf")] * len(sizes)
        start = time.perf_counter()
        for _ in range(repeats):
            for i, n in enumerate(sizes):
                t = time.perf_counter()
                excluded = forward(n)
                best[i] = min(best[i], time.perf_counter() - t - (excluded or 0.0))
                if time.perf_counter() - start > CALIBRATION_SECONDS:
                    break
            if time.perf_counter() - start > CALIBRATION_SECONDS:
                break
        measured = [(n, t) for n, t in zip(sizes, best) if t < float("inf")]
        return cls([n for n, _ in measured], [t for _, t in measured])

    def observe(self, n: int, seconds: float) -> None:
        """One timed verify forward of ``n`` tokens."""
        i = bisect.bisect_left(self.sizes, n)
        if i == len(self.sizes) or self.sizes[i] != n:
            # a new size: its first observation replaces the interpolation (spikes clipped by it)
            self.sizes.insert(i, n)
            self.seconds.insert(i, self._interpolate(n, skip=i))
            self.raw_counts.insert(i, 0.0)
            self._prices = None  # every line may move: computed whole when next read
        old = self.seconds[i]
        seconds = min(seconds, COST_SPIKE * old)
        below, self._root_explored = self._root_explored, 0  # (pending for this forward only)
        if below and n == 1:
            self._follow_level(seconds / old, below)
        self.count_scale *= COUNT_DECAY  # every count decays (recent forwards weigh more) ...
        if self.count_scale < RESCALE_BELOW:  # (the raw sums grow as the scale shrinks: fold it in now and then)
            self.raw_counts, self.count_scale = self.counts, 1.0
        self.raw_counts[i] += 1.0 / self.count_scale  # ... and this size's gains one
        count = self.raw_counts[i] * self.count_scale
        rate = max(COST_LEARNING_RATE, 1.0 / count)
        self.seconds[i] = old + rate * (seconds - old)
        self._curves.clear()
        if self._prices is not None:
            self._prices[i] = _blend(self.seconds[i], count, self._lines[i], SHRINK_COUNT)
            self._since_prices += 1

    def _follow_level(self, ratio: float, below: int) -> None:
        """The root alone, explored because the curve priced it as dear as the larger size
        ``below`` that the chooser took (``explore``), ran at ``ratio`` of its estimate: where
        faster, the machine's speed has changed since the stale estimates were made, so every
        size between the two observed under ``SHRINK_BELOW`` times lately moves by the same
        ratio (the root's own estimate follows its observation). Never up: a size priced too low
        is taken, so measured, anyway; the larger sizes, which the chooser does not take, stay."""
        if ratio >= 1.0:
            return
        counts = self.counts
        for j, m in enumerate(self.sizes):
            if 1 < m < below and counts[j] < SHRINK_BELOW:
                self.seconds[j] *= ratio
        self._prices = None

    def prices(self) -> list[float]:
        """What the choosers take each size to cost: its estimate drawn down towards the line
        through its neighbours observed lately, as far as its own observations are stale (``shrunk``).
        Computed whole every ``PRICES_EVERY`` observations or after a new size; in between
        ``observe`` updates the observed size's own (its neighbours' lines move little in
        ``PRICES_EVERY`` forwards; the whole computation at every step would add a visible share
        to a step's overhead)."""
        if self._prices is None or self._since_prices >= PRICES_EVERY:
            self._prices, self._lines = shrunk(self.sizes, self.seconds, self.counts, SHRINK_COUNT, TRUST_COUNT)
            self._since_prices = 0
        return self._prices

    def count(self, n: int) -> float:
        """The decayed number of forwards of ``n`` tokens behind its estimate (0: interpolated)."""
        i = bisect.bisect_left(self.sizes, n)
        return self.raw_counts[i] * self.count_scale if i < len(self.sizes) and self.sizes[i] == n else 0.0

    def explore(self, nodes: int, available: int) -> int:
        """The draft nodes to verify given the chooser's ``nodes`` (of ``available``): ``nodes``, or
        once every ``EXPLORE_EVERY`` calls the size observed least lately (``count``) among one node
        fewer, up to ``EXPLORE_SPAN`` more and twice ``nodes`` plus one (at most ``available``), if
        under ``EXPLORE_MIN_COUNT`` (ties: the nearest larger), so that no size's estimate outlives
        what it measured and a larger tree that costs less is found, past a plateau of stale
        estimates too. Where the root alone (one token) is priced at or above the ``nodes`` chosen
        and was observed less lately than the size exploration would try (and under
        ``EXPLORE_MIN_COUNT`` times), it is what is explored: a stale estimate may say one token
        costs as much as more, and the chooser would never take it to find out (a curve learnt
        while the machine ran slow, then a large tree measured fast: the chooser verified that
        tree on every step, never timing the root alone again, slower than greedy decoding where
        nothing drafted well); where it then runs
        faster than its estimate, the stale sizes follow (``_follow_level``). When the chooser takes
        the root alone (``nodes`` = 0) nothing is explored. History only (the curve's own timings):
        sampling stays exact.

        >>> cost = CostModel([1, 4, 8], [1.0, 1.1, 1.5])
        >>> [cost.explore(3, 7) for _ in range(EXPLORE_EVERY)][-2:]   # 5 tokens never observed
        [3, 4]
        >>> cost = CostModel([1, 7, 8, 9, 10, 11, 12, 16], [1.0, 1.2, 1.2, 2.3, 2.3, 2.2, 2.2, 4.0],
        ...                  counts=[9, 9, 9, 9, 9, 9, 9, 0.1])
        >>> [cost.explore(7, 40) for _ in range(EXPLORE_EVERY)][-1]   # 16 tokens, observed least lately
        15
        """
        self._since_explore += 1
        if self._since_explore < EXPLORE_EVERY or nodes <= 0:
            return nodes
        candidates = [*range(nodes + 1, min(nodes + EXPLORE_SPAN, available) + 1), nodes - 1]
        far = min(2 * nodes + 1, available)
        if far > nodes + EXPLORE_SPAN:
            candidates.append(far)
        other = min(candidates, key=lambda m: self.count(m + 1))  # the first of equal counts: nearest larger
        if EXPLORE_ROOT and self.count(1) < min(self.count(other + 1), EXPLORE_MIN_COUNT):
            prices = self.dense(nodes + 1, padded=False)
            if prices[1] >= prices[nodes + 1]:  # (the root alone priced as dear as the tree chosen)
                other = 0
                self._root_explored = nodes + 1
        if self.count(other + 1) >= EXPLORE_MIN_COUNT:
            return nodes
        self._since_explore = 0
        return other

    def _interpolate(self, n: int, skip: int = -1) -> float:
        """Linear interpolation between measured sizes (extrapolated past the ends); ``skip``:
        a position in ``sizes`` to ignore (a size just inserted)."""
        pairs = [(m, t) for j, (m, t) in enumerate(zip(self.sizes, self.seconds)) if j != skip]
        if len(pairs) == 1:
            return pairs[0][1]
        xs = [m for m, _ in pairs]
        i = bisect.bisect_left(xs, n)
        if i < len(xs) and xs[i] == n:
            return pairs[i][1]
        if i == 0:
            (n0, t0), (n1, t1) = pairs[0], pairs[1]
            return max(t0 * 0.5, t0 + (t1 - t0) * (n - n0) / (n1 - n0))
        if i == len(xs):
            return pairs[-1][1] + tail_slope(xs, [t for _, t in pairs]) * (n - xs[-1])
        (n0, t0), (n1, t1) = pairs[i - 1], pairs[i]
        return t0 + (t1 - t0) * (n - n0) / (n1 - n0)

    def dense(self, upto: int, *, optimistic: bool = False, padded: bool = True) -> np.ndarray:
        """``out[k]`` = the cost of ``k`` tokens for k = 0 ... upto (``out[0] = out[1]``):
        interpolated (linear past the largest observed size); ``padded``: the cheapest of any
        size from ``k`` up to the largest of ``upto`` and the largest observed size (what ``k``
        tokens cost where the caller pads a smaller tree: a batch's width); without it, each
        size at its own estimate (what a tree of exactly ``k`` tokens costs: the single
        sequence's chooser, which weighs every size itself). ``optimistic`` (what the choosers
        use): each size's estimate lowered by ``COST_OPTIMISM / sqrt(observations)`` first.

        Cached until the next ``observe``, which the engine makes every step: the curve is
        computed again before each step's choice, in one compiled call where the core is built
        (``dense_reference``'s numpy operations, bit for bit: ten numpy calls, every one of them
        cold after the forward, cost a step far more than the one call)."""
        key = (optimistic, padded)
        cached = self._curves.get(key)
        if cached is None or len(cached) <= upto:
            if _core is not None and hasattr(_core, "cost_curve"):
                cached = np.frombuffer(_core.cost_curve(self.sizes, self.prices(), self.raw_counts, upto, COST_OPTIMISM,
                                                        optimistic, padded, self.count_scale), np.float64)
            else:
                cached = self.dense_reference(upto, optimistic=optimistic, padded=padded)
            self._curves[key] = cached
        return cached

    def dense_reference(self, upto: int, *, optimistic: bool = False, padded: bool = True) -> np.ndarray:
        """``dense`` in numpy, not cached: the definition the compiled curve repeats."""
        top = max(upto, self.sizes[-1])
        ks = np.arange(1, top + 1, dtype=np.float64)
        xs, ys = np.asarray(self.sizes, dtype=np.float64), np.asarray(self.prices(), dtype=np.float64)
        if optimistic:
            ys = ys * (1.0 - COST_OPTIMISM / np.sqrt(np.maximum(np.asarray(self.counts, dtype=np.float64), 1.0)))
        curve = np.interp(ks, xs, ys)
        if len(xs) > 1 and top > xs[-1]:  # linear past the last size
            tail = ks > xs[-1]
            curve[tail] = ys[-1] + tail_slope(xs, ys) * (ks[tail] - xs[-1])
        if padded:
            curve = np.minimum.accumulate(curve[::-1])[::-1]
        return np.concatenate([curve[:1], curve])

    def __call__(self, n: int) -> float:
        return float(self.dense(n)[n])

    def to_dict(self) -> dict:
        return {"sizes": self.sizes, "seconds": self.seconds, "counts": self.counts}


def _blend(own: float, count: float, line: float | None, k: float) -> float:
    """A size's price: ``own`` estimate from ``count`` forwards lately, weighed against a lower
    ``line`` (its neighbours'; None: none) as ``k`` forwards; its own once counted SHRINK_BELOW
    times, or where the line is not lower."""
    if line is None or line >= own or count >= SHRINK_BELOW or k <= 0:
        return own
    return (count * own + k * line) / (count + k)


def shrunk(sizes: Sequence[int], seconds: Sequence[float], counts: Sequence[float], k: float = SHRINK_COUNT,
           trust: float = TRUST_COUNT) -> tuple[list[float], list[float | None]]:
    """``CostModel.prices`` by its definition, and each size's line: the linear interpolation at
    its size between the nearest sizes below and above it (itself left out) observed at least
    ``trust`` times lately (decayed counts), None outside their range or where fewer than two
    are; each price is ``(c * own + k * line) / (c + k)`` for a size observed ``c`` times lately
    (its own estimate once ``c`` reaches SHRINK_BELOW, without a line, or where the line is higher).

    >>> prices, lines = shrunk([1, 4, 8, 16], [0.040, 0.100, 0.060, 0.075], [50, 0.1, 6, 30])
    >>> [round(p, 4) for p in prices]   # 4 tokens, one slow forward long ago: near the line 1 -> 8 again
    [0.04, 0.0532, 0.0595, 0.075]
    """
    lines: list[float | None] = [None] * len(sizes)
    xs = [n for n, c in zip(sizes, counts) if c >= trust]
    if len(xs) >= 2:
        ys = [t for t, c in zip(seconds, counts) if c >= trust]
        for i, n in enumerate(sizes):
            if xs[0] < n < xs[-1]:
                h = bisect.bisect_left(xs, n)
                lo, hi = h - 1, h + 1 if xs[h] == n else h  # the size itself is not its own neighbour
                if hi < len(xs):
                    lines[i] = ys[lo] + (ys[hi] - ys[lo]) * (n - xs[lo]) / (xs[hi] - xs[lo])
    return [_blend(t, c, line, k) for t, c, line in zip(seconds, counts, lines)], lines


def tail_slope(sizes: Sequence[float], seconds: Sequence[float]) -> float:
    """Seconds per token past the largest size of a cost curve (``CostModel`` extrapolates with
    it): the secant from the largest size back to one at most half as large, never below 0 nor
    above the largest size's seconds per token. Two adjacent sizes (62 and 64 nodes, both seen
    by a single sequence's engine) differ by noise alone: their slope, a good part of a whole
    forward per token on a GPU whose forwards all cost about the same, priced a batch of 8 rows
    x 65 nodes at seconds and
    kept the batch's trees at a node or two. The cap holds because ``n`` tokens never cost
    more than ``n / m`` forwards of ``m``.

    >>> round(tail_slope([1, 16, 62, 64], [0.051, 0.040, 0.036, 0.046]), 6)   # 16 -> 64, not 62 -> 64
    0.000125
    >>> tail_slope([1, 4], [0.01, 0.09])   # at most 0.09 / 4 a token
    0.0225
    """
    last = len(sizes) - 1
    if last < 1:
        return 0.0
    base = 0  # the largest size at most half the last one (the first if none is)
    for j in range(last):
        if sizes[j] <= sizes[last] / 2:
            base = j
    slope = (seconds[last] - seconds[base]) / (sizes[last] - sizes[base])
    return float(min(max(slope, 0.0), seconds[last] / sizes[last]))


def cost_cache_path() -> str | None:
    """Where measured cost curves and the kernel forms chosen (``model/kernels.py``) are kept:
    ``$LOOKUPDEC_COST_CACHE`` (a file; ``off`` disables the cache), else
    ``$XDG_CACHE_HOME/lookupdec/cost_curves.json`` (``~/.cache`` by default)."""
    env = os.environ.get("LOOKUPDEC_COST_CACHE")
    if env:
        return None if env.lower() in ("0", "off", "none") else env
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "lookupdec", "cost_curves.json")


def _setup(model_config: dict, device) -> tuple[str, str]:
    """The architecture (not the weights' values: ``model_type-digest``) and the device (on CPU:
    the machine and its core count; not the thread count)."""
    import torch

    arch = {k: v for k, v in model_config.items() if k not in ("_name_or_path", "transformers_version")}
    digest = hashlib.sha256(json.dumps(arch, sort_keys=True, default=str).encode()).hexdigest()[:16]
    device = torch.device(device)
    where = (f"cuda:{torch.cuda.get_device_name(device)}" if device.type == "cuda"
             else f"{device.type}:{platform.machine()}:{os.cpu_count()}cpus")
    return f"{model_config.get('model_type', '?')}-{digest}", where


def cost_key(model_config: dict, device, dtype, context_tokens: int, kernels: str = "plain") -> str:
    """What a cost curve depends on: the architecture (not the weights' values), the device,
    the dtype, the context length bucket, torch's version, on CPU its thread count, and which
    kernels the forwards use (``TargetModel.kernels``)."""
    import torch

    model, where = _setup(model_config, device)
    if torch.device(device).type != "cuda":
        where += f":{torch.get_num_threads()}threads"
    return f"{model}|{where}|{dtype}|ctx{context_tokens}|torch{torch.__version__}|{kernels}"


def _read_cache() -> dict | None:
    """The cost cache's document, or None (no cache, unusable or unreadable, another version:
    ``cache_file.read``)."""
    path = cost_cache_path()
    doc = cache_file.read(path) if path else None
    return doc if isinstance(doc, dict) and doc.get("version") == COST_CACHE_VERSION else None


def _update_cache(section: str, key: str, entry: dict, bound: int) -> None:
    """Put ``entry`` under ``doc[section][key]`` in the cache file, the ``bound`` entries of the
    section updated last kept (atomically, the other sections as they were; a cache that is not
    a regular file, or unwritable, is left alone: ``cache_file.write``)."""
    path = cost_cache_path()
    if not path:
        return
    try:
        doc = _read_cache() or {"version": COST_CACHE_VERSION}
        part = doc.setdefault(section, {})
        if not isinstance(part, dict):
            part = doc[section] = {}
        part[key] = {**entry, "updated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        if len(part) > bound:  # bounded: drop the entries updated longest ago
            kept = sorted(part.items(), key=lambda kv: (kv[0] == key, str(kv[1].get("updated", ""))))
            doc[section] = dict(kept[-bound:])
        doc.setdefault("curves", {})
    except AttributeError as exc:  # (an entry not a dict): the section starts again
        log.debug("cost cache %s: section %s unusable (%r): rewritten", path, section, exc)
        doc[section] = {key: part[key]}
    cache_file.write(path, doc)


def load_cached_cost(key: str) -> CostModel | None:
    doc = _read_cache()
    try:
        entry = doc["curves"][key] if doc else None
        if not entry:
            return None
        # another process's curve: re-checked here
        cost = CostModel(entry["sizes"], entry["seconds"], entry.get("counts")).trusted()
        if cost is None:
            log.debug("cost cache entry %s: fewer than two sizes observed lately: measuring", key)
        return cost
    except (ValueError, KeyError, TypeError) as exc:
        log.debug("cost cache entry %s unusable (%r): measuring", key, exc)
        return None


def store_cached_cost(key: str, cost: CostModel) -> None:
    """Add one curve to the cache file (atomically; an unwritable cache is only logged)."""
    _update_cache("curves", key, cost.to_dict(), MAX_CACHED_CURVES)


SOURCE_PRIOR_WEIGHT = 1.0  # a source starts at factor 1, worth this many predicted tokens
ROW_PRIOR_WEIGHT = 2.0  # a (source, match bucket) row starts at its source's factor, worth this many
CELL_PRIOR_WEIGHT = 2.0  # a cell starts at its row's factor x its claimed probability, worth this many nodes
MAX_PRIOR_PROB = 0.9  # ... but a cell never observed is not believed certain


_COND_MIDS_BYTES = np.ascontiguousarray(COND_MIDS, dtype=np.float64).tobytes()


def _row_sums(counts: np.ndarray) -> np.ndarray:
    """Each row's sum, left to right (numpy's ``sum`` adds in pairs: its last bits differ)."""
    return np.cumsum(counts, axis=1)[:, -1] if counts.shape[0] else np.zeros(0)


class AcceptanceCalibrator:
    """Factors on the proposers' conditional acceptance probabilities, learnt from every step.

    After a step, every node of every draft — verified or not ("shadow" checking, so a source
    whose nodes were pruned keeps being measured) — whose parent path matches the committed
    tokens was *reached*: one observation, accepted if its own token is the next committed one.
    Observations are summed per (source, match-length bucket) row and (depth bucket, sibling
    rank, claimed-probability bucket) cell (``tree.Calibration``): the decayed count accepted over the decayed sum of the
    conditional probabilities the proposer claimed. A cell with few observations leans on its
    row, a row on its source, a source on 1 (``*_PRIOR_WEIGHT``), so a source, a depth or a
    second-ranked sibling that keeps failing gets lower scores and fewer of the step's nodes,
    and the budget chooser adds up honest probabilities as expected accepted tokens.

    ``backend``: "auto" (``calibration`` and ``learn`` in one compiled call each, where the core
    is built) or "reference" (numpy and ``observe_draft`` per draft: the definition; every sum
    left to right, so the two give bit-identical tables, ``tests/test_budget.py``).
    """

    def __init__(self, backend: str = "auto") -> None:
        if backend not in ("auto", "reference"):
            raise ValueError(f"AcceptanceCalibrator: backend must be 'auto' or 'reference', not {backend!r}")
        self.compiled = backend == "auto" and _core is not None and hasattr(_core, "calibration_table")
        self._rows: dict = {}  # (source, match bucket) -> row of the tables
        self._row_source: list[str] = []
        self._sources: dict[str, int] = {}  # source -> its index (the compiled calibration's)
        self._row_source_index = b""  # int32 per row: its source's index (bytes, for the compiled calibration)
        self._reached = np.zeros((0, CELLS_PER_ROW))  # decayed counts of reached nodes
        self._predicted = np.zeros((0, CELLS_PER_ROW))  # decayed sums of their claimed conditional probabilities
        self._matched = np.zeros((0, CELLS_PER_ROW))  # decayed counts of accepted nodes
        self._calibration: Calibration | None = None  # cached until the next learn
        self._rows_copy: dict | None = None  # the calibrations' copy of _rows (until a row is added)
        self._row_by_match: dict = {}  # (source, match length) -> row (``_row`` without the bucket's bisect)

    def _row(self, draft: Draft) -> int:
        key = calibration_row_key(draft)
        row = self._rows.get(key)
        if row is None:
            row = self._rows[key] = len(self._row_source)
            self._row_source.append(draft.source)
            self._row_source_index += np.int32(self._sources.setdefault(draft.source, len(self._sources))).tobytes()
            self._rows_copy = None
            grow = np.zeros((1, CELLS_PER_ROW))
            self._reached = np.vstack([self._reached, grow])
            self._predicted = np.vstack([self._predicted, grow])
            self._matched = np.vstack([self._matched, grow])
        return row

    def _levels(self) -> tuple[dict, np.ndarray]:
        """Per source and per row: the factor on claimed probabilities, prior included (sums left
        to right: a cumulative sum's last entry)."""
        row_p, row_m = _row_sums(self._predicted), _row_sums(self._matched)
        totals: dict[str, list[float]] = {}
        for row, source in enumerate(self._row_source):
            t = totals.setdefault(source, [0.0, 0.0])
            t[0] += row_p[row]
            t[1] += row_m[row]
        by_source = {s: min(MAX_FACTOR, (m + SOURCE_PRIOR_WEIGHT) / (p + SOURCE_PRIOR_WEIGHT))
                     for s, (p, m) in totals.items()}
        prior = np.array([by_source[s] for s in self._row_source])
        by_row = np.minimum(MAX_FACTOR, (row_m + ROW_PRIOR_WEIGHT * prior) / (row_p + ROW_PRIOR_WEIGHT))
        return by_source, by_row

    def factors(self) -> dict:
        """Every source's and every ``(source, match bucket)`` row's factor."""
        by_source, by_row = self._levels()
        return {**by_source, **{key: float(by_row[row]) for key, row in self._rows.items()}}

    def factor(self, draft: Draft) -> float:
        """The factor of ``draft``'s row, else its source's, else 1."""
        return self.calibration().row_factor(draft)

    def calibration(self) -> Calibration:
        """Each cell's acceptance probability, as ``TokenTree.from_drafts`` takes it (cached
        between steps): accepted over reached, leaning on the row's factor times the cell's mean
        claimed probability (``CELL_PRIOR_WEIGHT`` observations' worth, at most ``MAX_PRIOR_PROB``)."""
        if self._calibration is None and self.compiled:
            table, by_row, by_source = _core.calibration_table(
                self._reached, self._predicted, self._matched, self._row_source_index, len(self._sources),
                _COND_MIDS_BYTES, SOURCE_PRIOR_WEIGHT, ROW_PRIOR_WEIGHT, CELL_PRIOR_WEIGHT, MAX_FACTOR, MAX_PRIOR_PROB)
            if self._rows_copy is None:  # the rows change only when a draft brings a new one
                self._rows_copy = dict(self._rows)
            factors = np.frombuffer(by_source, np.float64).tolist()
            self._calibration = Calibration.packed(self._rows_copy, table, dict(zip(self._sources, factors)), by_row)
        elif self._calibration is None:
            by_source, by_row = self._levels()
            claimed = np.where(self._reached > 0, self._predicted / np.maximum(self._reached, 1e-12), COND_MIDS)
            prior = np.minimum(by_row[:, None] * claimed, MAX_PRIOR_PROB)
            table = (self._matched + CELL_PRIOR_WEIGHT * prior) / (self._reached + CELL_PRIOR_WEIGHT)
            self._calibration = Calibration(dict(self._rows), table, by_source, row_factors=by_row,
                                            probabilities=True)
        return self._calibration

    def merge_counts(self) -> tuple | None:
        """What ``TokenTree.from_drafts`` reads when given this calibrator instead of its
        ``calibration()``: ``(rows, sources, counts)``, the ``(source, match bucket) -> row`` and
        ``source -> index`` dicts and the compiled merge's count arguments, from which it computes
        only the cells its drafts read (each as ``calibration()``'s table holds it, bit for bit:
        the whole table, 1,800 cells, took more than the merge itself). None on the reference
        backend (the merge then takes ``calibration()``)."""
        if not self.compiled or not hasattr(_core, "merge_drafts_counts"):
            return None
        return self._rows, self._sources, (
            self._reached, self._predicted, self._matched, self._row_source_index, len(self._sources),
            _COND_MIDS_BYTES, SOURCE_PRIOR_WEIGHT, ROW_PRIOR_WEIGHT, CELL_PRIOR_WEIGHT, MAX_FACTOR, MAX_PRIOR_PROB)

    @property
    def rows_version(self) -> int:
        """Rows made so far: each new one replaces the count arrays (a fused request hands the
        core the new ones when this moves: ``mixture.FusedRequest.sync``)."""
        return len(self._row_source)

    def row_table(self, names: tuple[str, ...]) -> tuple[list[int], list[int]]:
        """For the compiled lookups' fused plan (``Mixture.plan``): each of ``names``' row per
        match bucket (``MATCH_BUCKETS``, -1 where none yet: the merge then takes the source's
        factor, as ``from_drafts`` does for a draft whose row is unknown), flat, and each name's
        source index (-1 unknown)."""
        rows = [self._rows.get((name, bucket), -1) for name in names for bucket in MATCH_BUCKETS]
        return rows, [self._sources.get(name, -1) for name in names]

    def learnt(self) -> None:
        """The counts were learnt in the core (``mixture.Mixture.finish``): what ``learn`` does
        beside the counting (the cached table dropped)."""
        self._calibration = None

    def learn(self, drafts: Sequence[Draft], committed: Sequence[int]) -> None:
        """After a step: decay the history once, then count every reached node of every draft
        against the ``committed`` tokens (the verified tree needs no pass of its own: every
        verified node came from a draft)."""
        self._calibration = None
        committed = list(committed)
        if self.compiled:
            in_core = getattr(drafts, "learn", None)  # a fused plan's drafts (mixture.PlannedDrafts)
            if in_core is not None and in_core(self, committed):
                return
            rows = []  # first: a new row grows the arrays
            row_by_match = self._row_by_match
            for draft in drafts:
                row = row_by_match.get((draft.source, draft.match_length))
                if row is None:
                    row = row_by_match[draft.source, draft.match_length] = self._row(draft)
                rows.append(row)
            _core.learn_drafts(self._reached, self._predicted, self._matched, HISTORY_DECAY, rows,
                               [draft.packed() for draft in drafts], committed)
            return
        self._reached *= HISTORY_DECAY
        self._predicted *= HISTORY_DECAY
        self._matched *= HISTORY_DECAY
        for draft in drafts:  # tree.observe_draft: compiled (tree.observe_draft_reference: the loop)
            row = self._row(draft)
            observe_draft(draft, committed, self._reached[row], self._predicted[row], self._matched[row])


SIZE_DECAY = 0.95  # per step observed (at any size: a record not refreshed fades back to the prior)
SIZE_PRIOR_STEPS = 3.0  # a size's own record outweighs the overall correction after this many steps


class SizeRecord:
    """Per tree size (root included; a batch's width): the draft tokens steps of that size
    accepted against the gains the chooser added up for them (decayed sums), so the chooser
    corrects each candidate size by its own record (``scales``). Calibrated node probabilities
    promise too much for the marginal nodes the chooser adds last (SmolLM2, log prompts, batches
    of 8: 6 nodes per row accepted what 4 did; summaries: 5-6 nodes what 4 did), and the overall
    correction (``StepCore.scale``) moves every size alike; with a record per size, a size whose
    extra nodes bring nothing stops being chosen. A size without a record takes the overall
    correction, and a record leans on it for ``SIZE_PRIOR_STEPS`` mean steps' worth. Records
    decay with every step observed, whatever its size: a size no longer chosen (its record made
    on other text, e.g. chat before log rewriting) fades back to the overall correction and is
    tried again. A single sequence's step also adds what its smallest unverified sizes would have
    accepted, once the tokens after it tell (``step.SizeHindsight``), so sizes 2-9 are fitted on
    every step, not only where the chooser picked them.

    >>> r = SizeRecord()
    >>> r.scales(3, 1.0)            # nothing observed: the overall correction everywhere
    [1.0, 1.0, 1.0, 1.0]
    >>> for _ in range(20): r.observe(3, promised=4.0, accepted=2.0)
    >>> [round(s, 2) for s in r.scales(3, 1.0)]  # size 3 (index 2) accepted half its promise
    [1.0, 1.0, 0.59, 1.0]
    """

    def __init__(self) -> None:
        # row size - 1: [promised, accepted, steps, step of the last update], decayed to that step
        # (a row never observed is all 0); float64, as the compiled chooser reads it
        # (``choose_tree_nodes(..., record=)``)
        self.table = np.zeros((0, 4))
        self.steps = 0  # steps observed, at any size

    def observe(self, size: int, *, promised: float, accepted: float) -> None:
        """One step observed (``tick``) whose tree of ``size`` tokens accepted ``accepted`` draft
        tokens of the ``promised`` (``add``)."""
        self.tick()
        self.add(size, promised=promised, accepted=accepted)

    def tick(self) -> None:
        """One step observed: every record not added to from now on decays once more."""
        self.steps += 1

    def add(self, size: int, *, promised: float, accepted: float) -> None:
        """What a tree of ``size`` tokens accepted against its ``promised`` gains, counted at the
        current step (a step may add several sizes: ``StepCore``'s hindsight of the sizes it did
        not verify)."""
        if size < 1:
            return
        if size > len(self.table):
            self.grow(size)
        promised_was, accepted_was, steps_was, last = self.table[size - 1].tolist()
        if not steps_was:
            last = self.steps
        keep = SIZE_DECAY ** (self.steps - last)
        self.table[size - 1] = (keep * promised_was + promised, keep * accepted_was + accepted, keep * steps_was + 1.0,
                                self.steps)

    def grow(self, sizes: int) -> None:
        """A table of at least ``sizes`` rows (new rows: never observed)."""
        if sizes > len(self.table):
            grown = np.zeros((max(sizes, 2 * len(self.table), 16), 4))
            grown[: len(self.table)] = self.table
            self.table = grown

    def scales(self, longest: int, scale: float, factor: float = 1.0) -> list[float]:
        """``out[k]``, k = 0 .. ``longest``: the correction of the gains of size ``k + 1`` (``k``
        draft nodes), times ``factor`` (the request's own correction, ``StepCore.request_factor``:
        the record then holds what was promised times it). (The compiled chooser makes the same
        from ``table``: ``choose_tree_nodes``.)"""
        out = [factor * scale] * (longest + 1)
        for row, (promised, accepted, steps, last) in enumerate(self.table[: longest + 1].tolist()):
            if promised > 0:
                prior = SIZE_PRIOR_STEPS * promised / steps  # that many mean steps' gains at the overall correction
                age = SIZE_DECAY ** (self.steps - last)  # the record's weight now
                out[row] = factor * ((age * accepted + prior * scale) / (age * promised + prior))
        return out


class DraftBudget:
    """How many nodes to ask the proposers for, from the number the chooser kept lately.

    Asking for ``max_nodes`` and pruning to the chosen ``n`` loses accepted tokens against asking
    for about ``n`` (proposers spread a larger budget over more, shallower branches, and pruning
    by score does not rebuild their deep chains): on loghub replay, 64 -> 32 by pruning accepts
    2% fewer tokens than a 32-node budget. So the request is the power of 2 at or above
    ``DRAFT_BUDGET_HEADROOM`` times the running mean of kept nodes (at least
    ``DRAFT_BUDGET_MIN``, at most ``max_nodes``). Only past choices enter it.

    >>> b = DraftBudget()
    >>> b.nodes(256)   # nothing observed yet: the full budget
    256
    >>> for _ in range(50): b.observe(20)
    >>> b.nodes(256)   # 2 x 20 -> 64
    64
    """

    def __init__(self, *, min_nodes: int = DRAFT_BUDGET_MIN, headroom: float = DRAFT_BUDGET_HEADROOM) -> None:
        self.mean_kept: float | None = None
        self.min_nodes, self.headroom = min_nodes, headroom

    def nodes(self, max_nodes: int) -> int:
        if self.mean_kept is None:
            return max_nodes
        n = self.min_nodes
        while n < self.headroom * self.mean_kept and n < max_nodes:
            n *= 2
        return min(n, max_nodes)

    def observe(self, kept: int) -> None:
        if self.mean_kept is None:
            self.mean_kept = float(kept)
        else:
            self.mean_kept = DRAFT_BUDGET_DECAY * self.mean_kept + (1 - DRAFT_BUDGET_DECAY) * kept


def choose_num_nodes(sorted_scores: Sequence[float], cost: CostModel, overhead_s: float, max_nodes: int,
                     scale: float | Sequence[float] = 1.0) -> int:
    """The ``n`` (0..max_nodes) maximising (1 + scale x sum of the first n values) / (t(1 + n) +
    overhead); the values are the nodes' probabilities of acceptance in the order pruning keeps
    them (``TokenTree.expected_in_prune_order``), ``scale`` the step's correction of them
    (``StepCore.scale``), one for every n or ``scale[n]`` per n (``SizeRecord.scales``). ``t``
    is the cost curve's optimistic reading (``CostModel.dense``): sizes seldom observed are
    tried again; each size at its own estimate, not padded: the tree verified has exactly
    ``1 + n`` tokens, so ``n`` costs what they cost (a larger tree that costs less wins by its
    own rate). A curve read as padded made weak drafts pay for 2 tokens what 5 cost, where 2
    were slower than 5 and a size-2 record promised more than the rest. The
    first of equal rates wins (fewer nodes).

    >>> cost = CostModel([1, 2, 4], [1.0, 1.1, 1.3])
    >>> choose_num_nodes([0.9, 0.8, 0.01], cost, 0.0, 3)   # the third node is not worth 0.1
    2
    """
    if _core is not None and hasattr(_core, "choose_num_nodes"):  # the same operations, compiled
        if not len(sorted_scores) or max_nodes <= 0:
            return 0
        upto = min(len(sorted_scores), max_nodes) + 1
        scales = [scale] * upto if isinstance(scale, (int, float)) else scale
        return _core.choose_num_nodes(sorted_scores, cost.dense(upto, optimistic=True, padded=False), overhead_s,
                                      max_nodes, scales)
    return choose_num_nodes_reference(sorted_scores, cost, overhead_s, max_nodes, scale)


def _times(factor: float, scale: float | Sequence[float]) -> float | list[float]:
    """``scale`` (one correction, or one per node count) times a request's ``factor``."""
    return factor * scale if isinstance(scale, (int, float)) else [factor * s for s in scale]


def choose_tree_nodes(tree, cost: CostModel, overhead_s: float, max_nodes: int,
                      scale: float | Sequence[float] = 1.0, record: SizeRecord | None = None,
                      factor: float = 1.0) -> int:
    """``choose_num_nodes(tree.expected_in_prune_order(), cost, overhead_s, max_nodes, scale)``:
    where the compiled core holds the tree (``TokenTree._from_core``) in one call that reads the
    gains where they are and makes the optimistic cost curve only as far as it is read (at one
    CPU thread the list of gains, the whole curve and their conversions cost more than the
    choice, every step, cold after the forward). With ``record`` (a ``SizeRecord``; ``scale``
    then a number, the overall correction) each size's gains are corrected by
    ``record.scales(..., scale, factor)``, which the core makes from ``record.table`` as it reads
    them; without ``record``, ``factor`` multiplies ``scale``."""
    if record is None and factor != 1.0:
        scale = _times(factor, scale)
    core = tree.__dict__.get("_core")
    if core is None or not hasattr(core, "choose_num_nodes"):
        if record is not None:
            scale = record.scales(max(min(len(tree) - 1, max_nodes), 0), scale, factor)
        return choose_num_nodes(tree.expected_in_prune_order(), cost, overhead_s, max_nodes, scale)
    count = min(len(core) - 1, max_nodes)
    if count <= 0:
        return 0
    if record is not None:
        return core.choose_num_nodes_record(cost.sizes, cost.prices(), cost.raw_counts, COST_OPTIMISM, overhead_s,
                                            max_nodes, record.table, record.steps, scale, SIZE_PRIOR_STEPS,
                                            SIZE_DECAY, factor, cost.count_scale)
    scales = [scale] * (count + 1) if isinstance(scale, (int, float)) else scale
    return core.choose_num_nodes(cost.sizes, cost.prices(), cost.raw_counts, COST_OPTIMISM, overhead_s, max_nodes, scales,
                                 cost.count_scale)


def choose_tree_nodes_reference(tree, cost: CostModel, overhead_s: float, max_nodes: int,
                                scale: float | Sequence[float] = 1.0, record: SizeRecord | None = None,
                                factor: float = 1.0) -> int:
    """``choose_tree_nodes`` by its definition: the tree's gains in prune order, the numpy chooser."""
    if record is not None:
        scale = record.scales(max(min(len(tree) - 1, max_nodes), 0), scale, factor)
    elif factor != 1.0:
        scale = _times(factor, scale)
    return choose_num_nodes_reference(tree.expected_in_prune_order(), cost, overhead_s, max_nodes, scale)


def choose_num_nodes_reference(sorted_scores: Sequence[float], cost: CostModel, overhead_s: float, max_nodes: int,
                               scale: float | Sequence[float] = 1.0) -> int:
    """``choose_num_nodes`` in numpy: the definition the compiled chooser repeats."""
    values = np.asarray(sorted_scores[:max_nodes], dtype=np.float64)
    if not len(values):
        return 0
    expected = np.empty(len(values) + 1)
    expected[0] = 1.0
    np.cumsum(values, out=expected[1:])
    expected[1:] *= scale if isinstance(scale, (int, float)) else np.asarray(scale[1 : len(values) + 1], np.float64)
    expected[1:] += 1.0
    seconds = cost.dense_reference(len(values) + 1, optimistic=True, padded=False)[1 : len(values) + 2] + overhead_s
    return int(np.argmax(expected / seconds))
