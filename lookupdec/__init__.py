"""lookupdec: lossless lookup-based speculative decoding for Hugging Face causal LMs.

The package's face is lazy: ``Engine`` and the other public names load on first use, so that
``import lookupdec.automaton`` (or ``lookupdec.config``) does not import torch.
"""
from lookupdec.version import __version__

__all__ = ["Engine", "EngineConfig", "Generation", "GenerationStats", "NgramConfig", "__version__"]

_LAZY = {"Engine": "lookupdec.engine", "Generation": "lookupdec.engine", "GenerationStats": "lookupdec.engine",
         "EngineConfig": "lookupdec.config", "NgramConfig": "lookupdec.config"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module 'lookupdec' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
