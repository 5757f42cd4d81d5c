"""The compiled core: the extension module ``lookupdec._native`` (C++ in ``csrc/``, built by
``pip install``), one submodule per group, each None where the extension is not built.

- ``drafting``: the suffix automaton (``automaton/``), the n-gram index and the recycling table
  (``proposers/``), a request's lookups drafted and merged in one call (``mixture.py``).
- ``tree``: the step's tree merge, calibration, size choice, verify inputs and greedy walk
  (``tree.py``, ``budget.py``, ``sampling.py``).
- ``kernels``: the forward's CPU kernels and the K/V cache's slot moves (``model/kernels.py``,
  ``model/cache.py``).

Every caller names the submodule it takes (``from lookupdec.native import kernels as
native_kernels``) and falls back for None on the fast path's definition in ``lookupdec.reference``
(docs/design/kernels.md), so the package works, slowly, without the build
(``LOOKUPDEC_NO_NATIVE=1`` runs the references with the build present: tests compare the two).
Importing this module imports no torch.
"""
from __future__ import annotations

import os

try:
    if os.environ.get("LOOKUPDEC_NO_NATIVE", "") not in ("", "0"):
        raise ImportError("LOOKUPDEC_NO_NATIVE is set")
    from lookupdec._native import drafting, kernels, tree
except ImportError:  # not built (a source tree without `pip install -e .`), or turned off: the references
    drafting = kernels = tree = None

__all__ = ["available", "drafting", "kernels", "tree"]


def available() -> bool:
    """Whether the extension is built (all three submodules, or none)."""
    return tree is not None
