"""Replay recorded (prompt, response) pairs through the proposers, with no model.

Each step is the engine's own (``step.StepCore.run``: the same propose, merge, choose, observe
and learn); only the verdict differs: the step accepts the longest tree path that matches the
recorded response, plus one bonus token. For greedy decoding this is exactly what the real model
would accept, since its output is the recorded response. As served, a response's first token
is the prefill's (``StepCore.first``), in no step; MAT is the other tokens per step. Requests
are replayed in order with the proposers kept across them, so caches learn as in serving.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

from lookupdec.budget import AcceptanceCalibrator, DraftBudget
from lookupdec.mixture import Mixture
from lookupdec.proposers import Proposer
from lookupdec.step import StepCore, Verdict
from lookupdec.tree import TokenTree
from lookupdec.workloads import JsonlRecord, read_jsonl  # noqa: F401  (the records reader, also this module's)

log = logging.getLogger("lookupdec")


@dataclass
class RecordResult:
    id: str
    prompt_tokens: int
    response_tokens: int
    steps: int
    tree_nodes: int  # summed over steps
    accepted_by_source: dict = field(default_factory=dict)
    nodes_per_step: list = field(default_factory=list)  # draft nodes verified at each step
    modeled_seconds: float = 0.0  # sum over steps of t(1 + nodes) when a cost model is given
    predicted: float = 0.0  # summed over steps: accepted draft tokens the calibrated trees promised
    accepted: int = 0  # summed over steps: draft tokens accepted
    prefill_tokens: int = 0  # the response's first token: the prefill's, in no step (``StepCore.first``)

    @property
    def mat(self) -> float:
        return (self.response_tokens - self.prefill_tokens) / self.steps if self.steps else 0.0


def _where(record, index: int) -> str:
    where = getattr(record, "where", "")
    return where or f"record {record.get('id', index) if isinstance(record, dict) else index}"


def tokenize_record(record: dict, tokenizer, index: int) -> tuple[str, list[int], list[int]]:
    """(id, prompt ids, response ids); a bad record is a ValueError naming ``FILE:LINE`` (records
    from ``read_jsonl``) or ``record ID``."""
    where = _where(record, index)
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, found {type(record).__name__}")
    rid = str(record.get("id", where if getattr(record, "where", "") else index))
    if "prompt_ids" in record or "response_ids" in record:
        prompt, response = (_token_ids(record, key, where) for key in ("prompt_ids", "response_ids"))
    else:
        for key in ("prompt", "response"):
            if not isinstance(record.get(key), str):
                raise ValueError(f"{where}: field {key!r} must be a string (or give prompt_ids/response_ids)")
        if tokenizer is None:
            raise ValueError(f"{where}: text records need a tokenizer")
        prompt = list(tokenizer.encode(record["prompt"]))
        response = list(tokenizer.encode(record["response"], add_special_tokens=False))
    if not prompt:
        raise ValueError(f"{where}: empty prompt")
    return rid, prompt, response


def _token_ids(record: dict, key: str, where: str) -> list[int]:
    value = record.get(key)
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**31
                                              for t in value):
        raise ValueError(f"{where}: field {key!r} must be a list of token ids (integers >= 0)")
    return value


def accepted_path(tree: TokenTree, target: Sequence[int]) -> list[int]:
    """Nodes of the longest root path whose tokens equal ``target``'s first tokens."""
    path, node = [], 0
    for token in target:
        node = tree.children[node].get(token)
        if node is None:
            break
        path.append(node)
    return path


def replay_one(rid: str, prompt: list[int], response: list[int], proposers: Sequence[Proposer], *,
               max_nodes: int, max_depth: int, draft_seconds: list,
               calibrator: AcceptanceCalibrator | None = None, cost=None, choose: bool = False,
               draft_budget: DraftBudget | None = None) -> RecordResult:
    """One record; ``calibrator`` scales each source's scores as the engine does (and learns).

    ``cost`` (a ``budget.CostModel``): adds up the modelled verify time ``t(1 + nodes)`` of every
    step; with ``choose=True`` each step also keeps only the number of nodes that maximises
    expected tokens per second under that cost, as the engine's ``budget="auto"`` does (per-step
    overhead taken as 0), asking the proposers for ``draft_budget.nodes(max_nodes)`` nodes."""
    core = StepCore(Mixture(proposers), max_nodes=max_nodes, calibrator=calibrator, draft_budget=draft_budget)
    choose_with = cost if choose else None
    result = RecordResult(rid, len(prompt), len(response), 0, 0)
    context = list(prompt)
    core.start(rid, context)
    try:
        if response:  # the first token: the prefill's, in no step (``RequestCore.first``)
            core.first(rid, response[:1])
            context.append(response[0])
            result.prefill_tokens = 1
        while len(context) - len(prompt) < len(response):
            rest = response[len(context) - len(prompt):]
            step = core.run(rid, context, lambda tree: recorded_verdict(tree, rest), max_depth=max_depth,
                            cost=choose_with)
            draft_seconds.append(step.propose_s + step.tree_s)
            result.nodes_per_step.append(step.tree.num_draft_nodes)
            if cost is not None:  # a tree of exactly 1 + n tokens (not padded to a cheaper size)
                n = 1 + step.tree.num_draft_nodes
                result.modeled_seconds += float(cost.dense(n, padded=False)[n])
            step.count_sources(result.accepted_by_source)
            result.predicted += step.predicted
            result.accepted += len(step.accepted)
            context.extend(step.new_tokens)
            result.steps += 1
            result.tree_nodes += step.tree.num_draft_nodes
    finally:
        core.stop(rid)
    return result


