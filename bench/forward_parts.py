"""What one sequence's verify forward costs besides the products of its weights.

On SmolLM2-135M-Instruct (float32, CPU; the engine's own forward: ``TargetModel.verify`` with
the kernels it chooses) for chains of ``--sizes`` tokens after a ``--context``-token prefix:

* ``forward_ms``   -- the whole forward, median of ``--repeats``;
* ``norms_ms``     -- what the RMS norms add: the forward against the same forward with every
  norm replaced by the identity (timing only: those logits are thrown away), interleaved; and
  ``core_norms_saves_ms``: the forward with each norm one ``F.rms_norm`` call (as before the
  compiled core's norm) against the engine's (``model/kernels.fused_norms_for``);
* ``rotary_ms``    -- the same for the rotary embedding of queries and keys as the engine
  computes it (``fused``: the compiled core's, ``model/kernels.fused_rotary_for``; else the
  model's ``apply_rotary_pos_emb``) against one returning them unrotated; and
  ``fused_rotary_saves_ms``: the forward with the model's own rotation against the fused one;
* ``lean_layers_saves_ms`` -- the forward with each decoder layer's own ``forward`` (a module
  call per norm, projection, attention and MLP) against the engine's lean layers
  (``model/lean.py``: one function per layer, the same calls bit for bit);
* ``attention_ms`` -- time inside ``scaled_dot_product_attention`` (every layer's call,
  ``batch_profile.AttentionTimer``, in forwards apart from the timed ones);
* ``aten_calls``   -- ATen operator calls per forward (``torch.profiler``), the dispatcher's
  count of small operations a decoder layer in eager PyTorch makes.

The rest of the forward is the linear layers (their weights' read: on a CPU a forward of a few
tokens is bound by it), the output projection, and Python and the dispatcher around the small
operations. ``norms_ms`` and ``rotary_ms`` bound what a fused kernel for each could save.

    python bench/forward_parts.py --threads 2      # ~2 minutes, writes bench/results/forward_parts_2t.json
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from batch_profile import AttentionTimer  # noqa: E402
from common import RESULTS_DIR, format_table, run_metadata, write_result  # noqa: E402


def rotary_module(model):
    """The module whose ``apply_rotary_pos_emb`` the model's attention calls (None: not found)."""
    for m in model.modules():
        if type(m).__name__.endswith("Attention"):
            module = sys.modules.get(type(m).__module__)
            if module is not None and hasattr(module, "apply_rotary_pos_emb"):
                return module
    return None


def unrotated(q, k, *args, **kwargs):
    return q, k


def _eps(norm) -> float:
    return getattr(norm, "variance_epsilon", getattr(norm, "eps", None))


