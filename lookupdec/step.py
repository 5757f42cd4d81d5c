"""One decoding step, less the model: the part the engine and the replay simulator share.

    propose  the mixture's drafts for the context (``Mixture.propose``), each of at most
             ``max_nodes`` nodes
    merge    ``TokenTree.from_drafts``: one trie, scores scaled by the calibrator, the best
             ``max_nodes`` nodes kept (ancestors first), at most ``max_depth`` deep; where the
             lookups are all compiled, propose and merge are one compiled call
             (``Mixture.plan``: the same drafts and tree; ``propose_s`` then counts both)
    choose   with a cost model (``EngineConfig.budget == "auto"``): keep the node count that
             maximises expected tokens per second (``budget.choose_tree_nodes``), each count's
             gains corrected by what trees of that size accepted (``budget.SizeRecord``; where
             it has little, what recent trees accepted: ``StepCore.scale``) and by what this
             request's trees accepted (``StepCore.request_factor``), and prune to it
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
from dataclasses import dataclass, field
from typing import Callable, Sequence

from lookupdec.budget import SIZE_DECAY, AcceptanceCalibrator, CostModel, DraftBudget, SizeRecord, choose_tree_nodes
from lookupdec.mixture import Mixture
from lookupdec.native import tree as _core  # the compiled core's tree submodule, None where not built
from lookupdec.tree import Draft, TokenTree

SCALE_PRIOR = 2.0  # accepted draft tokens behind the initial correction of 1
SCALE_DECAY = 0.95  # per verified tree
SCALE_MIN, SCALE_MAX = 0.2, 1.5
# a request's own correction (``StepCore.request_factor``): its accepted draft tokens over those
# the shared correction predicted for its trees, each sum with this prior added, decayed per step
REQUEST_PRIOR = 2.0
REQUEST_DECAY = 0.95
REQUEST_MIN = 0.02  # the lowest step correction a request's record can bring (shared x its own)
# the chooser's smallest candidate sizes whose hindsight every step adds to the size records
# (``StepCore.sizes``): the first this many nodes of the merged tree in prune order
SHADOW_NODES = 8


def hindsight(tokens: Sequence[int], parents: Sequence[int], depth: Sequence[int],
              committed: Sequence[int]) -> tuple[list[int] | None, int]:
    """A ``Shadow``'s nodes (node 0 the root, then the draft nodes in prune order, every parent
    before its children): per prefix size ``k`` (0 .. ``len(tokens) - 1``), the draft tokens a
    tree of the first ``k`` nodes would have accepted, were ``committed`` the target's tokens
    after the root (the deepest node of the prefix whose whole path matches them); and 0. Or
    (None, the number of committed tokens needed before it can tell) while a path matches all of
    them and goes deeper.

    >>> hindsight([9, 5, 7, 6], [-1, 0, 1, 0], [0, 1, 2, 1], [5, 7, 1])
    ([0, 1, 2, 2], 0)
    >>> hindsight([9, 5, 7, 6], [-1, 0, 1, 0], [0, 1, 2, 1], [5])   # node 2 waits for a second token
    (None, 2)
    """
    known = len(committed)
    matched = [False] * len(tokens)
    matched[0] = True
    out, best = [0], 0
    for node in range(1, len(tokens)):
        if matched[parents[node]]:
            d = depth[node]
            if d > known:
                return None, d
            if tokens[node] == committed[d - 1]:
                matched[node] = True
                if d > best:
                    best = d
        out.append(best)
    return out, 0


@dataclass
class Shadow:
    """A step's smallest candidate sizes, kept until their hindsight is known (``hindsight``): the
    root and the first ``SHADOW_NODES`` draft nodes of the merged tree in prune order, renumbered
    in that order (``tokens``, ``parents``, ``depth``), the gains the chooser added up for each
    prefix size (``gains[k]``, before the corrections), the request's factor then, and the tokens
    committed since (``needed``: how many before ``hindsight`` is worth asking again)."""

    tokens: list[int]
    parents: list[int]
    depth: list[int]
    gains: list[float]
    factor: float
    committed: list[int] = field(default_factory=list)
    needed: int = 0

    def __len__(self) -> int:
        return len(self.tokens)

    def lists(self) -> tuple:
        return self.tokens, self.parents, self.depth, self.gains

    @classmethod
    def of(cls, tree: TokenTree, factor: float, nodes: int = SHADOW_NODES) -> "Shadow | None":
        """The tree's shadow; None where a prefix of its prune order does not hold its nodes'
        parents (a prefix is then not what ``prune`` keeps). For a tree the compiled core holds,
        the core's (``_core.Tree.shadow``: a ``_core.Shadow``, the same ``lists()``, ``factor``
        and length, kept in the core for ``_core.ShadowBook``)."""
        core = tree.__dict__.get("_core")
        if core is not None and hasattr(core, "shadow"):
            return core.shadow(nodes, factor)
        return cls.of_reference(tree, factor, nodes)

    @classmethod
    def of_reference(cls, tree: TokenTree, factor: float, nodes: int = SHADOW_NODES) -> "Shadow | None":
        """``of`` by its definition, from the tree's lists."""
        order = tree.prune_order()[: max(nodes, 0)]
        local = {0: 0}
        tokens, parents, depth, gains, total = [tree.token_ids[0]], [-1], [0], [0.0], 0.0
        for node in order:
            parent = local.get(tree.parents[node])
            if parent is None:
                return None
            local[node] = len(tokens)
            tokens.append(tree.token_ids[node])
            parents.append(parent)
            depth.append(tree.depth[node])
            total += tree.expected[node]
            gains.append(total)
        return cls(tokens, parents, depth, gains, factor)


