"""Session-wide fixtures: tiny models (built once), their transformers reference outputs, the
real stories260K model, a private conversion cache. Models are float32 throughout: tests
demanding token identity must not depend on fp16/bf16 near-ties (docs/architecture.md, the
exactness contract).

The suite mirrors the package: ``tests/<pkg>/`` holds the tests of ``lookupdec/<pkg>/``, the top
level those of ``lookupdec/*.py``, ``system/`` the whole-system ones. Helpers shared by several
files live in ``support/`` (put on ``sys.path`` here, imported by plain name: ``from helpers
import ...``). This is the only conftest.py: test files import its caches as ``from conftest
import ...``, and a second one in a folder without ``__init__.py`` would take that name. Import
mode ``prepend`` (pyproject), no ``__init__.py``: every test file's name is unique in the tree."""
from __future__ import annotations

import functools
import os
import sys
import tempfile

import pytest
import torch

# The test models are tiny: one thread is faster than two fighting over 2 shared cores.
torch.set_num_threads(int(os.environ.get("LOOKUPDEC_TEST_THREADS", "1")))

# Measured verify-cost curves go to a per-session file, not the user's ~/.cache.
os.environ.setdefault("LOOKUPDEC_COST_CACHE", os.path.join(tempfile.mkdtemp(prefix="lookupdec-test-"), "cost.json"))

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "support"))  # helpers, whatever the rootdir

from helpers import hf_greedy, make_prompts  # noqa: E402
from repo_paths import LLAMA_SP, STORIES  # noqa: E402  (test files import STORIES from here too)
from tiny_models import tiny_model  # noqa: E402


@functools.cache
def cached_tiny(family: str):
    """One untied tiny model per family for the whole session (read-only in tests)."""
    return tiny_model(family, tie_word_embeddings=False)


@functools.cache
def cached_references(family: str) -> tuple:
    """(prompt, max_new_tokens, transformers greedy output) for the family's prompts."""
    model = cached_tiny(family)
    return tuple((prompt, n, hf_greedy(model, prompt, n)) for prompt, n in make_prompts(seed=1234))


@functools.cache
def load_stories():
    """(model, tokenizer) of the real stories260K model, loaded through lookupdec.model.load."""
    from lookupdec.model import load

    return load(STORIES, device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def stories():
    if not os.path.isdir(STORIES):
        pytest.skip(f"stories260K not found at {STORIES}")
    return load_stories()


@pytest.fixture
def model_cache(tmp_path, monkeypatch):
    """A private ``$LOOKUPDEC_CACHE`` (GGUF conversions) for one test."""
    root = tmp_path / "cache"
    monkeypatch.setenv("LOOKUPDEC_CACHE", str(root))
    return root


@pytest.fixture(scope="session")
def llama_tokenizer():
    """The llama2 SentencePiece tokenizer of ../shared (the index tests' own)."""
    if not os.path.exists(LLAMA_SP):
        pytest.skip(f"tokenizer not found at {LLAMA_SP}")
    from lookupdec.model import load_tokenizer

    return load_tokenizer(LLAMA_SP)
