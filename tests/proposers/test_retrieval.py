"""The retrieval proposer and its integration: drafts are the corpus's own continuations, refresh
re-queries on new output, the engine stays identical to transformers greedy with an index, and
the CLI's index commands work and fail cleanly."""
from __future__ import annotations

import json
import os

import pytest

from helpers import needs_llama_tokenizer, needs_stories, run_cli
from lookupdec.config import EngineConfig, RetrievalConfig
from lookupdec.index import Index, IndexStoreError, build_index
from lookupdec.model import load_tokenizer
from lookupdec.proposers.retrieval import RetrievalProposer, drafts_after
from repo_paths import LLAMA_SP, STORIES

pytestmark = [needs_llama_tokenizer, needs_stories]

MODULE = "\n".join(
    f"def handler_{name}(request, retries={i}):\n"
    f"    payload = request.json()\n"
    f"    if payload.get('kind') != '{name}':\n"
    f"        raise ValueError('expected a {name} request, got ' + repr(payload))\n"
    f"    return dispatch_{name}(payload, retries=retries)\n"
    for i, name in enumerate(["alpha", "bravo", "charlie", "delta", "echo", "foxtrot"]))
OTHER = "The quick brown fox jumps over the lazy dog. " * 30


@pytest.fixture(scope="module")
def code_index(tmp_path_factory):
    root = tmp_path_factory.mktemp("retr")
    (root / "corpus").mkdir()
    (root / "corpus" / "handlers.py").write_text(MODULE)
    (root / "corpus" / "fox.txt").write_text(OTHER)
    out = root / "idx"
    build_index([str(root / "corpus")], tokenizer=load_tokenizer(LLAMA_SP), out=str(out), chunk_tokens=48, progress=False)
    return Index.open(str(out)), load_tokenizer(LLAMA_SP)


def test_drafts_continue_the_retrieved_text(code_index):
    index, tok = code_index
    ids = tok.encode(MODULE, add_special_tokens=False)
    cut = ids.index(tok.encode("charlie", add_special_tokens=False)[-1]) + 1  # inside handler_charlie's name
    proposer = RetrievalProposer(index, RetrievalConfig(index=index.path))
    proposer.start("r", ids[:cut])
    drafts = proposer.propose("r", ids[:cut], 32)
    assert drafts and drafts[0].source == "retrieval"
    chain, _ = drafts[0].best_chain()
    assert chain[:12] == ids[cut : cut + 12]
    assert all(0 < s <= 1 for d in drafts for s in d.scores)
    proposer.stop("r")
    with pytest.raises(ValueError, match="was not started"):
        proposer.propose("r", ids[:cut], 32)


def test_drafts_after_is_a_started_asked_stopped_request(code_index):
    """``drafts_after`` (what ``index query`` prints) gives the drafts of a fresh request."""
    index, tok = code_index
    ids = tok.encode(MODULE, add_special_tokens=False)
    cut = ids.index(tok.encode("charlie", add_special_tokens=False)[-1]) + 1
    config = RetrievalConfig(index=index.path, top_k=5)
    proposer = RetrievalProposer(index, config)
    proposer.start("r", ids[:cut])
    expected = proposer.propose("r", ids[:cut], 32)
    got = drafts_after(index, ids[:cut], config)
    assert [(d.token_ids, d.parents) for d in got] == [(d.token_ids, d.parents) for d in expected] and got


def test_nothing_retrieved_means_no_drafts_not_an_error(code_index):
    index, tok = code_index
    proposer = RetrievalProposer(index, RetrievalConfig(index=index.path))
    prompt = tok.encode("zebra", add_special_tokens=False)
    proposer.start("r", prompt)
    assert proposer.propose("r", prompt, 0) == []
    for d in proposer.propose("r", prompt, 16):  # whatever it finds is a valid draft
        assert len(d.token_ids) <= 16


