"""The built-in model: a small Llama trained by the project on Python sources (``train.py``).

``MODEL_DIR`` is the target, ``DRAFT_DIR`` a smaller draft model with the same tokenizer;
``"builtin"`` and ``"builtin-draft"`` name them wherever a model path is taken
(``lookupdec.model_files.resolve``). The repository holds their configs and tokenizers; the
weights (``model.safetensors``) are built by ``python -m lookupdec.demo.train`` (the card's
"Retrain" section), not shipped. The model card is ``MODEL_CARD.md`` beside this file.
"""
from __future__ import annotations

import os

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL_DIR = os.path.join(HERE, "pycoder")
DRAFT_DIR = os.path.join(HERE, "pycoder-draft")
ALIASES = {"builtin": MODEL_DIR, "builtin-draft": DRAFT_DIR}
MODEL_CARD = os.path.join(HERE, "MODEL_CARD.md")


def resolve(path: str | os.PathLike | None) -> str | None:
    """``"builtin"`` / ``"builtin-draft"`` → their folders; anything else unchanged (no weights check)."""
    from lookupdec.model_files import resolve as resolve_name

    return resolve_name(path, weights=False)
