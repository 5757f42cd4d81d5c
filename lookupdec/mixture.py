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

from collections.abc import Sequence

import numpy as np

from lookupdec.budget import HISTORY_DECAY, AcceptanceCalibrator
from lookupdec.config import DraftConfig
from lookupdec.proposers.suffix import CERTAIN_DECAY
from lookupdec.proposers.base import Proposer
from lookupdec.native import drafting as native_drafting
from lookupdec.tree import Draft, TokenTree

# the fused plan's sources by code (``native_drafting.Lookups``): NgramProposer, SuffixProposer's two
# automata, RecycleProposer
FUSED_SOURCES = ("ngram", "suffix", "suffix-global", "recycle")


class Mixture:
    def __init__(self, lookups: Sequence[Proposer], draft=None, config: DraftConfig | None = None,
                 calibrator: AcceptanceCalibrator | None = None) -> None:
        self.lookups = list(lookups)
        self.draft = draft
        self.config = config or DraftConfig()
        self.calibrator = calibrator or AcceptanceCalibrator()
        self.draft_steps = 0  # steps on which the draft model ran (the engine resets it per request)
        # sources that learn from the target's own top tokens (token recycling): the engine
        # hands them the verify forward's top tokens along the walk with each step's observe
        # (``finish`` -> ``observe_path``)
        self.successor_sinks = [p for p in self.lookups if getattr(p, "wants_successors", False)]
        # ``plan``: the lookups' drafts and their merge in one compiled call, where every lookup
        # is one of the compiled kinds (each at most once) and no draft model joins them
        kinds = [getattr(p, "fused_kind", None) for p in self.lookups]
        self.fused = (native_drafting is not None and hasattr(native_drafting, "Lookups") and draft is None
                      and None not in kinds and len(set(kinds)) == len(kinds))
        self._fused: dict[str, FusedRequest] = {}  # request id -> its native_drafting.Lookups and what they were given
        self._suffix = next((p for p in self.lookups if getattr(p, "fused_kind", None) == "s"), None)
        # after a fused observe: the proposers with more to do than the core's extends (observe_fused)
        self._observe_fused = [p.observe_fused for p in self.lookups if hasattr(p, "observe_fused")]

    @property
    def proposers(self) -> list:
        return self.lookups + ([self.draft] if self.draft is not None else [])

    def start(self, request_id: str, prompt_ids: Sequence[int], params=None, seed=None) -> None:
        for p in self.proposers:
            p.start(request_id, prompt_ids)
        if self.draft is not None and params is not None:
            self.draft.set_sampling(request_id, params, seed)
        if self.fused:
            self._start_fused(request_id)

    def _start_fused(self, request_id: str) -> None:
        """The request's ``native_drafting.Lookups`` (its lookups' compiled state and parameters), or none
        where one of them is not compiled (``plan`` then returns None, and ``finish`` asks each
        proposer). With one, ``finish`` extends the n-gram index and the request's automaton
        in one call, settling the suffix automata's pending chains into the suffix proposer's
        certain-step estimates, then hands the proposers that define ``observe_fused`` the rest of
        their ``observe``."""
        handles = {p.fused_kind: p.compiled_lookup(request_id) for p in self.lookups}
        if None in handles.values():
            return
        ngram, ngram_params = handles.get("n", (None, (0, 0, 0.0, 0.0)))
        recycle, recycle_params = handles.get("r", (None, (0, 0)))
        suffix, suffix_params, max_match, certain = handles.get("s", (None, (0, 0, 0, 1, 0, 0.0, 0.0), 0, None))
        order = "".join(p.fused_kind for p in self.lookups)
        lookups = native_drafting.Lookups(ngram, *ngram_params, suffix, *suffix_params, recycle, *recycle_params, order,
                                list(FUSED_SOURCES), certain, CERTAIN_DECAY)
        self._fused[request_id] = FusedRequest(lookups, max_match, recycles=recycle is not None)

    def propose(self, request_id: str, context: Sequence[int], max_nodes: int) -> list[Draft]:
        """Every source's drafts, each of at most ``max_nodes`` nodes (the merge keeps the best)."""
        drafts = [d for p in self.lookups for d in p.propose(request_id, context, max_nodes)]
        if self.draft is not None and self._want_draft_model(drafts):
            drafts += self.draft.propose(request_id, context, max_nodes)
            self.draft_steps += 1
        return drafts

    def plan(self, request_id: str, context: Sequence[int], max_nodes: int, max_depth: int,
             calibrator: AcceptanceCalibrator) -> tuple[TokenTree, "PlannedDrafts"] | None:
        """``propose`` and ``TokenTree.from_drafts`` with ``calibrator`` in one compiled call
        (``native_drafting.Lookups.plan``): the same drafts, in the same order, and the same tree (the
        proposers' own compiled functions, the merge's own; ``tests/test_mixture_plan.py``), with
        no Python between them. None where it does not apply (``fused`` off, a lookup not
        compiled, a calibrator without compiled counts, negative budgets): the caller then
        proposes and merges apart. The drafts come as ``PlannedDrafts``: ``Draft`` objects made
        only if something reads them (``AcceptanceCalibrator.learn`` counts them in the core)."""
        entry = self._fused.get(request_id)
        if entry is None or max_nodes < 0 or max_depth < 0 or not entry.sync(calibrator):
            return None
        lookups, max_match = entry.lookups, entry.max_match
        global_core = self._suffix.global_core() if self._suffix is not None else None
        ctx = context[-max_match:] if max_match else []
        if type(ctx) is not list:
            ctx = list(ctx)
        n = len(context)
        try:
            out = lookups.plan(ctx, n, context[-2] if n > 1 else -1, context[-1], max_nodes, global_core, max_depth)
        except TypeError:  # ids outside int32: the proposers' own calls name them
            return None
        if out is None:  # the n-gram index missed tokens: its own call says so
            self.propose(request_id, context, max_nodes)
            raise AssertionError("Mixture.plan: the n-gram index and the context disagree")
        core, packed, serial = out
        return TokenTree._from_core(core, {}), PlannedDrafts(packed, entry, serial)

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
        """Every proposer sees ``new_ids`` (``finish`` without a verdict's extras)."""
        self.finish(request_id, new_ids)

    def finish(self, request_id: str, new_ids: Sequence[int], successors: tuple | None = None,
               drafts: Sequence[Draft] = (), calibrator: AcceptanceCalibrator | None = None) -> None:
        """After a step: ``observe_path(*successors)`` (the verify forward's top tokens along the
        walk, for token recycling), ``observe(request_id, new_ids)`` and, with ``calibrator``,
        ``calibrator.learn(drafts, new_ids)``, in that order. Where the request's lookups are
        fused, one compiled call (``native_drafting.Lookups.finish``) does all three, the learn too where
        ``drafts`` are the request's last fused plan (``PlannedDrafts``: else the calibrator
        learns apart, after)."""
        entry = self._fused.get(request_id)
        if entry is not None and type(new_ids) is list and (successors is None or entry.recycles):
            serial = -1  # (no plan of the core's: the core learns nothing)
            if (calibrator is not None and type(drafts) is PlannedDrafts and drafts.request is entry
                    and entry.sync(calibrator)):
                serial = drafts.serial
            prev, visited, tops = successors if successors is not None else (-1, [], None)
            try:
                learnt = entry.lookups.finish(prev, visited, tops, new_ids, serial, HISTORY_DECAY)
            except TypeError:
                pass  # ids outside int32: the proposers' own calls name them
            else:
                for observe_fused in self._observe_fused:
                    observe_fused(request_id, new_ids)
                if learnt:
                    calibrator.learnt()
                elif calibrator is not None:
                    calibrator.learn(drafts, new_ids)
                return
        if successors is not None:
            self.observe_path(*successors)
        for p in self.proposers:
            p.observe(request_id, new_ids)
        if calibrator is not None:
            calibrator.learn(drafts, new_ids)

    def observe_successors(self, entries) -> None:
        """``(previous token, token, target's top tokens after them)`` per visited tree node."""
        for p in self.successor_sinks:
            p.observe_successors(entries)

    def observe_path(self, prev: int, tokens: Sequence[int], successors) -> None:
        """``observe_successors`` of the path a step's walk visited: ``tokens`` (the root's, then
        each accepted node's) with the target's top tokens after each, ``prev`` before the first."""
        for p in self.successor_sinks:
            if hasattr(p, "observe_path"):
                p.observe_path(prev, tokens, successors)
            else:
                p.observe_successors(list(zip([prev, *tokens[:-1]], tokens, successors)))

    def stop(self, request_id: str) -> None:
        self._fused.pop(request_id, None)
        for p in self.proposers:
            p.stop(request_id)


