"""The definitions of ``lookupdec/budget.py``'s compiled paths (``csrc/tree/tree.cpp``): the cost
curve (``cost_curve``), the size choice (``choose_num_nodes``) and the acceptance calibrator's
counts and table (``AcceptanceCalibrator``), in numpy, every sum left to right as the core adds.

``budget.py`` falls back on them where the extension is not built, and imports from here what
both use: the calibrator's priors and decay (the compiled calls take them as arguments) and the
cost curve's tail (``tail_slope``, which a new size's interpolation shares). ``tests/test_budget.py``
and ``tests/test_tree_compiled.py`` compare each with its compiled path, bit for bit.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from lookupdec.reference import tree as reference_tree
from lookupdec.tree import CELLS_PER_ROW, COND_MIDS, MATCH_BUCKETS, Calibration, calibration_row_key

HISTORY_DECAY = 0.95  # the calibrator's per-step decay of old observations (half-life about 14 steps)
MAX_FACTOR = 1.5  # a source's scores are never trusted more than this
SOURCE_PRIOR_WEIGHT = 1.0  # a source starts at factor 1, worth this many predicted tokens
ROW_PRIOR_WEIGHT = 2.0  # a (source, match bucket) row starts at its source's factor, worth this many
CELL_PRIOR_WEIGHT = 2.0  # a cell starts at its row's factor x its claimed probability, worth this many nodes
MAX_PRIOR_PROB = 0.9  # ... but a cell never observed is not believed certain


def tail_slope(sizes: Sequence[float], seconds: Sequence[float]) -> float:
    """Seconds per token past the largest size of a cost curve: the secant from the largest
    size back to one at most half as large (adjacent sizes differ by noise alone), never below 0
    nor above the largest size's seconds per token (``n`` tokens never cost more than ``n / m``
    forwards of ``m``). (The compiled curve repeats it; ``CostModel``'s interpolation of a new
    size past the largest uses it too.)

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


def cost_curve(sizes: Sequence[int], seconds: Sequence[float], upto: int, *, padded: bool = True) -> np.ndarray:
    """Defines ``CostModel.dense`` (compiled: ``native.tree.cost_curve``): ``out[k]`` = the cost
    of ``k`` tokens, k = 0 ... at least ``upto`` (``out[0] = out[1]``), interpolated between the
    sizes, linear past the largest (``tail_slope``); ``padded``: the cheapest of any size from
    ``k`` up, else each size at its own estimate."""
    top = max(upto, sizes[-1])
    ks = np.arange(1, top + 1, dtype=np.float64)
    xs, ys = np.asarray(sizes, dtype=np.float64), np.asarray(seconds, dtype=np.float64)
    curve = np.interp(ks, xs, ys)
    if len(xs) > 1 and top > xs[-1]:  # linear past the last size
        tail = ks > xs[-1]
        curve[tail] = ys[-1] + tail_slope(xs, ys) * (ks[tail] - xs[-1])
    if padded:
        curve = np.minimum.accumulate(curve[::-1])[::-1]
    return np.concatenate([curve[:1], curve])


def choose_num_nodes(sorted_scores: Sequence[float], cost, overhead_s: float, max_nodes: int,
                     scale: float = 1.0) -> int:
    """Defines ``budget.choose_num_nodes`` and ``choose_tree_nodes`` (compiled:
    ``native.tree.choose_num_nodes``, ``Tree.choose_num_nodes``): the ``n`` (0..max_nodes)
    maximising (1 + scale x the sum of the first n values) / (t(1 + n) + overhead), ``t`` the
    curve of ``cost`` (a ``budget.CostModel``: its ``sizes`` and ``seconds``) each size at its own
    estimate (``cost_curve(padded=False)``). Ties: fewer nodes."""
    values = np.asarray(sorted_scores[:max_nodes], dtype=np.float64)
    if not len(values):
        return 0
    expected = np.empty(len(values) + 1)
    expected[0] = 1.0
    np.cumsum(values, out=expected[1:])
    expected[1:] *= scale
    expected[1:] += 1.0
    seconds = cost_curve(cost.sizes, cost.seconds, len(values) + 1, padded=False)[1 : len(values) + 2] + overhead_s
    return int(np.argmax(expected / seconds))


