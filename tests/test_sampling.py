"""Exactness of sampling acceptance, three ways:

1. closed form: on a small vocabulary the acceptance walk's outcome probabilities are computed
   exactly by recursion; the probability of every output sequence of length 2 and 3 equals plain
   sampling's (a product of processed target probabilities), to 1e-6;
2. Monte Carlo: >= 20k draws through the real ``accept`` with a seeded generator, and an
   end-to-end run of ``Engine.generate`` over many seeds; total variation under a bound from N;
3. seed determinism: same seed, same output.

The reference for logits processing is ``transformers``' own processors (repetition penalty,
temperature, top-k, top-p, in that order), not ``lookupdec.sampling.process_row``.

Then the greedy walk's fast forms against their definition, ``reference.sampling.accept`` (every
row's argmax): ``accept``
over whole logits (ties, NaN, infinities, strided views), over partial logits (``PartialLogits``:
the rows ``head_rows`` picks computed up front, the rest as the walk reaches them) and over the
picks a skinny head makes as it writes the rows.
"""
from __future__ import annotations

import itertools
import math
import random
from collections import Counter

import numpy as np
import pytest
import torch

from conftest import cached_references, cached_tiny
from distributions import V, hf_processors, plain_probs, synthetic_logits, total_variation, tv_between, tv_bound
from helpers import EOS, FakeTokenizer, OracleProposer, RandomTreeProposer, needs_core
from lookupdec import Engine, EngineConfig
from lookupdec.proposers import build_proposers
from lookupdec.proposers.base import Draft
from lookupdec.reference.request import top_tokens as reference_top_tokens
from lookupdec.reference.sampling import accept as reference_accept
from lookupdec.sampling import PartialLogits, SamplingParams, accept, head_rows, process_row, target_probs
from lookupdec.tree import TokenTree
from random_inputs import random_scored_tree, random_trie

CONTEXT = [1, 4, 4, 2]  # committed tokens; the root is the last one
CLOSED_FORM_TOL = 1e-6

PARAMS = {
    "plain": SamplingParams(temperature=1.0),
    "cold_topk": SamplingParams(temperature=0.7, top_k=4),
    "hot_topp": SamplingParams(temperature=1.3, top_p=0.8),
    "reppen": SamplingParams(temperature=0.9, repetition_penalty=1.5),
    "reppen_below_1": SamplingParams(temperature=1.0, repetition_penalty=0.7),
    "everything": SamplingParams(temperature=0.8, top_k=5, top_p=0.9, repetition_penalty=1.3),
    "all_strong_penalty": SamplingParams(temperature=0.9, top_k=5, top_p=0.95, repetition_penalty=2.0),
}

# Trees over the small vocabulary (root = CONTEXT[-1] = 2). Children of a node are distinct.
TREES = {
    # wide and deep: root -> {0, 3, 5}; 0 -> {1, 4}; 1 -> {5}; 3 -> {4}; (0, 4) -> {0}
    "wide": TokenTree(token_ids=[2, 0, 3, 5, 1, 4, 4, 5, 0], parents=[-1, 0, 0, 0, 1, 1, 2, 4, 5]),
    "chain": TokenTree(token_ids=[2, 4, 4, 1], parents=[-1, 0, 1, 2]),  # repeats context tokens
}


# -- the reference (the synthetic target and plain sampling: support/distributions.py) ----------
def plain_sequence_prob(prefix: list[int], seq: tuple[int, ...], params: SamplingParams) -> float:
    prob = 1.0
    for i, tok in enumerate(seq):
        ctx = prefix + list(seq[:i])
        prob *= float(plain_probs(synthetic_logits(tuple(ctx)), ctx, params)[tok])
    return prob


def tree_logits(tree: TokenTree, context: list[int]) -> torch.Tensor:
    """Row u = the target's logits after context + path to u (what a verify forward returns)."""
    return torch.stack([synthetic_logits(tuple(context + path(tree, u))) for u in range(len(tree))])


def path(tree: TokenTree, node: int) -> list[int]:
    return [tree.token_ids[i] for i in tree.path_to(node)]


