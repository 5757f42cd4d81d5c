"""The compiled tree merge (``TokenTree.from_drafts``, ``csrc/tree/tree.cpp``) and the fast tree
methods against their definitions (``lookupdec/reference/tree.py``), on many random drafts: calibration tables and
fallback factors, duplicate paths across drafts, draft-model samples, max_depth cuts, every
budget from 0 to all nodes, and tied scores. Token ids, parents, sources, cells, depths and
point masses must be equal; scores, expected and conditional probabilities too (the core
repeats the reference's floating-point operations in order), within 1e-12 at worst."""
from __future__ import annotations

import random

import numpy as np
import pytest

from lookupdec.native import tree as native_tree
from lookupdec.reference import tree as reference_tree
from lookupdec.tree import CELLS_PER_ROW, Calibration, Draft, TokenTree, match_bucket
from references import merged, pruned

pytestmark = pytest.mark.skipif(native_tree is None, reason="compiled core not built (pip install -e .)")

SOURCES = ("ngram", "suffix", "suffix-global", "draft")
TIED = (0.0, 0.25, 0.5, 0.5, 1.0)  # scores drawn from few values: ties everywhere


def random_draft(rng: random.Random, vocab: int, source: str) -> Draft:
    size = rng.randint(0, 12)
    if rng.random() < 0.3:
        parents = list(range(-1, size - 1))  # a chain
    else:
        parents = [rng.randint(-1, i - 1) for i in range(size)]
    tokens = [rng.randrange(vocab) for _ in range(size)]
    if rng.random() < 0.3:
        scores = [rng.choice(TIED) for _ in range(size)]
    else:
        scores = [rng.uniform(0.0, 1.0) for _ in range(size)]
    if size and rng.random() < 0.05:  # out of contract, still merged as the reference merges it
        scores[rng.randrange(size)] = rng.choice((-0.5, 1.5))
    samples = None
    if source == "draft" and size:
        samples = {at: (f"q{at}", [rng.randrange(vocab)]) for at in rng.sample(range(-1, size), rng.randint(1, 2))}
    return Draft(tuple(tokens), tuple(parents), tuple(scores), source, rng.randint(0, 40), samples)


def random_calibration(rng: random.Random, drafts: list[Draft]):
    kind = rng.randrange(4)
    if kind == 0:
        return None
    if kind == 1:  # per-source factors, some as (source, bucket) rows
        factors = {s: rng.uniform(0.0, 1.5) for s in SOURCES if rng.random() < 0.7}
        for d in drafts:
            if rng.random() < 0.5:
                factors[(d.source, match_bucket(d.match_length))] = rng.uniform(0.0, 1.5)
        return factors
    keys = list(dict.fromkeys((d.source, match_bucket(d.match_length)) for d in drafts))
    keys = [k for k in keys if rng.random() < 0.7]
    table = np.array([[rng.choice((0.0, 0.5, 1.0, 1.5)) if rng.random() < 0.3 else rng.uniform(0.0, 1.5)
                       for _ in range(CELLS_PER_ROW)] for _ in keys]).reshape(-1, CELLS_PER_ROW)
    fallback = {s: rng.uniform(0.0, 1.5) for s in SOURCES if rng.random() < 0.5}
    # probabilities: the table holds each cell's acceptance probability (factor = value / cond)
    return Calibration({k: i for i, k in enumerate(keys)}, table, fallback, probabilities=rng.random() < 0.5)


def random_case(seed: int):
    rng = random.Random(seed)
    vocab = rng.choice((2, 3, 5, 50))  # small vocabularies: drafts share prefixes and merge
    drafts = [random_draft(rng, vocab, rng.choice(SOURCES)) for _ in range(rng.randint(0, 6))]
    return rng, drafts, random_calibration(rng, drafts), rng.choice((1, 2, 3, 5, 64))


def assert_same_tree(fast: TokenTree, ref: TokenTree) -> None:
    # first, while a core-held tree has made no lists: its own tokens_of and expected_total
    nodes = list(range(len(ref.token_ids)))[::-1]
    assert fast.tokens_of(nodes) == ref.tokens_of(nodes) == [ref.token_ids[u] for u in nodes]
    total = 0.0
    for gain in ref.expected[1:]:
        total += gain
    assert fast.expected_total() == ref.expected_total() == total
    assert fast.token_ids == ref.token_ids
    assert fast.parents == ref.parents
    assert fast.sources == ref.sources
    assert fast.cells == ref.cells
    assert fast.point_mass == ref.point_mass
    assert fast.depth == ref.depth
    assert fast.samples == ref.samples
    for name in ("scores", "expected", "conds"):
        got, want = getattr(fast, name), getattr(ref, name)
        assert got == want, name  # bit-identical: the same operations in the same order
        assert np.allclose(got, want, rtol=0, atol=1e-12)
    assert fast.children == ref.children
    assert fast.is_chain == ref.is_chain
    assert fast.expected_in_prune_order() == ref.expected_in_prune_order()
    assert np.array_equal(fast.ancestor_mask(), reference_tree.ancestor_mask(ref.parents))


