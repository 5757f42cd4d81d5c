"""The tree format and its two types: a proposer's ``Draft`` and the step's ``TokenTree``.

The bottom of the package: it imports nothing of lookupdec but the compiled core's tree
submodule (``lookupdec.native.tree``, same layer), and everything that handles trees (proposers,
acceptance, the model, the step) imports it.

Fast paths and references. ``TokenTree.from_drafts`` merges in the compiled core
(``csrc/tree/tree.cpp``) when it is built and falls back to ``from_drafts_reference``, the pure-Python
definition, otherwise; trees it builds carry their depth and prune order, so ``prune``,
``expected_in_prune_order`` and ``children`` cost no per-node Python work beyond list copies, and
``ancestor_mask`` is compiled too. ``tests/test_tree_compiled.py`` checks every fast path against
its reference on random drafts (token ids, parents, cells exactly; scores are bit-identical too).

One format (docs/architecture.md, "The tree format"): ``token_ids[i]`` and ``parents[i]`` for every node, and parents
come before children (``parents[i] < i``). In a ``Draft``, ``parents[i] == -1`` marks a child of
the root (the last committed token). In a ``TokenTree`` node 0 is the root itself (not yet in
the KV cache) with ``parents[0] == -1``: ``TokenTree.from_drafts`` merges drafts into one trie
and prunes it to ``max_nodes`` draft nodes. Everything else — RoPE positions, the attention mask,
paths — is derived from those two lists by the pure functions here. A RoPE position
(``depth``, offset by the cache length) and a cache slot (the node index, offset by the cache
length) are different things: siblings share a position but never a slot.

Worked example::

    root=7, drafts: chain [1, 2, 3] (scores .9 .8 .5) and chain [1, 4] (scores .9 .6)
    -> token_ids [7, 1, 2, 3, 4], parents [-1, 0, 1, 2, 1], depth [0, 1, 2, 3, 2]
    with max_nodes=3 -> keeps 1 (.9), 2 (.8), 4 (.6): token_ids [7, 1, 2, 4], parents [-1, 0, 1, 1]
"""
from __future__ import annotations

import bisect
from array import array
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Sequence

import numpy as np

from lookupdec.native import tree as native_tree  # None where not built: the references run

MATCH_BUCKETS = (0, 1, 2, 3, 5, 9, 17, 33)  # match lengths are calibrated in these buckets


def match_bucket(match_length: int) -> int:
    """The lower end of ``match_length``'s bucket.

    >>> [match_bucket(n) for n in (0, 1, 2, 4, 8, 16, 40)]
    [0, 1, 2, 3, 5, 9, 33]
    """
    return MATCH_BUCKETS[bisect.bisect_right(MATCH_BUCKETS, match_length) - 1]


def calibration_row_key(draft: "Draft") -> tuple[str, int]:
    """The calibration row a draft's nodes are counted in: its source and match-length bucket."""
    return draft.source, match_bucket(draft.match_length)


