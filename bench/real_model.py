"""End to end on a real model: SmolLM2-135M-Instruct (float32, CPU) against ``transformers``.

Three methods decode the same prompts, greedy, side by side, in an order rotated per prompt:

* ``greedy``    -- ``model.generate(do_sample=False)``
* ``pld``       -- ``model.generate(do_sample=False, prompt_lookup_num_tokens=10)``
* ``lookupdec`` -- ``Engine(model, tokenizer, EngineConfig()).generate(...)``, the default
  configuration, one engine per thread setting kept across prompts as a server keeps it

Workloads, every prompt in the model's chat template: the six Spec-Bench categories (first turn
of multi-turn chat, translation, CNN/DM summarization, QA, GSM8K math, RAG), real code edits
("apply this change, output the whole file", TheAlgorithms history) and log lines to JSON
(loghub). Outputs must be identical to greedy's; mismatches are counted, never hidden. Also the
verify cost curve t(n)/t(1) of the model at a 512-token context.

    python bench/real_model.py                      # 5 prompts/workload, 160 tokens, 1 and 2 threads
    python bench/real_model.py --prompts 2 --max-new-tokens 32 --threads 1   # a quick look

Writes ``bench/results/real_model.json`` (``--out``). Timings on a shared machine are noisy:
read the ratios (measured side by side), not absolute tokens/s across runs.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR, SHARED_DIR, format_table, load_average, run_metadata, write_result  # noqa: E402
from e2e import METHODS, ForwardMeter, first_divergence, run_method, run_once, summarize  # noqa: E402

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


def read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def build_workloads(engine, n: int, max_prompt: int) -> dict[str, list[list[int]]]:
    """Prompt token ids per workload: the first ``n`` usable items of each source, in order."""
    def take(messages_iter) -> list[list[int]]:
        out = []
        for text in messages_iter:
            ids = engine.chat_prompt(text)
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

    def log_prompts():
        for system in LOG_SYSTEMS:
            with open(LOGHUB / f"{system}_2k.log", encoding="utf-8", errors="replace") as f:
                lines = [line.rstrip("\n") for _, line in zip(range(LOG_LINES_PER_PROMPT), f)]
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
    """Verify cost t(n) of an n-token chain after a COST_CONTEXT-token prefix (fastest of rounds)."""
    from lookupdec.budget import CostModel

    timer = engine.target.chain_forward_timer(COST_CONTEXT)
    try:
        cost = CostModel.measure(timer, max_tokens=COST_SIZES_MAX)
    finally:
        engine.target.reset()
    return {"context": COST_CONTEXT, "sizes": cost.sizes, "seconds": cost.seconds,
            "relative": [round(t / cost.seconds[0], 3) for t in cost.seconds]}


def bench_threads(threads: int, model, tokenizer, workloads, max_new: int) -> tuple[dict, list[dict]]:
    from lookupdec import Engine, EngineConfig

    torch.set_num_threads(threads)
    engine = Engine(model, tokenizer, EngineConfig())
    info = {"threads": threads, "cost_curve": cost_curve(engine), "load_average_before": load_average()}
    print(f"\n== smollm2, {threads} torch thread(s); verify cost t(n)/t(1) at context {COST_CONTEXT}: "
          + ", ".join(f"{n}: {r}" for n, r in zip(info["cost_curve"]["sizes"], info["cost_curve"]["relative"])),
          flush=True)
    # The verify cost curve of every context bucket the prompts fall in, measured (or read from
    # the cost cache) before timing, as a server that has seen such prompts has it: the first
    # request of each bucket otherwise pays ~2 s of measurement (reported apart, not hidden).
    t = time.perf_counter()
    for prompts in workloads.values():
        for prompt in prompts:
            engine.cost_model(len(prompt) + max_new // 2)
    info["cost_warmup_s"] = round(time.perf_counter() - t, 2)
    info["cost_origin"] = {str(k): v for k, v in sorted(engine.cost_origin.items())}
    meter = ForwardMeter(model)
    warm = engine.chat_prompt(WARMUP)
    for method in METHODS:  # allocator, oneDNN, the engine's cost calibration
        run_method(method, model, engine, warm, 16)
    runs = []
    for workload, prompts in workloads.items():
        for i, prompt in enumerate(prompts):
            k = i % len(METHODS)
            order = METHODS[k:] + METHODS[:k]
            trio = [run_once(method, model, engine, meter, prompt, max_new) for method in order]
            outs = {r["method"]: r.pop("_out") for r in trio}
            for r in trio:
                r.update(model=f"smollm2/{threads}t", workload=workload, prompt=i, repeat=0, threads=threads,
                         identical_to_greedy=outs[r["method"]] == outs["greedy"],
                         first_divergence=first_divergence(outs[r["method"]], outs["greedy"]))
            runs.extend(trio)
            print(f"  {workload:13s} #{i:<2d} prompt {len(prompt):4d} tok  " + "  ".join(
                f"{r['method']} {r['new_tokens'] / r['seconds']:6.1f} tok/s" for r in trio)
                + f"  ld MAT {next(r for r in trio if r['method'] == 'lookupdec')['mean_accepted']:.2f}"
                + ("" if all(r["identical_to_greedy"] for r in trio) else "  MISMATCH"), flush=True)
    meter.remove()
    info["load_average_after"] = load_average()
    return info, runs


def worst_prompts(runs: list[dict]) -> list[dict]:
    """Per thread setting and workload, the prompt where lookupdec / greedy is lowest."""
    rate = {(r["model"], r["workload"], r["prompt"], r["method"]): r["new_tokens"] / r["seconds"] for r in runs}
    out = []
    for model, workload in dict.fromkeys((r["model"], r["workload"]) for r in runs):
        ratios = {p: rate[model, workload, p, "lookupdec"] / rate[model, workload, p, "greedy"]
                  for (m, w, p, meth) in rate if (m, w, meth) == (model, workload, "greedy")}
        p = min(ratios, key=ratios.get)
        out.append({"model": model, "workload": workload, "prompt": p, "lookupdec/greedy": round(ratios[p], 3),
                    "lookupdec/pld": round(rate[model, workload, p, "lookupdec"] / rate[model, workload, p, "pld"], 3)})
    return out


TABLE = [("model", "run", ""), ("workload", "workload", ""), ("prompts", "n", "d"),
         ("mean_prompt_tokens", "prompt", ".0f"), ("greedy_tok_s", "greedy t/s", ".1f"),
         ("pld_tok_s", "pld t/s", ".1f"), ("lookupdec_tok_s", "ld t/s", ".1f"),
         ("lookupdec/greedy", "ld/greedy", ".2f"), ("lookupdec/pld", "ld/pld", ".2f"),
         ("pld/greedy", "pld/greedy", ".2f"), ("worst ld/greedy", "worst", ".2f"),
         ("lookupdec_mean_accepted", "ld MAT", ".2f"), ("lookupdec_tree_nodes", "ld nodes", ".1f"),
         ("lookupdec_overhead_us", "ovh us", ".0f"), ("lookupdec_forward_ms", "fwd ms", ".1f"),
         ("greedy_decode_forward_ms", "greedy fwd ms", ".1f"), ("identical", "identical", "")]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="model (folder, .gguf or alias; smollm2)")
    p.add_argument("--prompts", type=int, default=5, metavar="N", help="prompts per workload (5)")
    p.add_argument("--max-new-tokens", type=int, default=160, metavar="N", help="tokens per prompt (160)")
    p.add_argument("--max-prompt-tokens", type=int, default=1536, metavar="N",
                   help="skip longer prompts (1536)")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="torch thread settings (1 2)")
    p.add_argument("--workloads", nargs="+", default=None, help="only these workloads")
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "real_model.json", help="result JSON")
    args = p.parse_args(argv)

    from lookupdec import Engine

    meta = run_metadata(threads_set_by_benchmark=True)  # the code this run imports: the tree at its start
    t0 = time.perf_counter()
    loader = Engine.from_pretrained(args.model, device="cpu", dtype="float32")
    model, tokenizer = loader.target.model, loader.tokenizer
    workloads = build_workloads(loader, args.prompts, args.max_prompt_tokens)
    if args.workloads:
        unknown = set(args.workloads) - set(workloads)
        if unknown:
            p.error(f"--workloads: unknown {sorted(unknown)}; choose from {sorted(workloads)}")
        workloads = {k: v for k, v in workloads.items() if k in args.workloads}
    load_s = time.perf_counter() - t0
    infos, runs = [], []
    for threads in args.threads:
        info, r = bench_threads(threads, model, tokenizer, workloads, args.max_new_tokens)
        infos.append(info)
        runs.extend(r)
        report(args, argv, meta, workloads, load_s, infos, runs)  # after each setting: a cut run keeps its part
    return 0


def report(args, argv, meta, workloads, load_s, infos, runs) -> None:
    rows = summarize(runs)
    worst = {(w["model"], w["workload"]): w for w in worst_prompts(runs)}
    for row in rows:
        row["worst ld/greedy"] = worst[row["model"], row["workload"]]["lookupdec/greedy"]
    print()
    print(format_table(rows, TABLE))
    totals = {}
    for model in dict.fromkeys(r["model"] for r in runs):
        g = {m: [r for r in runs if r["model"] == model and r["method"] == m] for m in METHODS}
        rate = {m: sum(r["new_tokens"] for r in g[m]) / sum(r["seconds"] for r in g[m]) for m in METHODS}
        totals[model] = {"lookupdec/greedy": round(rate["lookupdec"] / rate["greedy"], 3),
                         "lookupdec/pld": round(rate["lookupdec"] / rate["pld"], 3),
                         "pld/greedy": round(rate["pld"] / rate["greedy"], 3),
                         "mismatches": sum(not r["identical_to_greedy"] for r in runs if r["model"] == model)}
        print(f"{model}: all workloads, lookupdec/greedy {totals[model]['lookupdec/greedy']:.2f}, "
              f"lookupdec/pld {totals[model]['lookupdec/pld']:.2f}, mismatches {totals[model]['mismatches']}")
    config = {"command": "python " + " ".join([sys.argv[0]] + (argv if argv is not None else sys.argv[1:])),
              "model": args.model, "prompts_per_workload": args.prompts, "max_new_tokens": args.max_new_tokens,
              "max_prompt_tokens": args.max_prompt_tokens, "threads": args.threads, "load_s": round(load_s, 1),
              "workload_sizes": {k: len(v) for k, v in workloads.items()},
              "mean_prompt_tokens": {k: round(statistics.fmean(map(len, v)), 1) for k, v in workloads.items() if v}}
    write_result(args.out, "real_model", config, {"per_workload": rows, "totals": totals,
                                                  "worst_prompts": list(worst.values()),
                                                  "threads": infos, "runs": runs},
                 meta=meta)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(main())
