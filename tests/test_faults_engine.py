"""One engine used from two places, and the cost cache at paths that are not regular files.

The contract (README, "Python API"): an ``Engine`` runs one request at a time. Other threads'
requests wait their turn (each output is the one it has alone); a second request on the same
thread while a stream of it is neither exhausted nor closed raises ``EngineBusy`` naming that
stream, never gives another request's text. The cost cache (``lookupdec/cache_file.py``) reads and
replaces only regular files; anything else is one warning and the cache off for the run.
"""
from __future__ import annotations

import os
import stat
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

from conftest import cached_tiny
from helpers import FakeTokenizer
from lookupdec import Engine, EngineConfig
from lookupdec.engine import EngineBusy
from lookupdec.validate import ParamError
from repo_paths import REPO
PROMPTS = ([5, 6, 7, 8, 5, 6], [9, 3, 9, 3, 11])


@pytest.fixture(scope="module")
def engine():
    return Engine(cached_tiny("llama"), FakeTokenizer(), EngineConfig())


@pytest.fixture(scope="module")
def alone(engine):
    return [engine.generate(p, max_new_tokens=24).token_ids for p in PROMPTS]


def test_two_streams_read_in_turn_raise_naming_the_live_one(engine, alone):
    a = iter(engine.stream(PROMPTS[0], max_new_tokens=24))
    b = iter(engine.stream(PROMPTS[1], max_new_tokens=24))
    next(a)
    with pytest.raises(EngineBusy, match=r"still running the stream of \[5, 6, 7, 8, 5, 6\] on this thread"):
        next(b)
    with pytest.raises(EngineBusy, match="stream of"):  # a request after it on this thread: the same
        engine.generate(PROMPTS[1], max_new_tokens=4)
    rest = list(a)  # the first stream goes on untouched
    assert a.gi_frame is None and rest is not None
    assert engine.turn.holder is None
    assert engine.generate(PROMPTS[0], max_new_tokens=24).token_ids == alone[0]


def test_a_closed_or_dropped_stream_lets_the_engine_go(engine, alone):
    stream = engine.stream(PROMPTS[0], max_new_tokens=24)
    pieces = iter(stream)
    next(pieces)
    stream.close()
    assert engine.turn.holder is None
    with engine.stream(PROMPTS[1], max_new_tokens=24) as s:
        next(iter(s))
    assert engine.turn.holder is None
    pieces = iter(engine.stream(PROMPTS[1], max_new_tokens=24))
    next(pieces)
    del pieces  # (CPython closes a generator that nothing refers to)
    assert engine.generate(PROMPTS[1], max_new_tokens=24).token_ids == alone[1]


def test_a_batch_step_on_the_thread_of_a_live_stream_raises(engine):
    from lookupdec.batch import BatchDecoder, BatchRequest

    pieces = iter(engine.stream(PROMPTS[0], max_new_tokens=24))
    next(pieces)
    decoder = BatchDecoder(engine, 2)
    decoder.submit(BatchRequest(PROMPTS[1], 4))
    with pytest.raises(EngineBusy):
        decoder.step()
    pieces.close()
    assert decoder.run()[0].token_ids == engine.generate(PROMPTS[1], max_new_tokens=4).token_ids


def test_generate_from_several_threads_gives_each_its_own_output(engine, alone):
    results, errors = {}, []

    def run(i):
        try:
            results[i] = engine.generate(PROMPTS[i % 2], max_new_tokens=24).token_ids
        except Exception as exc:  # noqa: BLE001 -- reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert [results[i] for i in range(6)] == [alone[i % 2] for i in range(6)]


def test_a_stream_and_a_batch_on_two_threads_each_as_alone(engine, alone):
    out = {}

    def batch():
        out["batch"] = [g.token_ids for g in engine.generate_batch(list(PROMPTS), max_new_tokens=24)]

    thread = threading.Thread(target=batch)
    pieces = iter(engine.stream(PROMPTS[1], max_new_tokens=24))
    thread.start()
    out["stream"] = list(pieces)
    thread.join(timeout=120)
    assert out["batch"] == alone


@pytest.mark.parametrize("make", [np.array, torch.tensor, lambda p: np.array(p, dtype=np.int32), tuple])
def test_generate_batch_takes_the_prompts_generate_takes(engine, make):
    want = engine.generate(PROMPTS[0], max_new_tokens=6).token_ids
    # (between two others: finding its row compared it with another sequence, and so its array)
    got = engine.generate_batch([list(PROMPTS[1]), make(PROMPTS[0]), list(PROMPTS[1])], max_new_tokens=6)
    assert got[1].token_ids == want