@dataclass(frozen=True)
class Draft:
    """One proposer's small tree, hung under the root (the last committed token)."""

    token_ids: tuple[int, ...]  # [n] draft tokens
    parents: tuple[int, ...]  # [n] parent index in this draft, -1 = child of the root
    scores: tuple[float, ...]  # [n] proposer's estimate that node i is accepted (in [0, 1])
    source: str  # proposer name, used for per-source acceptance stats
    match_length: int = 0  # context tokens the draft's match rests on (0: not a lookup), for
    #                        calibration per source and match length
    # Draft-model drafts when sampling: draft node (-1 = the root) -> (q [vocab], tokens drawn
    # i.i.d. from q there, in order). Acceptance uses them for rejection sampling (sampling.py).
    samples: dict | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if len(self.parents) != n or len(self.scores) != n:
            raise ValueError(f"Draft from {self.source!r}: token_ids, parents, scores lengths differ")
        for i, p in enumerate(self.parents):
            if not -1 <= p < i:
                raise ValueError(f"Draft from {self.source!r}: parents[{i}]={p} must be in [-1, {i})")

    @classmethod
    def _trusted(cls, token_ids: tuple | None, parents: tuple | None, scores: tuple | None, source: str,
                 match_length: int = 0, packed: tuple | None = None) -> "Draft":
        """A draft whose parents are valid by construction (no per-node check). ``packed``: its
        arrays as bytes (``packed()``); given alone (the three tuples None), the tuples are made
        from it on first use."""
        draft = cls.__new__(cls)
        fields = draft.__dict__
        fields.update(source=source, match_length=match_length, samples=None)
        if token_ids is not None:
            fields.update(token_ids=token_ids, parents=parents, scores=scores)
        if packed is not None:
            fields["_packed"] = packed
        return draft

    def __getattr__(self, name: str):
        """``token_ids``, ``parents`` and ``scores`` of a draft made from packed arrays, on first use."""
        packed = self.__dict__.get("_packed")
        if name not in ("token_ids", "parents", "scores") or packed is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        tokens, parents, scores = packed
        self.__dict__.update(token_ids=tuple(np.frombuffer(tokens, np.int32).tolist()),
                             parents=tuple(np.frombuffer(parents, np.int32).tolist()),
                             scores=tuple(np.frombuffer(scores, np.float64).tolist()))
        return self.__dict__[name]

    def packed(self) -> tuple[bytes, bytes, bytes]:
        """``token_ids`` (int32), ``parents`` (int32) and ``scores`` (float64) as bytes, for the
        compiled merge (made once per draft)."""
        packed = self.__dict__.get("_packed")
        if packed is None:
            packed = (array("i", self.token_ids).tobytes(), array("i", self.parents).tobytes(),
                      array("d", self.scores).tobytes())
            self.__dict__["_packed"] = packed
        return packed

    def best_chain(self) -> tuple[list[int], list[float]]:
        """The path that follows the best-scored child from the root: (tokens, conditional
        probabilities score[i] / score[parent])."""
        if self.parents == tuple(range(-1, len(self.parents) - 1)):  # already a chain
            prev = (1.0,) + self.scores[:-1]
            return list(self.token_ids), [s / p if p > 0 else 0.0 for s, p in zip(self.scores, prev)]
        children: dict[int, list[int]] = {}
        for i, p in enumerate(self.parents):
            children.setdefault(p, []).append(i)
        tokens, cond, node, parent_score = [], [], -1, 1.0
        while node in children:
            node = max(children[node], key=lambda i: self.scores[i])
            tokens.append(self.token_ids[node])
            cond.append(self.scores[node] / parent_score if parent_score > 0 else 0.0)
            parent_score = self.scores[node]
        return tokens, cond

    @classmethod
    def chain(cls, token_ids: Sequence[int], scores: Sequence[float], source: str, match_length: int = 0) -> "Draft":
        """A single path: node i is the child of node i-1."""
        n = len(token_ids)
        if len(scores) != n:
            raise ValueError(f"Draft from {source!r}: token_ids, parents, scores lengths differ")
        return cls._trusted(tuple(token_ids), tuple(range(-1, n - 1)), tuple(scores), source, match_length)


DEPTH_BUCKETS = (1, 2, 3, 5, 9, 17)  # node depths are calibrated in these buckets
SIBLING_RANKS = 3  # sibling rank (by score within a draft) is calibrated as 0, 1, 2 or more
COND_BUCKETS = (0.0, 0.25, 0.5, 0.75, 0.95)  # and the proposer's own conditional probability
CELLS_PER_ROW = len(DEPTH_BUCKETS) * SIBLING_RANKS * len(COND_BUCKETS)
# each cell's midpoint of its conditional probability bucket, [CELLS_PER_ROW]
COND_MIDS = np.tile(np.diff(np.append(COND_BUCKETS, 1.0)) / 2 + np.array(COND_BUCKETS), len(DEPTH_BUCKETS) * SIBLING_RANKS)
if native_tree is not None and (tuple(getattr(native_tree, "DEPTH_BUCKETS", ())) != DEPTH_BUCKETS
                                or getattr(native_tree, "SIBLING_RANKS", None) != SIBLING_RANKS
                                or tuple(getattr(native_tree, "COND_BUCKETS", ())) != COND_BUCKETS
                                or tuple(getattr(native_tree, "MATCH_BUCKETS", ())) != MATCH_BUCKETS):
    raise ImportError("lookupdec._native was built from other sources (calibration buckets differ, or no "
                      "tree merge): rebuild it with `pip install -e .`")


def depth_bucket(depth: int) -> int:
    """The index of ``depth``'s bucket in ``DEPTH_BUCKETS`` (depth 1 = a child of the root).

    >>> [depth_bucket(d) for d in (1, 2, 3, 4, 5, 8, 9, 30)]
    [0, 1, 2, 2, 3, 3, 4, 5]
    """
    return bisect.bisect_right(DEPTH_BUCKETS, depth) - 1


def draft_cells(draft: Draft) -> tuple[list[int], list[int], list[float]]:
    """Per draft node: its depth, its calibration cell within a row (``Calibration``: depth
    bucket, sibling rank, bucket of its conditional probability) and that conditional probability
    ``score / parent score``.

    >>> draft_cells(Draft((1, 2), (-1, 0), (.8, .2), "t"))
    ([1, 2], [3, 16], [0.8, 0.25])
    """
    depth, rank = draft_features(draft)
    scores, parents = draft.scores, draft.parents
    conds, cells = [], []
    for i, p in enumerate(parents):
        parent_score = scores[p] if p >= 0 else 1.0
        cond = scores[i] / parent_score if parent_score > 0 else 0.0
        conds.append(cond)
        cells.append((depth_bucket(depth[i]) * SIBLING_RANKS + min(rank[i], SIBLING_RANKS - 1)) * len(COND_BUCKETS)
                     + bisect.bisect_right(COND_BUCKETS, cond) - 1)
    return depth, cells, conds


