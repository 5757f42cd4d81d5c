"""Shared test helpers: skip markers, a fake tokenizer for tiny random models, plain-transformers
reference decoding, models whose attention ignores or rejects custom masks, a proposer spy,
scripted proposers whose right answer is obvious, and the CLI run in-process.

The scripted proposers know the true greedy continuation (``truth`` = prompt + reference output,
computed beforehand by ``transformers`` ``generate``) and follow the ``Proposer`` protocol of
``lookupdec.proposers.base`` with its lifecycle checks, so a test also catches an engine that
calls them out of order or forgets to ``observe`` what it emitted.
"""
from __future__ import annotations

import math
import os
import random
from types import SimpleNamespace
from typing import Sequence

import pytest
import torch

from lookupdec.automaton import compiled_available
from lookupdec.proposers.base import RequestRegistry
from lookupdec.tree import Draft
from repo_paths import LLAMA_SP, STORIES
from tiny_models import VOCAB

EOS = 2  # eos_token_id of every tiny config
PROMPT_TOKENS = range(3, VOCAB)  # random prompt tokens: no pad (0), bos (1) or eos (2)

needs_core = pytest.mark.skipif(not compiled_available(), reason="compiled core not built (pip install -e .)")
needs_stories = pytest.mark.skipif(not os.path.isdir(STORIES), reason="../shared/models/stories260K is absent")
needs_llama_tokenizer = pytest.mark.skipif(not os.path.exists(LLAMA_SP), reason="../shared tokenizer absent")


class FakeTokenizer:
    """What the engine needs from a tokenizer for id prompts: eos id, decode, __call__."""

    eos_token_id = EOS

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        ids = [int(t) for t in ids]
        if skip_special_tokens:
            ids = [t for t in ids if t != EOS]
        return "".join(f" {t}" for t in ids)

    def __call__(self, text: str):
        return SimpleNamespace(input_ids=[int(t) for t in text.split()])


@torch.inference_mode()
def hf_greedy(model, prompt_ids: Sequence[int], max_new_tokens: int, **kwargs) -> list[int]:
    """The reference: plain ``transformers`` greedy decoding (stops at EOS, EOS included)."""
    ids = torch.tensor([list(prompt_ids)])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=max_new_tokens, pad_token_id=0, **kwargs)
    return out[0, ids.shape[1]:].tolist()


