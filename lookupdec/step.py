"""One decoding step, less the model: the part the engine and the replay simulator share.

    propose  the mixture's drafts for the context (``Mixture.propose``), each of at most
             ``max_nodes`` nodes
    merge    ``TokenTree.from_drafts``: one trie, scores scaled by the calibrator, the best
             ``max_nodes`` nodes kept (ancestors first), at most ``max_depth`` deep; where the
             lookups are all compiled, propose and merge are one compiled call
             (``Mixture.plan``: the same drafts and tree; ``propose_s`` then counts both)
    choose   with a cost model (``EngineConfig.budget == "auto"``): keep the node count that
             maximises expected tokens per second (``budget.choose_tree_nodes``), the gains
             corrected by what recent trees accepted (``StepCore.scale``) and by what this
             request's trees accepted (``StepCore.request_factor``), and prune to it; a
             request's tree is at most as large as its accepted drafts earned (``StepCore.room``)
    verdict  the caller's: the engine verifies the tree with the target and accepts exactly
             (``sampling.accept``); the simulator walks the recorded response. Either returns
             the accepted nodes and the step's new tokens (accepted + one bonus or recovered
             token, cut at EOS, ``max_new_tokens`` or the context's end)
    observe  every proposer sees the new tokens (token recycling the verdict's top tokens along
             the walk)
    learn    the calibrator checks each source's best chain against them (``DraftBudget`` has
             already seen the node count chosen); where the lookups are all compiled, observe
             and learn are one compiled call (``Mixture.finish``)

A request's first new token is no step's: it comes from the logits of the prompt's last token,
computed by the prefill (``first``; ``RequestCore.first``), as ``transformers`` takes it.

``max_nodes`` is the one name of the node budget: ``EngineConfig.max_nodes`` caps it; with a cost
model, ``DraftBudget.nodes`` asks for fewer where fewer were kept lately. Only history enters the
tree (committed tokens, earlier timings), never the verdict's random draws, so sampling stays
exact. Because the engine and ``simulate`` both call ``StepCore.run``, a replayed step is the
served step (``tests/test_step.py`` runs both on one recorded response and compares them).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

from lookupdec.budget import AcceptanceCalibrator, CostModel, DraftBudget, choose_tree_nodes
from lookupdec.mixture import Mixture
from lookupdec.tree import Draft, TokenTree

SCALE_PRIOR = 2.0  # accepted draft tokens behind the initial correction of 1
SCALE_DECAY = 0.95  # per verified tree
SCALE_MIN, SCALE_MAX = 0.2, 1.5
# a request's own correction (``StepCore.request_factor``): its accepted draft tokens over those
# the shared correction predicted for its trees, each sum with this prior added, decayed per step
REQUEST_PRIOR = 2.0
REQUEST_DECAY = 0.95
REQUEST_MIN = 0.02  # the lowest step correction a request's record can bring (shared x its own)
# a request's trees earn their size (``StepCore.room``): at most EARN_BASE draft nodes until its
# drafts are accepted, then EARN_PER more per draft token they accepted (the request's whole count)
EARN_BASE = 1
EARN_PER = 4

@dataclass
class Verdict:
    """What the target (or the recorded response) made of a tree."""

    accepted: list[int]  # accepted draft nodes, root excluded, in path order
    new_tokens: list[int]  # the step's committed tokens: the accepted nodes' + one bonus/recovered, maybe cut
    # token recycling's input, handed over with the observe (``Mixture.finish``): (the token
    # before the root, the walked path's tokens, the target's top tokens after each), or None
    successors: tuple | None = None


@dataclass
class Plan:
    """A step's tree before the verdict (``StepCore.plan``)."""

    tree: TokenTree
    drafts: list[Draft]
    scale: float  # the step's correction when the tree was built: shared x the request's, clipped
    propose_s: float
    tree_s: float
    shared: float = 1.0  # ``StepCore.scale`` then

    @property
    def factor(self) -> float:
        """The request's own correction as applied (``StepCore.request_factor``, clipped)."""
        return self.scale / self.shared


@dataclass
class StepResult:
    tree: TokenTree  # the tree verified (after choosing and pruning)
    drafts: list[Draft]  # every source's drafts, before the merge
    accepted: list[int]  # accepted nodes whose tokens were committed (cut like new_tokens)
    new_tokens: list[int]
    propose_s: float  # proposers' time
    tree_s: float  # merge + choose + prune
    promised: float = 0.0  # sum of the tree's nodes' calibrated probabilities of being reached
    scale: float = 1.0  # the step's correction of them (``StepCore.scale``)

    @property
    def predicted(self) -> float:
        """Accepted draft tokens the tree promised the chooser, to set against ``len(accepted)``."""
        return self.promised * self.scale

    def count_sources(self, accepted_by_source: dict, nodes_by_source: dict | None = None) -> None:
        """Add this step's accepted (and verified) draft nodes per source to the dicts."""
        for node in self.accepted:
            source = self.tree.sources[node]
            accepted_by_source[source] = accepted_by_source.get(source, 0) + 1
        if nodes_by_source is not None:
            for source in self.tree.sources[1:]:
                nodes_by_source[source] = nodes_by_source.get(source, 0) + 1


