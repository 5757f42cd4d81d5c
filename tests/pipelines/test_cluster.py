"""``lookupdec rewrite --ray``: records shared among Ray workers, the driver alone writing.

A local Ray instance with 2 CPUs (started once for the module; the CLI joins it), the real
stories260K as the model, 200 short records over 4 files. Every run must give each id exactly
once, with the outputs of the single-engine run, whatever the workers, their number, a worker
killed mid-way or the driver killed and the run resumed.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from helpers import needs_stories
from lookupdec.cli import main
from lookupdec.pipelines import PromptFormat, ReadOptions, Record, ResultsFile, RewriteOptions, plan, read_records, rewrite
from lookupdec.pipelines.cluster import Shards
from repo_paths import REPO, STORIES

INSTRUCTION = "Tell a short story."
FILES, PER_FILE = 4, 50  # 200 records
MAX_NEW_TOKENS = 12
KILL_AFTER_LINES = 30
SUBPROCESS_TIMEOUT_S = 180


def outputs(path) -> dict[str, str]:
    """id -> output, failing on a torn line, an error line or an id written twice."""
    with open(path, "rb") as f:
        data = f.read()
    assert data == b"" or data.endswith(b"\n"), "the last line is torn"
    out = {}
    for raw in data.split(b"\n")[:-1]:
        line = json.loads(raw)
        assert "error" not in line, line
        assert line["id"] not in out, f"id {line['id']} written twice"
        out[line["id"]] = line["output"]
    return out


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("logs")
    paths = []
    for f in range(FILES):
        path = folder / f"app{f}.log"
        path.write_text("".join(f"{f}-{i} user{i % 7} opened session {i * 13 % 97} on host{f}\n"
                                for i in range(PER_FILE)))
        paths.append(str(path))
    return paths


@pytest.fixture(scope="module")
def reference(inputs, tmp_path_factory):
    """The single-engine run's outputs, by id."""
    if not os.path.isdir(STORIES):
        pytest.skip("../shared/models/stories260K is absent")
    out = tmp_path_factory.mktemp("ref") / "out.jsonl"
    assert main(["rewrite", "--model", STORIES, "--input", *inputs, "--output", str(out), "--instruction",
                 INSTRUCTION, "--max-new-tokens", str(MAX_NEW_TOKENS), "--batch-size", "1", "--quiet"]) == 0
    got = outputs(out)
    assert len(got) == FILES * PER_FILE
    return got


@pytest.fixture(scope="module")
def ray_local():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.WARNING)
    yield ray
    ray.shutdown()


def ray_argv(inputs, out, *more):
    return ["rewrite", "--model", STORIES, "--input", *inputs, "--output", str(out), "--instruction", INSTRUCTION,
            "--max-new-tokens", str(MAX_NEW_TOKENS), "--quiet", "--ray", *more]