class FusedRequest:
    """A request's ``native_drafting.Lookups`` and what it was last given of a calibrator: its count
    arrays, row table and weights (``set_calibration``), given again when the calibrator has
    added a row (which replaces its arrays) or is another one."""

    __slots__ = ("lookups", "max_match", "recycles", "calibrator", "version")

    def __init__(self, lookups, max_match: int, recycles: bool = False) -> None:
        self.lookups, self.max_match = lookups, max_match
        self.recycles = recycles  # the core holds the recycling table (every successor sink: all are fused)
        self.calibrator, self.version = None, -1

    def sync(self, calibrator: AcceptanceCalibrator) -> bool:
        """Give the core ``calibrator``'s current arrays if they changed; False where it has no
        compiled counts (the reference calibrator, which runs where the extension is not built)."""
        if calibrator is self.calibrator and calibrator.rows_version == self.version:
            return True
        counts = calibrator.merge_counts()
        if counts is None:
            return False
        self.lookups.set_calibration(*counts[2], *calibrator.row_table(FUSED_SOURCES))
        self.calibrator, self.version = calibrator, calibrator.rows_version
        return True


class PlannedDrafts(Sequence):
    """A fused plan's drafts (``Mixture.plan``), in merge order: the ``Draft`` objects are made
    on first read; ``AcceptanceCalibrator.learn`` counts them from the core's copy (``learn``)
    while they are the request's last plan."""

    def __init__(self, packed: tuple, request: FusedRequest, serial: int) -> None:
        self._packed = packed  # bytes: source codes, match lengths (int32), offsets (int64), tokens, parents, scores
        self._drafts: list[Draft] | None = None
        self.request, self.serial = request, serial

    def learn(self, calibrator: AcceptanceCalibrator, committed: list[int]) -> bool:
        """Count these drafts into ``calibrator``'s arrays in the core, as ``learn_drafts``
        would; False (nothing done) where they are not the request's last plan or a draft's
        row is new (the caller then learns from the drafts themselves)."""
        return self.request.sync(calibrator) and self.request.lookups.learn(self.serial, HISTORY_DECAY, committed)

    def _made(self) -> list[Draft]:
        if self._drafts is None:
            codes, matches, offsets, tokens, parents, scores = self._packed
            starts = np.frombuffer(offsets, np.int64).tolist()
            trusted = Draft._trusted
            self._drafts = [
                trusted(None, None, None, FUSED_SOURCES[code], match,
                        packed=(tokens[4 * a:4 * b], parents[4 * a:4 * b], scores[8 * a:8 * b]))
                for code, match, a, b in zip(np.frombuffer(codes, np.int32).tolist(),
                                             np.frombuffer(matches, np.int32).tolist(), starts, starts[1:])]
        return self._drafts

    def __len__(self) -> int:
        return len(self._packed[0]) // 4

    def __getitem__(self, i):
        return self._made()[i]

    def __iter__(self):
        return iter(self._made())
