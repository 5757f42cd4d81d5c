"""Drafting sources. ``build_proposers`` turns the names in ``EngineConfig.proposers`` into
objects following the ``Proposer`` protocol (``base.py``)."""
from __future__ import annotations

from lookupdec.config import EngineConfig
from lookupdec.proposers.base import Draft, Proposer

__all__ = ["Draft", "Proposer", "build_proposers"]


def build_proposers(config: EngineConfig) -> list[Proposer]:
    from lookupdec.proposers.ngram import NgramProposer
    from lookupdec.proposers.suffix import SuffixProposer

    factories = {"ngram": lambda: NgramProposer(config.ngram), "suffix": lambda: SuffixProposer(config.suffix)}
    out = []
    for name in config.proposers:
        if name not in factories:
            raise ValueError(f"proposers: unknown proposer {name!r} (known: {sorted(factories)})")
        out.append(factories[name]())
    return out
