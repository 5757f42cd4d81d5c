"""The built-in model: its training pipeline at toy scale (runs, is reproducible from a seed,
exports a folder the engine loads), and — where the shipped weights are present — the model
itself (greedy identity with transformers, the CLI's default, FIM and chat tokens)."""
from __future__ import annotations

import json
import os
import random

import pytest
import torch

from lookupdec.demo import DRAFT_DIR, MODEL_DIR, data, resolve, train


@pytest.fixture(scope="module")
def toy_sources():
    sources = data.find_sources()
    kept, held = data.split_sources(sources)
    small = [s for s in kept if 2_000 < s.size < 20_000][:12]
    held = [s for s in held if s.size < 40_000][:2]
    assert small and held, "the standard library should be found"
    return small + held


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory, toy_sources):
    root = tmp_path_factory.mktemp("train")
    tok, streams = str(root / "tok"), str(root / "data")
    train.train_tokenizer(tok, vocab_size=400, sample_bytes=200_000, sources=toy_sources)
    info = train.encode_streams(tok, streams, sources=toy_sources)
    return root, tok, streams, info


def test_synthetic_documents_are_what_they_claim():
    rng = random.Random(0)
    code = "def area(width, height):\n    total = width * height\n    return total\n" * 4
    for _ in range(20):
        doc = data.edit_document(code, "shapes.py", rng)
        assert doc is not None  # this code always offers a change (names, lines)
        message, after = data._edit(code, random.Random(1))
        assert after != code and message
    fim = data.fim_document(code, rng)
    prefix, rest = fim[len(data.FIM_PREFIX):].split(data.FIM_SUFFIX)
    suffix, middle = rest.split(data.FIM_MIDDLE)
    assert prefix + middle + suffix == code  # PSM order holds the whole text
    lines = data.lines_document(code, rng)
    objects = [json.loads(line) for line in lines.split("JSON:\n")[1].splitlines()]
    assert all(o[next(k for k in o if k != "n")] in code for o in objects)


def test_held_out_split_is_by_path_only():
    sources = data.find_sources()
    a = data.split_sources(sources)[1]
    b = data.split_sources(list(reversed(sources)))[1]
    assert sorted(s.path for s in a) == sorted(s.path for s in b)


def test_toy_training_is_reproducible_and_exports_a_loadable_model(toy_run, tmp_path):
    root, tok, streams, info = toy_run
    assert info["train_tokens"] > 5_000 and info["heldout_tokens"] > 1_000
    runs = []
    for name in ("a", "b"):
        out = str(tmp_path / name)
        result = train.train_model(streams, tok, out, size="test", tokens=8 * 1024, batch_tokens=1024, lr=3e-3,
                                   warmup=2, eval_every=4, save_every=4, log=lambda s: None)
        runs.append([json.loads(line)["loss"] for line in open(os.path.join(out, "log.jsonl"))])
    assert runs[0] == runs[1]  # same seed, same losses
    assert runs[0][-1] < runs[0][0]  # it learns
    assert result["steps"] == 8
    exported = train.export(str(tmp_path / "a"), tok, str(tmp_path / "model"))
    from lookupdec import Engine

    engine = Engine.from_pretrained(exported, device="cpu", dtype="float32")
    gen = engine.generate("def f(x):\n    return x", max_new_tokens=8)
    assert len(gen.token_ids) == 8 or gen.finish_reason == "eos"


def test_builtin_alias():
    assert resolve("builtin") == MODEL_DIR and resolve("builtin-draft") == DRAFT_DIR
    assert resolve("some/folder") == "some/folder"


needs_weights = pytest.mark.skipif(not os.path.isfile(os.path.join(MODEL_DIR, "model.safetensors")),
                                   reason="built-in weights not present")


@needs_weights
def test_builtin_model_greedy_identity_with_transformers():
    from helpers import hf_greedy  # noqa: F401  (conftest puts tests/ on sys.path)

    from lookupdec import Engine
    from lookupdec.model import load

    model, tokenizer = load("builtin", device="cpu", dtype="float32")
    engine = Engine(model, tokenizer)
    prompts = ["def fibonacci(n):\n", "import os\n\n\ndef main():\n    path = os.path.join(",
               "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"]
    for prompt in prompts:
        ids = tokenizer(prompt).input_ids
        with torch.no_grad():
            ref = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=40,
                                 pad_token_id=tokenizer.pad_token_id)[0, len(ids):].tolist()
        got = engine.generate(ids, max_new_tokens=40).token_ids
        if tokenizer.eos_token_id in ref:
            ref = ref[: ref.index(tokenizer.eos_token_id) + 1]
        assert got == ref


@needs_weights
def test_builtin_pair_shares_the_tokenizer_and_fits_the_size_budget():
    from lookupdec.model import load, vocab_fingerprint

    (_, t1), (_, t2) = load("builtin"), load("builtin-draft")
    assert vocab_fingerprint(t1) == vocab_fingerprint(t2)
    size = sum(os.path.getsize(os.path.join(d, f)) for d in (MODEL_DIR, DRAFT_DIR) for f in os.listdir(d)
               if f.endswith(".safetensors"))
    assert size <= 20e6
    for token in (data.FIM_PREFIX, data.FIM_SUFFIX, data.FIM_MIDDLE, data.EOT):
        assert t1.convert_tokens_to_ids(token) != t1.unk_token_id and len(t1(token).input_ids) == 1
    assert t1.chat_template


@needs_weights
def test_cli_takes_the_builtin_alias(capsys):
    from lookupdec.cli import main

    assert main(["generate", "--model", "builtin", "--prompt", "def fibonacci(n):", "--max-new-tokens", "16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["token_ids"]) == 16 or out["finish_reason"] == "eos"
