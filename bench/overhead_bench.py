"""Per-step overhead outside the model forward, model-free, over recorded contexts.

Replays recorded (prompt, response) pairs (``lookupdec.workloads`` over ``../shared/data``,
Llama-2 tokenizer, as ``bench/replay.py``) through the engine's step in ``StepCore.run``'s order
with a fixed node budget (``max_nodes=64``, ``max_depth=64``) and times every phase of it but
the verify forward, in µs per step:

    propose  ``Mixture.propose`` over ``build_proposers(EngineConfig())`` (n-gram + suffix + recycling);
             on the fast paths ``Mixture.plan``, as ``StepCore.plan`` calls it: the drafts and
             their merge in one compiled call (merge then reads 0)
    merge    ``TokenTree.from_drafts`` with the calibrator, as ``StepCore.plan`` (the
             reference: the reference calibrator's whole table first, then
             ``reference.tree.merge_drafts``)
    choose   ``choose_tree_nodes`` (``CostModel``: a measured 150M-parameter curve,
             one per set of paths, observed every step) + ``prune`` (timed; the verified tree stays the fixed
             budget's, as with ``budget="fixed"``)
    inputs   ``model.tree_inputs``: input ids, position ids, additive 4D mask [1,1,1+n,ctx+1+n]; on
             the fast paths, as ``TargetModel.verify`` with the compiled decoder
             (``model/native_forward.py``, trees of up to 64 nodes), the positions only (its
             mask is made inside the forward, from the parents); without it, the mask written
             into the ``InputBuffers`` kept across steps
    accept   ``sampling.accept`` (greedy) on logits [1+n, 49152] (SmolLM2's vocabulary) whose
             argmax follows the recorded response along the tree: the walk the target makes; on
             the fast paths as the engine calls it: with ``top_k``, so each visited row is read
             once for its argmax and the recycling table's top tokens, and on ``PartialLogits``
             (``EngineConfig.partial_logits``): the rows of the nodes ``head_rows`` picks are
             copied out after the KV writes, with each row's argmax and top tokens (untimed:
             the forward's output projection writes them last, and the skinny product, its form
             at up to 64 rows on this machine, picks them as it writes each row:
             ``FastHead.project``), so the walk reads the picks, not the rows; a row the walk
             asks for besides is copied then and read for its picks (its time is the forward's,
             as in the engine, and not counted here); the reference reads every row where the
             KV writes left it
    recycle  the engine's hand-off to the token-recycling proposer: the reference's
             ``reference.request.top_tokens`` of the visited rows, and ``Mixture.observe_path``; on the
             fast paths only the hand-off's tuple (``Verdict.successors``): the table takes it
             with the observe
    commit   ``model.commit_accepted`` on a KV cache of SmolLM2-135M's shape (30 layers of
             [1, 3, ctx+1+n, 64] float32 keys and values): the engine's ``SlotCache`` (fast) or
             transformers' ``DynamicCache`` (reference); and ``CostModel.observe`` of the
             forward's time (the curve's own estimate for that size), as the engine records every
             verify forward: the next step's choice reads the curve computed again
    observe  ``Mixture.observe`` (every proposer sees the new tokens); on the fast paths
             ``Mixture.finish``, as ``StepCore.finish`` calls it: the recycling table's
             hand-off, the observe and the calibrator's learn in one compiled call (learn then
             reads 0; a step whose drafts add a calibrator row learns apart, inside it)
    learn    ``AcceptanceCalibrator.learn`` (fast paths: in ``observe``; the reference:
             ``lookupdec.reference.budget.AcceptanceCalibrator.learn``)

Also, inside the verify forward and so in none of the totals: the K/V writes a forward of 1 + 64
tokens makes into the engine's cache, 30 layers (``SlotStore.write``), against indexing the
buffer per layer (its definition, ``reference.model.write``), in turn (``kv_writes``).

Two sets of code paths run the same steps, record by record in turn: ``reference`` (the
definition of every fast path, ``lookupdec.reference``: its functions called by name, the n-gram
index and the recycling table made as where the extension is not built, and the suffix drafts by
their definition over the compiled automata: ``reference_lookups``) and ``fast`` (what the engine
runs); every step's tree and
accepted nodes must be identical between them (checked). The verify forward is replaced by
the recorded response, so greedy acceptance accepts what the real model would; the recycling
proposer's successors come from those synthetic logits (their argmax is the recorded token,
the rest noise), so its drafts cost what they cost but are rarely right. Each phase is timed
by the wall clock and by this thread's CPU time (the machine is shared); between steps the
KV cache gets the forward's writes, so, as in the engine, every phase starts with cold caches.

    python bench/overhead_bench.py                       # ~1 minute, writes bench/results/overhead.json
    python bench/overhead_bench.py --repeat 3            # three fresh replays: the spread between runs
    python bench/overhead_bench.py --workloads loghub --records 2 --out /tmp/o.json
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import hashlib
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import RESULTS_DIR, SHARED_DIR, format_table, run_metadata, write_result  # noqa: E402

import torch  # noqa: E402

from lookupdec.budget import AcceptanceCalibrator, CostModel, choose_tree_nodes  # noqa: E402
from lookupdec.config import EngineConfig  # noqa: E402
from lookupdec.engine import top_tokens  # noqa: E402
from lookupdec.mixture import Mixture  # noqa: E402
from lookupdec.model import commit_accepted, load_tokenizer, new_cache, tree_inputs  # noqa: E402
from lookupdec.model.native_forward import NATIVE_MAX_NODES  # noqa: E402
from lookupdec.model.target import InputBuffers  # noqa: E402
from lookupdec.native import kernels as native_kernels  # noqa: E402
from lookupdec.proposers import build_proposers, ngram, recycle, suffix  # noqa: E402
from lookupdec.reference import budget as reference_budget  # noqa: E402
from lookupdec.reference import drafting as reference_drafting  # noqa: E402
from lookupdec.reference import model as reference_model  # noqa: E402
from lookupdec.reference import request as reference_request  # noqa: E402
from lookupdec.reference import sampling as reference_sampling  # noqa: E402
from lookupdec.reference import tree as reference_tree  # noqa: E402
from lookupdec.sampling import PartialLogits, SamplingParams, accept, head_rows  # noqa: E402
from lookupdec.simulate import accepted_path, tokenize_record  # noqa: E402
from lookupdec.tree import Draft, TokenTree  # noqa: E402
from lookupdec.workloads import WORKLOADS  # noqa: E402

PHASES = ("propose", "merge", "choose", "inputs", "accept", "recycle", "commit", "observe", "learn")
MAX_NODES = 64
# SmolLM2's trees of up to NATIVE_MAX_NODES nodes go through the compiled decoder, which builds its
# attention plan from the parents inside the forward
NATIVE = native_kernels is not None and hasattr(native_kernels, "decoder_forward_at") and MAX_NODES + 1 <= NATIVE_MAX_NODES
MAX_DEPTH = 64
# SmolLM2-135M-Instruct's shapes: what the KV cache and the logits of a real step hold
LAYERS, KV_HEADS, HEAD_DIM, VOCAB = 30, 3, 64, 49152
DTYPE = torch.float32
# The 150M-parameter Llama's measured verify cost on this machine (bench/results/budget.json,
# 2 threads, 256-token context): t(n) for the chooser
COST_SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256]
COST_SECONDS = [0.0445, 0.0764, 0.0852, 0.0842, 0.0984, 0.1301, 0.1818, 0.2995, 0.5216]
RECYCLE_SUCCESSORS = EngineConfig().recycle.successors
FULL_TREE = 60  # steps with at least this many draft nodes count as "at 64 nodes"
NODE_BINS = [(0, 0), (1, 15), (16, 31), (32, 47), (48, 59), (60, 63), (64, 64)]
KV_WRITE_ROUNDS = 200  # forwards' K/V writes timed per method (kv_writes)
DEFAULT_RECORDS = "loghub:8,code-edit:3,mtbench:6"  # workload:records (the first of each warms up)


@dataclass
class Paths:
    """The code one set of paths runs per phase."""

    name: str
    lookups: Callable  # () -> a context in which the lookups' index and table are made and their drafts run
    calibrator: Callable  # () -> the calibrator (budget.AcceptanceCalibrator or its reference)
    merge: Callable  # (root, drafts, max_nodes=, max_depth=, calibration=) -> TokenTree
    prune: Callable  # (tree, n) -> TokenTree
    inputs: Callable  # model.tree_inputs(tree, n_cached, device=, dtype=, windows=, tree_mode=)
    accept: Callable  # sampling.accept(tree, logits, params)
    slot_cache: bool  # the engine's SlotCache, else a DynamicCache
    top_tokens: Callable  # engine.top_tokens(logits, rows, k)
    choose: Callable  # budget.choose_tree_nodes(tree, cost, overhead, max_nodes, scales) or its reference
    partial: bool = False  # accept on PartialLogits (the likely nodes' rows), as the engine's greedy verify
    fused: bool = False  # propose and merge in one compiled call (Mixture.plan), as StepCore.plan
    picked: bool = False  # ... with each row's best ids made by the output projection (FastHead.project)


def reference_automaton_drafts(automaton, ctx, max_nodes, min_match, source, certain_step, pending) -> list:
    """``suffix.automaton_drafts`` with the drafts made by their definition,
    ``reference.drafting.suffix_drafts``, over the automaton's queries (compiled: the reference
    automaton core scores a match of no token otherwise, ``tests/automaton/test_automaton.py``)."""
    out = []
    for tokens, parents, scores, length, chain, chain_certain in reference_drafting.suffix_drafts(
            automaton, ctx, max_nodes, min_match, suffix.MATCH_LEVELS, suffix.SHORTER_MATCH_NODES_DIVISOR,
            suffix.SEPARATOR, suffix.EMPTY_MATCH_CONFIDENCE, suffix.MATCH_PRIOR, certain_step.value):
        out.append(Draft._trusted(None, None, None, source, length, packed=(tokens, parents, scores)))
        if chain is not None and source not in pending:
            pending[source] = (chain, chain_certain)
    return out


@contextlib.contextmanager
def reference_lookups():
    """The lookups on their definitions: the n-gram and recycling modules see no compiled drafting,
    so the index and the table made (and run) meanwhile are ``reference.drafting.NgramIndex`` and
    ``RecycleTable``, as where the extension is not built; the suffix proposer's drafts are
    ``reference_automaton_drafts``."""
    saved = [(module, name, getattr(module, name)) for module, name in
             ((ngram, "native_drafting"), (recycle, "native_drafting"), (suffix, "automaton_drafts"))]
    try:
        ngram.native_drafting = recycle.native_drafting = None
        suffix.automaton_drafts = reference_automaton_drafts
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


def reference_merge(root_token, drafts, *, max_nodes, max_depth, calibration) -> TokenTree:
    return TokenTree(**reference_tree.merge_drafts(root_token, drafts, max_nodes=max_nodes, max_depth=max_depth,
                                                   calibration=calibration.calibration()))


def reference_paths() -> Paths:
    return Paths("reference", reference_lookups, reference_budget.AcceptanceCalibrator, reference_merge,
                 lambda tree, n: TokenTree(**reference_tree.prune(tree, n)), reference_model.tree_inputs,
                 reference_sampling.accept, slot_cache=False, top_tokens=reference_request.top_tokens,
                 choose=lambda tree, cost, overhead_s, max_nodes, scale=1.0: reference_budget.choose_num_nodes(
                     tree.expected_in_prune_order(), cost, overhead_s, max_nodes, scale))


def native_inputs(tree, n_cached, **_) -> torch.Tensor:
    """The compiled decoder's inputs (``TargetModel._verify_native``): the nodes' positions; its
    mask is made inside the call, from the parents, and counts as the forward's."""
    return torch.from_numpy(np.asarray(tree.depth, dtype=np.int64) + n_cached)


