"""``bench/gpu_projection.py`` at its small configuration on the CPU: the method the GPU run uses
(t(n) of a random model on three paths, the replayed MAT per tree size, the projection) runs end
to end and its figures hold together."""
from __future__ import annotations

import importlib.util
import os

import pytest

from repo_paths import DATA, REPO


def load_bench():
    spec = importlib.util.spec_from_file_location("gpu_projection", os.path.join(REPO, "bench", "gpu_projection.py"))
    module = importlib.util.module_from_spec(spec)
    import sys

    sys.path.insert(0, os.path.join(REPO, "bench"))
    spec.loader.exec_module(module)
    return module


def test_small_projection_runs_and_is_consistent():
    if not os.path.isdir(DATA):
        pytest.skip(f"shared data not found at {DATA}")
    bench = load_bench()
    model = bench.random_model("small", "cpu", __import__("torch").float32)
    times = bench.time_paths(model, [1, 2, 4], context=64, repeats=2, device="cpu")
    for path in ("eager", "static", "captured"):
        assert all(times[path][n] > 0 for n in (1, 2, 4))
    mats = bench.replay_mat(["loghub"], [1, 2, 4], limit=2)
    assert mats["loghub"][1] == 1.0 and mats["loghub"][4] >= mats["loghub"][2] >= 1.0
    rows = bench.project(times, mats)
    assert {r["path"] for r in rows} == {"eager", "static", "captured"}
    for r in rows:  # the best n is at least plain decoding's rate by construction
        assert r["speedup_over_plain"] >= 1.0 and r["best_n"] in (1, 2, 4)
        assert r["tokens_per_s"] == pytest.approx(r["mat"] / (r["tn_ms"] / 1e3), rel=0.01)