def measure(target, size: int, repeats: int) -> dict:
    forward = target.chain_forward_timer(None)
    module = rotary_module(target.model)
    norms, rotary, layers = target.norms, target.rotary, target.layers
    identity = [(m, lambda x: x) for m, _ in norms]
    aten = [(m, lambda x, m=m: torch.nn.functional.rms_norm(x, m.weight.shape, m.weight, _eps(m))) for m, _ in norms]
    if module is not None:  # (set for the forward as the engine's fused rotation is: swapped)
        unrotated.__wrapped_rotary__ = rotary[1].__wrapped_rotary__ if rotary else module.apply_rotary_pos_emb
        skipped = (module, unrotated)

    def timed(variant: str) -> float:
        target.norms = {"no-norms": identity, "aten-norms": aten}.get(variant, norms)
        target.rotary = skipped if variant == "no-rotary" else None if variant == "own-rotary" else rotary
        target.layers = [] if variant == "own-layers" else layers
        try:
            start = time.perf_counter()
            forward(size)
            return time.perf_counter() - start
        finally:
            target.norms, target.rotary, target.layers = norms, rotary, layers

    variants = (["whole", "no-norms"] + (["no-rotary"] if module is not None else [])
                + (["own-rotary"] if rotary is not None else []) + (["aten-norms"] if norms else [])
                + (["own-layers"] if layers else []))
    for variant in variants * 3:  # kernel choices, caches
        timed(variant)
    times = {v: [] for v in variants}
    for i in range(repeats):  # interleaved, rotated: a drift of the machine's speed hits each alike
        for v in variants[i % len(variants):] + variants[: i % len(variants)]:
            times[v].append(timed(v))
    median = {v: statistics.median(t) for v, t in times.items()}
    timer = AttentionTimer(target.sync)
    with timer:
        for _ in range(repeats):
            forward(size)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        forward(size)
    calls = sum(e.count for e in prof.key_averages())
    return {"tokens": size, "rotary": "fused" if rotary else "own", "forward_ms": 1e3 * median["whole"],
            "norms_ms": 1e3 * (median["whole"] - median["no-norms"]),
            "rotary_ms": 1e3 * (median["whole"] - median["no-rotary"]) if module is not None else None,
            "core_norms_saves_ms": 1e3 * (median["aten-norms"] - median["whole"]) if norms else None,
            "fused_rotary_saves_ms": 1e3 * (median["own-rotary"] - median["whole"]) if rotary else None,
            "lean_layers_saves_ms": 1e3 * (median["own-layers"] - median["whole"]) if layers else None,
            "attention_ms": 1e3 * timer.seconds / repeats, "aten_calls": calls,
            "samples_ms": {v: [round(1e3 * x, 3) for x in t] for v, t in times.items()}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="model (folder, .gguf or alias; smollm2)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1)")
    p.add_argument("--context", type=int, default=512, metavar="N", help="prefix tokens before each chain (512)")
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 8, 16, 32], metavar="N",
                   help="chain lengths, tokens per forward (1 4 8 16 32)")
    p.add_argument("--repeats", type=int, default=30, metavar="N", help="timed forwards per variant and size (30)")
    p.add_argument("--out", type=Path, default=None,
                   help="result JSON (default bench/results/forward_parts_<threads>t.json)")
    args = p.parse_args(argv)
    if args.threads < 1 or args.context < 1 or args.repeats < 1 or min(args.sizes) < 1:
        p.error("--threads, --context, --repeats and every --sizes value must be >= 1")
    out = args.out or RESULTS_DIR / f"forward_parts_{args.threads}t.json"

    from lookupdec import Engine

    meta = run_metadata(threads_set_by_benchmark=True)
    torch.set_num_threads(args.threads)
    engine = Engine.from_pretrained(args.model, device="cpu", dtype="float32")
    target = engine.target
    for n in args.sizes:
        target.prepare(n)
    vocab = target.vocab_size
    target.prefill([(7 * i + 3) % vocab for i in range(args.context)])
    rows = []
    try:
        for n in args.sizes:
            rows.append(measure(target, n, args.repeats))
            r = rows[-1]
            print(f"  {n:3d} tokens: forward {r['forward_ms']:.1f} ms, norms {r['norms_ms']:.2f}, "
                  f"rotary {r['rotary_ms'] if r['rotary_ms'] is None else round(r['rotary_ms'], 2)}, "
                  f"attention {r['attention_ms']:.2f}, {r['aten_calls']} ATen calls", flush=True)
    finally:
        target.reset()
    print(format_table(rows, [("tokens", "tokens", "d"), ("forward_ms", "forward ms", ".1f"),
                              ("norms_ms", "norms ms", ".2f"), ("rotary_ms", "rotary ms", ".2f"),
                              ("core_norms_saves_ms", "core norms save ms", ".2f"),
                              ("fused_rotary_saves_ms", "fused rotation saves ms", ".2f"),
                              ("lean_layers_saves_ms", "lean layers save ms", ".2f"),
                              ("attention_ms", "attention ms", ".2f"), ("aten_calls", "ATen calls", "d")]))
    config = {"model": args.model, "threads": args.threads, "context": args.context, "sizes": args.sizes,
              "repeats": args.repeats, "device": "cpu", "dtype": "float32"}
    path = write_result(out, "forward_parts", config, rows, meta=meta)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
