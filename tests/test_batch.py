"""Batched verification (``lookupdec/batch.py``, ``model/batch.py``): every sequence of a batch
gets the output it gets alone, whatever else the batch holds.

- greedy: identical to ``transformers`` ``generate`` for every prompt of every tiny family
  (float32), prompts of different lengths and output lengths in one batch, more prompts than
  rows (continuous batching: rows are reused as sequences finish);
- sampled: the same output as alone for the same seed, greedy and sampled requests mixed;
- per-request stop strings and cancel flags, and the batch rows' K/V bookkeeping.
"""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from conftest import cached_references, cached_tiny
from helpers import FakeTokenizer, SpyProposer, failing_call, first_difference, hf_greedy
from lookupdec import Engine, EngineConfig
from lookupdec.batch import BatchDecoder, BatchRequest, choose_width
from lookupdec.budget import CostModel
from lookupdec.model.cache import BatchStore, SlotStore
from lookupdec.native import kernels as native_kernels
from lookupdec.native import tree as native_tree
from lookupdec.reference import model as reference_model
from tiny_models import FAMILIES

SAMPLING = dict(temperature=0.8, top_k=20, top_p=0.9)


def run_batch(engine: Engine, requests: list[BatchRequest], max_batch: int):
    decoder = BatchDecoder(engine, max_batch, record_widths=True)
    for r in requests:
        decoder.submit(r)
    return decoder.run(), decoder


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_batch_equals_transformers(family):
    model = cached_tiny(family)
    refs = cached_references(family)[:10]
    engine = Engine(model, FakeTokenizer(), EngineConfig())
    requests = [BatchRequest(list(prompt), n) for prompt, n, _ in refs]
    if not engine.batchable:  # the reference path: one at a time
        outs = engine.generate_batch([r.prompt for r in requests], max_new_tokens=min(n for _, n, _ in refs))
        assert all(g.token_ids == want[: len(g.token_ids)] for g, (_, _, want) in zip(outs, refs))
        return
    outs, decoder = run_batch(engine, requests, max_batch=4)
    for i, (gen, (prompt, n, want)) in enumerate(zip(outs, refs)):
        assert gen.token_ids == want, f"{family} prompt {i}: first difference at {first_difference(gen.token_ids, want)}"
    assert max(decoder.widths) > 1  # trees were verified, not only roots
    assert decoder.target.rows == 0 and decoder.idle


@pytest.mark.parametrize("family", FAMILIES)
def test_joint_prefill_batch_equals_transformers(family):
    """Sequences joining together prefill in one right-padded forward (``BatchTarget.add_many``,
    the default on a GPU): each still gets exactly its output alone, with prompts of different
    lengths in one group, more prompts than rows (later ones join as rows free up) and a group
    split by the padded-token cap."""
    from lookupdec.model import batch as model_batch

    model = cached_tiny(family)
    refs = cached_references(family)[:10]
    engine = Engine(model, FakeTokenizer(), EngineConfig())
    if not engine.batchable:
        pytest.skip(f"{family}: no tree masks, one sequence at a time")
    longest = max(len(p) for p, _, _ in refs)
    for cap in (model_batch.PREFILL_TOKENS, 2 * longest):  # one group; groups of two
        old, model_batch.PREFILL_TOKENS = model_batch.PREFILL_TOKENS, cap
        try:
            decoder = BatchDecoder(engine, 4, joint_prefill=True)
            for prompt, n, _ in refs:
                decoder.submit(BatchRequest(list(prompt), n))
            outs = decoder.run()
        finally:
            model_batch.PREFILL_TOKENS = old
        for i, (gen, (prompt, n, want)) in enumerate(zip(outs, refs)):
            assert gen.token_ids == want, f"{family} prompt {i}: first difference at {first_difference(gen.token_ids, want)}"


def test_joint_prefill_writes_what_each_rows_own_prefill_writes():
    from lookupdec.model.batch import BatchTarget

    engine = Engine(cached_tiny("llama"), FakeTokenizer())
    contexts = [[5, 9, 13, 17, 21, 4, 8], [], [7, 8, 9], [3, 4, 5, 6, 3]]
    joint = BatchTarget(engine.target, 6, joint_prefill=True)
    alone = BatchTarget(engine.target, 6, joint_prefill=False)
    assert alone.add(contexts[0]) == 0 and joint.add(contexts[0]) == 0  # a row already there
    assert joint.add_many(contexts[1:]) == alone.add_many(contexts[1:]) == [1, 2, 3]
    assert joint.lengths == alone.lengths == [len(c) for c in contexts]
    assert joint.store.lengths == alone.store.lengths and joint.store.rows == 4
    for b, n in enumerate(joint.lengths):
        torch.testing.assert_close(joint.store.buffer[:, :, b, :, :n], alone.store.buffer[:, :, b, :, :n])
    with pytest.raises(ValueError, match="full"):
        joint.add_many([[1, 2], [3, 4], [5, 6]])
    assert joint.rows == 4  # nothing half-added


def test_joint_prefill_groups_by_its_caps(monkeypatch):
    """A joint prefill forward takes at most ``PREFILL_TOKENS`` padded tokens and
    ``PREFILL_MASK`` mask cells; an empty context (a one-token prompt) has nothing to prefill."""
    from lookupdec.model import batch as model_batch
    from lookupdec.model.batch import BatchTarget

    engine = Engine(cached_tiny("llama"), FakeTokenizer())
    target = BatchTarget(engine.target, 8, joint_prefill=True)
    groups, group = [], target._add_group
    monkeypatch.setattr(target, "_add_group", lambda g: groups.append([len(c) for c, _ in g]) or group(g))
    monkeypatch.setattr(model_batch, "PREFILL_MASK", 2 * 6 ** 2)  # two 6-token contexts, not three
    assert target.add_many([[1] * 6, [2] * 5, [3] * 4, [], [4] * 6]) == [0, 1, 2, 3, 4]
    assert groups == [[6, 5], [4], [6]]
    assert target.lengths == [6, 5, 4, 0, 6]
    monkeypatch.setattr(model_batch, "PREFILL_TOKENS", 11)  # 2 x 6 padded tokens: one each
    groups.clear()
    target.add_many([[1] * 6, [2] * 5])
    assert groups == [[6], [5]]