@pytest.mark.parametrize("prompt, says", [
    ([1, 2.7], "2.7 is not an integer token id"),
    ([True, 3], "True is not an integer token id"),
    (b"Once", "got bytes"),
    (np.array([[1, 2]]), "shape (1, 2)"),
])
def test_bad_token_id_prompts_are_refused_alone_and_in_a_batch(engine, prompt, says):
    with pytest.raises(ParamError, match=f"^prompts\\[1\\]: .*{__import__('re').escape(says)}") as err:
        engine.generate_batch([PROMPTS[0], prompt], max_new_tokens=4)
    assert err.value.field == "prompts[1]"
    with pytest.raises(ParamError, match=__import__("re").escape(says)):
        engine.generate(prompt, max_new_tokens=4)


def test_a_too_long_token_id_prompt_says_prompt_not_chat_template(engine):
    limit = engine.target.max_context
    with pytest.raises(ParamError) as err:
        engine.generate_batch([[5] * limit], max_new_tokens=4)
    assert "chat template" not in str(err.value) and f"prompt has {limit} tokens" in str(err.value)


# -- the cost cache at paths that are not regular files -------------------------------------

CACHE_RUN = r"""
import logging, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))  # reading a device to its end would pass this
sys.path.insert(0, "tests/support")
logging.basicConfig(level=logging.WARNING)
from helpers import FakeTokenizer
from lookupdec import Engine, EngineConfig
from tiny_models import tiny_model
e = Engine(tiny_model("llama", tie_word_embeddings=False), FakeTokenizer(), EngineConfig())
print(e.generate([5, 6, 7, 8], max_new_tokens=8).token_ids)
"""


def _run_with_cache(path) -> subprocess.CompletedProcess:
    env = os.environ | {"LOOKUPDEC_COST_CACHE": str(path), "PYTHONPATH": REPO}
    return subprocess.run([sys.executable, "-c", CACHE_RUN], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full")
def test_a_cache_at_an_endless_device_is_not_read_nor_replaced():
    before = os.stat("/dev/full")
    done = _run_with_cache("/dev/full")
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("is not a regular file") == 1, done.stderr
    after = os.stat("/dev/full")
    assert stat.S_ISCHR(after.st_mode) and after.st_rdev == before.st_rdev


def test_a_cache_at_a_fifo_neither_blocks_nor_is_replaced(tmp_path):
    fifo = tmp_path / "cache.json"
    os.mkfifo(fifo)
    done = _run_with_cache(fifo)
    assert done.returncode == 0, done.stderr
    assert stat.S_ISFIFO(os.stat(fifo).st_mode) and os.listdir(tmp_path) == ["cache.json"]


def test_a_cache_at_a_device_node_is_left_a_device(tmp_path):
    node = tmp_path / "null"
    try:
        os.mknod(node, 0o666 | stat.S_IFCHR, os.makedev(1, 3))  # /dev/null's numbers
    except (PermissionError, OSError):
        pytest.skip("mknod needs root")
    done = _run_with_cache(node)
    assert done.returncode == 0, done.stderr
    assert stat.S_ISCHR(os.stat(node).st_mode) and os.listdir(tmp_path) == ["null"]


def test_a_cache_at_a_folder_warns_once_and_leaves_nothing(tmp_path):
    folder = tmp_path / "cache"
    folder.mkdir()
    done = _run_with_cache(folder)
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("cost cache") == 1, done.stderr
    assert os.listdir(tmp_path) == ["cache"] and os.listdir(folder) == []


def test_a_huge_cache_file_is_not_read_nor_replaced(tmp_path):
    from lookupdec import cache_file

    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate(cache_file.MAX_BYTES + 1)  # (sparse)
    assert cache_file.read(str(big)) is None
    cache_file.write(str(big), {"version": 1})
    assert os.path.getsize(big) == cache_file.MAX_BYTES + 1 and os.listdir(tmp_path) == ["big.json"]


def test_a_full_disk_leaves_the_cache_as_it_was_and_no_temporary_file(tmp_path):
    """Writes past a file-size limit fail (EFBIG, as on a full disk): the old cache stays whole."""
    cache = tmp_path / "cache.json"
    cache.write_text('{"version": 0}')
    script = (
        "import resource, signal, sys\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (64, 64))\n"
        "from lookupdec import cache_file\n"
        f"cache_file.write({str(cache)!r}, {{'version': 1, 'curves': {{'k': 'x' * 1000}}}})\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=os.environ | {"PYTHONPATH": REPO},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "could not write the cost cache" in done.stderr and done.stderr.count("\n") == 1
    assert cache.read_text() == '{"version": 0}' and os.listdir(tmp_path) == ["cache.json"]
