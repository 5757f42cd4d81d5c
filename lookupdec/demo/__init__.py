"""The built-in model: a small Llama trained by the project on Python sources (``train.py``).

``lookupdec generate`` uses it when no ``--model`` is given, so the package works offline on a
fresh machine. ``MODEL_DIR`` is the target, ``DRAFT_DIR`` a smaller draft model with the same
tokenizer; ``"builtin"`` and ``"builtin-draft"`` name them wherever a model path is taken.
The model card is ``MODEL_CARD.md`` beside this file.
"""
from __future__ import annotations

import os

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL_DIR = os.path.join(HERE, "pycoder")
DRAFT_DIR = os.path.join(HERE, "pycoder-draft")
ALIASES = {"builtin": MODEL_DIR, "builtin-draft": DRAFT_DIR}


def resolve(path: str | os.PathLike | None) -> str | None:
    """``"builtin"`` / ``"builtin-draft"`` → the shipped folders; anything else unchanged."""
    if path is None:
        return None
    return ALIASES.get(os.fspath(path), os.fspath(path))
