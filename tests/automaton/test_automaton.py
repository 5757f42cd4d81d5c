"""Suffix automaton: compiled core vs pure-Python reference vs brute-force search.

Brute force is the definition: the longest suffix of the context that occurs as a substring of
the stream; its end positions; the tokens that follow them. The compiled core must agree with
it and with the reference core (``lookupdec.reference.automaton.ReferenceAutomaton``, which builds
the same states in the same order; wrapped by ``SuffixAutomaton(core=...)``) after random
extends, for small alphabets (many repeats) and for token ids above 65,535.
"""
from __future__ import annotations

import gc
from collections import Counter

import numpy as np
import pytest

from lookupdec.automaton import SuffixAutomaton, compiled_available
from lookupdec.reference.automaton import ReferenceAutomaton
from references import reference_automaton

if not compiled_available():  # fail, never skip: the compiled core is the product
    pytest.fail("lookupdec._native (the compiled core) is not importable: build it with `pip install -e .` "
                "(or, after a non-editable install, run `pytest`, not `python -m pytest`, from "
                "the repository root, whose lookupdec/ would shadow the installed one)",
                pytrace=False)

from lookupdec.native import drafting as native_drafting  # noqa: E402

CORES = (lambda: native_drafting.Automaton(), ReferenceAutomaton)  # the compiled core, its definition
BIG_VOCAB_BASE = 100_000  # ids above 65,535 (REST's uint16 limit)
INT32_MAX = 2**31 - 1


# ---------------------------------------------------------------- brute force


def brute_match_len(stream: list[int], context: list[int], max_len: int | None = None) -> int:
    longest = len(context) if max_len is None else min(len(context), max_len)
    for length in range(longest, 0, -1):
        if brute_end_positions(stream, context[len(context) - length:]):
            return length
    return 0


def brute_end_positions(stream: list[int], pattern: list[int]) -> list[int]:
    """End positions (index just after) of every occurrence, newest first."""
    m = len(pattern)
    return [e for e in range(len(stream), m - 1, -1) if stream[e - m:e] == pattern]


def brute_next_counts(stream: list[int], pattern: list[int]) -> dict[int, int]:
    ends = brute_end_positions(stream, pattern)
    return dict(Counter(stream[e] for e in ends if e < len(stream)))


# ---------------------------------------------------------------- helpers


def random_stream(rng: np.random.Generator, n: int, vocab: list[int]) -> list[int]:
    """Zipf-like: token i of the vocab has weight 1 / (i + 1), so some contexts repeat a lot."""
    weights = 1.0 / np.arange(1, len(vocab) + 1)
    return [int(t) for t in rng.choice(vocab, size=n, p=weights / weights.sum())]


def random_contexts(rng: np.random.Generator, stream: list[int], vocab: list[int], k: int):
    """Half copied from the stream (long matches), half random (short ones)."""
    for i in range(k):
        length = int(rng.integers(1, 12))
        if i % 2 == 0 and len(stream) > length:
            start = int(rng.integers(0, len(stream) - length + 1))
            yield stream[start:start + length] + random_stream(rng, int(rng.integers(0, 2)), vocab)
        else:
            yield random_stream(rng, length, vocab)


def both(tokens=()) -> tuple[SuffixAutomaton, SuffixAutomaton]:
    return SuffixAutomaton(tokens), reference_automaton(tokens)


def check_queries(compiled: SuffixAutomaton, reference: SuffixAutomaton, stream: list[int],
                  context: list[int]) -> None:
    state, length = compiled.match(context)
    assert (state, length) == reference.match(context), context
    assert length == brute_match_len(stream, context), context
    pattern = context[len(context) - length:]
    if length == 0:
        assert state == 0
        return
    ends = brute_end_positions(stream, pattern)
    assert compiled.end_positions(state, len(ends) + 5).tolist() == ends
    assert compiled.end_positions(state, 2).tolist() == ends[:2]
    assert reference.end_positions(state, len(ends)).tolist() == ends
    assert compiled.count(state) == len(ends) == reference.count(state)
    assert compiled.most_recent_end(state) == ends[0]
    assert compiled.next_counts(state) == brute_next_counts(stream, pattern)
    assert reference.next_counts(state) == compiled.next_counts(state)
    assert compiled.continuation_count(state) == sum(compiled.next_counts(state).values())