def test_a_joint_prefill_that_fails_adds_no_row(monkeypatch):
    """``add_many`` is all or nothing: a later group's forward that raises (out of memory) takes
    the rows of the groups before it out again, so the caller may add each one alone."""
    from lookupdec.model import batch as model_batch
    from lookupdec.model.batch import BatchTarget

    engine = Engine(cached_tiny("llama"), FakeTokenizer())
    target = BatchTarget(engine.target, 8, joint_prefill=True)
    target.add([9, 8, 7])
    monkeypatch.setattr(model_batch, "PREFILL_MASK", 2 * 6 ** 2)  # groups [6, 5], [4]
    monkeypatch.setattr(target, "_add_group", failing_call(target._add_group, 2))
    with pytest.raises(RuntimeError, match="out of memory"):
        target.add_many([[1] * 6, [2] * 5, [3] * 4])
    assert target.rows == 1 and target.lengths == [3] and target.store.rows == 1
    assert target.add_many([[1] * 6, [2] * 5, [3] * 4]) == [1, 2, 3]  # (its third call: fine)
    assert target.lengths == [3, 6, 5, 4]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_fixed_budget_batch_equals_transformers(family):
    model = cached_tiny(family)
    refs = cached_references(family)[:6]
    engine = Engine(model, FakeTokenizer(), EngineConfig(budget="fixed", max_nodes=12))
    outs, _ = run_batch(engine, [BatchRequest(list(p), n) for p, n, _ in refs], max_batch=3)
    assert [g.token_ids for g in outs] == [want for _, _, want in refs]


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_batch_on_partial_logits_equals_transformers_and_skips_rows(family):
    """Each row's likely nodes projected in one product for the whole batch (``PartialLogits``
    per sequence, ``partial_logits``); a node reached without a row is projected then."""
    model = cached_tiny(family)
    refs = cached_references(family)[:8]
    engine = Engine(model, FakeTokenizer(), EngineConfig(budget="fixed", max_nodes=32))
    assert engine.target.partial_head
    outs, _ = run_batch(engine, [BatchRequest(list(p), n) for p, n, _ in refs], max_batch=4)
    assert [g.token_ids for g in outs] == [want for _, _, want in refs]
    projected = sum(g.stats.logit_rows * g.stats.steps for g in outs)
    nodes = sum((g.stats.mean_tree_nodes + 1) * g.stats.steps for g in outs)
    assert projected < nodes  # rows were left out ...
    assert sum(g.stats.logit_misses for g in outs) > 0  # ... and some the walk reached were projected then


def test_greedy_rows_read_at_once_equal_each_rows_own(monkeypatch):
    """On an accelerator the batch takes every row's argmax and recycling's top tokens in one
    pass (``GreedyChoices``); forced on the CPU, greedy rows still equal transformers and
    sampled rows in the same batch their output alone for the seed."""
    from lookupdec.sampling import GreedyChoices

    calls = []
    of_batch = GreedyChoices.of_batch
    monkeypatch.setattr(GreedyChoices, "of_batch", staticmethod(lambda *a: calls.append(1) or of_batch(*a)))
    # steps whose batch held a greedy row: the step budget follows measured times, so how many
    # steps the sampled row runs alone at the end varies from run to run
    greedy_steps = []
    choose = BatchDecoder._greedy_choices

    def counted(self, logits, trees):
        greedy_steps.append(any(seq.params.greedy for seq in self.active))
        return choose(self, logits, trees)

    monkeypatch.setattr(BatchDecoder, "_greedy_choices", counted)
    model = cached_tiny("llama")
    refs = cached_references("llama")[:6]
    config = EngineConfig(partial_logits=False)  # (partial logits are per row already)
    sampled = [5, 9, 13, 17, 21] * 3
    alone = Engine(model, FakeTokenizer(), config).generate(sampled, max_new_tokens=20, seed=3, **SAMPLING).token_ids
    decoder = BatchDecoder(Engine(model, FakeTokenizer(), config), 4, record_widths=True)
    decoder.greedy_at_once = True
    for prompt, n, _ in refs:
        decoder.submit(BatchRequest(list(prompt), n))
    decoder.submit(BatchRequest(sampled, 20, seed=3, **SAMPLING))
    outs = decoder.run()
    assert [g.token_ids for g in outs[:-1]] == [want for _, _, want in refs]
    assert outs[-1].token_ids == alone
    assert len(greedy_steps) == len(decoder.widths) and sum(greedy_steps) >= 10
    assert len(calls) == sum(greedy_steps)  # one pass for every step that held a greedy row


def test_greedy_choices_accept_as_the_logits():
    from lookupdec.sampling import GreedyChoices, SamplingParams, accept
    from lookupdec.tree import Draft, TokenTree

    torch.manual_seed(1)
    logits = torch.randn(7, 50)
    best = logits.argmax(-1).tolist()
    # a tree whose first branch follows the argmax two deep, then leaves it
    drafts = [Draft((best[0], best[1], 3), (-1, 0, 1), (0.9, 0.8, 0.7), "a"), Draft((best[0] + 1,), (-1,), (0.5,), "b")]
    tree = TokenTree.from_drafts(9, drafts, max_nodes=6, max_depth=4)
    rows = len(tree)
    choices = GreedyChoices.of_batch(logits[None, :rows], [rows], 4)[0]
    greedy = SamplingParams()
    want = accept(tree, logits[:rows], greedy, top_k=4)
    got = accept(tree, choices, greedy, top_k=4)
    assert (got.accepted, got.next_token, got.bonus, got.tops) == (want.accepted, want.next_token, want.bonus, want.tops)
    assert len(got.accepted) >= 1
    with pytest.raises(ValueError, match="greedy"):
        accept(tree, choices, SamplingParams(temperature=0.7), generator=torch.Generator())


