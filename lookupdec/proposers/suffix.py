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

    def __init__(self, config: SuffixConfig | None = None, *, drafting: str = "auto") -> None:
        """``drafting``: "auto" (``automaton_drafts``: compiled where the automata are) or
        "reference" (``automaton_drafts_reference``, the pure-Python definition; same drafts)."""
        if drafting not in ("auto", "reference"):
            raise ValueError(f"drafting must be 'auto' or 'reference', got {drafting!r}")
        self.config = config or SuffixConfig()
        self.drafting = drafting
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
        drafts = automaton_drafts if self.drafting == "auto" else automaton_drafts_reference
        out = drafts(request.automaton, ctx, max_nodes, self.config.min_match, "suffix", self.certain_step["suffix"],
                     request.pending)
        if self._global_tokens:
            out += drafts(self.global_automaton, ctx, max_nodes, self.config.global_min_match, "suffix-global",
                          self.certain_step["suffix-global"], request.pending)
        return out

    # -- Mixture.plan: the drafts and their merge in one compiled call ---------------------------
    fused_kind = "s"

    def compiled_lookup(self, request_id: str) -> tuple | None:
        """The request's compiled automaton, ``automaton_drafts``' fixed parameters
        (``min_match``, ``global_min_match``, then ``suffix_drafts``' levels, divisor, separator,
        empty confidence and match prior), ``max_match`` and the certain-step estimates' table
        (the core reads each value and settles each pending chain into it, as ``observe`` does
        with ``settle_pending``); None where drafting is not compiled (``drafting="reference"``,
        or automata without the core)."""
        request: _Request = self._requests.get(request_id)
        if self.drafting != "auto" or request.automaton.backend != "compiled" or \
                self.global_automaton.backend != "compiled":
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
    """``automaton_drafts_reference``'s drafts, made by the compiled core in one call
    (``csrc/drafting/suffix_drafts.cpp``) when the automaton is compiled; each draft comes with its
    arrays (the merge and the calibrator read them as they are), the first with its best chain
    and certain-step flags for ``pending``."""
    if automaton.backend != "compiled":
        return automaton_drafts_reference(automaton, ctx, max_nodes, min_match, source, certain_step, pending)
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


def automaton_drafts_reference(automaton: SuffixAutomaton, ctx: Sequence[int], max_nodes: int, min_match: int,
                               source: str, certain_step: CertainStepEstimate, pending: dict) -> list[Draft]:
    """Drafts from the longest match of ``ctx`` in ``automaton`` and up to ``MATCH_LEVELS - 1``
    shorter ones (suffix links: fewer context tokens, more occurrences, more varied
    continuations). The longest match's best chain goes into ``pending[source]`` with its
    certain-step flags, for ``CertainStepEstimate.update`` once the step's tokens are known."""
    state, length = automaton.match(ctx)
    out = []
    while state >= 0 and length >= min_match and len(out) < MATCH_LEVELS:
        if automaton.continuation_count(state):
            level_nodes = max_nodes if not out else max(1, max_nodes // SHORTER_MATCH_NODES_DIVISOR)
            # no depth cap of its own: n nodes are at most n deep (the step's merge caps the depth)
            tree = automaton.expand_tree(state, max_nodes=level_nodes, max_depth=level_nodes)
            tokens, parents, raw = without_separator(tree.token_ids, tree.parents, tree.scores)
            if tokens:
                confidence = (length + EMPTY_MATCH_CONFIDENCE) / (length + EMPTY_MATCH_CONFIDENCE + MATCH_PRIOR)
                scores, certain = decay_certain_steps(parents, raw, confidence, certain_step.value)
                draft = Draft(tuple(tokens), tuple(parents), tuple(scores), source, length)
                if source not in pending:
                    chain, _ = draft.best_chain()
                    pending[source] = (chain, _chain_flags(draft, chain, certain))
                out.append(draft)
        state = automaton.suffix_link(state)
        length = automaton.state_len(state) if state >= 0 else -1
    return out


def settle_pending(pending: dict, estimates: dict[str, CertainStepEstimate], committed: Sequence[int]) -> None:
    """After a step: check each source's pending best chain (left by ``automaton_drafts``)
    against the committed tokens in that source's estimate, then forget the chains."""
    for source, (chain, certain) in pending.items():
        estimates[source].update(chain, certain, committed)
    pending.clear()


def decay_certain_steps(parents: Sequence[int], scores: Sequence[float], scale: float,
                        certain_step: float) -> tuple[list[float], list[bool]]:
    """Scores times ``scale``, where a step every earlier occurrence agreed on (conditional
    frequency 1, often a single occurrence) counts ``certain_step`` instead of 1: copying goes
    on with high but not total probability, learnt per workload. Also returns which nodes are
    such certain steps.

    >>> s, c = decay_certain_steps([-1, 0, 1], [1.0, 1.0, 0.5], 0.5, 0.9)
    >>> [round(x, 3) for x in s], c
    ([0.45, 0.405, 0.203], [True, True, False])
    """
    out: list[float] = []
    certain: list[bool] = []
    for i, p in enumerate(parents):
        parent_raw = 1.0 if p < 0 else scores[p]
        parent_new = scale if p < 0 else out[p]
        cond = scores[i] / parent_raw if parent_raw > 0 else 0.0
        certain.append(cond >= 1.0 - 1e-9)
        out.append(parent_new * (certain_step if certain[-1] else cond))
    return out, certain


def _chain_flags(draft: Draft, chain: Sequence[int], certain: Sequence[bool]) -> list[bool]:
    """``certain`` flags of the nodes along ``chain`` (the draft's best path)."""
    flags, node, children = [], -1, {}
    for i, p in enumerate(draft.parents):
        children.setdefault((p, draft.token_ids[i]), i)
    for token in chain:
        node = children[(node, token)]
        flags.append(certain[node])
    return flags


def without_separator(token_ids, parents, scores) -> tuple[list[int], list[int], list[float]]:
    """Drop separator nodes and their descendants; renumber parents.

    >>> without_separator([5, SEPARATOR, 7, 8], [-1, -1, 1, 0], [.9, .5, .5, .8])
    ([5, 8], [-1, 0], [0.9, 0.8])
    """
    token_ids, parents = token_ids.tolist() if hasattr(token_ids, "tolist") else list(token_ids), list(parents)
    scores = scores.tolist() if hasattr(scores, "tolist") else list(scores)
    if SEPARATOR not in token_ids:
        return token_ids, [int(p) for p in parents], scores
    new_index, out_t, out_p, out_s = {}, [], [], []
    for i, (tok, par) in enumerate(zip(token_ids, parents)):
        if tok == SEPARATOR or (par >= 0 and par not in new_index):
            continue
        new_index[i] = len(out_t)
        out_t.append(tok)
        out_p.append(-1 if par < 0 else new_index[par])
        out_s.append(scores[i])
    return out_t, out_p, out_s
