"""Bad inputs to ``lookupdec rewrite`` (``lookupdec.pipelines.inputs``): a ``.jsonl`` line that
is not UTF-8, an id that another line's ``PATH:LINE`` already is, a lone surrogate in a record's
text or id. Each is an error line for that record and the run goes on (README, "Batch
rewriting"); what concerns the whole run (an ``--instruction`` UTF-8 cannot encode, a file
read twice) is one line, exit 2. Model: the real stories260K, a few tokens per record.
"""
from __future__ import annotations

import json

import pytest

from helpers import needs_stories
from lookupdec.cli import main
from lookupdec.pipelines import InputError, read_records
from lookupdec.validate import NOT_UNICODE
from repo_paths import STORIES

INSTRUCTION = "Tell a short story."


@pytest.fixture
def run(capsys, caplog):
    """``run(*argv)`` -> (exit status, stderr with the warnings logged); one record at a time."""

    def run(*argv):
        caplog.clear()
        code = main(["rewrite", "--model", STORIES, "--batch-size", "1", "--max-new-tokens", "3", *argv])
        return code, caplog.text + capsys.readouterr().err

    return run


def lines_of(path) -> dict:
    """Every line of a results file by id, parsed strictly (an id on two lines fails the test)."""
    with open(path, "rb") as f:
        data = f.read()
    assert data.endswith(b"\n"), "the last line is torn"
    lines = [json.loads(line) for line in data.split(b"\n")[:-1]]
    assert len({line["id"] for line in lines}) == len(lines), "an id on two lines"
    return {line["id"]: line for line in lines}


# -- a .jsonl line that is not UTF-8 -----------------------------------------------------------------
def test_a_line_not_utf8_is_one_failed_record(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'{"text": "one"}\n{"text": "caf\xe9"}\n{"text": "three"}\n')
    records = read_records([str(path)])[0]
    assert [(r.id, r.text, r.error) for r in records if r.error is None] == [
        (f"{path}:1", "one", None), (f"{path}:3", "three", None)]
    # the byte and its column (in characters, as "not valid JSON" counts): column 14 is the \xe9
    assert [r.error for r in records if r.error] == [f"{path}:2: not UTF-8 text (byte 0xe9 at column 14)"]


def test_a_jsonl_not_utf8_in_a_folder_is_still_skipped_whole(tmp_path):
    """In a folder, a file that is not UTF-8 text is skipped and counted (README), .jsonl included."""
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "in.jsonl").write_bytes(b'{"text": "one"}\n{"text": "caf\xe9"}\n')
    records, skipped = read_records([str(tmp_path / "d")])
    assert records == [] and skipped == [f"{tmp_path / 'd' / 'in.jsonl'} (not UTF-8 text (byte 29))"]


@needs_stories
def test_rewrite_goes_on_past_a_line_not_utf8(tmp_path, run):
    path, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    path.write_bytes(b'{"id": "a", "text": "Lily saw a cat."}\n\xff\xfe{"text": "x"}\n{"id": "c", "text": "Tom ran."}\n')
    code, err = run("--input", str(path), "--output", str(out), "--instruction", INSTRUCTION)
    assert code == 1, err
    lines = lines_of(out)
    assert set(lines) == {"a", f"{path}:2", "c"}
    assert "output" in lines["a"] and "output" in lines["c"]
    assert lines[f"{path}:2"]["error"] == f"{path}:2: not UTF-8 text (byte 0xff at column 1)"
    assert "2 records rewritten, 1 failed" in err


