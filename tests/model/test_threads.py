"""``release_openmp_threads`` (``lookupdec/model/threads.py``): the thread that loaded a model
lets its OpenMP workers go before another thread runs the model, so that thread's workers spin
between operators instead of sleeping; the server's workers and the Ray worker call it on the
thread that built them."""
from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from repo_paths import REPO, STORIES

# In a fresh process with two OpenMP threads: an operator on the main thread starts its team (one
# worker thread more); released, the worker is gone; an operator on another thread then starts
# that thread's own team, and the main thread has none to hold against it.
COUNT_THREADS = r"""
import os, threading, torch
from lookupdec.model import release_openmp_threads
def threads():
    return len(os.listdir("/proc/self/task"))
a, b = torch.randn(256, 576), torch.randn(576, 1536)
before = threads()
a @ b  # the main thread's team (MKL's product and torch's own loops share it)
torch.ones(1 << 22).exp()
with_team = threads()
released = release_openmp_threads()
after = threads()
print(before, with_team, released, after)
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_release_lets_the_calling_threads_openmp_workers_go():
    env = os.environ | {"OMP_NUM_THREADS": "2", "PYTHONPATH": REPO}
    out = subprocess.run([sys.executable, "-c", COUNT_THREADS], env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    before, with_team, released, after = int(out[0]), int(out[1]), out[2], int(out[3])
    assert with_team == before + 1  # the team of two: the main thread and one worker
    assert released == "True"
    assert after == with_team - 1  # the worker let go


def test_release_twice_and_without_a_team_is_harmless():
    import torch

    from lookupdec.model import release_openmp_threads

    assert release_openmp_threads() == release_openmp_threads()
    x = torch.randn(64, 64)
    assert torch.equal(x @ x, x @ x)  # the next operator makes a new team


@pytest.fixture
def released(monkeypatch):
    """The threads that called ``release_openmp_threads`` (the real one still runs)."""
    import lookupdec.model as model

    calls, real = [], model.release_openmp_threads

    def record():
        calls.append(threading.get_ident())
        return real()

    monkeypatch.setattr(model, "release_openmp_threads", record)
    return calls


@pytest.mark.skipif(not os.path.isdir(STORIES), reason="../shared/models/stories260K is absent")
@pytest.mark.parametrize("max_batch", [1, 4])
def test_the_server_releases_the_loading_threads_workers(released, max_batch):
    pytest.importorskip("fastapi")
    from starlette.testclient import TestClient

    from conftest import load_stories
    from lookupdec import Engine, EngineConfig
    from lookupdec.server import create_app

    model, tokenizer = load_stories()
    engine = Engine(model, tokenizer, EngineConfig(budget="fixed", max_nodes=4))
    app = create_app(engine, "m", max_batch=max_batch)
    assert released == [threading.get_ident()]  # the thread that made the app, before any request
    with TestClient(app) as client:
        r = client.post("/v1/completions", json={"model": "m", "prompt": "Once upon", "max_tokens": 4})
        assert r.status_code == 200
    assert released == [threading.get_ident()]  # not again on the engine thread


@pytest.mark.skipif(not os.path.isdir(STORIES), reason="../shared/models/stories260K is absent")
def test_the_ray_worker_releases_the_loading_threads_workers(released):
    from lookupdec.pipelines import PromptFormat, RewriteOptions
    from lookupdec.pipelines.cluster import EngineSpec, RewriteWorker

    worker = RewriteWorker(EngineSpec.of(STORIES), PromptFormat(("", "")), RewriteOptions(max_new_tokens=4), 1)
    assert released == [threading.get_ident()]  # on the thread that loaded it, not the loop's
    worker.inbox.put(None)  # (no more records: the loop ends)
    worker.thread.join(timeout=60)
    assert not worker.thread.is_alive() and worker.failure is None
