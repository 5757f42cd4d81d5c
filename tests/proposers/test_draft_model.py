"""The draft model: its KV cache stays equal to a fresh forward, greedy output stays identical to
transformers (tiny random pairs and the real stories260K pair), sampling with draft-model
children mixed with lookup children is exact (closed form over every draw, Monte Carlo through
the real ``accept``, end to end over seeds), and the mixture runs it only where lookups are weak."""
from __future__ import annotations

import itertools
import math
import os
from collections import Counter

import pytest
import torch

from conftest import cached_references, cached_tiny
from distributions import plain_probs, synthetic_logits, total_variation, tv_between, tv_bound
from helpers import FakeTokenizer, hf_greedy, make_prompts
from lookupdec import Engine, EngineConfig
from lookupdec.config import DraftConfig
from lookupdec.model import ModelLoadError
from lookupdec.proposers.draft_model import DraftModelProposer
from lookupdec.sampling import SamplingParams, accept, node_distribution, rejection_distribution, residual
from lookupdec.tree import Draft, TokenTree
from repo_paths import STORIES
from tiny_models import FAMILIES, tiny_model

FINETUNED = os.path.join(os.path.dirname(STORIES), "stories260K-finetuned")


@pytest.fixture(scope="module")
def pair():
    """A tiny llama target and a smaller-seeded draft of the same vocabulary (random weights)."""
    return tiny_model("llama", seed=0, tie_word_embeddings=False), tiny_model("llama", seed=1, tie_word_embeddings=False)


