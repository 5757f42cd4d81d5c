"""Suffix-automaton cache: drafts from everything seen before, in this request and earlier ones.

Two automata (``lookupdec.automaton.SuffixAutomaton``, compiled core):

- per request: the prompt and the output so far, extended every step;
- global: the outputs of earlier requests, joined by a separator token no vocabulary uses, with
  a capacity in tokens. When a finished request pushes it past the capacity, the oldest outputs
  are dropped until ``GLOBAL_RETAIN`` of the capacity is left and the automaton is rebuilt from
  what remains: O(retained tokens) once per ``(1 - GLOBAL_RETAIN) * capacity`` new tokens, so
  amortised about three appends per cached token.

Each step, each automaton matches the longest suffix of the context that occurred before with
a continuation, then grows a best-first subtree from it: a node's score is the product along
its path of empirical next-token frequencies, times a confidence in the match length
``L / (L + MATCH_PRIOR)``. A second, shorter match with at least ``RETRY_MIN_COUNT``
occurrences is tried too when the longest one rests on fewer; both subtrees merge in the trie.
The drafts are made in one call into the automaton's core (``automaton_drafts``): compiled
(``csrc/drafting/suffix_drafts.cpp``), else (the extension not built) the reference core, whose
``lookupdec.reference.drafting.suffix_drafts`` defines them.
"""
from __future__ import annotations

import json
import os
from collections import deque
from typing import Sequence

import numpy as np

from lookupdec.automaton import SuffixAutomaton
from lookupdec.config import SuffixConfig
from lookupdec.proposers.base import Draft, RequestRegistry
from lookupdec.tokens import SEPARATOR

MATCH_PRIOR = 1.0  # confidence in a match of length L is L / (L + MATCH_PRIOR)
EMPTY_MATCH_CONFIDENCE = 0.2  # pseudo match length: a 0-token match still scores above 0
MATCH_LEVELS = 2  # subtrees from this many match lengths (the longest and shorter ones)
SHORTER_MATCH_NODES_DIVISOR = 2  # shorter matches add breadth: half the nodes are enough (replay: the same MAT for less drafting)
CERTAIN_STEP = 0.9  # prior probability that a step all earlier occurrences agree on is right
CERTAIN_PRIOR_WEIGHT = 20.0  # observations the prior is worth
CERTAIN_DECAY = 0.998  # per observation: the estimate follows the last ~500 certain steps
GLOBAL_RETAIN = 0.75  # share of the capacity kept when the global cache is trimmed
CACHE_FORMAT_VERSION = 1


class _Request:
    def __init__(self, prompt_ids: Sequence[int]) -> None:
        self.automaton = SuffixAutomaton(np.asarray(prompt_ids, dtype=np.int64))
        self.output: list[int] = []
        self.pending: dict[str, tuple[list[int], list[bool]]] = {}  # source -> best chain, certain flags


class CertainStepEstimate:
    """How often a draft step that every earlier occurrence agreed on turns out right.

    Copy-heavy work (code edits) continues a copied span almost surely; chat does not. Learnt
    from the committed tokens after each step (history only), with decayed counts so it follows
    the workload, starting from ``CERTAIN_STEP`` worth ``CERTAIN_PRIOR_WEIGHT`` observations.
    """

    def __init__(self, state: np.ndarray | None = None) -> None:
        """``state``: where (trials, hits) live, a float64 pair (a row of ``SuffixProposer``'s
        table, which the compiled lookups read and update in place: ``native.drafting.Lookups``)."""
        self.state = np.zeros(2) if state is None else state
        self.state[:] = (CERTAIN_PRIOR_WEIGHT, CERTAIN_PRIOR_WEIGHT * CERTAIN_STEP)

    @property
    def trials(self) -> float:
        return float(self.state[0])

    @property
    def hits(self) -> float:
        return float(self.state[1])

    @property
    def value(self) -> float:
        trials, hits = self.state.tolist()
        return hits / trials

    def update(self, chain: Sequence[int], certain: Sequence[bool], committed: Sequence[int]) -> None:
        trials, hits = self.state.tolist()
        for token, is_certain, actual in zip(chain, certain, committed):
            if is_certain:
                trials = trials * CERTAIN_DECAY + 1
                hits = hits * CERTAIN_DECAY + (token == actual)
            if token != actual:
                break
        self.state[:] = (trials, hits)


