"""The suffix-automaton proposer: drafts, lifecycle, the global cache's capacity and persistence;
its compiled drafts (``automaton_drafts``' one call into the core) against their definition,
``lookupdec.reference.drafting.suffix_drafts`` over the reference core: the same drafts (tokens,
parents, bit-identical scores, match lengths), best chains and certain-step flags, over random
streams with separators, contexts and parameters."""
import random

import numpy as np
import pytest

from helpers import draft_paths, needs_core
from lookupdec.automaton import SuffixAutomaton
from lookupdec.config import SuffixConfig
from lookupdec.proposers.suffix import (EMPTY_MATCH_CONFIDENCE, MATCH_LEVELS, MATCH_PRIOR, SEPARATOR,
                                        SHORTER_MATCH_NODES_DIVISOR, SuffixProposer)
from lookupdec.reference import drafting as reference_drafting
from lookupdec.reference.drafting import without_separator
from random_inputs import random_stream
from references import reference_automaton


def test_request_automaton_drafts_what_followed_the_context():
    p = SuffixProposer()
    prompt = [5, 6, 7, 8, 9, 1, 2, 5, 6]
    p.start("r", prompt)
    drafts = p.propose("r", prompt, max_nodes=8)
    assert (7, 8, 9, 1) in draft_paths(drafts)  # [5, 6] was followed by 7 8 9 1 ...
    for d in drafts:
        assert all(0 < s <= 1 for s in d.scores)
        assert all(d.scores[i] <= d.scores[p_] for i, p_ in enumerate(d.parents) if p_ >= 0)


def test_observe_extends_and_global_cache_learns_across_requests():
    p = SuffixProposer()
    p.start("a", [1, 2, 3])
    p.observe("a", [40, 41, 42, 43, 44])
    p.stop("a")
    assert p.global_tokens == 6  # 5 output tokens + separator
    p.start("b", [9, 9, 40, 41])
    drafts = p.propose("b", [9, 9, 40, 41], max_nodes=8)
    assert any(d.source == "suffix-global" for d in drafts)
    assert (42, 43, 44) in draft_paths([d for d in drafts if d.source == "suffix-global"])
    assert all(SEPARATOR not in d.token_ids for d in drafts)


def test_lifecycle_errors_name_the_request():
    p = SuffixProposer()
    p.start("x", [1, 2])
    with pytest.raises(ValueError, match="'x'"):
        p.start("x", [1, 2])
    with pytest.raises(ValueError, match="'y'"):
        p.propose("y", [1, 2], max_nodes=4)
    with pytest.raises(ValueError, match="'y'"):
        p.observe("y", [3])
    p.stop("x")
    with pytest.raises(ValueError, match="'x'"):
        p.stop("x")


@pytest.mark.parametrize("bad", [2**31, 2**40, -1])
def test_a_context_id_outside_int32_is_a_value_error(bad):
    # the compiled drafting calls the core directly; its TypeError (overflow) becomes the
    # wrapper's ValueError, and the core raises that itself for a negative id
    p = SuffixProposer()
    p.start("r", [1, 2, 3, 1, 2])
    with pytest.raises(ValueError, match="token ids must be in"):
        p.propose("r", [1, 2, 3, 1, bad], max_nodes=8)


def test_global_capacity_drops_oldest_outputs():
    p = SuffixProposer(SuffixConfig(global_capacity=40))
    for r in range(10):
        p.start(f"r{r}", [1])
        p.observe(f"r{r}", [100 + r] * 9)
        p.stop(f"r{r}")
        assert p.global_tokens <= 40
    stream = p.global_automaton.tokens
    assert 100 + 9 in stream and 100 not in stream  # newest kept, oldest dropped
    p.global_automaton.check_invariants()


def test_no_global_cache_when_capacity_is_zero():
    p = SuffixProposer(SuffixConfig(global_capacity=0))
    p.start("a", [1])
    p.observe("a", [2, 3])
    p.stop("a")
    assert p.global_tokens == 0


