"""``lookupdec.tree``: the docstring's worked example, trie merge, pruning to a budget (ancestors
kept), max_depth, the ancestor mask and the best chain, each against a brute-force reference on
random drafts."""
from __future__ import annotations

import random

import numpy as np
import pytest

from helpers import draft_paths
from lookupdec.proposers.base import Draft
from lookupdec.tree import TokenTree
from random_inputs import random_drafts  # (test_budget.py imports it from here)

BIG = 10**6  # a budget that prunes nothing


def chain(tokens, scores, source="test"):
    return Draft.chain(tokens, scores, source)


def path_tokens(tree: TokenTree, node: int) -> tuple[int, ...]:
    return tuple(tree.token_ids[i] for i in tree.path_to(node))


def all_paths(tree: TokenTree) -> set[tuple[int, ...]]:
    return {path_tokens(tree, i) for i in range(1, len(tree))}


def test_docstring_worked_example():
    drafts = [chain([1, 2, 3], [0.9, 0.8, 0.5]), chain([1, 4], [0.9, 0.6])]
    full = TokenTree.from_drafts(7, drafts, max_nodes=BIG, max_depth=BIG)
    assert full.token_ids == [7, 1, 2, 3, 4]
    assert full.parents == [-1, 0, 1, 2, 1]
    assert full.depth == [0, 1, 2, 3, 2]
    assert full.scores == pytest.approx([1.0, 0.9, 0.8, 0.5, 0.6])
    pruned = TokenTree.from_drafts(7, drafts, max_nodes=3, max_depth=BIG)
    # keeps 1 (.9), 2 (.8), 4 (.6); 3 (.5) is the worst node
    assert pruned.token_ids == [7, 1, 2, 4]
    assert pruned.parents == [-1, 0, 1, 1]
    assert full.prune(3).token_ids == pruned.token_ids


def test_best_chain_worked_example():
    tree = TokenTree.from_drafts(7, [chain([1, 2, 3], [0.9, 0.8, 0.5]), chain([1, 4], [0.9, 0.6])],
                                 max_nodes=BIG, max_depth=BIG)
    best = tree.best_chain()  # gains: [1, 2, 3] -> 2.2, [1, 4] -> 1.5
    assert best.token_ids == [7, 1, 2, 3] and best.parents == [-1, 0, 1, 2]


def test_max_depth_cuts_deep_nodes_and_their_descendants():
    drafts = [chain([1, 2, 3, 4], [0.9] * 4), Draft((5, 6, 7), (-1, 0, 0), (0.5, 0.4, 0.3), "t")]
    tree = TokenTree.from_drafts(9, drafts, max_nodes=BIG, max_depth=2)
    assert all_paths(tree) == {(1,), (1, 2), (5,), (5, 6), (5, 7)}
    assert max(tree.depth) == 2
    assert TokenTree.from_drafts(9, drafts, max_nodes=BIG, max_depth=1).token_ids == [9, 1, 5]


def test_zero_budget_keeps_only_the_root():
    tree = TokenTree.from_drafts(3, [chain([1, 2], [0.9, 0.9])], max_nodes=0, max_depth=BIG)
    assert tree.token_ids == [3] and tree.parents == [-1] and tree.num_draft_nodes == 0


def test_factors_scale_conditional_probabilities():
    drafts = [chain([1, 2], [0.9, 0.8], "weak"), chain([3, 4], [0.5, 0.4], "strong")]
    tree = TokenTree.from_drafts(0, drafts, max_nodes=BIG, max_depth=BIG, calibration={"weak": 0.5, "strong": 4.0})
    # weak: 0.5 * 0.9 = 0.45, then 0.45 * 0.5 * (0.8 / 0.9); strong: min(1, 4 * 0.5) = 1, min(1, 4 * 0.8) = 1
    assert tree.scores == pytest.approx([1.0, 0.45, 0.45 * 0.5 * 0.8 / 0.9, 1.0, 1.0])


