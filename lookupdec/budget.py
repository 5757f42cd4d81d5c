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
import hashlib
import json
import logging
import os
import platform
import time
from typing import Callable, Sequence

import numpy as np

from lookupdec.tree import CELLS_PER_ROW, Calibration, Draft, TokenTree, match_bucket


log = logging.getLogger("lookupdec")

CALIBRATION_SECONDS = 2.0  # start-up budget for measuring t(n) (once per model, device, dtype: cached)
MAX_MEASURED_TOKENS = 256  # t(n) is measured for n = 1, 2, 4 ... 256 tree tokens
COST_CACHE_VERSION = 1
CALIBRATION_REPEATS = 3  # forwards per size; the minimum is kept (least noisy)
PRIOR_WEIGHT = 4.0  # pseudo-observations behind the initial factor of 1.0 (they decay like
#                    real ones, so a source that never matches fades to a factor near 0)
HISTORY_DECAY = 0.95  # per-step decay of old observations (half-life about 14 steps)
MAX_FACTOR = 1.5  # a source's scores are never trusted more than this
DRAFT_BUDGET_HEADROOM = 2.0  # proposers are asked for this many times the nodes lately kept
DRAFT_BUDGET_MIN = 16  # ... but never fewer than this many
DRAFT_BUDGET_DECAY = 0.9  # per-step decay of the running mean of kept nodes


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
        """Time ``forward(n)`` for n = 1, 2, 4, ... ``max_tokens``, in interleaved rounds.

        Noise (other processes, a cold cache) only ever adds time, so each size keeps its
        fastest round, and a size measured slower than a larger one takes the larger one's
        time: verifying more tokens cannot be cheaper. Rounds stop at ``CALIBRATION_REPEATS``
        or when ``CALIBRATION_SECONDS`` are spent (sizes never reached are extrapolated).
        """
        sizes = [1]
        while sizes[-1] < max_tokens:
            sizes.append(min(2 * sizes[-1], max_tokens))
        best = [float("inf")] * len(sizes)
        start = time.perf_counter()
        for _ in range(CALIBRATION_REPEATS):
            for i, n in enumerate(sizes):
                t = time.perf_counter()
                forward(n)
                best[i] = min(best[i], time.perf_counter() - t)
                if time.perf_counter() - start > CALIBRATION_SECONDS:
                    break
            if time.perf_counter() - start > CALIBRATION_SECONDS:
                break
        measured = [(n, t) for n, t in zip(sizes, best) if t < float("inf")]
        seconds = [t for _, t in measured]
        for i in range(len(seconds) - 2, -1, -1):
            seconds[i] = min(seconds[i], seconds[i + 1])
        return cls([n for n, _ in measured], seconds)

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

    def table(self, count: int) -> list[float]:
        """``[t(1), ..., t(count)]``, each value ``self(n)``'s (cached: the chooser's per-step lookup)."""
        table = getattr(self, "_table", None)
        if table is None or len(table) < count:
            size = max(count, 2 * len(table) if table is not None else 0)
            table = self._table = [self(n) for n in range(1, size + 1)]
        return table

    def to_dict(self) -> dict:
        return {"sizes": self.sizes, "seconds": self.seconds}


def cost_cache_path() -> str | None:
    """Where measured cost curves are kept: ``$LOOKUPDEC_COST_CACHE`` (a file; ``off`` disables
    the cache), else ``$XDG_CACHE_HOME/lookupdec/cost_curves.json`` (``~/.cache`` by default)."""
    env = os.environ.get("LOOKUPDEC_COST_CACHE")
    if env:
        return None if env.lower() in ("0", "off", "none") else env
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "lookupdec", "cost_curves.json")


def cost_key(model_config: dict, device, dtype, context_tokens: int) -> str:
    """What a cost curve depends on: the architecture (not the weights' values), the device,
    the dtype, the context length bucket, torch's version and, on CPU, its thread count."""
    import torch

    arch = {k: v for k, v in model_config.items() if k not in ("_name_or_path", "transformers_version")}
    digest = hashlib.sha256(json.dumps(arch, sort_keys=True, default=str).encode()).hexdigest()[:16]
    device = torch.device(device)
    if device.type == "cuda":
        where = f"cuda:{torch.cuda.get_device_name(device)}"
    else:
        where = f"{device.type}:{platform.machine()}:{os.cpu_count()}cpus:{torch.get_num_threads()}threads"
    return f"{model_config.get('model_type', '?')}-{digest}|{where}|{dtype}|ctx{context_tokens}|torch{torch.__version__}"