def walk_distribution(tree, logits, context, params, *, row_of=None, prefix_of=None) -> dict[tuple, float]:
    """Exact distribution of one step's emitted tokens (accepted path + bonus/recovered token)
    under the point-mass rule: draw y from the node's processed target distribution; move to the
    child carrying y, else emit y and stop. ``row_of``/``prefix_of`` exist to model mistakes."""
    row_of = row_of or (lambda u: u)
    prefix_of = prefix_of or (lambda u: context + path(tree, u))
    out: dict[tuple, float] = {}

    def visit(node: int, prob: float) -> None:
        ids = torch.unique(torch.tensor(prefix_of(node)))
        probs = target_probs(logits[row_of(node)], ids, params).double()
        for y in range(V):
            p = prob * float(probs[y])
            if p == 0.0:
                continue
            child = tree.children[node].get(y)
            if child is None:
                key = tuple(path(tree, node)) + (y,)
                out[key] = out.get(key, 0.0) + p
            else:
                visit(child, p)

    visit(0, 1.0)
    return out


def first_tokens_distribution(step: dict[tuple, float], context, params, length: int) -> dict[tuple, float]:
    """P(first ``length`` output tokens) when one step emits ``step``'s outcomes and plain
    sampling continues after a shorter outcome (the next step starts from a fresh root)."""
    dist: dict[tuple, float] = {}
    for emitted, p in step.items():
        if len(emitted) >= length:
            dist[emitted[:length]] = dist.get(emitted[:length], 0.0) + p
            continue
        for rest in itertools.product(range(V), repeat=length - len(emitted)):
            seq = emitted + rest
            q = plain_sequence_prob(context + list(emitted), rest, params)
            dist[seq] = dist.get(seq, 0.0) + p * q
    return dist


# -- 0. logits processing equals transformers' ---------------------------------------------
@pytest.mark.parametrize("name", sorted(PARAMS))
def test_process_row_matches_transformers_processors(name):
    params = PARAMS[name]
    gen = torch.Generator().manual_seed(3)
    for _ in range(50):
        vocab = int(torch.randint(2, 40, (1,), generator=gen))
        logits = 3 * torch.randn(vocab, generator=gen)
        prefix = torch.randint(0, vocab, (int(torch.randint(1, 12, (1,), generator=gen)),), generator=gen).tolist()
        got = process_row(logits, torch.unique(torch.tensor(prefix)), params).softmax(-1).double()
        want = hf_processors(params)(torch.tensor([prefix]), logits[None].clone())[0].softmax(-1).double()
        assert torch.allclose(got, want, atol=1e-7), f"{name}: {got} vs {want}"


def test_greedy_rows_only_apply_the_repetition_penalty():
    logits = torch.tensor([1.0, -2.0, 3.0, 2.5])
    greedy = SamplingParams(temperature=0.0, repetition_penalty=2.0, top_k=1, top_p=0.5)
    row = process_row(logits, torch.tensor([2, 1]), greedy)
    assert row.tolist() == [1.0, -4.0, 1.5, 2.5]  # 2 was seen: 3 / 2 = 1.5 < 2.5, the argmax moves to 3


# -- 1. closed form --------------------------------------------------------------------------
@pytest.mark.parametrize("tree_name", sorted(TREES))
@pytest.mark.parametrize("name", sorted(PARAMS))
def test_closed_form_equals_plain_sampling(name, tree_name):
    params, tree = PARAMS[name], TREES[tree_name]
    logits = tree_logits(tree, CONTEXT)
    step = walk_distribution(tree, logits, CONTEXT, params)
    assert math.fsum(step.values()) == pytest.approx(1.0, abs=CLOSED_FORM_TOL)
    for length in (2, 3):
        dist = first_tokens_distribution(step, CONTEXT, params, length)
        assert math.fsum(dist.values()) == pytest.approx(1.0, abs=CLOSED_FORM_TOL)
        for seq in itertools.product(range(V), repeat=length):
            want = plain_sequence_prob(CONTEXT, seq, params)
            got = dist.get(seq, 0.0)
            assert abs(got - want) <= CLOSED_FORM_TOL, f"{name}/{tree_name} {seq}: tree {got:.9f} vs plain {want:.9f}"