# ---------------------------------------------------------------- worked example


def test_worked_example_from_the_docstring():
    tokens = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 6]
    context = [0, 1, 2]
    for core in CORES:
        automaton = SuffixAutomaton(tokens, core=core())
        state, length = automaton.match(context)
        assert length == 2  # [0, 1, 2] never occurred, [1, 2] did
        assert automaton.end_positions(state, 8).tolist() == [14, 10, 6, 2]
        assert automaton.next_counts(state) == {3: 3, 6: 1}
        tree = automaton.propose_tree(context, max_nodes=4, max_depth=3)
        assert tree.token_ids.tolist() == [3, 4, 1, 6]
        assert tree.parents.tolist() == [-1, 0, 1, -1]
        # 6 (1/4) and 5 (3/4 * 1/3) tie at .25: the one pushed first (6) wins, not 5
        assert tree.scores.tolist() == pytest.approx([0.75, 0.5, 0.5, 0.25])
        automaton.check_invariants()


def test_compiled_core_is_the_default():
    assert compiled_available()
    assert SuffixAutomaton().backend == "compiled" and reference_automaton().backend == "reference"


# ---------------------------------------------------------------- random agreement


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("vocab_kind", ["small", "medium", "big"])
def test_random_extends_agree_with_reference_and_brute_force(seed, vocab_kind):
    rng = np.random.default_rng(seed)
    if vocab_kind == "small":
        vocab = list(range(int(rng.integers(2, 5))))
    elif vocab_kind == "medium":  # states with >= HEAVY_DEGREE edges use the hashed index
        vocab = list(range(3 * native_drafting.HEAVY_DEGREE))
    else:  # above 65,535, up to the int32 limit
        vocab = [BIG_VOCAB_BASE + i for i in range(6)] + [70_000, INT32_MAX - 1, INT32_MAX]
    compiled, reference = both()
    stream: list[int] = []
    for _ in range(5):
        chunk = random_stream(rng, int(rng.integers(1, 120)), vocab)
        compiled.extend(chunk)
        reference.extend(np.asarray(chunk, dtype=np.int64))
        stream += chunk
        compiled.check_invariants()
        reference.check_invariants()
        assert len(compiled) == len(stream) and compiled.tokens.tolist() == stream
        assert compiled.num_states == reference.num_states
        for context in random_contexts(rng, stream, vocab, 12):
            check_queries(compiled, reference, stream, context)


def test_match_of_the_streams_own_tail():
    """A context that is the stream's own tail (a request's automaton and its context, every
    step) is matched by suffix links from the last state: the same (state, length) as the
    reference's transition walk, for every tail length, on repetitive and random streams, after
    bulk and small extends; a context differing in one token takes the walk."""
    rng = np.random.default_rng(11)
    for vocab, n in (([0, 1], 300), ([0, 1, 2, 3, 4, 5, 6, 7], 400), ([3], 80)):
        compiled, reference = both()
        stream: list[int] = []
        for chunk in (random_stream(rng, n, vocab), random_stream(rng, 7, vocab), [vocab[0]] * 5):
            compiled.extend(chunk)
            reference.extend(np.asarray(chunk, dtype=np.int64))
            stream += chunk
            for length in list(range(1, 70)) + [len(stream) - 1, len(stream)]:
                tail = stream[-length:]
                check_queries(compiled, reference, stream, tail)
                assert compiled.match(tail)[1] == len(tail)
                changed = tail[:-1] + [99]
                assert compiled.match(changed) == reference.match(changed) == (0, 0)


def test_match_max_len_caps_the_match():
    stream = [5, 6, 7, 8, 9] * 3
    automaton = SuffixAutomaton(stream)
    context = [1, 5, 6, 7, 8, 9, 5, 6]
    assert automaton.match(context)[1] == 7
    for max_len in range(0, 9):
        expected = brute_match_len(stream, context, max_len)
        assert automaton.match(context, max_len=max_len)[1] == expected


