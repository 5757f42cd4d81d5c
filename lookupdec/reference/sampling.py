"""The definition of ``lookupdec/sampling.py``'s greedy fast paths: the compiled walk over the rows
it visits (``TokenTree.greedy_walk``, ``csrc/tree/tree.cpp``), the walk over partial logits and
over a batch's ``GreedyChoices``, each row's argmax read as it is reached. Here every row's
argmax is taken first, in one torch call; the walk follows it. ``tests/test_sampling.py`` and
``tests/test_tree_compiled.py`` compare them: the same accepted nodes, next token and bonus.

(Sampling, and greedy acceptance with a repetition penalty, have no fast path: ``sampling.accept``'s
walk is their definition, and ``accept`` below hands them to it.)
"""
from __future__ import annotations

import torch

from lookupdec import sampling
from lookupdec.sampling import Acceptance, GreedyChoices, PartialLogits, SamplingParams


def accept(tree, logits, params: SamplingParams, *, context_ids: torch.Tensor | None = None,
           generator: torch.Generator | None = None) -> Acceptance:
    """Defines ``sampling.accept``'s greedy walks (without a repetition penalty): from the root,
    follow the child whose token is the row's argmax (the first of equal maxima, as
    ``torch.argmax``), and emit the argmax at the first node without such a child (a bonus token
    where the node has no children). ``logits``: [1 + n, vocab] (row u after node u), a
    ``PartialLogits`` (every row made first) or ``GreedyChoices``."""
    if not params.greedy or params.uses_prefix:
        return sampling.accept(tree, logits, params, context_ids=context_ids, generator=generator)
    if isinstance(logits, GreedyChoices):
        choice = logits.argmax
    else:
        if isinstance(logits, PartialLogits):
            logits = logits.dense()
        choice = logits.argmax(-1).tolist()  # one argmax over every row
    accepted, node, children = [], 0, tree.children
    while True:
        token = choice[node]
        child = children[node].get(token)
        if child is None:
            return Acceptance(accepted, token, bonus=not children[node])
        accepted.append(child)
        node = child
