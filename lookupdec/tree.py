"""The tree format and its two types: a proposer's ``Draft`` and the step's ``TokenTree``.

The bottom of the package: it imports nothing of lookupdec but the compiled core's tree
submodule (``lookupdec.native.tree``) and its references (``lookupdec.reference.tree``), both in
its layer, and everything that handles trees (proposers, acceptance, the model, the step)
imports it.

Fast paths and references. ``TokenTree.from_drafts`` merges in the compiled core
(``csrc/tree/tree.cpp``) when it is built and falls back to ``reference.tree.merge_drafts``, the
pure-Python definition, otherwise; trees it builds carry their depth and prune order, so
``prune``, ``expected_in_prune_order`` and ``children`` cost no per-node Python work beyond list
copies, and ``ancestor_mask`` is compiled too. ``tests/test_tree_compiled.py`` checks every fast
path against its definition in ``lookupdec/reference/tree.py`` on random drafts (token ids,
parents, cells exactly; scores are bit-identical too).

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
from lookupdec.reference import tree as reference_tree
# the calibration cells, defined with their definition (reference.tree.draft_cells), re-exported
from lookupdec.reference.tree import CELLS_PER_ROW, COND_BUCKETS, DEPTH_BUCKETS, SIBLING_RANKS

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


# each cell's midpoint of its conditional probability bucket, [CELLS_PER_ROW]
COND_MIDS = np.tile(np.diff(np.append(COND_BUCKETS, 1.0)) / 2 + np.array(COND_BUCKETS), len(DEPTH_BUCKETS) * SIBLING_RANKS)
if native_tree is not None and (tuple(getattr(native_tree, "DEPTH_BUCKETS", ())) != DEPTH_BUCKETS
                                or getattr(native_tree, "SIBLING_RANKS", None) != SIBLING_RANKS
                                or tuple(getattr(native_tree, "COND_BUCKETS", ())) != COND_BUCKETS
                                or tuple(getattr(native_tree, "MATCH_BUCKETS", ())) != MATCH_BUCKETS):
    raise ImportError("lookupdec._native was built from other sources (calibration buckets differ, or no "
                      "tree merge): rebuild it with `pip install -e .`")


def observe_draft(draft: Draft, committed: Sequence[int], reached: np.ndarray, predicted: np.ndarray,
                  matched: np.ndarray) -> None:
    """One draft against the step's ``committed`` tokens, counted into a calibration row's arrays
    (``budget.AcceptanceCalibrator.learn``) by the compiled core in one call; defined by
    ``reference.tree.observe_draft`` (which runs where the core is absent)."""
    if native_tree is None:
        return reference_tree.observe_draft(draft, committed, reached, predicted, matched)
    tokens, parents, scores = draft.packed()
    native_tree.observe_draft(tokens, parents, scores, committed if type(committed) is list else list(committed),
                        reached, predicted, matched)


class Calibration:
    """What ``TokenTree.from_drafts`` multiplies each draft node's conditional probability by
    (``budget.AcceptanceCalibrator.calibration`` builds it from verified steps).

    ``rows`` maps ``(source, match bucket)`` to a row of ``table`` ``[rows, CELLS_PER_ROW]``; a
    node's cell in the row is its (depth bucket, sibling rank, conditional probability bucket)
    (``reference.tree.draft_cells``).
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
    # [1 + n] probability that the walk reaches each node (``reference.tree.coherent_scores``): what
    # the budget chooser adds up. ``scores`` rank the nodes (they decide what a budget keeps). Default: scores.
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
        """Merge drafts into a trie, then keep the ``max_nodes`` best nodes (ancestors kept), as
        ``reference.tree.merge_drafts`` defines it (scores, calibration, ties): in one call into
        the compiled core when it is built (``csrc/tree/tree.cpp``), by the definition itself
        where it is not or a budget is negative. Draft-model ``samples`` are mapped to the kept
        nodes here. ``calibration``: a ``Calibration``, a dict of factors (``Calibration.from_factors``)
        or a ``budget.AcceptanceCalibrator``: the tree is the one its
        ``calibration()`` gives, the merge computing only the cells it reads from the
        calibrator's counts (``merge_counts``)."""
        counts = None
        if hasattr(calibration, "merge_counts"):  # an AcceptanceCalibrator
            if native_tree is not None and max_nodes >= 0 and max_depth >= 0:
                counts = calibration.merge_counts()
            if counts is None:  # (a calibrator without compiled counts, or the reference merge below)
                calibration = calibration.calibration()
        if native_tree is None or max_nodes < 0 or max_depth < 0:  # (negative budgets: the reference's behaviour)
            if isinstance(calibration, dict):
                calibration = Calibration.from_factors(calibration)
            return cls(**reference_tree.merge_drafts(root_token, drafts, max_nodes=max_nodes, max_depth=max_depth,
                                                     calibration=calibration))
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
        if max_nodes < 0 or not self._parents_first:  # (no prune order, a negative budget: the definition)
            fields = reference_tree.prune(self, max_nodes)
            return self if len(fields["token_ids"]) == len(self.token_ids) else TokenTree(**fields)
        core = self.__dict__.get("_core")
        if core is not None:  # the core's arrays: no Python lists
            samples = self.samples
            if samples:
                keep = [0, *sorted(self.prune_order()[:max_nodes])]
                remap = {old: new for new, old in enumerate(keep)}
                samples = {remap[node]: value for node, value in samples.items() if node in remap}
            return TokenTree._from_core(core.prune(max_nodes), samples)
        # every node's parent comes before it in prune order: select_top_nodes (reference.tree) takes a prefix
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
        """``mask[i, j]`` is True when node j is node i or one of its ancestors.  [1+n, 1+n]
        (Defined by ``reference.tree.ancestor_mask``, which runs where the core is absent.)"""
        if native_tree is None:
            return reference_tree.ancestor_mask(self.parents)
        n = len(self.token_ids)
        mask = native_tree.ancestor_mask(array("i", self.parents).tobytes())
        return np.frombuffer(mask, np.bool_).reshape(n, n)

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