class MaskIgnoringModel(torch.nn.Module):
    """Wraps a model and drops any custom attention mask (as some attention kernels do)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.config = inner.config

    def get_output_embeddings(self):
        return self.inner.get_output_embeddings()

    def forward(self, attention_mask=None, **kwargs):
        return self.inner(**kwargs)


class TreeMaskRejectingModel(MaskIgnoringModel):
    """A causal LM whose attention rejects custom 4D masks (as some model types do)."""

    def forward(self, input_ids=None, attention_mask=None, **kwargs):
        if attention_mask is not None and (isinstance(attention_mask, dict) or attention_mask.dim() == 4):
            raise NotImplementedError("custom 4D attention masks are not supported")
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, **kwargs)


class SpyProposer:
    """Wraps a proposer (or, with ``drafts``, stands in for one that always returns those) and
    records what the engine did with it: requests started and stopped, ``max_nodes`` asked."""

    def __init__(self, inner=None, *, name: str | None = None, drafts: Sequence[Draft] = ()) -> None:
        self.inner, self.drafts = inner, list(drafts)
        self.name = name or inner.name
        self.started: list[str] = []
        self.stopped: list[str] = []
        self.asked: list[int] = []  # max_nodes of every propose call

    @property
    def calls(self) -> int:
        return len(self.asked)

    def start(self, request_id, prompt_ids):
        self.started.append(request_id)
        if self.inner is not None:
            self.inner.start(request_id, prompt_ids)

    def set_sampling(self, request_id, params, seed):  # the draft model's extra call
        pass

    def propose(self, request_id, context, max_nodes):
        self.asked.append(max_nodes)
        return self.inner.propose(request_id, context, max_nodes) if self.inner is not None else list(self.drafts)

    def observe(self, request_id, new_ids):
        if self.inner is not None:
            self.inner.observe(request_id, new_ids)

    def stop(self, request_id):
        self.stopped.append(request_id)
        if self.inner is not None:
            self.inner.stop(request_id)


def make_prompts(seed: int, count: int = 24) -> list[tuple[list[int], int]]:
    """``count`` (prompt ids, max_new_tokens) pairs: half random (lengths 1..60), half periodic
    (so that n-gram drafting triggers); max_new_tokens in 40..64. Every prompt + output is longer
    than mistral's sliding window of 24, so the window mask is exercised."""
    rng = random.Random(seed)
    lengths = [1, 2, 3, 5, 8, 13, 17, 21, 30, 40, 50, 60]
    prompts = []
    for i in range(count):
        if i % 2 == 0:
            length = lengths[(i // 2) % len(lengths)]
            prompt = [rng.choice(PROMPT_TOKENS) for _ in range(length)]
        else:
            period = rng.randint(2, 8)
            pattern = [rng.choice(PROMPT_TOKENS) for _ in range(period)]
            length = rng.randint(10, 60)
            prompt = (pattern * (length // period + 1))[:length]
            if i % 6 == 1:  # a broken repetition: drafts that are right for a while, then wrong
                prompt[rng.randrange(length)] = rng.choice(PROMPT_TOKENS)
        if i == 5:
            prompt[len(prompt) // 2] = EOS  # an EOS inside the prompt does not end anything
        prompts.append((prompt, 40 + (7 * i) % 25))
    return prompts


class _Scripted:
    """Lifecycle bookkeeping shared by the scripted proposers: per request, the truth and the
    number of tokens seen; ``propose`` checks the context is exactly what was observed."""

    name = "scripted"

    def __init__(self, truths: dict[tuple[int, ...], list[int]]) -> None:
        self.truths = truths  # prompt ids -> prompt + reference output
        self._requests = RequestRegistry(type(self).__name__)
        self.calls = 0
        self.active: set[str] = set()  # started and not yet stopped

    def start(self, request_id, prompt_ids) -> None:
        prompt = tuple(int(t) for t in prompt_ids)
        self._requests.add(request_id, SimpleNamespace(truth=self.truths.get(prompt), seen=list(prompt)))
        self.active.add(request_id)

    def observe(self, request_id, new_ids) -> None:
        self._requests.get(request_id).seen.extend(int(t) for t in new_ids)

    def stop(self, request_id) -> None:
        self._requests.pop(request_id)
        self.active.discard(request_id)

    def propose(self, request_id, context, max_nodes) -> list[Draft]:
        state = self._requests.get(request_id)
        assert list(context) == state.seen, "engine context differs from what it let the proposer observe"
        self.calls += 1
        truth = state.truth
        on_track = truth is not None and list(context) == truth[: len(context)]
        return self._drafts(list(context), truth if on_track else None, max_nodes)

    def _drafts(self, context, truth, max_nodes) -> list[Draft]:
        raise NotImplementedError


class OracleProposer(_Scripted):
    """Drafts the true continuation (every draft token must be accepted).

    With ``distractors`` > 0, wrong chains come first in the draft list (so they take the low
    node indices and cache slots) and the true chain after them, with a higher score so that
    pruning keeps it whole: accepting it forces the KV commit to gather non-contiguous slots.
    With ``overrun`` > 0 the drafts run that many tokens past the end of the reference (past EOS
    or max_new_tokens): the engine must cut its output there.
    """

    name = "oracle"

    def __init__(self, truths, *, distractors: int = 0, distractor_len: int = 3, overrun: int = 0) -> None:
        super().__init__(truths)
        self.distractors = distractors
        self.distractor_len = distractor_len
        self.overrun = overrun

    def _drafts(self, context, truth, max_nodes):
        if truth is None:
            return []
        truth = truth + [3 + (5 * j) % (VOCAB - 3) for j in range(self.overrun)]
        true_chain = truth[len(context) : len(context) + max_nodes]
        drafts = []
        for b in range(self.distractors if true_chain else 0):
            wrong = (true_chain[0] + 1 + b) % VOCAB
            chain = [wrong] + true_chain[1 : self.distractor_len]
            drafts.append(Draft.chain(chain, [0.5] * len(chain), "distractor"))
        if true_chain:
            drafts.append(Draft.chain(true_chain, [1.0] * len(true_chain), self.name))
        return drafts


def oracle_expectation(n_out: int, k: int) -> tuple[int, int]:
    """(steps, accepted draft tokens) when an oracle's drafts of up to ``k`` tokens per step
    (k = min(max_nodes, max_depth)) are all accepted: every step emits k accepted + 1 bonus
    token, except the last, which emits the rest ``r`` (its bonus is cut when r <= k)."""
    steps = math.ceil(n_out / (k + 1))
    last = n_out - (steps - 1) * (k + 1)
    return steps, (steps - 1) * k + min(last, k)


class AdversarialProposer(_Scripted):
    """Several branches whose first token is wrong (followed by the true continuation shifted by
    one, the most tempting mistake for an off-by-one row index): nothing may be accepted."""

    name = "adversary"

    def __init__(self, truths, *, branches: int = 3, length: int = 6) -> None:
        super().__init__(truths)
        self.branches = branches
        self.length = length

    def _drafts(self, context, truth, max_nodes):
        n = len(context)
        right = truth[n] if truth is not None and n < len(truth) else None
        rest = (truth[n + 1 : n + self.length] if truth is not None else [])
        drafts = []
        for b in range(self.branches):
            wrong = (context[-1] + 7 * b + 1) % VOCAB
            if wrong == right:
                wrong = (wrong + 1) % VOCAB
            drafts.append(Draft.chain([wrong] + rest, [0.9 - 0.1 * b] * (1 + len(rest)), self.name))
        return drafts


class RandomTreeProposer(_Scripted):
    """Random trees with random parents; a node's token is the true one with probability
    ``p_true`` when its path is still on the truth, else a random token. Deterministic."""

    name = "random"

    def __init__(self, truths, *, seed: int = 0, p_true: float = 0.6, max_drafts: int = 3) -> None:
        super().__init__(truths)
        self.rng = random.Random(seed)
        self.p_true = p_true
        self.max_drafts = max_drafts

    def _drafts(self, context, truth, max_nodes):
        rng, n = self.rng, len(context)
        drafts = []
        for _ in range(rng.randint(0, self.max_drafts)):
            size = rng.randint(1, max(1, max_nodes))
            tokens, parents, depth, on_truth = [], [], [], []
            for i in range(size):
                par = rng.randint(-1, i - 1)
                d = 1 if par < 0 else depth[par] + 1
                on = par < 0 or on_truth[par]
                if on and truth is not None and n + d - 1 < len(truth) and rng.random() < self.p_true:
                    tok, good = truth[n + d - 1], True
                else:
                    tok, good = rng.randrange(VOCAB), False
                tokens.append(tok)
                parents.append(par)
                depth.append(d)
                on_truth.append(on and good)
            scores = tuple(rng.uniform(0.05, 1.0) for _ in tokens)
            drafts.append(Draft(tuple(tokens), tuple(parents), scores, self.name))
        return drafts


def draft_paths(drafts: Sequence[Draft], max_depth: int | None = None) -> set[tuple[int, ...]]:
    """Every root-to-node token path of ``drafts`` (of at most ``max_depth`` tokens), as tuples."""
    paths = set()
    for draft in drafts:
        for i in range(len(draft.token_ids)):
            path, node = [], i
            while node >= 0:
                path.append(draft.token_ids[node])
                node = draft.parents[node]
            if max_depth is None or len(path) <= max_depth:
                paths.add(tuple(reversed(path)))
    return paths


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def failing_call(fn, nth: int, message: str = "out of memory", exc: type[BaseException] = RuntimeError):
    """``fn`` that raises ``exc(message)`` on its ``nth`` call (1-based), as a prefill out of
    memory would; the calls so far in ``.calls``."""
    def wrapper(*args, **kwargs):
        wrapper.calls += 1
        if wrapper.calls == nth:
            raise exc(message)
        return fn(*args, **kwargs)

    wrapper.calls = 0
    return wrapper


def greedy_alone_and_batched(engine, model, prompts, counter: list, tokens: int = 30, batched: bool = True) -> None:
    """``engine`` generates ``prompts[0]`` alone and (``batched``) all of ``prompts`` in one
    ``BatchDecoder``, ``tokens`` each, every output ``transformers``' greedy, and ``counter`` (a
    one-element list a kernel or forward counts its calls in) rises in both."""
    from lookupdec.batch import BatchDecoder, BatchRequest

    calls = counter[0]
    assert engine.generate(prompts[0], max_new_tokens=tokens).token_ids == hf_greedy(model, prompts[0], tokens)
    alone = counter[0]
    assert alone > calls
    if not batched:
        return
    decoder = BatchDecoder(engine, len(prompts))
    for p in prompts:
        decoder.submit(BatchRequest(p, tokens))
    done = []
    while not decoder.idle:
        done.extend(decoder.generation(s).token_ids for s in decoder.step())
    assert sorted(done) == sorted(hf_greedy(model, p, tokens) for p in prompts)
    assert counter[0] > alone


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    """``lookupdec ARGV...`` in-process (``cli.main``, each argument as a string): (exit status,
    stdout, stderr)."""
    from lookupdec.cli import main

    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err
