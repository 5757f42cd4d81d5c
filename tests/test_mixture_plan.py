"""``Mixture.plan``: the compiled lookups' drafts and their merge in one call (``native.drafting.Lookups``)
must give, step after step, exactly what ``Mixture.propose`` and ``TokenTree.from_drafts`` give
apart: the same drafts in the same order, the same tree (tokens, parents, sources, scores,
expected gains, prune order), the same pending chains for the suffix proposer's certain-step
estimates. Two twins (the fused path and the one apart) are driven through the same records,
each learning from its own steps, with the global suffix cache and the recycling table filled
as the engine fills them."""
from __future__ import annotations

import copy
import random

import numpy as np
import pytest

from lookupdec import EngineConfig
from lookupdec.automaton import compiled_available
from lookupdec.budget import AcceptanceCalibrator
from lookupdec.mixture import FUSED_SOURCES, Mixture
from lookupdec.proposers import build_proposers
from lookupdec.proposers.ngram import NgramProposer
from lookupdec.proposers.recycle import RecycleProposer
from lookupdec.proposers.suffix import SuffixProposer
from lookupdec.simulate import recorded_verdict
from lookupdec.step import StepCore, Verdict
from lookupdec.tree import TokenTree

pytestmark = pytest.mark.skipif(not compiled_available(), reason="the compiled core is not built")

CONFIG = EngineConfig()  # the default lookups: n-gram, suffix, recycling


def record(rng: random.Random, vocab: int, length: int) -> list[int]:
    """Tokens that repeat as logs and edits do: fresh runs and copies of earlier spans, some
    with a token changed."""
    out = [rng.randrange(vocab) for _ in range(8)]
    while len(out) < length:
        if rng.random() < 0.35:
            out += [rng.randrange(vocab) for _ in range(rng.randrange(1, 6))]
        else:
            start = rng.randrange(len(out))
            span = out[start:start + rng.randrange(3, 25)]
            if span and rng.random() < 0.3:
                span[rng.randrange(len(span))] = rng.randrange(vocab)
            out += span
    return out[:length]


def tree_state(tree: TokenTree) -> tuple:
    return (list(tree.token_ids), list(tree.parents), list(tree.sources), list(tree.scores), list(tree.expected),
            list(tree.cells), list(tree.conds), list(tree.point_mass), list(tree.depth), list(tree.prune_order()))


def counts(calibrator: AcceptanceCalibrator) -> tuple:
    """The calibrator's three count arrays (what its learn writes)."""
    return calibrator._reached, calibrator._predicted, calibrator._matched


def draft_state(drafts) -> list[tuple]:
    return [(d.source, d.match_length, d.packed()) for d in drafts]


class Twin:
    def __init__(self, fused: bool, config: EngineConfig = CONFIG) -> None:
        self.calibrator = AcceptanceCalibrator()
        self.mixture = Mixture(build_proposers(config), calibrator=self.calibrator)
        self.mixture.fused = fused and self.mixture.fused
        self.core = StepCore(self.mixture, max_nodes=CONFIG.max_nodes, calibrator=self.calibrator)
        self.suffix = next((p for p in self.mixture.lookups if isinstance(p, SuffixProposer)), None)

    def pending(self, rid: str) -> dict:
        """The chains waiting for the step's tokens (the suffix proposer's ``pending``, or for a
        fused request the core's), and the certain-step estimates, bit for bit."""
        if self.suffix is None:
            return {}
        pending = dict(self.suffix._requests.get(rid).pending)
        fused = self.mixture._fused.get(rid)
        if fused is not None:
            assert not pending  # the fused steps leave theirs in the core
            pending = {FUSED_SOURCES[code]: (chain, certain) for code, chain, certain in fused.lookups.pending()}
        return {**pending, "estimates": self.suffix._certain.tobytes()}