# -- the draft model's KV cache -------------------------------------------------------------------
def test_cache_equals_a_fresh_forward_after_accepts_and_rejections(pair):
    _, draft_model = pair
    proposer = DraftModelProposer(draft_model, DraftConfig(max_tokens=4, branch=2))
    context = [5, 17, 29, 41, 53]
    proposer.start("r", context)
    for step in range(6):
        draft = proposer.propose("r", context, 16)[0]
        chain, _ = draft.best_chain()
        # commit part of the chain (accepted) and then a token of our own (a rejection)
        new = chain[: step % 3] + [(7 * step + 3) % 96]
        proposer.observe("r", new)
        context = context + new
    proposer.propose("r", context, 16)
    cached = proposer.cached_tokens("r")
    assert cached[: len(context)] == context  # the committed tokens, then the last chain's drafts
    cache = proposer.cache_of("r")
    with torch.inference_mode():
        fresh = draft_model(input_ids=torch.tensor([cached]), use_cache=True).past_key_values
    for layer, ref in zip(cache.layers, fresh.layers):
        assert layer.keys.shape[2] == len(cached)
        torch.testing.assert_close(layer.keys, ref.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(layer.values, ref.values, atol=1e-5, rtol=1e-5)


def test_no_recomputation_of_the_context(pair):
    """Each propose feeds only what is new: one forward for the catch-up, one per draft level."""
    _, draft_model = pair
    proposer = DraftModelProposer(draft_model, DraftConfig(max_tokens=3, branch=1))
    context = list(range(3, 40))
    proposer.start("r", context)
    proposer.propose("r", context, 8)
    assert proposer.forwards == 3
    chain, _ = proposer.propose("r", context, 8)[0].best_chain()  # same context: re-feeds the last token only
    proposer.observe("r", chain[:2] + [90])
    before = proposer.forwards
    proposer.propose("r", context + chain[:2] + [90], 8)
    assert proposer.forwards - before == 3
    assert len(proposer.cached_tokens("r")) == len(context) + 3 + 2  # context + 3 new + 2 draft levels fed


# -- greedy identity ------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["always", "auto"])
def test_greedy_identity_with_a_draft_model(pair, mode):
    target, draft_model = pair
    config = EngineConfig(draft=DraftConfig(mode=mode, max_tokens=4, branch=2))
    engine = Engine(target, FakeTokenizer(), config, draft_model=draft_model)
    used = 0
    for prompt, n in make_prompts(seed=77, count=12):
        gen = engine.generate(prompt, max_new_tokens=n)
        assert gen.token_ids == hf_greedy(target, prompt, n), (mode, prompt)
        used += gen.stats.draft_model_steps
    assert used > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_identity_with_a_draft_model_every_family(family):
    """Target and draft of the same family (different random weights), the draft run every step."""
    target = cached_tiny(family)
    draft_model = tiny_model(family, seed=5, tie_word_embeddings=False)
    engine = Engine(target, FakeTokenizer(), EngineConfig(draft=DraftConfig(mode="always", max_tokens=3)),
                    draft_model=draft_model)
    for prompt, n, ref in cached_references(family)[:8]:
        gen = engine.generate(prompt, max_new_tokens=n)
        assert gen.token_ids == ref, (family, prompt)
        assert gen.stats.draft_model_steps == gen.stats.steps


def test_greedy_identity_when_the_draft_is_the_target(pair):
    """A draft model equal to the target drafts the true continuation: every draft accepted."""
    target, _ = pair
    engine = Engine(target, FakeTokenizer(), EngineConfig(proposers=(), budget="fixed",
                                                          draft=DraftConfig(mode="always", max_tokens=4, branch=1)),
                    draft_model=target)
    prompt = [9, 8, 7, 6, 5]
    gen = engine.generate(prompt, max_new_tokens=40)
    assert gen.token_ids == hf_greedy(target, prompt, 40)
    assert gen.stats.mean_accepted == pytest.approx(5.0, abs=0.5)  # 4 drafts + 1 bonus per step


@pytest.mark.skipif(not os.path.isdir(FINETUNED), reason="stories260K-finetuned absent")
def test_stories_pair_greedy_identity():
    engine = Engine.from_pretrained(STORIES, draft_model=FINETUNED,
                                    config=EngineConfig(draft=DraftConfig(mode="always")))
    model, tokenizer = engine.target.model, engine.tokenizer
    total = {}
    for prompt in ["Once upon a time", "Lily wanted to play with her ball", "The dog ran to the park and"]:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        want = model.generate(ids, do_sample=False, max_new_tokens=48)[0, ids.shape[1]:].tolist()
        gen = engine.generate(prompt, max_new_tokens=48)
        assert gen.token_ids == want, prompt
        for k, v in gen.stats.accepted_by_source.items():
            total[k] = total.get(k, 0) + v
    assert total.get("draft", 0) > 20, total  # the two models agree on ~74% of greedy tokens


def test_draft_model_with_another_tokenizer_is_refused(tmp_path):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    if not os.path.isdir(STORIES):
        pytest.skip("stories260K absent")
    other = tmp_path / "other"
    tiny_model("llama").save_pretrained(other)
    vocab = {f"w{i}": i for i in range(96)}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="w0")),
                                  eos_token="w2", bos_token="w1")
    tok.save_pretrained(other)
    with pytest.raises(ModelLoadError, match=r"draft model .*other has another tokenizer .*target .*stories260K"):
        Engine.from_pretrained(STORIES, draft_model=str(other))


# -- sampling exactness with draft-model children -------------------------------------------------
V = 5


def _dist(values):
    t = torch.tensor(values, dtype=torch.float64)
    return t / t.sum()


NODE_CASES = {
    # p, lookup tokens, q, number of draws
    "no_lookup_two_draws": (_dist([.4, .3, .2, .1, 0]), [], _dist([.1, .1, .2, .3, .3]), 2),
    "lookup_and_three_draws": (_dist([.35, .25, .2, .15, .05]), [1], _dist([.3, .3, .2, .1, .1]), 3),
    "q_misses_p_support": (_dist([.5, .5, 0, 0, 0]), [], _dist([0, .2, .4, .4, 0]), 2),
    "p_all_on_lookups": (_dist([.6, .4, 0, 0, 0]), [0, 1], _dist([.2] * 5), 2),
    "q_equals_residual": (_dist([.4, .3, .2, .1, 0]), [0], _dist([0, .5, 1 / 3, 1 / 6, 0]), 1),
    "top_k_zeros": (_dist([0, .7, 0, .3, 0]), [3], _dist([.25, .25, .25, .25, 0]), 4),
}