def load_cached_cost(key: str) -> CostModel | None:
    path = cost_cache_path()
    if not path or not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
        entry = doc["curves"][key] if doc.get("version") == COST_CACHE_VERSION else None
        return CostModel(entry["sizes"], entry["seconds"]) if entry else None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.debug("cost cache %s unreadable (%r): measuring", path, exc)
        return None


def store_cached_cost(key: str, cost: CostModel) -> None:
    """Add one curve to the cache file (atomically; an unwritable cache is only logged)."""
    path = cost_cache_path()
    if not path:
        return
    try:
        doc = {"version": COST_CACHE_VERSION, "curves": {}}
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                old = json.load(f)
            if old.get("version") == COST_CACHE_VERSION:
                doc = old
        doc["curves"][key] = {**cost.to_dict(), "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1)
        os.replace(tmp, path)
    except (OSError, ValueError) as exc:
        log.warning("could not write the cost cache %s: %s", path, exc)


BUCKET_PRIOR_WEIGHT = 2.0  # a bucket starts at its source's factor, worth this many observations
CELL_PRIOR_WEIGHT = 2.0  # a (depth, rank) cell starts at its bucket's factor, worth this many


class AcceptanceCalibrator:
    """Factors on the proposers' conditional acceptance probabilities, learnt from verified
    steps, at two levels:

    - coarse, per source and per (source, match-length bucket): after every step the best
      chain of each source's first draft per bucket is checked against the committed tokens,
      whether it was verified or not ("shadow" checking), so a source whose drafts were pruned
      keeps being measured;
    - fine, per (source, match bucket) row and (depth bucket, sibling rank) cell
      (``tree.Calibration``): every verified node whose parent the target reached is one
      observation of its conditional probability (accepted or not); a cell starts at its
      bucket's coarse factor worth ``CELL_PRIOR_WEIGHT`` observations.

    A factor is the decayed count of nodes accepted over the decayed sum of the probabilities
    the proposer claimed for them, so a source, a depth or a second-ranked sibling that keeps
    failing gets lower scores and fewer of the step's nodes; the budget chooser adds up the
    calibrated probabilities as expected accepted tokens.
    """

    def __init__(self) -> None:
        self._predicted: dict = {}  # key -> decayed sum of predicted conditional probs
        self._matched: dict = {}  # key -> decayed count of nodes that matched
        self._rows: dict = {}  # (source, match bucket) -> row of the fine tables
        self._cell_predicted = np.zeros((0, CELLS_PER_ROW))
        self._cell_matched = np.zeros((0, CELLS_PER_ROW))
        self._calibration: Calibration | None = None  # cached until the next learn

    def _ratio(self, key) -> float:
        predicted, matched = self._predicted[key], self._matched[key]
        return min(MAX_FACTOR, matched / predicted) if predicted > 0 else 1.0

    def factors(self) -> dict:
        """Every observed coarse key's factor: ``source`` and ``(source, bucket)`` keys."""
        return {key: self._ratio(key) for key in self._predicted}

    def factor(self, draft: Draft) -> float:
        """The coarse factor of ``draft``: its (source, bucket) entry, else its source's, else 1."""
        key = (draft.source, match_bucket(draft.match_length))
        if key in self._predicted:
            return self._ratio(key)
        return self._ratio(draft.source) if draft.source in self._predicted else 1.0

    def calibration(self) -> Calibration:
        """The factors as ``TokenTree.from_drafts`` takes them (cached between steps)."""
        if self._calibration is None:
            rows = self._rows
            prior = np.array([self._ratio(key) for key in rows]).reshape(-1, 1)
            table = (self._cell_matched + CELL_PRIOR_WEIGHT * prior) / (self._cell_predicted + CELL_PRIOR_WEIGHT)
            np.minimum(table, MAX_FACTOR, out=table)
            fallback = {key: self._ratio(key) for key in self._predicted if not isinstance(key, tuple)}
            self._calibration = Calibration(dict(rows), table, fallback)
        return self._calibration

    def learn(self, drafts: Sequence[Draft], committed: Sequence[int], tree: TokenTree | None = None,
              accepted: Sequence[int] = ()) -> None:
        """After a step: decay the history once; shadow-check the best chain of each source's
        first draft per match bucket against the ``committed`` tokens (coarse); and, given the
        verified ``tree`` and its ``accepted`` nodes, count every node whose parent was reached
        in its cell (fine).

        Priors are pseudo-observations that decay like real ones: a source starts at factor 1
        worth ``PRIOR_WEIGHT``; a bucket starts at its source's factor worth
        ``BUCKET_PRIOR_WEIGHT``. A source whose drafts never match fades towards 0."""
        self._calibration = None
        for key in self._predicted:
            self._predicted[key] *= HISTORY_DECAY
            self._matched[key] *= HISTORY_DECAY
        self._cell_predicted *= HISTORY_DECAY
        self._cell_matched *= HISTORY_DECAY
        checked: set = set()
        sources_seen: set = set()
        for draft in drafts:
            key = (draft.source, match_bucket(draft.match_length))
            if key in checked:
                continue
            checked.add(key)
            chain, cond_probs = draft.best_chain()
            predicted = matched = 0.0
            for token, prob, actual in zip(chain, cond_probs, committed):
                predicted += prob
                if token != actual:
                    break
                matched += 1
            if draft.source not in self._predicted:
                self._predicted[draft.source] = self._matched[draft.source] = PRIOR_WEIGHT
            if key not in self._predicted:
                self._predicted[key] = BUCKET_PRIOR_WEIGHT
                self._matched[key] = BUCKET_PRIOR_WEIGHT * self._ratio(draft.source)
            if key not in self._rows:
                self._rows[key] = len(self._rows)
                self._cell_predicted = np.vstack([self._cell_predicted, np.zeros(CELLS_PER_ROW)])
                self._cell_matched = np.vstack([self._cell_matched, np.zeros(CELLS_PER_ROW)])
            targets = [key] if draft.source in sources_seen else [key, draft.source]
            sources_seen.add(draft.source)
            for k in targets:
                self._predicted[k] += predicted
                self._matched[k] += matched
        if tree is not None and len(tree) > 1:
            self._learn_cells(tree, accepted)

    def _learn_cells(self, tree: TokenTree, accepted: Sequence[int]) -> None:
        predicted, matched = self._cell_predicted.reshape(-1), self._cell_matched.reshape(-1)
        accepted_set = set(accepted)
        for parent in [0, *accepted]:
            for node in tree.children[parent].values():
                cell = tree.cells[node]
                if 0 <= cell < len(predicted):
                    predicted[cell] += tree.conds[node]
                    if node in accepted_set:
                        matched[cell] += 1.0


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

    def __init__(self) -> None:
        self.mean_kept: float | None = None

    def nodes(self, max_nodes: int) -> int:
        if self.mean_kept is None:
            return max_nodes
        n = DRAFT_BUDGET_MIN
        while n < DRAFT_BUDGET_HEADROOM * self.mean_kept and n < max_nodes:
            n *= 2
        return min(n, max_nodes)

    def observe(self, kept: int) -> None:
        if self.mean_kept is None:
            self.mean_kept = float(kept)
        else:
            self.mean_kept = DRAFT_BUDGET_DECAY * self.mean_kept + (1 - DRAFT_BUDGET_DECAY) * kept


def choose_num_nodes(sorted_scores: Sequence[float], cost: CostModel, overhead_s: float, max_nodes: int) -> int:
    """The ``n`` (0..max_nodes) maximising (1 + sum of the first n values) / (t(1 + n) + overhead);
    the values are the nodes' probabilities of acceptance in the order pruning keeps them
    (``TokenTree.expected_in_prune_order``). ``choose_num_nodes_reference``'s loop with ``t(n)``
    read from a table cached on the cost model (its interpolation was most of the time).

    >>> cost = CostModel([1, 2, 4], [1.0, 1.1, 1.3])
    >>> choose_num_nodes([0.9, 0.8, 0.01], cost, 0.0, 3)   # the third node is not worth 0.1
    2
    """
    best_n, best_rate, expected = 0, 1.0 / (cost(1) + overhead_s), 1.0
    scores = sorted_scores[:max_nodes]
    seconds = cost.table(len(scores) + 1)  # seconds[n] = t(1 + n)
    for n, score in enumerate(scores, start=1):
        expected += score
        rate = expected / (seconds[n] + overhead_s)
        if rate > best_rate:
            best_n, best_rate = n, rate
    return best_n


def choose_num_nodes_reference(sorted_scores: Sequence[float], cost: CostModel, overhead_s: float,
                               max_nodes: int) -> int:
    """``choose_num_nodes`` by its definition: every prefix in turn."""
    best_n, best_rate, expected = 0, 1.0 / (cost(1) + overhead_s), 1.0
    for n, score in enumerate(sorted_scores[:max_nodes], start=1):
        expected += score
        rate = expected / (cost(1 + n) + overhead_s)
        if rate > best_rate:
            best_n, best_rate = n, rate
    return best_n
