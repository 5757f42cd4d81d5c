"""The references: the pure-Python (numpy, torch) definition of every compiled fast path.

The rule. Every compiled fast path (the C++ core ``lookupdec._native`` handed out by
``lookupdec.native``, and the CPU kernels and cache moves beside the forward) has its definition
here, in the module that mirrors the production module it defines:

    tree.py       lookupdec/tree.py           merge, prune, ancestor mask, calibration counts
    automaton.py  lookupdec/automaton/        the suffix automaton's core (and its drafts)
    drafting.py   lookupdec/proposers/        the n-gram index, the recycling table, the suffix drafts
    sampling.py   lookupdec/sampling.py       greedy acceptance
    budget.py     lookupdec/budget.py         the cost curve, the size choice, the calibrator
    request.py    lookupdec/request.py        a row's top tokens
    model.py      lookupdec/model/            verify inputs, K/V writes and moves, attention plan and attention

Each function or class that defines a fast path names it in its docstring's first line
("Defines ..."; the others are parts of a definition, or what it shares with its production
module). The tests compare the two bit for bit (the reference repeats the fast path's operations
in order), or as the test states (the tree attention: within float rounding of its float64
definition).

Production code calls a reference only where the extension is not built, or where its fast path
does not take the input (another device or dtype, negative budgets, a tree not from the
compiled merge, sliding-window masks, a cache without the slot buffer): each such call says
which. A reference imports nothing from the module whose fast path it defines (that module
falls back on it): what both use (the calibration's cells and priors, the cost curve's tail) is
defined in the reference and imported from there; what the compiled core takes as arguments
(decays, priors, the suffix drafts' parameters), the reference takes as arguments too.

Importing this package imports none of its modules: callers name the one they take
(``from lookupdec.reference import tree as reference_tree``).
"""