def observe_draft(draft: Draft, committed: Sequence[int], reached: np.ndarray, predicted: np.ndarray,
                  matched: np.ndarray) -> None:
    """``observe_draft_reference``'s counts, made by the compiled core in one call."""
    if native_tree is None:
        return observe_draft_reference(draft, committed, reached, predicted, matched)
    tokens, parents, scores = draft.packed()
    native_tree.observe_draft(tokens, parents, scores, committed if type(committed) is list else list(committed),
                        reached, predicted, matched)


def observe_draft_reference(draft: Draft, committed: Sequence[int], reached: np.ndarray, predicted: np.ndarray,
                            matched: np.ndarray) -> None:
    """One draft against the step's ``committed`` tokens, into a calibration row's arrays
    ([CELLS_PER_ROW] each; ``budget.AcceptanceCalibrator.learn``): every node whose parent path
    matches the committed tokens was *reached* (+1 in ``reached`` at its cell, its conditional
    probability in ``predicted``), accepted (+1 in ``matched``) if its own token is the next
    committed one."""
    depth, cells, conds = draft_cells(draft)
    parents, tokens = draft.parents, draft.token_ids
    known = len(committed)
    hit = [False] * len(tokens)
    for i, p in enumerate(parents):
        d = depth[i]
        if d > known or (p >= 0 and not hit[p]):
            continue
        cell = cells[i]
        reached[cell] += 1.0
        predicted[cell] += conds[i]
        if tokens[i] == committed[d - 1]:
            matched[cell] += 1.0
            hit[i] = True


def draft_features(draft: Draft) -> tuple[list[int], list[int]]:
    """Per draft node: its depth (1 = a child of the root) and its sibling rank (0 = the
    best-scored child of its parent in this draft; ties go to the earlier node).

    >>> draft_features(Draft((1, 2, 3, 4), (-1, -1, 0, 0), (.5, .7, .2, .4), "t"))
    ([1, 1, 2, 2], [1, 0, 1, 0])
    """
    parents, scores = draft.parents, draft.scores
    n = len(parents)
    depth = [0] * n
    for i, p in enumerate(parents):
        depth[i] = 1 if p < 0 else depth[p] + 1
    if parents == tuple(range(-1, n - 1)):
        return depth, [0] * n
    rank = [0] * n
    children: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        children.setdefault(p, []).append(i)
    for kids in children.values():
        if len(kids) > 1:
            for r, i in enumerate(sorted(kids, key=lambda i: (-scores[i], i))):
                rank[i] = r
    return depth, rank


