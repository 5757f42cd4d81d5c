"""Drafting sources. ``build_proposers`` turns the names in ``EngineConfig.proposers`` into
objects following the ``Proposer`` protocol (``base.py``)."""
from __future__ import annotations

from lookupdec.config import EngineConfig
from lookupdec.proposers.base import Draft, Proposer

__all__ = ["Draft", "Proposer", "build_proposers"]


def build_proposers(config: EngineConfig, *, tokenizer=None) -> list[Proposer]:
    """``tokenizer``: the model's, needed with "retrieval" (the index must have been built with
    the same vocabulary; opening it checks the fingerprint)."""
    from lookupdec.proposers.ngram import NgramProposer
    from lookupdec.proposers.suffix import SuffixProposer

    def retrieval():
        from lookupdec.index import Index
        from lookupdec.proposers.retrieval import RetrievalProposer
        from lookupdec.tokens import vocab_fingerprint

        if tokenizer is None:
            raise ValueError("the retrieval proposer needs the model's tokenizer (build_proposers(..., tokenizer=))")
        index = Index.open(config.retrieval.index, tokenizer_fingerprint=vocab_fingerprint(tokenizer),
                           check_hashes=config.retrieval.check_hashes, decode=tokenizer.decode)
        return RetrievalProposer(index, config.retrieval)

    def recycle():
        from lookupdec.proposers.recycle import RecycleProposer

        return RecycleProposer(config.recycle)

    factories = {"ngram": lambda: NgramProposer(config.ngram), "suffix": lambda: SuffixProposer(config.suffix),
                 "retrieval": retrieval, "recycle": recycle}
    out = []
    for name in config.proposers:
        if name not in factories:
            raise ValueError(f"proposers: unknown proposer {name!r} (known: {sorted(factories)})")
        out.append(factories[name]())
    return out