def tv_to_plain(step, params, length=2) -> float:
    dist = first_tokens_distribution(step, CONTEXT, params, length)
    return 0.5 * sum(abs(dist.get(s, 0.0) - plain_sequence_prob(CONTEXT, s, params))
                     for s in itertools.product(range(V), repeat=length))


def test_closed_form_has_power():
    """The check above does catch the usual mistakes: a row off by one (the parent's row used at
    a child) and a repetition penalty applied with the root's prefix at every node."""
    tree = TREES["wide"]
    logits = tree_logits(tree, CONTEXT)
    params = PARAMS["reppen"]
    off_by_one = walk_distribution(tree, logits, CONTEXT, params, row_of=lambda u: max(0, tree.parents[u]))
    root_prefix = walk_distribution(tree, logits, CONTEXT, params, prefix_of=lambda u: CONTEXT)
    assert tv_to_plain(off_by_one, params) > 0.01  # observed 0.42
    assert tv_to_plain(root_prefix, params) > 0.01  # observed 0.02, against a tolerance of 1e-6


# -- 2. Monte Carlo --------------------------------------------------------------------------
MC_DRAWS = 20_000


@pytest.mark.parametrize("name", ["plain", "all_strong_penalty"])
def test_monte_carlo_accept(name):
    """20k draws through the real ``accept`` (its own per-node prefixes, its own draws)."""
    params, tree = PARAMS[name], TREES["wide"]
    logits = tree_logits(tree, CONTEXT)
    exact = walk_distribution(tree, logits, CONTEXT, params)
    context_ids = torch.unique(torch.tensor(CONTEXT))
    generator = torch.Generator().manual_seed(2024)
    counts = Counter()
    for _ in range(MC_DRAWS):
        result = accept(tree, logits, params, context_ids=context_ids, generator=generator)
        last = result.accepted[-1] if result.accepted else 0
        assert result.accepted == tree.path_to(last)
        assert result.bonus == (not tree.children[last])
        counts[tuple(tree.token_ids[i] for i in result.accepted) + (result.next_token,)] += 1
    tv, bound = total_variation(counts, exact, MC_DRAWS), tv_bound(exact.values(), MC_DRAWS)
    assert tv <= bound, f"{name}: TV {tv:.4f} > bound {bound:.4f} (N={MC_DRAWS}, K={len(exact)})"
    # power: the bound is well below the error of a row off by one (bound ~0.03, error > 0.5) ...
    off_by_one = walk_distribution(tree, logits, CONTEXT, params, row_of=lambda u: max(0, tree.parents[u]))
    assert tv_between(off_by_one, exact) > 2 * bound
    if params.uses_prefix:  # ... and of a penalty applied with the root's prefix at every node (~0.12)
        root_prefix = walk_distribution(tree, logits, CONTEXT, params, prefix_of=lambda u: CONTEXT)
        assert tv_between(root_prefix, exact) > 2 * bound


class FixedTreeProposer:
    """At the prompt only: the two likeliest first tokens, each with its two likeliest next tokens
    (from the target itself, so the walk does go down the tree). Never looks at random draws."""

    name = "fixed"

    def __init__(self, prompt, children):
        self.prompt, self.children = list(prompt), children  # {first token: [second tokens]}
        self.started = set()

    def start(self, rid, prompt_ids):
        self.started.add(rid)

    def observe(self, rid, new_ids):
        assert rid in self.started

    def stop(self, rid):
        self.started.remove(rid)

    def propose(self, rid, context, budget):
        if list(context) != self.prompt:
            return []
        drafts = []
        for first, seconds in self.children.items():
            tokens = (first, *seconds)
            drafts.append(Draft(tokens, (-1,) + (0,) * len(seconds), (0.9,) * len(tokens), self.name))
        return drafts