class SuffixProposer:
    name = "suffix"

    def __init__(self, config: SuffixConfig | None = None) -> None:
        self.config = config or SuffixConfig()
        self._requests = RequestRegistry("SuffixProposer")
        self._outputs: deque[np.ndarray] = deque()  # earlier outputs in the global cache, oldest first
        self._global_tokens = 0
        self.global_automaton = SuffixAutomaton()
        # (trials, hits) of each automaton's estimate: rows of one table the compiled lookups share
        self._certain = np.zeros((2, 2))
        self.certain_step = {"suffix": CertainStepEstimate(self._certain[0]),
                             "suffix-global": CertainStepEstimate(self._certain[1])}

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self, request_id: str, prompt_ids: Sequence[int]) -> None:
        self._requests.add(request_id, _Request(prompt_ids))

    def observe(self, request_id: str, new_ids: Sequence[int]) -> None:
        request: _Request = self._requests.get(request_id)
        request.automaton.extend(new_ids)
        request.output.extend(new_ids)
        settle_pending(request.pending, self.certain_step, new_ids)

    def observe_fused(self, request_id: str, new_ids: Sequence[int]) -> None:
        """``observe`` less what ``Mixture.finish``'s compiled call did (the automaton's extend,
        the fused plans' pending chains settled)."""
        request: _Request = self._requests.get(request_id)
        request.output.extend(new_ids)
        if request.pending:  # (left by a step that proposed apart)
            settle_pending(request.pending, self.certain_step, new_ids)

    def stop(self, request_id: str) -> None:
        request: _Request = self._requests.pop(request_id)
        if request.output and self.config.global_capacity:
            self.add_to_global(request.output)

    def propose(self, request_id: str, context: Sequence[int], max_nodes: int) -> list[Draft]:
        request: _Request = self._requests.get(request_id)
        if max_nodes <= 0:
            return []
        ctx = list(context[-self.config.max_match :])
        out = automaton_drafts(request.automaton, ctx, max_nodes, self.config.min_match, "suffix",
                               self.certain_step["suffix"], request.pending)
        if self._global_tokens:
            out += automaton_drafts(self.global_automaton, ctx, max_nodes, self.config.global_min_match,
                                    "suffix-global", self.certain_step["suffix-global"], request.pending)
        return out

    # -- Mixture.plan: the drafts and their merge in one compiled call ---------------------------
    fused_kind = "s"

    def compiled_lookup(self, request_id: str) -> tuple | None:
        """The request's compiled automaton, ``automaton_drafts``' fixed parameters
        (``min_match``, ``global_min_match``, then ``suffix_drafts``' levels, divisor, separator,
        empty confidence and match prior), ``max_match`` and the certain-step estimates' table
        (the core reads each value and settles each pending chain into it, as ``observe`` does
        with ``settle_pending``); None where the automata's cores are not compiled (the extension
        not built)."""
        request: _Request = self._requests.get(request_id)
        if request.automaton.backend != "compiled" or self.global_automaton.backend != "compiled":
            return None
        config = self.config
        return request.automaton._core, (config.min_match, config.global_min_match, MATCH_LEVELS,
                                         SHORTER_MATCH_NODES_DIVISOR, SEPARATOR, EMPTY_MATCH_CONFIDENCE,
                                         MATCH_PRIOR), config.max_match, self._certain

    def global_core(self):
        """The global automaton's compiled core for a step's fused plan, None while the global
        cache is empty."""
        return self.global_automaton._core if self._global_tokens else None

    # -- the global cache -----------------------------------------------------------------------
    def add_to_global(self, output: Sequence[int]) -> None:
        """Append one finished output; trim the oldest and rebuild past the capacity."""
        chunk = np.append(np.asarray(output, dtype=np.int64), SEPARATOR)
        self._outputs.append(chunk)
        self._global_tokens += len(chunk)
        if self._global_tokens <= self.config.global_capacity:
            self.global_automaton.extend(chunk)
            return
        keep = GLOBAL_RETAIN * self.config.global_capacity
        while self._outputs and self._global_tokens > keep:
            self._global_tokens -= len(self._outputs.popleft())
        self.global_automaton = SuffixAutomaton(np.concatenate(list(self._outputs)) if self._outputs else ())

    @property
    def global_tokens(self) -> int:
        return self._global_tokens

    def save_global(self, path: str, *, tokenizer_fingerprint: str) -> None:
        """Write the global cache (the retained outputs) to ``path`` (.npz), atomically."""
        stream = np.concatenate(list(self._outputs)) if self._outputs else np.zeros(0, np.int64)
        header = {"format_version": CACHE_FORMAT_VERSION, "tokenizer_fingerprint": tokenizer_fingerprint,
                  "tokens": int(len(stream)), "outputs": len(self._outputs)}
        tmp = f"{path}.tmp.npz"
        np.savez(tmp, stream=stream.astype(np.int32), header=np.array(json.dumps(header)))
        os.replace(tmp, path)

    def load_global(self, path: str, *, tokenizer_fingerprint: str) -> None:
        """Replace the global cache with one saved by ``save_global`` for the same tokenizer."""
        try:
            with np.load(path, allow_pickle=False) as f:
                header = json.loads(str(f["header"]))
                stream = f["stream"].astype(np.int64)
        except (OSError, KeyError, ValueError) as exc:
            raise ValueError(f"{path}: not a lookupdec suffix cache ({exc})") from None
        if header.get("format_version") != CACHE_FORMAT_VERSION:
            raise ValueError(f"{path}: cache format_version {header.get('format_version')!r}, "
                             f"this lookupdec reads {CACHE_FORMAT_VERSION}")
        if header.get("tokenizer_fingerprint") != tokenizer_fingerprint:
            raise ValueError(f"{path}: cache built for tokenizer {header.get('tokenizer_fingerprint')}, "
                             f"this model's tokenizer is {tokenizer_fingerprint}")
        if len(stream) != header.get("tokens"):
            raise ValueError(f"{path}: truncated ({len(stream)} of {header.get('tokens')} tokens)")
        ends = np.flatnonzero(stream == SEPARATOR)
        self._outputs = deque(np.split(stream, ends[:-1] + 1)) if len(ends) else deque()
        self._global_tokens = int(len(stream))
        self.global_automaton = SuffixAutomaton(stream)


