"""Frozen configuration dataclasses, validated in ``__post_init__``.

Every field carries a comment; a bad value raises ``ValueError`` naming the field.
"""
from __future__ import annotations

from dataclasses import dataclass, field


def _require(cond: bool, name: str, value, rule: str) -> None:
    if not cond:
        raise ValueError(f"{name}={value!r}: {rule}")


@dataclass(frozen=True, kw_only=True)
class NgramConfig:
    """Prompt n-gram lookup (``lookupdec.proposers.ngram``)."""

    min_ngram: int = 1  # shortest context suffix that may anchor a match
    max_ngram: int = 4  # longest context suffix tried first (longer ones: the suffix proposer)
    max_draft_tokens: int = 48  # tokens copied after a match (long: copy-heavy work)
    max_branches: int = 4  # distinct continuations (occurrences) kept as branches

    def __post_init__(self) -> None:
        _require(self.min_ngram >= 1, "min_ngram", self.min_ngram, "must be >= 1")
        _require(self.max_ngram >= self.min_ngram, "max_ngram", self.max_ngram, "must be >= min_ngram")
        _require(self.max_draft_tokens >= 1, "max_draft_tokens", self.max_draft_tokens, "must be >= 1")
        _require(self.max_branches >= 1, "max_branches", self.max_branches, "must be >= 1")


@dataclass(frozen=True, kw_only=True)
class SuffixConfig:
    """Suffix-automaton proposer (``lookupdec.proposers.suffix``)."""

    max_match: int = 64  # context tokens matched (cost of a match is O(max_match))
    min_match: int = 1  # request automaton: shortest match that may draft
    global_min_match: int = 0  # global automaton: shortest match that may draft (0: its
    #                            most frequent tokens when nothing longer matched)
    global_capacity: int = 10_000_000  # tokens of earlier outputs kept (0 = no global cache)

    def __post_init__(self) -> None:
        for name in ("max_match", "min_match"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)!r}: must be >= 1")
        if self.global_min_match < 0:
            raise ValueError(f"global_min_match={self.global_min_match!r}: must be >= 0")
        if self.global_capacity < 0:
            raise ValueError(f"global_capacity={self.global_capacity!r}: must be >= 0")


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """How the engine drafts and verifies. Sampling settings are per call, not here."""

    max_nodes: int = 64  # most draft-tree nodes verified per step (the root not counted)
    budget: str = "auto"  # "auto": per step, the node count that maximises expected tokens/s
    #                       from measured verify cost; "fixed": always up to max_nodes
    max_depth: int = 48  # longest root-to-leaf path in the draft tree
    proposers: tuple[str, ...] = ("ngram", "suffix")  # drafting sources, in priority order
    ngram: NgramConfig = field(default_factory=NgramConfig)
    suffix: SuffixConfig = field(default_factory=SuffixConfig)
    verify: str = "auto"  # "auto" (probe tree masks), "tree", or "chain" (one path per step)

    def __post_init__(self) -> None:
        _require(self.max_nodes >= 0, "max_nodes", self.max_nodes, "must be >= 0")
        _require(self.max_depth >= 1, "max_depth", self.max_depth, "must be >= 1")
        _require(self.budget in ("auto", "fixed"), "budget", self.budget, "must be auto or fixed")
        _require(self.verify in ("auto", "tree", "chain"), "verify", self.verify, "must be auto, tree or chain")
        known = {"ngram", "suffix"}
        for name in self.proposers:
            _require(name in known, "proposers", self.proposers, f"unknown proposer {name!r} (known: {sorted(known)})")