E2E_SEEDS = 2000
E2E_FAILURE_PROB = 1e-4  # this bound's failure probability (N is smaller than in the accept test)
E2E_PARAMS = dict(temperature=0.8, top_k=3, repetition_penalty=1.3)  # top-k: few outcomes, a tight bound


def test_monte_carlo_engine_first_two_tokens():
    """P(first two generated tokens) over many seeds of Engine.generate vs the model's own
    probabilities p(t1 | prompt) p(t2 | prompt, t1), with a tree that covers the likely tokens.
    The bound has failure probability 1e-4 (tv_bound; at most 3 x 3 + 1 outcomes, so it is at most
    about 0.5 sqrt(10 / N) + sqrt(ln(1e4) / 2N) = 0.083 for N = 2000)."""
    model = cached_tiny("llama")
    prompt = [11, 23, 35, 47, 59, 71]
    params = SamplingParams(**E2E_PARAMS)
    with torch.inference_mode():
        first_logits = model(input_ids=torch.tensor([prompt])).logits[0, -1].float()
        batch = torch.tensor([prompt + [t] for t in range(first_logits.numel())])
        second_logits = model(input_ids=batch).logits[:, -1].float()
    p1 = plain_probs(first_logits, prompt, params)

    def two_token_dist(second_row) -> dict[tuple, float]:
        dist = {}
        for t1 in p1.nonzero().flatten().tolist():
            if t1 == EOS:
                dist[(t1,)] = float(p1[t1])
                continue
            p2 = plain_probs(second_row(t1), prompt + [t1], params)
            for t2 in p2.nonzero().flatten().tolist():
                dist[(t1, t2)] = float(p1[t1] * p2[t2])
        return dist

    exact = two_token_dist(lambda t1: second_logits[t1])
    likely = p1.topk(2).indices.tolist()
    children = {t: plain_probs(second_logits[t], prompt + [t], params).topk(2).indices.tolist() for t in likely}
    engine = Engine(model, FakeTokenizer(), EngineConfig(proposers=(), budget="fixed"),
                    proposers=[FixedTreeProposer(prompt, children)])
    counts, two_in_one_step = Counter(), 0
    for seed in range(E2E_SEEDS):
        gen = engine.generate(prompt, max_new_tokens=2, seed=seed, **E2E_PARAMS)
        counts[tuple(gen.token_ids)] += 1
        two_in_one_step += gen.stats.steps == 1 and len(gen.token_ids) == 2
    tv = total_variation(counts, exact, E2E_SEEDS)
    bound = tv_bound(exact.values(), E2E_SEEDS, E2E_FAILURE_PROB)
    assert tv <= bound, f"TV {tv:.4f} > bound {bound:.4f} (N={E2E_SEEDS}, K={len(exact)})"
    assert two_in_one_step > E2E_SEEDS // 5, "the tree was hardly used: the test would not exercise it"
    # power: a row off by one (t2 drawn from the root's row) would be far outside the bound
    wrong = two_token_dist(lambda t1: first_logits)
    assert tv_between(wrong, exact) > 2 * bound


# -- 3. seeds --------------------------------------------------------------------------------
SAMPLING = dict(temperature=0.8, top_k=20, top_p=0.9)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_same_seed_same_output(family):
    prompt = [5, 9, 13, 17, 21] * 3
    engine = Engine(cached_tiny(family), FakeTokenizer())  # default config: n-gram, budget auto
    outputs = {}
    for seed in range(5):
        first = engine.generate(prompt, max_new_tokens=30, seed=seed, **SAMPLING).token_ids
        again = engine.generate(prompt, max_new_tokens=30, seed=seed, **SAMPLING).token_ids
        other_engine = Engine(cached_tiny(family), FakeTokenizer()).generate(
            prompt, max_new_tokens=30, seed=seed, **SAMPLING).token_ids
        assert first == again == other_engine, f"seed {seed}"
        outputs[seed] = tuple(first)
    assert len(set(outputs.values())) > 1, "different seeds never gave different outputs"


