"""Where the tests find the checkout and the models and data beside it, for every test file
whatever its depth under ``tests/``: nothing else computes a path from its own ``__file__``."""
from __future__ import annotations

import os

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/
REPO = os.path.dirname(TESTS)  # the checkout: lookupdec/, bench/, examples/, docs/
SHARED = os.path.normpath(os.path.join(REPO, "..", "shared"))  # models and data next to the checkout
DATA = os.path.join(SHARED, "data")
LLAMA_SP = os.path.join(DATA, "tokenizers", "llama2", "tokenizer.model")
# the real stories260K model ($LOOKUPDEC_STORIES: another copy of it)
STORIES = os.environ.get("LOOKUPDEC_STORIES", os.path.join(SHARED, "models", "stories260K"))
