"""Suffix automaton over token ids: where the end of a context occurred before, and what followed.

APPEND-ONLY: tokens are only ever appended (``extend``); a change in the middle needs a
rebuild (a new ``SuffixAutomaton`` over the tokens to keep).

Vocabulary used below. The *stream* is every token appended so far (``tokens``). A *state*
(an int) stands for a set of substrings of the stream that occur at exactly the same *end
positions*; an end position is the index just after an occurrence, so an occurrence of ``s``
ending at ``e`` is ``tokens[e - len(s):e]`` and its *next token* is ``tokens[e]`` (none when
``e == len(tokens)``). State 0 is the root: the empty string. Token ids are int32 (any
vocabulary up to 2**31 - 1; ids above 65,535 are ordinary); the stream holds up to 2**29 - 1
tokens (int32 state and edge ids).

Worked example (tests/automaton/test_automaton.py uses the same arrays)::

    tokens  = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 6]
    context = [0, 1, 2]
    match(context)             -> (state, 2)      [0, 1, 2] never occurred, [1, 2] did
    end_positions(state, 8)    -> [14, 10, 6, 2]  just after each [1, 2], newest first
    next_counts(state)         -> {3: 3, 6: 1}    three [1, 2, 3] and one [1, 2, 6]
    propose_tree(context, max_nodes=4, max_depth=3)
        token_ids -> [3,   4,  1,  6]
        parents   -> [-1,  0,  1, -1]
        scores    -> [.75, .5, .5, .25]
    3 scores 3/4; under it 4 scores 3/4 * 2/3 = .5 (two of the three [1, 2, 3] went on with
    4) and 1 scores .5 * 1; the fourth node ties at .25 between 6 (1/4) and 5 (3/4 * 1/3):
    the one pushed first, 6, wins.

Propose (``propose_tree``): match the last ``max_match`` tokens of the context (the longest
suffix that occurred; the match runs over a short tail first and widens it only while the
match fills it, so it costs about the match length, not ``max_match``). While the matched
state has fewer than ``min_count`` occurrences followed by a token (the occurrence that IS the
end of the stream has none, e.g. when the context itself is in the stream), fall back along
suffix links to the longest shorter match that has enough (``shorten_match``). From that
state, ``expand_tree`` grows a best-first subtree: a node's score is the product along its path
of next-token frequencies ``count(child) / sum of the counts of it and its siblings``, so
scores never increase from parent to child. Deeper nodes follow the automaton's transitions
(the matched string grows); below a string that occurred once, the single continuation is
read from the stream. Ties: higher score first, then the candidate pushed first; children are
pushed in order of count (descending), then token id (ascending). The best children of states
with many edges are cached; an entry is valid while its state's continuation count is
unchanged (a new occurrence of any child raises it), so the cache never changes a result. A
full recount (after a bulk extend, e.g. loading a global cache) fills it for every state with
32 or more edges, so that no proposal pays their scan cold.

Counts and end positions: each state's occurrence count and most recent end position are
exact whenever they are read. ``extend`` only notes the new leaf state of each appended token;
the next query adds 1 along each noted leaf's suffix-link path (cost: the leaf's depth, ~15
on real text, 8 walks interleaved), or, after a bulk extend where that would cost more,
recounts every state (states sorted by length, one pass, linear in the states). Then
``most_recent_end`` is O(1), and ``end_positions`` walks the suffix-link subtree best-first by
newest end position, so its cost grows with ``limit``, not with the number of occurrences.

Memory (measured by bench/automaton_bench.py): about 77 bytes per token at 10M tokens of real
text (1.6 states of 28 B and 1.8 list edges of 12 B per token, a small hash table per state
with many edges, the int32 token stream). Not thread-safe: calls hold the GIL, and queries
update internal caches.

The compiled automaton (``lookupdec.native.drafting.Automaton``, C++ in ``csrc/drafting/``
through nanobind, built by ``pip install``) is the core ``SuffixAutomaton`` wraps;
``lookupdec.reference.automaton.ReferenceAutomaton`` defines it, a pure-Python core with the same
interface and state numbering, which the tests hand in (``core=``) to compare the two. If the
extension was not built (a source tree without ``pip install -e .``), the reference is the
core, with a warning: slow, but correct.
"""
from __future__ import annotations

import warnings
from typing import NamedTuple, Sequence

import numpy as np

from lookupdec.config import DEFAULT_MAX_MATCH  # context tokens matched by propose_tree (its comment: why)
from lookupdec.native import drafting as native_drafting  # None where not built: see the module docstring
from lookupdec.reference.automaton import ReferenceAutomaton

__all__ = ["SuffixAutomaton", "TreeArrays", "compiled_available", "DEFAULT_MAX_MATCH"]

INT32_MAX = 2**31 - 1