@pytest.mark.parametrize("family", ["llama", "mistral", "gpt_neox"])
def test_seeded_output_does_not_depend_on_the_drafts(family):
    """A stronger check that needs no statistics: the walk makes exactly one draw per emitted
    token, each from the target's distribution at that token's true prefix, so with one seed the
    output is the same whatever the tree (no drafts, n-gram, oracle, random trees). (Float noise
    between a tree batch and a single row could in principle flip a draw at a near-tie; it does
    not for these fixed seeds.)"""
    refs = cached_references(family)[1::4]
    truths = {tuple(p): p + r for p, _, r in refs}
    engines = {}
    for setting in ("none", "ngram", "oracle", "random"):
        proposers = {"none": [], "ngram": build_proposers(EngineConfig(), tokenizer=FakeTokenizer()),
                     "oracle": [OracleProposer(truths)], "random": [RandomTreeProposer(truths, seed=3)]}[setting]
        engines[setting] = Engine(cached_tiny(family), FakeTokenizer(), EngineConfig(proposers=(), budget="fixed"),
                                  proposers=proposers)
    for i, (prompt, n, _) in enumerate(refs):
        outs = {s: e.generate(prompt, max_new_tokens=n, seed=100 + i, temperature=0.9, top_p=0.95).token_ids
                for s, e in engines.items()}
        assert all(o == outs["none"] for o in outs.values()), f"prompt #{i}: {outs}"


def test_greedy_is_unaffected_by_seed_and_top_k_1_is_greedy():
    refs = cached_references("qwen2")[:6]
    engine = Engine(cached_tiny("qwen2"), FakeTokenizer())
    for prompt, n, ref in refs:
        assert engine.generate(prompt, max_new_tokens=n, seed=1).token_ids == ref
        assert engine.generate(prompt, max_new_tokens=n, temperature=1.0, top_k=1, seed=2).token_ids == ref


@pytest.mark.parametrize("params, want", [
    (SamplingParams(temperature=1e-300), "argmax"),  # float32 holds 1e-300 as 0
    (SamplingParams(temperature=1e-40), "argmax"),
    (SamplingParams(temperature=1e300), "uniform"),  # float32 holds 1e300 as inf
    (SamplingParams(temperature=1.0, repetition_penalty=1e-300), "seen"),  # seen positive logits -> inf
])
def test_extreme_values_give_the_limit_distribution_not_nan(params, want):
    logits = torch.tensor([1.0, 3.0, -2.0, 0.5])
    prefix = torch.tensor([0, 3])  # tokens 0 and 3 seen (repetition penalty)
    probs = target_probs(logits, prefix, params)
    assert torch.isfinite(probs).all() and abs(float(probs.sum()) - 1) < 1e-6
    expected = {"argmax": [0, 1, 0, 0], "uniform": [0.25] * 4, "seen": [0.5, 0, 0, 0.5]}[want]
    assert probs.tolist() == pytest.approx(expected, abs=1e-6)


