"""The engine and the replay simulator share one step (``lookupdec.step.StepCore``): replaying
the engine's own greedy output through ``simulate`` must give, step by step, the same trees, the
same accepted nodes and tokens, and the same per-source counts — across two requests, so that
the global suffix cache and the calibrator carry over the same way in both."""
from __future__ import annotations

import pytest

from lookupdec import Engine, EngineConfig
from lookupdec.budget import AcceptanceCalibrator, DraftBudget
from lookupdec.proposers import build_proposers
from lookupdec.simulate import replay_one
from lookupdec.step import StepCore

PROMPTS = [
    "Tom said: the cat sat on the mat. the cat sat on the mat. the cat sat on the mat. the cat sat on",
    "Lily said: the cat sat on the mat. the dog sat on the log. the cat sat on the mat. the dog",
]
MAX_NEW_TOKENS = 60
# token recycling drafts from the target's logits, which a replay has not: left out of both
CONFIG = EngineConfig(budget="fixed", verify="tree", max_nodes=24, max_depth=12, proposers=("ngram", "suffix"))


@pytest.fixture
def recorded_steps(monkeypatch):
    """Every ``StepCore.run`` result as (tree tokens, parents, sources, accepted, new tokens)."""
    steps: list[tuple] = []
    run = StepCore.run

    def recording(self, *args, **kwargs):
        result = run(self, *args, **kwargs)
        t = result.tree
        steps.append((t.token_ids, t.parents, t.sources, result.accepted, result.new_tokens))
        return result

    monkeypatch.setattr(StepCore, "run", recording)
    return steps


def test_replay_of_the_engines_output_repeats_its_steps(stories, recorded_steps):
    model, tokenizer = stories
    engine = Engine(model, tokenizer, CONFIG)
    served, engine_counts = [], []
    for prompt in PROMPTS:
        gen = engine.generate(prompt, max_new_tokens=MAX_NEW_TOKENS)
        served.append((tokenizer(prompt).input_ids, gen.token_ids))
        engine_counts.append(gen.stats.accepted_by_source)
    engine_steps = list(recorded_steps)
    recorded_steps.clear()

    proposers, calibrator, draft_budget = build_proposers(CONFIG), AcceptanceCalibrator(), DraftBudget()
    replay_counts = []
    for i, (prompt_ids, response) in enumerate(served):
        record = replay_one(f"r{i}", prompt_ids, response, proposers, max_nodes=CONFIG.max_nodes,
                            max_depth=CONFIG.max_depth, draft_seconds=[], calibrator=calibrator,
                            draft_budget=draft_budget)
        replay_counts.append(record.accepted_by_source)
    replay_steps = list(recorded_steps)

    assert len(replay_steps) == len(engine_steps)
    for n, (served_step, replayed_step) in enumerate(zip(engine_steps, replay_steps)):
        assert replayed_step == served_step, f"step {n}: the replay diverged from the engine"
    assert replay_counts == engine_counts
    # the comparison means something: real trees, drafts accepted, by more than one source
    assert sum(len(tokens) - 1 for tokens, *_ in engine_steps) > 10 * len(engine_steps)
    accepted = {source: n for counts in engine_counts for source, n in counts.items()}
    assert sum(accepted.values()) > 20 and len(accepted) >= 2, accepted


def _random_drafts(rng, vocab: int):
    """A few random drafts (distinct sibling tokens not required: the merge joins them)."""
    from lookupdec.tree import Draft

    drafts = []
    for d in range(rng.randint(1, 4)):
        n = rng.randint(1, 12)
        parents = [rng.randrange(-1, i) for i in range(n)]
        scores = []
        for i, p in enumerate(parents):
            scores.append((1.0 if p < 0 else scores[p]) * rng.uniform(0.05, 1.0))
        drafts.append(Draft(tuple(rng.randrange(1, vocab) for _ in range(n)), tuple(parents), tuple(scores),
                            f"s{d % 2}", match_length=rng.randint(0, 9)))
    return drafts


def test_hindsight_is_what_each_prefix_tree_would_accept():
    """``step.hindsight`` on a tree's ``Shadow``: for every prefix of the prune order, the draft
    tokens that smaller tree would have accepted (``simulate.accepted_path`` on ``tree.prune(k)``:
    the greedy walk along the tokens the target committed); None (with how many tokens it needs)
    while the committed tokens are too few to tell, and once known, more tokens do not change it.
    The compiled core's shadow of a merged tree is its reference's, list for list."""
    import random

    from lookupdec.simulate import accepted_path
    from lookupdec.step import SHADOW_NODES, Shadow, hindsight
    from lookupdec.tree import TokenTree

    rng = random.Random(7)
    undecided = decided = deep = compiled = 0
    for trial in range(400):
        merged = TokenTree.from_drafts(rng.randrange(1, 8), _random_drafts(rng, rng.choice((3, 4, 8))),
                                       max_nodes=rng.choice((4, 16, 64)), max_depth=rng.choice((3, 16)))
        if merged.num_draft_nodes == 0:
            continue
        # the same tree held in Python lists: the reference's input
        plain = TokenTree(list(merged.token_ids), list(merged.parents), list(merged.scores),
                          expected=list(merged.expected))
        nodes = rng.choice((SHADOW_NODES, 64))
        compiled_shadow, shadow = Shadow.of(merged, 0.5, nodes), Shadow.of_reference(plain, 0.5, nodes)
        assert compiled_shadow.lists() == shadow.lists() and compiled_shadow.factor == 0.5
        assert len(compiled_shadow) == len(shadow) == min(nodes, merged.num_draft_nodes) + 1
        compiled += not isinstance(compiled_shadow, Shadow)
        # committed tokens: often a path of the tree, then anything
        node = rng.randrange(len(merged))
        committed = [merged.token_ids[u] for u in merged.path_to(node)[1:]] if node else []
        committed += [rng.randrange(1, 8) for _ in range(12)]
        full, needed = hindsight(shadow.tokens, shadow.parents, shadow.depth, committed)
        assert needed == 0
        assert full == [len(accepted_path(merged.prune(k), committed)) for k in range(len(shadow.tokens))]
        assert shadow.gains == pytest.approx([sum(merged.expected_in_prune_order()[:k])
                                              for k in range(len(shadow.tokens))])
        deep += full[-1] >= 2
        for cut in range(len(committed)):  # fewer tokens: unknown (needing more), or already the answer
            early, needed = hindsight(shadow.tokens, shadow.parents, shadow.depth, committed[:cut])
            if early is None:
                undecided += 1
                assert cut < needed <= len(committed)
            else:
                decided += 1
                assert early == full
    assert undecided > 100 and decided > 100 and deep > 30 and compiled > 300, (undecided, decided, deep, compiled)


