"""Token recycling: drafts from the target's own earlier predictions, no second network.

Every verify forward computes the target's logits at each tree node; most of that is thrown
away. Here the top-``successors`` tokens at every node the acceptance walk visited are kept, keyed
by the node's token and the token before it (and by the node's token alone as a fallback): "after
``b`` (preceded by ``a``), the target's likeliest next tokens were ``x, y, z``". Each step the
draft is grown best-first from the context's last two tokens through that table: a node's score
is its parent's times a prior for its rank among the successors (``RANK_PRIOR``); the calibrator
(``budget.AcceptanceCalibrator``, per depth and sibling rank) corrects those priors from what
the target accepted.

Exact: the table holds tokens from earlier steps (history), never the current step's draws, and
every draft node is a point mass that acceptance verifies like any lookup's.

The table is the engine's, shared by all requests (a token's likely successors do not depend on
the request much), and bounded (``RecycleConfig.max_entries``: past it, the pair table starts
over). The table and the draft live in the compiled core (``native.drafting.RecycleTable``) when it is
built; ``backend="reference"`` runs the pure-Python definition here, which tests compare it
with draft for draft. Paper: Luo et al., "Turning Trash into Treasure: Accelerating Inference of Large Language
Models with Token Recycling" (arXiv 2408.08696), which keeps one adjacency row per token.
"""
from __future__ import annotations

import heapq
from typing import Sequence

from lookupdec.automaton import compiled_available
from lookupdec.config import RecycleConfig
from lookupdec.proposers.base import Draft

RANK_PRIOR = (0.45, 0.15, 0.08, 0.05, 0.04, 0.03, 0.02, 0.02)  # conditional acceptance by successor rank
PAIR_MATCH = 2  # Draft.match_length when the root's successors came from the (previous, last) pair
TOKEN_MATCH = 1  # ... from the last token alone


class RecycleProposer:
    name = "recycle"
    wants_successors = True  # the step hands it the target's top tokens (``Mixture.finish`` -> ``observe_path``)
    fused_kind = "r"  # Mixture.plan's code for it (compiled_lookup)

    def __init__(self, config: RecycleConfig | None = None, *, backend: str = "auto") -> None:
        """``backend``: "auto" (the compiled table when built, else the reference), "compiled"
        (an error without it) or "reference"."""
        if backend not in ("auto", "compiled", "reference"):
            raise ValueError(f"backend must be 'auto', 'compiled' or 'reference', got {backend!r}")
        if backend == "compiled" and not compiled_available():
            raise ImportError("lookupdec's compiled core (lookupdec._native) is not built: run `pip install -e .`")
        self.config = config or RecycleConfig()
        self.backend = "compiled" if backend != "reference" and compiled_available() else "reference"
        self.by_pair: dict[tuple[int, int], tuple[int, ...]] = {}  # (previous, token) -> successors, best first
        self.by_token: dict[int, tuple[int, ...]] = {}  # token -> successors, best first
        self._table = None
        if self.backend == "compiled":
            from lookupdec.native import drafting as native_drafting

            self._table = native_drafting.RecycleTable(self.config.successors, self.config.max_entries,
                                                       list(RANK_PRIOR))

    @property
    def num_pairs(self) -> int:
        """(previous, token) entries held (bounded by ``RecycleConfig.max_entries``, plus one step's)."""
        return self._table.num_pairs() if self._table is not None else len(self.by_pair)

    # -- lifecycle: the table is not per request --------------------------------------------------
    def start(self, request_id: str, prompt_ids: Sequence[int]) -> None:
        pass

    def observe(self, request_id: str, new_ids: Sequence[int]) -> None:
        pass

    def stop(self, request_id: str) -> None:
        pass

    def observe_successors(self, entries: Sequence[tuple[int, int, Sequence[int]]]) -> None:
        """``(previous token, token, the target's top tokens after them, best first)`` for every
        node the acceptance walk visited in a verify forward."""
        if self._table is not None:
            previous, tokens, successors = zip(*entries) if entries else ((), (), ())
            self._table.observe(previous, tokens, successors)
            return
        if len(self.by_pair) > self.config.max_entries:
            self.by_pair.clear()
        for prev, token, successors in entries:
            successors = tuple(successors[: self.config.successors])
            self.by_pair[(prev, token)] = successors
            self.by_token[token] = successors

    def compiled_lookup(self, request_id: str) -> tuple | None:
        """For ``Mixture.plan``: the compiled table and ``propose``'s limits (``max_nodes``,
        ``max_depth``); None on the reference backend."""
        if self._table is None:
            return None
        return self._table, (self.config.max_nodes, self.config.max_depth)

    def observe_path(self, prev: int, tokens: Sequence[int], successors: Sequence[Sequence[int]]) -> None:
        """``observe_successors`` of a walked path: ``tokens`` (the root's, then each accepted
        node's), each preceded by the one before it (``prev`` before the first)."""
        if self._table is not None:
            self._table.observe_path(prev, tokens, successors)
            return
        self.observe_successors(list(zip([prev, *tokens[:-1]], tokens, successors)))

    def successors(self, prev: int, token: int) -> tuple[tuple[int, ...], int]:
        """(The reference's table.) The recorded successors of ``token`` after ``prev`` and the match length they rest on
        (``PAIR_MATCH``, ``TOKEN_MATCH``, or 0 with none)."""
        found = self.by_pair.get((prev, token))
        if found is not None:
            return found, PAIR_MATCH
        found = self.by_token.get(token)
        return (found, TOKEN_MATCH) if found is not None else ((), 0)

    def propose(self, request_id: str, context: Sequence[int], max_nodes: int) -> list[Draft]:
        limit = min(max_nodes, self.config.max_nodes)
        if limit <= 0 or not context:
            return []
        root, prev = context[-1], (context[-2] if len(context) > 1 else -1)
        if self._table is not None:
            tokens, parents, scores, match = self._table.propose(prev, root, limit, self.config.max_depth)
            if not tokens:
                return []
            return [Draft._trusted(None, None, None, self.name, match, packed=(tokens, parents, scores))]
        first, match = self.successors(prev, root)
        if not first:
            return []
        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []
        max_depth = self.config.max_depth
        # heap of (-score, order, parent node, previous token, token, depth)
        heap = [(-RANK_PRIOR[min(r, len(RANK_PRIOR) - 1)], r, -1, root, t, 1) for r, t in enumerate(first)]
        heapq.heapify(heap)
        order = len(heap)
        while heap and len(tokens) < limit:
            neg, _, parent, before, token, depth = heapq.heappop(heap)
            node = len(tokens)
            tokens.append(token)
            parents.append(parent)
            scores.append(-neg)
            if depth < max_depth:
                for r, t in enumerate(self.successors(before, token)[0]):
                    heapq.heappush(heap, (neg * RANK_PRIOR[min(r, len(RANK_PRIOR) - 1)], order, node, token, t,
                                          depth + 1))
                    order += 1
        return [Draft(tuple(tokens), tuple(parents), tuple(scores), self.name, match)]
