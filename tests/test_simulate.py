"""The replay simulator: accepted paths, MAT on a copy task, the CLI, and bad input."""
import json

import pytest

from helpers import needs_llama_tokenizer
from lookupdec.cli import main
from lookupdec.config import EngineConfig
from lookupdec.proposers import build_proposers
from lookupdec.proposers.base import Draft
from lookupdec.simulate import accepted_path, replay
from lookupdec.tree import TokenTree
from repo_paths import LLAMA_SP


def test_accepted_path_follows_the_response():
    tree = TokenTree.from_drafts(0, [Draft.chain([1, 2, 3], [.9, .8, .7], "a"), Draft.chain([1, 4], [.9, .6], "b")],
                                 max_nodes=8, max_depth=8)
    assert [tree.token_ids[n] for n in accepted_path(tree, [1, 4, 9])] == [1, 4]
    assert accepted_path(tree, [5]) == []


def test_copy_task_accepts_many_tokens_per_step():
    body = list(range(10, 70))
    records = [{"id": "copy", "prompt_ids": [1] + body + [2], "response_ids": body}]
    result = replay(records, None, build_proposers(EngineConfig()), max_nodes=64, max_depth=64)
    # the first step has nothing to copy after token 2 but the bonus; then whole spans copy
    assert result["steps"] <= 3 and result["mat"] >= 20
    assert result["per_record"][0]["response_tokens"] == 60


def test_no_drafts_means_one_token_per_step():
    records = [{"prompt_ids": [1, 2, 3], "response_ids": [4, 5, 6, 7]}]
    result = replay(records, None, build_proposers(EngineConfig(proposers=())), max_nodes=16, max_depth=16)
    # the first token is the prefill's (as served): three steps for the other three
    assert result["mat"] == 1.0 and result["steps"] == 3


def test_cli_simulate_json(tmp_path, capsys):
    path = tmp_path / "records.jsonl"
    body = list(range(10, 50))
    path.write_text("\n".join(json.dumps({"id": f"r{i}", "prompt_ids": [1] + body, "response_ids": body})
                              for i in range(3)) + "\n")
    assert main(["simulate", "--input", str(path), "--budget", "32", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["records"] == 3 and out["mat"] > 5 and len(out["per_record"]) == 3
    assert {"draft_us_p50", "draft_us_p99", "mean_tree_nodes", "accepted_share_by_source"} <= set(out)


def test_cli_simulate_bad_line(tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt_ids": [1], "response_ids": [2]}\n{not json\n')
    assert main(["simulate", "--input", str(path)]) == 2
    assert "bad.jsonl:2" in capsys.readouterr().err


@needs_llama_tokenizer
def test_cli_simulate_missing_field(tmp_path, capsys):
    path = tmp_path / "missing.jsonl"
    path.write_text('{"id": "a", "prompt": "hello"}\n')
    assert main(["simulate", "--input", str(path), "--tokenizer", LLAMA_SP]) == 2
    assert "missing.jsonl:1: field 'response'" in capsys.readouterr().err


# -- bad inputs name FILE:LINE (issue 13) ----------------------------------------------------------
@needs_llama_tokenizer
@pytest.mark.parametrize("content, message", [
    (b'{"prompt_ids": [1], "response_ids": [2]}\n[1, 2]\n', "in.jsonl:2: expected a JSON object"),
    (b'"just a string"\n', "in.jsonl:1: expected a JSON object, found a JSON string"),
    (b'\n\n{"prompt": "a", "response": 5}\n', "in.jsonl:3: field 'response' must be a string"),
    (b'{"prompt_ids": [1], "response_ids": [2]}\n{"prompt_ids": [], "response_ids": [2]}\n', "in.jsonl:2: empty prompt"),
    (b'{"prompt_ids": [1, -4], "response_ids": [2]}\n', "in.jsonl:1: field 'prompt_ids' must be a list of token ids"),
    (b'{"prompt_ids": [1], "response_ids": "abc"}\n', "in.jsonl:1: field 'response_ids'"),
    (b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe binary", "in.jsonl:1: not UTF-8 text"),
])
def test_cli_simulate_bad_records_name_file_and_line(tmp_path, capsys, content, message):
    path = tmp_path / "in.jsonl"
    path.write_bytes(content)
    assert main(["simulate", "--input", str(path), "--tokenizer", LLAMA_SP]) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("lookupdec: error: ") and err.count("\n") == 1, err


def test_cli_simulate_missing_input(tmp_path, capsys):
    assert main(["simulate", "--input", str(tmp_path / "none.jsonl")]) == 2
    assert "--input" in capsys.readouterr().err


@needs_llama_tokenizer
def test_cli_simulate_empty_response_is_reported_not_dropped(tmp_path, capsys, caplog):
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps({"prompt": "Hello there", "response": ""}) + "\n"
                    + json.dumps({"prompt": "Hello there", "response": "General Kenobi"}) + "\n")
    assert main(["simulate", "--input", str(path), "--tokenizer", LLAMA_SP, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["records"] == 1 and out["skipped_empty_responses"] == [f"{path}:1"]
    assert f"{path}:1: empty response" in caplog.text


@needs_llama_tokenizer
def test_cli_simulate_retrieval_named_with_an_index(tmp_path, capsys):
    """`--proposers ngram,suffix,retrieval --index DIR` failed ("'retrieval' needs retrieval.index")."""
    from lookupdec.index import build_index

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    story = "The quick brown fox jumps over the lazy dog near the old river bank. " * 4
    (corpus / "a.txt").write_text(story)
    from lookupdec.model import load_tokenizer

    build_index([str(corpus)], tokenizer=load_tokenizer(LLAMA_SP), out=str(tmp_path / "idx"), chunk_tokens=16,
                progress=False)
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps({"prompt": "Story: The quick brown", "response": story[15:120]}) + "\n")
    for proposers in ("ngram,suffix,retrieval", "retrieval", "ngram,suffix"):
        assert main(["simulate", "--input", str(path), "--tokenizer", LLAMA_SP, "--proposers", proposers,
                     "--index", str(tmp_path / "idx"), "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert "retrieval" in out["proposers"] and out["accepted_share_by_source"].get("retrieval", 0) > 0, out
    assert out["proposers"] == ["ngram", "suffix", "retrieval"]
    assert main(["simulate", "--input", str(path), "--tokenizer", LLAMA_SP, "--proposers",
                 "ngram,retrieval"]) == 2
    assert "--proposers retrieval needs --index" in capsys.readouterr().err
