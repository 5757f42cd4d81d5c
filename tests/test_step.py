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
