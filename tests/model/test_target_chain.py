"""Chain verification: forced, and chosen automatically for a model that ignores 4D masks."""
import logging

import pytest
import torch

from helpers import FakeTokenizer, MaskIgnoringModel, hf_greedy
from lookupdec import Engine, EngineConfig
from lookupdec.model import TargetModel
from tiny_models import tiny_model

MAX_NEW = 40


def test_probe_detects_mask_ignoring_model_and_falls_back(caplog):
    model = tiny_model("llama", seed=3)
    with caplog.at_level(logging.WARNING, logger="lookupdec"):
        target = TargetModel(MaskIgnoringModel(model))
    assert not target.tree_mode
    assert sum("one draft chain per step" in r.getMessage() for r in caplog.records) == 1
    assert TargetModel(model).tree_mode


@pytest.mark.parametrize("verify", ["chain", "auto"])
def test_chain_verification_is_exact(verify):
    """The whole output equals transformers' greedy one (an engine that stopped early would
    fail), and the n-gram drafts were accepted on the way."""
    model = tiny_model("llama", seed=4)
    engine = Engine(MaskIgnoringModel(model), FakeTokenizer(), EngineConfig(verify=verify, budget="fixed"))
    assert not engine.target.tree_mode
    accepted = 0
    for seed in range(5):
        g = torch.Generator().manual_seed(seed)
        base = torch.randint(3, 90, (6,), generator=g).tolist()
        prompt = base * 4  # repetitive: the n-gram proposer drafts
        gen = engine.generate(prompt, max_new_tokens=MAX_NEW)
        ref = hf_greedy(model, prompt, MAX_NEW)
        assert gen.token_ids == ref
        assert gen.finish_reason == ("eos" if ref[-1] == FakeTokenizer.eos_token_id else "length")
        assert gen.stats.mean_tree_nodes <= engine.config.max_depth  # one chain: at most max_depth nodes
        accepted += sum(gen.stats.accepted_by_source.values())
    assert accepted > 0, "no draft token accepted: the chains were never really verified"