def test_compiled_hindsight_book_is_its_reference():
    """``SizeHindsight`` in the core (``native.tree.ShadowBook``) and its Python reference, fed the same
    steps of several interleaved requests (random trees, committed tokens often along them, steps
    without a shadow, requests stopped with shadows pending), leave the size records' tables bit
    for bit alike, step after step."""
    import random

    import numpy as np

    from lookupdec.budget import SizeRecord
    from lookupdec.step import SizeHindsight
    from lookupdec.tree import TokenTree

    rng = random.Random(11)
    fast, slow = SizeHindsight(), SizeHindsight(backend="reference")
    assert fast.book is not None and slow.book is None
    fast_sizes, slow_sizes = SizeRecord(), SizeRecord()
    requests = ["a", "b", "c"]
    added = 0
    for step in range(600):
        rid = rng.choice(requests)
        merged = TokenTree.from_drafts(rng.randrange(1, 6), _random_drafts(rng, 6), max_nodes=rng.choice((8, 32)),
                                       max_depth=8)
        factor = rng.uniform(0.2, 1.5)
        make = merged.num_draft_nodes and rng.random() < 0.8
        fast_shadow, slow_shadow = (fast.capture(merged, factor), slow.capture(merged, factor)) if make else (None, None)
        node = rng.randrange(len(merged))
        new_tokens = [merged.token_ids[u] for u in merged.path_to(node)[1:]][: rng.randint(1, 4)] or [rng.randrange(1, 6)]
        if rng.random() < 0.3:
            new_tokens = [rng.randrange(1, 6)]
        fast.observe(fast_sizes, rid, fast_shadow, new_tokens)
        slow.observe(slow_sizes, rid, slow_shadow, new_tokens)
        assert fast.waiting(rid) == slow.waiting(rid)
        if rng.random() < 0.02:
            fast.drop(rid)
            slow.drop(rid)
        assert fast_sizes.steps == slow_sizes.steps
        assert np.array_equal(fast_sizes.table, slow_sizes.table), f"step {step}"
        added = fast_sizes.table[:, 2].sum()
    assert added > 50 and fast_sizes.steps > 300


def test_size_records_learn_the_sizes_the_chooser_did_not_verify():
    """Corrections fitted on verified trees only are fitted where the chooser's promise was high;
    a size it never verifies would keep the overall correction. Every step's smallest candidate
    sizes are counted once the tokens after them tell what each would have accepted: here the
    root is verified alone (drafts cost too much), the drafts are always right, and every size
    of 2-9 tokens gets a record of the draft tokens it would have accepted (1 a step for two
    tokens, 8 for nine), added when known and never for a request stopped before."""
    import numpy as np

    from lookupdec.budget import CostModel
    from lookupdec.mixture import Mixture
    from lookupdec.proposers.base import Draft
    from lookupdec.step import Verdict

    class Right:  # a chain of 5s, always what comes next, claimed unlikely
        name = "right"

        def start(self, *a): pass
        def observe(self, *a): pass
        def stop(self, *a): pass

        def propose(self, rid, context, max_nodes):
            n = min(8, max_nodes)
            return [Draft.chain([5] * n, [0.2 ** (d + 1) for d in range(n)], self.name, match_length=4)]

    calibrator = AcceptanceCalibrator()
    core = StepCore(Mixture([Right()], calibrator=calibrator), max_nodes=64, calibrator=calibrator)
    cost = CostModel([1, 2, 64], [1.0, 100.0, 200.0], [1e6] * 3)  # any tree costs 100 forwards: the root alone
    core.start("r", [1, 2, 3])
    context = [1, 2, 3]
    for step in range(12):
        result = core.run("r", context, lambda tree: Verdict([], [5]), max_depth=48, cost=cost)
        assert result.tree.num_draft_nodes == 0
        context.append(5)
    table = core.sizes.table
    assert core.sizes.steps == 12
    # steps 1-5 are known, each at the end of the seventh step after it (its 8 tokens committed):
    # added at steps 8-12, decayed since; nothing was verified (no record of the root alone)
    assert table[0].tolist() == [0.0, 0.0, 0.0, 0.0]
    decay = np.array([0.95 ** (12 - known) for known in range(8, 13)])
    for size in range(2, 10):
        promised, accepted, steps, last = table[size - 1]
        assert last == 12 and promised > 0
        assert accepted == pytest.approx((size - 1) * decay.sum())  # every one of those steps: size - 1 tokens
        assert steps == pytest.approx(decay.sum())
    assert core.hindsight.waiting("r")
    core.stop("r")  # the steps not known yet (6-12) are dropped with the request
    assert not core.hindsight.waiting("r")