class TreeArrays(NamedTuple):  # read-only arrays
    token_ids: np.ndarray  # [num_nodes] int32
    parents: np.ndarray  # [num_nodes] int32, -1 = child of the root, parents[i] < i
    scores: np.ndarray  # [num_nodes] float64, product of next-token frequencies on the path


def compiled_available() -> bool:
    return native_drafting is not None


def _array(values: bytes | np.ndarray, dtype: type) -> np.ndarray:
    """The compiled core returns small arrays as bytes (cheaper than numpy arrays to make):
    a read-only view of them; the reference returns numpy arrays."""
    return np.frombuffer(values, dtype=dtype) if isinstance(values, bytes) else values


def _int32_tokens(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    """[n] int32 contiguous array; ValueError for ids outside [0, 2**31 - 1] or not 1-D."""
    if type(tokens) is np.ndarray and tokens.dtype == np.int32 and tokens.ndim == 1:  # fast path
        return tokens if tokens.flags.c_contiguous else np.ascontiguousarray(tokens)
    if isinstance(tokens, (list, tuple, range)):
        try:
            array = np.asarray(tokens, dtype=np.int32)
        except OverflowError as exc:
            raise ValueError("token ids must be in [0, 2**31 - 1]") from exc
        if array.size and array.min() < 0:  # -1 fits int32: checked, as for arrays below
            raise ValueError("token ids must be in [0, 2**31 - 1]")
    else:  # numpy arrays, torch tensors, ...
        array = np.asarray(tokens)
        if array.dtype != np.int32 and array.size:
            if array.dtype.kind not in "iu":
                raise TypeError(f"token ids must be integers, got dtype {array.dtype}")
            if array.min() < 0 or array.max() > INT32_MAX:
                raise ValueError("token ids must be in [0, 2**31 - 1]")
        array = array.astype(np.int32, copy=False)
    if array.ndim != 1:
        raise ValueError(f"token ids must be 1-D, got shape {array.shape}")
    return np.ascontiguousarray(array)


def _default_core():
    if native_drafting is not None:
        return native_drafting.Automaton()
    warnings.warn("lookupdec.automaton: compiled core not built (run `pip install -e .` in "
                  "the repository); using the slow pure-Python reference", RuntimeWarning,
                  stacklevel=3)
    return ReferenceAutomaton()


class SuffixAutomaton:
    """APPEND-ONLY suffix automaton over int32 token ids (see the module docstring).

    ``core``: an empty automaton core to wrap; by default the compiled one, else (the extension
    not built) the reference with a warning. Tests hand in a
    ``lookupdec.reference.automaton.ReferenceAutomaton`` to compare the two.
    """

    def __init__(self, tokens: Sequence[int] | np.ndarray = (), *, core=None) -> None:
        self._core = _default_core() if core is None else core
        self.backend = "reference" if isinstance(self._core, ReferenceAutomaton) else "compiled"
        self.extend(tokens)

    def __repr__(self) -> str:
        return (f"SuffixAutomaton(backend={self.backend!r}, tokens={len(self)}, "
                f"states={self.num_states})")

    def extend(self, tokens: Sequence[int] | np.ndarray) -> None:
        """Append tokens to the stream (amortised O(1) per token)."""
        if type(tokens) is list and self.backend == "compiled":  # a step's few tokens: no numpy
            try:
                return self._core.extend_list(tokens)
            except TypeError:
                pass  # not int32: _int32_tokens says why
        self._core.extend(_int32_tokens(tokens))

    def __len__(self) -> int:
        return self._core.size()

    @property
    def tokens(self) -> np.ndarray:
        """[len(self)] int32, read-only: a snapshot that later extends leave unchanged."""
        return self._core.tokens()

    @property
    def num_states(self) -> int:
        return self._core.num_states()

    @property
    def last_state(self) -> int:
        """The state of the whole stream (only it ends at len(self))."""
        return self._core.last_state()

    # ------------------------------------------------------------ matching

    def match(self, context: Sequence[int] | np.ndarray, max_len: int | None = None
              ) -> tuple[int, int]:
        """(state, length) of the longest suffix of ``context`` (at most ``max_len`` tokens)
        that occurs in the stream; (0, 0) = only the empty string. Cost O(min(len, max_len))."""
        if max_len is not None:
            if max_len < 0:
                raise ValueError(f"max_len must be >= 0, got {max_len}")
            context = context[max(len(context) - max_len, 0):]
        return self._core.match(_int32_tokens(context))

    def shorten_match(self, state: int, length: int, *, min_count: int) -> tuple[int, int]:
        """Follow suffix links from a match until its state has at least ``min_count``
        occurrences followed by a token; (0, 0) if no non-empty match has."""
        while length > 0 and self._core.continuation_count(state) < min_count:
            state = self._core.suffix_link(state)
            length = self._core.state_len(state)
        return state, length

    def state_len(self, state: int) -> int:
        """Length of the longest string of ``state``."""
        return self._core.state_len(state)

    def suffix_link(self, state: int) -> int:
        """The state of the longest suffix that occurs at more end positions (-1 for root)."""
        return self._core.suffix_link(state)

    # ------------------------------------------------------------ occurrences

    def count(self, state: int) -> int:
        """Number of end positions (occurrences) of ``state``'s strings."""
        return self._core.count(state)

    def continuation_count(self, state: int) -> int:
        """Occurrences followed by a token (all but the one ending the stream, if any)."""
        return self._core.continuation_count(state)

    def most_recent_end(self, state: int) -> int:
        """Newest end position of ``state`` (O(1)); continue reading at ``tokens[end]``."""
        return self._core.most_recent_end(state)

    def end_positions(self, state: int, limit: int) -> np.ndarray:
        """[min(limit, count)] int32 end positions of ``state``, newest first (read-only)."""
        return _array(self._core.end_positions(state, limit), np.int32)

    def next_counts(self, state: int) -> dict[int, int]:
        """next token -> number of occurrences of ``state``'s strings followed by it."""
        tokens, counts = self._core.next_counts(state)
        return dict(zip(_array(tokens, np.int32).tolist(), _array(counts, np.int32).tolist()))

    # ------------------------------------------------------------ drafting

    def expand_tree(self, state: int, *, max_nodes: int, max_depth: int) -> TreeArrays:
        """Best-first subtree of continuations of ``state`` (module docstring: scores, ties)."""
        _check_budget(max_nodes, max_depth)
        return _tree_arrays(self._core.expand_tree(state, max_nodes, max_depth))

    def propose_tree(self, context: Sequence[int] | np.ndarray, *, max_nodes: int,
                     max_depth: int, min_match: int = 1, min_count: int = 1,
                     max_match: int = DEFAULT_MAX_MATCH) -> TreeArrays:
        """match (of the last ``max_match`` tokens) -> shorten_match(min_count) -> expand_tree;
        empty if the match is shorter than ``min_match`` tokens. One call into the core."""
        _check_budget(max_nodes, max_depth)
        window = _int32_tokens(context[max(len(context) - max_match, 0):])
        return _tree_arrays(self._core.propose_tree(window, max_nodes, max_depth, min_match,
                                                    min_count))

    def suffix_drafts(self, context: Sequence[int] | np.ndarray, *, max_nodes: int, min_match: int, levels: int,
                      shorter_divisor: int, separator: int, empty_confidence: float, match_prior: float,
                      certain_step: float) -> list[tuple]:
        """The suffix proposer's drafts in one call into the core (``lookupdec.proposers.suffix.
        automaton_drafts``; defined by ``lookupdec.reference.drafting.suffix_drafts``, which
        documents the arguments): per draft, ``(token_ids, parents, scores, match_length, chain,
        chain_certain)``: the draft's arrays as bytes (int32, int32, float64); the first draft's
        best chain as lists (tokens, certain-step flags), None for the others."""
        _check_budget(max_nodes, max_nodes)
        if shorter_divisor < 1:
            raise ValueError(f"shorter_divisor must be >= 1, got {shorter_divisor}")
        if type(context) is not list:
            context = _int32_tokens(context).tolist()
        try:
            return self._core.suffix_drafts(context, max_nodes, min_match, levels, shorter_divisor, separator,
                                            empty_confidence, match_prior, certain_step)
        except TypeError:
            _int32_tokens(context)  # raises the ValueError naming the bad ids
            raise

    # ------------------------------------------------------------ checks

    def check_invariants(self) -> None:
        """Raise AssertionError naming the first broken invariant (structure, edges,
        suffix-link tree, counts against a recount). O(states log states)."""
        error = self._core.check_invariants()
        if error:
            raise AssertionError(f"SuffixAutomaton ({self.backend}): {error}")

    def memory_report(self) -> dict[str, int]:
        """Resident bytes per part of the compiled core (the pages its arrays touched, the
        token buffer's capacity, the hash index's slots); empty for the reference."""
        return dict(self._core.memory_report())

    def memory_bytes(self) -> int:
        return sum(self.memory_report().values())


def _check_budget(max_nodes: int, max_depth: int) -> None:
    if max_nodes < 0 or max_depth < 0:
        raise ValueError(f"max_nodes and max_depth must be >= 0, got {max_nodes}, {max_depth}")


def _tree_arrays(arrays: tuple) -> TreeArrays:
    token_ids, parents, scores = arrays
    return TreeArrays(_array(token_ids, np.int32), _array(parents, np.int32),
                      _array(scores, np.float64))
