"""The kernel forms chosen on CPU (``model/kernels.py``, ``FormChooser``) kept for the next
process, in the cost cache's file (``cost_cache.cost_cache_path``) beside the cost curves: the forms
of each setup (``forms_key``: architecture, machine, dtype, torch and the forms on offer), the
``MAX_CACHED_FORMS`` setups updated last.

The file's reading and its bounded, atomic update are the cost cache's (``cost_cache.py``), so this
module, beside the kernels it serves, sits in the engine layer with ``cost_cache.py``
(``tests/test_layers.py``); ``engine.py`` calls it.
"""
from __future__ import annotations

from lookupdec.cost_cache import read_cache, setup, update_cache

MAX_CACHED_FORMS = 8  # the cost cache keeps the kernel forms of this many setups updated last


def forms_key(model_config: dict, device, dtype, kernels: str = "") -> str:
    """What the kernel forms chosen on CPU (``model/kernels.py``) depend on besides the row and
    thread counts their own keys hold: the architecture, the machine, the dtype, torch's version
    (``cost_cache.cost_key`` less the context bucket and the thread count) and the forms on offer
    (``TargetModel.kernels``: choices made without a form are made again once it is there)."""
    import torch

    model, where = setup(model_config, device)
    return f"{model}|{where}|{dtype}|torch{torch.__version__}|{kernels}"


def load_cached_forms(key: str) -> dict:
    """The kernel forms kept for ``key`` (``forms_key``; ``model/kernels.kernel_forms``' shape),
    or {} (none kept, or unreadable)."""
    doc = read_cache()
    forms = doc.get("forms") if doc else None
    entry = forms.get(key) if isinstance(forms, dict) else None
    return {part: v for part, v in entry.items() if part != "updated"} if isinstance(entry, dict) else {}


def store_cached_forms(key: str, forms: dict) -> None:
    """Keep the kernel forms chosen in this process for the next ones (``budget.update_cache``)."""
    update_cache("forms", key, forms, MAX_CACHED_FORMS)
