"""The ``Proposer`` protocol.

A proposer returns ``Draft``s (``lookupdec.tree``: a small tree in the one tree format used
everywhere, imported here for the proposers' convenience) of at most ``max_nodes`` nodes.

Lifecycle, per request id: ``start`` → (``propose`` → ``observe``)* → ``stop``. Calling out of
order raises ``ValueError`` naming the request id.
"""
from __future__ import annotations

from typing import Protocol, Sequence

from lookupdec.tree import Draft

__all__ = ["Draft", "Proposer", "RequestRegistry"]


class Proposer(Protocol):
    name: str

    def start(self, request_id: str, prompt_ids: Sequence[int]) -> None: ...

    def propose(self, request_id: str, context: Sequence[int], max_nodes: int) -> list[Draft]: ...
    # at most max_nodes draft nodes in all (the step's node budget); none when it is 0

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

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._states

    def get(self, request_id: str):
        try:
            return self._states[request_id]
        except KeyError:
            raise ValueError(f"{self._owner}: request {request_id!r} was not started (or already stopped)") from None

    def pop(self, request_id: str):
        state = self.get(request_id)
        del self._states[request_id]
        return state