def fast_paths() -> Paths:
    # as TargetModel.verify: trees the compiled decoder takes need their positions only
    inputs = native_inputs if NATIVE else functools.partial(tree_inputs, buffers=InputBuffers())
    return Paths("fast", contextlib.nullcontext, AcceptanceCalibrator, TokenTree.from_drafts, TokenTree.prune, inputs,
                 accept, slot_cache=True, top_tokens=top_tokens, choose=choose_tree_nodes,
                 partial=True, picked=True, fused=True)


@dataclass
class Mode:
    """One set of paths with its own proposers and calibrator (state kept across records)."""

    paths: Paths
    mixture: Mixture
    calibrator: AcceptanceCalibrator  # (or its reference)
    cost: CostModel = field(default_factory=lambda: CostModel(COST_SIZES, COST_SECONDS))  # the engine's curve, observed
    times: dict = field(default_factory=lambda: {p: [] for p in PHASES})  # phase -> [ns per step], wall clock
    cpu_times: dict = field(default_factory=lambda: {p: [] for p in PHASES})  # ... this thread's CPU time
    nodes: list = field(default_factory=list)  # draft nodes verified per step
    chosen: list = field(default_factory=list)  # nodes the chooser would keep
    digest: "hashlib._Hash" = field(default_factory=hashlib.sha256)  # trees and accepted nodes

    @classmethod
    def make(cls, paths: Paths) -> "Mode":
        with paths.lookups():  # (the recycling table is made here)
            proposers = build_proposers(EngineConfig())
        return cls(paths, Mixture(proposers), paths.calibrator())