def _row_sums(counts: np.ndarray) -> np.ndarray:
    """Each row's sum, left to right (numpy's ``sum`` adds in pairs: its last bits differ)."""
    return np.cumsum(counts, axis=1)[:, -1] if counts.shape[0] else np.zeros(0)


class AcceptanceCalibrator:
    """Defines ``budget.AcceptanceCalibrator``'s compiled counts and table
    (``native.tree.learn_drafts``, ``calibration_table``, ``merge_drafts_counts``): its interface,
    in numpy, every sum left to right as the core adds. ``budget.AcceptanceCalibrator()`` is one
    of these where the extension is not built. It has no compiled counts (``merge_counts`` is
    None), so a fused plan (``Mixture.plan``) does not take it.

    After a step every node of every draft, verified or not, whose parent path matches the
    committed tokens was *reached*: one observation, accepted if its token is the next committed
    one. Observations are summed per (source, match bucket) row and (depth bucket, sibling rank,
    claimed-probability bucket) cell (``tree.Calibration``): decayed accepted over decayed claimed.
    A cell with few observations leans on its row, a row on its source, a source on 1
    (``*_PRIOR_WEIGHT``).
    """

    def __init__(self) -> None:
        self._rows: dict = {}  # (source, match bucket) -> row of the tables
        self._row_source: list[str] = []
        self._sources: dict[str, int] = {}  # source -> its index
        self._reached = np.zeros((0, CELLS_PER_ROW))  # decayed counts of reached nodes
        self._predicted = np.zeros((0, CELLS_PER_ROW))  # decayed sums of their claimed conditional probabilities
        self._matched = np.zeros((0, CELLS_PER_ROW))  # decayed counts of accepted nodes
        self._calibration: Calibration | None = None  # cached until the next learn

    def _row(self, draft) -> int:
        key = calibration_row_key(draft)
        row = self._rows.get(key)
        if row is None:
            row = self._rows[key] = len(self._row_source)
            self._row_source.append(draft.source)
            self._sources.setdefault(draft.source, len(self._sources))
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

    def factor(self, draft) -> float:
        """The factor of ``draft``'s row, else its source's, else 1."""
        return self.calibration().row_factor(draft)

    def calibration(self) -> Calibration:
        """Each cell's acceptance probability, as ``TokenTree.from_drafts`` takes it (cached
        between steps): accepted over reached, leaning on the row's factor times the cell's mean
        claimed probability (``CELL_PRIOR_WEIGHT`` observations' worth, at most ``MAX_PRIOR_PROB``)."""
        if self._calibration is None:
            by_source, by_row = self._levels()
            claimed = np.where(self._reached > 0, self._predicted / np.maximum(self._reached, 1e-12), COND_MIDS)
            prior = np.minimum(by_row[:, None] * claimed, MAX_PRIOR_PROB)
            table = (self._matched + CELL_PRIOR_WEIGHT * prior) / (self._reached + CELL_PRIOR_WEIGHT)
            self._calibration = Calibration(dict(self._rows), table, by_source, row_factors=by_row,
                                            probabilities=True)
        return self._calibration

    def merge_counts(self) -> None:
        """No compiled counts: ``TokenTree.from_drafts`` reads ``calibration()``."""
        return None

    @property
    def rows_version(self) -> int:
        """Rows made so far."""
        return len(self._row_source)

    def row_table(self, names: tuple[str, ...]) -> tuple[list[int], list[int]]:
        """Each of ``names``' row per match bucket (-1 where none yet), flat, and each name's
        source index (-1 unknown)."""
        rows = [self._rows.get((name, bucket), -1) for name in names for bucket in MATCH_BUCKETS]
        return rows, [self._sources.get(name, -1) for name in names]

    def learnt(self) -> None:
        """The counts changed elsewhere: the cached table is dropped."""
        self._calibration = None

    def learn(self, drafts: Sequence, committed: Sequence[int]) -> None:
        """After a step: decay the history once, then count every reached node of every draft
        against the ``committed`` tokens (``reference.tree.observe_draft``; the verified tree needs
        no pass of its own: every verified node came from a draft)."""
        self._calibration = None
        committed = list(committed)
        self._reached *= HISTORY_DECAY
        self._predicted *= HISTORY_DECAY
        self._matched *= HISTORY_DECAY
        for draft in drafts:
            row = self._row(draft)
            reference_tree.observe_draft(draft, committed, self._reached[row], self._predicted[row],
                                         self._matched[row])