class SizeHindsight:
    """The size records (``budget.SizeRecord``) learn from every candidate size of a step, not only
    the one verified: corrections fitted on verified trees alone are fitted where the chooser's
    promise was high (it verifies more nodes when its gains look large, and looked larger than
    they were), and weak trees, verified seldom, were corrected down with them (SmolLM2's greedy
    outputs replayed, ``bench/cost_replay.py``: the 4-node trees of steps that verified the root
    alone promised 0.03-0.08 tokens after the corrections and would have accepted 0.15-0.32). So
    each step's smallest candidates (``Shadow``) wait for the tokens committed after them, and when
    those tell what each prefix size would have accepted (``hindsight``), every one of those sizes'
    records adds it, at the step when it is known. The step itself counts at its own finish
    (``SizeRecord.tick``); a size past the shadow's is recorded when verified, as before. A request
    stopped before its last steps are known drops them.

    ``backend``: "auto" (the pending shadows and their hindsight in the compiled core,
    ``_core.ShadowBook``, where it is built) or "reference" (this class's Python: the definition;
    the two leave the record's table bit for bit alike, ``tests/test_step.py``)."""

    def __init__(self, backend: str = "auto") -> None:
        if backend not in ("auto", "reference"):
            raise ValueError(f"SizeHindsight: backend must be 'auto' or 'reference', not {backend!r}")
        compiled = backend == "auto" and _core is not None and hasattr(_core, "ShadowBook")
        self.book = _core.ShadowBook() if compiled else None
        self.pending: dict[str, list[Shadow]] = {}  # (reference) per request: the steps not known yet, oldest first

    def capture(self, tree: TokenTree, factor: float) -> "Shadow | None":
        """A step's candidates (``Shadow.of``), compiled or not as this book keeps them."""
        if self.book is None:
            return Shadow.of_reference(tree, factor)
        shadow = Shadow.of(tree, factor)
        if isinstance(shadow, Shadow):  # a tree in Python lists: its shadow handed to the core
            shadow = _core.Shadow(*shadow.lists(), factor)
        return shadow

    def waiting(self, request_id: str) -> bool:
        """Whether shadows of the request wait for its next tokens."""
        return bool(self.book.waiting(request_id)) if self.book is not None else request_id in self.pending

    def observe(self, sizes: SizeRecord, request_id: str, shadow, new_tokens: Sequence[int]) -> None:
        """A step of ``request_id`` committed ``new_tokens``; ``shadow``: its candidates (None: the
        step chose nothing, e.g. a batch's row)."""
        if shadow is not None:
            sizes.tick()
            if len(sizes.table) < len(shadow):
                sizes.grow(len(shadow))
        if self.book is not None:
            self.book.observe(sizes.table, float(sizes.steps), request_id, shadow, new_tokens, SIZE_DECAY)
            return
        pending = self.pending.setdefault(request_id, [])
        if shadow is not None:
            pending.append(shadow)
        kept = []
        for entry in pending:
            entry.committed += new_tokens
            if len(entry.committed) < entry.needed:
                kept.append(entry)
                continue
            accepted, entry.needed = hindsight(entry.tokens, entry.parents, entry.depth, entry.committed)
            if accepted is None:
                kept.append(entry)
                continue
            for k in range(1, len(accepted)):
                sizes.add(k + 1, promised=entry.gains[k] * entry.factor, accepted=accepted[k])
        if kept:
            self.pending[request_id] = kept
        else:
            del self.pending[request_id]

    def drop(self, request_id: str) -> None:
        if self.book is not None:
            self.book.drop(request_id)
        self.pending.pop(request_id, None)


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
    factor: float = 1.0  # ``scale / shared``: the request's own correction as applied (``request_factor``, clipped)
    shadow: "Shadow | None" = None  # the chooser's candidates, for their hindsight (a step that chose; or a _core.Shadow)


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
        # the same per tree size (the batch's re-drafted trees count too): the chooser corrects
        # each candidate size by its own
        self.sizes = SizeRecord()
        # per request: decayed sums of the accepted draft tokens the shared correction predicted
        # for its trees and those accepted (``request_factor``)
        self._requests: dict[str, list[float]] = {}
        # the size records also learn each step's smallest candidate sizes, once known (``SizeHindsight``)
        self.hindsight = SizeHindsight()

    def start(self, request_id: str, prompt_ids: Sequence[int], params=None, seed=None) -> None:
        self.mixture.start(request_id, prompt_ids, params, seed)
        self._requests[request_id] = [0.0, 0.0]

    def stop(self, request_id: str) -> None:
        self.mixture.stop(request_id)
        self._requests.pop(request_id, None)
        self.hindsight.drop(request_id)

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
        shared = self.scale
        scale = min(SCALE_MAX, max(REQUEST_MIN, shared * self.request_factor(request_id)))
        if max_nodes is None:
            max_nodes = self.draft_budget.nodes(self.max_nodes) if cost is not None else self.max_nodes
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
        factor = scale / shared
        shadow = (self.hindsight.capture(merged, factor)
                  if cost is not None and not self.chain_only and merged.num_draft_nodes else None)
        tree = self.select(merged, max_nodes=max_nodes, cost=cost, overhead_s=overhead_s, scale=shared, factor=factor)
        return Plan(tree, drafts, scale, propose_s=t1 - t0, tree_s=time.perf_counter() - t1, shared=shared,
                    factor=factor, shadow=shadow)

    def finish(self, request_id: str, plan: "Plan", judged: Verdict) -> StepResult:
        """After the verdict on ``plan.tree``: every proposer observes the new tokens, the
        calibrator learns, the scale moves."""
        tree = plan.tree
        self.mixture.finish(request_id, judged.new_tokens, judged.successors, plan.drafts, self.calibrator)
        promised = tree.expected_total() if tree.num_draft_nodes else 0.0
        record = self._requests.get(request_id)
        if plan.shadow is not None or self.hindsight.waiting(request_id):  # (first: the step counts, then its sizes)
            self.hindsight.observe(self.sizes, request_id, plan.shadow, judged.new_tokens)
        if tree.num_draft_nodes:
            accepted = len(judged.accepted)
            self._promised = SCALE_DECAY * self._promised + promised
            self._accepted = SCALE_DECAY * self._accepted + accepted
            if plan.shadow is None:  # (a size's record: what the request's correction left to correct)
                self.sizes.observe(len(tree), promised=promised * plan.factor, accepted=accepted)
            elif tree.num_draft_nodes >= len(plan.shadow):  # past the shadow's sizes: this one, verified
                self.sizes.add(len(tree), promised=promised * plan.factor, accepted=accepted)
            if record is not None:
                record[0] = REQUEST_DECAY * record[0] + promised * plan.shared
                record[1] = REQUEST_DECAY * record[1] + accepted
        else:  # nothing verified, nothing learnt: drift back towards 1, or a low scale would stick
            self._promised = SCALE_DECAY * self._promised + (1 - SCALE_DECAY) * SCALE_PRIOR
            self._accepted = SCALE_DECAY * self._accepted + (1 - SCALE_DECAY) * SCALE_PRIOR
            if record is not None:  # the request's record fades alike, so a request that stopped drafting tries again
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
        slowly: a request whose drafts keep failing where others' succeed (SmolLM2, a translation
        whose prompt its answer never copies: 0.09 accepted a step where 0.9 were predicted)
        verified trees for its whole length before the shared sums noticed. The step's correction
        is ``scale`` times this, clipped to ``[REQUEST_MIN, SCALE_MAX]`` (the chooser multiplies
        each size's record by it). Steps without a tree fade the record as the shared one fades:
        a request that stopped drafting on a few unlucky steps tries again (without the fade, chat and
        QA requests that had stopped so ran slower than a fixed 4-node budget; with it, close to
        that budget's speed)."""
        record = self._requests.get(request_id)
        if record is None:
            return 1.0
        return (record[1] + REQUEST_PRIOR) / (record[0] + REQUEST_PRIOR)

    def select(self, tree: TokenTree, *, max_nodes: int, cost: CostModel | None, overhead_s: float,
               scale: float = 1.0, factor: float = 1.0) -> TokenTree:
        """The merged tree's nodes worth verifying: its best chain alone (``chain_only``), and
        with ``cost`` the node count ``choose_tree_nodes`` picks (each size's gains corrected by
        its record, ``scale`` where it has little, times the request's ``factor``)."""
        if self.chain_only:
            tree = tree.best_chain()
        if cost is not None and tree.num_draft_nodes:
            available = min(tree.num_draft_nodes, max_nodes)
            chosen = choose_tree_nodes(tree, cost, overhead_s, max_nodes, scale, record=self.sizes, factor=factor)
            tree = tree.prune(cost.explore(chosen, available))
            self.draft_budget.observe(tree.num_draft_nodes)
        return tree