_SUFFIX_DRAFTS_KWARGS = ("max_nodes", "min_match", "levels", "shorter_divisor", "separator", "empty_confidence",
                         "match_prior", "certain_step")


def automaton_drafts(automaton: SuffixAutomaton, ctx: Sequence[int], max_nodes: int, min_match: int, source: str,
                     certain_step: CertainStepEstimate, pending: dict) -> list[Draft]:
    """Drafts from the longest match of ``ctx`` in ``automaton`` and up to ``MATCH_LEVELS - 1``
    shorter ones (suffix links), made by its core in one call (``suffix_drafts``: compiled, or the
    reference core, ``lookupdec.reference.drafting.suffix_drafts``, which defines them); each
    draft comes with its arrays (the merge and the calibrator read them as they are), the first
    with its best chain and certain-step flags, which go into ``pending[source]`` for
    ``CertainStepEstimate.update`` once the step's tokens are known."""
    # SuffixAutomaton.suffix_drafts's arguments in its core's order
    args = (max_nodes, min_match, MATCH_LEVELS, SHORTER_MATCH_NODES_DIVISOR, SEPARATOR, EMPTY_MATCH_CONFIDENCE,
            MATCH_PRIOR, certain_step.value)
    levels = None
    if type(ctx) is list and max_nodes >= 0:  # the step's call: straight to the core, past the wrapper's checks
        try:
            levels = automaton._core.suffix_drafts(ctx, *args)
        except TypeError:
            pass  # (the wrapper below names the bad ids)
    if levels is None:
        levels = automaton.suffix_drafts(ctx, **dict(zip(_SUFFIX_DRAFTS_KWARGS, args)))
    out = []
    for tokens, parents, scores, length, chain, chain_certain in levels:
        out.append(Draft._trusted(None, None, None, source, length, packed=(tokens, parents, scores)))
        if chain is not None and source not in pending:
            pending[source] = (chain, chain_certain)
    return out


def settle_pending(pending: dict, estimates: dict[str, CertainStepEstimate], committed: Sequence[int]) -> None:
    """After a step: check each source's pending best chain (left by ``automaton_drafts``)
    against the committed tokens in that source's estimate, then forget the chains."""
    for source, (chain, certain) in pending.items():
        estimates[source].update(chain, certain, committed)
    pending.clear()
