"""Many sequences per forward: the batched step and continuous batching.

``BatchDecoder`` runs up to ``max_batch`` sequences of one ``Engine`` together. Each step:

    admit    waiting sequences join while rows are free (a prefill forward of the prompt each, or
             one for all of them on a GPU: ``BatchTarget.add_many``); each one's first token
             comes from its prefill's last logits (``RequestCore.first``, as alone)
    plan     every sequence's drafts and merged tree (``StepCore.plan``, no pruning yet)
    choose   one joint budget: the width ``W`` (nodes per row, root included) maximising the
             batch's expected tokens per second, sum over rows of ``1 + scale x`` the gains of
             its ``W - 1`` best nodes (``StepCore.scale``; each row's times its request's own
             correction, ``StepCore.request_factor``), over ``t(rows x W)``, the learnt cost of the batched forward
             (rows are padded to the widest tree, so within a width every row takes all the
             nodes it has up to ``W - 1``: padding is computed anyway); a row whose tree is
             wider than ``W - 1`` is drafted again for ``W - 1`` nodes. A sequence alone in
             the batch (a client alone on a server, a batch's last row) is planned and
             chosen for as alone instead: the engine's own cost curve and chooser
             (``BatchDecoder._lone_cost``)
    verify   one forward for every row's tree (``BatchTarget.verify``)
    accept   per sequence, exactly as alone (``sampling.accept`` with its own generator), then
             one KV commit for the batch, observe and learn per sequence (``StepCore.finish``)
    leave    finished sequences (EOS, length, stop string, cancel) free their rows

Each sequence keeps its own sampling parameters, seed, stop strings and cancel flag; its output
is the one it would have alone: greedy identical (every row sees exactly its own prefix and
ancestors), sampled identical for a seed (point-mass drafts consume one draw per emitted token,
whatever the tree). ``tests/test_batch.py`` checks both. Models without tree masks or with
sliding windows run their sequences one at a time (``Engine.generate`` each): the reference path.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch

from lookupdec.budget import CostModel, DraftBudget
from lookupdec.request import Generation, GenerationStats, StepTimer, cancel_check, count_step, finish_stats
from lookupdec.sampling import GreedyChoices, PartialLogits, SamplingParams
from lookupdec.step import Verdict
from lookupdec.stops import StopStrings, TextAssembler


# Proposers asked for 64 nodes (or 16) and pruned to the 3-4 a batch row keeps accept about half
# as many draft tokens as proposers asked for 4 (SmolLM2, 16 log prompts, B = 8: 1.94 and 2.05
# against 3.19 tokens per step). So the width is chosen on drafts made for twice the nodes kept
# lately, from 4 up (twice: the width can grow where drafts start to match, e.g. an output seen
# before), and a row whose tree is wider than the width chosen is drafted again for exactly that
# many nodes (``BatchDecoder._choose``): the tree verified is the one a fixed budget of that size
# would have made.
BATCH_DRAFT_MIN = 4
BATCH_DRAFT_HEADROOM = 2.0
# the widths a batch's first curve times before it trusts its prices (``BatchDecoder._cost``)
PROBE_WIDTHS = (1, 2, 4, 8)
PROBE_PRIOR_COUNT = 0.01  # ... one row's prices stand in for them as this many forwards (the first one replaces them)
# new tokens a joining row reserves K/V slots for (``BatchDecoder._room``): the buffer then
# grows as a prompt joins, not in the middle of a step, where it stalls every row
RESERVE_NEW_TOKENS = 1024
# a sequence alone in the batch steps as alone (``BatchDecoder._lone_cost``; False: the joint
# budget on a one-row curve, for tests of the batched path)
LONE_ROW_ALONE = True


@dataclass
class BatchRequest:
    """One sequence of a batch, with everything ``Engine.generate`` takes."""

    prompt: object  # text or token ids
    max_new_tokens: int
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: object = None
    cancel: object = None  # threading.Event or zero-argument callable
    on_text: Callable[[str], None] | None = None  # called with each new piece of text (streaming)
    tag: object = None  # the caller's, returned untouched


@dataclass(eq=False)  # a sequence is itself, whatever its request's values (a prompt may be an array)
class _Sequence:
    request: BatchRequest
    index: int
    rid: str
    context: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    text: TextAssembler
    cancelled: Callable[[], bool] | None
    stats: object
    timer: object
    started: float
    seen: set = field(default_factory=set)
    produced: int = 0
    row: int = -1
    finish: str | None = None
    plan: object = None


class BatchDecoder:
    """Continuous batching over one engine: ``submit`` requests, ``step`` until ``idle``."""

    def __init__(self, engine, max_batch: int, joint_prefill: bool | None = None,
                 record_widths: bool = False) -> None:
        """``joint_prefill``: sequences joining together prefill in one forward (None: on a GPU,
        not on a CPU; ``BatchTarget``). ``record_widths``: keep every step's width in ``widths``
        (benchmarks, tests; a server's or a long job's decoder keeps nothing per step or per
        finished sequence, so its memory stays flat). ``engine``: an ``Engine``, of which the
        decoder uses the public face only (this module imports nothing of ``engine.py``): its
        request rules (``Engine.request_core``, shared with its own requests), ``step_core``,
        ``target``, ``config``, ``turn``, ``check_request``, ``cost_model``, ``batch_costs``,
        ``batch_probes`` and ``store_forms``."""
        from lookupdec.model.batch import BatchTarget

        if max_batch < 1:
            raise ValueError(f"max_batch={max_batch}: must be >= 1")
        self.engine = engine
        self.max_batch = max_batch
        self.target = BatchTarget(engine.target, max_batch, joint_prefill=joint_prefill,
                                  prefix_cache=engine.config.prefix_cache)
        # greedy rows read every row's argmax (and top tokens) from one pass over the batch's
        # logits (None: where they lie on an accelerator; ``_greedy_choices``)
        self.greedy_at_once: bool | None = None
        self.waiting: list[_Sequence] = []
        self.active: list[_Sequence] = []  # by row
        self.done: list[_Sequence] = []  # what ``run`` finished (``step`` keeps none: its caller has them)
        # the sequences the current (or last) ``step`` ended: where it raised, its caller still
        # answers these from them (``abandon`` gives the rest)
        self.ended_in_step: list[_Sequence] = []
        # the sequences whose own prefill failed as they joined in the current (or last) step,
        # with the error (an out-of-memory prompt): they left, the batch went on without them;
        # the caller answers them (the server's 500, rewrite's record alone)
        self.failed_in_step: list[tuple[_Sequence, Exception]] = []
        self._count = 0
        self._costs = engine.batch_costs  # (context bucket, rows) -> t(rows x width), the engine's
        self._probes = engine.batch_probes  # (context bucket, rows) -> widths not timed yet (``_cost``)
        self._lone_costs: dict = {}  # context bucket -> a lone row's curve (``_lone_cost``)
        self.overhead_s = 0.0  # mean batch step time outside the forward (decayed)
        self.steps = 0  # verify steps so far
        self.widths: list[int] = []  # with ``record_widths``: the chosen width of every step
        self._record_widths = record_widths
        self.redrafted = 0  # rows drafted again for the width chosen (for tests and benchmarks)
        # nodes each row's proposers are asked for: the power of 2 at or above twice the nodes kept
        # lately (at least BATCH_DRAFT_MIN, not the single-sequence floor of 16)
        self.draft_budget = DraftBudget(min_nodes=BATCH_DRAFT_MIN, headroom=BATCH_DRAFT_HEADROOM)

    # -- requests --------------------------------------------------------------------------------
    def submit(self, request: BatchRequest, field: str = "prompt") -> int:
        """Queue ``request`` (checked now: a bad value raises ``ParamError``, a bad prompt's
        ``.field`` ``field``); its index."""
        engine = self.engine
        ids = engine.check_request(request.prompt, max_new_tokens=request.max_new_tokens,
                                   temperature=request.temperature, top_k=request.top_k, top_p=request.top_p,
                                   repetition_penalty=request.repetition_penalty, seed=request.seed,
                                   stop=request.stop, field=field)
        params = SamplingParams(temperature=request.temperature, top_k=request.top_k, top_p=request.top_p,
                                repetition_penalty=request.repetition_penalty)
        generator = None
        if not params.greedy:
            generator = torch.Generator(device=engine.target.device)
            generator.manual_seed(request.seed) if request.seed is not None else generator.seed()
        index = self._count
        self._count += 1
        seq = _Sequence(request, index, f"batch-{id(self)}-{index}", list(ids), params, generator,
                        TextAssembler(engine.tokenizer, StopStrings(request.stop)), cancel_check(request.cancel),
                        GenerationStats(), StepTimer(), time.perf_counter(), seen=set(ids))
        self.waiting.append(seq)
        return index

    def abandon(self) -> list[_Sequence]:
        """After a ``step`` that raised: every sequence not done (active, then waiting), the
        active ones' step state released; the decoder is not to be stepped again. The caller
        answers or redoes each (the server's 500s, rewrite's records one at a time), and answers
        ``ended_in_step`` (done before the step raised) as it answers what a step returns."""
        for seq in self.active:  # (the waiting ones have no step state yet)
            self.engine.step_core.stop(seq.rid)
        left = self.active + self.waiting
        self.active, self.waiting = [], []
        return left

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.active

    def run(self) -> list:
        """Step until every submitted request is done; their ``Generation``s in submission order.
        A prompt whose prefill fails raises its error (the others abandoned)."""
        try:
            while not self.idle:
                self.done.extend(self.step())
                if self.failed_in_step:  # (a prompt's prefill: the whole call fails, as alone)
                    raise self.failed_in_step[0][1]
        except BaseException:
            self.abandon()  # (their step state released: nothing of them stays in the engine)
            raise
        return [self.generation(seq) for seq in sorted(self.done, key=lambda s: s.index)]

    def generation(self, seq: _Sequence) -> Generation:
        finish_stats(seq.stats, seq.timer, time.perf_counter() - seq.started, len(seq.text.output_ids))
        return Generation(text=seq.text.text, token_ids=seq.text.output_ids, finish_reason=seq.finish,
                          stats=seq.stats)

    # -- the step ---------------------------------------------------------------------------------
    def step(self) -> list[_Sequence]:
        """One batched step (admitting waiting requests first). Returns the sequences that
        finished during it. A step holds the engine's turn (``Engine.turn``: other threads'
        requests wait; this thread's live stream raises ``EngineBusy``). Between steps the
        batch's state (its own K/V rows, its requests' step state by id) is apart from the
        engine's single request, so the caller may run one to its end there (rewrite's records
        redone alone)."""
        self.engine.turn.take(f"a step of a BatchDecoder of {self.max_batch} rows")
        try:
            return self._step()
        finally:
            self.engine.turn.give()

    def _step(self) -> list[_Sequence]:
        finished: list[_Sequence] = []
        self.ended_in_step = finished
        self.failed_in_step = []
        self._admit(finished)
        for seq in list(self.active):  # (length, EOS and stops end a sequence in the step that reaches them)
            if seq.cancelled is not None and seq.cancelled():
                self._end(seq, "cancelled", finished)
        if not self.active:
            return finished
        engine, core, request_core = self.engine, self.engine.step_core, self.engine.request_core
        auto = engine.config.budget == "auto"
        # a sequence alone in the batch is chosen for as it would be alone (``_lone_cost``)
        lone = self._lone_cost(self.active[0]) if auto and LONE_ROW_ALONE and len(self.active) == 1 else None
        if auto and lone is None:
            self._cost(len(self.active))  # a first cost curve may take a few forwards: not the step's overhead
        t0 = time.perf_counter()
        if lone is not None:
            seq = self.active[0]
            self._promised = None
            seq.plan = core.plan(seq.rid, seq.context, cost=lone, overhead_s=seq.timer.overhead_s(),
                                 max_depth=self._depth(seq))
            trees = [seq.plan.tree]
        else:
            # drafts made for about the width the joint budget has kept lately (DraftBudget): a
            # tree drafted for 64 nodes and pruned to 4 accepts far less than one drafted for 4
            asked = self.draft_budget.nodes(engine.config.max_nodes) if auto else None
            for seq in self.active:
                seq.plan = core.plan(seq.rid, seq.context, cost=None, max_nodes=asked,
                                     max_depth=self._depth(seq))
            trees = self._choose(self.active)
        t1 = time.perf_counter()
        head_rows = [request_core.head_rows(tree, seq.params) for seq, tree in zip(self.active, trees)]
        # (as alone, ``Engine._verdict``: the output projection picks the selected rows' best tokens)
        picks = request_core.picks() if any(r is not None for r in head_rows) else 0
        logits = self.target.verify(trees, head_rows, picks)
        if auto:  # timed to the device's end, as alone (TargetModel.sync)
            engine.target.sync()
        t2 = time.perf_counter()
        forward = t2 - t1 - engine.target.last_prepare_s
        rows = len(trees)
        width = max(len(tree) for tree in trees)
        self.steps += 1
        if self._record_widths:
            self.widths.append(width)
        accepted, verdicts = [], []
        choices = self._greedy_choices(logits, trees)
        for b, (seq, tree) in enumerate(zip(self.active, trees)):
            mine = logits[b] if isinstance(logits, list) else logits[b, : len(tree)]
            if choices is not None and seq.params.greedy and not seq.params.uses_prefix:
                mine = choices[b]
            verdicts.append(self._accept(seq, tree, mine))
            accepted.append(verdicts[-1][0])
            if isinstance(mine, PartialLogits):  # rows the walk asked for are the forward's cost
                forward += mine.extra_s
                seq.timer.head_rows += mine.computed
                seq.timer.head_misses += mine.misses
            else:
                seq.timer.head_rows += len(tree)
        if lone is not None:
            lone.observe(width, forward)
        elif auto:
            self._cost(rows).observe(rows * width, forward)
            self._probes.get(self._key(rows), set()).discard(width)
        self.target.commit(accepted)
        for seq, tree, (acc, new, successors) in zip(list(self.active), trees, verdicts):
            seq.plan.tree = tree
            step = core.finish(seq.rid, seq.plan, Verdict(acc, new, successors))
            seq.timer.forward += forward
            seq.timer.prepare += engine.target.last_prepare_s
            count_step(seq.stats, seq.timer, step, t0)
            self._emit(seq, step.new_tokens, finished)
        outside = (t1 - t0) + (time.perf_counter() - t2)  # the step outside its forward
        self.overhead_s = outside if self.steps == 1 else 0.8 * self.overhead_s + 0.2 * outside
        return finished

    def _greedy_choices(self, logits, trees) -> list | None:
        """Every row's argmax and recycling's top tokens in one pass and one transfer
        (``GreedyChoices``), for a forward's logits on an accelerator (``greedy_at_once``)
        holding a greedy row; None otherwise (each row reads its own logits)."""
        at_once = self.greedy_at_once
        if isinstance(logits, list) or not (at_once or (at_once is None and logits.device.type != "cpu")):
            return None
        if not any(seq.params.greedy and not seq.params.uses_prefix for seq in self.active):
            return None
        k = self.engine.request_core.recycle_successors()
        return GreedyChoices.of_batch(logits, [len(tree) for tree in trees], k)

    def _admit(self, finished: list) -> None:
        """Waiting sequences join while rows are free: each prompt prefilled into a row, and its
        first token taken from the prefill's last logits (``RequestCore.first``, as alone)."""
        engine, request_core = self.engine, self.engine.request_core
        joining = self.waiting[: self.max_batch - len(self.active)]
        if not joining:
            return
        del self.waiting[: len(joining)]
        before = self.target.rows
        try:
            joining, rows, logits, prefill_ms = self._prefill(joining)
        except BaseException:  # (an interrupt): the rows added leave and they wait again, so that
            self.target.truncate(before)  # the caller's recovery of active + waiting sees them,
            self.waiting[:0] = [seq for seq in joining if seq is not None]  # none lost
            raise
        for seq, row, ms in zip(joining, rows, prefill_ms):
            seq.row = row
            seq.stats.prefill_ms = ms
            engine.step_core.start(seq.rid, seq.context, seq.params, seq.request.seed)
            self.active.append(seq)
        for seq, first in zip(joining, logits):
            if seq.cancelled is not None and seq.cancelled():  # checked before every forward's tokens
                self._end(seq, "cancelled", finished)
            elif seq.request.max_new_tokens > 0 and request_core.room(seq.context) > 0:
                new = request_core.first(seq.rid, seq.context, first, seq.params, seq.generator, seq.seen, 1)
                seq.stats.prefill_tokens = len(new)
                self._emit(seq, new, finished)
            else:
                self._end(seq, "length", finished)

    def _prefill(self, joining: list) -> tuple[list, list, list, list]:
        """Rows for the ``joining`` sequences' prompts: those that joined, their rows, their
        prompts' last logits and prefill ms. One forward for all where ``joint_prefill`` (each
        gets its share of the time); if it fails (out of memory) it adds no row and each prefills
        alone, so that only a prompt whose own prefill fails leaves, into ``failed_in_step``
        (``joining[k]`` set to None, for an interrupt's recovery)."""
        rooms = [self._room(seq) for seq in joining]
        if self.target.joint_prefill and len(joining) > 1:
            t = time.perf_counter()
            try:
                rows = self.target.add_many([seq.context for seq in joining], rooms)
            except Exception:  # noqa: BLE001 -- each alone, below: a failure then names its prompt
                pass
            else:
                share = (time.perf_counter() - t) * 1e3 / len(joining)
                return joining, rows, self.target.last_logits, [share] * len(joining)
        rows, logits, prefill_ms = [], [], []
        for k, (seq, room) in enumerate(zip(joining, rooms)):
            t = time.perf_counter()
            try:
                rows.append(self.target.add(seq.context, room))
            except Exception as exc:  # (its prompt out of memory): it alone fails, the batch as it was
                self.failed_in_step.append((seq, exc))
                joining[k] = None
                continue
            logits.append(self.target.last_logits[0])
            prefill_ms.append((time.perf_counter() - t) * 1e3)
            seq.stats.prefix_reused = self.target.last_reused
        return [seq for seq in joining if seq is not None], rows, logits, prefill_ms

    def _emit(self, seq: _Sequence, new: list[int], finished: list) -> None:
        """``new`` tokens join ``seq``'s output (text streamed); it ends at a stop string, EOS,
        ``max_new_tokens`` or the context's end."""
        engine = self.engine
        seq.context.extend(new)
        seq.seen.update(new)
        seq.produced += len(new)
        piece = seq.text.add(new)
        if piece and seq.request.on_text is not None:
            seq.request.on_text(piece)
        if seq.text.stopped:
            self._end(seq, "stop", finished)
        elif new and new[-1] in engine.eos_token_ids:
            self._end(seq, "eos", finished)
        elif seq.produced >= seq.request.max_new_tokens or engine.request_core.room(seq.context) <= 0:
            self._end(seq, "length", finished)

    def _end(self, seq: _Sequence, finish: str, finished: list) -> None:
        seq.finish = finish
        tail = seq.text.flush()
        if tail and seq.request.on_text is not None:
            seq.request.on_text(tail)
        self.engine.step_core.stop(seq.rid)
        row = self.active.index(seq)
        moved = self.target.remove(row)
        last = self.active.pop()
        if moved is not None:
            self.active[row] = last
            last.row = row
        finished.append(seq)
        self.engine.store_forms()  # kernel forms chosen meanwhile, for the next process

    def _accept(self, seq: _Sequence, tree, logits: torch.Tensor) -> tuple[list[int], list[int], tuple | None]:
        engine = self.engine
        limit = min(seq.request.max_new_tokens - seq.produced, engine.request_core.room(seq.context))
        prev = seq.context[-2] if len(seq.context) > 1 else -1
        return engine.request_core.accept(tree, logits, seq.params, seq.generator, seq.seen, limit, prev)

    # -- the joint budget ----------------------------------------------------------------------
    def _key(self, rows: int) -> tuple[int, int]:
        return self.engine.request_core.cost_bucket(max(len(seq.context) for seq in self.active)), rows

    def _cost(self, rows: int) -> CostModel:
        """``t(rows x width)`` at the batch's context bucket, learnt from the batch's forwards. A
        new (bucket, rows) curve starts from the nearest one the engine has for several rows
        (fewest rows apart, then nearest bucket: the sizes it observed lately, ``CostModel
        .trusted``), with the widths that one has still to time. The first starts from one row's
        prices of as many tokens at ``rows x`` each of ``PROBE_WIDTHS`` only, and times each of
        them, one step each on the batch's own trees (``_probe``), its first forward replacing
        the prior. One row's curve prices a batch's widths badly (a row's cost grows with its
        tokens far faster than a batch's with its width: ``bench/batch_profile.py``,
        docs/design/batching.md), and a copy of the whole curve would keep one row's prices of
        sizes no batch of these rows verifies, pricing the narrowest width at the cheapest of
        them."""
        engine = self.engine
        key = self._key(rows)
        if key not in self._costs:
            bucket, cost = key[0], None
            if rows > 1:  # the nearest batch curve: fewest rows apart, then nearest bucket
                near = sorted((abs(r - rows), abs(b.bit_length() - bucket.bit_length()), b, r)
                              for b, r in self._costs if r > 1)
                for *_, b, r in near:
                    if (cost := self._costs[b, r].trusted()) is not None:
                        if self._probes.get((b, r)):  # what that curve has still to time, this one too
                            self._probes[key] = set(self._probes[b, r])
                        break
            if cost is None:
                single = engine.cost_model(bucket)
                if rows == 1:
                    cost = single.copy()
                else:  # one row's prices at rows x each probe width, each replaced by its first forward
                    widths = sorted(w for w in PROBE_WIDTHS if w <= engine.config.max_nodes + 1)
                    sizes = [rows * w for w in widths]
                    prices = single.dense(sizes[-1], padded=False)
                    cost = CostModel(sizes, [float(prices[n]) for n in sizes], [PROBE_PRIOR_COUNT] * len(sizes))
                    self._probes[key] = set(widths)
            self._costs[key] = cost
        return self._costs[key]

    def _room(self, seq: _Sequence) -> int:
        """K/V slots ``seq``'s row reserves beyond its prompt as it joins: its new tokens (at most
        ``RESERVE_NEW_TOKENS``; a longer answer grows the buffer as it needs) and the widest tree."""
        engine = self.engine
        new = min(seq.request.max_new_tokens, RESERVE_NEW_TOKENS, engine.request_core.room(seq.context))
        return max(0, new) + engine.config.max_nodes + 1

    def _depth(self, seq: _Sequence) -> int:
        """The deepest tree ``seq`` may verify: the step's cap, or the room left in its context."""
        return min(self.engine.config.max_depth, self.engine.request_core.room(seq.context))

    def _lone_cost(self, seq: _Sequence) -> CostModel:
        """The cost curve of a sequence alone in the batch: a copy of the engine's own at the
        bucket it would take alone (``Engine._steps``), which the step then observes; its tree is chosen
        as alone too (``StepCore.plan`` with the curve: the single-sequence chooser, its
        exploration and draft budget), not by the joint budget on a one-row curve of its own:
        a client alone on a batching server then waits as long as on the one-at-a-time server
        (docs/design/batching.md)."""
        prompt = len(seq.context) - seq.produced  # (``cost_model`` takes the bucket of this many tokens)
        context = prompt + seq.request.max_new_tokens // 2
        bucket = self.engine.request_core.cost_bucket(context)
        if bucket not in self._lone_costs:
            # the decoder's own copy: a row verifies through the batched forward, not the path a
            # request alone takes (its root alone through the compiled decoder), so its timings
            # stay out of the engine's curve (and the cost cache), whose t(1) they would raise
            engine_curve = self.engine.cost_model(context)
            self._lone_costs[bucket] = engine_curve.trusted() or engine_curve.copy()
        return self._lone_costs[bucket]

    def _probe(self, rows: int, width: int, widest: int) -> int:
        """The width to verify given the joint budget's ``width``: itself while it or no width
        up to ``widest`` (the widest tree's nodes) is left to time on this batch's curve; else
        the narrowest such width (``_cost``; one step each, every row's tokens accepted as at
        any width: the sampling stays exact)."""
        pending = self._probes.get(self._key(rows))
        if not pending or width in pending:
            return width
        return min((w for w in pending if w <= widest), default=width)

    def _choose(self, seqs: list[_Sequence]) -> list:
        """Every row's tree for the joint budget's width ``W`` (``choose_width``): a row whose tree
        has more than ``W - 1`` nodes is drafted again for ``W - 1`` (its lookups only: a draft
        model's tree is pruned instead, one draft-model run per step is enough)."""
        engine, core = self.engine, self.engine.step_core
        trees = [seq.plan.tree for seq in seqs]
        if engine.config.budget != "auto":
            return trees
        # each row's gains corrected by its request's own record (``StepCore.request_factor``): the
        # joint budget then spends its width where the drafts have been accepted
        gains = [[seq.plan.factor * g for g in tree.expected_in_prune_order()] for seq, tree in zip(seqs, trees)]
        longest = min(max((len(g) for g in gains), default=0), engine.config.max_nodes)
        width = choose_width(gains, self._cost(len(trees)), self.overhead_s, engine.config.max_nodes, core.scale)
        width = self._probe(len(trees), width, longest + 1)
        out = []
        for seq, tree in zip(seqs, trees):
            if tree.num_draft_nodes > width - 1 and width > 1 and core.mixture.draft is None:
                first = seq.plan
                self.redrafted += 1
                seq.plan = core.plan(seq.rid, seq.context, cost=None, max_nodes=width - 1,
                                     max_depth=self._depth(seq))
                seq.plan.propose_s += first.propose_s  # the step's drafting time is both plans'
                seq.plan.tree_s += first.tree_s
                pruned = seq.plan.tree.prune(width - 1)  # (the merge keeps at most W - 1 already)
            else:
                pruned = tree.prune(width - 1)
            if tree.num_draft_nodes:
                self.draft_budget.observe(pruned.num_draft_nodes)
            out.append(pruned)
        return out


