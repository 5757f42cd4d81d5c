"""The chooser's layers, each switched off in turn, on the real model: what each one buys.

The chooser (``lookupdec/budget.py``, ``lookupdec/step.py``) learns t(n), calibrates each node's
chance and keeps the tree size that maximises expected tokens per second; on top of that sit
correction layers (those whose removal cost nothing beyond the noise are gone: the optimism,
per-size records and their hindsight and the prices; docs/design/chooser.md).
Each variant below is the default engine with one layer off (its constant set
while that engine runs), beside ``plain`` (no drafts) and the default twice (``default`` and
``default-again``, two engines of the same code: their gap is the noise a layer's effect must
exceed to count):

* ``no-explore``      -- ``EXPLORE_EVERY`` never reached and ``EXPLORE_ROOT`` off: no size is
  verified only to re-measure it
* ``no-root-explore`` -- ``EXPLORE_ROOT`` off (the root alone is never explored)
* ``no-request``      -- ``REQUEST_PRIOR`` huge: no per-request correction
* ``no-scale``        -- ``SCALE_PRIOR`` huge: no step-wide correction of the calibrated chances
* ``fixed4``          -- ``budget="fixed", max_nodes=4``: no chooser at all

Every output must equal ``plain``'s (greedy identity). Per workload and variant: tokens/s per
request (prefill included) over ``plain``, and over ``default``.

    python bench/chooser_ablation.py --threads 2 --prompts 4
    python bench/chooser_ablation.py --workloads chat log_to_json --prompts 2 --max-new-tokens 64

Writes ``bench/results/chooser_ablation.json`` (``--out``).
"""
from __future__ import annotations

import argparse
import gc
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR, format_table, run_metadata, write_result  # noqa: E402
from real_model import build_workloads, run_order  # noqa: E402

HUGE = 1e12
VARIANTS = {  # name -> (module, constant, value) switched while that engine runs
    "no-explore": [("budget", "EXPLORE_EVERY", 1 << 40), ("budget", "EXPLORE_ROOT", False)],
    "no-root-explore": [("budget", "EXPLORE_ROOT", False)],
    "no-request": [("step", "REQUEST_PRIOR", HUGE)],
    "no-scale": [("step", "SCALE_PRIOR", HUGE)],
}


@contextmanager
def switched(changes):
    import importlib

    old = []
    for module, name, value in changes:
        mod = importlib.import_module(f"lookupdec.{module}")
        old.append((mod, name, getattr(mod, name)))
        setattr(mod, name, value)
    try:
        yield
    finally:
        for mod, name, value in reversed(old):
            setattr(mod, name, value)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2, help="torch threads (2)")
    p.add_argument("--prompts", type=int, default=4, metavar="N", help="prompts per workload (4)")
    p.add_argument("--max-new-tokens", type=int, default=128, metavar="N", help="tokens per prompt (128)")
    p.add_argument("--workloads", nargs="+", default=["chat", "code_edit", "log_to_json", "summarization"])
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "chooser_ablation.json", help="result JSON")
    args = p.parse_args(argv)

    from lookupdec import Engine, EngineConfig

    meta = run_metadata(threads_set_by_benchmark=True)
    torch.set_num_threads(args.threads)
    loader = Engine.from_pretrained("smollm2", dtype="float32")
    model, tokenizer = loader.target.model, loader.tokenizer
    workloads = {k: v for k, v in build_workloads(loader, args.prompts, 1536).items() if k in args.workloads}
    engines = {"plain": (Engine(model, tokenizer, EngineConfig(proposers=())), []),
               "default": (Engine(model, tokenizer, EngineConfig()), []),
               "default-again": (Engine(model, tokenizer, EngineConfig()), [])}
    for name, changes in VARIANTS.items():
        with switched(changes):
            engines[name] = (Engine(model, tokenizer, EngineConfig()), changes)
    engines["fixed4"] = (Engine(model, tokenizer, EngineConfig(budget="fixed", max_nodes=4)), [])
    warm = loader.chat_prompt("Say hello in three languages.")
    for engine, changes in engines.values():
        with switched(changes):
            engine.generate(warm, max_new_tokens=16)
    runs = []
    for workload, prompts in workloads.items():
        for k, prompt in enumerate(prompts):
            outs = {}
            for name in run_order(list(engines), k, bracket=False):
                engine, changes = engines[name]
                gc.collect()
                with switched(changes):
                    start = time.perf_counter()
                    gen = engine.generate(prompt, max_new_tokens=args.max_new_tokens)
                    seconds = time.perf_counter() - start
                outs[name] = list(gen.token_ids)
                runs.append({"workload": workload, "prompt": k, "method": name, "seconds": seconds,
                             "new_tokens": len(gen.token_ids), "steps": gen.stats.steps,
                             "mean_tree_nodes": gen.stats.mean_tree_nodes})
            for r in runs[-len(engines):]:
                r["identical"] = outs[r["method"]] == outs["plain"]
            print(f"  {workload:13s} #{k} " + "  ".join(
                f"{r['method']} {r['new_tokens'] / r['seconds']:.1f}" for r in runs[-len(engines):]), flush=True)
    rows = []
    for workload in workloads:
        group = [r for r in runs if r["workload"] == workload]
        rate = {m: sum(r["new_tokens"] for r in group if r["method"] == m)
                / sum(r["seconds"] for r in group if r["method"] == m) for m in engines}
        row = {"workload": workload}
        for m in engines:
            row[f"{m}/plain"] = rate[m] / rate["plain"]
        row["identical"] = f"{sum(r['identical'] for r in group)}/{len(group)}"
        rows.append(row)
    columns = [("workload", "workload", "")] + [(f"{m}/plain", m, ".3f") for m in engines] + [
        ("identical", "identical", "")]
    print()
    print(format_table(rows, columns))
    write_result(args.out, "chooser_ablation", {k: str(v) for k, v in vars(args).items()},
                 {"per_workload": rows, "runs": runs, "variants": {k: [list(c) for c in v] for k, v in VARIANTS.items()}},
                 meta=meta, threads_set_by_benchmark=True)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