class Calibration:
    """What ``TokenTree.from_drafts`` multiplies each draft node's conditional probability by
    (``budget.AcceptanceCalibrator.calibration`` builds it from verified steps).

    ``rows`` maps ``(source, match bucket)`` to a row of ``table`` ``[rows, CELLS_PER_ROW]``; a
    node's cell in the row is its (depth bucket, sibling rank, conditional probability bucket)
    (``draft_cells``).
    A draft without a row takes ``fallback[source]`` (1.0 when absent) for every node. With
    ``probabilities``, ``table`` holds each cell's acceptance probability itself: the node's
    factor is that over its own conditional probability.
    """

    def __init__(self, rows: dict | None = None, table=None, fallback: dict | None = None,
                 row_factors=None, probabilities: bool = False) -> None:
        self.probabilities = probabilities  # table holds each cell's acceptance probability, not a factor
        self.rows = rows or {}
        self.table = np.ones((0, CELLS_PER_ROW)) if table is None else np.asarray(table, dtype=np.float64)
        self.fallback = fallback or {}
        # one factor per row (for a whole draft, e.g. the mixture's draft-model decision); default:
        # the row's rank-0, depth-1 cell
        self.row_factors = self.table[:, 0] if row_factors is None else np.asarray(row_factors)

    @classmethod
    def packed(cls, rows: dict, table: bytes, fallback: dict, row_factors: bytes) -> "Calibration":
        """A probabilities calibration from the compiled core's float64 bytes (``table`` [rows,
        CELLS_PER_ROW] and one factor per row), its arrays made only when read: the merge takes
        the bytes as they are (``packed_table``), once per step."""
        calibration = cls.__new__(cls)
        calibration.probabilities, calibration.rows, calibration.fallback = True, rows, fallback
        calibration._packed_table, calibration._packed_row_factors = table, row_factors
        return calibration

    def __getattr__(self, name: str):  # ``table`` and ``row_factors`` of a ``packed`` calibration
        packed = self.__dict__.get("_packed_table")
        if packed is None or name not in ("table", "row_factors"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        self.table = np.frombuffer(packed, np.float64).reshape(-1, CELLS_PER_ROW)
        self.row_factors = np.frombuffer(self.__dict__["_packed_row_factors"], np.float64)
        return self.__dict__[name]

    def row_factor(self, draft: Draft) -> float:
        row = self.row(draft)
        return float(self.row_factors[row]) if row >= 0 else self.fallback.get(draft.source, 1.0)

    @classmethod
    def from_factors(cls, factors: dict) -> "Calibration":
        """One factor per source (or per ``(source, match bucket)``) for every node."""
        rows, table, fallback = {}, [], {}
        for key, factor in factors.items():
            if isinstance(key, tuple):
                rows[key] = len(table)
                table.append([factor] * CELLS_PER_ROW)
            else:
                fallback[key] = factor
        return cls(rows, np.array(table).reshape(-1, CELLS_PER_ROW), fallback)

    def packed_table(self) -> bytes:
        """``table`` as float64 bytes, for the compiled merge (made once)."""
        packed = self.__dict__.get("_packed_table")
        if packed is None:
            packed = self._packed_table = np.ascontiguousarray(self.table, dtype=np.float64).tobytes()
        return packed

    def row(self, draft: Draft) -> int:
        """``draft``'s row, -1 if none (``fallback`` then)."""
        return self.rows.get(calibration_row_key(draft), -1)

    def node_factors(self, draft: Draft) -> tuple[list[float], list[int]]:
        """Each node's factor and its flat cell (``row * CELLS_PER_ROW + cell``, -1 without a row)."""
        row = self.row(draft)
        if row < 0:
            return [self.fallback.get(draft.source, 1.0)] * len(draft.token_ids), [-1] * len(draft.token_ids)
        _, cells, conds = draft_cells(draft)
        cells = [row * CELLS_PER_ROW + c for c in cells]
        flat = self.table.reshape(-1)
        if self.probabilities:  # the factor that turns the node's own probability into its cell's
            return [float(flat[c]) / cond if cond > 0 else 0.0 for c, cond in zip(cells, conds)], cells
        return [float(flat[c]) for c in cells], cells


@dataclass
class TokenTree:
    """The step's tree: the root and the draft nodes the target verifies in one forward."""

    token_ids: list[int]  # [1 + n] node tokens, node 0 = root
    parents: list[int]  # [1 + n] parent node index, -1 for the root
    scores: list[float] = field(default_factory=list)  # [1 + n] estimated acceptance probability
    sources: list[str] = field(default_factory=list)  # [1 + n] proposer of each node ("" for root)
    # node -> (q [vocab], tokens drawn i.i.d. from q at that node, in order): draft-model samples
    # whose children are accepted by rejection sampling (sampling.py). Samples stay listed even
    # where pruning removed their child node.
    samples: dict = field(default_factory=dict)
    # [1 + n] True where a deterministic (lookup) draft proposed the node: a point mass, tried
    # before the sampled children of its parent. Default: every node.
    point_mass: list[bool] = field(default_factory=list)
    # [1 + n] probability that the walk reaches each node (``coherent_scores``): what the budget
    # chooser adds up. ``scores`` rank the nodes (they decide what a budget keeps). Default: scores.
    expected: list[float] = field(default_factory=list)
    # [1 + n] per node, from the draft that gave its score: the calibration cell it was scaled by
    # (``Calibration``; -1: none) and its raw conditional probability (draft score / parent
    # score), which ``AcceptanceCalibrator.learn`` compares with what the target accepted.
    cells: list[int] = field(default_factory=list)
    conds: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if not self.cells:
            self.cells = [-1] * n
        if not self.conds:
            self.conds = [1.0] * n
        if not self.scores:
            self.scores = [1.0] * n
        if not self.sources:
            self.sources = [""] * n
        if not self.point_mass:
            self.point_mass = [True] * n
        if not self.expected:
            self.expected = list(self.scores)
        if len(self.parents) != n or self.parents[0] != -1:
            raise ValueError("TokenTree: parents must match token_ids and parents[0] must be -1")
        self.depth = [0] * n
        self._children: list[dict[int, int]] | None = [{} for _ in range(n)]
        self._order: list[int] | None = None  # draft nodes in prune order, if known
        self._parents_first = False  # True: every node's parent comes before it in _order
        for i in range(1, n):
            p = self.parents[i]
            if not 0 <= p < i:
                raise ValueError(f"TokenTree: parents[{i}]={p} must be in [0, {i})")
            if self.token_ids[i] in self._children[p]:
                raise ValueError(f"TokenTree: node {p} has two children with token {self.token_ids[i]}")
            self._children[p][self.token_ids[i]] = i
            self.depth[i] = self.depth[p] + 1

    @classmethod
    def _trusted(cls, *, depth: list[int], order: list[int] | None, parents_first: bool, **fields) -> "TokenTree":
        """A tree whose lists are valid by construction (the compiled merge, a fast prune): no
        per-node check; ``children`` is built on first use."""
        tree = cls.__new__(cls)
        tree.__dict__.update(fields)
        tree.depth, tree._children, tree._order, tree._parents_first = depth, None, order, parents_first
        return tree

    @classmethod
    def _from_core(cls, core, samples: dict) -> "TokenTree":
        """A tree held by the compiled core (``native_tree.Tree``): its lists are read on first use
        (``__getattr__``); pruning and verify inputs work on the core's arrays."""
        tree = cls.__new__(cls)
        tree.__dict__.update(samples=samples, _core=core, _children=None, _order=None,
                             _parents_first=core.parents_first)
        return tree

    def __getattr__(self, name: str):
        """A list of a core-held tree (``_from_core``), made on first use."""
        core = self.__dict__.get("_core")
        if core is None or name not in _CORE_LISTS:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        value = self.__dict__[name] = getattr(core, name)()
        return value

    @property
    def children(self) -> list[dict[int, int]]:
        """Per node: token -> child node."""
        if self._children is None and self.__dict__.get("_core") is not None:
            self._children = self._core.children()
        if self._children is None:
            children: list[dict[int, int]] = [{} for _ in self.token_ids]
            for i, (p, token) in enumerate(zip(self.parents, self.token_ids)):
                if i:
                    children[p][token] = i
            self._children = children
        return self._children

    def __len__(self) -> int:
        core = self.__dict__.get("_core")
        return len(core) if core is not None else len(self.token_ids)

    @property
    def is_chain(self) -> bool:
        """One path (the root alone included): its mask is the ordinary causal one."""
        return self.depth[-1] == len(self.depth) - 1  # parents[i] < i: only a chain is that deep

    @property
    def num_draft_nodes(self) -> int:
        return len(self) - 1

    @classmethod
    def from_drafts(
        cls, root_token: int, drafts: Sequence[Draft], *, max_nodes: int, max_depth: int,
        calibration: Calibration | dict | None = None,
    ) -> "TokenTree":
        """``from_drafts_reference``'s tree, computed by the compiled core when it is built (one
        call: ``csrc/tree/tree.cpp``). Draft-model ``samples`` are mapped to the kept nodes here.
        ``calibration`` may also be a ``budget.AcceptanceCalibrator``: the tree is the one its
        ``calibration()`` gives, the merge computing only the cells it reads from the
        calibrator's counts (``merge_counts``)."""
        counts = None
        if hasattr(calibration, "merge_counts"):  # an AcceptanceCalibrator
            if native_tree is not None and max_nodes >= 0 and max_depth >= 0:
                counts = calibration.merge_counts()
            if counts is None:  # (the reference backend, or the reference merge below)
                calibration = calibration.calibration()
        if native_tree is None or max_nodes < 0 or max_depth < 0:  # (negative budgets: the reference's behaviour)
            return cls.from_drafts_reference(root_token, drafts, max_nodes=max_nodes, max_depth=max_depth,
                                             calibration=calibration)
        if isinstance(calibration, dict):
            calibration = Calibration.from_factors(calibration)
        packed = [d.packed() for d in drafts]
        point_mass = bytes([d.samples is None for d in drafts])
        if counts is not None:
            rows_of, source_of, arrays = counts
            core, node_of = native_tree.merge_drafts_counts(
                root_token, packed, [rows_of.get(calibration_row_key(d), -1) for d in drafts],
                [source_of.get(d.source, -1) for d in drafts], point_mass, *arrays,
                [d.source for d in drafts] + [""], max_nodes, max_depth)
            return cls._with_samples(core, node_of, drafts, packed, point_mass)
        if calibration is None:
            rows, fallback, table, probabilities = [-1] * len(drafts), [1.0] * len(drafts), b"", False
        else:
            rows = [calibration.row(d) for d in drafts]
            fallback = [calibration.fallback.get(d.source, 1.0) if r < 0 else 1.0 for d, r in zip(drafts, rows)]
            table, probabilities = calibration.packed_table(), calibration.probabilities
        core, node_of = native_tree.merge_drafts(root_token, packed, rows, fallback, point_mass,
                                           table, probabilities, [d.source for d in drafts] + [""], max_nodes,
                                           max_depth)
        return cls._with_samples(core, node_of, drafts, packed, point_mass)

    @classmethod
    def _with_samples(cls, core, node_of: bytes, drafts: Sequence[Draft], packed: list,
                      point_mass: bytes) -> "TokenTree":
        """The compiled merge's tree, each draft's ``samples`` mapped to the nodes kept
        (``point_mass``: a byte per draft, 1 where it has none: lookups only, nothing to map)."""
        samples = {}
        if 0 in point_mass and any(d.samples for d in drafts):
            node_of = np.frombuffer(node_of, np.int32)
            starts = accumulate((len(p[0]) // 4 for p in packed), initial=0)
            for draft, start in zip(drafts, starts):
                for at, (q, drawn) in (draft.samples or {}).items():
                    node = 0 if at < 0 else int(node_of[start + at])
                    if node >= 0:
                        samples[node] = (q, tuple(drawn))
        return cls._from_core(core, samples)

    @classmethod
    def from_drafts_reference(
        cls, root_token: int, drafts: Sequence[Draft], *, max_nodes: int, max_depth: int,
        calibration: Calibration | dict | None = None,
    ) -> "TokenTree":
        """Merge drafts into a trie, then keep the ``max_nodes`` best nodes (ancestors kept).

        ``calibration`` (``Calibration``, from ``budget.AcceptanceCalibrator.calibration``; a
        dict of per-source factors is taken as ``Calibration.from_factors``) multiplies each
        node's conditional probability ``score / parent score`` by its cell's factor (per
        source, match bucket, depth bucket and sibling rank), capped at 1. A node's score is
        capped by its parent's (a path cannot be likelier than its prefix), so taking nodes in
        order of score never takes a child before its parent. Ties go to the earlier node
        (drafts earlier in the list win).
        """
        if hasattr(calibration, "merge_counts"):  # an AcceptanceCalibrator
            calibration = calibration.calibration()
        if isinstance(calibration, dict):
            calibration = Calibration.from_factors(calibration)
        token_ids, parents, scores, sources, depths = [root_token], [-1], [1.0], [""], [0]
        point_mass, samples, cells, conds = [True], {}, [-1], [1.0]
        index: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
        for draft in drafts:
            if calibration is not None:
                node_factors, node_cells = calibration.node_factors(draft)
            else:
                node_factors, node_cells = None, None
            raw = draft.scores
            local = [0] * len(draft.token_ids)  # draft node -> trie node
            for i, (tok, par) in enumerate(zip(draft.token_ids, draft.parents)):
                parent = 0 if par < 0 else local[par]
                if parent < 0:  # an ancestor was cut by max_depth
                    local[i] = -1
                    continue
                key = (parent, tok)
                node = index.get(key)
                raw_parent = 1.0 if par < 0 else raw[par]
                cond = raw[i] / raw_parent if raw_parent > 0 else 0.0
                factor = node_factors[i] if node_factors is not None else 1.0
                score = scores[parent] * min(1.0, factor * cond)
                if node is None:
                    if depths[parent] >= max_depth:
                        local[i] = -1
                        continue
                    node = len(token_ids)
                    depths.append(depths[parent] + 1)
                    index[key] = node
                    token_ids.append(tok)
                    parents.append(parent)
                    scores.append(score)
                    sources.append(draft.source)
                    point_mass.append(draft.samples is None)
                    cells.append(node_cells[i] if node_cells is not None else -1)
                    conds.append(cond)
                else:
                    point_mass[node] = point_mass[node] or draft.samples is None
                    if score > scores[node]:
                        scores[node] = score
                        sources[node] = draft.source
                        cells[node] = node_cells[i] if node_cells is not None else -1
                        conds[node] = cond
                local[i] = node
            for at, (q, drawn) in (draft.samples or {}).items():
                node = 0 if at < 0 else local[at]
                if node >= 0:
                    samples[node] = (q, tuple(drawn))
        expected = coherent_scores(parents, scores)
        keep = select_top_nodes(parents, scores, max_nodes)
        return cls._subtree(keep, token_ids, parents, scores, sources, point_mass, samples, expected, cells, conds)

    @classmethod
    def _subtree(cls, keep, token_ids, parents, scores, sources, point_mass=None, samples=None,
                 expected=None, cells=None, conds=None) -> "TokenTree":
        remap = {old: new for new, old in enumerate(keep)}
        return cls(
            token_ids=[token_ids[i] for i in keep],
            parents=[-1] + [remap[parents[i]] for i in keep[1:]],
            scores=[scores[i] for i in keep],
            sources=[sources[i] for i in keep],
            samples={remap[node]: value for node, value in (samples or {}).items() if node in remap},
            point_mass=[point_mass[i] for i in keep] if point_mass else [],
            expected=[expected[i] for i in keep] if expected else [],
            cells=[cells[i] for i in keep] if cells else [],
            conds=[conds[i] for i in keep] if conds else [],
        )

    def _keep(self, keep) -> "TokenTree":
        return TokenTree._subtree(keep, self.token_ids, self.parents, self.scores, self.sources, self.point_mass,
                                  self.samples, self.expected, self.cells, self.conds)

    def prune_order(self) -> list[int]:
        """The draft nodes in the order ``prune`` takes them: score descending, then index."""
        if self._order is None:
            core = self.__dict__.get("_core")
            self._order = (core.order() if core is not None else
                           sorted(range(1, len(self.token_ids)), key=lambda i: (-self.scores[i], i)))
        return self._order

    def expected_in_prune_order(self) -> list[float]:
        """``expected`` of the draft nodes in the order ``prune`` takes them (best score first):
        ``prune(n)`` keeps the first ``n``, which the budget chooser sums."""
        core = self.__dict__.get("_core")
        if core is not None:
            return core.expected_in_prune_order()
        expected = self.expected
        return [expected[i] for i in self.prune_order()]

    def prune(self, max_nodes: int) -> "TokenTree":
        """The root and the ``max_nodes`` best nodes (ancestors kept), as a new tree."""
        if len(self) - 1 <= max_nodes:  # (a core-held tree's length, its lists not made)
            return self
        if max_nodes < 0 or not self._parents_first:
            return self.prune_reference(max_nodes)
        core = self.__dict__.get("_core")
        if core is not None:  # the core's arrays: no Python lists
            samples = self.samples
            if samples:
                keep = [0, *sorted(self.prune_order()[:max_nodes])]
                remap = {old: new for new, old in enumerate(keep)}
                samples = {remap[node]: value for node, value in samples.items() if node in remap}
            return TokenTree._from_core(core.prune(max_nodes), samples)
        # every node's parent comes before it in prune order: select_top_nodes takes a prefix
        taken = self._order[:max(max_nodes, 0)]
        keep = [0, *sorted(taken)]
        remap = [-1] * len(self.token_ids)
        for new, old in enumerate(keep):
            remap[old] = new
        parents, depth = self.parents, self.depth
        samples = {remap[node]: value for node, value in self.samples.items() if remap[node] >= 0}
        return TokenTree._trusted(
            token_ids=[self.token_ids[i] for i in keep], parents=[-1] + [remap[parents[i]] for i in keep[1:]],
            scores=[self.scores[i] for i in keep], sources=[self.sources[i] for i in keep], samples=samples,
            point_mass=[self.point_mass[i] for i in keep], expected=[self.expected[i] for i in keep],
            cells=[self.cells[i] for i in keep], conds=[self.conds[i] for i in keep],
            depth=[depth[i] for i in keep], order=[remap[i] for i in taken], parents_first=True)

    def prune_reference(self, max_nodes: int) -> "TokenTree":
        """``prune`` by its definition: ``select_top_nodes``, then the subtree."""
        keep = select_top_nodes(self.parents, self.scores, max_nodes)
        if len(keep) == len(self.token_ids):
            return self
        return self._keep(keep)

    def verify_inputs(self, n_cached: int, fill: bytes):
        """The compiled core's ``(input ids, positions, additive mask)`` for ``model.tree_inputs``
        as bytearrays (int64 [1+n], int64 [1+n], [1+n, n_cached+1+n] elements of ``fill``'s
        size; the mask None for a chain), or None without the core."""
        core = self.__dict__.get("_core")
        if core is not None:
            return core.inputs(n_cached, fill)
        if native_tree is None:
            return None
        return native_tree.tree_inputs(self.token_ids, self.parents, n_cached, fill)

    def verify_inputs_at(self, n_cached: int, fill: bytes, ids: int, positions: int, mask: int, rows: int,
                         cols: int, last_rows: int, last_column: int):
        """``verify_inputs`` written into buffers kept across steps (``model.InputBuffers``), given
        by address: ``ids`` and ``positions`` (int64, ``rows`` long), ``mask`` (C-contiguous
        [rows, cols] elements of ``fill``'s size, zero but for the last step's tree block of
        ``last_rows`` rows at column ``last_column``): that block is cleared, this tree's ([1+n,
        1+n] at column ``n_cached``) written unless the tree is a chain. Returns whether it was
        written, or None without the core. The caller keeps the buffers alive and large enough
        (checked against ``rows`` and ``cols``)."""
        core = self.__dict__.get("_core")
        if core is not None:
            return core.inputs_at(n_cached, fill, ids, positions, mask, rows, cols, last_rows, last_column)
        if native_tree is None:
            return None
        return native_tree.tree_inputs_at(self.token_ids, self.parents, n_cached, fill, ids, positions, mask, rows,
                                          cols, last_rows, last_column)

    def greedy_walk(self, logits: np.ndarray | None, top_k: int = 0, row_of: bytes | None = None, start: int = 0,
                    choices: np.ndarray | None = None):
        """The compiled core's greedy acceptance walk over float32 ``logits`` (rows contiguous;
        node u's row is u, or ``row_of[u]`` given ``row_of``, int32 bytes with -1 for a row not
        computed): ``(accepted nodes, next token, bonus, tops, missing, tokens)`` as ``sampling.accept``
        defines the first three, or None without the core. ``tops``: with ``top_k`` > 0 the
        ``top_k`` best token ids of every visited row (the root's, then each accepted node's) from
        the same single pass over the row (``engine.top_tokens``' order), else None. ``missing``:
        the first node reached whose row is -1 (the walk stops there), else -1. ``start``: the node
        the walk begins at (a missing one, once its row is there): accepted nodes are those below
        it, ``tops`` begin with its row. ``choices``: int32 [rows, >= max(top_k, 1)], each row's
        best token ids made as the row was written (``kernels.skinny_linear(tops=...)``): the walk
        reads those, not the rows (``logits`` may then be None). ``tokens``: the token ids of
        ``start`` and of each accepted node (``tokens_of([start, *accepted])``)."""
        core = self.__dict__.get("_core")
        if core is not None:
            return core.greedy_walk(logits, top_k, row_of, start, choices)
        if native_tree is None:
            return None
        return native_tree.greedy_walk(logits, self.token_ids, self.parents, top_k, row_of, start, choices)

    def tokens_of(self, nodes: Sequence[int]) -> list[int]:
        """The token ids of ``nodes``, without making the whole ``token_ids`` list of a core-held
        tree."""
        core = self.__dict__.get("_core")
        if core is not None and "token_ids" not in self.__dict__:
            return core.tokens_of(nodes)
        token_ids = self.token_ids
        return [token_ids[u] for u in nodes]

    def expected_total(self) -> float:
        """The draft nodes' expected gains added up left to right (the root's excluded): what the
        tree promised the chooser."""
        core = self.__dict__.get("_core")
        if core is not None:
            return core.expected_total()
        total = 0.0
        for gain in self.expected[1:]:
            total += gain
        return total

    def ancestor_mask(self) -> np.ndarray:
        """``mask[i, j]`` is True when node j is node i or one of its ancestors.  [1+n, 1+n]"""
        if native_tree is None:
            return self.ancestor_mask_reference()
        n = len(self.token_ids)
        mask = native_tree.ancestor_mask(array("i", self.parents).tobytes())
        return np.frombuffer(mask, np.bool_).reshape(n, n)

    def ancestor_mask_reference(self) -> np.ndarray:
        """``ancestor_mask`` row by row: a node's row is its parent's plus itself."""
        n = len(self.token_ids)
        mask = np.zeros((n, n), dtype=bool)
        for i in range(n):
            p = self.parents[i]
            if p >= 0:
                mask[i, : p + 1] = mask[p, : p + 1]
            mask[i, i] = True
        return mask

    def path_to(self, node: int) -> list[int]:
        """Nodes from the root's child down to ``node`` (root excluded)."""
        path = []
        while node > 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def best_chain(self) -> "TokenTree":
        """The single path with the most expected accepted tokens (sum of node scores)."""
        n = len(self.token_ids)
        gain = [0.0] * n
        for i in range(1, n):
            gain[i] = gain[self.parents[i]] + self.scores[i]
        leaf = max(range(n), key=lambda i: (gain[i], -i))
        keep = [0] + self.path_to(leaf)
        return self._keep(keep)


# the lists a core-held tree (TokenTree._from_core) makes on first use
_CORE_LISTS = frozenset(("token_ids", "parents", "scores", "sources", "point_mass", "expected", "cells", "conds",
                         "depth"))


def coherent_scores(parents: Sequence[int], scores: Sequence[float]) -> list[float]:
    """Scores adjusted so that the children of a node never claim more than certainty.

    Drafts are scored independently; merged into one trie, two sources can each give their own
    child of the same node a high conditional probability, though at most one child can be
    accepted. Children keep their conditional probability ``score / parent score`` in order of
    confidence until the mass left runs out: the likeliest keeps its own, each next one gets at
    most what the ones before left. Applied top-down, a node's score is then at most the
    probability that the walk reaches it — what the budget chooser adds up as expected accepted
    tokens.

    >>> coherent_scores([-1, 0, 0, 1], [1.0, 0.9, 0.6, 0.8])
    [1.0, 0.9, 0.09999999999999998, 0.8]
    """
    n = len(parents)
    children: list[list[int]] = [[] for _ in range(n)]
    for i in range(1, n):
        children[parents[i]].append(i)
    out = list(scores)
    for node in range(n):  # parents come before children: out[node] is final here
        kids = children[node]
        if not kids:
            continue
        old_parent = scores[node]
        conds = {k: (scores[k] / old_parent if old_parent > 0 else 0.0) for k in kids}
        left = 1.0
        for k in sorted(kids, key=lambda k: (-conds[k], k)):
            cond = min(conds[k], max(left, 0.0))
            left -= cond
            out[k] = out[node] * cond
    return out


def select_top_nodes(parents: Sequence[int], scores: Sequence[float], max_nodes: int) -> list[int]:
    """Indices of the root and the ``max_nodes`` best nodes, in tree order (ancestors kept).

    Scores must not increase from parent to child, which ``from_drafts`` guarantees; the sort
    key (score desc, depth asc via index order) then always takes a parent before its child.
    """
    n = len(parents)
    if n - 1 <= max_nodes:
        return list(range(n))
    order = sorted(range(1, n), key=lambda i: (-scores[i], i))
    chosen = set()
    for i in order:
        if len(chosen) == max_nodes:
            break
        if parents[i] == 0 or parents[i] in chosen:
            chosen.add(i)
    return [0] + sorted(chosen)
