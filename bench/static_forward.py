"""The static verify forward (``lookupdec/model/static.py``), eager and compiled, against the engine's.

For chains of ``--sizes`` tokens after a ``--context``-token prefix on SmolLM2 (float32, CPU),
per thread count: the engine's own verify forward (``TargetModel.chain_forward_timer``: lean
layers, the compiled core's skinny products, norms, rotary and tree attention), the static
forward run eagerly, and the static forward through ``torch.compile(fullgraph=True)`` (inductor's
C++ backend). Rounds interleave the three per size, rotated; the median per cell is reported with
the compile time (cold: inductor's cache cleared first unless ``--warm``).

    python bench/static_forward.py --threads 1 2          # writes bench/results/static_forward.json
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR, format_table, run_metadata, write_result  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--context", type=int, default=256, help="prefix tokens before the timed forwards (256)")
    p.add_argument("--rounds", type=int, default=15, help="interleaved rounds per size (15)")
    p.add_argument("--warm", action="store_true", help="keep inductor's cache (default: a fresh one, cold compile)")
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "static_forward.json")
    args = p.parse_args(argv)
    if not args.warm:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-")

    from lookupdec import Engine, EngineConfig
    from lookupdec.model.static import StaticForward, context_bucket, tree_inputs_static

    meta = run_metadata(threads_set_by_benchmark=True)
    engine = Engine.from_pretrained(config=EngineConfig(proposers=()))
    model = engine.target.model
    vocab = model.config.vocab_size
    prefix = [(7 * i + 3) % vocab for i in range(args.context)]
    results = {}
    for threads in args.threads:
        torch.set_num_threads(threads)
        engine_forward = engine.target.chain_forward_timer(prefix_len=args.context)
        static = StaticForward(model, context_bucket(args.context + max(args.sizes), 1 << 16))
        with torch.inference_mode():
            static.prefill(prefix)
        compiled = torch.compile(static, fullgraph=True, dynamic=False)
        inputs = {}
        compile_s = {}
        for n in args.sizes:
            chain = [(5 * i + 1) % vocab for i in range(n)]
            inputs[n] = tree_inputs_static(chain, list(range(-1, n - 1)), args.context, n,
                                           context_bucket(args.context + n, static.capacity))
            t = time.perf_counter()
            with torch.inference_mode():
                compiled(*inputs[n])
            compile_s[n] = time.perf_counter() - t

        def run_static(fn, n):
            with torch.inference_mode():
                fn(*inputs[n])

        methods = {"engine": lambda n: engine_forward(n), "static_eager": lambda n: run_static(static, n),
                   "static_compiled": lambda n: run_static(compiled, n)}
        times = {m: {n: [] for n in args.sizes} for m in methods}
        names = list(methods)
        for r in range(args.rounds):
            for n in args.sizes:
                for k in range(len(names)):
                    name = names[(r + k) % len(names)]
                    t = time.perf_counter()
                    methods[name](n)
                    times[name][n].append(time.perf_counter() - t)
        engine.target.reset()
        rows = []
        for n in args.sizes:
            row = {"threads": threads, "tokens": n, "compile_s": round(compile_s[n], 2)}
            for name in names:
                row[f"{name}_ms"] = round(1e3 * statistics.median(times[name][n][1:]), 2)
            row["compiled/engine"] = round(row["static_compiled_ms"] / row["engine_ms"], 3)
            rows.append(row)
        results[threads] = rows
        print(format_table(rows, [("threads", "threads", "d"), ("tokens", "tokens", "d"),
                                  ("engine_ms", "engine ms", ".2f"), ("static_eager_ms", "static eager", ".2f"),
                                  ("static_compiled_ms", "compiled", ".2f"), ("compiled/engine", "compiled/engine", ".3f"),
                                  ("compile_s", "compile s", ".1f")]))
    write_result(args.out, "static_forward",
                 {"sizes": args.sizes, "context": args.context, "rounds": args.rounds, "warm": args.warm},
                 {str(k): v for k, v in results.items()}, threads_set_by_benchmark=True, meta=meta)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
