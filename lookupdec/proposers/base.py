"""The ``Proposer`` protocol and the ``Draft`` it returns.

A draft is a small tree in the one tree format used everywhere (STYLE.md item 3):
``token_ids[i]`` is the token of node ``i`` and ``parents[i]`` its parent, ``-1`` for a child of
the root (the last committed token). Parents come before children (``parents[i] < i``).

Lifecycle, per request id: ``start`` → (``propose`` → ``observe``)* → ``stop``. Calling out of
order raises ``ValueError`` naming the request id.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence


@dataclass(frozen=True)
class Draft:
    token_ids: tuple[int, ...]  # [n] draft tokens
    parents: tuple[int, ...]  # [n] parent index in this draft, -1 = child of the root
    scores: tuple[float, ...]  # [n] proposer's estimate that node i is accepted (in [0, 1])
    source: str  # proposer name, used for per-source acceptance stats
    match_length: int = 0  # context tokens the draft's match rests on (0: not a lookup), for
    #                        calibration per source and match length
    # Draft-model drafts when sampling: draft node (-1 = the root) -> (q [vocab], tokens drawn
    # i.i.d. from q there, in order). Acceptance uses them for rejection sampling (sampling.py).
    samples: dict | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if len(self.parents) != n or len(self.scores) != n:
            raise ValueError(f"Draft from {self.source!r}: token_ids, parents, scores lengths differ")
        for i, p in enumerate(self.parents):
            if not -1 <= p < i:
                raise ValueError(f"Draft from {self.source!r}: parents[{i}]={p} must be in [-1, {i})")

    def best_chain(self) -> tuple[list[int], list[float]]:
        """The path that follows the best-scored child from the root: (tokens, conditional
        probabilities score[i] / score[parent])."""
        if self.parents == tuple(range(-1, len(self.parents) - 1)):  # already a chain
            prev = (1.0,) + self.scores[:-1]
            return list(self.token_ids), [s / p if p > 0 else 0.0 for s, p in zip(self.scores, prev)]
        children: dict[int, list[int]] = {}
        for i, p in enumerate(self.parents):
            children.setdefault(p, []).append(i)
        tokens, cond, node, parent_score = [], [], -1, 1.0
        while node in children:
            node = max(children[node], key=lambda i: self.scores[i])
            tokens.append(self.token_ids[node])
            cond.append(self.scores[node] / parent_score if parent_score > 0 else 0.0)
            parent_score = self.scores[node]
        return tokens, cond

    @classmethod
    def chain(cls, token_ids: Sequence[int], scores: Sequence[float], source: str, match_length: int = 0) -> "Draft":
        """A single path: node i is the child of node i-1."""
        n = len(token_ids)
        return cls(tuple(token_ids), tuple(range(-1, n - 1)), tuple(scores), source, match_length)


class Proposer(Protocol):
    name: str

    def start(self, request_id: str, prompt_ids: Sequence[int]) -> None: ...

    def propose(self, request_id: str, context: Sequence[int], budget: int) -> list[Draft]: ...

    def observe(self, request_id: str, new_ids: Sequence[int]) -> None: ...

    def stop(self, request_id: str) -> None: ...


class RequestRegistry:
    """Per-request state with loud misuse: unknown or duplicate ids raise ``ValueError``."""

    def __init__(self, owner: str) -> None:
        self._owner = owner
        self._states: dict[str, object] = {}

    def add(self, request_id: str, state: object) -> None:
        if request_id in self._states:
            raise ValueError(f"{self._owner}: request {request_id!r} already started")
        self._states[request_id] = state

    def get(self, request_id: str):
        try:
            return self._states[request_id]
        except KeyError:
            raise ValueError(f"{self._owner}: request {request_id!r} was not started (or already stopped)") from None

    def pop(self, request_id: str):
        state = self.get(request_id)
        del self._states[request_id]
        return state
