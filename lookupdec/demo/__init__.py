"""The built-in model: a small Llama trained by the project on Python sources (``train.py``).

``MODEL_DIR`` is the target, ``DRAFT_DIR`` a smaller draft model with the same tokenizer;
``"builtin"`` and ``"builtin-draft"`` name them wherever a model path is taken
(``lookupdec.model_files.resolve``). The repository holds their configs and tokenizers; the
weights (``model.safetensors``) are built by ``python -m lookupdec.demo.train`` (the card's
"Retrain" section), not shipped. The two share one tokenizer: ``pycoder-draft/tokenizer.json``
is a symbolic link to ``pycoder/tokenizer.json``. The model card is ``MODEL_CARD.md`` beside
this file. This module imports nothing of the package (``model_files`` imports it).
"""
from __future__ import annotations

import os

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL_DIR = os.path.join(HERE, "pycoder")
DRAFT_DIR = os.path.join(HERE, "pycoder-draft")
ALIASES = {"builtin": MODEL_DIR, "builtin-draft": DRAFT_DIR}
MODEL_CARD = os.path.join(HERE, "MODEL_CARD.md")


def resolve(path: str | os.PathLike | None) -> str | None:
    """``"builtin"`` / ``"builtin-draft"`` → their folders; anything else unchanged (no weights
    check; ``lookupdec.model_files.resolve`` takes every alias and checks the weights)."""
    if path is None:
        return None
    path = os.fspath(path)
    return ALIASES.get(path, path)
