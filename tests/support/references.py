"""The references (``lookupdec.reference``) in the shapes the tests compare with the fast paths:
a tree the reference merge or prune defines as a ``TokenTree`` (the references hand out the tree's
fields), and a ``SuffixAutomaton`` over the reference automaton core."""
from __future__ import annotations

from typing import Sequence

from lookupdec.automaton import SuffixAutomaton
from lookupdec.reference import tree as reference_tree
from lookupdec.reference.automaton import ReferenceAutomaton
from lookupdec.tree import Calibration, TokenTree


def merged(root_token: int, drafts: Sequence, *, max_nodes: int, max_depth: int, calibration=None) -> TokenTree:
    """``reference.tree.merge_drafts``' tree; ``calibration`` as ``TokenTree.from_drafts`` takes it
    (a ``Calibration``, a dict of factors, a calibrator or None)."""
    if hasattr(calibration, "merge_counts"):  # a calibrator: its table
        calibration = calibration.calibration()
    if isinstance(calibration, dict):
        calibration = Calibration.from_factors(calibration)
    return TokenTree(**reference_tree.merge_drafts(root_token, drafts, max_nodes=max_nodes, max_depth=max_depth,
                                                   calibration=calibration))


def pruned(tree: TokenTree, max_nodes: int) -> TokenTree:
    """``reference.tree.prune``'s tree."""
    return TokenTree(**reference_tree.prune(tree, max_nodes))


def reference_automaton(tokens=()) -> SuffixAutomaton:
    """A ``SuffixAutomaton`` over the reference core (``ReferenceAutomaton``) holding ``tokens``."""
    return SuffixAutomaton(tokens, core=ReferenceAutomaton())
