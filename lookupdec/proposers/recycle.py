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
over). The table and the draft live in the compiled core (``native.drafting.RecycleTable``) when
it is built, else in their pure-Python definition, ``lookupdec.reference.drafting.RecycleTable``,
which tests compare it with draft for draft. Paper: Luo et al., "Turning Trash into Treasure:
Accelerating Inference of Large Language Models with Token Recycling" (arXiv 2408.08696), which
keeps one adjacency row per token.
"""
from __future__ import annotations

from typing import Sequence

from lookupdec.config import RecycleConfig
from lookupdec.native import drafting as native_drafting  # None where not built: the reference table
from lookupdec.proposers.base import Draft
from lookupdec.reference import drafting as reference_drafting
# Draft.match_length when the root's successors came from the (previous, last) pair, or from the
# last token alone: the table's own (defined with it, re-exported)
from lookupdec.reference.drafting import PAIR_MATCH, TOKEN_MATCH  # noqa: F401

RANK_PRIOR = (0.45, 0.15, 0.08, 0.05, 0.04, 0.03, 0.02, 0.02)  # conditional acceptance by successor rank


class RecycleProposer:
    name = "recycle"
    wants_successors = True  # the step hands it the target's top tokens (``Mixture.finish`` -> ``observe_path``)
    fused_kind = "r"  # Mixture.plan's code for it (compiled_lookup)

    def __init__(self, config: RecycleConfig | None = None) -> None:
        self.config = config or RecycleConfig()
        # the table: compiled, else (the extension not built) its definition
        table = native_drafting.RecycleTable if native_drafting is not None else reference_drafting.RecycleTable
        self._table = table(self.config.successors, self.config.max_entries, list(RANK_PRIOR))

    @property
    def num_pairs(self) -> int:
        """(previous, token) entries held (bounded by ``RecycleConfig.max_entries``, plus one step's)."""
        return self._table.num_pairs()

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
        previous, tokens, successors = zip(*entries) if entries else ((), (), ())
        self._table.observe(previous, tokens, successors)

    def compiled_lookup(self, request_id: str) -> tuple | None:
        """For ``Mixture.plan``: the compiled table and ``propose``'s limits (``max_nodes``,
        ``max_depth``); None where the table is the reference (the extension not built)."""
        if isinstance(self._table, reference_drafting.RecycleTable):
            return None
        return self._table, (self.config.max_nodes, self.config.max_depth)

    def observe_path(self, prev: int, tokens: Sequence[int], successors: Sequence[Sequence[int]]) -> None:
        """``observe_successors`` of a walked path: ``tokens`` (the root's, then each accepted
        node's), each preceded by the one before it (``prev`` before the first)."""
        self._table.observe_path(prev, tokens, successors)

    def propose(self, request_id: str, context: Sequence[int], max_nodes: int) -> list[Draft]:
        limit = min(max_nodes, self.config.max_nodes)
        if limit <= 0 or not context:
            return []
        root, prev = context[-1], (context[-2] if len(context) > 1 else -1)
        tokens, parents, scores, match = self._table.propose(prev, root, limit, self.config.max_depth)
        if not tokens:
            return []
        return [Draft._trusted(None, None, None, self.name, match, packed=(tokens, parents, scores))]