def recorded_verdict(tree: TokenTree, rest: Sequence[int]) -> Verdict:
    """The greedy target's verdict when its output is ``rest``: the longest matching path, then
    the next recorded token as the bonus (none once ``rest`` is used up)."""
    path = accepted_path(tree, rest)
    return Verdict(path, list(rest[: len(path) + 1]))


def replay(records: Iterable[dict], tokenizer, proposers: Sequence[Proposer], *, max_nodes: int,
           max_depth: int, progress: bool = False, cost=None, choose: bool = False) -> dict:
    """Replay every record; returns the summary and per-record figures (JSON-ready). With
    ``cost``, also the modelled speedup over plain decoding (``replay_one``)."""
    from tqdm import tqdm

    results, draft_seconds, calibrator, draft_budget = [], [], AcceptanceCalibrator(), DraftBudget()
    records = list(records)
    skipped = []
    for i, record in enumerate(tqdm(records, disable=not progress, desc="replay", unit="rec")):
        rid, prompt, response = tokenize_record(record, tokenizer, i)
        if not response:  # nothing to replay: said, not dropped silently
            skipped.append(_where(record, i))
            log.warning("%s: empty response: nothing to replay, record skipped", skipped[-1])
        else:
            results.append(replay_one(rid, prompt, response, proposers, max_nodes=max_nodes,
                                      max_depth=max_depth, draft_seconds=draft_seconds,
                                      calibrator=calibrator, cost=cost, choose=choose,
                                      draft_budget=draft_budget))
    # "budget": the CLI's --budget, the node budget of every step
    summary = summarize(results, draft_seconds, budget=max_nodes, max_depth=max_depth,
                        proposers=[p.name for p in proposers])
    summary["skipped_empty_responses"] = skipped
    queries = [s for p in proposers for s in getattr(p, "query_seconds", [])]
    if queries:
        ms = np.array(queries) * 1e3
        summary["retrieval_queries"] = len(queries)
        summary["retrieval_ms_p50"] = float(np.percentile(ms, 50))
        summary["retrieval_ms_p99"] = float(np.percentile(ms, 99))
    return summary


def summarize(results: list[RecordResult], draft_seconds: list, **settings) -> dict:
    tokens = sum(r.response_tokens for r in results)
    stepped = tokens - sum(r.prefill_tokens for r in results)  # the steps' tokens (each first one the prefill's)
    steps = sum(r.steps for r in results)
    by_source: dict[str, int] = {}
    for r in results:
        for s, n in r.accepted_by_source.items():
            by_source[s] = by_source.get(s, 0) + n
    accepted = sum(by_source.values())
    us = np.array(draft_seconds) * 1e6 if draft_seconds else np.zeros(1)
    modeled = sum(r.modeled_seconds for r in results)
    extra = {}
    if modeled > 0:
        extra["modeled_seconds"] = modeled
        extra["nodes_histogram"] = {int(k): int(v) for k, v in zip(*np.unique(
            [n for r in results for n in r.nodes_per_step], return_counts=True))}
    return {
        **extra,
        **settings,
        "records": len(results),
        "response_tokens": tokens,
        "steps": steps,
        "mat": stepped / steps if steps else 0.0,  # tokens per step
        "mean_tree_nodes": sum(r.tree_nodes for r in results) / steps if steps else 0.0,
        # calibration: accepted draft tokens per step the trees promised, and those accepted
        "predicted_accepted": sum(r.predicted for r in results) / steps if steps else 0.0,
        "realised_accepted": sum(r.accepted for r in results) / steps if steps else 0.0,
        "draft_us_p50": float(np.percentile(us, 50)),
        "draft_us_p99": float(np.percentile(us, 99)),
        "accepted_share_by_source": {s: n / accepted for s, n in by_source.items()} if accepted else {},
        "per_record": [{"id": r.id, "prompt_tokens": r.prompt_tokens, "response_tokens": r.response_tokens,
                        "steps": r.steps, "mat": round(r.mat, 4)} for r in results],
    }
