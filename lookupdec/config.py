"""Frozen configuration dataclasses, validated in ``__post_init__``.

Every field carries a comment; a bad value raises ``ValueError`` naming the field.
"""
from __future__ import annotations

from dataclasses import dataclass, field


# Context tokens a lookup matches at most: the one default of the automaton's ``propose_tree``
# and of the suffix and retrieval proposers (``max_match``). A match costs about its own length,
# not this cap (``lookupdec.automaton``'s docstring), and longer matches seldom change what
# follows: on bench/automaton_bench.py's held-out contexts (10M-token cache), of the 594 in 3,000
# whose match exceeded 32 tokens, 588 had the same best next token at 32. 64 leaves room for
# the long copies of code edits at no cost where matches are short.
DEFAULT_MAX_MATCH = 64

# ``lookupdec serve``'s requests per verify forward (``--max-batch``): concurrent clients verified
# together get more tokens per second than taken one at a time, at one thread and at two, and a
# client alone keeps its latency (bench/results/server_batch_*.json). The batch's K/V buffer holds this
# many rows of the longest context, paid for as the rows in use write them (model/cache.py, BatchStore).
SERVE_MAX_BATCH = 8
SERVE_GRACE_S = 20.0  # on SIGTERM the requests in flight get this long (inside Kubernetes' default grace before SIGKILL)
# most sequences per verify forward for ``rewrite --batch-size`` and ``serve --max-batch`` (a
# program calling ``Engine.generate_batch`` sizes its own): each row reserves K/V memory for the
# longest context, and past 16 rows a CPU gains nothing
MAX_BATCH = 64


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

    max_match: int = DEFAULT_MAX_MATCH  # context tokens matched (cost of a match is O(max_match))
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
class RetrievalConfig:
    """Retrieval from a corpus index (``lookupdec.proposers.retrieval``, ``lookupdec index build``)."""

    index: str | None = None  # index folder; the "retrieval" proposer needs one
    top_k: int = 32  # chunks retrieved per query (replay, HumanEval over the stdlib: 8 -> 32 -> 64
    #                  chunks gave MAT 1.44 / 1.58 / more; retrieved text also acts as frequency data)
    follow_chunks: int = 1  # also take this many chunks that follow each hit in its document
    query_tokens: int = 64  # the query is the last this-many tokens of the prompt (then the context)
    refresh_every: int = 16  # re-query on the recent context every this-many new tokens (0 = never)
    max_reference_tokens: int = 65_536  # most retrieved tokens kept per request
    min_match: int = 1  # shortest context suffix matched in the retrieved text that may draft
    max_match: int = DEFAULT_MAX_MATCH  # context tokens matched
    check_hashes: bool = True  # verify every index file's SHA-256 when opening (sizes are always checked)

    def __post_init__(self) -> None:
        for name in ("top_k", "query_tokens", "max_reference_tokens", "min_match", "max_match"):
            _require(getattr(self, name) >= 1, name, getattr(self, name), "must be >= 1")
        for name in ("follow_chunks", "refresh_every"):
            _require(getattr(self, name) >= 0, name, getattr(self, name), "must be >= 0")


@dataclass(frozen=True, kw_only=True)
class RecycleConfig:
    """Token recycling: drafts from the target's own top tokens at earlier steps
    (``lookupdec.proposers.recycle``)."""

    successors: int = 4  # top tokens kept per (previous token, token) and per token
    max_nodes: int = 32  # most nodes of its draft per step (the step's budget applies too)
    max_depth: int = 8  # longest path of its draft
    max_entries: int = 1_000_000  # (previous, token) pairs kept; past it the pair table starts over

    def __post_init__(self) -> None:
        for name in ("successors", "max_nodes", "max_depth", "max_entries"):
            _require(getattr(self, name) >= 1, name, getattr(self, name), "must be >= 1")