def test_refresh_queries_again_with_new_output(code_index):
    index, tok = code_index
    cfg = RetrievalConfig(index=index.path, top_k=1, follow_chunks=0, refresh_every=8, query_tokens=16)
    proposer = RetrievalProposer(index, cfg)
    fox = tok.encode(OTHER, add_special_tokens=False)
    code = tok.encode(MODULE, add_special_tokens=False)
    proposer.start("r", fox[:16])
    first = proposer.retrieved_chunks("r")
    assert len(proposer.query_seconds) == 1 and all("fox" in index.document_name(c) for c in first)
    proposer.observe("r", code[:7])
    assert len(proposer.query_seconds) == 1  # not yet 8 new tokens
    proposer.observe("r", code[7:20])
    assert len(proposer.query_seconds) == 2
    added = set(proposer.retrieved_chunks("r")) - set(first)
    assert added and all("handlers" in index.document_name(c) for c in added)


def test_reference_tokens_are_capped(code_index):
    index, tok = code_index
    cfg = RetrievalConfig(index=index.path, top_k=50, max_reference_tokens=60, refresh_every=1)
    proposer = RetrievalProposer(index, cfg)
    ids = tok.encode(MODULE, add_special_tokens=False)
    proposer.start("r", ids[:30])
    for t in ids[30:80]:
        proposer.observe("r", [t])
    assert proposer._requests.get("r").reference_tokens == 60


def test_config_needs_an_index_for_retrieval():
    with pytest.raises(ValueError, match="'retrieval' needs retrieval.index"):
        EngineConfig(proposers=("ngram", "retrieval"))
    cfg = EngineConfig().with_index("somewhere")
    assert cfg.proposers == ("ngram", "suffix", "recycle", "retrieval") and cfg.retrieval.index == "somewhere"
    with pytest.raises(ValueError, match="top_k=0"):
        RetrievalConfig(top_k=0)


# -- the engine with an index (real stories260K) --------------------------------------------------
@pytest.fixture(scope="module")
def stories_corpus_index(tmp_path_factory, stories):
    """An index over the model's own greedy continuations: retrieval should draft them exactly."""
    model, tokenizer = stories
    root = tmp_path_factory.mktemp("stories")
    (root / "corpus").mkdir()
    prompts = ["Once upon a time, there was a little dog", "Tom had a red ball", "The sun was hot and"]
    for i, prompt in enumerate(prompts):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        out = model.generate(ids, do_sample=False, max_new_tokens=80)[0]
        (root / "corpus" / f"story{i}.txt").write_text(tokenizer.decode(out, skip_special_tokens=True))
    build_index([str(root / "corpus")], tokenizer=load_tokenizer(STORIES), out=str(root / "idx"), chunk_tokens=32, progress=False)
    return str(root / "idx"), prompts


def test_engine_with_index_is_identical_to_transformers_greedy(stories, stories_corpus_index):
    from lookupdec.engine import Engine

    model, tokenizer = stories
    path, prompts = stories_corpus_index
    engine = Engine(model, tokenizer, EngineConfig(proposers=(), budget="fixed").with_index(path))
    for prompt in prompts + ["A cat sat on the mat and"]:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        want = model.generate(ids, do_sample=False, max_new_tokens=60)[0, ids.shape[1]:].tolist()
        gen = engine.generate(prompt, max_new_tokens=60)
        assert gen.token_ids == want, prompt
        if prompt in prompts:  # the corpus holds this very continuation
            assert gen.stats.accepted_by_source.get("retrieval", 0) >= 30, gen.stats
            assert gen.stats.mean_accepted > 3


def test_engine_refuses_an_index_of_another_tokenizer(stories, code_index):
    from lookupdec.engine import Engine

    model, tokenizer = stories
    with pytest.raises(IndexStoreError, match=r"index built for tokenizer [0-9a-f]{16} .*tokenizer is [0-9a-f]{16}"):
        Engine(model, tokenizer, EngineConfig().with_index(code_index[0].path))
    with pytest.raises(IndexStoreError, match="no index folder here"):
        Engine.from_pretrained(STORIES, index="/nonexistent/index")


