"""End to end on a real model: SmolLM2-135M-Instruct (float32; CPU, or a GPU with ``--device cuda``) against ``transformers``.

The methods decode the same prompts, greedy, side by side, in an order rotated per prompt:

* ``plain``     -- the same engine with no drafts, ``EngineConfig(proposers=())``: the same kernels,
  prefix cache and step, one token per forward. The figure this benchmark leads with is
  lookupdec over ``plain`` (what the lookups add, as Spec-Bench reports), per request (prefill
  included) and for the decode phase alone (from the first generated token on). This machine's
  speed drifts by 5-10% within minutes, which one run of each side reads as a speedup or a loss,
  so by default (``--measure interleaved``) the engines' requests for a prompt (plain,
  lookupdec, the other engine methods asked for) run in lockstep on one thread: the request
  that has taken the least time so far takes its next step, so all of them run over the same
  seconds and drift reaches each alike; a request's time is the sum of its own steps' (its
  stream's ``next`` calls, prefill included). ``--twin`` adds a second plain engine to the
  lockstep (``plain_twin``): plain over its twin per prompt is the measurement's own spread.
  ``--measure bracketed``: one request at a time, plain right before and right after lookupdec
  (``plain_after``), a prompt's plain time the two runs' mean.
* ``greedy``    -- ``transformers``' ``model.generate(do_sample=False)``: its eager forward, so
  lookupdec over it mixes the engine's faster kernels with what the lookups add
* ``pld``       -- ``model.generate(do_sample=False, prompt_lookup_num_tokens=10)``
* ``lookupdec`` -- ``Engine(model, tokenizer, EngineConfig()).generate(...)``, the default
  configuration, one engine per thread setting kept across prompts as a server keeps it
* ``fixedN``    -- the same with ``EngineConfig(budget="fixed", max_nodes=N)`` (``--fixed``, at
  ``--fixed-threads``): how far the default's per-step choice is from the best fixed budget
* ``all-logits`` -- the default with ``EngineConfig(partial_logits=False)`` (``--all-logits``):
  the verify forward projects every node's hidden state, not only the likely ones
* ``no-prefix-cache`` -- the default with ``EngineConfig(prefix_cache=False)``
  (``--no-prefix-cache``): every prompt prefilled whole, as ``transformers`` does; the
  default keeps what a prompt shares with the one before (its chat template, an instruction)

Workloads, every prompt in the model's chat template: the six Spec-Bench categories (first turn
of multi-turn chat, translation, CNN/DM summarization, QA, GSM8K math, RAG), real code edits
("apply this change, output the whole file", TheAlgorithms history) and log lines to JSON
(loghub). Outputs must be identical to greedy's; mismatches are counted, never hidden. Also the
verify cost curve t(n)/t(1) of the model at a 512-token context.

    python bench/real_model.py                      # 10 prompts/workload, 128 tokens, 1 and 2 threads
    python bench/real_model.py --prompts 2 --max-new-tokens 32 --threads 1   # a quick look
    python bench/real_model.py --device cuda --threads 1 --out bench/results/real_model_h100.json

Each run learns its cost curves afresh (a cost cache of its own, ``LOOKUPDEC_COST_CACHE``), so
no run starts from what an earlier one left. Writes ``bench/results/real_model.json`` and
``.png`` (``--out``). Timings on a shared machine are noisy: read the ratios (measured side by
side), not absolute tokens/s across runs.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR, SHARED_DIR, add_device_option, format_table, load_average, run_metadata, write_result  # noqa: E402
from e2e import first_divergence, run_method  # noqa: E402
from lookupdec.validate import ParamError  # noqa: E402

SPEC_BENCH = SHARED_DIR / "data" / "spec_bench" / "question.jsonl"
CODE_EDITS = SHARED_DIR / "data" / "code_edits" / "thealgorithms_python.jsonl"
LOGHUB = SHARED_DIR / "data" / "loghub"
# Spec-Bench's multi-turn chat is its first 80 questions: MT-Bench's eight categories.
MT_BENCH = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
SPEC_CATEGORIES = {"chat": MT_BENCH, "translation": ("translation",), "summarization": ("summarization",),
                   "qa": ("qa",), "math": ("math_reasoning",), "rag": ("rag",)}
LOG_SYSTEMS = ("Apache", "BGL", "HDFS", "Hadoop", "Linux", "OpenSSH", "Spark", "Zookeeper")
LOG_LINES_PER_PROMPT = 4
LOG_INSTRUCTION = ("Rewrite each log line below as one JSON object per line, with the keys "
                   "\"timestamp\", \"level\", \"component\" and \"message\". Output only the JSON lines.")
EDIT_INSTRUCTION = "Apply this change to the file and output the whole updated file, nothing else."
WARMUP = "Say hello in three languages."
COST_CONTEXT = 512
COST_SIZES_MAX = 128
COST_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128)


def read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def build_workloads(engine, n: int, max_prompt: int) -> dict[str, list[list[int]]]:
    """Prompt token ids per workload: the first ``n`` usable items of each source, in order."""
    def take(messages_iter) -> list[list[int]]:
        out = []
        for text in messages_iter:
            try:
                ids = engine.chat_prompt(text)
            except ParamError:  # longer than the model's context
                continue
            if len(ids) <= max_prompt:
                out.append(ids)
            if len(out) == n:
                break
        return out

    workloads = {}
    questions = read_jsonl(SPEC_BENCH)
    for name, categories in SPEC_CATEGORIES.items():
        # chat: one question from each MT-Bench category in turn, not the first n writing tasks
        pool = [q for q in questions if q["category"] in categories]
        workloads[name] = take(q["turns"][0] for q in _interleave(pool))
    edits = read_jsonl(CODE_EDITS)
    workloads["code_edit"] = take(f"{EDIT_INSTRUCTION}\n\nChange: {e['message']}\n\n```diff\n{e['diff']}```\n\n"
                                  f"File {e['path']}:\n\n```python\n{e['before']}```" for e in edits)

    def log_prompts():  # the first lines of each system's log, then the next lines, ...
        logs = {}
        for system in LOG_SYSTEMS:
            with open(LOGHUB / f"{system}_2k.log", encoding="utf-8", errors="replace") as f:
                logs[system] = [line.rstrip("\n") for line in f]
        for start in range(0, 2000, LOG_LINES_PER_PROMPT * 25):
            for system in LOG_SYSTEMS:
                lines = logs[system][start : start + LOG_LINES_PER_PROMPT]
                if len(lines) == LOG_LINES_PER_PROMPT:
                    yield LOG_INSTRUCTION + "\n\n" + "\n".join(lines)

    workloads["log_to_json"] = take(log_prompts())
    empty = [name for name, prompts in workloads.items() if not prompts]
    if empty:
        raise SystemExit(f"no prompts for {empty}: check {SHARED_DIR / 'data'} and --max-prompt-tokens")
    return workloads


def _interleave(questions: list[dict]) -> list[dict]:
    """Round-robin over categories, each in file order."""
    by_category: dict[str, list[dict]] = {}
    for q in questions:
        by_category.setdefault(q["category"], []).append(q)
    out, queues = [], list(by_category.values())
    while any(queues):
        for queue in queues:
            if queue:
                out.append(queue.pop(0))
    return out


def cost_curve(engine) -> dict:
    """Verify cost t(n) of an n-token chain after a COST_CONTEXT-token prefix (fastest of rounds;
    one token as a greedy step verifies the root alone, as the engine's curves time it)."""
    from lookupdec.budget import CostModel

    for n in COST_SIZES:
        engine.target.prepare(n)  # kernel choices first (model/kernels.py), outside the timing
    timer = engine.target.chain_forward_timer(COST_CONTEXT, root_picks=engine.request_core.picks())
    try:
        cost = CostModel.measure(timer, max_tokens=COST_SIZES_MAX, sizes=COST_SIZES)
    finally:
        engine.target.reset()
    return {"context": COST_CONTEXT, "sizes": cost.sizes, "seconds": cost.seconds,
            "relative": [round(t / cost.seconds[0], 3) for t in cost.seconds]}


def ld_run(engine, prompt, max_new) -> tuple[list[int], dict]:
    """One request through ``engine``: its tokens and figures (``decode_s``: from the first
    generated token on, the request's time less its prefill)."""
    gc.collect()
    start = time.perf_counter()
    gen = engine.generate(prompt, max_new_tokens=max_new)
    return ld_record(gen, time.perf_counter() - start)


def lockstep(engines: dict, prompt, max_new) -> dict[str, tuple[list[int], dict]]:
    """One request for ``prompt`` through each of ``engines`` (name -> engine), stepped in
    lockstep on this thread: the request that has taken the least time so far takes its next
    step (its stream's next piece of text), so the requests run over the same seconds and the
    machine's drift reaches each alike. A request's time is the sum of its own calls (the
    stream's creation, which checks the request, and every ``next``). Each engine runs one
    request at a time (``Engine.turn``): these are several engines, so they may interleave."""
    gc.collect()
    spent, pieces, streams = {}, {}, {}
    for name, engine in engines.items():
        t = time.perf_counter()
        streams[name] = engine.stream(prompt, max_new_tokens=max_new)
        pieces[name] = iter(streams[name])
        spent[name] = time.perf_counter() - t
    live = list(engines)
    while live:
        name = min(live, key=spent.__getitem__)
        t = time.perf_counter()
        try:
            next(pieces[name])
        except StopIteration:
            live.remove(name)
        spent[name] += time.perf_counter() - t
    return {name: ld_record(streams[name].generation, spent[name]) for name in engines}


def ld_record(gen, seconds: float) -> tuple[list[int], dict]:
    s = gen.stats
    return list(gen.token_ids), {
        "seconds": seconds, "decode_s": seconds - s.prefill_ms / 1e3, "steps": s.steps, "mean_accepted": s.mean_accepted, "overhead_us": s.overhead_us,
        "draft_us": s.draft_us, "forward_ms": s.forward_ms, "prefill_ms": s.prefill_ms,
        "mean_tree_nodes": s.mean_tree_nodes, "predicted_accepted": s.predicted_accepted,
        "realised_accepted": s.realised_accepted, "accepted_by_source": dict(s.accepted_by_source),
        "logit_rows": s.logit_rows, "logit_misses": s.logit_misses, "prefix_reused": s.prefix_reused,
        "prefill_tokens": s.prefill_tokens}


def run_order(methods: list[str], k: int, bracket: bool, together: Sequence[str] = ()) -> list:
    """The methods' order for the ``k``-th prompt: rotated by ``k``; with ``bracket``, plain runs
    again right after lookupdec, and the two are rotated as one block with plain's first run;
    the methods in ``together`` run in lockstep, as one unit (a tuple) where the first of them is.

    >>> run_order(["plain", "greedy", "pld", "lookupdec"], 1, bracket=False)
    ['greedy', 'pld', 'lookupdec', 'plain']
    >>> run_order(["plain", "greedy", "pld", "lookupdec"], 1, bracket=True)
    ['greedy', 'pld', 'plain', 'lookupdec', 'plain_after']
    >>> run_order(["plain", "greedy", "pld", "lookupdec"], 1, bracket=False, together=["plain", "lookupdec"])
    ['greedy', 'pld', ('plain', 'lookupdec')]
    """
    units = [[m] for m in methods]
    if bracket:
        units = [["plain", "lookupdec", "plain_after"]] + [[m] for m in methods if m not in ("plain", "lookupdec")]
    if together:
        first = min(methods.index(m) for m in together)
        units = [[tuple(together)] if i == first else [m] for i, m in enumerate(methods) if i == first or m not in together]
    k %= len(units)
    return [m for unit in units[k:] + units[:k] for m in unit]


def bench_threads(threads: int, model, tokenizer, workloads, max_new: int, fixed: list[int],
                  all_logits: bool = False, no_prefix_cache: bool = False, measure: str = "interleaved",
                  twin: bool = False, after_workload=None) -> tuple[dict, list[dict]]:
    """Every workload's prompts through every method at ``threads``; ``after_workload(info,
    runs)`` (if given) after each workload with what was measured so far. ``measure``:
    ``interleaved``, the engines' requests for a prompt in lockstep (``lockstep``; with
    ``twin``, a second plain engine among them: ``plain_twin``); ``bracketed``, one at a time,
    plain decoding each prompt twice, right before and right after lookupdec (``plain_after``),
    a prompt's plain time the mean of the two. Either way a machine whose speed drifts over
    seconds to minutes shifts both sides of the ratio alike instead of only one."""
    bracket = measure == "bracketed"
    label = f"{threads}t" if model.device.type == "cpu" else model.device.type  # the run's name in the tables
    from lookupdec import Engine, EngineConfig

    torch.set_num_threads(threads)
    # plain's second run has an engine of its own: each engine sees each prompt once, so every
    # one's prefix cache holds the same earlier prompts when it starts one (a second run on the
    # first run's engine would find its whole prompt cached)
    engines = {"plain": Engine(model, tokenizer, EngineConfig(proposers=())),
               "lookupdec": Engine(model, tokenizer, EngineConfig())}
    if bracket:
        engines["plain_after"] = Engine(model, tokenizer, EngineConfig(proposers=()))
    if twin and not bracket:
        engines["plain_twin"] = Engine(model, tokenizer, EngineConfig(proposers=()))
    for n in fixed:
        engines[f"fixed{n}"] = Engine(model, tokenizer, EngineConfig(budget="fixed", max_nodes=n))
    if all_logits:
        engines["all-logits"] = Engine(model, tokenizer, EngineConfig(partial_logits=False))
    if no_prefix_cache:
        engines["no-prefix-cache"] = Engine(model, tokenizer, EngineConfig(prefix_cache=False))
    methods = ["plain", "greedy", "pld", *[m for m in engines if m not in ("plain", "plain_after")]]
    together = [] if bracket else [m for m in methods if m in engines]  # (plain_twin at the end)
    if "plain_twin" in together:
        together.append(together.pop(together.index("plain_twin")))
    info = {"threads": threads, "measure": measure, "methods": methods + (["plain_after"] if bracket else []),
            "cost_curve": cost_curve(engines["lookupdec"]),
            "load_average_before": load_average()}
    print(f"\n== smollm2 on {model.device.type}, {threads} torch thread(s); verify cost t(n)/t(1) at context {COST_CONTEXT}: "
          + ", ".join(f"{n}: {r}" for n, r in zip(info["cost_curve"]["sizes"], info["cost_curve"]["relative"])),
          flush=True)
    warm = engines["lookupdec"].chat_prompt(WARMUP)
    t = time.perf_counter()
    for method in [*methods, *(["plain_after"] if bracket else [])]:  # allocator, oneDNN, cost curve seeds
        if method in engines:
            ld_run(engines[method], warm, 16)
        else:
            run_method(method, model, None, warm, 16)
    info["warmup_s"] = round(time.perf_counter() - t, 2)
    runs = []
    for workload, prompts in workloads.items():
        for i, prompt in enumerate(prompts):
            order = run_order(methods, i, bracket, together)
            group = []
            for unit in order:
                if isinstance(unit, tuple):  # the engines in lockstep
                    done = lockstep({m: engines[m] for m in unit}, prompt, max_new)
                elif unit in engines:
                    done = {unit: ld_run(engines[unit], prompt, max_new)}
                else:
                    done = {unit: run_method(unit, model, None, prompt, max_new)}
                for method, (out, rec) in done.items():
                    group.append({"method": method, "prompt_tokens": len(prompt), "new_tokens": len(out),
                                  "load_1m": round(os.getloadavg()[0], 2), **rec, "_out": out})
            outs = {r["method"]: r.pop("_out") for r in group}
            for r in group:
                r.update(model=f"smollm2/{label}", workload=workload, prompt=i, threads=threads,
                         identical_to_greedy=outs[r["method"]] == outs["greedy"],
                         first_divergence=first_divergence(outs[r["method"]], outs["greedy"]))
            runs.extend(group)
            rate = {r["method"]: r["new_tokens"] / r["seconds"] for r in group}
            ld = next(r for r in group if r["method"] == "lookupdec")
            plain = plain_rate(group)
            print(f"  {workload:13s} #{i:<2d} {len(prompt):4d} tok  plain {plain:5.1f} t/s  "
                  + "  ".join(f"{m} {rate[m] / plain:.2f}" for m in methods[1:] if m != "plain_twin")
                  + f"  decode {plain_decode_s(group) / ld['decode_s']:.2f}"
                  + (f" (plain runs {rate['plain'] / rate['plain_after']:.2f} apart)" if bracket else "")
                  + (f" (plain / its twin {rate['plain'] / rate['plain_twin']:.2f})" if "plain_twin" in rate else "")
                  + f"  MAT {ld['mean_accepted']:.2f} nodes {ld['mean_tree_nodes']:.1f} "
                  f"pred/real {ld['predicted_accepted']:.2f}/{ld['realised_accepted']:.2f}"
                  + ("" if all(r["identical_to_greedy"] for r in group) else "  MISMATCH"), flush=True)
        if after_workload is not None:
            after_workload(info, runs)
    info["load_average_after"] = load_average()
    return info, runs


def plain_rate(group: list[dict]) -> float:
    """One prompt's plain tokens/s: its runs' tokens over their seconds (with ``plain_after``,
    the rate of the two runs' mean time)."""
    runs = [r for r in group if r["method"] in ("plain", "plain_after")]
    return sum(r["new_tokens"] for r in runs) / sum(r["seconds"] for r in runs)


def plain_decode_s(group: list[dict]) -> float:
    """One prompt's plain decode phase in seconds (with ``plain_after``, the two runs' mean)."""
    runs = [r for r in group if r["method"] in ("plain", "plain_after")]
    return statistics.fmean(r["decode_s"] for r in runs)


def rate_of(group: list[dict], method: str) -> float:
    runs = [r for r in group if r["method"] == method]
    return sum(r["new_tokens"] for r in runs) / sum(r["seconds"] for r in runs)


DECODE_BAR = 0.6  # issue bar: decode-phase gain >= this x (accepted tokens per step) / (tree verify cost / one token's)


def summarize_runs(runs: list[dict]) -> list[dict]:
    """Per thread setting x workload: lookupdec over its own plain decoding (per request and
    decode phase, total and worst prompt), each method's total tokens/s over plain's and over
    greedy's, lookupdec's step figures, the best fixed budget."""
    rows = []
    for model, workload in dict.fromkeys((r["model"], r["workload"]) for r in runs):
        group = [r for r in runs if (r["model"], r["workload"]) == (model, workload)]
        methods = list(dict.fromkeys(r["method"] for r in group if r["method"] != "plain_after"))
        total = {m: rate_of(group, m) for m in methods}
        total["plain"] = plain_rate(group)  # with plain_after: both runs of every prompt
        ld = [r for r in group if r["method"] == "lookupdec"]
        by_prompt = {r["prompt"]: [q for q in group if q["prompt"] == r["prompt"]] for r in ld}
        ratios = [r["new_tokens"] / r["seconds"] / plain_rate(by_prompt[r["prompt"]]) for r in ld]
        decode = [plain_decode_s(by_prompt[r["prompt"]]) / r["decode_s"] for r in ld]
        first = {r["prompt"]: r["new_tokens"] / r["seconds"] for r in group if r["method"] == "plain"}
        after = {r["prompt"]: r["new_tokens"] / r["seconds"] for r in group if r["method"] == "plain_after"}
        twin = {r["prompt"]: r["new_tokens"] / r["seconds"] for r in group if r["method"] == "plain_twin"}
        steps = sum(r["steps"] for r in ld)
        plain_runs = [r for r in group if r["method"] in ("plain", "plain_after")]
        plain_fwd = sum(r["forward_ms"] * r["steps"] for r in plain_runs) / max(1, sum(r["steps"] for r in plain_runs))
        mat = sum(r["new_tokens"] - r.get("prefill_tokens", 0) for r in ld) / steps
        fwd = sum(r["forward_ms"] * r["steps"] for r in ld) / steps
        tree_cost = fwd / plain_fwd if plain_fwd else float("nan")  # the chosen trees' verify cost / one token's
        decode_total = (sum(plain_decode_s(by_prompt[r["prompt"]]) for r in ld)
                        / sum(r["decode_s"] for r in ld))
        row = {"model": model, "workload": workload, "prompts": len(ld),
               "mean_prompt_tokens": statistics.fmean(r["prompt_tokens"] for r in ld),
               "plain_tok_s": total["plain"], "lookupdec/plain": total["lookupdec"] / total["plain"],
               "worst ld/plain": min(ratios), "worst_prompt": ratios.index(min(ratios)),
               "prompts_below_0.97": sum(x < 0.97 for x in ratios),
               "decode ld/plain": decode_total, "worst decode ld/plain": min(decode),
               "decode_bar": DECODE_BAR * mat / tree_cost,
               "plain_runs_apart": (max(math.exp(abs(math.log(first[p] / after[p]))) for p in after)
                                    if after else None),
               # the measurement's own spread: plain over its twin in the same lockstep (``--twin``)
               **({"plain/twin": total["plain"] / total["plain_twin"],
                   "worst plain/twin": min(first[p] / twin[p] for p in twin),
                   "best plain/twin": max(first[p] / twin[p] for p in twin)} if twin else {}),
               "greedy_tok_s": total["greedy"], "lookupdec/greedy": total["lookupdec"] / total["greedy"],
               "plain/greedy": total["plain"] / total["greedy"],
               "lookupdec/pld": total["lookupdec"] / total["pld"], "pld/greedy": total["pld"] / total["greedy"],
               # tokens per step: the first of each answer is the prefill's, in no step
               "lookupdec_mean_accepted": mat, "tree_cost": tree_cost,
               "lookupdec_tree_nodes": sum(r["mean_tree_nodes"] * r["steps"] for r in ld) / steps,
               "lookupdec_predicted": sum(r["predicted_accepted"] * r["steps"] for r in ld) / steps,
               "lookupdec_realised": sum(r["realised_accepted"] * r["steps"] for r in ld) / steps,
               "lookupdec_overhead_us": sum(r["overhead_us"] * r["steps"] for r in ld) / steps,
               "plain_overhead_us": sum(r["overhead_us"] * r["steps"] for r in plain_runs)
               / max(1, sum(r["steps"] for r in plain_runs)),
               "lookupdec_forward_ms": fwd, "plain_forward_ms": plain_fwd,
               "lookupdec_prefill_ms": statistics.fmean(r["prefill_ms"] for r in ld),
               "plain_prefill_ms": statistics.fmean(r["prefill_ms"] for r in plain_runs),
               "lookupdec_logit_rows": sum(r.get("logit_rows", 0.0) * r["steps"] for r in ld) / steps,
               "lookupdec_logit_misses": sum(r.get("logit_misses", 0) for r in ld),
               "identical": f"{sum(r['identical_to_greedy'] for r in group)}/{len(group)}"}
        fixed = [m for m in methods if m.startswith("fixed")]
        for m in fixed:
            row[f"{m}/plain"] = total[m] / total["plain"]
        if fixed:
            best = max(fixed, key=lambda m: total[m])
            row["best_fixed"] = best
            row["lookupdec/best_fixed"] = total["lookupdec"] / total[best]
        if "all-logits" in total:
            row["lookupdec/all-logits"] = total["lookupdec"] / total["all-logits"]
        if "no-prefix-cache" in total:
            row["lookupdec/no-prefix-cache"] = total["lookupdec"] / total["no-prefix-cache"]
        row["lookupdec_prefix_reused"] = statistics.fmean(r.get("prefix_reused", 0) for r in ld)
        rows.append(row)
    return rows


TABLE = [("model", "run", ""), ("workload", "workload", ""), ("prompts", "n", "d"),
         ("mean_prompt_tokens", "prompt", ".0f"), ("plain_tok_s", "plain t/s", ".1f"),
         ("lookupdec/plain", "ld/plain", ".2f"), ("worst ld/plain", "worst", ".2f"),
         ("decode ld/plain", "decode", ".2f"), ("worst decode ld/plain", "worst dec", ".2f"),
         ("decode_bar", "dec bar", ".2f"), ("plain_runs_apart", "plain runs apart", ".2f"),
         ("worst plain/twin", "plain/twin min", ".3f"), ("best plain/twin", "plain/twin max", ".3f"),
         ("lookupdec/greedy", "ld/greedy", ".2f"), ("plain/greedy", "plain/greedy", ".2f"),
         ("lookupdec/pld", "ld/pld", ".2f"), ("pld/greedy", "pld/greedy", ".2f"),
         ("lookupdec/best_fixed", "ld/best fixed", ".2f"), ("best_fixed", "best fixed", ""),
         ("lookupdec_mean_accepted", "MAT", ".2f"), ("tree_cost", "tree cost", ".2f"),
         ("lookupdec_tree_nodes", "nodes", ".1f"),
         ("lookupdec_predicted", "pred acc", ".2f"), ("lookupdec_realised", "real acc", ".2f"),
         ("lookupdec_overhead_us", "ovh us", ".0f"), ("plain_overhead_us", "plain ovh us", ".0f"),
         ("lookupdec_forward_ms", "fwd ms", ".1f"), ("plain_forward_ms", "plain fwd ms", ".1f"),
         ("lookupdec/all-logits", "ld/all-logits", ".2f"),
         ("lookupdec/no-prefix-cache", "ld/no-prefix", ".2f"),
         ("identical", "identical", "")]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="model (folder, .gguf or alias; smollm2)")
    p.add_argument("--prompts", type=int, default=10, metavar="N", help="prompts per workload (10)")
    p.add_argument("--max-new-tokens", type=int, default=128, metavar="N", help="tokens per prompt (128)")
    p.add_argument("--max-prompt-tokens", type=int, default=1536, metavar="N",
                   help="skip longer prompts (1536)")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="torch thread settings (1 2)")
    p.add_argument("--fixed", type=int, nargs="*", default=[4, 16], metavar="N",
                   help="also fixed budgets of N nodes (budget='fixed'), for the default's distance to the best (4 16)")
    p.add_argument("--fixed-threads", type=int, nargs="*", default=[1], metavar="T",
                   help="thread settings that run the fixed budgets (1)")
    p.add_argument("--workloads", nargs="+", default=None, help="only these workloads")
    p.add_argument("--all-logits", action="store_true",
                   help="also run the default with EngineConfig(partial_logits=False): every node's logits computed")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="also run the default with EngineConfig(prefix_cache=False): every prompt prefilled whole")
    p.add_argument("--measure", choices=("interleaved", "bracketed"), default="interleaved",
                   help="interleaved (default): a prompt's engine requests (plain, lookupdec, ...) in lockstep, the one "
                        "behind in time stepping next; bracketed: one at a time, plain right before and after lookupdec")
    p.add_argument("--twin", action="store_true",
                   help="interleaved: a second plain engine in the lockstep (plain_twin), for the measurement's own spread")
    p.add_argument("--prompt-offset", type=int, default=0, metavar="K", help="skip the first K prompts of each workload")
    add_device_option(p)
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "real_model.json", help="result JSON (and .png)")
    args = p.parse_args(argv)

    from lookupdec import Engine

    meta = run_metadata(threads_set_by_benchmark=True)  # the code this run imports: the tree at its start
    # a cost cache of this run's own (LOOKUPDEC_COST_CACHE): no run starts from curves an earlier
    # run, another benchmark or a batch left on this machine
    cost_cache = tempfile.TemporaryDirectory(prefix="lookupdec-real-model-")  # (removed as main returns)
    os.environ["LOOKUPDEC_COST_CACHE"] = os.path.join(cost_cache.name, "cost_curves.json")
    t0 = time.perf_counter()
    loader = Engine.from_pretrained(args.model, device=args.device, dtype="float32")
    model, tokenizer = loader.target.model, loader.tokenizer
    workloads = build_workloads(loader, args.prompts + args.prompt_offset, args.max_prompt_tokens)
    workloads = {k: v[args.prompt_offset:] for k, v in workloads.items()}
    if args.workloads:
        unknown = set(args.workloads) - set(workloads)
        if unknown:
            p.error(f"--workloads: unknown {sorted(unknown)}; choose from {sorted(workloads)}")
        workloads = {k: v for k, v in workloads.items() if k in args.workloads}
    load_s = time.perf_counter() - t0
    infos, runs = [], []
    for threads in args.threads:
        fixed = args.fixed if threads in args.fixed_threads else []
        # after each workload the result so far is written (a run cut short keeps what it measured),
        # after each setting it is also printed
        info, r = bench_threads(threads, model, tokenizer, workloads, args.max_new_tokens, fixed,
                                all_logits=args.all_logits, no_prefix_cache=args.no_prefix_cache,
                                measure=args.measure, twin=args.twin, after_workload=lambda i, so_far: report(args, argv, meta, workloads, load_s,
                                                                         [*infos, i], [*runs, *so_far], echo=False))
        infos.append(info)
        runs.extend(r)
        report(args, argv, meta, workloads, load_s, infos, runs)
    return 0


