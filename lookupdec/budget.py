"""How many draft nodes to verify per step: measured cost against calibrated acceptance.

``CostModel`` learns ``t(n)``, one verify forward of ``n`` tokens, from the engine's own timed
forwards; ``AcceptanceCalibrator`` learns how far each proposer's claimed probabilities are from
what is accepted; ``choose_num_nodes`` keeps the ``n`` best nodes maximising ``(1 + expected
accepted) / (t(1 + n) + overhead)``; ``DraftBudget`` sizes the proposers' request. Only history
enters (committed tokens, timings), never a step's random draws: sampling stays exact. Why each
part is there, and the layers removed because they did not pay: docs/design/chooser.md.

The curve, the choice and the calibrator's counts and table are compiled (``csrc/tree/tree.cpp``)
where the extension is built; their definitions, which run where it is not, are in
``lookupdec/reference/budget.py``, with the calibrator's priors and decay and the curve's tail
(``tail_slope``) that both use (imported from there).
"""
from __future__ import annotations

import bisect
import time
from typing import Callable, Sequence

import numpy as np

from lookupdec.native import tree as native_tree  # the compiled tree submodule, None where not built
from lookupdec.reference import budget as reference_budget
# what the definitions (lookupdec/reference/budget.py) and the compiled paths share, re-exported
from lookupdec.reference.budget import (CELL_PRIOR_WEIGHT, HISTORY_DECAY, MAX_FACTOR, MAX_PRIOR_PROB,
                                        ROW_PRIOR_WEIGHT, SOURCE_PRIOR_WEIGHT, tail_slope)
from lookupdec.tree import CELLS_PER_ROW, COND_MIDS, MATCH_BUCKETS, Calibration, Draft, calibration_row_key

CALIBRATION_SECONDS = 2.0  # cap on a full measurement (``CostModel.measure``, benchmarks)
CALIBRATION_REPEATS = 3  # forwards per size in a full measurement; the minimum is kept (least noisy)
SEED_SIZES = (1, 4, 16, 64)  # an engine's first context bucket: one forward each, then learnt online
COST_LEARNING_RATE = 0.1  # an observed forward moves its size's estimate this far (after the first few)
COST_SPIKE = 2.0  # an observation above this many times the estimate counts as this many times
# Counts decay per forward of the curve, so an estimate made under other conditions gives way
# once observed again (rate 1 / count); a size the chooser avoids is observed only by ``explore``.
COUNT_DECAY = 0.995
RESCALE_BELOW = 1e-3  # CostModel folds its running count scale into the raw sums below this
EXPLORE_EVERY = 32
EXPLORE_SPAN = 4
EXPLORE_MIN_COUNT = 3.0
EXPLORE_ROOT = True
CACHED_COUNT_CAP = 4.0  # a curve from the cost cache or another bucket counts as this many forwards at most per size
CACHED_MIN_COUNT = 0.5  # ... and keeps only sizes observed at least this many times lately
DRAFT_BUDGET_HEADROOM = 2.0  # proposers are asked for this many times the nodes lately kept
DRAFT_BUDGET_MIN = 16  # ... but never fewer than this many
DRAFT_BUDGET_DECAY = 0.9  # per-step decay of the running mean of kept nodes


