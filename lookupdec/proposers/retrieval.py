"""Retrieval from a corpus index: drafts copied from chunks of the user's own files.

At request start the last ``query_tokens`` of the prompt are embedded and the ``top_k`` nearest
chunks (plus the ``follow_chunks`` chunks after each, where a copy continues) go into a
per-request reference suffix automaton, each chunk run ending in a separator so no match spans
two of them. Every ``refresh_every`` new tokens the recent context queries again and new chunks
are appended (the automaton is append-only), up to ``max_reference_tokens``. Drafting is the
suffix cache's (``automaton_drafts``): longest match of the context in the retrieved text, then a
best-first subtree of what followed it. Retrieval only proposes tokens; exactness does not
depend on it.
"""
from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from lookupdec.automaton import SuffixAutomaton
from lookupdec.config import RetrievalConfig
from lookupdec.index.store import Index
from lookupdec.proposers.base import Draft, RequestRegistry
from lookupdec.proposers.suffix import CertainStepEstimate, automaton_drafts, settle_pending
from lookupdec.tokens import SEPARATOR


class _Request:
    def __init__(self) -> None:
        self.automaton = SuffixAutomaton()
        self.chunks: set[int] = set()
        self.reference_tokens = 0
        self.tail: list[int] = []  # the context's last tokens, for refresh queries
        self.since_refresh = 0
        self.pending: dict = {}


class RetrievalProposer:
    name = "retrieval"

    def __init__(self, index: Index, config: RetrievalConfig | None = None) -> None:
        self.index = index
        self.config = config or RetrievalConfig()
        self._requests = RequestRegistry("RetrievalProposer")
        self.certain_step = CertainStepEstimate()
        self.query_seconds: list[float] = []  # every retrieval query (embed + search + automaton)

    def start(self, request_id: str, prompt_ids: Sequence[int]) -> None:
        request = _Request()
        self._requests.add(request_id, request)
        request.tail = list(prompt_ids[-self.config.query_tokens :])
        self._retrieve(request)

    def observe(self, request_id: str, new_ids: Sequence[int]) -> None:
        request: _Request = self._requests.get(request_id)
        settle_pending(request.pending, {self.name: self.certain_step}, new_ids)
        request.tail = (request.tail + list(new_ids))[-self.config.query_tokens :]
        request.since_refresh += len(new_ids)
        if self.config.refresh_every and request.since_refresh >= self.config.refresh_every:
            request.since_refresh = 0
            self._retrieve(request)

    def stop(self, request_id: str) -> None:
        self._requests.pop(request_id)

    def propose(self, request_id: str, context: Sequence[int], max_nodes: int) -> list[Draft]:
        request: _Request = self._requests.get(request_id)
        if max_nodes <= 0 or not request.reference_tokens:
            return []
        ctx = np.asarray(context[-self.config.max_match :], dtype=np.int64)
        return automaton_drafts(request.automaton, ctx, max_nodes, self.config.min_match, self.name,
                                self.certain_step, request.pending)

    def retrieved_chunks(self, request_id: str) -> list[int]:
        return sorted(self._requests.get(request_id).chunks)

    def _retrieve(self, request: _Request) -> None:
        """Query with the context tail; append the new chunks' token runs to the automaton."""
        if request.reference_tokens >= self.config.max_reference_tokens:
            return
        t = time.perf_counter()
        wanted: list[int] = []
        for hit in self.index.search_tokens(request.tail, self.config.top_k):
            chunk = hit.chunk
            for _ in range(self.config.follow_chunks + 1):
                if chunk is None:
                    break
                if chunk not in request.chunks and chunk not in wanted:
                    wanted.append(chunk)
                chunk = self.index.next_chunk(chunk)
        for run in _runs(sorted(wanted), self.index):
            tokens = np.concatenate([self.index.chunk_tokens(c) for c in run])
            room = self.config.max_reference_tokens - request.reference_tokens
            if room <= 0:
                break
            tokens = tokens[:room]
            request.automaton.extend(np.append(tokens, SEPARATOR))
            request.reference_tokens += len(tokens)
            request.chunks.update(run)
        self.query_seconds.append(time.perf_counter() - t)


PREVIEW_MAX_NODES = 32  # draft nodes asked by ``drafts_after``


def drafts_after(index: Index, context_ids: Sequence[int], config: RetrievalConfig | None = None, *,
                 max_nodes: int = PREVIEW_MAX_NODES) -> list[Draft]:
    """The drafts retrieval would propose right after ``context_ids`` if they ended a prompt:
    one request started on them (its first query), asked once for ``max_nodes`` nodes, stopped.
    For inspecting an index (``lookupdec index query``); the engine uses the proposer itself."""
    proposer = RetrievalProposer(index, config)
    ids = list(context_ids)
    proposer.start("preview", ids)
    try:
        return proposer.propose("preview", ids, max_nodes)
    finally:
        proposer.stop("preview")


def _runs(chunks: list[int], index: Index) -> list[list[int]]:
    """Sorted chunk ids grouped into runs that are consecutive in one document."""
    runs: list[list[int]] = []
    for c in chunks:
        if runs and index.next_chunk(runs[-1][-1]) == c:
            runs[-1].append(c)
        else:
            runs.append([c])
    return runs
