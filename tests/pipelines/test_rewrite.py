"""``lookupdec rewrite``: records in, one whole JSON line per record out, resumable after a kill.

The model is the real stories260K; outputs are short (a few tokens) so that the whole file runs
in well under a minute. Greedy outputs must equal plain ``transformers`` greedy decoding.
"""
from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from helpers import failing_call, hf_greedy, needs_stories
from lookupdec.cli import main
from lookupdec.pipelines import PromptFormat, ReadOptions, Record, ResultsFile, ResultsFileError, read_records
from lookupdec.pipelines.results import TMP_SUFFIX
from repo_paths import REPO, STORIES

INSTRUCTION = "Tell a short story."
KILL_RECORDS = 200  # enough for the killed run to be caught mid-way (later records take ~15 ms each)
KILL_AFTER_LINES = 5
POLL_S = 0.005
SUBPROCESS_TIMEOUT_S = 120


@pytest.fixture
def run(capsys, caplog):
    """``run(*argv)`` -> (exit status, stdout, stderr with the warnings logged)."""

    def run(*argv):
        caplog.clear()
        if "--batch-size" not in argv:  # one record at a time: these tests read lines in input order
            argv = (*argv, "--batch-size", "1")  # (auto, the default, batches when the cost curve says so)
        code = main(["rewrite", "--model", STORIES, *argv])
        out, err = capsys.readouterr()
        return code, out, caplog.text + err

    return run


def lines_of(path) -> list[dict]:
    """Every line parsed strictly: a torn or invalid line fails the test."""
    with open(path, "rb") as f:
        data = f.read()
    assert data == b"" or data.endswith(b"\n"), "the last line is torn"
    return [json.loads(line) for line in data.split(b"\n")[:-1]]