def test_batched_verify_picks_each_selected_rows_best_tokens_as_alone(monkeypatch):
    """``BatchTarget.verify(trees, rows, picks)`` hands each tree with ``rows`` a ``PartialLogits``
    holding its rows' ``picks`` best token ids as the output projection made them (the greedy
    walk and recycling read those, as ``TargetModel.verify(picks=...)`` alone): the top tokens
    of its logits, which are bit for bit those without picks; a tree without rows (a sampled
    row) keeps its plain logits; the batch decoder asks for picks whenever a row is greedy."""
    from lookupdec.engine import top_tokens
    from lookupdec.model.batch import BatchTarget
    from lookupdec.sampling import PartialLogits
    from lookupdec.tree import Draft, TokenTree

    model = cached_tiny("llama")
    engine = Engine(model, FakeTokenizer())
    head = engine.target.fast_head
    assert engine.target.partial_head and head is not None
    if "skinny" not in head.forms:
        pytest.skip("no skinny product on this machine")
    # the skinny product for every call (the head is the model's: other tests timed its buckets)
    monkeypatch.setattr(head._chooser, "pick", lambda key: "skinny")
    body = engine.target.body
    if body is not None:  # the body's form fixed too: a check of another form (probe layers in it)
        chooser = body._chooser  # would make one forward's hidden states differ in the last bits
        monkeypatch.setattr(chooser, "pick", lambda key: chooser.choice.get(key) or chooser.forms_of(key)[0])
        monkeypatch.setattr(chooser, "record", lambda *args, **kwargs: 0.0)
    trees = [TokenTree.from_drafts(4, [Draft((5, 6, 7), (-1, 0, 1), (0.9, 0.8, 0.7), "a"),
                                       Draft((8,), (-1,), (0.5,), "b")], max_nodes=6, max_depth=4),
             TokenTree.from_drafts(9, [Draft((3, 2), (-1, 0), (0.9, 0.8), "a")], max_nodes=6, max_depth=4),
             TokenTree([11], [-1])]
    contexts = [[1, 2, 3, 4], [7, 7, 9], [5, 6]]
    outs = {}
    for picks in (0, 3):
        target = BatchTarget(engine.target, 3)
        for c in contexts:
            target.add(c)
        outs[picks] = target.verify(trees, [[0, 1, 2], None, [0]], picks)
    for b, (plain, picked) in enumerate(zip(outs[0], outs[3])):
        if b == 1:  # no rows asked: every row, plain logits, no picks
            assert not isinstance(picked, PartialLogits) and torch.equal(plain, picked)
            continue
        assert isinstance(picked, PartialLogits) and picked.tops is not None and picked.tops.shape[1] == 3
        assert torch.equal(plain.logits if isinstance(plain, PartialLogits) else plain, picked.logits)
        rows = np.flatnonzero(picked.row_of >= 0).tolist()
        assert picked.tops.tolist() == top_tokens(picked.logits, range(len(rows)), 3)
    seen = []
    original = BatchTarget.verify

    def spy(self, trees, rows=None, picks=0):
        out = original(self, trees, rows, picks)
        seen.append((picks, [getattr(o, "tops", None) is not None for o in out] if isinstance(out, list) else None))
        return out

    monkeypatch.setattr(BatchTarget, "verify", spy)
    prompts = [[1, 2, 3, 4, 5, 1, 2, 3], [4, 4, 2]]
    outs, _ = run_batch(engine, [BatchRequest(p, 12) for p in prompts], 2)
    assert [o.token_ids for o in outs] == [hf_greedy(model, p, 12) for p in prompts]
    assert seen and all(p >= 1 and tops and all(tops) for p, tops in seen), seen


