"""The definitions of ``lookupdec/tree.py``'s fast paths (``csrc/tree/tree.cpp``): the trie merge
with its calibration cells and scores, prune, the ancestor mask and a draft's calibration counts.

They work on the tree format (docs/architecture.md, "The tree format"): drafts and trees are read
through their lists (``token_ids``, ``parents``, ``scores``, ...), and a tree comes back as its
fields, ``TokenTree(**fields)``: ``tree.py`` builds its trees from them where it falls back on them,
and imports from here the calibration cells (the buckets, ``CELLS_PER_ROW``) that ``draft_cells``
defines and the compiled core repeats (checked at import by ``tree.py``).
``tests/test_tree_compiled.py`` compares every one with its fast path on random drafts (token ids,
parents, cells equal; scores, expected and conditional probabilities bit for bit).
"""
from __future__ import annotations

import bisect
from typing import Sequence

import numpy as np

DEPTH_BUCKETS = (1, 2, 3, 5, 9, 17)  # node depths are calibrated in these buckets
SIBLING_RANKS = 3  # sibling rank (by score within a draft) is calibrated as 0, 1, 2 or more
COND_BUCKETS = (0.0, 0.25, 0.5, 0.75, 0.95)  # and the proposer's own conditional probability
CELLS_PER_ROW = len(DEPTH_BUCKETS) * SIBLING_RANKS * len(COND_BUCKETS)


def depth_bucket(depth: int) -> int:
    """The index of ``depth``'s bucket in ``DEPTH_BUCKETS`` (depth 1 = a child of the root).

    >>> [depth_bucket(d) for d in (1, 2, 3, 4, 5, 8, 9, 30)]
    [0, 1, 2, 2, 3, 3, 4, 5]
    """
    return bisect.bisect_right(DEPTH_BUCKETS, depth) - 1


def draft_cells(draft) -> tuple[list[int], list[int], list[float]]:
    """Defines the calibration cell the compiled merge and count give each draft node: its depth,
    its cell within a row (``tree.Calibration``: depth bucket, sibling rank, bucket of its
    conditional probability) and that conditional probability ``score / parent score``.

    >>> from lookupdec.tree import Draft
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


def draft_features(draft) -> tuple[list[int], list[int]]:
    """Per draft node: its depth (1 = a child of the root) and its sibling rank (0 = the
    best-scored child of its parent in this draft; ties go to the earlier node).

    >>> from lookupdec.tree import Draft
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


def observe_draft(draft, committed: Sequence[int], reached: np.ndarray, predicted: np.ndarray,
                  matched: np.ndarray) -> None:
    """Defines ``tree.observe_draft`` (compiled: ``native.tree.observe_draft``, ``learn_drafts``).
    One draft against the step's ``committed`` tokens, into a calibration row's arrays
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


def node_factors(calibration, draft) -> tuple[list[float], list[int]]:
    """Defines the factor the compiled merge multiplies each node of ``draft`` by under
    ``calibration`` (a ``tree.Calibration``): each node's factor and its flat cell
    (``row * CELLS_PER_ROW + cell``, -1 without a row, the source's fallback factor then)."""
    row = calibration.row(draft)
    if row < 0:
        return [calibration.fallback.get(draft.source, 1.0)] * len(draft.token_ids), [-1] * len(draft.token_ids)
    _, cells, conds = draft_cells(draft)
    cells = [row * CELLS_PER_ROW + c for c in cells]
    flat = calibration.table.reshape(-1)
    if calibration.probabilities:  # the factor that turns the node's own probability into its cell's
        return [float(flat[c]) / cond if cond > 0 else 0.0 for c, cond in zip(cells, conds)], cells
    return [float(flat[c]) for c in cells], cells


def merge_drafts(root_token: int, drafts: Sequence, *, max_nodes: int, max_depth: int, calibration=None) -> dict:
    """Defines ``TokenTree.from_drafts`` (compiled: ``native.tree.merge_drafts``,
    ``merge_drafts_counts``, the merge of ``Mixture.plan``). Merges drafts into a trie, then
    keeps the ``max_nodes`` best nodes (ancestors kept); returns the tree's fields
    (``TokenTree(**fields)``).

    ``calibration`` (a ``tree.Calibration``, from ``budget.AcceptanceCalibrator.calibration``;
    ``TokenTree.from_drafts`` turns a dict of factors into one first) multiplies each node's
    conditional probability ``score / parent score`` by its cell's factor (per source, match
    bucket, depth bucket and sibling rank), capped at 1. A node's score is capped by its
    parent's (a path cannot be likelier than its prefix), so taking nodes in order of score
    never takes a child before its parent. Ties go to the earlier node (drafts earlier in the
    list win). Draft-model ``samples`` are mapped to the nodes kept.
    """
    token_ids, parents, scores, sources, depths = [root_token], [-1], [1.0], [""], [0]
    point_mass, samples, cells, conds = [True], {}, [-1], [1.0]
    index: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
    for draft in drafts:
        if calibration is not None:
            factors, node_cells = node_factors(calibration, draft)
        else:
            factors, node_cells = None, None
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
            factor = factors[i] if factors is not None else 1.0
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
    return _subtree_fields(keep, token_ids, parents, scores, sources, point_mass, samples, expected, cells, conds)


def prune(tree, max_nodes: int) -> dict:
    """Defines ``TokenTree.prune`` (compiled: ``native.tree.Tree.prune``, and the prune order
    ``TokenTree.prune_order`` a merged tree carries): ``select_top_nodes``, then the subtree;
    returns its fields (``TokenTree(**fields)``)."""
    keep = select_top_nodes(tree.parents, tree.scores, max_nodes)
    return _subtree_fields(keep, tree.token_ids, tree.parents, tree.scores, tree.sources, tree.point_mass, tree.samples,
                    tree.expected, tree.cells, tree.conds)


def _subtree_fields(keep: list[int], token_ids, parents, scores, sources, point_mass, samples, expected, cells,
             conds) -> dict:
    """The fields of the tree of nodes ``keep`` (root first, each node after its parent)."""
    remap = {old: new for new, old in enumerate(keep)}
    return dict(
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


def ancestor_mask(parents: Sequence[int]) -> np.ndarray:
    """Defines ``TokenTree.ancestor_mask`` (compiled: ``native.tree.ancestor_mask``): ``mask[i, j]``
    is True when node j is node i or one of its ancestors, row by row (a node's row is its
    parent's plus itself).  [1+n, 1+n]"""
    n = len(parents)
    mask = np.zeros((n, n), dtype=bool)
    for i in range(n):
        p = parents[i]
        if p >= 0:
            mask[i, : p + 1] = mask[p, : p + 1]
        mask[i, i] = True
    return mask


def coherent_scores(parents: Sequence[int], scores: Sequence[float]) -> list[float]:
    """Defines a merged tree's ``expected`` (the compiled merge repeats it): scores adjusted so
    that the children of a node never claim more than certainty.

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
    """Defines which nodes a prune keeps (the compiled prune and prune order repeat it): the
    root and the ``max_nodes`` best nodes, in tree order (ancestors kept).

    Scores must not increase from parent to child, which ``merge_drafts`` guarantees; the sort
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