def test_save_load_round_trip_and_checks(tmp_path):
    p = SuffixProposer()
    for r, out in enumerate([[7, 8, 9], [70000, 70001]]):  # ids above 65535 survive
        p.start(str(r), [1])
        p.observe(str(r), out)
        p.stop(str(r))
    path = str(tmp_path / "cache.npz")
    p.save_global(path, tokenizer_fingerprint="abc")
    q = SuffixProposer()
    q.load_global(path, tokenizer_fingerprint="abc")
    assert np.array_equal(q.global_automaton.tokens, p.global_automaton.tokens)
    assert q.global_tokens == p.global_tokens
    with pytest.raises(ValueError, match="tokenizer"):
        SuffixProposer().load_global(path, tokenizer_fingerprint="other")
    (tmp_path / "bad.npz").write_bytes(b"not a cache")
    with pytest.raises(ValueError, match="not a lookupdec suffix cache"):
        SuffixProposer().load_global(str(tmp_path / "bad.npz"), tokenizer_fingerprint="abc")


def test_without_separator_drops_descendants():
    tokens, parents, scores = without_separator([5, SEPARATOR, 7, 8], [-1, -1, 1, 0], [.9, .5, .5, .8], SEPARATOR)
    assert tokens == [5, 8] and parents == [-1, 0] and scores == [.9, .8]


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="min_match"):
        SuffixConfig(min_match=0)
    with pytest.raises(ValueError, match="global_capacity"):
        SuffixConfig(global_capacity=-1)


# -- the compiled drafts against their definition ---------------------------------------------------
@needs_core
@pytest.mark.parametrize("seed", range(40))
def test_compiled_suffix_drafts_equal_the_reference(seed):
    """The compiled core's suffix drafts (``SuffixAutomaton.suffix_drafts``) against their
    definition, ``reference.drafting.suffix_drafts``, over the same automaton's queries: per draft
    the same arrays bit for bit, match length, best chain and certain-step flags, for contexts
    copied from the stream and random ones, budgets, and parameters around the proposer's own; and
    over the reference core (``ReferenceAutomaton``) extended alike, the same drafts where the
    matches are a token or longer (the root's children: ``test_automaton.py``)."""
    rng = random.Random(seed)
    vocab = rng.choice((3, 8, 30))
    fast, ref = SuffixAutomaton(), reference_automaton()
    for _ in range(rng.randint(1, 6)):
        chunk = random_stream(rng, rng.randint(1, 80), vocab)
        for automaton in (fast, ref):
            automaton.extend(chunk)
        tokens = fast.tokens.tolist()
        for _ in range(6):
            if rng.random() < 0.7:
                end = rng.randint(1, len(tokens))
                ctx = tokens[max(0, end - rng.randint(1, 64)):end]
            else:
                ctx = random_stream(rng, rng.randint(1, 20), vocab)
            proposer = rng.random() < 0.5  # the proposer's own parameters
            kwargs = dict(max_nodes=rng.choice((0, 1, 2, 5, 16, 64)), min_match=rng.choice((0, 1, 2)),
                          levels=MATCH_LEVELS if proposer else rng.choice((1, 2, 3)),
                          shorter_divisor=SHORTER_MATCH_NODES_DIVISOR if proposer else rng.choice((1, 3)),
                          separator=SEPARATOR,
                          empty_confidence=EMPTY_MATCH_CONFIDENCE if proposer else rng.choice((0.0, 0.5)),
                          match_prior=MATCH_PRIOR if proposer else 0.5, certain_step=rng.choice((0.5, 0.9, 1.0)))
            got = fast.suffix_drafts(ctx, **kwargs)
            assert got == reference_drafting.suffix_drafts(fast, ctx, **kwargs), (ctx, kwargs)
            if kwargs["min_match"] >= 1:
                assert got == ref.suffix_drafts(ctx, **kwargs), (ctx, kwargs)


def test_packed_arrays_and_pending_chain_are_the_drafts_own():
    p = SuffixProposer()
    prompt = [5, 6, 7, 8, 9, 1, 2, 5, 6, 7, 3, 5, 6]
    p.start("r", prompt)
    drafts = p.propose("r", prompt, 8)
    assert drafts
    chain, certain = p._requests.get("r").pending["suffix"]  # the longest match's, checked after the step
    assert chain == drafts[0].best_chain()[0] and len(certain) == len(chain)
    for draft in drafts:
        tokens, parents, scores = draft.packed()
        assert np.frombuffer(tokens, np.int32).tolist() == list(draft.token_ids)
        assert np.frombuffer(parents, np.int32).tolist() == list(draft.parents)
        assert np.frombuffer(scores, np.float64).tolist() == list(draft.scores)
        fresh = type(draft)(draft.token_ids, draft.parents, draft.scores, draft.source, draft.match_length)
        assert draft.best_chain() == fresh.best_chain()