def test_batch_asks_proposers_for_about_the_width_it_keeps(monkeypatch):
    """The joint budget keeps W - 1 nodes per row: its proposers are asked for the power of 2 at
    or above twice the nodes kept lately (``BATCH_DRAFT_MIN`` at least), not the engine's cap,
    then a row with a wider tree for exactly W - 1; the output is unchanged."""
    from lookupdec.batch import BATCH_DRAFT_MIN
    from lookupdec.proposers import build_proposers

    from lookupdec import step

    monkeypatch.setattr(step, "EARN_BASE", 64)  # the joint budget's asks alone, not what requests earned
    model = cached_tiny("llama")
    refs = cached_references("llama")[:6]
    config = EngineConfig(max_nodes=64)
    spies = [SpyProposer(p) for p in build_proposers(config, tokenizer=FakeTokenizer())]
    engine = Engine(model, FakeTokenizer(), config, proposers=spies)

    class Fixed(CostModel):  # a cost curve that learns nothing: the widths do not depend on timings
        def observe(self, n, seconds):
            pass

    cost = Fixed([1, 2, 4, 8, 16, 32, 64, 128, 256], [1.0, 1.0, 1.02, 1.05, 1.1, 1.3, 1.7, 2.5, 4.0], [100] * 9)
    decoder = BatchDecoder(engine, 3, record_widths=True)
    decoder._cost = lambda rows: cost
    first, nodes = [], decoder.draft_budget.nodes  # what each step asks every row's proposers for
    decoder.draft_budget.nodes = lambda cap: first.append(nodes(cap)) or first[-1]
    for p, n, _ in refs:
        decoder.submit(BatchRequest(list(p), n))
    outs = decoder.run()
    assert [g.token_ids for g in outs] == [want for _, _, want in refs]
    asked = spies[0].asked  # one call per row and step, and one per row drafted again
    assert asked[0] == 64 and first[0] == 64  # nothing kept yet: the cap
    assert all(not b & (b - 1) for b in first), first  # powers of 2
    widths = set(decoder.widths)
    # every ask is a step's (``first``) or a row's drafted again for its step's width W (W - 1)
    assert decoder.redrafted > 0 and all(b in first or b + 1 in widths for b in asked), (asked, widths)
    later, kept = first[len(first) // 2 :], max(decoder.widths[len(decoder.widths) // 2 :]) - 1
    assert all(BATCH_DRAFT_MIN <= b <= max(BATCH_DRAFT_MIN, 4 * kept) for b in later), (later, kept)
    assert min(later) < 64



def test_a_lone_row_is_chosen_for_as_alone(monkeypatch):
    """A sequence alone in the batch (a client alone on the server, a batch's last row) is
    planned as alone: ``StepCore.plan`` gets a copy of the engine's own cost curve of its bucket
    (the single-sequence chooser), which observes its forwards, while the engine's curve
    observes none of them (a batched forward is not the path a request alone takes: its t(1)
    would rise); with two or more rows the joint budget chooses (no curve to ``plan``); outputs
    unchanged either way. With ``LONE_ROW_ALONE`` off, every step is the joint budget's."""
    import lookupdec.batch as batch_module

    model = cached_tiny("llama")
    refs = [cached_references("llama")[i] for i in (1, 5)]  # 47 and 64 new tokens: a tail alone
    for lone in (True, False):
        monkeypatch.setattr(batch_module, "LONE_ROW_ALONE", lone)
        engine = Engine(model, FakeTokenizer(), EngineConfig(max_nodes=16))
        decoder = BatchDecoder(engine, 2)
        calls, plan = [], engine.step_core.plan

        def spy(*args, **kwargs):
            calls.append((len(decoder.active), kwargs.get("cost")))
            return plan(*args, **kwargs)

        engine.step_core.plan = spy
        for p, n, _ in refs:
            decoder.submit(BatchRequest(list(p), n))
        observed, observe = [], CostModel.observe
        monkeypatch.setattr(CostModel, "observe", lambda self, n, seconds: observed.append(self) or observe(self, n, seconds))
        outs = decoder.run()
        monkeypatch.setattr(CostModel, "observe", observe)
        assert [g.token_ids for g in outs] == [want for _, _, want in refs]
        alone = [cost for rows, cost in calls if rows == 1]
        assert alone and all(cost is None for rows, cost in calls if rows > 1)
        if lone:
            mine = list(decoder._lone_costs.values())
            assert all(cost is not None and any(cost is c for c in mine) for cost in alone)
            assert any(curve is alone[-1] for curve in observed)  # it observed the lone steps' forwards
            assert engine._costs and not any(curve is c for curve in observed for c in engine._costs.values())
            assert all(k[1] > 1 for k in engine.batch_costs)  # no one-row batch curve was made
        else:
            assert all(cost is None for cost in alone)
            assert any(k[1] == 1 for k in engine.batch_costs)


def test_a_batchs_first_curve_times_its_probe_widths_then_hands_on(monkeypatch):
    """An engine's first batch curve starts from one row's curve of as many tokens (which prices
    wide batches badly: ``BatchDecoder._cost``), so its first steps verify each of
    ``PROBE_WIDTHS`` (up to the widest tree) once on the batch's own trees, a curve of the next
    context bucket taking over what is left; outputs unchanged. A batch of other rows, in a
    later decoder of the same engine, starts from the curve learnt (its sizes observed lately)
    with the widths that curve has still to time, not from one row's."""
    from lookupdec import step
    from lookupdec.batch import PROBE_WIDTHS

    # the probes reach as wide as the widest tree: trees as wide as the drafts, not as requests earned
    monkeypatch.setattr(step, "EARN_BASE", 64)
    model = cached_tiny("llama")
    refs = [cached_references("llama")[i] for i in (1, 5, 7, 9)]  # prompts of 39-55 tokens, 47-64 new
    engine = Engine(model, FakeTokenizer(), EngineConfig(max_nodes=16))
    outs, decoder = run_batch(engine, [BatchRequest(list(p), n) for p, n, _ in refs], max_batch=4)
    assert [g.token_ids for g in outs] == [want for _, _, want in refs]
    assert set(PROBE_WIDTHS) <= set(decoder.widths[:10]), decoder.widths
    fours = [engine.batch_costs[k] for k in engine.batch_probes]
    assert all(k[1] == 4 for k in engine.batch_probes) and len(fours) >= 1
    for w in PROBE_WIDTHS:  # each timed by a batch forward of its own
        assert any(curve.count(4 * w) > 0.5 for curve in fours), w
    again = BatchDecoder(engine, 4)
    assert again._costs is engine.batch_costs
    again.active = decoder.done + decoder.done[:1]  # five rows (the first batch's end: its last bucket)
    bucket = again._key(5)[0]
    five = again._cost(5)  # (four rows: the nearest)
    assert five.sizes == engine.batch_costs[bucket, 4].trusted().sizes
    assert engine.batch_probes.get((bucket, 5), set()) == engine.batch_probes.get((bucket, 4), set())


def test_joint_budget_weighs_each_row_by_its_requests_record(monkeypatch):
    """The joint budget multiplies each row's gains by its request's own correction
    (``Plan.factor``, from ``StepCore.request_factor``): each prompt runs in two rows at once, so
    both rows draft the same trees, and the second request's record is one of failed drafts: the
    gains handed to ``choose_width`` differ by exactly that factor, and each row's output is still
    its own."""
    import lookupdec.batch as batch_module
    from lookupdec.step import REQUEST_MIN, SCALE_MIN

    model = cached_tiny("llama")
    refs = cached_references("llama")[:6]
    engine = Engine(model, FakeTokenizer(), EngineConfig(max_nodes=16))
    decoder = BatchDecoder(engine, 2)
    core = engine.step_core
    failing = {f"batch-{id(decoder)}-{i}" for i in range(1, 2 * len(refs), 2)}  # every pair's second (``submit``)
    monkeypatch.setattr(core, "request_factor", lambda rid: 0.25 if rid in failing else 1.0)
    seen = []
    choose = batch_module.choose_width

    def spy(gains, *args, **kwargs):
        seen.append([list(g) for g in gains])
        return choose(gains, *args, **kwargs)

    monkeypatch.setattr(batch_module, "choose_width", spy)
    for p, n, _ in refs:
        for _ in range(2):
            decoder.submit(BatchRequest(list(p), n))
    outs = decoder.run()
    assert [g.token_ids for g in outs] == [want for _, _, want in refs for _ in range(2)]
    pairs = [g for g in seen if len(g) == 2 and g[0]]
    assert len(pairs) >= 5, len(pairs)  # steps where the pair had drafts
    # (the shared correction stays in [SCALE_MIN, SCALE_MAX]: a quarter of it is never clipped at REQUEST_MIN)
    assert 0.25 * SCALE_MIN > REQUEST_MIN
    for first, second in pairs:
        assert len(first) == len(second)
        assert all(b == 0.25 * a for a, b in zip(first, second)), (first, second)  # (a power of 2: exact)


@pytest.mark.parametrize("family", ["llama", "gpt_neox"])
def test_sampled_batch_equals_alone_for_a_seed(family):
    model = cached_tiny(family)
    prompts = [[5, 9, 13, 17, 21] * 3, [7, 8, 9, 7, 8, 9, 7, 8], [3, 4, 5, 6, 3, 4, 5, 6, 3, 4, 5], [11, 12, 13] * 5]
    alone_engine = Engine(model, FakeTokenizer())
    alone = []
    for i, p in enumerate(prompts):
        params = SAMPLING if i % 2 == 0 else {}  # sampled and greedy requests in one batch
        alone.append(alone_engine.generate(p, max_new_tokens=25, seed=100 + i, **params).token_ids)
    requests = [BatchRequest(p, 25, seed=100 + i, **(SAMPLING if i % 2 == 0 else {})) for i, p in enumerate(prompts)]
    outs, _ = run_batch(Engine(model, FakeTokenizer()), requests, max_batch=3)
    assert [g.token_ids for g in outs] == alone
    decoder = BatchDecoder(Engine(model, FakeTokenizer()), 3, joint_prefill=True)
    for r in requests:
        decoder.submit(r)
    assert [g.token_ids for g in decoder.run()] == alone  # and with the rows' prefills joint


def test_generate_batch_api_and_seeds():
    model = cached_tiny("llama")
    engine = Engine(model, FakeTokenizer())
    prompts = [[5, 6, 7, 5, 6, 7], [9, 10, 11, 12]]
    outs = engine.generate_batch(prompts, max_new_tokens=12, seed=[1, 2], **SAMPLING)
    assert [g.token_ids for g in outs] == [engine.generate(p, max_new_tokens=12, seed=s, **SAMPLING).token_ids
                                           for p, s in zip(prompts, [1, 2])]
    # (the first token is the prefill's: a sequence ending there, at EOS, takes no step)
    assert all(g.finish_reason in ("length", "eos") and g.stats.prefill_tokens == 1 for g in outs)
    assert all(g.stats.steps > 0 or len(g.token_ids) == 1 for g in outs)
    with pytest.raises(ValueError, match="seed"):
        engine.generate_batch(prompts, max_new_tokens=4, seed=[1])
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.generate_batch(prompts, max_new_tokens=0)


def test_generate_batch_names_bad_arguments():
    from lookupdec.validate import ParamError

    engine = Engine(cached_tiny("llama"), FakeTokenizer())
    with pytest.raises(ParamError, match="list of prompts") as exc:
        engine.generate_batch("one string", max_new_tokens=4)  # not split into its characters
    assert exc.value.field == "prompts"
    for bad_rows in (0, -3, 2.5, "4", None, True):
        with pytest.raises(ParamError, match="max_batch") as exc:
            engine.generate_batch([[5, 6, 7]], max_new_tokens=4, max_batch=bad_rows)
        assert exc.value.field == "max_batch"
    with pytest.raises(ParamError, match=r"prompts\[1\]: prompt is empty") as exc:
        engine.generate_batch([[5, 6, 7], [], [8, 9]], max_new_tokens=4)
    assert exc.value.field == "prompts[1]"
    assert engine.generate_batch([], max_new_tokens=4) == []


def test_generate_batch_reserves_no_more_rows_than_prompts(monkeypatch):
    import lookupdec.batch as batch_module

    sizes = []
    init = batch_module.BatchDecoder.__init__

    def spy(self, engine, max_batch, *args, **kwargs):
        sizes.append(max_batch)
        init(self, engine, max_batch, *args, **kwargs)

    monkeypatch.setattr(batch_module.BatchDecoder, "__init__", spy)
    engine = Engine(cached_tiny("llama"), FakeTokenizer())
    prompts = [[5, 6, 7, 5, 6, 7], [9, 10, 11, 12]]
    outs = engine.generate_batch(prompts, max_new_tokens=6, max_batch=64)
    assert sizes == [2]  # each row reserves K/V memory for the longest context
    assert [g.token_ids for g in outs] == [engine.generate(p, max_new_tokens=6).token_ids for p in prompts]


@pytest.mark.parametrize("reuse", [False, True])
def test_joining_rows_fill_the_one_row_buffer_already_there(reuse):
    """A sequence joining by its own prefill is written into the one-row buffer the last joining
    one used (emptied), not a new one; each row's K/V are still its own (outputs transformers')."""
    from lookupdec.model.batch import BatchTarget

    model = cached_tiny("llama")
    engine = Engine(model, FakeTokenizer(), EngineConfig(prefix_cache=reuse))
    a, b = list(range(3, 50)), [2] + list(range(60, 90))
    contexts = [a, b, a[:40] + [91, 92], b[:5]]
    target = BatchTarget(engine.target, 4, joint_prefill=False, prefix_cache=reuse)
    twin = Engine(model, FakeTokenizer(), EngineConfig(prefix_cache=reuse))  # (its own kept prompts)
    reference = BatchTarget(twin.target, 4, joint_prefill=False, prefix_cache=reuse)
    target.add(contexts[0])
    buffer = target._spare.slot_store.buffer
    for c in contexts[1:]:
        target.add(c)
        assert target._spare.slot_store.buffer is buffer  # nothing shared, a kept copy, a shorter prompt
    for c in contexts:
        reference._spare = None  # a new one-row cache for every row: the reference
        reference.add(c)
    assert target.lengths == reference.lengths == [len(c) for c in contexts]
    for b_, n in enumerate(target.lengths):
        got, want = target.store.buffer[:, :, b_, :, :n], reference.store.buffer[:, :, b_, :, :n]
        assert torch.equal(got, want), f"row {b_}"
    decoder = BatchDecoder(engine, 4, joint_prefill=False)
    for c in contexts:
        decoder.submit(BatchRequest(list(c), 8))
    for gen, c in zip(decoder.run(), contexts):
        assert gen.token_ids == hf_greedy(model, c, 8)


def test_a_failed_prefill_fails_its_sequence_alone():
    """A prompt whose own prefill raises as it joins (out of memory) leaves the batch in
    ``failed_in_step`` with its error; the others joined and go on, their outputs as alone
    (before, the whole step failed and every request in flight with it). A joint prefill that
    raises leaves every joining sequence waiting, so a caller's recovery of ``active + waiting``
    (the server's 500s, rewrite's one at a time) meets them all."""
    engine = Engine(cached_tiny("llama"), FakeTokenizer())
    decoder = BatchDecoder(engine, 4, joint_prefill=False)
    prompts = [[5, 6, 7, i + 1] for i in range(3)]
    indices = [decoder.submit(BatchRequest(p, 4)) for p in prompts]
    decoder.target.add = failing_call(decoder.target.add, 2)
    ended = decoder.step()
    assert [(seq.index, str(exc)) for seq, exc in decoder.failed_in_step] == [(indices[1], "out of memory")]
    assert sorted(seq.index for seq in decoder.active + ended) == [indices[0], indices[2]]
    while not decoder.idle:
        ended += decoder.step()
        assert decoder.failed_in_step == []
    for seq in ended:
        want = engine.generate(prompts[seq.index], max_new_tokens=4).token_ids
        assert decoder.generation(seq).token_ids == want
    joint = BatchDecoder(engine, 4, joint_prefill=True)
    indices = [joint.submit(BatchRequest(p, 4)) for p in prompts]
    joint.target.add = failing_call(joint.target.add, 2)
    joint.target._add_group = failing_call(joint.target._add_group, 1)
    ended = joint.step()  # the joint forward fails: each alone, the second fails alone
    assert [(seq.index, str(exc)) for seq, exc in joint.failed_in_step] == [(indices[1], "out of memory")]
    assert joint.target.rows == len(joint.active) and not joint.waiting
    while not joint.idle:
        ended += joint.step()
    assert sorted(seq.index for seq in ended) == [indices[0], indices[2]]
    for seq in ended:
        want = engine.generate(prompts[seq.index], max_new_tokens=4).token_ids
        assert joint.generation(seq).token_ids == want
    stopped = BatchDecoder(engine, 4, joint_prefill=True)
    indices = [stopped.submit(BatchRequest(p, 4)) for p in prompts]
    stopped.target.add_many = failing_call(stopped.target.add_many, 1, exc=KeyboardInterrupt)
    with pytest.raises(KeyboardInterrupt):  # an interrupt: every joining sequence waits again
        stopped.step()
    assert [seq.index for seq in stopped.waiting] == indices and not stopped.active  # in their order
    assert stopped.target.rows == 0
    stopped.target.add = failing_call(stopped.target.add, 2, exc=KeyboardInterrupt)
    stopped.target.joint_prefill = False
    with pytest.raises(KeyboardInterrupt):  # in the middle of rows joining one by one: the same
        stopped.step()
    assert [seq.index for seq in stopped.waiting] == indices and stopped.target.rows == 0
    again = BatchDecoder(engine, 4, joint_prefill=False)
    for p in prompts:
        again.submit(BatchRequest(p, 4))
    again.target.add = failing_call(again.target.add, 3)
    with pytest.raises(RuntimeError, match="out of memory"):  # run (generate_batch): the call fails
        again.run()


def test_a_failed_step_keeps_what_it_had_ended_and_steps_keep_nothing():
    """A step that raises after some sequences ended in it (a first token at admission that is
    the last, here) leaves them in ``ended_in_step``, whole, and ``abandon`` gives the others:
    none lost (before, the ended ones were in neither list and their server clients waited
    forever). And a decoder stepped by its caller keeps no finished sequence nor any per-step
    record: a server's memory stays flat."""
    engine = Engine(cached_tiny("llama"), FakeTokenizer())
    decoder = BatchDecoder(engine, 4)
    short = decoder.submit(BatchRequest([5, 6, 7, 8], 1))
    longer = [decoder.submit(BatchRequest([5, 6, 7, i + 1], 8)) for i in range(2)]
    decoder.target.verify = failing_call(decoder.target.verify, 1)
    with pytest.raises(RuntimeError, match="out of memory"):
        decoder.step()
    assert [seq.index for seq in decoder.ended_in_step] == [short]
    assert decoder.generation(decoder.ended_in_step[0]).token_ids == engine.generate([5, 6, 7, 8], max_new_tokens=1).token_ids
    assert sorted(seq.index for seq in decoder.abandon()) == longer
    again = BatchDecoder(engine, 4)
    for i in range(3):
        again.submit(BatchRequest([5, 6, 7, i + 1], 8))
    ended = []
    while not again.idle:
        ended += again.step()
    assert len(ended) == 3 and again.done == [] and again.widths == [] and again.steps > 0


def test_stop_strings_and_cancel_are_per_request():
    model = cached_tiny("llama")
    engine = Engine(model, FakeTokenizer())
    prompt = [5, 9, 13, 17, 21] * 3
    alone = engine.generate(prompt, max_new_tokens=30)
    stop_at = alone.text[5:8]
    cancel = threading.Event()
    cancel.set()
    pieces: list[str] = []
    requests = [BatchRequest(prompt, 30, stop=[stop_at]), BatchRequest(prompt, 30, cancel=cancel),
                BatchRequest(prompt, 30, on_text=pieces.append)]
    outs, _ = run_batch(engine, requests, max_batch=3)
    assert outs[0].finish_reason == "stop" and outs[0].text == alone.text[: alone.text.index(stop_at)]
    assert outs[1].finish_reason == "cancelled" and outs[1].token_ids == []
    assert outs[2].token_ids == alone.token_ids and "".join(pieces) == alone.text


@pytest.mark.skipif(native_tree is None, reason="compiled core not built")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("seed", range(4))
def test_batch_inputs_are_their_definitions(dtype, seed):
    """``BatchTarget.inputs``' compiled form (``native.tree.batch_tree_inputs_at``) writes what
    ``reference.model.batch_inputs`` defines, bit for bit: random trees (chains, bushes, the root
    alone) padded to the widest, rows of different lengths (holes), every dtype's fill."""
    from types import SimpleNamespace

    from lookupdec.model.batch import BatchTarget
    from lookupdec.tree import TokenTree

    rng = np.random.default_rng(seed)
    rows = int(rng.integers(2, 7))
    trees = []
    for _ in range(rows):
        n = int(rng.integers(1, 9))
        parents = [-1] + [int(rng.integers(0, i)) if rng.random() < 0.5 else i - 1 for i in range(1, n)]
        tokens = [int(t) for t in rng.permutation(1000)[:n]]  # distinct: no two siblings share a token
        trees.append(TokenTree(tokens, parents))
    width = max(len(t) for t in trees) + int(rng.integers(0, 3))
    lengths = [int(x) for x in rng.integers(0, 40, size=rows)]
    slots = max(lengths) + int(rng.integers(0, 3))
    batch = BatchTarget.__new__(BatchTarget)
    batch.target = SimpleNamespace(device=torch.device("cpu"), dtype=dtype)
    batch.lengths = lengths
    batch.store = SimpleNamespace(lengths=[slots] * rows)
    batch.max_rows = rows
    got = batch.inputs(trees, width)
    want = reference_model.batch_inputs(trees, lengths, slots, width, device="cpu", dtype=dtype)
    assert batch._base == slots
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert torch.equal(g.view(torch.uint8) if g.is_floating_point() else g,
                           w.view(torch.uint8) if w.is_floating_point() else w)


def test_batch_inputs_refuse_a_tree_wider_than_the_width():
    if native_tree is None:
        pytest.skip("compiled core not built")
    ids, positions, mask = torch.empty(1, 2, dtype=torch.int64), torch.empty(1, 2, dtype=torch.int64), torch.empty(1, 1, 2, 5)
    fill = b"\xff\xff\x7f\xff"
    with pytest.raises(ValueError, match="row 0"):
        native_tree.batch_tree_inputs_at([[1, 2, 3]], [[-1, 0, 1]], [3], 3, 2, fill, ids.data_ptr(),
                                         positions.data_ptr(), mask.data_ptr())
    with pytest.raises(ValueError, match="row 0"):  # a length past the slots
        native_tree.batch_tree_inputs_at([[1]], [[-1]], [4], 3, 2, fill, ids.data_ptr(), positions.data_ptr(),
                                         mask.data_ptr())


def test_batch_store_rows():
    layers, heads, dim = 2, 3, 4
    one = SlotStore(layers)
    for layer in range(layers):
        one.write(layer, torch.arange(5 * heads * dim, dtype=torch.float32).view(1, heads, 5, dim) + layer,
                  torch.zeros(1, heads, 5, dim))
    store = BatchStore(layers, max_rows=3)
    store.put_row(0, one, 5)
    store.put_row(1, one, 3)
    store.rows = 2
    assert store.lengths == [5, 5]
    assert torch.equal(store.view(0, 0)[1, :, :3], one.view(0, 0)[0, :, :3])
    assert torch.count_nonzero(store.view(0, 0)[1, :, 3:]) == 0  # a hole is zeros, never garbage
    store.gather_row(0, [3, 4], 1)  # slots 3, 4 of row 0 to 1, 2
    assert torch.equal(store.view(1, 0)[0, :, 1:3], one.view(1, 0)[0, :, 3:5])
    store.move_row(0, 1, 5)
    assert torch.equal(store.buffer[:, :, 1, :, :5], store.buffer[:, :, 0, :, :5])


def nan_buffers(monkeypatch):
    """Every new ``BatchStore`` buffer filled with NaN: what an uninitialised one may hold."""
    from lookupdec.model import cache

    monkeypatch.setattr(cache, "new_buffer", lambda shape, dtype, device: torch.full(
        shape, float("nan"), dtype=dtype, device=device))


def test_batch_store_zeroes_the_holes_of_an_uninitialised_buffer(monkeypatch):
    """Whatever a new buffer holds (NaN here): a joining row's slots up to the shared count
    and the other rows' slots a longer row adds are zeroed, a row's own slots copied, and a
    growth keeps the rows in use; no slot below the shared count of a row in use is NaN."""
    nan_buffers(monkeypatch)
    layers, heads, dim = 2, 3, 4
    one = SlotStore(layers)
    for layer in range(layers):
        one.write(layer, torch.randn(1, heads, 9, dim), torch.randn(1, heads, 9, dim))
    store = BatchStore(layers, max_rows=4)
    for row, length in enumerate([6, 3, 8]):
        store.put_row(row, one, length, room=2)
        store.rows = row + 1
        shared = store.lengths[0]
        for r, n in enumerate([6, 3, 8][: row + 1]):
            for layer in range(layers):
                for kind in (0, 1):
                    got = store.view(layer, kind)[r]
                    assert got.shape[1] == shared and not torch.isnan(got).any()
                    assert torch.equal(got[:, :n], one.view(layer, kind)[0, :, :n])
                    assert torch.count_nonzero(got[:, n:]) == 0
    before = [store.view(layer, kind).clone() for layer in range(layers) for kind in (0, 1)]
    store.reserve(store.buffer.shape[4] + 50, one.view(0, 0)[:, :, :1])  # a growth: the rows in use kept
    assert [store.view(layer, kind) for layer in range(layers) for kind in (0, 1)] != []
    assert all(torch.equal(a, store.view(layer, kind)) for a, (layer, kind) in
               zip(before, [(layer, kind) for layer in range(layers) for kind in (0, 1)]))


def test_a_joining_row_reserves_its_request_so_steps_never_grow_the_buffer(monkeypatch):
    """A sequence joining the batch reserves K/V slots for its new tokens and widest tree
    (``BatchDecoder._room``): its steps never make a new buffer (a new one stalled every row);
    outputs stay transformers' (buffers made NaN: nothing uninitialised is read)."""
    from lookupdec.model import cache

    monkeypatch.setattr(cache, "INITIAL_SLOTS", 8)  # (else the first buffer holds this request anyway)
    nan_buffers(monkeypatch)
    model = cached_tiny("llama")
    engine = Engine(model, FakeTokenizer())
    prompt = [5, 9, 2, 7, 1, 3, 8]
    decoder = BatchDecoder(engine, 4)
    decoder.submit(BatchRequest(prompt, 40))
    ended = decoder.step()
    buffer = decoder.target.store.buffer
    assert buffer.shape[4] >= len(prompt) + 40 + engine.config.max_nodes + 1
    while not decoder.idle:
        ended += decoder.step()
        assert decoder.target.store.buffer is buffer
    out = decoder.generation(ended[0])
    assert out.token_ids == hf_greedy(model, prompt, 40)


def test_rows_joining_and_leaving_never_read_an_uninitialised_slot(monkeypatch):
    """Uninitialised buffers (NaN here) under rows of different lengths joining, leaving and
    growing the buffer (small first buffers, a request longer than its reservation): every
    output is still transformers' greedy, alone and joint prefill."""
    from lookupdec import batch as batch_module
    from lookupdec.model import cache

    nan_buffers(monkeypatch)
    monkeypatch.setattr(cache, "INITIAL_SLOTS", 4)
    monkeypatch.setattr(batch_module, "RESERVE_NEW_TOKENS", 3)  # (answers outgrow their reservation)
    model = cached_tiny("llama")
    prompts = [[5, 9, 2, 7, 1, 3, 8, 8, 2], [4, 4], [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2], [6, 7, 6]]
    want = [hf_greedy(model, p, 14) for p in prompts]
    for joint in (False, True):
        engine = Engine(model, FakeTokenizer())
        decoder = BatchDecoder(engine, 3, joint_prefill=joint)
        for p, n in zip(prompts, (14, 5, 14, 14)):
            decoder.submit(BatchRequest(p, n))
        outs = decoder.run()
        assert [o.token_ids for o in outs] == [want[0], want[1][:5], want[2], want[3]]


def test_batch_store_gathers_rows_at_once_as_row_by_row():
    """A batch's KV commit in one gather (an accelerator's) moves what ``gather_row`` moves row
    by row (a CPU's), including slots read that are other slots' targets and rows with nothing
    to move."""
    torch.manual_seed(0)
    store = BatchStore(2, max_rows=4)
    store.buffer = torch.randn(2, 2, 4, 3, 40, 5)
    store.rows = 4
    moves = [(0, [20, 22, 25], 10), (1, [20, 21, 22], 20), (2, [20, 23, 24, 27], 18), (3, [20], 5)]
    at_once, by_row = BatchStore(2, 4), BatchStore(2, 4)
    at_once.buffer, by_row.buffer = store.buffer.clone(), store.buffer.clone()
    at_once.gather_rows(moves, at_once=True)
    by_row.gather_rows(moves)  # (CPU: row by row)
    assert torch.equal(at_once.buffer, by_row.buffer)
    assert not torch.equal(by_row.buffer, store.buffer)
    assert torch.equal(by_row.buffer[:, :, 2, :, 18:22], store.buffer[:, :, 2, :, [20, 23, 24, 27]])
    before = at_once.buffer.clone()
    at_once.gather_rows([(1, [20, 21], 20)], at_once=True)  # already in place: nothing moves
    assert torch.equal(at_once.buffer, before)


def test_slot_writes_equal_indexing_each_layer():
    """``write`` (views made once for every layer of a forward, ``_Spans``) leaves the buffer and
    hands out the K, V that indexing the buffer per layer (``reference.model.write``) does, same shape
    and strides, for one sequence and a batch's first rows: through prefills, steps of every
    size (none included), crops and commits between them, the buffer's growth, a buffer swapped
    from outside, and a write after only some layers have theirs; a layer shaped otherwise than
    its cache still raises."""
    rng = np.random.default_rng(1)
    layers, heads, dim = 3, 2, 4
    for make in (lambda: SlotStore(layers), lambda: BatchStore(layers, max_rows=4)):
        fast, ref = make(), make()
        rows = 1 if type(fast) is SlotStore else 3
        for step in range(40):
            new = int(rng.integers(0, 9)) if step else 200  # a prefill first (past INITIAL_SLOTS soon: growth)
            upto = layers if step % 7 != 3 else 1  # (a forward cut short after its first layer)
            for layer in range(upto):
                keys = torch.from_numpy(rng.standard_normal((rows, heads, new, dim)).astype(np.float32))
                values = keys.transpose(1, 2).contiguous().transpose(1, 2) * 2  # (laid out as attention's)
                got, want = fast.write(layer, keys, values), reference_model.write(ref, layer, keys, values)
                for a, b in zip(got, want):
                    assert a.shape == b.shape and a.stride() == b.stride() and torch.equal(a, b), (step, layer)
                assert fast.lengths == ref.lengths, (step, layer)
                for i, n in enumerate(fast.lengths):  # (what no write reached is whatever torch.empty left)
                    assert torch.equal(fast.buffer[i, :, :rows, :, :n], ref.buffer[i, :, :rows, :, :n]), (step, layer, i)
            if upto < layers:  # as a failed forward's caller: every layer back to the shortest
                keep = min(fast.lengths)
            else:  # as a commit: keep some of the step's slots
                keep = max(fast.lengths) - int(rng.integers(0, new + 1))
            fast.crop(keep)
            ref.crop(keep)
            if step == 20:  # a buffer set from outside (a test's, a reused prefix's): its views are made anew
                fast.buffer, ref.buffer = fast.buffer.clone(), ref.buffer.clone()
        with pytest.raises((ValueError, RuntimeError)):
            fast.write(0, torch.zeros(rows, heads + 1, 1, dim), torch.zeros(rows, heads + 1, 1, dim))


@pytest.mark.skipif(native_kernels is None, reason="compiled core not built")
def test_compiled_slot_gathers_equal_torch_indexing():
    """``SlotStore.gather`` and ``BatchStore.gather_row`` move slots in place in the compiled
    core (``gather_slots``) on a CPU buffer: the same buffer as torch's indexing
    (``reference.model.gather``, ``gather_row``) on random increasing slots, overlapping runs
    (a slot read that is another's target), slots already in place, and float16."""
    rng = np.random.default_rng(0)
    for trial in range(60):
        dtype = torch.float16 if trial % 5 == 4 else torch.float32
        capacity, start = 48, int(rng.integers(0, 20))
        count = int(rng.integers(1, 10))
        slots = sorted(int(s) for s in rng.choice(np.arange(start, capacity), size=count, replace=False))
        slots = [max(s, start + j) for j, s in enumerate(slots)]  # (still increasing: each at or after its target)
        if trial % 3 == 0:  # the accepted path's first nodes often sit in place already
            slots[0] = start
        single, reference = SlotStore(3), SlotStore(3)
        single.buffer = torch.randn(3, 2, 1, 2, capacity, 8).to(dtype)
        reference.buffer = single.buffer.clone()
        single.gather(slots, start)
        reference_model.gather(reference, slots, start)
        assert torch.equal(single.buffer, reference.buffer), (slots, start)
        batch, batch_reference = BatchStore(3, max_rows=4), BatchStore(3, max_rows=4)
        batch.buffer = torch.randn(3, 2, 4, 2, capacity, 8).to(dtype)
        batch_reference.buffer = batch.buffer.clone()
        row = trial % 4
        batch.gather_row(row, slots, start)
        reference_model.gather_row(batch_reference, row, slots, start)
        assert torch.equal(batch.buffer, batch_reference.buffer), (row, slots, start)
    with pytest.raises(ValueError, match="slots must increase"):
        single.gather([5, 4], 2)
    with pytest.raises(ValueError, match="at or after its target"):
        single.gather([1], 2)


def test_choose_width():
    cost = CostModel([1, 2, 4, 8, 16], [1.0, 1.0, 1.05, 1.1, 3.0])
    assert choose_width([[0.9, 0.9, 0.9], [0.9, 0.9, 0.9]], cost, 0.0, 8) == 4  # 8 tokens for 1.1
    assert choose_width([[0.01, 0.01], [0.01]], CostModel([1, 2, 4], [1.0, 1.5, 2.0]), 0.0, 8) == 1
    assert choose_width([[], []], cost, 0.0, 8) == 1
    assert choose_width([[0.9] * 10], cost, 0.0, 3) <= 4  # max_nodes caps the width


def test_choose_width_past_a_single_sequences_sizes():
    """A batch reads its cost past the sizes one sequence ever verified (8 rows x 65 nodes =
    520 tokens). The curve an H100 engine learnt alone (ms; 62 and 64 nodes differ by noise):
    extrapolated from those two neighbours, 520 tokens cost 2.4 s and the batch kept one or two
    nodes per row (0.91x transformers batched at B = 8, where fixed 16-node trees gave 2.47x).
    The secant over half the range keeps the cost flat, as it is, and the trees wide."""
    cost = CostModel([1, 4, 16, 62, 64], [0.0511, 0.0390, 0.0400, 0.0359, 0.0465])
    gains = [[0.9, 0.8, 0.7, 0.6] + [0.3] * 60 for _ in range(8)]
    assert cost(520) < 3 * cost(64)
    assert choose_width(gains, cost, 0.005, 64) >= 33
    # never cheaper than proportional growth allows: n tokens cost at most n / m forwards of m
    steep = CostModel([1, 2], [0.010, 0.050])
    assert steep(8) <= 0.050 * 8 / 2 + 1e-12
    assert CostModel([1, 4, 16], [1.0, 1.5, 2.5], [50] * 3)(32) == pytest.approx(2.5 + 16 * (2.5 - 1.5) / 12)


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen2"])
def test_each_row_sees_the_distributions_of_its_sequence_alone(family):
    """The lemma every exactness claim rests on: a batched forward gives each row's nodes the
    logits that row's tree gets alone (float rounding apart), whatever the other rows' lengths
    and trees; acceptance per row then runs on the same distributions as alone (the closed-form
    and Monte Carlo tests of test_sampling.py hold for it unchanged)."""
    from lookupdec.model.batch import BatchTarget
    from lookupdec.model.target import TargetModel
    from lookupdec.tree import TokenTree

    model = cached_tiny(family)
    target = TargetModel(model)
    contexts = [[3, 4, 5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]]
    trees = [TokenTree(token_ids=[9, 1, 2, 3, 4], parents=[-1, 0, 0, 1, 3]),
             TokenTree(token_ids=[11], parents=[-1]),
             TokenTree(token_ids=[22, 5, 6, 7], parents=[-1, 0, 1, 0])]
    alone = []
    for context, tree in zip(contexts, trees):
        target.prefill(context[:-1])
        alone.append(target.verify(tree))
    batch = BatchTarget(target, max_rows=3)
    for context in contexts:
        batch.add(context[:-1])
    got = batch.verify(trees)
    for b, (tree, want) in enumerate(zip(trees, alone)):
        assert torch.allclose(got[b, : len(tree)], want, rtol=1e-4, atol=1e-4), f"row {b}"
    # after a commit (row 0 keeps nodes 1, 3; row 2 keeps node 3) the rows go on as alone
    batch.commit([[1, 3], [], [3]])
    nxt = [TokenTree(token_ids=[3, 8], parents=[-1, 0]), TokenTree(token_ids=[0], parents=[-1]),
           TokenTree(token_ids=[7, 1, 2], parents=[-1, 0, 0])]
    got = batch.verify(nxt)
    for b, (context, kept, tree) in enumerate(zip(contexts, [[1, 3], [], [3]], nxt)):
        prefix = context + [trees[b].token_ids[i] for i in kept]
        target.prefill(prefix)
        want = target.verify(tree)
        assert torch.allclose(got[b, : len(tree)], want, rtol=1e-4, atol=1e-4), f"row {b} after commit"