# -- an id that is another line's PATH:LINE ----------------------------------------------------------
def test_an_id_naming_another_line_makes_that_line_a_duplicate(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join([
        json.dumps({"id": f"{path}:3#2", "text": "one"}),  # the id line 3 would take next
        json.dumps({"id": f"{path}:3", "text": "two"}),  # the id line 3 has by position
        json.dumps({"text": "three"}),
        json.dumps({"id": "x", "text": "four"}),
        json.dumps({"id": f"{path}:6", "text": "five"}),
        json.dumps({"id": "x", "text": "six"}),  # its id and its position both taken
    ]) + "\n", encoding="utf-8")
    records = read_records([str(path)])[0]
    assert len({r.id for r in records}) == len(records) == 6
    failed = {r.id: r.error for r in records if r.error}
    assert failed == {f"{path}:3#3": f"{path}:3: duplicate id '{path}:3' (first at {path}:2)",
                      f"{path}:6#2": f"{path}:6: duplicate id 'x' (first at {path}:4)"}
    assert [r.text for r in records if r.error is None] == ["one", "two", "four", "five"]


def test_a_file_named_twice_is_still_one_line_error(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text('{"id": "a", "text": "one"}\n{"text": "two"}\n', encoding="utf-8")
    with pytest.raises(InputError, match=r"in.jsonl:1: read twice"):
        read_records([str(path), str(path)])
    with pytest.raises(InputError, match=r"in.jsonl:1: read twice"):
        read_records([str(tmp_path), str(path)])


@needs_stories
def test_rewrite_writes_the_duplicate_an_error_line(tmp_path, run):
    path, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    path.write_text(json.dumps({"id": f"{path}:2", "text": "Lily saw a cat."}) + "\n"
                    + json.dumps({"text": "Tom ran."}) + "\n", encoding="utf-8")
    args = ("--input", str(path), "--output", str(out), "--instruction", INSTRUCTION)
    code, err = run(*args)
    assert code == 1, err
    lines = lines_of(out)
    assert "output" in lines[f"{path}:2"]
    assert lines[f"{path}:2#2"]["error"] == f"{path}:2: duplicate id '{path}:2' (first at {path}:1)"
    code, err = run(*args)  # a rerun redoes the error line under the same id, the result kept
    assert code == 1 and set(lines_of(out)) == {f"{path}:2", f"{path}:2#2"}, err
    assert "0 records rewritten, 1 failed, 1 already done (of 2)" in err


# -- a lone surrogate ----------------------------------------------------------------------------------
def test_a_lone_surrogate_text_fails_with_the_servers_explanation(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text('{"id": "s", "text": "bad \\ud800 here"}\n{"id": "ok", "text": "fine"}\n', encoding="utf-8")
    records = read_records([str(path)])[0]
    assert [(r.id, r.error) for r in records] == [(f"{path}:1", f"{path}:1: text: {NOT_UNICODE}"), ("ok", None)]


@needs_stories
def test_rewrite_gives_lone_surrogates_an_error_line(tmp_path, run):
    path, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    path.write_text('{"id": "s", "text": "Lily \\ud800 saw"}\n{"id": "\\udc00", "text": "Tom ran."}\n'
                    '{"id": "ok", "text": "Sue sang."}\n', encoding="utf-8")
    template = tmp_path / "t.txt"
    template.write_text("[{id}] {text}", encoding="utf-8")  # the second id goes into its prompt
    code, err = run("--input", str(path), "--output", str(out), "--template", str(template))
    assert code == 1, err
    lines = lines_of(out)
    assert lines[f"{path}:1"]["error"] == f"{path}:1: text: {NOT_UNICODE}"
    assert lines["\udc00"]["error"] == f"{path}:2: prompt: {NOT_UNICODE}"
    assert "output" in lines["ok"] and "TypeError" not in err


@needs_stories
def test_an_instruction_with_a_lone_surrogate_is_one_line_exit_2(tmp_path, run):
    """An argument's undecodable byte (``--instruction $'caf\\xe9'`` in a UTF-8 locale) reaches
    Python as a lone surrogate: every prompt would fail, so the run does not start."""
    path, out = tmp_path / "in.txt", tmp_path / "out.jsonl"
    path.write_text("Lily saw a cat.\n", encoding="utf-8")
    code, err = run("--input", str(path), "--output", str(out), "--instruction", "caf\udce9")
    assert code == 2 and err.strip().splitlines() == [f"lookupdec: error: --instruction: {NOT_UNICODE}"]
    assert not out.exists() or out.read_bytes() == b""
