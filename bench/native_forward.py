"""The compiled decoder (``model/native_forward.py``) against the eager forward, and the weights' pass.

On SmolLM2-135M-Instruct (float32, CPU), per thread count:

* ``forwards`` -- ``TargetModel.verify`` of a chain of ``--sizes`` tokens after a
  ``--context``-token prefix (greedy: the root's row projected, with its picks, as the engine
  asks), through the compiled decoder and through the eager forward (``TargetModel.native``
  off), interleaved per round in rotated order; medians, and compiled over eager;
* ``weights`` -- one pass of the skinny product over the body's packed panels (every linear
  layer but the output projection, as a forward reads them) for 1, 2, 4 and 8 rows, in turn per
  round; medians and the rate at which the weights were read.

    python bench/native_forward.py --threads 1 2      # ~2 minutes, writes bench/results/native_forward.json
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR, format_table, run_metadata, write_result  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 65])
    p.add_argument("--context", type=int, default=256, help="prefix tokens before the timed forwards (256)")
    p.add_argument("--rounds", type=int, default=12, help="interleaved rounds (12)")
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "native_forward.json")
    args = p.parse_args(argv)

    from lookupdec import Engine, EngineConfig
    from lookupdec.native import kernels as native_kernels
    from lookupdec.tree import TokenTree

    meta = run_metadata(threads_set_by_benchmark=True)
    engine = Engine.from_pretrained(config=EngineConfig(proposers=()))
    target = engine.target
    if target.native is None:
        raise SystemExit("the compiled decoder does not take this model here (model/native_forward.py)")
    vocab = target.vocab_size
    target.prefill([(7 * i + 3) % vocab for i in range(args.context)])
    n0, store, native = target.n_cached, target.cache.slot_store, target.native

    def forward(n: int, compiled: bool) -> float:
        tree = TokenTree(token_ids=[(5 * i + 1) % vocab for i in range(n)], parents=list(range(-1, n - 1)))
        target.native = native if compiled else None
        start = time.perf_counter()
        target.verify(tree, rows=[0], picks=4)
        seconds = time.perf_counter() - start
        target.native = native
        store.crop(n0)
        target.n_cached = n0
        return seconds

    body = target.body
    panels = [(m.in_features, m.out_features, body.panels(m)) for m in body.modules]
    weight_bytes = sum(4 * k * n for k, n, _ in panels)

    def weights_pass(rows: int) -> float:
        xs = {k: torch.randn(rows, k) for k, _, _ in panels}
        ys = {n: torch.empty(rows, n) for _, n, _ in panels}
        start = time.perf_counter()
        for k, n, w in panels:
            native_kernels.skinny_linear_at(xs[k].data_ptr(), k, rows, k, w.data_ptr(), n, ys[n].data_ptr())
        return time.perf_counter() - start

    results = {}
    for threads in args.threads:
        torch.set_num_threads(threads)
        for n in args.sizes:  # warm: kernel forms chosen, pages touched
            for compiled in (True, False, False, False):
                forward(n, compiled)
        times = {(n, c): [] for n in args.sizes for c in (True, False)}
        passes = {r: [] for r in (1, 2, 4, 8)}
        for r in range(args.rounds):
            for n in args.sizes:
                for compiled in ((True, False) if r % 2 else (False, True)):
                    times[n, compiled].append(forward(n, compiled))
            for rows in (list(passes) if r % 2 else list(passes)[::-1]):
                passes[rows].append(weights_pass(rows))
        rows_out = []
        for n in args.sizes:
            eager, compiled = (1e3 * statistics.median(times[n, c]) for c in (False, True))
            rows_out.append({"tokens": n, "eager_ms": round(eager, 2), "compiled_ms": round(compiled, 2),
                             "compiled/eager": round(compiled / eager, 3)})
        one = statistics.median(passes[1])
        weights = [{"rows": r, "ms": round(1e3 * statistics.median(v), 2),
                    "GB/s": round(weight_bytes / statistics.median(v) / 1e9, 1),
                    "over one row": round(statistics.median(v) / one, 3)} for r, v in passes.items()]
        results[str(threads)] = {"forwards": rows_out, "weights": weights}
        print(f"== {threads} thread(s)")
        print(format_table(rows_out, [("tokens", "tokens", "d"), ("eager_ms", "eager ms", ".2f"),
                                      ("compiled_ms", "compiled ms", ".2f"), ("compiled/eager", "compiled/eager", ".3f")]))
        print(format_table(weights, [("rows", "rows", "d"), ("ms", "weights pass ms", ".2f"), ("GB/s", "GB/s", ".1f"),
                                     ("over one row", "over one row", ".3f")]))
    write_result(args.out, "native_forward", {"sizes": args.sizes, "context": args.context, "rounds": args.rounds,
                                              "weight_bytes": weight_bytes}, results,
                 threads_set_by_benchmark=True, meta=meta)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