def drive(seed: int, records: int = 4, vocab: int = 60, length: int = 220, max_nodes: int = 64,
          max_depth: int = 64, config: EngineConfig = CONFIG) -> int:
    """Both twins through ``records`` prompt/response pairs; every step compared. Returns the
    steps compared."""
    rng = random.Random(seed)
    fused, apart = Twin(True, config), Twin(False, config)
    assert fused.mixture.fused and not apart.mixture.fused
    steps = 0
    for r in range(records):
        stream = record(rng, vocab, length)
        cut = rng.randrange(20, length // 2)
        prompt, response = stream[:cut], stream[cut:]
        rid = f"r{r}"
        for twin in (fused, apart):
            twin.core.start(rid, prompt)
            twin.core.first(rid, response[:1])
        context = prompt + response[:1]
        while len(context) - len(prompt) < len(response):
            rest = response[len(context) - len(prompt):]
            nodes = rng.choice([0, 1, 3, 8, 24, max_nodes])
            plans = [twin.core.plan(rid, context, max_depth=max_depth, max_nodes=nodes) for twin in (fused, apart)]
            assert draft_state(plans[0].drafts) == draft_state(plans[1].drafts), f"seed {seed} step {steps}: drafts"
            assert tree_state(plans[0].tree) == tree_state(plans[1].tree), f"seed {seed} step {steps}: tree"
            assert fused.pending(rid) == apart.pending(rid), f"seed {seed} step {steps}: pending chains"
            verdicts = [recorded_verdict(plan.tree, rest) for plan in plans]
            # the recycling table learns the "target's" top tokens at the visited nodes, handed
            # over with the observe as Engine._verdict hands them (Verdict.successors), the same
            # for both twins
            visited = [0, *verdicts[0].accepted]
            tokens = [plans[0].tree.token_ids[u] for u in visited]
            tops = [[rng.randrange(vocab) for _ in range(CONFIG.recycle.successors)] for _ in visited]
            successors = (context[-2] if len(context) > 1 else -1, tokens, tops) if fused.mixture.successor_sinks else None
            for twin, plan, verdict in zip((fused, apart), plans, verdicts):
                twin.core.finish(rid, plan, Verdict(verdict.accepted, verdict.new_tokens, successors))
            assert fused.pending(rid) == apart.pending(rid), f"seed {seed} step {steps}: settled estimates"
            for a, b in zip(counts(fused.calibrator), counts(apart.calibrator)):
                assert a.tobytes() == b.tobytes(), f"seed {seed} step {steps}: learnt counts"
            context += verdicts[0].new_tokens
            steps += 1
        for twin in (fused, apart):
            twin.core.stop(rid)  # the output joins the global suffix cache
    assert fused.suffix is None or fused.suffix.global_tokens > 0
    return steps


@pytest.mark.parametrize("seed", range(6))
def test_fused_plan_equals_propose_and_merge(seed):
    assert drive(seed) > 50


def test_fused_plan_with_small_budgets_and_depths():
    assert drive(11, records=2, max_nodes=5, max_depth=2) > 20


@pytest.mark.parametrize("proposers", [("ngram", "suffix"), ("suffix", "recycle", "ngram"), ("recycle",),
                                       ("ngram",), ("suffix",)])
def test_fused_plan_with_other_lookups_in_any_order(proposers):
    assert drive(21, records=3, config=EngineConfig(proposers=proposers)) > 30


def test_the_step_takes_the_fused_plan(monkeypatch):
    """With the default lookups the step never calls ``propose``, the proposers' own
    ``observe``, the recycling table's ``observe_path`` nor ``AcceptanceCalibrator.learn`` (a
    mutant StepCore that ignores ``Mixture.plan``, or a ``Mixture.finish`` that falls back, fails
    here); with ``fused`` off it does. Either way the recycling table gets the walk's tokens."""
    observed = []
    for cls in (NgramProposer, SuffixProposer):
        monkeypatch.setattr(cls, "observe", lambda self, rid, ids, f=cls.observe: observed.append(1) or f(self, rid, ids))
    monkeypatch.setattr(RecycleProposer, "observe_path",
                        lambda self, *a, f=RecycleProposer.observe_path: observed.append(2) or f(self, *a))
    monkeypatch.setattr(AcceptanceCalibrator, "learn",
                        lambda self, *a, f=AcceptanceCalibrator.learn: observed.append(3) or f(self, *a))
    for fused in (True, False):
        twin = Twin(fused)
        calls = []
        observed.clear()
        propose = twin.mixture.propose
        twin.mixture.propose = lambda *a, **k: calls.append(1) or propose(*a, **k)
        context = [1, 2, 3, 1, 2]
        twin.core.start("r", context)
        for step in range(6):  # (steps whose drafts add calibrator rows learn apart: the first five)
            plan = twin.core.plan("r", context, max_depth=8)
            verdict = recorded_verdict(plan.tree, [3, 1, 2, 3, 1, 2])
            visited = plan.tree.tokens_of([0, *verdict.accepted])
            twin.core.finish("r", plan, Verdict(verdict.accepted, verdict.new_tokens,
                                                (context[-2], visited, [[9, 4, 1]] * len(visited))))
            context = context + verdict.new_tokens
            assert (1 not in observed and 2 not in observed) == fused, observed
            if step < 5:
                observed.clear()
        assert (len(calls) == 0) == fused
        assert (len(observed) == 0) == fused, observed
        recycle = next(p for p in twin.mixture.lookups if isinstance(p, RecycleProposer))
        assert recycle._table.num_pairs() >= 2


def test_plan_applies_only_where_every_part_is_compiled(monkeypatch):
    from lookupdec.proposers import ngram
    from lookupdec.reference import budget as reference_budget

    calibrator = AcceptanceCalibrator()
    context = [1, 2, 3, 1, 2]
    # a lookup on its reference (the request's n-gram index made as without the core): no fused plan
    mixture = Mixture([NgramProposer(CONFIG.ngram), SuffixProposer(CONFIG.suffix)])
    with monkeypatch.context() as patch:
        patch.setattr(ngram, "native_drafting", None)
        mixture.start("r", context)
    assert mixture.plan("r", context, 8, 8, calibrator) is None
    # the reference calibrator, negative budgets
    mixture = Mixture(build_proposers(CONFIG))
    mixture.start("r", context)
    assert mixture.plan("r", context, 8, 8, reference_budget.AcceptanceCalibrator()) is None
    assert mixture.plan("r", context, -1, 8, calibrator) is None
    assert mixture.plan("r", context, 8, 8, calibrator) is not None
    # a draft model joins: off for the mixture
    assert not Mixture(build_proposers(CONFIG), draft=object()).fused
    # a request stopped is forgotten
    mixture.stop("r")
    assert mixture.plan("r", context, 8, 8, calibrator) is None


def test_plan_reports_misuse_as_the_proposers_do():
    mixture = Mixture([NgramProposer(CONFIG.ngram), SuffixProposer(CONFIG.suffix), RecycleProposer(CONFIG.recycle)])
    calibrator = AcceptanceCalibrator()
    mixture.start("r", [1, 2, 3])
    with pytest.raises(ValueError, match="'r' saw 3 tokens, context has 4"):
        mixture.plan("r", [1, 2, 3, 4], 8, 8, calibrator)  # observe() missed
    with pytest.raises(ValueError, match=r"\[0, 2\*\*31 - 1\]"):
        mixture.observe("r", [2**31])  # rejected: nothing kept
    with pytest.raises(ValueError, match=r"\[0, 2\*\*31 - 1\]"):
        mixture.observe("r", [4, -1])  # the compiled observe checks every id first
    assert [p.compiled_lookup("r")[0].size() for p in mixture.lookups[:2]] == [3, 3]
    assert mixture.plan("r", [1, 2, 3], 8, 8, calibrator) is not None
    with pytest.raises(ValueError, match=r"\[0, 2\*\*31 - 1\]"):
        mixture.plan("r", [1, 2, 2**31], 8, 8, calibrator) or mixture.propose("r", [1, 2, 2**31], 8)


def test_fused_sources_are_the_proposers_names():
    """The compiled plan names its drafts' sources by code: the proposers' own names."""
    assert FUSED_SOURCES == (NgramProposer.name, SuffixProposer.name, "suffix-global", RecycleProposer.name)
    suffix = SuffixProposer()
    assert set(suffix.certain_step) == {"suffix", "suffix-global"}


def test_row_table_follows_new_rows():
    calibrator = AcceptanceCalibrator()
    rows, sources = calibrator.row_table(FUSED_SOURCES)
    assert rows == [-1] * 32 and sources == [-1] * 4
    mixture = Mixture(build_proposers(CONFIG), calibrator=calibrator)
    core = StepCore(mixture, max_nodes=16, calibrator=calibrator)
    context = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    core.start("r", context)
    plan = core.plan("r", context, max_depth=8)
    core.finish("r", plan, recorded_verdict(plan.tree, [7, 8, 5]))
    rows, sources = calibrator.row_table(FUSED_SOURCES)
    assert rows != [-1] * 32 and np.count_nonzero(np.array(rows) >= 0) == len(calibrator._rows)
    assert sources[:2] == [calibrator._sources.get("ngram", -1), calibrator._sources.get("suffix", -1)]


def test_planned_drafts_learn_in_the_core_as_the_drafts_do():
    """``AcceptanceCalibrator.learn`` of a fused plan's drafts counts them in the core
    (``Lookups.learn``): the same arrays, bit for bit, as learning from the ``Draft`` objects;
    a plan that is no longer the request's last, or a draft whose row is new, is learnt from
    the drafts themselves."""
    twin = Twin(True)
    rng = random.Random(3)
    stream = record(rng, 40, 200)
    context, committed = stream[:150], stream[150:160]
    twin.core.start("r", context)
    first = twin.core.plan("r", context, max_depth=64).drafts
    assert first.learn(twin.calibrator, committed) is False  # rows not made yet
    twin.calibrator.learn(first, committed)  # makes them (from the drafts)
    stale = twin.core.plan("r", context, max_depth=64).drafts
    drafts = twin.core.plan("r", context, max_depth=64).drafts
    assert len(drafts) >= 3 and {d.source for d in drafts} >= {"ngram", "suffix"}
    assert stale.learn(twin.calibrator, committed) is False  # not the last plan
    clone = copy.deepcopy(twin.calibrator)
    assert drafts.learn(twin.calibrator, committed) is True
    clone.learn(list(drafts), committed)
    for a, b in zip(counts(twin.calibrator), counts(clone)):
        assert a.tobytes() == b.tobytes()
    assert np.count_nonzero(counts(twin.calibrator)[2]) > 0


def test_interleaved_requests_share_the_calibrator():
    """Two requests stepped in turn, as a batch steps its rows: a row one request's learn adds
    replaces the calibrator's arrays under the other's plan (``FusedRequest.sync`` gives the core
    the new ones); trees and drafts stay those of the path apart."""
    rng = random.Random(7)
    fused, apart = Twin(True), Twin(False)
    streams = {rid: record(rng, 50, 200) for rid in ("a", "b")}
    contexts, responses = {}, {}
    for rid, stream in streams.items():
        contexts[rid], responses[rid] = stream[:60], stream[60:]
        for twin in (fused, apart):
            twin.core.start(rid, contexts[rid])
    steps = 0
    while all(len(contexts[r]) < len(streams[r]) for r in streams):
        plans = {rid: [twin.core.plan(rid, contexts[rid], max_depth=64) for twin in (fused, apart)] for rid in streams}
        for rid, (p_fused, p_apart) in plans.items():
            assert draft_state(p_fused.drafts) == draft_state(p_apart.drafts), f"step {steps} {rid}: drafts"
            assert tree_state(p_fused.tree) == tree_state(p_apart.tree), f"step {steps} {rid}: tree"
        for rid, pair in plans.items():
            rest = streams[rid][len(contexts[rid]):]
            verdict = recorded_verdict(pair[0].tree, rest)
            for twin, plan in zip((fused, apart), pair):
                twin.core.finish(rid, plan, verdict)
            contexts[rid] = contexts[rid] + verdict.new_tokens
        steps += 1
    assert steps > 10 and fused.calibrator.rows_version >= 4
    for a, b in zip(counts(fused.calibrator), counts(apart.calibrator)):
        assert a.tobytes() == b.tobytes()
