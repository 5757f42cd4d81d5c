"""Throughput with many sequences per forward: lookupdec's batched step against ``transformers``'
batched greedy ``generate`` at the same batch size, on SmolLM2-135M-Instruct (float32; CPU, or a GPU
with ``--device cuda``).

For each torch thread setting, workload and batch size B, side by side in an order rotated per B:

* ``transformers``  -- ``model.generate(do_sample=False)`` over the records in chunks of B,
  left-padded (its batch runs until the longest row ends)
* ``plain``         -- the same with ``EngineConfig(proposers=())``: the same ``BatchDecoder`` at the
  same B with no drafts (one token per row per forward). lookupdec over it (``vs_plain``) is what
  the lookups add under load: it must never fall below 1
* ``lookupdec``     -- ``Engine.generate_batch(records, max_batch=B)``, the default configuration
  (joint budget, continuous batching), a fresh engine per run so that its suffix cache has not
  seen these records' outputs before; at B = 1 ``Engine.generate`` one record at a time (what
  ``rewrite --batch-size 1`` does)
* ``fixedN``        -- (``--fixed-batch`` only) lookupdec with ``budget="fixed", max_nodes=N``
  per sequence: the joint budget's distance to the best fixed setting

Tokens/s = the records' new tokens (each up to its first EOS) over the run's wall time, prefill
included (with ``--repeat N``: over the median of N runs, each round in an order rotated once more).
Every lookupdec output must equal ``transformers`` greedy of that record alone (the B = 1 run, every
repeat); mismatches are counted, never hidden.

    python bench/batch_bench.py                       # 16 records, 96 tokens, B = 1 4 8 16, 1 and 2 threads
    python bench/batch_bench.py --threads 1 --records 8 --batch-sizes 1 8   # a quick look
    python bench/batch_bench.py --device cuda --threads 1 --out bench/results/batch_h100.json

Writes ``bench/results/batch.json`` and ``.png`` (``--out``).
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR, add_device_option, format_table, run_metadata, write_result  # noqa: E402
from real_model import build_workloads  # noqa: E402


def until_eos(ids: list[int], eos: set[int]) -> list[int]:
    for i, t in enumerate(ids):
        if t in eos:
            return ids[: i + 1]
    return ids


def tf_batched(model, prompts, batch: int, max_new: int, pad_id: int, eos: set[int]):
    outs = []
    gc.collect()
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        chunk = prompts[i : i + batch]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in chunk], device=model.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=model.device)
        with torch.inference_mode():
            seq = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new,
                                 pad_token_id=pad_id)
        outs.extend(until_eos(row[width:].tolist(), eos) for row in seq)
    return outs, time.perf_counter() - start, {}


def ld_batched(model, tokenizer, prompts, batch: int, max_new: int, config=None, sequential: bool = False):
    from lookupdec import Engine, EngineConfig

    engine = Engine(model, tokenizer, config or EngineConfig())
    gc.collect()
    start = time.perf_counter()
    if sequential:
        gens = [engine.generate(p, max_new_tokens=max_new) for p in prompts]
    else:
        gens = engine.generate_batch(prompts, max_new_tokens=max_new, max_batch=batch)
    seconds = time.perf_counter() - start
    steps = sum(g.stats.steps for g in gens)
    stepped = sum(len(g.token_ids) - g.stats.prefill_tokens for g in gens)  # (each first: the prefill's)
    info = {"mean_accepted": stepped / steps if steps else 0.0,
            "mean_tree_nodes": sum(g.stats.mean_tree_nodes * g.stats.steps for g in gens) / steps if steps else 0.0}
    return [list(g.token_ids) for g in gens], seconds, info


def bench(threads: int, model, tokenizer, workloads, args) -> list[dict]:
    from lookupdec import EngineConfig

    torch.set_num_threads(threads)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    from lookupdec.model import tokenizer_info

    eos = set(tokenizer_info(tokenizer)["eos_token_ids"])  # the engine's own EOS set
    warm = workloads[next(iter(workloads))][:2]
    ld_batched(model, tokenizer, warm, 2, 8)  # oneDNN packing, kernel choices, the cost curve seed
    tf_batched(model, warm, 2, 8, pad_id, eos)
    rows = []
    for workload, prompts in workloads.items():
        reference = None
        for batch in args.batch_sizes:
            methods = ["transformers", "plain", "lookupdec"]
            if batch in args.fixed_batch:
                methods += [f"fixed{n}" for n in args.fixed]
            runs: dict[str, list] = {m: [] for m in methods}
            for rep in range(args.repeat):  # each repeat starts one method later
                k = (args.batch_sizes.index(batch) + rep) % len(methods)
                for method in methods[k:] + methods[:k]:
                    if method == "transformers":
                        runs[method].append(tf_batched(model, prompts, batch, args.max_new_tokens, pad_id, eos))
                    else:
                        config = (EngineConfig(budget="fixed", max_nodes=int(method[5:])) if method.startswith("fixed")
                                  else EngineConfig(proposers=()) if method == "plain" else None)
                        runs[method].append(ld_batched(model, tokenizer, prompts, batch, args.max_new_tokens, config,
                                                       sequential=batch == 1))
            if batch == 1:
                reference = runs["transformers"][0][0]
            results = {m: runs[m] for m in methods}
            for method, done in results.items():
                outs, _, info = done[0]
                seconds = statistics.median(s for _, s, _ in done)  # the median run's rate: one slow run is noise here
                tokens = sum(len(o) for o in outs)
                identical = None if reference is None else min(sum(o == r for o, r in zip(outs_i, reference))
                                                               for outs_i, _, _ in done)
                rows.append({"threads": threads, "workload": workload, "batch": batch, "method": method,
                             "records": len(prompts), "new_tokens": tokens, "seconds": round(seconds, 3),
                             "tokens_per_s": round(tokens / seconds, 2), "identical": identical, **info,
                             **({"seconds_each": [round(s, 3) for _, s, _ in done]} if len(done) > 1 else {})})
            tf_rate = next(r["tokens_per_s"] for r in rows[-len(results):] if r["method"] == "transformers")
            plain_rate = next(r["tokens_per_s"] for r in rows[-len(results):] if r["method"] == "plain")
            for r in rows[-len(results):]:
                r["vs_transformers"] = round(r["tokens_per_s"] / tf_rate, 3)
                r["vs_plain"] = round(r["tokens_per_s"] / plain_rate, 3)
            print(f"  {threads}t {workload:12s} B={batch:<3d} " + "  ".join(
                f"{r['method']} {r['tokens_per_s']:.1f} t/s ({r['vs_plain']:.2f}x plain, {r['vs_transformers']:.2f}x tf"
                + (f", {r['identical']}/{r['records']} identical" if r["identical"] is not None else "") + ")"
                for r in rows[-len(results):]), flush=True)
    return rows


TABLE = [("threads", "threads", "d"), ("workload", "workload", ""), ("batch", "batch", "d"), ("method", "method", ""),
         ("tokens_per_s", "tokens/s", ".1f"), ("vs_plain", "x plain", ".2f"), ("vs_transformers", "x transformers", ".2f"),
         ("mean_accepted", "tokens/step", ".2f"), ("mean_tree_nodes", "nodes/step", ".1f"),
         ("identical", "identical", "")]


def plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    panels = list(dict.fromkeys((r["threads"], r["workload"]) for r in rows))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
    for ax, (threads, workload) in zip(axes[0], panels):
        for method, style in (("transformers", "o--"), ("plain", "^:"), ("lookupdec", "s-")):
            pts = [(r["batch"], r["tokens_per_s"]) for r in rows
                   if r["threads"] == threads and r["workload"] == workload and r["method"] == method]
            if pts:
                ax.plot(*zip(*pts), style, label=method)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{workload}, {threads} thread(s)")
        ax.set_xlabel("batch size")
        ax.set_ylabel("tokens/s")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="model (folder, .gguf or alias; smollm2)")
    p.add_argument("--records", type=int, default=16, metavar="N", help="records per workload (16)")
    p.add_argument("--max-new-tokens", type=int, default=96, metavar="N", help="tokens per record (96)")
    p.add_argument("--max-prompt-tokens", type=int, default=1024, metavar="N", help="skip longer prompts (1024)")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="torch thread settings (1 2)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 8, 16], help="batch sizes (1 4 8 16)")
    p.add_argument("--workloads", nargs="+", default=["log_to_json", "code_edit"], help="workloads")
    p.add_argument("--fixed", type=int, nargs="*", default=[4, 16], metavar="N", help="fixed per-sequence budgets (4 16)")
    p.add_argument("--fixed-batch", type=int, nargs="*", default=[8], metavar="B",
                   help="batch sizes that also run the fixed budgets (8)")
    p.add_argument("--repeat", type=int, default=1, metavar="N",
                   help="runs of every method at each batch size, each round rotated one method on; tokens/s from "
                        "the median run (1). Single runs at two threads spread 10-25%% on a 2-core machine")
    add_device_option(p)
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "batch.json", help="result JSON (and .png)")
    args = p.parse_args(argv)
    if 1 not in args.batch_sizes:
        p.error("--batch-sizes must include 1 (transformers alone gives the reference outputs)")
    args.batch_sizes = sorted(args.batch_sizes)
    if args.repeat < 1:
        p.error(f"--repeat must be at least 1, got {args.repeat}")

    from lookupdec import Engine

    meta = run_metadata(threads_set_by_benchmark=True)
    loader = Engine.from_pretrained(args.model, device=args.device, dtype="float32")
    model, tokenizer = loader.target.model, loader.tokenizer
    workloads = build_workloads(loader, args.records, args.max_prompt_tokens)
    workloads = {k: workloads[k] for k in args.workloads}
    rows = []
    for threads in args.threads:
        rows.extend(bench(threads, model, tokenizer, workloads, args))
        print()
        print(format_table(rows, TABLE))
        write_result(args.out, "batch", {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                     rows, meta=meta, threads_set_by_benchmark=True, load_average_end=os.getloadavg())
        plot(rows, args.out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
