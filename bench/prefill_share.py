"""How much of one engine's time the server benchmark's requests spend in prefill.

    python bench/prefill_share.py [--prompts 8] [--max-tokens 48] [--threads 1]

The prompts of ``bench/server_batch_bench.py`` (log lines to JSON and code edits in the chat
template, ``real_model.build_workloads``), each generated alone by one engine (greedy, default
config, after one warm-up request): per request the prompt's forward (``stats.prefill_ms``)
against the whole ``generate`` call. Batching shares decoding steps, never prefill, so
``1 / prefill share`` bounds what any batching of this workload can gain. Writes
``bench/results/prefill_share.json``.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR, format_table, run_metadata, write_result  # noqa: E402
from real_model import build_workloads  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--prompts", type=int, default=8, help="prompts per workload (8: the server benchmark's 16)")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "prefill_share.json")
    args = p.parse_args(argv)
    meta = run_metadata(threads_set_by_benchmark=True)
    torch.set_num_threads(args.threads)
    from lookupdec import Engine, EngineConfig
    from lookupdec.model import load

    model, tokenizer = load(args.model, device="cpu", dtype=torch.float32)
    engine = Engine(model, tokenizer, EngineConfig())
    workloads = build_workloads(engine, args.prompts, 1024)
    prompts = [(name, ids) for name in ("log_to_json", "code_edit") for ids in workloads[name][: args.prompts]]
    engine.generate(prompts[0][1], max_new_tokens=8)  # warm-up: cost curve, kernels
    rows = []
    for name, ids in prompts:
        start = time.perf_counter()
        gen = engine.generate(ids, max_new_tokens=args.max_tokens)
        seconds = time.perf_counter() - start
        rows.append({"workload": name, "prompt_tokens": len(ids), "new_tokens": len(gen.token_ids),
                     "seconds": seconds, "prefill_s": gen.stats.prefill_ms / 1e3,
                     "share": gen.stats.prefill_ms / 1e3 / seconds})
    total = sum(r["seconds"] for r in rows)
    prefill = sum(r["prefill_s"] for r in rows)
    summary = {"requests": len(rows), "mean_prompt_tokens": sum(r["prompt_tokens"] for r in rows) / len(rows),
               "seconds": total, "prefill_s": prefill, "prefill_share": prefill / total,
               "batching_bound": total / prefill}
    print(format_table(rows, [("workload", "workload", ""), ("prompt_tokens", "prompt", "d"),
                              ("new_tokens", "new", "d"), ("seconds", "s", ".2f"), ("prefill_s", "prefill s", ".2f"),
                              ("share", "share", ".2f")]))
    print(f"{len(rows)} requests, {summary['mean_prompt_tokens']:.0f} prompt tokens on average: prefill "
          f"{prefill:.1f} of {total:.1f} s ({summary['prefill_share']:.0%}); batching decode can give at most "
          f"{summary['batching_bound']:.2f}x")
    print(f"wrote {write_result(args.out, 'prefill_share', vars(args) | {'out': str(args.out)}, rows, meta=meta, summary=summary, threads_set_by_benchmark=True)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