# -- without Ray ----------------------------------------------------------------------------------
def test_ray_without_the_extra_is_a_one_line_error(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    code = main(["rewrite", "--input", str(tmp_path / "missing.log"), "--output", str(tmp_path / "o.jsonl"),
                 "--instruction", "x", "--ray"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and 'pip install "lookupdec[ray]"' in err, err
    assert not (tmp_path / "o.jsonl").exists()


def test_ray_flags_need_ray(capsys, tmp_path):
    code = main(["rewrite", "--input", "x.log", "--output", str(tmp_path / "o.jsonl"), "--instruction", "x",
                 "--ray-workers", "2"])
    assert code == 2 and "--ray-workers needs --ray" in capsys.readouterr().err


def records(*groups: tuple[str, int]) -> list[Record]:
    return [Record(f"{g}{i}", "t", f"{g}:{i}", group=g) for g, n in groups for i in range(1, n + 1)]


def ids(rs) -> list[str]:
    return [r.id for r in rs]


def test_shards_keep_a_group_with_one_worker_and_steal_only_when_idle():
    shards = Shards(records(("a", 4), ("b", 4), ("c", 2)), "affinity")
    assert ids(shards.take(0, 2)) == ["a1", "a2"]
    assert ids(shards.take(1, 2)) == ["b1", "b2"]  # a is 0's: 1 opens a new group
    assert ids(shards.take(0, 3)) == ["a3", "a4", "c1"]  # its own group first, then a new one
    assert ids(shards.take(1, 2)) == ["b3", "b4"]
    assert ids(shards.take(1, 2)) == ["c2"]  # nothing of its own left: the tail of 0's group
    assert len(shards) == 0 and shards.take(0, 5) == []


def test_shards_steal_from_the_tail_of_the_largest_group():
    shards = Shards(records(("a", 6)), "affinity")
    assert ids(shards.take(0, 2)) == ["a1", "a2"]
    assert ids(shards.take(1, 2)) == ["a5", "a6"]  # input order within the bite
    assert ids(shards.take(0, 5)) == ["a3", "a4"]


def test_shards_give_back_a_dead_workers_records_in_order():
    shards = Shards(records(("a", 4), ("b", 2)), "affinity")
    first = shards.take(0, 2)
    assert ids(shards.take(1, 1)) == ["b1"]
    shards.give_back(list(reversed(first)), 0)  # 0 died: its records first again, its group free
    assert ids(shards.take(1, 1)) == ["b2"]  # 1 finishes its own group first
    assert ids(shards.take(1, 3)) == ["a1", "a2", "a3"]  # then takes the dead worker's, in order
    assert shards.owner["a"] == 1


def test_shards_spread_ignores_groups():
    shards = Shards(records(("a", 2), ("b", 2)), "spread")
    assert ids(shards.take(0, 1)) == ["a1"]
    assert ids(shards.take(1, 2)) == ["a2", "b1"]
    assert ids(shards.take(0, 2)) == ["b2"]


def test_shards_random_is_a_seeded_shuffle_of_every_record():
    rs = records(("a", 20), ("b", 20))
    taken = [ids(Shards(rs, "random").take(w, 40)) for w in (0, 1)]
    assert taken[0] == taken[1] != ids(rs)  # the same order every time, not the input's
    assert sorted(taken[0]) == sorted(ids(rs))


def test_records_are_grouped_by_file_or_by_a_jsonl_field(tmp_path):
    log = tmp_path / "a.log"
    log.write_text("x\ny\n")
    data = tmp_path / "b.jsonl"
    data.write_text('{"text": "p", "src": "web"}\n{"text": "q", "src": 3}\n{"text": "r"}\n')
    got = read_records([str(log), str(data)], ReadOptions(group_by="src"))[0]
    assert [r.group for r in got] == [str(log), str(log), "web", "3", str(data)]
    assert {r.group for r in read_records([str(data)])[0]} == {str(data)}


# -- on a local Ray instance ------------------------------------------------------------------------------
@needs_stories
def test_two_workers_equal_the_single_engine_run(ray_local, inputs, reference, tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    assert main(ray_argv(inputs, out, "--ray-workers", "2", "--batch-size", "4", "--json-summary")) == 0
    summary = json.loads(capsys.readouterr().out)
    assert outputs(out) == reference
    assert summary["done"] == FILES * PER_FILE and summary["workers"] == 2 and summary["batch_size"] == 4


def rewrite_killing_a_worker(inputs, out: str, options, after_lines: int = KILL_AFTER_LINES):
    """``rewrite`` on Ray with ``options``; the first worker to start is SIGKILLed (as the OOM
    killer does) once ``after_lines`` lines are written. Returns (summary, workers started, lines
    written at the kill)."""
    from lookupdec.pipelines.cluster import EngineSpec, RayRewrite

    started: list[dict] = []
    killed: list[int] = []

    def kill_one_worker_midway():
        deadline = time.monotonic() + SUBPROCESS_TIMEOUT_S
        while time.monotonic() < deadline:
            lines = sum(1 for _ in open(out, "rb")) if os.path.exists(out) else 0
            if lines >= after_lines and started:
                os.kill(started[0]["pid"], signal.SIGKILL)
                killed.append(lines)
                return
            time.sleep(0.002)

    watcher = threading.Thread(target=kill_one_worker_midway, daemon=True)
    watcher.start()
    todo = read_records(inputs)[0]
    with ResultsFile.open(out) as results:
        summary = rewrite(None, plan(todo, results), PromptFormat.from_instruction(INSTRUCTION), results,
                          RewriteOptions(max_new_tokens=MAX_NEW_TOKENS, batch_size=2),
                          cluster=RayRewrite(EngineSpec.of(STORIES), options, on_start=started.append))
    watcher.join(timeout=5)
    assert killed and killed[0] < FILES * PER_FILE - 20, "the kill came too late to test anything"
    return summary, started


@needs_stories
def test_the_last_worker_dying_ends_the_run_with_error_lines_and_a_rerun_finishes(ray_local, inputs, reference,
                                                                                   tmp_path, capsys):
    from lookupdec.pipelines.cluster import RayOptions

    out = str(tmp_path / "out.jsonl")
    summary, started = rewrite_killing_a_worker(inputs, out, RayOptions(workers=1, max_restarts=0))
    assert len(started) == 1
    assert summary.failed > 0 and summary.done + summary.failed == FILES * PER_FILE  # ended, every id has a line
    lines = [json.loads(line) for line in open(out, encoding="utf-8")]
    assert len({line["id"] for line in lines}) == len(lines) == FILES * PER_FILE
    assert all("every Ray worker died" in line["error"] for line in lines if "error" in line)
    # the rerun redoes the failed records only
    assert main(ray_argv(inputs, out, "--ray-workers", "2", "--batch-size", "2", "--json-summary")) == 0
    printed = capsys.readouterr().out
    again = json.loads(printed.strip().splitlines()[-1])
    assert again["done"] == summary.failed and again["skipped"] == summary.done
    assert outputs(out) == reference


def test_workers_that_cannot_load_the_model_are_a_one_line_error(ray_local, inputs, tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    code = main(["rewrite", "--model", str(tmp_path / "no-model"), "--input", inputs[0], "--output", str(out),
                 "--instruction", INSTRUCTION, "--quiet", "--ray", "--ray-workers", "1"])
    err = capsys.readouterr().err
    assert code == 2 and "no Ray worker could start" in err and "no-model" in err, err
    assert "Traceback" not in err
    assert out.read_text() == ""  # nothing written; a rerun with the right model does every record


@needs_stories
def test_a_worker_killed_midway_has_its_records_redone(ray_local, inputs, reference, tmp_path, caplog):
    from lookupdec.pipelines.cluster import RayOptions

    out = str(tmp_path / "out.jsonl")
    with caplog.at_level(logging.WARNING, "lookupdec"):
        summary, started = rewrite_killing_a_worker(inputs, out, RayOptions(workers=2))
    assert f"Ray worker {started[0]['number']} stopped" in caplog.text
    assert len(started) == 3  # a replacement joined
    assert summary.done == FILES * PER_FILE and summary.failed == 0
    assert outputs(out) == reference


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@needs_stories
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT], ids=["SIGKILL", "Ctrl-C"])
def test_resume_after_the_driver_is_killed_or_interrupted(ray_local, inputs, reference, tmp_path, sig):
    out = tmp_path / "out.jsonl"
    argv = ray_argv(inputs, out, "--ray-workers", "2", "--batch-size", "1", "--max-new-tokens", "48")
    # a foreground command's Ctrl-C: SIGINT at its default even where this test runs as a background
    # job (which inherits it ignored, and so would the driver)
    proc = subprocess.Popen([sys.executable, "-m", "lookupdec", *argv], cwd=REPO, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + SUBPROCESS_TIMEOUT_S
        lines = 0
        while time.monotonic() < deadline and proc.poll() is None:
            lines = sum(1 for _ in open(out, "rb")) if out.exists() else 0
            if lines >= 2:  # early: a test process slowed by a busy machine still signals mid-run
                break
            time.sleep(0.005)
        assert proc.poll() is None and lines >= 2, "the run ended (or never wrote) before the kill"
        proc.send_signal(sig)  # the driver alone (SIGKILL: its Ray instance is left to notice)
        code = proc.wait(timeout=60)
        if sig == signal.SIGINT:  # Ctrl-C: exit status 130, the workers and the local Ray instance stopped
            assert code == 130
            deadline = time.monotonic() + 30
            while group_alive(proc.pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not group_alive(proc.pid), "Ray processes outlived the interrupted run"
    finally:
        time.sleep(1)
        try:  # what the killed driver's local Ray instance left behind
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    partial = len(open(out, "rb").read().split(b"\n")) - 1
    assert partial < FILES * PER_FILE
    # the rerun (on the module's Ray instance) does the rest; the 48-token outputs are another run's
    assert main([*argv, "--json-summary"]) == 0
    got = outputs(out)
    assert set(got) == set(reference)
    single = tmp_path / "single.jsonl"
    some = [inputs[0]]
    assert main(["rewrite", "--model", STORIES, "--input", *some, "--output", str(single), "--instruction",
                 INSTRUCTION, "--max-new-tokens", "48", "--batch-size", "1", "--quiet"]) == 0
    assert all(got[rid] == text for rid, text in outputs(single).items())
