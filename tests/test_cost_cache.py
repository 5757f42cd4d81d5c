"""The verify-cost curve: measured once per model architecture, device, dtype and context bucket
within the start-up budget, cached in a small file, reused by later engines, and robust to a
broken or unwritable cache."""
from __future__ import annotations

import json
import time

import pytest

from conftest import cached_tiny
from helpers import FakeTokenizer
from lookupdec import Engine, EngineConfig
from lookupdec.budget import CALIBRATION_SECONDS, CostModel, cost_cache_path


@pytest.fixture
def cache_file(tmp_path, monkeypatch):
    path = tmp_path / "costs.json"
    monkeypatch.setenv("LOOKUPDEC_COST_CACHE", str(path))
    return path


def test_measured_once_then_cached(cache_file):
    model = cached_tiny("qwen2")
    engine = Engine(model, FakeTokenizer(), EngineConfig())
    t = time.perf_counter()
    cost = engine.cost_model(40)
    assert time.perf_counter() - t < CALIBRATION_SECONDS + 1.0
    assert engine.cost_origin == {64: "measured"}
    assert cost.sizes[0] == 1 and cost.sizes[-1] <= 256 and cost(256) >= cost(1) > 0
    assert all(a <= b for a, b in zip(cost.seconds, cost.seconds[1:]))  # monotone
    doc = json.loads(cache_file.read_text())
    (key, entry), = doc["curves"].items()
    assert "qwen2-" in key and "|ctx64|" in key and entry["sizes"] == cost.sizes
    again = Engine(model, FakeTokenizer(), EngineConfig())
    assert again.cost_model(40).seconds == cost.seconds and again.cost_origin == {64: "cached"}
    again.cost_model(200)  # another context bucket: measured and added (capped at half the context)
    assert again.cost_origin[256] == "measured" and len(json.loads(cache_file.read_text())["curves"]) == 2
    other = Engine(cached_tiny("llama"), FakeTokenizer(), EngineConfig())  # another architecture
    other.cost_model(40)
    assert other.cost_origin == {64: "measured"}


def test_generation_uses_the_curve_without_disturbing_the_output(cache_file):
    model = cached_tiny("llama")
    engine = Engine(model, FakeTokenizer(), EngineConfig())
    gen = engine.generate([5, 6, 7, 5, 6, 7, 5, 6], max_new_tokens=30)
    fixed = Engine(model, FakeTokenizer(), EngineConfig(budget="fixed")).generate([5, 6, 7, 5, 6, 7, 5, 6],
                                                                                   max_new_tokens=30)
    assert gen.token_ids == fixed.token_ids and engine.cost_origin


@pytest.mark.parametrize("content", ["{not json", json.dumps({"version": 99, "curves": {}}),
                                     json.dumps({"version": 1, "curves": {"x": {"sizes": "bad"}}})])
def test_a_broken_cache_is_remeasured(cache_file, content):
    cache_file.write_text(content)
    engine = Engine(cached_tiny("llama"), FakeTokenizer(), EngineConfig())
    assert isinstance(engine.cost_model(10), CostModel) and engine.cost_origin == {64: "measured"}


def test_cache_can_be_switched_off_or_unwritable(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("LOOKUPDEC_COST_CACHE", "off")
    assert cost_cache_path() is None
    Engine(cached_tiny("llama"), FakeTokenizer(), EngineConfig()).cost_model(10)
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("LOOKUPDEC_COST_CACHE", str(blocker / "sub" / "costs.json"))  # parent is a file
    Engine(cached_tiny("llama"), FakeTokenizer(), EngineConfig()).cost_model(10)
    assert "could not write the cost cache" in caplog.text