def test_counts_exact_across_bulk_and_small_extends():
    """A bulk extend (full recount) followed by small ones (suffix-path walks)."""
    rng = np.random.default_rng(7)
    compiled, reference = both()
    chunks = [random_stream(rng, 12_000, [0, 1, 2])] + [random_stream(rng, 5, [0, 1, 2, 3])] * 20
    for chunk in chunks:
        compiled.extend(chunk)
        reference.extend(chunk)
        state = compiled.match(chunk[-6:])[0]
        assert compiled.count(state) == reference.count(state)
        assert compiled.next_counts(state) == reference.next_counts(state)
    compiled.check_invariants()


def test_repeated_token_stream():
    """A model stuck repeating one token: the deepest suffix-link chain (a path of n states)."""
    compiled, reference = both([9] * 3000)
    compiled.extend([9] * 10)
    reference.extend([9] * 10)
    compiled.check_invariants()
    state, length = compiled.match([9] * 5)
    assert length == 5 and compiled.count(state) == 3010 - 4
    assert compiled.end_positions(state, 3).tolist() == [3010, 3009, 3008]
    assert compiled.next_counts(state) == reference.next_counts(state) == {9: 3005}


def test_clone_of_a_state_with_many_edges():
    """[7, 8] always came as [6, 7, 8] and was followed by 3 * HEAVY_DEGREE different tokens;
    then [5, 7, 8] splits its state: the clone copies every edge (and the hashed index)."""
    fanout = [200 + k for k in range(3 * native_drafting.HEAVY_DEGREE)]
    stream = [t for k in fanout for t in (6, 7, 8, k)] + [5, 7, 8]
    compiled, reference = both(stream)
    compiled.check_invariants()
    state, length = compiled.match([9, 7, 8])
    assert (state, length) == reference.match([9, 7, 8]) and length == 2
    assert compiled.next_counts(state) == {k: 1 for k in fanout}
    compiled.extend([fanout[-1], 7, 8, 300])
    reference.extend([fanout[-1], 7, 8, 300])
    compiled.check_invariants()
    assert compiled.next_counts(state) == reference.next_counts(state)
    assert compiled.next_counts(state)[fanout[-1]] == 2


# ---------------------------------------------------------------- draft trees


def tree_depths(parents: list[int]) -> list[int]:
    depths: list[int] = []
    for p in parents:
        depths.append(1 if p == -1 else depths[p] + 1)
    return depths


def check_tree_format(tree, max_nodes: int, max_depth: int) -> None:
    ids, parents, scores = tree.token_ids.tolist(), tree.parents.tolist(), tree.scores.tolist()
    assert len(ids) == len(parents) == len(scores) <= max_nodes
    assert tree.token_ids.dtype == np.int32 and tree.parents.dtype == np.int32
    seen: set[tuple[int, int]] = set()
    for i, (tok, p) in enumerate(zip(ids, parents)):
        assert -1 <= p < i
        assert (p, tok) not in seen  # children of a node are distinct tokens
        seen.add((p, tok))
        assert 0 < scores[i] <= (1.0 if p == -1 else scores[p])
    assert all(d <= max_depth for d in tree_depths(parents))


def check_tree_against_brute_force(tree, stream: list[int], pattern: list[int]) -> None:
    """Each node's path continues the pattern somewhere in the stream, and its score is the
    product of brute-force next-token frequencies along the path."""
    paths: list[list[int]] = []
    for tok, p in zip(tree.token_ids.tolist(), tree.parents.tolist()):
        paths.append(([] if p == -1 else paths[p]) + [tok])
    for path, score in zip(paths, tree.scores.tolist()):
        expected = 1.0
        for k, tok in enumerate(path):
            counts = brute_next_counts(stream, pattern + path[:k])
            expected *= counts[tok] / sum(counts.values())
        assert score == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("seed", range(8))
def test_propose_tree_format_and_agreement(seed):
    rng = np.random.default_rng(100 + seed)
    if seed % 2:
        vocab = list(range(int(rng.integers(2, 30))))
    else:
        vocab = [BIG_VOCAB_BASE + i for i in range(12)]
    compiled, reference = both()
    stream: list[int] = []
    for _ in range(3):  # extends between proposals: cached children must not go stale
        chunk = random_stream(rng, int(rng.integers(50, 300)), vocab)
        compiled.extend(chunk)
        reference.extend(chunk)
        stream += chunk
        for context in random_contexts(rng, stream, vocab, 10):
            check_proposal(compiled, reference, stream, context, rng)