# -- CLI ------------------------------------------------------------------------------------------
def test_cli_index_build_info_query_verify(capsys, caplog, tmp_path):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "handlers.py").write_text(MODULE)
    (tmp_path / "c" / "image.png").write_bytes(b"\x89PNG\x00\x00")
    out = str(tmp_path / "idx")
    code, stdout, err = run_cli(capsys, "index", "build", str(tmp_path / "c"), "--tokenizer", LLAMA_SP, "--out", out,
                            "--chunk-tokens", "64")
    assert code == 0, err
    assert "chunks from 1 documents" in stdout and "skipped 1" in stdout
    assert "skipped 1 binary" in caplog.text + err and "image.png" in caplog.text + err
    code, stdout, _ = run_cli(capsys, "index", "info", out)
    assert code == 0 and "format_version 1" in stdout and "faiss.index" in stdout and "flat" in stdout
    code, stdout, _ = run_cli(capsys, "index", "info", out, "--json")
    assert json.loads(stdout)["counts"]["documents"] == 1
    code, stdout, _ = run_cli(capsys, "index", "query", out, "--text", "def handler_delta(request, retries=3):", "--k", "2")
    assert code == 0 and "#1  score" in stdout and "handlers.py" in stdout
    assert "best path" in stdout and "payload = request.json()" in stdout
    code, stdout, _ = run_cli(capsys, "index", "verify", out)
    assert code == 0 and "OK (5 files" in stdout
    with open(os.path.join(out, "chunks.npy"), "r+b") as f:
        f.seek(-1, os.SEEK_END)
        f.write(b"\x7f")
    code, _, err = run_cli(capsys, "index", "verify", out)
    assert code == 2 and "chunks.npy: SHA-256 differs" in err and "Traceback" not in err


@pytest.mark.parametrize("argv, message", [
    (["index", "build", "/nonexistent/corpus", "--tokenizer", LLAMA_SP, "--out", "{tmp}/x"], "no such file or folder"),
    (["index", "build", "{tmp}", "--tokenizer", "/nonexistent/tok.model", "--out", "{tmp}/x"], "tokenizer not found"),
    (["index", "build", "{tmp}", "--tokenizer", LLAMA_SP, "--out", "{tmp}/x", "--embedder", "word2vec"], "--embedder 'word2vec'"),
    (["index", "build", "{tmp}", "--tokenizer", LLAMA_SP, "--out", "{tmp}/x", "--embedder", "sentence-transformers:/nope"],
     "sentence-transformers embedder: /nope is not a folder"),
    (["index", "info", "{tmp}/missing"], "no index folder here"),
    (["index", "verify", "{tmp}"], "manifest.json: missing"),
    (["generate", "--model", STORIES, "--prompt", "hi", "--index", "{tmp}/missing"], "no index folder here"),
])
def test_cli_index_errors_are_one_line(capsys, tmp_path, argv, message):
    (tmp_path / "doc.txt").write_text("some text to index")
    code, _, err = run_cli(capsys, *[a.replace("{tmp}", str(tmp_path)) for a in argv])
    assert code == 2 and message in err and err.startswith("lookupdec: error:") and "Traceback" not in err
    assert not (tmp_path / "x").exists()


def test_cli_generate_with_wrong_tokenizer_index(capsys, code_index):
    code, _, err = run_cli(capsys, "generate", "--model", STORIES, "--prompt", "hi", "--index", code_index[0].path)
    assert code == 2 and "index built for tokenizer" in err


def test_cli_simulate_with_index(capsys, tmp_path, code_index):
    records = tmp_path / "r.jsonl"
    ids = MODULE.split("def handler_delta")
    records.write_text(json.dumps({"id": "a", "prompt": "# handlers\ndef handler_delta", "response": ids[1][:200]}) + "\n")
    code, out, _ = run_cli(capsys, "simulate", "--input", str(records), "--json")
    without = json.loads(out)["mat"]
    code, out, _ = run_cli(capsys, "simulate", "--input", str(records), "--index", code_index[0].path, "--json")
    result = json.loads(out)
    assert code == 0 and result["proposers"] == ["ngram", "suffix", "retrieval"]
    assert result["mat"] > 2 * without and result["retrieval_queries"] >= 1