class CostModel:
    """``t(n)``: seconds for one verify forward of ``n`` tokens (the root included), learnt.

    Seeded by a few timed forwards (``measure``) or a cached curve (``trusted``), then refined by
    every verify forward the engine times (``observe``, spikes clipped); interpolated between
    observed sizes. Costs need not grow with ``n``: the single-sequence chooser weighs every size
    at its own cost; a caller that pads (a batch's width) reads ``dense(padded=True)``."""

    def __init__(self, sizes: Sequence[int], seconds: Sequence[float], counts: Sequence[int] | None = None) -> None:
        if not sizes or list(sizes) != sorted(set(sizes)) or len(sizes) != len(seconds):
            raise ValueError("CostModel: sizes must be increasing and match seconds")
        self.sizes, self.seconds = [int(n) for n in sizes], [float(t) for t in seconds]
        # observations per size, decayed: raw sums times one running scale, so an observe changes
        # one size's sum and the scale (the compiled chooser and curve multiply the two)
        self.raw_counts = [float(c) for c in counts] if counts is not None else [1.0] * len(self.sizes)
        self.count_scale = 1.0
        self._since_explore = 0  # choices since the last exploration (``explore``)
        self._root_explored = 0  # the size chosen when ``explore`` last took the root alone instead (0: none pending)
        self._curves: dict[bool, np.ndarray] = {}  # padded -> dense()

    @property
    def counts(self) -> list[float]:
        """The decayed number of forwards behind each size's estimate, a new list."""
        scale = self.count_scale
        return [c * scale for c in self.raw_counts]

    def copy(self) -> "CostModel":
        """The same estimates and counts, to be learnt apart (another bucket's: ``trusted``)."""
        return CostModel(self.sizes, self.seconds, self.counts)

    def trusted(self, max_count: float = CACHED_COUNT_CAP, min_count: float = CACHED_MIN_COUNT) -> "CostModel | None":
        """What another process or context bucket hands on: the sizes observed at least
        ``min_count`` times lately, each counting as ``max_count`` forwards at most (None where
        fewer than two are left: measure instead); its first choice explores. An estimate seen
        long ago may come from a busy machine, and a size avoided for it is never observed again.

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
        """Time ``forward(n)`` for each of ``sizes`` (default 1, 2, 4, ... ``max_tokens``) in
        ``repeats`` interleaved rounds, keeping each size's fastest, within
        ``CALIBRATION_SECONDS``. ``forward`` may return seconds of its call that are not the
        forward's cost (one-time kernel choices): they are not counted."""
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

    def _follow_level(self, ratio: float, below: int) -> None:
        """The root alone, explored because the curve priced it as dear as the larger size
        ``below`` that the chooser took (``explore``), ran at ``ratio`` of its estimate: where
        faster, the machine's speed has changed since the stale estimates were made, so every
        size between the two observed under ``EXPLORE_MIN_COUNT`` times lately moves by the same
        ratio. Never up: a size priced too low is taken, so measured, anyway."""
        if ratio < 1.0:
            counts = self.counts
            for j, m in enumerate(self.sizes):
                if 1 < m < below and counts[j] < EXPLORE_MIN_COUNT:
                    self.seconds[j] *= ratio

    def count(self, n: int) -> float:
        """The decayed number of forwards of ``n`` tokens behind its estimate (0: interpolated)."""
        i = bisect.bisect_left(self.sizes, n)
        return self.raw_counts[i] * self.count_scale if i < len(self.sizes) and self.sizes[i] == n else 0.0

    def explore(self, nodes: int, available: int) -> int:
        """The draft nodes to verify given the chooser's ``nodes`` (of ``available``): ``nodes``, or
        once every ``EXPLORE_EVERY`` calls the size observed least lately among one node fewer, up
        to ``EXPLORE_SPAN`` more and twice ``nodes`` plus one, if under ``EXPLORE_MIN_COUNT``; or
        the root alone where the curve prices it at or above the tree chosen and it was observed
        less lately (a stale curve may say one token costs as much as more); found faster than
        its estimate, the stale sizes between follow (``_follow_level``). Nothing while the
        chooser takes the root alone. History only: sampling stays exact.

        >>> cost = CostModel([1, 4, 8], [1.0, 1.1, 1.5])
        >>> [cost.explore(3, 7) for _ in range(EXPLORE_EVERY)][-2:]   # 5 tokens never observed
        [3, 4]
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
        """Linear between measured sizes, extrapolated past the ends; ``skip``: a position to ignore."""
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

    def dense(self, upto: int, *, padded: bool = True) -> np.ndarray:
        """``out[k]`` = the cost of ``k`` tokens, k = 0 ... upto (``out[0] = out[1]``), interpolated
        (past the largest size: ``tail_slope``); ``padded``: the cheapest of any size from ``k``
        up (what a caller that pads pays); else each size at its own estimate. Cached until the
        next ``observe``; compiled where built, else its definition
        (``reference.budget.cost_curve``, bit for bit)."""
        cached = self._curves.get(padded)
        if cached is None or len(cached) <= upto:
            if native_tree is not None and hasattr(native_tree, "cost_curve"):
                cached = np.frombuffer(native_tree.cost_curve(self.sizes, self.seconds, upto, padded), np.float64)
            else:
                cached = reference_budget.cost_curve(self.sizes, self.seconds, upto, padded=padded)
            self._curves[padded] = cached
        return cached

    def __call__(self, n: int) -> float:
        return float(self.dense(n)[n])

    def to_dict(self) -> dict:
        return {"sizes": self.sizes, "seconds": self.seconds, "counts": self.counts}


_COND_MIDS_BYTES = np.ascontiguousarray(COND_MIDS, dtype=np.float64).tobytes()


class AcceptanceCalibrator:
    """Factors on the proposers' conditional acceptance probabilities, learnt from every step.

    After a step every node of every draft, verified or not, whose parent path matches the
    committed tokens was *reached*: one observation, accepted if its token is the next committed
    one. Observations are summed per (source, match bucket) row and (depth bucket, sibling rank,
    claimed-probability bucket) cell (``tree.Calibration``): decayed accepted over decayed claimed.
    A cell with few observations leans on its row, a row on its source, a source on 1
    (``*_PRIOR_WEIGHT``). The counts are learnt and the table made in the compiled core; their
    definition, ``lookupdec.reference.budget.AcceptanceCalibrator`` (numpy, every sum left to
    right, the same interface), is what ``AcceptanceCalibrator()`` gives where the extension is
    not built.
    """

    def __new__(cls):
        if native_tree is None or not hasattr(native_tree, "calibration_table"):  # the core is absent: the definition
            return reference_budget.AcceptanceCalibrator()
        return super().__new__(cls)

    def __init__(self) -> None:
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

    def factors(self) -> dict:
        """Every source's and every ``(source, match bucket)`` row's factor (``calibration()``'s)."""
        calibration = self.calibration()
        row_factors = calibration.row_factors
        return {**calibration.fallback, **{key: float(row_factors[row]) for key, row in calibration.rows.items()}}

    def factor(self, draft: Draft) -> float:
        """The factor of ``draft``'s row, else its source's, else 1."""
        return self.calibration().row_factor(draft)

    def calibration(self) -> Calibration:
        """Each cell's acceptance probability as ``TokenTree.from_drafts`` takes it (cached between steps)."""
        if self._calibration is None:
            table, by_row, by_source = native_tree.calibration_table(
                self._reached, self._predicted, self._matched, self._row_source_index, len(self._sources),
                _COND_MIDS_BYTES, SOURCE_PRIOR_WEIGHT, ROW_PRIOR_WEIGHT, CELL_PRIOR_WEIGHT, MAX_FACTOR, MAX_PRIOR_PROB)
            if self._rows_copy is None:  # the rows change only when a draft brings a new one
                self._rows_copy = dict(self._rows)
            factors = np.frombuffer(by_source, np.float64).tolist()
            self._calibration = Calibration.packed(self._rows_copy, table, dict(zip(self._sources, factors)), by_row)
        return self._calibration

    def merge_counts(self) -> tuple | None:
        """What ``TokenTree.from_drafts`` reads instead of ``calibration()`` to compute only the
        cells its drafts read (bit for bit as the table): ``(rows, sources, counts)``; None where
        the core has no such merge."""
        if not hasattr(native_tree, "merge_drafts_counts"):
            return None
        return self._rows, self._sources, (
            self._reached, self._predicted, self._matched, self._row_source_index, len(self._sources),
            _COND_MIDS_BYTES, SOURCE_PRIOR_WEIGHT, ROW_PRIOR_WEIGHT, CELL_PRIOR_WEIGHT, MAX_FACTOR, MAX_PRIOR_PROB)

    @property
    def rows_version(self) -> int:
        """Rows made so far (a fused request hands the core new count arrays when this moves)."""
        return len(self._row_source)

    def row_table(self, names: tuple[str, ...]) -> tuple[list[int], list[int]]:
        """For the fused plan (``Mixture.plan``): each of ``names``' row per match bucket (-1
        where none yet), flat, and each name's source index (-1 unknown)."""
        rows = [self._rows.get((name, bucket), -1) for name in names for bucket in MATCH_BUCKETS]
        return rows, [self._sources.get(name, -1) for name in names]

    def learnt(self) -> None:
        """The counts were learnt in the core (``Mixture.finish``): the cached table is dropped."""
        self._calibration = None

    def learn(self, drafts: Sequence[Draft], committed: Sequence[int]) -> None:
        """After a step: decay the history once, then count every reached node of every draft."""
        self._calibration = None
        committed = list(committed)
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
        native_tree.learn_drafts(self._reached, self._predicted, self._matched, HISTORY_DECAY, rows,
                                 [draft.packed() for draft in drafts], committed)


class DraftBudget:
    """How many nodes to ask the proposers for: the power of 2 at or above
    ``DRAFT_BUDGET_HEADROOM`` times the running mean of nodes kept (at least ``DRAFT_BUDGET_MIN``,
    at most ``max_nodes``). Proposers asked for many nodes spread them over more, shallower
    branches, and pruning by score does not rebuild their deep chains. Only past choices enter.

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
                     scale: float = 1.0) -> int:
    """The ``n`` (0..max_nodes) maximising (1 + scale x the sum of the first n values) / (t(1 + n)
    + overhead): the values are the nodes' acceptance probabilities in prune order
    (``TokenTree.expected_in_prune_order``), ``scale`` the step's correction (``StepCore.scale``),
    ``t`` each size at its own estimate (``dense(padded=False)``). Ties: fewer nodes. Compiled
    where built, else its definition (``reference.budget.choose_num_nodes``).

    >>> cost = CostModel([1, 2, 4], [1.0, 1.1, 1.3])
    >>> choose_num_nodes([0.9, 0.8, 0.01], cost, 0.0, 3)   # the third node is not worth 0.1
    2
    """
    if native_tree is not None and hasattr(native_tree, "choose_num_nodes"):  # the same operations, compiled
        if not len(sorted_scores) or max_nodes <= 0:
            return 0
        upto = min(len(sorted_scores), max_nodes) + 1
        return native_tree.choose_num_nodes(sorted_scores, cost.dense(upto, padded=False), overhead_s, max_nodes, scale)
    return reference_budget.choose_num_nodes(sorted_scores, cost, overhead_s, max_nodes, scale)  # (the core is absent)


def choose_tree_nodes(tree, cost: CostModel, overhead_s: float, max_nodes: int, scale: float = 1.0) -> int:
    """``choose_num_nodes`` on the tree's gains in prune order: one compiled call where the core
    holds the tree (``TokenTree._from_core``), the curve made only as far as it is read."""
    core = tree.__dict__.get("_core")
    if core is None or not hasattr(core, "choose_num_nodes"):
        return choose_num_nodes(tree.expected_in_prune_order(), cost, overhead_s, max_nodes, scale)
    count = min(len(core) - 1, max_nodes)
    if count <= 0:
        return 0
    return core.choose_num_nodes(cost.sizes, cost.seconds, overhead_s, max_nodes, scale)
