"""Chain verification: forced, and chosen automatically for a model that ignores 4D masks."""
import logging

import pytest
import torch

from lookupdec import Engine, EngineConfig
from lookupdec.model import TargetModel
from tiny_models import tiny_model


class MaskIgnoringModel(torch.nn.Module):
    """Wraps a model and drops any custom attention mask (as some attention kernels do)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.config = inner.config

    def get_output_embeddings(self):
        return self.inner.get_output_embeddings()

    def forward(self, attention_mask=None, **kwargs):
        return self.inner(**kwargs)


class FakeTokenizer:
    eos_token_id = 2

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def _greedy(model, prompt, n):
    ids = torch.tensor([prompt])
    return model.generate(ids, do_sample=False, max_new_tokens=n)[0, len(prompt):].tolist()


def test_probe_detects_mask_ignoring_model_and_falls_back(caplog):
    model = tiny_model("llama", seed=3)
    with caplog.at_level(logging.WARNING, logger="lookupdec"):
        target = TargetModel(MaskIgnoringModel(model))
    assert not target.tree_mode
    assert sum("one draft chain per step" in r.getMessage() for r in caplog.records) == 1
    assert TargetModel(model).tree_mode


@pytest.mark.parametrize("verify", ["chain", "auto"])
def test_chain_verification_is_exact(verify):
    model = tiny_model("llama", seed=4)
    wrapped = MaskIgnoringModel(model)
    engine = Engine(wrapped, FakeTokenizer(), EngineConfig(verify=verify, budget="fixed"))
    assert not engine.target.tree_mode
    for seed in range(5):
        g = torch.Generator().manual_seed(seed)
        base = torch.randint(3, 90, (6,), generator=g).tolist()
        prompt = base * 4  # repetitive: the n-gram proposer drafts
        gen = engine.generate(prompt, max_new_tokens=40)
        assert gen.token_ids == _greedy(model, prompt, 40)[: len(gen.token_ids)]
        assert gen.finish_reason in ("length", "eos")
