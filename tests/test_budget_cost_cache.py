"""The verify-cost curve: seeded by one forward per ``SEED_SIZES`` (or from the cache, or from
another bucket), learnt from every verify forward, cached per model architecture, device, dtype
and context bucket in a small bounded versioned file, and robust to a broken or unwritable
cache."""
from __future__ import annotations

import json
import os
import time

import pytest

from conftest import cached_tiny
from helpers import FakeTokenizer
from lookupdec import Engine, EngineConfig
from lookupdec.budget import COUNT_DECAY, SEED_SIZES, CostModel
from lookupdec.cost_cache import (COST_CACHE_VERSION, MAX_CACHED_CURVES, cost_cache_path, load_cached_cost,
                                  store_cached_cost)


@pytest.fixture
def cache_file(tmp_path, monkeypatch):
    path = tmp_path / "costs.json"
    monkeypatch.setenv("LOOKUPDEC_COST_CACHE", str(path))
    return path


def count_forwards(engine):
    """Wrap the target's verify forward with a counter."""
    calls = []
    verify = engine.target.verify
    engine.target.verify = lambda tree, *rest: (calls.append(len(tree)), verify(tree, *rest))[1]
    return calls


def test_seeded_by_a_few_forwards_learnt_online_then_cached(cache_file):
    model = cached_tiny("qwen2")
    engine = Engine(model, FakeTokenizer(), EngineConfig())
    calls = count_forwards(engine)
    gen = engine.generate([5, 6, 7, 5, 6, 7, 5, 6], max_new_tokens=20)
    assert engine.cost_origin == {64: "measured"}
    seed = [n for n in calls[: len(SEED_SIZES)]]
    assert seed == list(SEED_SIZES)  # no start-up tax beyond one forward per seed size
    assert len(calls) == len(SEED_SIZES) + gen.stats.steps  # then only the request's own verify forwards
    cost = engine.cost_model(40)
    steps = gen.stats.steps  # every verify forward was learnt from (counts decay per forward)
    assert sum(cost.counts) == pytest.approx(len(SEED_SIZES) * COUNT_DECAY**steps + (1 - COUNT_DECAY**steps) / (1 - COUNT_DECAY))
    doc = json.loads(cache_file.read_text())
    (key, entry), = doc["curves"].items()
    assert doc["version"] == COST_CACHE_VERSION and "qwen2-" in key and "|ctx64|" in key
    assert entry["sizes"] == cost.sizes and entry["counts"] == cost.counts
    again = Engine(model, FakeTokenizer(), EngineConfig())
    calls = count_forwards(again)
    assert again.cost_model(40).seconds == pytest.approx(cost.seconds) and again.cost_origin == {64: "cached"}
    again.cost_model(200)  # another context bucket: seeded from the nearest known one, no forward
    assert again.cost_origin[256] == "bucket 64" and calls == []
    other = Engine(cached_tiny("llama"), FakeTokenizer(), EngineConfig())  # another architecture
    other.cost_model(40)
    assert other.cost_origin == {64: "measured"}


def test_the_cache_keeps_the_latest_curves(cache_file):
    for i in range(MAX_CACHED_CURVES + 5):
        store_cached_cost(f"key{i}", CostModel([1, 4], [1.0, 1.5 + i]))
    curves = json.loads(cache_file.read_text())["curves"]
    assert len(curves) == MAX_CACHED_CURVES and "key0" not in curves and f"key{MAX_CACHED_CURVES + 4}" in curves
    assert load_cached_cost(f"key{MAX_CACHED_CURVES + 4}").seconds == [1.0, 1.5 + MAX_CACHED_CURVES + 4]


def test_generation_uses_the_curve_without_disturbing_the_output(cache_file):
    model = cached_tiny("llama")
    engine = Engine(model, FakeTokenizer(), EngineConfig())
    gen = engine.generate([5, 6, 7, 5, 6, 7, 5, 6], max_new_tokens=30)
    fixed = Engine(model, FakeTokenizer(), EngineConfig(budget="fixed")).generate([5, 6, 7, 5, 6, 7, 5, 6],
                                                                                   max_new_tokens=30)
    assert gen.token_ids == fixed.token_ids and engine.cost_origin


