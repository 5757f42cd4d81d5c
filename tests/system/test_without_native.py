"""The package without its compiled core (``LOOKUPDEC_NO_NATIVE=1``, as a source tree without
``pip install -e .``): every fast path's Python reference runs, and a request's output is the
compiled run's, token for token (greedy, default engine: drafts, partial logits, recycling)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from repo_paths import REPO, STORIES

SCRIPT = """
import json, sys
import lookupdec.native as native
from lookupdec import Engine, EngineConfig
engine = Engine.from_pretrained(sys.argv[1], config=EngineConfig())
out = [engine.generate(p, max_new_tokens=40).token_ids for p in ("Once upon a time", "The little dog")]
print(json.dumps({"native": native.available(), "out": out}))
"""


def run(no_native: bool) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), "LOOKUPDEC_COST_CACHE": "off"}
    env.pop("LOOKUPDEC_NO_NATIVE", None)
    if no_native:
        env["LOOKUPDEC_NO_NATIVE"] = "1"
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(STORIES)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_references_alone_give_the_compiled_output():
    if not os.path.isdir(STORIES):
        pytest.skip(f"stories260K not found at {STORIES}")
    compiled, reference = run(False), run(True)
    assert reference["native"] is False
    assert reference["out"] == compiled["out"]