def test_monte_carlo_first_two_tokens_in_batches():
    """The Monte Carlo check above through ``Engine.generate_batch``: 8 seeds of the prompt per
    batch, beside rows of another prompt of another length, the same tree source and bound."""
    model = cached_tiny("llama")
    prompt, other = [11, 23, 35, 47, 59, 71], [5, 6, 7, 5, 6, 7, 5, 6, 7, 8, 9]
    params = SamplingParams(**E2E_PARAMS)
    with torch.inference_mode():
        first_logits = model(input_ids=torch.tensor([prompt])).logits[0, -1].float()
        batch = torch.tensor([prompt + [t] for t in range(first_logits.numel())])
        second_logits = model(input_ids=batch).logits[:, -1].float()
    p1 = plain_probs(first_logits, prompt, params)
    exact = {}
    for t1 in p1.nonzero().flatten().tolist():
        if t1 == EOS:
            exact[(t1,)] = float(p1[t1])
            continue
        p2 = plain_probs(second_logits[t1], prompt + [t1], params)
        for t2 in p2.nonzero().flatten().tolist():
            exact[(t1, t2)] = float(p1[t1] * p2[t2])
    likely = p1.topk(2).indices.tolist()
    children = {t: plain_probs(second_logits[t], prompt + [t], params).topk(2).indices.tolist() for t in likely}
    engine = Engine(model, FakeTokenizer(), EngineConfig(proposers=(), budget="fixed"),
                    proposers=[FixedTreeProposer(prompt, children)])
    per_batch = 8
    counts, two_in_one_step = Counter(), 0
    for start in range(0, E2E_SEEDS, per_batch):
        seeds = list(range(start, start + per_batch))
        gens = engine.generate_batch([prompt] * per_batch + [other, other], max_new_tokens=2, max_batch=10,
                                     seed=seeds + [start, start + 1], **E2E_PARAMS)
        for gen in gens[:per_batch]:
            counts[tuple(gen.token_ids)] += 1
            two_in_one_step += gen.stats.steps == 1 and len(gen.token_ids) == 2
    tv = total_variation(counts, exact, E2E_SEEDS)
    bound = tv_bound(exact.values(), E2E_SEEDS, E2E_FAILURE_PROB)
    assert tv <= bound, f"TV {tv:.4f} > bound {bound:.4f} (N={E2E_SEEDS}, K={len(exact)})"
    assert two_in_one_step > E2E_SEEDS // 5, "the tree was hardly used: the test would not exercise it"


# -- 4. the greedy walk's fast forms --------------------------------------------------------------
@pytest.mark.parametrize("seed", range(100))
def test_greedy_accept_equals_the_reference(seed):
    rng = random.Random(seed)
    # 1031, 3072, 3100: the compiled argmax's blocks of 1024, whole and with a tail
    vocab = rng.choice((2, 4, 50, 1031, 3072, 3100))
    tree = random_trie(rng, rng.randint(0, 30), vocab)
    if rng.random() < 0.5:  # integer logits: many tied maxima (the first one wins in both)
        logits = torch.randint(0, 3, (len(tree), vocab)).float()
    else:
        logits = torch.randn(len(tree), vocab, dtype=rng.choice((torch.float32, torch.float64)))
    if rng.random() < 0.2:
        logits[rng.randrange(len(tree)), rng.randrange(vocab)] = float("nan")
    for _ in range(rng.randint(0, 3)):  # a maximum tied at two places, maybe blocks apart; inf, -inf rows
        row, (a, b) = rng.randrange(len(tree)), sorted(rng.sample(range(vocab), 2))
        logits[row, a] = logits[row, b] = rng.choice((10.0, float("inf")))
    if rng.random() < 0.1:
        logits[rng.randrange(len(tree))] = float("-inf")
    # walk along the tree: each visited row's argmax is a child's token most of the time
    node = 0
    while tree.children[node] and rng.random() < 0.8:
        token, child = rng.choice(sorted(tree.children[node].items()))
        logits[node, token] = logits[node].nan_to_num(0.0).max() + 1.0
        node = child
    params = SamplingParams()
    got, want = accept(tree, logits, params), reference_accept(tree, logits, params)
    assert (got.accepted, got.next_token, got.bonus) == (want.accepted, want.next_token, want.bonus)
    view = torch.randn(len(tree), 2 * vocab)[:, ::2]  # a strided view takes the same path
    got, want = accept(tree, view, params), reference_accept(tree, view, params)
    assert (got.accepted, got.next_token) == (want.accepted, want.next_token)


