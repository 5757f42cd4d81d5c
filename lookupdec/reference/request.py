"""The definition of ``lookupdec/request.py``'s compiled top tokens (``request.top_tokens``: one pass
per row in the core, ``csrc/common/topk.cpp``, as ``TokenTree.greedy_walk`` and the skinny
product's picks read them too). ``tests/test_request.py`` compares the two."""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch


def top_tokens(logits: torch.Tensor, rows: Sequence[int], k: int) -> list[list[int]]:
    """Defines ``request.top_tokens`` (compiled: ``native.tree.top_tokens``): the ``k``
    highest-scoring token ids of each of ``rows`` of ``logits`` [n, vocab], best first, by
    repeated argmax (the first of equal values, NaN as the largest) on a CPU, else ``topk``."""
    if logits.device.type != "cpu":
        return logits[list(rows)].topk(k, dim=-1).indices.tolist()
    out = []
    array = logits.numpy()
    for r in rows:
        row = array[r].copy()
        best = []
        for _ in range(min(k, len(row))):
            i = int(row.argmax())
            best.append(i)
            row[i] = -np.inf
        out.append(best)
    return out
