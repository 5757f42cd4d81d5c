"""Verify cost against tree size, and whether the per-step budget chooser finds the best size.

    python bench/budget_bench.py                                  # curves (CPU) + replays + check
    python bench/budget_bench.py --parts curves --models llama-1B
    python bench/budget_bench.py --parts replay --curves-from bench/results/budget_gpu.json

1. **curves**: t(n)/t(1) for n = 1, 2, 4 ... 256 tree tokens (one verify forward after a
   256-token context, the minimum of `--repeats` runs) for randomly initialised float32 Llama
   models of about 20M, 150M and 1B parameters on this machine's CPU (weights are random: the
   cost does not depend on their values).
2. **replay**: each workload replayed (model-free, `lookupdec.simulate`) at fixed budgets
   1 ... 256 and with the engine's per-step chooser (`budget="auto"`) under each curve. The
   modelled speedup over plain decoding is `tokens * t(1) / sum over steps of t(1 + nodes)`
   (per-step overhead taken as 0 for every method). The chooser passes where its speedup is at
   least 95% of the best fixed budget's, for every workload and curve.

Writes ``bench/results/budget.json`` and ``budget.png``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import RESULTS_DIR, SHARED_DIR, format_table, run_metadata, write_result  # noqa: E402

from lookupdec.budget import CostModel  # noqa: E402
from lookupdec.config import EngineConfig  # noqa: E402
from lookupdec.model import TargetModel, load_tokenizer  # noqa: E402
from lookupdec.proposers import build_proposers  # noqa: E402
from lookupdec.simulate import replay  # noqa: E402
from lookupdec.workloads import WORKLOADS  # noqa: E402

SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
BUDGETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
CONTEXT = 256
RANDOM_LLAMAS = {  # LlamaConfig fields (vocab 32000, untied): ~20M, ~150M, ~1.1B parameters
    "llama-20M": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=8, num_attention_heads=4),
    "llama-150M": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=14, num_attention_heads=12),
    "llama-1B": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                     num_key_value_heads=4),
}
WORKLOAD_LIMITS = {"mtbench": None, "code-edit": 60, "loghub": 40, "humaneval": None}
PASS_SHARE = 0.95


def measure_curve(name: str, repeats: int, dtype=torch.float32, device="cpu") -> dict:
    import transformers

    config = transformers.LlamaConfig(vocab_size=32000, max_position_embeddings=4096, tie_word_embeddings=False,
                                      **RANDOM_LLAMAS[name])
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()
    params = sum(p.numel() for p in model.parameters())
    target = TargetModel(model, verify="tree")
    forward = target.chain_forward_timer(prefix_len=CONTEXT)
    forward(1)  # warm-up
    best = {n: float("inf") for n in SIZES}
    for _ in range(repeats):
        for n in SIZES:
            t = time.perf_counter()
            forward(n)
            best[n] = min(best[n], time.perf_counter() - t)
    del model, target
    curve = {"model": name, "params": params, "dtype": str(dtype).replace("torch.", ""), "device": device,
             "context": CONTEXT, "repeats": repeats, "threads": torch.get_num_threads(),
             "sizes": list(SIZES), "seconds": [best[n] for n in SIZES],
             "relative": [best[n] / best[1] for n in SIZES]}
    print(f"curve {name} ({params / 1e6:.0f}M, {curve['dtype']}, {device}): t(1) {best[1] * 1e3:.1f} ms; t(n)/t(1) "
          + " ".join(f"{n}:{r:.2f}" for n, r in zip(SIZES, curve["relative"])), flush=True)
    return curve


def cost_of(curve: dict) -> CostModel:
    return CostModel(curve["sizes"], curve["seconds"])


def replay_workloads(args, curves: list[dict], tokenizer) -> list[dict]:
    rows = []
    for workload in args.workloads.split(","):
        records = list(WORKLOADS[workload](args.data))[: WORKLOAD_LIMITS.get(workload)]
        fixed = {}
        for budget in BUDGETS:
            t = time.perf_counter()
            r = replay(records, tokenizer, build_proposers(EngineConfig(), tokenizer=tokenizer), max_nodes=budget,
                       max_depth=min(budget, 64), cost=CostModel([1], [1.0]))
            fixed[budget] = r
            print(f"{workload:10s} fixed {budget:3d}: MAT {r['mat']:.3f} ({time.perf_counter() - t:.0f} s)", flush=True)
        for curve in curves:
            cost = cost_of(curve)
            machine = f"{curve['model']} {curve['dtype']} {curve['device']}"
            speedups = {}
            for budget, r in fixed.items():
                seconds = sum(count * cost(1 + nodes) for nodes, count in r["nodes_histogram"].items())
                speedups[budget] = r["response_tokens"] * cost(1) / seconds
            r = replay(records, tokenizer, build_proposers(EngineConfig(), tokenizer=tokenizer), max_nodes=256,
                       max_depth=64, cost=cost, choose=True)
            auto = r["response_tokens"] * cost(1) / r["modeled_seconds"]
            best_budget = max(speedups, key=speedups.get)
            row = {"workload": workload, "machine": machine, "records": len(records),
                   "mat_by_budget": {b: fixed[b]["mat"] for b in BUDGETS}, "speedup_by_budget": speedups,
                   "best_fixed_budget": best_budget, "best_fixed_speedup": speedups[best_budget],
                   "auto_speedup": auto, "auto_mat": r["mat"], "auto_mean_nodes": r["mean_tree_nodes"],
                   "auto_share_of_best": auto / speedups[best_budget],
                   "pass": auto >= PASS_SHARE * speedups[best_budget]}
            rows.append(row)
            print(f"{workload:10s} {machine:28s} best fixed {best_budget:3d} -> {speedups[best_budget]:.2f}x, "
                  f"auto {auto:.2f}x ({row['auto_share_of_best']:.1%}, {r['mean_tree_nodes']:.1f} nodes, MAT {r['mat']:.2f})",
                  flush=True)
    return rows


def plot(curves, rows, path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    fig, axes = plt.subplots(1, 1 + len(workloads), figsize=(4.2 * (1 + len(workloads)), 4), squeeze=False)
    ax = axes[0][0]
    for c in curves:
        ax.plot(c["sizes"], c["relative"], marker="o", label=f"{c['model']} {c['device']}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tree tokens n")
    ax.set_ylabel("t(n) / t(1)")
    ax.set_title("verify cost")
    ax.legend(fontsize=7)
    for ax, workload in zip(axes[0][1:], workloads):
        for r in (r for r in rows if r["workload"] == workload):
            budgets = sorted(int(b) for b in r["speedup_by_budget"])
            line, = ax.plot(budgets, [r["speedup_by_budget"][b] for b in budgets], marker=".", label=r["machine"])
            ax.axhline(r["auto_speedup"], color=line.get_color(), linestyle="--", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("fixed budget (nodes); dashed: auto")
        ax.set_ylabel("modelled speedup over plain decoding")
        ax.set_title(workload)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="curves,replay")
    ap.add_argument("--models", nargs="+", default=list(RANDOM_LLAMAS), choices=list(RANDOM_LLAMAS))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--curves-from", nargs="*", default=[], help="JSON files with more curves (e.g. from a GPU run)")
    ap.add_argument("--workloads", default="mtbench,code-edit,loghub,humaneval")
    ap.add_argument("--data", default=str(SHARED_DIR / "data"))
    ap.add_argument("--tokenizer", default=str(SHARED_DIR / "data/tokenizers/llama2/tokenizer.model"))
    ap.add_argument("--out", default=str(RESULTS_DIR / "budget.json"))
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    meta = run_metadata(threads_set_by_benchmark=bool(args.threads))
    parts = args.parts.split(",")
    curves = []
    if "curves" in parts:
        curves = [measure_curve(name, args.repeats) for name in args.models]
    elif os.path.exists(args.out):
        with open(args.out) as f:
            curves = json.load(f)["results"]["curves"]
    for path in args.curves_from:
        with open(path) as f:
            curves += json.load(f)["results"]["curves"]
    rows = []
    if "replay" in parts:
        rows = replay_workloads(args, curves, load_tokenizer(args.tokenizer))
        print()
        print(format_table(rows, [("workload", "workload", ""), ("machine", "machine", ""),
                                  ("best_fixed_budget", "best fixed", ""), ("best_fixed_speedup", "its speedup", ".2f"),
                                  ("auto_speedup", "auto", ".2f"), ("auto_share_of_best", "auto/best", ".3f"),
                                  ("auto_mean_nodes", "auto nodes", ".1f")]))
        print(f"chooser within {1 - PASS_SHARE:.0%} of the best fixed budget everywhere: {all(r['pass'] for r in rows)}")
    path = write_result(args.out, "budget", vars(args), {"curves": curves, "replay": rows}, meta=meta,
                        bars={"auto_within_5pct_of_best_fixed": all(r["pass"] for r in rows) if rows else None})
    plot(curves, rows, path.with_suffix(".png"))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