@needs_core
@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("top_k", [0, 4])
@pytest.mark.parametrize("picked", [False, True])
def test_walk_over_partial_rows_equals_the_walk_over_every_row(seed, top_k, picked):
    """``picked``: the rows' best ids come with them (``PartialLogits.tops``, as the skinny
    product makes them) and rows computed on demand get theirs."""
    rng = np.random.default_rng(seed)
    n, d, vocab = 40, 16, 64
    tree = random_scored_tree(rng, n)
    hidden = torch.from_numpy(rng.standard_normal((n, d)).astype(np.float32))
    weight = torch.from_numpy(rng.standard_normal((vocab, d)).astype(np.float32))
    weight[:3] *= 4.0  # tokens 0-2 usually win: the walk goes deep, past the rows computed up front
    dense = hidden @ weight.T
    project = lambda h: (h @ weight.T, 0.0)  # noqa: E731
    rows = [0] if seed % 2 else head_rows(range(n), tree.expected, min_rows=2)
    tops = np.asarray(reference_top_tokens(dense, rows, max(top_k, 1)), dtype=np.int32) if picked else None
    partial = PartialLogits(tree, rows, dense[rows], hidden, project, tops=tops)
    got = accept(tree, partial, SamplingParams(), top_k=top_k)
    want = reference_accept(tree, dense, SamplingParams())
    assert (got.accepted, got.next_token, got.bonus) == (want.accepted, want.next_token, want.bonus)
    if top_k:
        assert got.tops == reference_top_tokens(dense, [0, *got.accepted], top_k)
    # the path's tokens, across walks resumed after a miss too
    assert got.tokens == [tree.token_ids[u] for u in [0, *got.accepted]]
    computed = partial.row_of >= 0
    assert computed[[0, *got.accepted]].all()  # every visited row was computed, each once
    assert partial.computed == int(computed.sum())
    if rows == [0] and got.accepted:
        assert partial.misses >= 1 and partial.computed < n
    if picked:  # the rows computed on demand got their picks too
        assert partial.tops.shape == (partial.computed, max(top_k, 1))
        assert partial.tops.tolist() == reference_top_tokens(partial.logits, range(partial.computed), max(top_k, 1))
    # every other path sees every row, in node order
    assert torch.equal(partial.dense(), dense)


@needs_core
def test_the_walk_reads_the_picks_not_the_rows():
    """With ``tops`` the walk follows the picks made as the rows were written: given rows of
    zeros (whose argmax is token 0) and picks naming token 1 at the root, it takes the root's
    child with token 1, and hands recycling the picks."""
    tree = TokenTree(token_ids=[9, 0, 1], parents=[-1, 0, 0], expected=[1.0, 0.5, 0.5])
    zeros = torch.zeros(3, 5)
    tops = np.array([[1, 2], [3, 4], [4, 0]], dtype=np.int32)
    got = accept(tree, PartialLogits(tree, [0, 1, 2], zeros, torch.zeros(3, 2), None, tops=tops), SamplingParams(),
                 top_k=2)
    assert (got.accepted, got.next_token, got.tops) == ([2], 4, [[1, 2], [4, 0]])
    assert tree.greedy_walk(None, 2, None, 0, tops)[:4] == ([2], 4, True, [[1, 2], [4, 0]])  # no rows needed
    with pytest.raises(ValueError, match="logits or choices"):
        tree.greedy_walk(None, 2)


@needs_core
def test_sampling_on_partial_logits_takes_every_row():
    rng = np.random.default_rng(0)
    tree = random_scored_tree(rng, 12)
    hidden = torch.from_numpy(rng.standard_normal((12, 8)).astype(np.float32))
    weight = torch.from_numpy(rng.standard_normal((20, 8)).astype(np.float32))
    dense = hidden @ weight.T
    params = SamplingParams(temperature=0.8)
    got = accept(tree, PartialLogits(tree, [0], dense[[0]], hidden, lambda h: (h @ weight.T, 0.0)), params,
                 generator=torch.Generator().manual_seed(3))
    want = accept(tree, dense, params, generator=torch.Generator().manual_seed(3))
    assert (got.accepted, got.next_token) == (want.accepted, want.next_token)


def test_head_rows_keep_the_likely_nodes_and_a_floor():
    expected = [1.0, 0.9, 0.05, 0.3, 0.01, 0.2]
    assert head_rows(range(6), expected, min_rows=2) == [0, 1, 3, 5]
    assert head_rows(range(6), expected, min_rows=5) == [0, 1, 2, 3, 5]
    assert head_rows(range(3), expected, min_rows=8) == [0, 1, 2]
    assert head_rows([3, 4], expected, base=0.3, min_rows=1, threshold=0.1) == [3]  # 0.01 < 0.1 x 0.3