def report(args, argv, meta, workloads, load_s, infos, runs, echo: bool = True) -> None:
    """Write the result JSON and its plot from ``runs``; with ``echo``, print the table too."""
    rows = summarize_runs(runs)
    if echo:
        print()
        print(format_table(rows, TABLE))
    totals = {}
    for model in dict.fromkeys(r["model"] for r in runs):
        mine = [r for r in runs if r["model"] == model]
        rate = {m: rate_of(mine, m) for m in ("greedy", "pld", "lookupdec")}
        rate["plain"] = plain_rate(mine)
        ld = [r for r in mine if r["method"] == "lookupdec"]
        prompts = {(r["workload"], r["prompt"]): [q for q in mine if (q["workload"], q["prompt"]) == (r["workload"], r["prompt"])]
                   for r in ld}
        ratios = [r["new_tokens"] / r["seconds"] / plain_rate(prompts[(r["workload"], r["prompt"])]) for r in ld]
        totals[model] = {"lookupdec/plain": round(rate["lookupdec"] / rate["plain"], 3),
                         "worst ld/plain": round(min(ratios), 3),
                         "decode ld/plain": round(sum(plain_decode_s(g) for g in prompts.values())
                                                  / sum(r["decode_s"] for r in ld), 3),
                         "lookupdec/greedy": round(rate["lookupdec"] / rate["greedy"], 3),
                         "plain/greedy": round(rate["plain"] / rate["greedy"], 3),
                         "lookupdec/pld": round(rate["lookupdec"] / rate["pld"], 3),
                         "mismatches": sum(not r["identical_to_greedy"] for r in mine)}
        if echo:
            t = totals[model]
            print(f"{model}: all workloads, lookupdec/plain {t['lookupdec/plain']:.2f} (worst prompt "
                  f"{t['worst ld/plain']:.2f}, decode phase {t['decode ld/plain']:.2f}), lookupdec/greedy "
                  f"{t['lookupdec/greedy']:.2f}, plain/greedy {t['plain/greedy']:.2f}, lookupdec/pld "
                  f"{t['lookupdec/pld']:.2f}, mismatches {t['mismatches']}")
    config = {"command": "python " + " ".join([sys.argv[0]] + (argv if argv is not None else sys.argv[1:])),
              "model": args.model, "device": args.device, "prompts_per_workload": args.prompts, "prompt_offset": args.prompt_offset,
              "max_new_tokens": args.max_new_tokens, "max_prompt_tokens": args.max_prompt_tokens,
              "threads": args.threads, "fixed": args.fixed, "fixed_threads": args.fixed_threads,
              "measure": args.measure, "twin": args.twin,
              "load_s": round(load_s, 1), "workload_sizes": {k: len(v) for k, v in workloads.items()},
              "mean_prompt_tokens": {k: round(statistics.fmean(map(len, v)), 1) for k, v in workloads.items() if v}}
    write_result(args.out, "real_model", config, {"per_workload": rows, "totals": totals, "threads": infos,
                                                  "runs": runs}, meta=meta)
    plot(rows, runs, Path(args.out).with_suffix(".png"))
    print(f"wrote {args.out}" + ("" if echo else " (so far)"), flush=True)