@pytest.mark.parametrize("case", sorted(NODE_CASES))
def test_node_distribution_averages_to_p_in_closed_form(case):
    """Over every tuple of draws (weighted by q), the emitted token's law is exactly p."""
    p, lookup, q, k = NODE_CASES[case]
    support = q.nonzero().flatten().tolist()
    total = torch.zeros(V, dtype=torch.float64)
    for drawn in itertools.product(support, repeat=k):
        weight = math.prod(float(q[x]) for x in drawn)
        total += weight * node_distribution(p, lookup, q, drawn)
    torch.testing.assert_close(total, p, atol=1e-12, rtol=0)


def test_closed_form_has_power():
    """A wrong residual (no renormalisation / accepting with r/q uncapped) would be caught."""
    p, lookup, q, k = NODE_CASES["lookup_and_three_draws"]
    def wrong(r, q_, drawn):  # forgets the residual update: keeps testing against r
        out, stay = torch.zeros_like(r), 1.0
        for x in drawn:
            a = min(1.0, float(r[x] / q_[x]))
            out[x] += stay * a
            stay *= 1 - a
        return out + stay * r
    total = torch.zeros(V, dtype=torch.float64)
    for drawn in itertools.product(range(V), repeat=k):
        rest = p.clone()
        rest[lookup] = 0
        mass = float(rest.sum())
        d = torch.zeros(V, dtype=torch.float64)
        d[lookup] = p[lookup]
        total += math.prod(float(q[x]) for x in drawn) * (d + mass * wrong(rest / mass, q, drawn))
    assert float((total - p).abs().sum()) > 1e-3


def test_residual_and_rejection_distribution_basics():
    r, q = _dist([.5, .3, .2, 0, 0]), _dist([.2, .6, .2, 0, 0])
    torch.testing.assert_close(residual(r, q), _dist([1, 0, 0, 0, 0]))
    assert float(rejection_distribution(r, q, [0]).sum()) == pytest.approx(1.0)
    assert rejection_distribution(r, r, [2])[2] == pytest.approx(1.0)  # q == r: always accepted


CONTEXT = [1, 4, 4, 2]
MC_PARAMS = SamplingParams(temperature=1.0, top_k=4)
MC_DRAWS = 20_000


def q_of(prefix) -> torch.Tensor:
    """A fixed 'draft model' on V tokens, near but not equal to the target."""
    return plain_probs(synthetic_logits(tuple(prefix)) * 0.6 + 0.3, list(prefix), SamplingParams(temperature=1.0)).float()


def _argmax_after(prefix) -> int:
    return int(plain_probs(synthetic_logits(tuple(prefix)), list(prefix), MC_PARAMS).argmax())


LOOKUP_CHAIN = (_argmax_after(CONTEXT), _argmax_after(CONTEXT + [_argmax_after(CONTEXT)]))


def build_mixed_tree(gen: torch.Generator) -> TokenTree:
    """Root: a lookup chain (the target's likeliest two tokens) and two draws from q at the root; the first
    draw's node has two draws of its own (and where a draw repeats a lookup token, the node is
    shared, as the trie makes it)."""
    root_q = q_of(CONTEXT)
    drawn = torch.multinomial(root_q, 2, replacement=True, generator=gen).tolist()
    lookup = Draft(LOOKUP_CHAIN, (-1, 0), (0.9, 0.8), "lookup", 2)
    x1 = drawn[0]
    q2 = q_of(CONTEXT + [x1])
    drawn2 = torch.multinomial(q2, 2, replacement=True, generator=gen).tolist()
    tokens, parents, samples = [], [], {-1: (root_q, tuple(drawn))}
    for tok in dict.fromkeys(drawn):
        tokens.append(tok)
        parents.append(-1)
    first = tokens.index(x1)
    for tok in dict.fromkeys(drawn2):
        tokens.append(tok)
        parents.append(first)
    samples[first] = (q2, tuple(drawn2))
    sampled = Draft(tuple(tokens), tuple(parents), tuple([0.5] * len(tokens)), "draft", 0, samples)
    return TokenTree.from_drafts(CONTEXT[-1], [lookup, sampled], max_nodes=64, max_depth=8)


