"""The replay simulator: accepted paths, MAT on a copy task, the CLI, and bad input."""
import json
from pathlib import Path

import pytest

from lookupdec.cli import main
from lookupdec.config import EngineConfig
from lookupdec.proposers import build_proposers
from lookupdec.proposers.base import Draft
from lookupdec.simulate import accepted_path, replay
from lookupdec.tree import TokenTree


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
    assert result["mat"] == 1.0 and result["steps"] == 4


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


LLAMA2_TOKENIZER = Path(__file__).resolve().parents[2] / "shared/data/tokenizers/llama2/tokenizer.model"


@pytest.mark.skipif(not LLAMA2_TOKENIZER.exists(), reason="../shared tokenizer absent")
def test_cli_simulate_missing_field(tmp_path, capsys):
    path = tmp_path / "missing.jsonl"
    path.write_text('{"id": "a", "prompt": "hello"}\n')
    assert main(["simulate", "--input", str(path), "--tokenizer", str(LLAMA2_TOKENIZER)]) == 2
    assert "record a" in capsys.readouterr().err