def plot(rows: list[dict], runs: list[dict], path: Path) -> None:
    """Per workload and thread setting: lookupdec and prompt lookup over greedy (bars), and every
    single prompt's lookupdec/greedy (dots)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(7 * len(models), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models):
        mine = [r for r in rows if r["model"] == model]
        names = [r["workload"] for r in mine]
        xs = range(len(names))
        ax.bar([x - 0.27 for x in xs], [r["lookupdec/plain"] for r in mine], 0.27, label="lookupdec / plain")
        ax.bar(list(xs), [r["decode ld/plain"] for r in mine], 0.27, label="decode phase: lookupdec / plain")
        ax.bar([x + 0.27 for x in xs], [r["pld/greedy"] for r in mine], 0.27, label="transformers: prompt lookup / greedy")
        for x, name in zip(xs, names):
            group = [r for r in runs if r["model"] == model and r["workload"] == name]
            dots = [r["new_tokens"] / r["seconds"] / plain_rate([q for q in group if q["prompt"] == r["prompt"]])
                    for r in group if r["method"] == "lookupdec"]
            ax.scatter([x - 0.27] * len(dots), dots, s=8, color="black", zorder=3)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.axhline(0.97, color="red", lw=0.6, ls="--")
        ax.set_xticks(list(xs), names, rotation=30, ha="right")
        ax.set_ylabel("tokens/s ratio (per request, prefill included)")
        ax.set_title(f"SmolLM2-135M, {model.split('/')[1]} (dots: single prompts)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