def choose_width(gains: Sequence[Sequence[float]], cost: CostModel, overhead_s: float, max_nodes: int,
                 scale: float = 1.0) -> int:
    """The width ``W`` (1..max_nodes + 1) maximising (rows + scale x the sum over rows of the
    first ``W - 1`` gains) / (t(rows x W) + overhead): the batched forward computes ``rows x W``
    tokens whatever each row's tree, so each row takes its best ``W - 1`` nodes.

    >>> cost = CostModel([1, 2, 4, 8], [1.0, 1.0, 1.1, 2.0])
    >>> choose_width([[0.9, 0.5, 0.1], [0.8]], cost, 0.0, 3)   # 4 tokens cost 1.1: two per row
    2
    """
    rows = len(gains)
    longest = min(max((len(g) for g in gains), default=0), max_nodes)
    promised = np.zeros(longest + 1)  # [W - 1]: the sum over rows of their first W - 1 gains
    for g in gains:
        values = np.asarray(g[:longest], dtype=np.float64)
        if len(values):
            sums = np.cumsum(values)
            promised[1 : len(values) + 1] += sums
            promised[len(values) + 1 :] += sums[-1]
    expected = rows + scale * promised
    dense = cost.dense(rows * (longest + 1))
    seconds = np.array([dense[rows * (w + 1)] for w in range(longest + 1)]) + overhead_s
    return int(np.argmax(expected / seconds)) + 1