def check_proposal(compiled, reference, stream, context, rng) -> None:
    max_nodes, max_depth = int(rng.integers(1, 80)), int(rng.integers(1, 8))
    kwargs = dict(max_nodes=max_nodes, max_depth=max_depth, min_count=int(rng.integers(1, 4)))
    tree = compiled.propose_tree(context, **kwargs)
    expected = reference.propose_tree(context, **kwargs)
    for got, want in zip(tree, expected):
        assert got.tolist() == want.tolist()
    check_tree_format(tree, max_nodes, max_depth)
    state, length = compiled.shorten_match(*compiled.match(context), min_count=kwargs["min_count"])
    if length:
        check_tree_against_brute_force(tree, stream, context[len(context) - length:])


def test_proposals_exact_after_bulk_load_and_small_extends():
    """A bulk extend recounts every state and caches the best children of states with many
    edges; later extends must make those entries recompute, never serve stale counts."""
    rng = np.random.default_rng(11)
    vocab = list(range(60))
    stream = random_stream(rng, 6000, vocab)  # > 4096 new leaves: a full recount
    compiled, reference = both(stream)
    for _ in range(4):
        for context in random_contexts(rng, stream, vocab, 8):
            kwargs = dict(max_nodes=int(rng.integers(1, 80)), max_depth=int(rng.integers(1, 6)))
            tree = compiled.propose_tree(context, **kwargs)
            for got, want in zip(tree, reference.propose_tree(context, **kwargs)):
                assert got.tolist() == want.tolist()
            check_tree_format(tree, **kwargs)
        chunk = random_stream(rng, 40, vocab)
        compiled.extend(chunk)
        reference.extend(chunk)
        stream += chunk
    compiled.check_invariants()


def test_propose_falls_back_to_a_shorter_match_with_continuations():
    """Per-request use: the context IS the stream, so its longest match is the whole stream,
    which has no next token; the proposal comes from the longest repeated suffix."""
    stream = [4, 5, 6, 7, 1, 2, 3, 4, 5, 6]
    automaton = SuffixAutomaton(stream)
    assert automaton.match(stream) == (automaton.last_state, len(stream))
    assert automaton.shorten_match(automaton.last_state, len(stream), min_count=1)[1] == 3
    tree = automaton.propose_tree(stream, max_nodes=3, max_depth=3)
    assert tree.token_ids.tolist() == [7, 1, 2]  # what followed [4, 5, 6] before
    assert tree.parents.tolist() == [-1, 0, 1]
    assert len(automaton.propose_tree(stream, max_nodes=3, max_depth=3, min_match=4).token_ids) == 0


def test_propose_budget_edges():
    automaton = SuffixAutomaton([1, 2, 3, 1, 2, 4])
    assert len(automaton.propose_tree([1, 2], max_nodes=0, max_depth=4).token_ids) == 0
    assert len(automaton.propose_tree([1, 2], max_nodes=5, max_depth=0).token_ids) == 0
    assert len(automaton.propose_tree([8], max_nodes=5, max_depth=4).token_ids) == 0  # no match
    assert len(SuffixAutomaton().propose_tree([1], max_nodes=5, max_depth=4).token_ids) == 0
    with pytest.raises(ValueError):
        automaton.expand_tree(0, max_nodes=-1, max_depth=2)


# ---------------------------------------------------------------- API contracts


def test_tokens_view_is_a_stable_snapshot():
    automaton = SuffixAutomaton(range(10))
    view = automaton.tokens
    assert not view.flags.writeable
    for i in range(200):  # many buffer growths
        automaton.extend(np.arange(1000, dtype=np.int32) + i)
    gc.collect()
    assert view.tolist() == list(range(10))
    assert len(automaton.tokens) == 10 + 200 * 1000
    del automaton
    gc.collect()
    assert view.tolist() == list(range(10))  # the view keeps its buffer alive


def test_invalid_input_is_loud():
    automaton = SuffixAutomaton([1, 2, 3])
    with pytest.raises(ValueError):
        automaton.extend([4, -1])
    with pytest.raises(ValueError):
        automaton.extend([2**31])
    with pytest.raises(ValueError):
        automaton.extend(np.array([2**40], dtype=np.int64))
    with pytest.raises(TypeError):
        automaton.extend(np.array([1.5]))
    with pytest.raises(ValueError):
        automaton.extend([[4, 5], [6, 7]])  # 2-D: never flattened silently
    assert len(automaton) == 3  # nothing of a rejected extend was kept
    with pytest.raises(IndexError):
        automaton.count(automaton.num_states)