def write(path, text: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return str(path)


# -- reading records (no model) ---------------------------------------------------------------------
def test_text_file_records_by_lines_paragraphs_and_file(tmp_path):
    path = write(tmp_path / "app.log", "a\nb\n\nc\r\nd\ne\n")

    def read(**kw):
        return [(r.id, r.text) for r in read_records([path], ReadOptions(**kw))[0]]

    assert read() == [(f"{path}:1", "a"), (f"{path}:2", "b"), (f"{path}:4", "c"), (f"{path}:5", "d"),
                      (f"{path}:6", "e")]
    # the blank line 3 is skipped: "c" joins "b"'s group, not a group of its own
    assert read(lines_per_record=2) == [(f"{path}:1", "a\nb"), (f"{path}:4", "c\nd"), (f"{path}:6", "e")]
    assert read(split="paragraphs") == [(f"{path}:1", "a\nb"), (f"{path}:4", "c\nd\ne")]
    assert read(split="file") == [(path, "a\nb\n\nc\r\nd\ne\n")]


def test_jsonl_records_ids_and_bad_lines(tmp_path):
    path = write(tmp_path / "in.jsonl", "\n".join([
        '{"id": "x", "text": "one"}', '{"text": "two"}', "{not json", '{"body": "three"}', "[1, 2]",
        '{"id": 7, "text": "four"}', '{"id": {"a": 1}, "text": "five"}', '{"id": "x", "text": "again"}', ""]))
    records = read_records([path])[0]
    assert [(r.id, r.text, r.error is None) for r in records][:2] == [("x", "one", True), (f"{path}:2", "two", True)]
    errors = {r.id: r.error for r in records if r.error}
    assert errors[f"{path}:3"].startswith(f"{path}:3: not valid JSON")
    assert errors[f"{path}:4"] == f"{path}:4: no string field 'text'"
    assert errors[f"{path}:5"] == f"{path}:5: not a JSON object"
    assert "must be a string or an integer" in errors[f"{path}:7"]
    assert errors[f"{path}:8"] == f"{path}:8: duplicate id 'x' (first at {path}:1)"
    assert ("7", "four") in [(r.id, r.text) for r in records]
    assert len({r.id for r in records}) == len(records) == 8
    assert [r.text for r in read_records([path], ReadOptions(field="body"))[0] if r.error is None] == ["three"]


def test_a_byte_order_mark_is_not_text(tmp_path):
    """Files some editors save with a UTF-8 byte-order mark first: the first .jsonl line is a
    record (it was "not valid JSON"), the first text line has no invisible U+FEFF."""
    jsonl = tmp_path / "bom.jsonl"
    jsonl.write_bytes("\ufeff".encode() + b'{"id": "a", "text": "one"}\n')
    text = tmp_path / "bom.txt"
    text.write_bytes("\ufeff".encode() + b"first line\n")
    assert [(r.id, r.text, r.error) for r in read_records([str(jsonl)])[0]] == [("a", "one", None)]
    assert [r.text for r in read_records([str(text)])[0]] == ["first line"]


def test_folder_recursive_sorted_skips_binary_and_the_output(tmp_path):
    root = tmp_path / "docs"
    write(root / "b.txt", "bee\n")
    write(root / "a" / "z.md", "zed\n")
    write(root / "a" / "rec.jsonl", '{"text": "json"}\n')
    write(root / "__pycache__" / "x.txt", "cached\n")
    (root / "img.bin").write_bytes(b"\x89PNG\0\0")
    (root / "latin1.txt").write_bytes(b"caf\xe9\n")
    out = write(root / "out.jsonl", "")
    records, skipped = read_records([str(root)], ReadOptions(split="file"), ignore=[out])
    assert [r.id for r in records] == [f"{root}/a/rec.jsonl:1", f"{root}/a/z.md", f"{root}/b.txt"]
    assert sorted(s.split(" (")[0] for s in skipped) == [f"{root}/img.bin", f"{root}/latin1.txt"]


def test_bad_read_options():
    with pytest.raises(ValueError, match="split='words'"):
        ReadOptions(split="words")
    with pytest.raises(ValueError, match="lines_per_record=0"):
        ReadOptions(lines_per_record=0)


def test_template_placeholders():
    fmt = PromptFormat.from_template('{"a": 1} [{id}] {text} / {text}', "t.txt")
    assert fmt.prompt(Record("r1", "hi {id}", "f:1")) == '{"a": 1} [r1] hi {id} / hi {id}'
    assert PromptFormat.from_instruction("Do it.").prompt(Record("r", "x\n\n", "f")) == "Do it.\n\nx\n\nOutput:\n"
    with pytest.raises(ValueError, match=r"t.txt: the template has no \{text\}"):
        PromptFormat.from_template("no slot", "t.txt")


# -- the results file (no model) ----------------------------------------------------------------------
def test_results_file_cuts_a_torn_line_keeps_a_whole_one(tmp_path):
    path = str(tmp_path / "out.jsonl")
    write(tmp_path / "out.jsonl", '{"id": "a", "input_hash": "h", "output": "x"}\n{"id": "b", "input_hash": "h", "outp')
    with ResultsFile.open(path) as results:
        assert set(results.entries) == {"a"} and "torn" in results.repaired
        results.append({"id": "b", "input_hash": "h", "output": "y"})
    assert lines_of(path) == [{"id": "a", "input_hash": "h", "output": "x"}, {"id": "b", "input_hash": "h", "output": "y"}]
    with open(path, "ab") as f:
        f.write(b'{"id": "c", "input_hash": "h", "error": "e"}')  # complete, only the newline missing: kept
    with ResultsFile.open(path) as results:
        assert set(results.entries) == {"a", "b", "c"} and not results.entries["c"].ok
        results.drop(["c", "a"])
        assert set(results.entries) == {"b"}
        results.append({"id": "c", "input_hash": "h", "output": "z"})
    assert lines_of(path) == [{"id": "b", "input_hash": "h", "output": "y"}, {"id": "c", "input_hash": "h", "output": "z"}]
    assert not os.path.exists(path + TMP_SUFFIX)


@pytest.mark.parametrize("text, message", [
    ('{"id": "a", "input_hash": "h"}\nhello\n{"id": "b", "input_hash": "h"}\n', ":2: not a result line"),
    ('{"id": "a", "input_hash": "h"}\n{"id": "a", "input_hash": "h"}\n', "id 'a' is on lines 1 and 2"),
    # a dataset with string ids is not a results file: its lines were taken for done records
    ('{"id": "a", "text": "Lily had a dog."}\n', ":1: not a result line"),
    ('{"id": 3}\n', ":1: not a result line"),
    # a file that is not ours, its last line without a newline: refused whole, its last line kept
    ('{"id": 1, "text": "Lily had a dog."}\n{"id": 2, "text": "Tom had a cat."}', ":1: not a result line"),
    ('my notes\nimportant last line', ":1: not a result line"),
    ('important only line', ":1: not a result line .*nor the start of one"),
    ('{"id": "a", "input_hash": "h"}\n{"id": "b", "input_hash": "h"}\nnot ours', ":3: not a result line .*nor the start of one"),
])
def test_results_file_refuses_foreign_lines(tmp_path, text, message):
    path = write(tmp_path / "out.jsonl", text)
    with pytest.raises(ResultsFileError, match=message):
        ResultsFile.open(path)
    assert open(path).read() == text  # nothing cut


def test_results_file_one_writer_at_a_time(tmp_path):
    path = str(tmp_path / "out.jsonl")
    with ResultsFile.open(path) as results:
        with pytest.raises(ResultsFileError, match="another run is writing"):
            ResultsFile.open(path)
        results.drop([])
    with ResultsFile.open(path):
        pass


# -- the command --------------------------------------------------------------------------------------
@needs_stories
def test_outputs_equal_transformers_greedy(stories, tmp_path, run):
    texts = ["Lily saw a big dog.", "Tom had a red ball. He liked to play.", "The sun was hot."]
    source = write(tmp_path / "in.jsonl", "".join(json.dumps({"id": f"r{i}", "text": t}) + "\n"
                                                  for i, t in enumerate(texts)))
    out = str(tmp_path / "out.jsonl")
    code, _, err = run("--input", source, "--output", out, "--instruction", INSTRUCTION,
                           "--max-new-tokens", "12", "--token-ids")
    assert code == 0, err
    assert "3 records rewritten, 0 failed, 0 already done (of 3)" in err
    lines = lines_of(out)
    assert [line["id"] for line in lines] == ["r0", "r1", "r2"]
    _, tokenizer = stories
    for line, text in zip(lines, texts):
        want = hf_greedy(stories[0], stories[1](f"{INSTRUCTION}\n\n{text}\n\nOutput:\n").input_ids, 12)
        assert line["token_ids"] == want
        assert line["output"] == tokenizer.decode(want, skip_special_tokens=True)
        assert line["finish_reason"] == "length" and line["stats"]["new_tokens"] == 12
        assert set(line) == {"id", "input_hash", "job", "output", "finish_reason", "stats", "token_ids"}


@needs_stories
@pytest.mark.parametrize("name, text", [("empty.jsonl", ""), ("blank.txt", "\n\n  \n"), ("empty_dir/", None)])
def test_no_records_is_a_warning_not_silence(tmp_path, run, name, text):
    """An input with no record (an empty file, blank lines, an empty folder) exits 0 with an
    empty output and a warning naming the input (before: nothing said)."""
    path = tmp_path / name
    if text is None:
        path.mkdir()
    else:
        path.write_text(text, encoding="utf-8")
    out = tmp_path / "out.jsonl"
    code, _, err = run("--input", str(path), "--instruction", INSTRUCTION, "--output", str(out))
    assert code == 0 and lines_of(out) == [], err
    assert f"no records in {path}" in err and "0 records rewritten" in err


@needs_stories
def test_folder_with_template_and_split_file(tmp_path, run):
    write(tmp_path / "docs" / "b.txt", "Tom ran.\n")
    write(tmp_path / "docs" / "a" / "c.txt", "Lily sang.\n")
    template = write(tmp_path / "t.txt", "[{id}] Story: {text}Next:")
    out = str(tmp_path / "docs" / "out.jsonl")  # inside the input folder: never read as input
    code, out_json, err = run("--input", str(tmp_path / "docs"), "--output", out, "--template", template,
                                  "--split", "file", "--max-new-tokens", "3", "--json-summary", "--quiet")
    assert code == 0, err
    assert [line["id"] for line in lines_of(out)] == [str(tmp_path / "docs" / "a" / "c.txt"),
                                                      str(tmp_path / "docs" / "b.txt")]
    summary = json.loads(out_json)
    assert summary["done"] == 2 and summary["failed"] == 0 and summary["new_tokens"] == 6
    assert "rewritten" not in err  # --quiet: no summary line


@needs_stories
def test_rerun_skips_done_records_and_does_only_new_ones(tmp_path, run, monkeypatch):
    source = tmp_path / "story.txt"
    write(source, "Lily saw a cat.\nTom saw a dog.\nSue saw a bird.\n")
    out = str(tmp_path / "out.jsonl")
    args = ["--input", str(source), "--output", out, "--instruction", INSTRUCTION, "--max-new-tokens", "4"]
    assert run(*args)[0] == 0
    before = open(out, "rb").read()

    from lookupdec.engine import Engine

    def no_model(*a, **k):
        raise AssertionError("the model was loaded although every record is done")

    with monkeypatch.context() as m:
        m.setattr(Engine, "from_pretrained", no_model)
        code, _, err = run(*args)
    assert code == 0 and "0 records rewritten, 0 failed, 3 already done (of 3)" in err
    assert open(out, "rb").read() == before

    with open(source, "a") as f:
        f.write("Ben saw a fish.\nMia saw a frog.\n")
    code, _, err = run(*args)
    assert code == 0 and "2 records rewritten, 0 failed, 3 already done (of 5)" in err
    after = open(out, "rb").read()
    assert after.startswith(before)
    assert [line["id"] for line in lines_of(out)] == [f"{source}:{n}" for n in range(1, 6)]


@needs_stories
def test_corrupt_input_lines_are_reported_and_skipped(tmp_path, run):
    source = write(tmp_path / "in.jsonl", '{"text": "Lily saw a cat."}\n{"text": oops}\n{"txt": "x"}\n'
                                          '{"text": "Tom saw a dog."}\n')
    out = str(tmp_path / "out.jsonl")
    code, _, err = run("--input", source, "--output", out, "--instruction", INSTRUCTION,
                           "--max-new-tokens", "4")
    assert code == 1
    assert f"{source}:2: not valid JSON" in err and f"{source}:3: no string field 'text'" in err
    lines = {line["id"]: line for line in lines_of(out)}
    assert set(lines) == {f"{source}:{n}" for n in range(1, 5)}
    assert lines[f"{source}:2"]["error"].startswith(f"{source}:2: not valid JSON")
    assert "output" in lines[f"{source}:1"] and "output" in lines[f"{source}:4"]
    assert "2 records rewritten, 2 failed" in err


@needs_stories
def test_too_long_record_is_an_error_line_then_retried(tmp_path, run):
    long_text = "Lily and Tom played in the park with a big red ball. " * 12  # fits alone, not after the long instruction
    source = write(tmp_path / "in.jsonl", json.dumps({"id": "short", "text": "Tom saw a dog."}) + "\n"
                   + json.dumps({"id": "long", "text": long_text}) + "\n")
    out = str(tmp_path / "out.jsonl")
    base = ["--input", source, "--output", out, "--max-new-tokens", "4"]
    code, _, err = run(*base, "--instruction", "Please tell a story. " * 30)
    assert code == 1
    lines = {line["id"]: line for line in lines_of(out)}
    assert "context is 512 tokens" in lines["long"]["error"] and "output" in lines["short"]
    short_line = open(out).read().splitlines()[0]
    # a rerun redoes the failed record only (here it now fits) and keeps one line per id
    code, _, err = run(*base, "--instruction", "Go.")
    assert code == 0, err
    assert "1 records rewritten, 0 failed, 1 already done (of 2)" in err
    assert "1 results in" in err and "made by another job" in err and "e.g. line 1" in err  # another prompt
    code, _, err = run(*base, "--instruction", "Go.")
    assert code == 0 and "another job" in err and "e.g. line 1)" in err, err  # ("long" is this job's)
    assert "1 results in" in err
    text = open(out).read().splitlines()
    assert text[0] == short_line and [json.loads(t)["id"] for t in text] == ["short", "long"]
    assert json.loads(text[1])["finish_reason"] in ("length", "eos")


@needs_stories
@pytest.mark.parametrize("make_args, message", [
    (lambda p: ["--input", str(p / "missing.jsonl"), "--instruction", "x"], "missing.jsonl: no such file or folder"),
    (lambda p: ["--input", write(p / "b.bin", "a\0b"), "--instruction", "x"], "b.bin: binary file"),
    (lambda p: ["--input", write(p / "in.txt", "a"), "--template", write(p / "t.txt", "no slot")],
     "t.txt: the template has no {text} placeholder"),
    (lambda p: ["--input", write(p / "in.txt", "a"), "--template", str(p / "none.txt")], "none.txt: No such file"),
    (lambda p: ["--input", write(p / "in.txt", "a"), "--instruction", " "], "--instruction is empty"),
    (lambda p: ["--input", write(p / "in.txt", "a"), "--instruction", "x", "--temperature", "-1"], "temperature"),
    (lambda p: ["--input", write(p / "in.txt", "a"), "--instruction", "x", "--top-p", "1.5"], "top_p"),
    (lambda p: ["--input", write(p / "in.txt", "a"), "--instruction", "x", "--top-k", "0"], "top_k"),
    (lambda p: ["--input", write(p / "in.txt", "a"), "--instruction", "x", "--repetition-penalty", "nan"],
     "repetition_penalty"),
    (lambda p: ["--input", str(p / "out.jsonl"), "--instruction", "x"], "is the output file"),
])
def test_user_errors_are_one_line_exit_2(tmp_path, run, make_args, message):
    write(tmp_path / "out.jsonl", "")
    code, _, err = run(*make_args(tmp_path), "--output", str(tmp_path / "out.jsonl"))
    assert code == 2 and message in err and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("lookupdec: error:")


@needs_stories
def test_output_held_by_another_run_is_refused(tmp_path, run):
    source, out = write(tmp_path / "in.txt", "Lily."), str(tmp_path / "out.jsonl")
    with open(out, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        code, _, err = run("--input", source, "--output", out, "--instruction", "x")
    assert code == 2 and "another run is writing" in err
    assert run("--input", source, "--output", out, "--instruction", "x", "--max-new-tokens", "2")[0] == 0


@needs_stories
@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full")
def test_full_disk_is_one_line_exit_2(tmp_path, run):
    """``--output /dev/full``: the first write fails (ENOSPC), and so would the fsync on the way
    out (EINVAL): one line naming the output, exit 2, no traceback."""
    source = write(tmp_path / "in.txt", "Lily.\nTom.\n")
    code, out, err = run("--input", source, "--output", "/dev/full", "--instruction", "x", "--max-new-tokens", "2")
    assert code == 2 and "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("lookupdec: error:")]
    assert errors == [errors[-1]] and "--output /dev/full: cannot write (No space left on device)" in errors[0]
    assert err.strip().splitlines()[-1] == errors[0]


def test_failed_write_leaves_no_half_line(tmp_path, monkeypatch):
    """A write that stops part-way (the disk filled up) is cut back: the file keeps whole lines only."""
    import errno

    import lookupdec.pipelines.results as results_module

    path = str(tmp_path / "out.jsonl")
    with ResultsFile.open(path) as results:
        results.append({"id": "a", "input_hash": "h", "output": "x"})
    before = open(path, "rb").read()
    real_write, calls = os.write, []

    def write_half_then_fail(fd, data):
        calls.append(len(data))
        if len(calls) == 1:
            return real_write(fd, bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with ResultsFile.open(path) as results:
        monkeypatch.setattr(results_module.os, "write", write_half_then_fail)
        with pytest.raises(ResultsFileError, match="No space left"):
            results.append({"id": "b", "input_hash": "h", "output": "y" * 100})
        monkeypatch.setattr(results_module.os, "write", real_write)
    assert open(path, "rb").read() == before and len(calls) == 2


def test_help_explains_inputs_resuming_and_output(capsys):
    with pytest.raises(SystemExit):
        main(["rewrite", "--help"])
    text = capsys.readouterr().out
    for words in (".jsonl", "--split lines", "folders", "resuming", "exactly once", '"input_hash"', "exit status"):
        assert words in text


# -- a kill mid-run -----------------------------------------------------------------------------------
@needs_stories
@pytest.mark.parametrize("batch", ["1", "4"])
def test_sigkill_mid_run_then_resume_gives_every_record_once(tmp_path, run, batch):
    source = write(tmp_path / "stories.txt", "".join(f"Lily and Tom went to the park, day {i}. They played.\n"
                                                     for i in range(KILL_RECORDS)))
    ids = [f"{source}:{n}" for n in range(1, KILL_RECORDS + 1)]
    killed, reference = str(tmp_path / "killed.jsonl"), str(tmp_path / "reference.jsonl")
    args = ["--input", source, "--instruction", INSTRUCTION, "--max-new-tokens", "16", "--token-ids",
            "--batch-size", batch]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    stderr = tmp_path / "stderr.txt"
    with open(stderr, "wb") as err_file:  # a file, not a pipe: a full pipe would block the child
        proc = subprocess.Popen([sys.executable, "-m", "lookupdec", "rewrite", "--model", STORIES, *args,
                                 "--output", killed], cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=err_file)
    try:
        deadline = time.monotonic() + SUBPROCESS_TIMEOUT_S
        while _count_lines(killed) < KILL_AFTER_LINES:
            assert proc.poll() is None, stderr.read_text()
            assert time.monotonic() < deadline, "the run wrote no lines in time"
            time.sleep(POLL_S)
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=SUBPROCESS_TIMEOUT_S) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    done_before = lines_of(killed)  # every line whole after SIGKILL
    assert KILL_AFTER_LINES <= len(done_before) < KILL_RECORDS
    missing = next(i for i in ids if i not in {line["id"] for line in done_before})
    with open(killed, "ab") as f:  # and a torn line as a crash of the machine could leave
        f.write(json.dumps({"id": missing, "input_hash": "0", "output": "half"}).encode()[:30])

    code, _, err = run(*args, "--output", killed)
    assert code == 0, err
    assert "cut a torn last line" in err
    assert f"already done (of {KILL_RECORDS})" in err
    assert run(*args, "--output", reference)[0] == 0
    got, want = lines_of(killed), lines_of(reference)
    if batch == "1":
        assert [line["id"] for line in got] == ids  # each exactly once, in input order
    else:  # each exactly once, in the order records finished
        assert sorted(line["id"] for line in got) == sorted(ids) and len(got) == len(ids)
    assert got[: len(done_before)] == done_before
    outputs = {w["id"]: (w["output"], w["token_ids"]) for w in want}
    assert all((g["output"], g["token_ids"]) == outputs[g["id"]] for g in got)


def _count_lines(path: str) -> int:
    try:
        with open(path, "rb") as f:
            return f.read().count(b"\n")
    except FileNotFoundError:
        return 0


# -- batching -----------------------------------------------------------------------------------------
@needs_stories
@pytest.mark.parametrize("batch", ["3", "auto"])
def test_batched_run_equals_one_at_a_time(tmp_path, run, batch):
    """--batch-size N: the same outputs per id as one record at a time; every id exactly once."""
    source = write(tmp_path / "in.txt", "".join(f"Lily saw {i} big dogs. Tom saw {i % 3} cats.\n" for i in range(10))
                   + "\n")
    one, many = str(tmp_path / "one.jsonl"), str(tmp_path / "many.jsonl")
    args = ["--input", source, "--instruction", INSTRUCTION, "--max-new-tokens", "20", "--token-ids", "--stop", "Tom"]
    assert run(*args, "--output", one, "--batch-size", "1")[0] == 0
    code, _, err = run(*args, "--output", many, "--batch-size", batch)
    assert code == 0, err
    got, want = lines_of(many), lines_of(one)
    assert sorted(line["id"] for line in got) == sorted(line["id"] for line in want) and len(got) == 10
    by_id = {line["id"]: line for line in want}
    for line in got:
        assert (line["output"], line["token_ids"], line["finish_reason"]) == (
            by_id[line["id"]]["output"], by_id[line["id"]]["token_ids"], by_id[line["id"]]["finish_reason"])
    if batch == "3":
        assert "batches of 3" in err


@needs_stories
def test_batched_sampling_uses_each_records_seed(tmp_path, run):
    source = write(tmp_path / "in.txt", "".join(f"Sue had {i} red hats.\n" for i in range(6)))
    outs = []
    for batch in ("1", "4"):
        out = str(tmp_path / f"b{batch}.jsonl")
        assert run("--input", source, "--output", out, "--instruction", INSTRUCTION, "--max-new-tokens", "12",
                   "--temperature", "0.8", "--seed", "5", "--token-ids", "--batch-size", batch)[0] == 0
        outs.append({line["id"]: line["token_ids"] for line in lines_of(out)})
    assert outs[0] == outs[1]


@needs_stories
def test_every_sampling_option_reaches_each_record(stories, tmp_path, run):
    """--top-k, --top-p and --repetition-penalty (as in ``generate``) reach every record's
    generation, one at a time and batched: each output is ``Engine.generate`` with those values
    and the record's derived seed; without them the same seed gives other outputs (so the
    comparison can fail)."""
    from lookupdec import Engine, EngineConfig
    from lookupdec.pipelines import RewriteOptions

    texts = [f"Sue had {i} red hats and a big dog." for i in range(4)]
    source = write(tmp_path / "in.txt", "".join(t + "\n" for t in texts))
    base = ["--input", source, "--instruction", INSTRUCTION, "--max-new-tokens", "12", "--token-ids",
            "--temperature", "0.9", "--seed", "7"]
    extra = ["--top-k", "6", "--top-p", "0.85", "--repetition-penalty", "1.4"]
    outs = {}
    for name, args in (("plain", base), ("1", [*base, *extra]), ("3", [*base, *extra, "--batch-size", "3"])):
        out = str(tmp_path / f"{name}.jsonl")
        code, _, err = run(*args, "--output", out)
        assert code == 0, err
        outs[name] = {line["id"]: line["token_ids"] for line in lines_of(out)}
    assert outs["1"] == outs["3"] and len(outs["1"]) == len(texts)
    assert outs["plain"] != outs["1"]
    engine = Engine(*stories, EngineConfig())
    seeds = RewriteOptions(seed=7)
    for i, text in enumerate(texts):
        rid = f"{source}:{i + 1}"
        gen = engine.generate(f"{INSTRUCTION}\n\n{text}\n\nOutput:\n", max_new_tokens=12, temperature=0.9,
                              top_k=6, top_p=0.85, repetition_penalty=1.4, seed=seeds.record_seed(rid))
        assert outs["1"][rid] == list(gen.token_ids)


@needs_stories
def test_batched_prefill_failure_redoes_every_record(tmp_path, run, monkeypatch):
    """A prefill that fails while records join a batch (out of memory): the records then in
    flight are done one at a time, every one gets its line, exit 0."""
    from lookupdec.model.batch import BatchTarget

    failing = failing_call(BatchTarget.add, 2)
    monkeypatch.setattr(BatchTarget, "add", failing)
    source = write(tmp_path / "in.txt", "".join(f"Ann had {i} cats.\n" for i in range(3)))
    out = str(tmp_path / "out.jsonl")
    code, _, err = run("--input", source, "--output", out, "--instruction", INSTRUCTION, "--max-new-tokens", "6",
                       "--batch-size", "4")
    assert code == 0, err
    assert "3 records rewritten, 0 failed" in err and failing.calls >= 2
    assert sorted(line["id"] for line in lines_of(out)) == [f"{source}:{n}" for n in range(1, 4)]


@needs_stories
def test_batch_size_above_the_records_takes_as_many_rows_as_records(tmp_path, run):
    source = write(tmp_path / "in.txt", "Ann had a cat.\nTom had a dog.\n")
    code, _, err = run("--input", source, "--output", str(tmp_path / "o.jsonl"), "--instruction", INSTRUCTION,
                       "--max-new-tokens", "4", "--batch-size", "16")
    assert code == 0, err
    assert "batches of 2" in err  # each row reserves K/V memory: 16 for 2 records would waste 14


@needs_stories
def test_batch_rows_count_only_records_to_decode_and_chat_needs_a_template(tmp_path, run):
    """Input-error records take no row (3 good lines and 2 bad ones: batches of 3, not 5); and
    --chat with a model whose tokenizer has no chat template is one usage error before any
    record, not an error line per record."""
    source = write(tmp_path / "in.jsonl", '{"id": "a", "text": "Ann had a cat."}\nnot json\n'
                   '{"id": "b", "text": "Tom had a dog."}\n{"id": "c"}\n{"id": "d", "text": "Sue ran."}\n')
    code, _, err = run("--input", source, "--output", str(tmp_path / "o.jsonl"), "--instruction", INSTRUCTION,
                       "--max-new-tokens", "4", "--batch-size", "16")
    assert code == 1 and "batches of 3" in err and "2 failed" in err, err
    out = str(tmp_path / "chat.jsonl")
    code, _, err = run("--input", source, "--output", out, "--instruction", INSTRUCTION, "--chat")
    assert code == 2 and "no chat template" in err and err.count("\n") == 1, err
    assert not os.path.exists(out) or open(out).read() == ""


def test_a_record_with_no_line_is_an_error_exit(tmp_path, run, monkeypatch):
    """Should a bug ever lose a record (no line written), the run says so and exits 1."""
    rewrite_module = sys.modules["lookupdec.pipelines.rewrite"]  # (the package's `rewrite` is the function)
    monkeypatch.setattr(rewrite_module, "run_records", lambda *a, **k: None)  # writes nothing
    source = write(tmp_path / "in.txt", "a\nb\n")
    code, _, err = run("--input", source, "--output", str(tmp_path / "o.jsonl"), "--instruction", "x")
    assert code == 1 and "2 records got no line" in err


def test_batch_size_option_is_checked(tmp_path, run):
    source = write(tmp_path / "in.txt", "a\n")
    for flag in ("--batch-size", "--max-batch"):  # (--max-batch: serve's name for the same rows)
        for bad_value in ("0", "x", "65"):
            with pytest.raises(SystemExit) as exc:
                run("--input", source, "--output", str(tmp_path / "o.jsonl"), "--instruction", "x", flag, bad_value)
            assert exc.value.code == 2


def test_auto_batch_size_reads_the_cost_curve():
    from lookupdec.budget import CostModel
    from lookupdec.pipelines.rewrite import auto_batch_size

    assert auto_batch_size(CostModel([1, 2, 4, 8, 16], [1.0, 1.0, 1.1, 1.3, 2.5])) == 8
    assert auto_batch_size(CostModel([1, 2, 4, 8, 16], [1.0, 2.0, 4.0, 8.0, 16.0])) == 1  # rows cost all they bring
    assert auto_batch_size(CostModel([1, 2, 4, 8, 16], [1.0, 1.0, 1.0, 1.0, 1.0])) == 16