class KVBuffer:
    """The reference: a transformers ``DynamicCache`` (``new_cache()``), whose layers are, before
    each step's commit, views of [0, ctx+1+n) slots of one preallocated buffer, as after a verify
    forward (a real forward concatenates the whole cache per layer: too slow to replay here)."""

    def __init__(self, capacity: int) -> None:
        self.buffer = torch.zeros(LAYERS, 2, 1, KV_HEADS, capacity, HEAD_DIM, dtype=DTYPE)
        self.cache = new_cache()
        for layer in range(LAYERS):
            one = torch.zeros(1, KV_HEADS, 1, HEAD_DIM, dtype=DTYPE)
            self.cache.update(one, one, layer)

    def start(self, prefix: int) -> None:
        pass

    def after_forward(self, slots: int):
        for i, layer in enumerate(self.cache.layers):
            layer.keys = self.buffer[i, 0, :, :, :slots]
            layer.values = self.buffer[i, 1, :, :, :slots]
        return self.cache


class SlotKV:
    """The engine's cache (``new_cache(num_layers)``, a ``SlotCache``): filled per step by the
    ``update`` calls a verify forward makes (untimed)."""

    def __init__(self) -> None:
        self.cache = None
        self._new = torch.zeros(1, KV_HEADS, 1 + MAX_NODES, HEAD_DIM, dtype=DTYPE)

    def start(self, prefix: int) -> None:
        self.cache = new_cache(LAYERS)
        prompt = torch.zeros(1, KV_HEADS, prefix, HEAD_DIM, dtype=DTYPE)
        for layer in range(LAYERS):
            self.cache.update(prompt, prompt, layer)

    def after_forward(self, slots: int):
        new = self._new[:, :, : slots - self.cache.get_seq_length()]
        for layer in range(LAYERS):
            self.cache.update(new, new, layer)
        return self.cache