class StepCore:
    """The model-free part of a step for one mixture of proposers, kept across requests (the
    calibrator and the draft budget learn from every step)."""

    def __init__(self, mixture: Mixture, *, max_nodes: int, calibrator: AcceptanceCalibrator | None,
                 draft_budget: DraftBudget | None = None, chain_only: bool = False) -> None:
        self.mixture = mixture
        self.max_nodes = max_nodes  # cap on draft nodes per step (EngineConfig.max_nodes)
        self.calibrator = calibrator  # None: scores as proposed, nothing learnt
        self.draft_budget = draft_budget or DraftBudget()  # nodes asked when a cost model chooses
        self.chain_only = chain_only  # verify only the best chain (a model without tree masks)
        # decayed sums of the accepted draft tokens trees promised and those accepted (whole steps)
        self._promised = self._accepted = SCALE_PRIOR
        # per request: decayed sums of the accepted draft tokens the shared correction predicted
        # for its trees and those accepted (``request_factor``)
        self._requests: dict[str, list[float]] = {}
        # whether anything proposes (``EngineConfig(proposers=())``: plain decoding, every tree the root)
        self.drafts = bool(mixture.proposers)

    def start(self, request_id: str, prompt_ids: Sequence[int], params=None, seed=None) -> None:
        self.mixture.start(request_id, prompt_ids, params, seed)
        self._requests[request_id] = [0.0, 0.0, 0]

    def stop(self, request_id: str) -> None:
        self.mixture.stop(request_id)
        self._requests.pop(request_id, None)

    def first(self, request_id: str, new_tokens: Sequence[int], successors: tuple | None = None) -> None:
        """A request's first token, taken from its prefill's logits (no tree, no step): every
        proposer observes it (token recycling the prompt's last row, ``successors``); nothing was
        verified, so nothing is learnt."""
        self.mixture.finish(request_id, new_tokens, successors)

    def run(self, request_id: str, context: Sequence[int], verdict: Callable[[TokenTree], Verdict], *,
            max_depth: int, cost: CostModel | None = None, overhead_s: float = 0.0) -> StepResult:
        """One step: propose, merge, choose, ``verdict(tree)``, observe, learn. ``context`` (the
        prompt and the output so far) is not changed: the caller appends ``new_tokens``."""
        plan = self.plan(request_id, context, max_depth=max_depth, cost=cost, overhead_s=overhead_s)
        return self.finish(request_id, plan, verdict(plan.tree))

    def plan(self, request_id: str, context: Sequence[int], *, max_depth: int, cost: CostModel | None = None,
             overhead_s: float = 0.0, max_nodes: int | None = None) -> "Plan":
        """Propose, merge and (with ``cost``) choose: the tree to verify. Without ``cost`` the tree
        keeps up to ``max_nodes`` nodes (default: the step's cap), for a caller that chooses
        itself (the batched step's joint budget, ``batch.py``)."""
        t0 = time.perf_counter()
        if not self.drafts:  # nothing proposes: the root alone, nothing merged or chosen
            return Plan(TokenTree([context[-1]], [-1]), [], 1.0, propose_s=0.0, tree_s=0.0)
        shared = self.scale
        scale = min(SCALE_MAX, max(REQUEST_MIN, shared * self.request_factor(request_id)))
        if max_nodes is None:
            max_nodes = self.draft_budget.nodes(self.max_nodes) if cost is not None else self.max_nodes
            if cost is not None:
                max_nodes = min(max_nodes, self.room(request_id))
        elif cost is None:  # the batched step's own budget: the same room per request
            max_nodes = min(max_nodes, self.room(request_id))
        fused = (self.mixture.plan(request_id, context, max_nodes, max_depth, self.calibrator)
                 if self.calibrator is not None and self.mixture.fused else None)
        if fused is not None:  # drafts and merge in one compiled call: propose_s counts both
            merged, drafts = fused
            t1 = time.perf_counter()
        else:
            drafts = self.mixture.propose(request_id, context, max_nodes)
            t1 = time.perf_counter()
            # (the calibrator itself: the compiled merge computes only the cells it reads)
            merged = TokenTree.from_drafts(context[-1], drafts, max_nodes=max_nodes, max_depth=max_depth,
                                           calibration=self.calibrator)
        tree = self.select(merged, max_nodes=max_nodes, cost=cost, overhead_s=overhead_s, scale=scale)
        return Plan(tree, drafts, scale, propose_s=t1 - t0, tree_s=time.perf_counter() - t1, shared=shared)

    def finish(self, request_id: str, plan: "Plan", judged: Verdict) -> StepResult:
        """After the verdict on ``plan.tree``: every proposer observes the new tokens, the
        calibrator learns, the scale and the request's record move."""
        tree = plan.tree
        if not self.drafts:  # nothing proposes, so nothing observes or learns
            return StepResult(tree, [], [], judged.new_tokens, propose_s=0.0, tree_s=0.0)
        self.mixture.finish(request_id, judged.new_tokens, judged.successors, plan.drafts, self.calibrator)
        promised = tree.expected_total() if tree.num_draft_nodes else 0.0
        record = self._requests.get(request_id)
        if tree.num_draft_nodes:
            accepted = len(judged.accepted)
            self._promised = SCALE_DECAY * self._promised + promised
            self._accepted = SCALE_DECAY * self._accepted + accepted
            if record is not None:
                record[0] = REQUEST_DECAY * record[0] + promised * plan.shared
                record[1] = REQUEST_DECAY * record[1] + accepted
                record[2] += accepted
        else:  # nothing verified, nothing learnt: drift back towards 1, or a low scale would stick
            self._promised = SCALE_DECAY * self._promised + (1 - SCALE_DECAY) * SCALE_PRIOR
            self._accepted = SCALE_DECAY * self._accepted + (1 - SCALE_DECAY) * SCALE_PRIOR
            if record is not None:  # the request's record fades alike: a request that stopped drafting tries again
                record[0] *= REQUEST_DECAY
                record[1] *= REQUEST_DECAY
        return StepResult(tree, plan.drafts, judged.accepted[: len(judged.new_tokens)], judged.new_tokens,
                          propose_s=plan.propose_s, tree_s=plan.tree_s, promised=promised, scale=plan.scale)

    @property
    def scale(self) -> float:
        """What the chooser multiplies the tree's expected gains by: accepted over promised on
        recent verified trees (decayed, in ``[SCALE_MIN, SCALE_MAX]``). The cells calibrate each
        node alone; this corrects what they miss together (sources that disagree at a position
        are each right less often than their own record says)."""
        return min(SCALE_MAX, max(SCALE_MIN, self._accepted / self._promised))

    def request_factor(self, request_id: str) -> float:
        """The request's own correction on top of ``scale``: the draft tokens its trees accepted
        over those ``scale`` predicted for them (decayed sums, ``REQUEST_PRIOR`` added to each;
        1 for a request not started). The shared correction learns from every request and moves
        slowly: a request whose drafts keep failing where others' succeed (a translation whose
        answer never copies its prompt) would verify trees for its whole length before the shared
        sums noticed. Steps without a tree fade the record as the shared one fades, so a request
        that stopped drafting on a few unlucky steps tries again."""
        record = self._requests.get(request_id)
        if record is None:
            return 1.0
        return (record[1] + REQUEST_PRIOR) / (record[0] + REQUEST_PRIOR)

    def room(self, request_id: str) -> int:
        """The most draft nodes the request's next tree may keep when a cost model chooses (or the
        batched step's joint budget): ``EARN_BASE`` plus ``EARN_PER`` per draft token its trees
        have accepted so far (the step's cap for a request not started). A request's first trees
        are predicted from other requests' records alone, and an answer that copies nothing (a
        translation, a short reply) pays for every node it verifies: a 15-node tree that accepts
        nothing costs most of a token on this CPU's curve, a large share of a 13-token answer.
        Trees grow as fast as their drafts are accepted, so a copying request reaches full size
        within a few steps."""
        record = self._requests.get(request_id)
        if record is None:
            return self.max_nodes
        return min(self.max_nodes, EARN_BASE + EARN_PER * record[2])

    def select(self, tree: TokenTree, *, max_nodes: int, cost: CostModel | None, overhead_s: float,
               scale: float = 1.0) -> TokenTree:
        """The merged tree's nodes worth verifying: its best chain alone (``chain_only``), and
        with ``cost`` the node count ``choose_tree_nodes`` picks for gains times ``scale``
        (``CostModel.explore`` now and then another)."""
        if self.chain_only:
            tree = tree.best_chain()
        if cost is not None and tree.num_draft_nodes:
            available = min(tree.num_draft_nodes, max_nodes)
            chosen = choose_tree_nodes(tree, cost, overhead_s, max_nodes, scale)
            tree = tree.prune(cost.explore(chosen, available))
            self.draft_budget.observe(tree.num_draft_nodes)
        return tree