@pytest.mark.parametrize("seed", range(400))
def test_merge_matches_the_reference(seed):
    rng, drafts, calibration, max_depth = random_case(seed)
    full = merged(7, drafts, max_nodes=10**6, max_depth=max_depth, calibration=calibration)
    for max_nodes in sorted({0, 1, 2, rng.randint(0, len(full)), len(full) - 1, len(full), 10**6}):
        ref = merged(7, drafts, max_nodes=max_nodes, max_depth=max_depth, calibration=calibration)
        fast = TokenTree.from_drafts(7, drafts, max_nodes=max_nodes, max_depth=max_depth, calibration=calibration)
        assert_same_tree(fast, ref)


@pytest.mark.parametrize("seed", range(200))
def test_prune_matches_the_reference(seed):
    rng, drafts, calibration, max_depth = random_case(seed)
    fast = TokenTree.from_drafts(3, drafts, max_nodes=10**6, max_depth=max_depth, calibration=calibration)
    ref = merged(3, drafts, max_nodes=10**6, max_depth=max_depth, calibration=calibration)
    for n in range(len(fast) + 1):
        cut = fast.prune(n)
        assert_same_tree(cut, pruned(ref, n))
        for m in (0, n // 2):  # a pruned tree prunes on
            assert_same_tree(cut.prune(m), pruned(pruned(ref, n), m))


@pytest.mark.parametrize("seed", range(100))
def test_verify_inputs_of_merged_and_pruned_trees_equal_the_reference(seed):
    import torch

    from lookupdec.model import tree_inputs
    from lookupdec.reference import model as reference_model

    rng, drafts, calibration, max_depth = random_case(seed)
    tree = TokenTree.from_drafts(3, drafts, max_nodes=rng.randint(0, 40), max_depth=max_depth, calibration=calibration)
    for t in (tree, tree.prune(rng.randint(0, len(tree)))):
        n_cached = rng.choice((0, 5, 200))
        dtype = rng.choice((torch.float32, torch.bfloat16))
        got = tree_inputs(t, n_cached, device="cpu", dtype=dtype)
        want = reference_model.tree_inputs(t, n_cached, device="cpu", dtype=dtype)
        for g, w in zip(got, want):
            assert (g is None and w is None) or (g.dtype == w.dtype and torch.equal(g, w))


@pytest.mark.parametrize("seed", range(100))
def test_greedy_walk_of_merged_trees_equals_the_reference(seed):
    import torch

    from lookupdec.reference import sampling as reference_sampling
    from lookupdec.sampling import SamplingParams, accept

    rng, drafts, calibration, max_depth = random_case(seed)
    tree = TokenTree.from_drafts(3, drafts, max_nodes=rng.randint(0, 40), max_depth=max_depth, calibration=calibration)
    logits = torch.randint(0, 4, (len(tree) + rng.randint(0, 2), 60)).float()  # ties; spare rows allowed
    node = 0
    while tree.children[node] and rng.random() < 0.85:
        token, child = rng.choice(sorted(tree.children[node].items()))
        logits[node, token] = 9.0
        node = child
    got = accept(tree, logits, SamplingParams())
    want = reference_sampling.accept(tree, logits[: len(tree)], SamplingParams())
    assert (got.accepted, got.next_token, got.bonus) == (want.accepted, want.next_token, want.bonus)


def test_hand_made_trees_take_the_reference_paths():
    tree = TokenTree(token_ids=[9, 1, 2, 3], parents=[-1, 0, 0, 1], scores=[1.0, 0.4, 0.4, 0.4])
    assert tree.prune_order() == [1, 2, 3]  # ties: the earlier node
    assert tree.prune(2).token_ids == [9, 1, 2]
    assert np.array_equal(tree.ancestor_mask(), reference_tree.ancestor_mask(tree.parents))
    assert tree.prune(1).token_ids == pruned(tree, 1).token_ids == [9, 1]
    assert not tree.is_chain and TokenTree(token_ids=[5, 6], parents=[-1, 0]).is_chain


def test_scores_that_rise_below_a_parent_prune_by_the_definition():
    # a source scoring a child above its parent: min(1, factor * cond) caps the child at its
    # parent's score, so the child ties with the parent and the earlier (the parent) is first
    drafts = [Draft((1, 2), (-1, 0), (0.2, 0.9), "t"), Draft((3,), (-1,), (0.2,), "u")]
    for n in range(4):
        fast = TokenTree.from_drafts(0, drafts, max_nodes=n, max_depth=8)
        ref = merged(0, drafts, max_nodes=n, max_depth=8)
        assert_same_tree(fast, ref)


def test_bad_drafts_are_rejected_by_the_core():
    draft = Draft.__new__(Draft)
    draft.__dict__.update(token_ids=(1, 2), parents=(-1, 5), scores=(0.5, 0.5), source="t", match_length=0,
                          samples=None)
    with pytest.raises(ValueError, match="parents"):
        TokenTree.from_drafts(0, [draft], max_nodes=4, max_depth=4)


@pytest.mark.parametrize("seed", range(200))
def test_observe_draft_matches_the_reference(seed):
    """The calibrator's count of a draft's reached nodes (compiled) vs its Python loop: the same
    cells get the same sums, bit for bit (the same additions in the same order)."""
    from lookupdec.tree import observe_draft

    rng, drafts, _, _ = random_case(seed)
    for draft in drafts:
        committed = [rng.randrange(3) for _ in range(rng.randint(0, 8))]
        if draft.token_ids and rng.random() < 0.5:  # follow one of the draft's paths for a while
            node, path = rng.randrange(len(draft.token_ids)), []
            while node >= 0:
                path.append(draft.token_ids[node])
                node = draft.parents[node]
            committed = path[::-1][: rng.randint(0, len(path))] + committed
        row = rng.randrange(3)  # rows of a [3, CELLS_PER_ROW] table, as the calibrator passes them
        tables = [[rng.random() * np.ones((3, CELLS_PER_ROW)) for _ in range(3)] for _ in range(2)]
        for a, b in zip(*tables):
            b[:] = a
        observe_draft(draft, committed, *(t[row] for t in tables[0]))
        reference_tree.observe_draft(draft, committed, *(t[row] for t in tables[1]))
        for f, w in zip(*tables):
            assert f.tolist() == w.tolist()


def test_cells_at_the_bucket_bounds_are_the_references():
    """Conditional probabilities exactly at, just under and outside the bucket bounds, at depths
    across the depth buckets: the compiled merge's and count's cells (buckets counted, not
    searched) are the reference's."""
    from lookupdec.budget import AcceptanceCalibrator
    from lookupdec.reference import budget as reference_budget
    from lookupdec.tree import observe_draft

    bounds = [0.0, 0.25, 0.5, 0.75, 0.95, 1.0, 0.2499999999, 0.9500000001, -0.25, 1.5]
    drafts = [Draft(list(range(len(bounds))), [-1] * len(bounds), bounds, "ngram", match_length=3)]
    for depth in (2, 3, 4, 5, 8, 9, 16, 17, 18):  # a chain, its last step at each bound in turn
        for cond in bounds:
            scores = [1.0] * (depth - 1) + [cond]
            drafts.append(Draft(list(range(depth)), list(range(-1, depth - 1)), scores, "suffix", match_length=depth))
    committed = list(range(20))
    fast, ref = AcceptanceCalibrator(), reference_budget.AcceptanceCalibrator()
    for calibrator in (fast, ref):
        calibrator.learn(drafts, committed)
    assert fast._reached.tolist() == ref._reached.tolist() and fast._matched.tolist() == ref._matched.tolist()
    for draft in drafts:
        tables = [[np.zeros(CELLS_PER_ROW) for _ in range(3)] for _ in range(2)]
        observe_draft(draft, committed, *tables[0])
        reference_tree.observe_draft(draft, committed, *tables[1])
        assert [t.tolist() for t in tables[0]] == [t.tolist() for t in tables[1]]
        want = merged(0, [draft], max_nodes=64, max_depth=64, calibration=ref.calibration())
        assert_same_tree(TokenTree.from_drafts(0, [draft], max_nodes=64, max_depth=64, calibration=fast), want)


def test_a_merge_reading_more_cells_than_its_memo_holds_is_the_reference():
    """The compiled merge keeps the calibration cells it worked out in a table of 256 slots, at
    most half of them filled per merge; past that it works cells out without keeping them. A
    merge over drafts of every source and match length (hundreds of distinct cells) against the
    merge over the reference's whole table: the same tree, bit for bit."""
    from lookupdec.budget import AcceptanceCalibrator
    from lookupdec.reference import budget as reference_budget
    from lookupdec.tree import calibration_row_key

    rng = random.Random(5)
    fast, ref = AcceptanceCalibrator(), reference_budget.AcceptanceCalibrator()
    drafts = []
    for source in ("ngram", "suffix", "suffix-global", "recycle"):
        for match_length in (0, 1, 2, 3, 5, 9, 17, 33):
            n = rng.randint(8, 20)
            parents = [-1] + [rng.randrange(-1, i) for i in range(1, n)]
            scores, tokens = [], []
            for i, p in enumerate(parents):
                scores.append((1.0 if p < 0 else scores[p]) * rng.choice((0.1, 0.3, 0.6, 0.8, 0.97, 1.0)))
                tokens.append(rng.randrange(50))
            drafts.append(Draft(tokens, parents, scores, source, match_length=match_length))
    for step in range(3):  # counts in every row, so the cells differ from their priors
        committed = [rng.randrange(50) for _ in range(6)]
        for calibrator in (fast, ref):
            calibrator.learn(drafts, committed)
    assert len({(calibration_row_key(d), c) for d in drafts for c in reference_tree.draft_cells(d)[1]}) > 128
    want = TokenTree.from_drafts(0, drafts, max_nodes=64, max_depth=64, calibration=ref.calibration())
    assert_same_tree(TokenTree.from_drafts(0, drafts, max_nodes=64, max_depth=64, calibration=fast), want)


@pytest.mark.parametrize("seed", range(40))
def test_compiled_calibrator_matches_the_reference(seed):
    """``AcceptanceCalibrator`` (compiled ``learn`` and ``calibration``, one call each) against its
    numpy reference over many steps of random drafts from every source: the counts, the table,
    the row and source factors bit for bit, and the trees merged with either calibration or with
    the calibrator itself (the compiled merge computing the cells it reads from the counts)."""
    from lookupdec.budget import AcceptanceCalibrator
    from lookupdec.reference import budget as reference_budget

    rng = random.Random(seed)
    fast, ref = AcceptanceCalibrator(), reference_budget.AcceptanceCalibrator()
    assert type(fast) is AcceptanceCalibrator
    for step in range(30):
        _, drafts, _, max_nodes = random_case(seed * 1000 + step)
        committed = [rng.randrange(3) for _ in range(rng.randint(0, 8))]
        # before learning them (some drafts' rows, even sources, not seen yet: their fallback):
        # the merge over the calibrator's counts (cells computed as read) is the merge over its table
        by_table = TokenTree.from_drafts(0, drafts, max_nodes=max_nodes, max_depth=8, calibration=ref.calibration())
        assert fast.merge_counts() is not None and ref.merge_counts() is None
        for calibrator in (fast, ref):
            assert_same_tree(TokenTree.from_drafts(0, drafts, max_nodes=max_nodes, max_depth=8, calibration=calibrator),
                             by_table)
        assert_same_tree(merged(0, drafts, max_nodes=max_nodes, max_depth=8, calibration=fast), by_table)
        for calibrator in (fast, ref):
            calibrator.learn(drafts, committed)
        for name in ("_reached", "_predicted", "_matched"):
            assert getattr(fast, name).tolist() == getattr(ref, name).tolist(), name
        a, b = fast.calibration(), ref.calibration()
        assert a.rows == b.rows
        assert a.table.tolist() == b.table.tolist()
        assert np.asarray(a.row_factors).tolist() == np.asarray(b.row_factors).tolist()
        assert a.fallback == b.fallback
        assert a.packed_table() == b.packed_table()
        assert fast.factors() == ref.factors()
        assert_same_tree(TokenTree.from_drafts(0, drafts, max_nodes=max_nodes, max_depth=8, calibration=a),
                         TokenTree.from_drafts(0, drafts, max_nodes=max_nodes, max_depth=8, calibration=b))


def test_the_calibrator_is_compiled_where_the_core_is_built():
    """``AcceptanceCalibrator()`` is the compiled one here; where the extension is not built it is
    its definition (``tests/system/test_without_native.py`` runs that)."""
    from lookupdec.budget import AcceptanceCalibrator
    from lookupdec.reference import budget as reference_budget

    calibrator = AcceptanceCalibrator()
    assert type(calibrator) is AcceptanceCalibrator and calibrator.merge_counts() is not None
    assert reference_budget.AcceptanceCalibrator().merge_counts() is None