@dataclass(frozen=True, kw_only=True)
class DraftConfig:
    """Small draft model used where lookups are weak (``lookupdec.proposers.draft_model``)."""

    mode: str = "auto"  # "auto": run it on steps whose best lookup draft scores below
    #                     `threshold`; "always"; "never"
    threshold: float = 0.3  # calibrated acceptance estimate of the lookups' best first token
    max_tokens: int = 5  # chain depth (one draft forward per token)
    branch: int = 2  # tokens per level: greedy, the top-b (the best continues the chain);
    #                  sampling, b i.i.d. draws (the first continues it)

    def __post_init__(self) -> None:
        _require(self.mode in ("auto", "always", "never"), "mode", self.mode, "must be auto, always or never")
        _require(0.0 <= self.threshold <= 1.0, "threshold", self.threshold, "must be in [0, 1]")
        _require(self.max_tokens >= 1, "max_tokens", self.max_tokens, "must be >= 1")
        _require(self.branch >= 1, "branch", self.branch, "must be >= 1")


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """How the engine drafts and verifies. Sampling settings are per call, not here."""

    max_nodes: int = 64  # most draft-tree nodes verified per step (the root not counted)
    budget: str = "auto"  # "auto": per step, the node count that maximises expected tokens/s
    #                       from measured verify cost; "fixed": always up to max_nodes
    max_depth: int = 48  # longest root-to-leaf path in the draft tree
    proposers: tuple[str, ...] = ("ngram", "suffix", "recycle")  # drafting sources, in priority order
    ngram: NgramConfig = field(default_factory=NgramConfig)
    suffix: SuffixConfig = field(default_factory=SuffixConfig)
    retrieval: RetrievalConfig = field(default_factory=RetrievalConfig)  # used when "retrieval" is a proposer
    recycle: RecycleConfig = field(default_factory=RecycleConfig)  # used when "recycle" is a proposer
    draft: DraftConfig = field(default_factory=DraftConfig)  # used when the engine has a draft model
    verify: str = "auto"  # "auto" (probe tree masks), "tree", or "chain" (one path per step)
    fast_kernels: bool = True  # CPU float32: linear layers on oneDNN-prepacked weights, the output
    #                            projection by the fastest product form per row count, grouped K/V
    #                            heads not copied in attention (model/kernels.py);
    #                            same logits up to float rounding (greedy identity is tested)
    prefix_cache: bool = True  # a request's prompt keeps the K/V of what it shares with the last
    #                            request's prompt (an instruction, a chat template): only the rest
    #                            is prefilled (TargetModel.prefill); same logits up to float rounding
    prefix_cache_mb: float = 256.0  # with prefix_cache: copies of earlier prompts' K/V kept too (least
    #                                 recently used dropped first past this many MiB; model/cache.py
    #                                 PrefixStore), so a prompt may start from any of them: editors
    #                                 resending their own file, pipelines alternating instructions
    partial_logits: bool = True  # greedy on CPU: the verify forward projects only the hidden states of
    #                              the nodes likely to be accepted; any other the walk reaches is
    #                              projected then (sampling.PartialLogits). Exact: the same rows

    def __post_init__(self) -> None:
        _require(self.max_nodes >= 0, "max_nodes", self.max_nodes, "must be >= 0")
        _require(self.max_depth >= 1, "max_depth", self.max_depth, "must be >= 1")
        _require(self.prefix_cache_mb >= 0, "prefix_cache_mb", self.prefix_cache_mb, "must be >= 0")
        _require(self.budget in ("auto", "fixed"), "budget", self.budget, "must be auto or fixed")
        _require(self.verify in ("auto", "tree", "chain"), "verify", self.verify, "must be auto, tree or chain")
        known = {"ngram", "suffix", "retrieval", "recycle"}
        for name in self.proposers:
            _require(name in known, "proposers", self.proposers, f"unknown proposer {name!r} (known: {sorted(known)})")
        _require("retrieval" not in self.proposers or self.retrieval.index is not None, "proposers",
                 self.proposers, "'retrieval' needs retrieval.index (an index folder from `lookupdec index build`)")

    def with_index(self, index) -> "EngineConfig":
        """This config plus retrieval from the index folder ``index``."""
        import dataclasses
        import os

        proposers = self.proposers if "retrieval" in self.proposers else (*self.proposers, "retrieval")
        return dataclasses.replace(self, proposers=proposers,
                                   retrieval=dataclasses.replace(self.retrieval, index=os.fspath(index)))