def two_token_exact() -> dict:
    p1 = plain_probs(synthetic_logits(tuple(CONTEXT)), CONTEXT, MC_PARAMS)
    out = {}
    for t1 in p1.nonzero().flatten().tolist():
        p2 = plain_probs(synthetic_logits(tuple(CONTEXT + [t1])), CONTEXT + [t1], MC_PARAMS)
        for t2 in p2.nonzero().flatten().tolist():
            out[(t1, t2)] = float(p1[t1] * p2[t2])
    return out


def test_monte_carlo_mixed_lookup_and_draft_children():
    """20k steps through the real ``accept`` on freshly drawn mixed trees: the first two emitted
    tokens (the second from plain sampling when the step stops after one) follow the target."""
    drafts_gen, target_gen = torch.Generator().manual_seed(5), torch.Generator().manual_seed(6)
    counts, used = Counter(), Counter()
    for _ in range(MC_DRAWS):
        tree = build_mixed_tree(drafts_gen)
        logits = torch.stack([synthetic_logits(tuple(CONTEXT + [tree.token_ids[i] for i in tree.path_to(u)]))
                              for u in range(len(tree))])
        result = accept(tree, logits, MC_PARAMS, generator=target_gen)
        out = [tree.token_ids[i] for i in result.accepted] + [result.next_token]
        if len(out) == 1:
            p2 = plain_probs(synthetic_logits(tuple(CONTEXT + out)), CONTEXT + out, MC_PARAMS)
            out.append(int(torch.multinomial(p2.float(), 1, generator=target_gen)))
        counts[tuple(out[:2])] += 1
        if result.accepted:
            used[tree.point_mass[result.accepted[0]]] += 1
    exact = two_token_exact()
    tv, bound = total_variation(counts, exact, MC_DRAWS), tv_bound(exact.values(), MC_DRAWS)
    assert tv <= bound, f"TV {tv:.4f} > bound {bound:.4f} (N={MC_DRAWS}, K={len(exact)})"
    assert used[True] > MC_DRAWS // 10 and used[False] > MC_DRAWS // 10  # both kinds of children were taken
    # power: treating the root's draws as if p were q (accept all draws) would be far off
    wrong = {}
    p1 = plain_probs(synthetic_logits(tuple(CONTEXT)), CONTEXT, MC_PARAMS)
    q1 = q_of(CONTEXT).double()
    mixed = 0.5 * p1 + 0.5 * q1
    for (t1, t2), pr in exact.items():
        wrong[(t1, t2)] = pr / float(p1[t1]) * float(mixed[t1]) if p1[t1] > 0 else 0.0
    assert tv_between(wrong, exact) > 2 * bound


def test_sampling_with_a_draft_model_is_seed_deterministic_and_matches_the_target(pair):
    """End to end over seeds: P(first token) with a draft model on equals the target's."""
    target, draft_model = pair
    params = dict(temperature=1.0, top_k=3)
    engine = Engine(target, FakeTokenizer(), EngineConfig(proposers=(), budget="fixed",
                                                          draft=DraftConfig(mode="always", max_tokens=3, branch=2)),
                    draft_model=draft_model)
    prompt = [11, 23, 35, 47]
    a = engine.generate(prompt, max_new_tokens=12, seed=3, **params).token_ids
    assert engine.generate(prompt, max_new_tokens=12, seed=3, **params).token_ids == a
    with torch.inference_mode():
        first = target(input_ids=torch.tensor([prompt])).logits[0, -1].float()
    p1 = plain_probs(first, prompt, SamplingParams(**params))
    exact = {(t,): float(p1[t]) for t in p1.nonzero().flatten().tolist()}
    n = 1500
    counts = Counter()
    for seed in range(n):
        counts[tuple(engine.generate(prompt, max_new_tokens=1, seed=seed, **params).token_ids)] += 1
    tv, bound = total_variation(counts, exact, n), tv_bound(exact.values(), n, 1e-4)
    assert tv <= bound, f"TV {tv:.4f} > bound {bound:.4f}"