def test_invalid_trees_are_rejected():
    with pytest.raises(ValueError, match="two children"):
        TokenTree(token_ids=[0, 5, 5], parents=[-1, 0, 0])
    with pytest.raises(ValueError, match="parents"):
        TokenTree(token_ids=[0, 5, 6], parents=[-1, 2, 0])
    with pytest.raises(ValueError, match="parents"):
        TokenTree(token_ids=[0, 5], parents=[0, 0])
    with pytest.raises(ValueError, match="parents"):
        Draft((1, 2), (-1, 1), (0.5, 0.5), "t")
    with pytest.raises(ValueError, match="lengths"):
        Draft((1, 2), (-1, 0), (0.5,), "t")


@pytest.mark.parametrize("seed", range(100))
def test_random_drafts_against_brute_force(seed):
    rng = random.Random(seed)
    drafts = random_drafts(rng)
    max_depth = rng.randint(1, 6)
    full = TokenTree.from_drafts(0, drafts, max_nodes=BIG, max_depth=max_depth)

    # trie merge: exactly the draft paths (depth-capped), each once, children distinct
    want = draft_paths(drafts, max_depth)
    assert all_paths(full) == want
    assert len(full) == 1 + len(want)
    for node in range(len(full)):
        kids = [full.token_ids[i] for i in range(1, len(full)) if full.parents[i] == node]
        assert len(kids) == len(set(kids)), f"node {node} has repeated child tokens {kids}"
        assert full.children[node] == {full.token_ids[i]: i for i in range(1, len(full)) if full.parents[i] == node}
    assert all(full.parents[i] < i for i in range(1, len(full)))
    assert all(full.depth[i] == len(full.path_to(i)) <= max_depth for i in range(len(full)))
    # a path cannot be likelier than its prefix
    assert all(0.0 <= full.scores[i] <= full.scores[full.parents[i]] for i in range(1, len(full)))

    # pruning: the max_nodes best nodes (score desc, then earlier), which include their ancestors
    max_nodes = rng.randint(0, len(full))
    pruned = TokenTree.from_drafts(0, drafts, max_nodes=max_nodes, max_depth=max_depth)
    best = sorted(range(1, len(full)), key=lambda i: (-full.scores[i], i))[:max_nodes]
    assert all_paths(pruned) == {path_tokens(full, i) for i in best}
    assert pruned.num_draft_nodes == min(max_nodes, len(full) - 1)
    for i in range(1, len(pruned)):
        assert path_tokens(pruned, i)[:-1] in all_paths(pruned) | {()}, "an ancestor was dropped"
    assert all_paths(full.prune(max_nodes)) == all_paths(pruned)

    # ancestor mask: node i sees j iff j is i or on its path
    mask = full.ancestor_mask()
    want_mask = np.zeros((len(full), len(full)), dtype=bool)
    for i in range(len(full)):
        for j in [0, *full.path_to(i)]:
            want_mask[i, j] = True
    assert mask.dtype == bool and np.array_equal(mask, want_mask)

    # best chain: the path of largest score sum (ties: the earliest node)
    gain = {i: sum(full.scores[j] for j in full.path_to(i)) for i in range(len(full))}
    leaf = max(range(len(full)), key=lambda i: (gain[i], -i))
    best_chain = full.best_chain()
    assert best_chain.parents == list(range(-1, len(best_chain) - 1))
    assert tuple(best_chain.token_ids[1:]) == path_tokens(full, leaf)


def test_draft_best_chain():
    tokens, cond = chain([4, 5, 6], [0.9, 0.45, 0.45]).best_chain()
    assert tokens == [4, 5, 6] and cond == pytest.approx([0.9, 0.5, 1.0])
    tree_draft = Draft((1, 2, 3, 4), (-1, 0, 0, 2), (0.8, 0.2, 0.6, 0.3), "t")
    tokens, cond = tree_draft.best_chain()  # follows the best-scored child: 1 -> 3 -> 4
    assert tokens == [1, 3, 4] and cond == pytest.approx([0.8, 0.75, 0.5])