@pytest.mark.parametrize("content", ["{not json", json.dumps({"version": 99, "curves": {}}),
                                     json.dumps({"version": 1, "curves": {}}),
                                     json.dumps({"version": COST_CACHE_VERSION, "curves": {"x": {"sizes": "bad"}}})])
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
    Engine(cached_tiny("llama"), FakeTokenizer(), EngineConfig()).generate([5, 6, 7], max_new_tokens=4)
    assert caplog.text.count("the cache is off for this run") == 1, caplog.text  # one warning, nothing written
    assert os.listdir(tmp_path) == ["file"]


def test_kernel_forms_are_kept_for_the_next_process(cache_file):
    """The kernel forms an engine chose (``model/kernels.py``) go to the cost cache at the end
    of a request; an engine on another copy of the model (a new process's) starts from them
    before its first forward (``FormChooser.seed``: no trials in those buckets), and its output
    is the same."""
    from lookupdec.model.kernel_forms import forms_key, load_cached_forms
    from tiny_models import tiny_model

    first = Engine(tiny_model("llama", tie_word_embeddings=False), FakeTokenizer(), EngineConfig())
    if first.target.fast_head is None:
        pytest.skip("no fast kernels on this build")
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    for _ in range(12):  # until the head's trials of some bucket have ended (2 calls of each of its forms)
        gen = first.generate(prompt, max_new_tokens=40)
        if first.target.kernel_forms().get("head"):
            break
    key = forms_key(first.target.config.to_dict(), first.target.device, first.target.dtype, first.target.kernels)
    kept = load_cached_forms(key)
    assert kept == first.target.kernel_forms() and kept["head"]
    doc = json.loads(cache_file.read_text())
    assert set(doc) == {"version", "curves", "forms"} and doc["curves"]  # the curves kept beside them
    fresh = tiny_model("llama", tie_word_embeddings=False)  # another model object: its own choosers
    second = Engine(fresh, FakeTokenizer(), EngineConfig())
    assert second.target.kernel_forms() == kept  # seeded before any forward
    again = second.generate(prompt, max_new_tokens=40)
    assert again.token_ids == gen.token_ids


def test_kernel_forms_are_chosen_again_when_the_forms_on_offer_change():
    """Forms chosen without one on offer (a build before the skinny product, a CPU without its
    instruction set) are not seeded where it is: the key names the forms."""
    from lookupdec.model.kernel_forms import forms_key

    config = {"model_type": "llama", "hidden_size": 8}
    old = forms_key(config, "cpu", "torch.float32", "head+packed")
    assert old != forms_key(config, "cpu", "torch.float32", "head+packed+skinny")
    assert old == forms_key(config, "cpu", "torch.float32", "head+packed")


def test_kernel_forms_share_the_file_with_the_curves(cache_file, monkeypatch):
    """Curves and forms written in any order keep each other; the forms kept are bounded;
    another version's file, a broken section or ``LOOKUPDEC_COST_CACHE=off`` give no forms."""
    from lookupdec.model.kernel_forms import MAX_CACHED_FORMS, load_cached_forms, store_cached_forms

    store_cached_forms("setup", {"head": {"1,1": "linear"}})
    store_cached_cost("curve", CostModel([1, 4], [1.0, 1.5]))
    store_cached_forms("setup", {"head": {"1,1": "packed"}})
    assert load_cached_forms("setup")["head"] == {"1,1": "packed"} and load_cached_cost("curve").seconds == [1.0, 1.5]
    for i in range(MAX_CACHED_FORMS + 3):
        store_cached_forms(f"setup{i}", {"body": {"4,1": "linear"}})
    forms = json.loads(cache_file.read_text())["forms"]
    assert len(forms) == MAX_CACHED_FORMS and f"setup{MAX_CACHED_FORMS + 2}" in forms and "setup" not in forms
    assert load_cached_cost("curve") is not None
    cache_file.write_text(json.dumps({"version": COST_CACHE_VERSION, "curves": {}, "forms": ["not", "a", "dict"]}))
    assert load_cached_forms("setup0") == {}
    store_cached_forms("setup0", {"head": {"2,1": "linear"}})  # a broken section is replaced
    assert load_cached_forms("setup0") == {"head": {"2,1": "linear"}}
    cache_file.write_text(json.dumps({"version": COST_CACHE_VERSION - 1, "forms": {"setup0": {"head": {}}}}))
    assert load_cached_forms("setup0") == {}
    monkeypatch.setenv("LOOKUPDEC_COST_CACHE", "off")
    store_cached_forms("setup0", {"head": {"2,1": "linear"}})
    assert load_cached_forms("setup0") == {}
