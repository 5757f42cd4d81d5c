"""All of a step's drafting sources behind one call, with one node budget (``max_nodes``).

Lookups (n-gram, suffix cache, retrieval) run every step. The draft model, if there is one,
runs only where they are weak (``DraftConfig.mode="auto"``: the best calibrated score of a
lookup's first token is below ``threshold``), or always, or never. The step's node budget is
then shared among all the drafts by calibrated score in ``TokenTree.from_drafts``: the
calibrator (``budget.AcceptanceCalibrator``) scales each source's scores — per source and per
match-length bucket — by how often its drafts turned out right, so a source that keeps failing
gets fewer of the nodes.
"""
from __future__ import annotations

from typing import Sequence

from lookupdec.budget import AcceptanceCalibrator
from lookupdec.config import DraftConfig
from lookupdec.proposers.base import Proposer
from lookupdec.tree import Draft


class Mixture:
    def __init__(self, lookups: Sequence[Proposer], draft=None, config: DraftConfig | None = None,
                 calibrator: AcceptanceCalibrator | None = None) -> None:
        self.lookups = list(lookups)
        self.draft = draft
        self.config = config or DraftConfig()
        self.calibrator = calibrator or AcceptanceCalibrator()
        self.draft_steps = 0  # steps on which the draft model ran (the engine resets it per request)
        # sources that learn from the target's own top tokens (token recycling): the engine
        # hands them ``observe_successors`` after each verify forward
        self.successor_sinks = [p for p in self.lookups if getattr(p, "wants_successors", False)]

    @property
    def proposers(self) -> list:
        return self.lookups + ([self.draft] if self.draft is not None else [])

    def start(self, request_id: str, prompt_ids: Sequence[int], params=None, seed=None) -> None:
        for p in self.proposers:
            p.start(request_id, prompt_ids)
        if self.draft is not None and params is not None:
            self.draft.set_sampling(request_id, params, seed)

    def propose(self, request_id: str, context: Sequence[int], max_nodes: int) -> list[Draft]:
        """Every source's drafts, each of at most ``max_nodes`` nodes (the merge keeps the best)."""
        drafts = [d for p in self.lookups for d in p.propose(request_id, context, max_nodes)]
        if self.draft is not None and self._want_draft_model(drafts):
            drafts += self.draft.propose(request_id, context, max_nodes)
            self.draft_steps += 1
        return drafts

    def _want_draft_model(self, drafts: Sequence[Draft]) -> bool:
        mode = self.config.mode
        if mode != "auto":
            return mode == "always"
        best = 0.0
        for d in drafts:
            factor = self.calibrator.factor(d)
            for score, parent in zip(d.scores, d.parents):
                if parent < 0:
                    best = max(best, min(1.0, score * factor))
        return best < self.config.threshold

    def observe(self, request_id: str, new_ids: Sequence[int]) -> None:
        for p in self.proposers:
            p.observe(request_id, new_ids)

    def observe_successors(self, entries) -> None:
        """``(previous token, token, target's top tokens after them)`` per visited tree node."""
        for p in self.successor_sinks:
            p.observe_successors(entries)

    def stop(self, request_id: str) -> None:
        for p in self.proposers:
            p.stop(request_id)