@pytest.mark.xfail(strict=True, reason="the compiled core divides the root's children's counts by the root's "
                                      "continuation count (csrc/drafting/automaton.cpp, continuation_total), one "
                                      "fewer than their sum, which the reference divides by")
def test_the_roots_children_score_their_share_of_every_position():
    """A match of no token (the root: ``SuffixConfig.global_min_match`` 0 drafts from it) expands
    into each token's share of the stream's tokens, ``count / sum of the counts`` as everywhere
    else, in the reference and the compiled core alike."""
    stream = [7, 2, 7, 2, 3, 7]
    compiled, reference = both(stream)
    want = [3 / 6, 2 / 6, 1 / 6]  # 7, 2, 3
    assert reference.expand_tree(0, max_nodes=3, max_depth=1).scores.tolist() == want
    assert compiled.expand_tree(0, max_nodes=3, max_depth=1).scores.tolist() == want


def test_check_invariants_raises_assertion_error_on_a_broken_automaton():
    automaton = reference_automaton([1, 2, 1, 2, 3])
    automaton.check_invariants()
    automaton._core._link[3] = 3  # a state cannot be its own suffix link
    with pytest.raises(AssertionError, match="link"):
        automaton.check_invariants()


def test_memory_report():
    rng = np.random.default_rng(3)
    automaton = SuffixAutomaton(np.minimum(rng.zipf(1.3, size=200_000), 32_000))
    report = automaton.memory_report()
    assert set(report) == {"tokens", "states", "edges", "heavy_tables", "pending_leaves",
                           "children_cache", "tree_cache"}
    assert automaton.memory_bytes() == sum(report.values())
    assert automaton.memory_bytes() / len(automaton) < 150


@pytest.mark.parametrize("seed", range(6))
def test_expansions_again_without_an_extend_are_the_cached_trees_of_the_same_stream(seed):
    """``expand_tree`` keeps its trees until the next extend (the global cache meets the same
    states step after step): a second call is a cache hit and the same tree as the reference's;
    after an extend every tree is the one a fresh automaton of the longer stream grows."""
    rng = np.random.default_rng(seed)
    stream = [int(t) for t in rng.integers(0, 6, size=300)]
    compiled, reference = SuffixAutomaton(stream), reference_automaton(stream)

    def same_tree(a, b):
        return (list(a.token_ids), list(a.parents), list(a.scores)) == (list(b.token_ids), list(b.parents), list(b.scores))

    states = sorted({compiled.match(stream[: int(end)])[0] for end in rng.integers(5, len(stream), size=12)})
    budgets = [(3, 3), (16, 16), (64, 8)]
    for state in states:
        for max_nodes, max_depth in budgets:
            first = compiled.expand_tree(state, max_nodes=max_nodes, max_depth=max_depth)
            assert same_tree(first, reference.expand_tree(state, max_nodes=max_nodes, max_depth=max_depth))
    hits = compiled._core.tree_cache_hits()
    for state in states:
        for max_nodes, max_depth in budgets:
            again = compiled.expand_tree(state, max_nodes=max_nodes, max_depth=max_depth)
            assert same_tree(again, reference.expand_tree(state, max_nodes=max_nodes, max_depth=max_depth))
    assert compiled._core.tree_cache_hits() == hits + len(states) * len(budgets)
    assert compiled.memory_report()["tree_cache"] > 0
    more = [int(t) for t in rng.integers(0, 6, size=40)]
    compiled.extend(more)
    fresh = reference_automaton(stream + more)
    hits = compiled._core.tree_cache_hits()
    for state in states:  # the same state numbers name the same strings' states in the longer stream
        for max_nodes, max_depth in budgets:
            grown = compiled.expand_tree(state, max_nodes=max_nodes, max_depth=max_depth)
            assert same_tree(grown, fresh.expand_tree(state, max_nodes=max_nodes, max_depth=max_depth))
    assert compiled._core.tree_cache_hits() == hits  # the extend emptied the cache