class WalkLogits:
    """Random logits [1+MAX_NODES, VOCAB] made once; per step the rows along the recorded walk
    get the recorded token as their argmax, and are restored afterwards."""

    def __init__(self, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.logits = torch.randn(1 + MAX_NODES, VOCAB, generator=generator, dtype=DTYPE)
        self.top = float(self.logits.max()) + 1.0
        self._saved: list[tuple[int, int, float]] = []

    def set_walk(self, tree: TokenTree, rest: list[int]) -> torch.Tensor:
        path = accepted_path(tree, rest)
        for row, node in enumerate([0, *path]):
            if row < len(rest):
                token = rest[row]
                self._saved.append((node, token, float(self.logits[node, token])))
                self.logits[node, token] = self.top
        return self.logits[: len(tree)]

    def restore(self) -> None:
        for node, token, value in reversed(self._saved):
            self.logits[node, token] = value
        self._saved.clear()


def _now() -> tuple[int, int]:
    """(wall clock, this thread's CPU time) in ns: on a shared machine the second leaves out the
    time other processes held the core (cache sharing still counts)."""
    return time.perf_counter_ns(), time.thread_time_ns()


def run_record(mode: Mode, rid: str, prompt: list[int], response: list[int], kv: KVBuffer, walk: WalkLogits,
               timed: bool, max_steps: int) -> None:
    """One record through ``mode``'s paths, step by step as ``StepCore.run`` orders them."""
    with mode.paths.lookups():  # (the request's n-gram index is made here, its drafts run)
        run_steps(mode, rid, prompt, response, kv, walk, timed, max_steps)


def run_steps(mode: Mode, rid: str, prompt: list[int], response: list[int], kv: KVBuffer, walk: WalkLogits,
              timed: bool, max_steps: int) -> None:
    """``run_record``'s steps, in its paths' lookups context."""
    mixture, calibrator, paths, greedy = mode.mixture, mode.calibrator, mode.paths, SamplingParams()
    cost = mode.cost
    context = list(prompt)
    mixture.start(rid, context)
    kv.start(len(context) - 1)
    steps = 0
    try:
        while len(context) - len(prompt) < len(response) and steps < max_steps:
            rest = response[len(context) - len(prompt):]
            n_cached = len(context) - 1
            marks = [_now()]
            planned = mixture.plan(rid, context, MAX_NODES, MAX_DEPTH, calibrator) if paths.fused else None
            if planned is not None:  # as StepCore.plan: propose and merge in one call, timed as propose
                tree, drafts = planned
                marks.append(_now())
                marks.append(marks[-1])
            else:
                drafts = mixture.propose(rid, context, MAX_NODES)
                marks.append(_now())
                tree = paths.merge(context[-1], drafts, max_nodes=MAX_NODES, max_depth=MAX_DEPTH,
                                   calibration=calibrator)  # as StepCore.plan
                marks.append(_now())
            chosen = paths.choose(tree, cost, 0.0, MAX_NODES, 1.0)
            paths.prune(tree, chosen)
            marks.append(_now())
            paths.inputs(tree, n_cached, device="cpu", dtype=DTYPE, windows={}, tree_mode=True)
            marks.append(_now())
            logits = walk.set_walk(tree, rest)  # what the forward would return (untimed)
            forward_s = float(cost.dense(len(tree), padded=False)[len(tree)])  # its time: the curve's own estimate
            cache = kv.after_forward(n_cached + len(tree))
            verified = logits
            if paths.partial:  # the engine's forward projects the likely nodes' rows, its last writes (untimed)
                rows = head_rows(range(len(tree)), tree.expected)
                projected = logits[rows].clone()
                picks = max(RECYCLE_SUCCESSORS if mixture.successor_sinks else 0, 1)
                tops = (np.asarray(paths.top_tokens(projected, range(len(rows)), picks), dtype=np.int32)
                        if paths.picked else None)  # the skinny product picks them as it writes the rows
                verified = PartialLogits(tree, rows, projected, torch.arange(len(tree)),
                                         lambda nodes: (logits[nodes].clone(), 0.0), tops=tops)
            marks.append(_now())
            # the engine's accept(top_k=...) reads each visited row once for the argmax and the
            # recycling table's top tokens; the reference takes them apart (reference.request.top_tokens)
            fused = RECYCLE_SUCCESSORS if mixture.successor_sinks and paths.name == "fast" else 0
            result = (paths.accept(tree, verified, greedy, top_k=fused) if fused
                      else paths.accept(tree, verified, greedy))
            projected_ns = int(verified.extra_s * 1e9) if paths.partial else 0  # rows the walk asked for: the forward's
            path = (result.tokens if result.tokens is not None  # as RequestCore.accept
                    else tree.tokens_of([0, *result.accepted]))
            new_tokens = (path[1:] + [result.next_token])[: len(rest)]
            accepted = result.accepted[: len(new_tokens)]
            marks.append(_now())
            successors = None
            if mixture.successor_sinks:  # as RequestCore.accept
                visited = [0, *result.accepted]
                tops = result.tops if result.tops is not None else paths.top_tokens(logits, visited,
                                                                                     RECYCLE_SUCCESSORS)
                successors = (context[-2] if len(context) > 1 else -1, path, tops)
                if not paths.fused:  # the reference hands them over apart
                    mixture.observe_path(*successors)
            marks.append(_now())
            commit_accepted(cache, n_cached, accepted)
            cost.observe(len(tree), forward_s)  # as Engine._verdict does after every verify forward
            marks.append(_now())
            if paths.fused:  # as StepCore.finish: the hand-off, observe and learn in one call
                mixture.finish(rid, new_tokens, successors, drafts, calibrator)
                marks.append(_now())
            else:
                mixture.observe(rid, new_tokens)
                marks.append(_now())
                calibrator.learn(drafts, new_tokens)
            marks.append(_now())
            walk.restore()
            if new_tokens != rest[: len(new_tokens)]:
                raise AssertionError(f"{rid}: greedy acceptance left the recorded response")
            context.extend(new_tokens)
            steps += 1
            mode.digest.update(repr((tree.token_ids, tree.parents, accepted, chosen)).encode())
            if timed:
                spans = [(0, 1), (1, 2), (2, 3), (3, 4), (5, 6), (6, 7), (7, 8), (8, 9), (9, 10)]  # 4 -> 5: untimed
                for phase, (a, b) in zip(PHASES, spans):
                    untimed = projected_ns if phase == "accept" else 0
                    mode.times[phase].append(marks[b][0] - marks[a][0] - untimed)
                    mode.cpu_times[phase].append(marks[b][1] - marks[a][1] - untimed)
                mode.nodes.append(tree.num_draft_nodes)
                mode.chosen.append(chosen)
    finally:
        mixture.stop(rid)


def kv_writes(context: int, rounds: int) -> dict:
    """Inside the verify forward, not in the step's totals: the K/V writes of one forward of
    1 + ``MAX_NODES`` tokens into the engine's cache (``SlotStore.write``, every layer's views
    made at once) against indexing the buffer per layer (``reference.model.write``), both
    after a ``context``-token prefix, in turn, µs per forward (median of ``rounds``, CPU time;
    back to back, so warm, unlike the step's phases)."""
    from lookupdec.model.cache import SlotStore

    # (laid out as a Llama attention's: projected [1, tokens, heads, dim], then transposed)
    new = torch.randn(1, 1 + MAX_NODES, KV_HEADS, HEAD_DIM, dtype=DTYPE).transpose(1, 2)
    prefix = torch.zeros(1, KV_HEADS, context, HEAD_DIM, dtype=DTYPE)
    out = {}
    stores = {"write": SlotStore(LAYERS), "write_reference": SlotStore(LAYERS)}  # (the results' keys)
    for name, store in stores.items():
        for layer in range(LAYERS):
            reference_model.write(store, layer, prefix, prefix)
        out[name] = []
    for _ in range(rounds):
        for name, store in stores.items():
            write = store.write if name == "write" else functools.partial(reference_model.write, store)
            t = time.thread_time_ns()
            for layer in range(LAYERS):
                write(layer, new, new)
            out[name].append(time.thread_time_ns() - t)
            store.crop(context)
    return {name: float(np.median(ns)) / 1e3 for name, ns in out.items()}


def summarize(mode: Mode) -> dict:
    nodes = np.array(mode.nodes)
    full = nodes >= FULL_TREE
    out = {"paths": mode.paths.name, "steps": int(len(nodes)), "mean_nodes": float(nodes.mean()),
           "steps_at_64": int(full.sum()), "mean_nodes_at_64": float(nodes[full].mean()) if full.any() else None,
           "node_histogram": {f"{lo}-{hi}" if lo != hi else str(lo): int(((nodes >= lo) & (nodes <= hi)).sum())
                              for lo, hi in NODE_BINS},
           "mean_chosen": float(np.mean(mode.chosen))}
    for clock, times in (("wall", mode.times), ("cpu", mode.cpu_times)):
        out[f"{clock}_us"] = _phases(times, np.ones(len(nodes), bool))
        out[f"{clock}_us_at_64"] = _phases(times, full) if full.any() else {}
    return out


def _phases(times: dict, rows: np.ndarray) -> dict:
    """Mean and median µs per phase over the steps in ``rows``, and of their total."""
    out, total = {}, np.zeros(int(rows.sum()))
    for phase in PHASES:
        us = np.array(times[phase])[rows] / 1e3
        total += us
        out[phase] = {"mean": float(us.mean()), "median": float(np.median(us))}
    out["total"] = {"mean": float(total.mean()), "median": float(np.median(total)), "p90": float(np.percentile(total, 90))}
    return out


def table(summaries: list[dict], key: str) -> str:
    rows = []
    for phase in (*PHASES, "total"):
        row = {"phase": phase}
        for s in summaries:
            got = s[key].get(phase)
            row[f"{s['paths']}_mean"] = got["mean"] if got else None
            row[f"{s['paths']}_median"] = got["median"] if got else None
        rows.append(row)
    columns = [("phase", "phase", "")]
    for s in summaries:
        columns += [(f"{s['paths']}_mean", f"{s['paths']} mean", ".1f"),
                    (f"{s['paths']}_median", f"{s['paths']} median", ".1f")]
    return format_table(rows, columns)


def load_records(spec: str, data: str, tokenizer) -> list[tuple[str, str, list[int], list[int]]]:
    """(workload, id, prompt ids, response ids) for ``workload:count,...``, in that order."""
    out = []
    for item in spec.split(","):
        workload, _, count = item.partition(":")
        records = list(WORKLOADS[workload](data))[: int(count or 1)]
        for i, record in enumerate(records):
            rid, prompt, response = tokenize_record(record, tokenizer, i)
            if response:
                out.append((workload, rid, prompt, response))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", default=DEFAULT_RECORDS,
                    help="workload:count,... replayed in order; the first record of each workload warms up (untimed)")
    ap.add_argument("--data", default=str(SHARED_DIR / "data"), help="shared data folder")
    ap.add_argument("--tokenizer", default=str(SHARED_DIR / "data/tokenizers/llama2/tokenizer.model"))
    ap.add_argument("--max-steps", type=int, default=120, help="steps per record at most")
    ap.add_argument("--paths", default="reference,fast", help="which sets of paths to time")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the engine's default on this machine: 1-2)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="replay the records this many times, each time with fresh proposers and calibrator: "
                         "the tables and JSON summaries are the first replay's; every replay's median total at "
                         "64 nodes is reported too (this machine moves by several per cent between runs)")
    ap.add_argument("--out", default=str(RESULTS_DIR / "overhead.json"))
    args = ap.parse_args(argv)
    if args.repeat < 1:
        ap.error(f"--repeat must be >= 1, got {args.repeat}")
    if not os.path.isdir(args.data):
        print(f"skipped: shared data not found at {args.data}")
        return 0
    torch.set_num_threads(args.threads)
    meta = run_metadata(threads_set_by_benchmark=True)
    tokenizer = load_tokenizer(args.tokenizer)
    records = load_records(args.records, args.data, tokenizer)
    factories = {"reference": reference_paths, "fast": fast_paths}
    kv = KVBuffer(max(len(p) + len(r) for _, _, p, r in records) + 2 + MAX_NODES)
    slot_kv = SlotKV()
    walk = WalkLogits()
    start = time.perf_counter()
    runs, digests = [], set()  # the modes of every repetition; every mode's trees and accepted nodes
    for _ in range(args.repeat):
        modes = [Mode.make(factories[name]()) for name in args.paths.split(",")]
        seen: set = set()
        with torch.inference_mode():
            for workload, rid, prompt, response in records:
                timed = workload in seen
                seen.add(workload)
                for mode in modes:  # record by record in turn: load on this shared machine hits both alike
                    gc.collect()
                    run_record(mode, rid, prompt, response, slot_kv if mode.paths.slot_cache else kv, walk,
                               timed, args.max_steps)
        runs.append(modes)
        digests |= {mode.digest.hexdigest() for mode in modes}
    seconds = time.perf_counter() - start
    modes = runs[0]
    summaries = [summarize(mode) for mode in modes]
    repeats = None  # per paths, each replay's median total at 64 nodes (None: no step reached 64 nodes)
    if args.repeat > 1:
        repeats = {s["paths"]: [s["cpu_us_at_64"].get("total", {}).get("median")]
                   + [summarize(m)["cpu_us_at_64"].get("total", {}).get("median") for m in later]
                   for s, later in zip(summaries, zip(*runs[1:]))}
    identical = len(digests) == 1
    for s in summaries:
        print(f"{s['paths']}: {s['steps']} timed steps, mean {s['mean_nodes']:.1f} draft nodes, "
              f"{s['steps_at_64']} steps with >= {FULL_TREE} (mean {s['mean_nodes_at_64'] or 0:.1f}); "
              f"nodes histogram {s['node_histogram']}; chooser would keep {s['mean_chosen']:.1f} on average")
    for clock, what in (("wall", "wall clock"), ("cpu", "this thread's CPU time")):
        print(f"\nµs per step ({what}), steps with >= {FULL_TREE} draft nodes:")
        print(table(summaries, f"{clock}_us_at_64"))
    print("\nµs per step (wall clock), all timed steps:")
    print(table(summaries, "wall_us"))
    if repeats:
        print(f"\nmedian total µs per step (CPU time, >= {FULL_TREE} nodes), each of {args.repeat} replays:")
        for name, totals in repeats.items():
            got = [t for t in totals if t is not None]
            print(f"  {name}: {', '.join('-' if t is None else f'{t:.1f}' for t in totals)}  "
                  f"(median {float(np.median(got)) if got else float('nan'):.1f})")
    print(f"\ntrees and accepted nodes identical across paths{' and replays' if repeats else ''}: {identical}  "
          f"({seconds:.0f} s)")
    context = int(np.median([len(p) + len(r) // 2 for _, _, p, r in records]))
    writes = kv_writes(context, KV_WRITE_ROUNDS)
    print(f"inside the forward (not in the totals): the K/V writes of one verify forward of {1 + MAX_NODES} tokens "
          f"after {context}: {writes['write']:.0f} µs (per layer by indexing: {writes['write_reference']:.0f})")
    config = {**vars(args), "max_nodes": MAX_NODES, "max_depth": MAX_DEPTH, "full_tree": FULL_TREE,
              "kv_cache": f"{LAYERS} layers x [1, {KV_HEADS}, ctx+1+n, {HEAD_DIM}] {DTYPE}",
              "logits": f"[1+n, {VOCAB}] {DTYPE}", "cost_model": {"sizes": COST_SIZES, "seconds": COST_SECONDS}}
    path = write_result(args.out, "overhead", config, summaries, meta=meta, threads_set_by_benchmark=True,
                        identical_across_paths=identical, seconds=seconds,
                        repeat_totals_cpu_us_at_64=repeats,
                        forward_kv_writes_cpu_us={"context": context, "rounds": KV_WRITE_ROUNDS, **writes})
    print(f"wrote {path}")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
