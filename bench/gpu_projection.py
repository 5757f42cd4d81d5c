"""Projected speed at a real model size: a measured verify cost t(n) times the replayed acceptance.

No 7-8B weights are needed to time a forward: a randomly initialised model with Llama-3-8B's
shapes (bf16 on a GPU) costs what the trained one does. Per tree size n (tokens per forward, the
root included), ``t(n)`` is timed after a ``--context``-token prefix three ways:

* ``eager``    -- transformers' own forward with its cache and the tree's 4D mask (what the engine's
  eager path runs on a GPU);
* ``static``   -- ``model/static.py``'s forward, eager (per-layer K/V buffers written at slots);
* ``captured`` -- the static forward through ``torch.compile``: ``mode="reduce-overhead"`` on CUDA
  (one CUDA graph per shape, replayed), inductor's default on the CPU.

Model-free, the replay simulator gives the accepted tokens per step (MAT) at a fixed budget of
``n - 1`` draft nodes on the shared Vicuna-7B outputs (``--workloads``: MT-Bench, code edits,
loghub; ``lookupdec.simulate.replay``, the engine's own step). The projection per workload and
path: tokens/s = MAT(n) / t(n) at the best n, over plain decoding's 1 / t(1) on the same path.
Host work per step is not in t(n): it is reported by ``bench/overhead_bench.py``.

    python bench/gpu_projection.py --config small          # CPU, a few minutes: the method, small shapes
    python bench/gpu_projection.py --config llama3-8b --device cuda   # the projection (a GPU with ~20 GB)

Writes ``bench/results/gpu_projection_<config>.json`` (``--out``).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR, SHARED_DIR, format_table, run_metadata, write_result  # noqa: E402

CONFIGS = {
    # Llama-3-8B's shapes (config.json of meta-llama/Meta-Llama-3-8B)
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
                      rms_norm_eps=1e-5, tie_word_embeddings=False),
    # SmolLM2-135M's shapes (its GGUF's config): the one-token forward's time on a GPU needs no
    # weights, and its file is larger than what travels to a lent device
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0,
                         rms_norm_eps=1e-5, tie_word_embeddings=True),
    # the same structure, small enough for a CPU test of the method
    "small": dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=2, vocab_size=32000, max_position_embeddings=4096, rms_norm_eps=1e-5,
                  tie_word_embeddings=False),
}
SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
WORKLOADS = ("mtbench", "code-edit", "loghub")


def random_model(name: str, device: str, dtype: torch.dtype):
    """A LlamaForCausalLM of ``CONFIGS[name]``'s shapes, random weights, in eval mode."""
    import transformers

    config = transformers.LlamaConfig(**CONFIGS[name])
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config)
    return model.to(dtype).eval()


def time_paths(model, sizes, context: int, repeats: int, device: str) -> dict:
    """Median seconds of one forward of n chain tokens after ``context`` tokens, per path."""
    from lookupdec.model import new_cache
    from lookupdec.model.static import StaticForward, context_bucket, tree_inputs_static
    from lookupdec.model.cache import crop_cache
    from lookupdec.model.target import tree_inputs
    from lookupdec.tree import TokenTree

    vocab = model.config.vocab_size
    prefix = torch.tensor([[(7 * i + 3) % vocab for i in range(context)]], device=device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    capacity = context_bucket(context + max(sizes), 1 << 20)
    static = StaticForward(model, capacity)
    mode = "reduce-overhead" if device.startswith("cuda") else "default"
    captured = torch.compile(static, mode=mode, fullgraph=True, dynamic=False)
    out = {"eager": {}, "static": {}, "captured": {}, "compile_s": {}}
    with torch.inference_mode():
        cache = new_cache()
        model(input_ids=prefix, past_key_values=cache, use_cache=True)
        static.prefill(prefix[0].tolist())
        for n in sizes:
            chain = [(5 * i + 1) % vocab for i in range(n)]
            tree = TokenTree(token_ids=chain, parents=list(range(-1, n - 1)))
            ids, positions, mask = tree_inputs(tree, context, device=device, dtype=model.dtype)
            inputs = [t.to(device) for t in tree_inputs_static(chain, list(range(-1, n - 1)), context, n,
                                                                context_bucket(context + n, capacity),
                                                                dtype=model.dtype)]

            def eager():
                model(input_ids=ids, position_ids=positions, attention_mask=mask, past_key_values=cache,
                      use_cache=True)
                crop_cache(cache, context)

            t = time.perf_counter()
            for _ in range(3):  # compile, then the graph's warm-up and capture
                captured(*inputs)
            sync()
            out["compile_s"][n] = time.perf_counter() - t
            for name, fn in (("eager", eager), ("static", lambda: static(*inputs)),
                             ("captured", lambda: captured(*inputs))):
                fn()
                sync()
                times = []
                for _ in range(repeats):
                    t = time.perf_counter()
                    fn()
                    sync()
                    times.append(time.perf_counter() - t)
                out[name][n] = statistics.median(times)
    return out


def replay_mat(workloads, sizes, limit: int) -> dict:
    """MAT per workload at a fixed budget of n - 1 draft nodes, n in ``sizes`` (n = 1: 1.0)."""
    from lookupdec.config import EngineConfig
    from lookupdec.model import load_tokenizer
    from lookupdec.proposers import build_proposers
    from lookupdec.simulate import replay
    from lookupdec.workloads import WORKLOADS as BUILDERS

    data = SHARED_DIR / "data"
    tokenizer = load_tokenizer(str(data / "tokenizers" / "llama2" / "tokenizer.model"))
    out = {}
    for workload in workloads:
        records = list(BUILDERS[workload](str(data)))[:limit]
        out[workload] = {1: 1.0}
        for n in sizes:
            if n > 1:
                r = replay(records, tokenizer, build_proposers(EngineConfig()), max_nodes=n - 1, max_depth=n - 1)
                out[workload][n] = r["mat"]
    return out


def project(times: dict, mats: dict) -> list[dict]:
    rows = []
    for workload, mat in mats.items():
        for path in ("eager", "static", "captured"):
            t = times[path]
            plain = 1.0 / t[1]
            best = max(mat, key=lambda n: mat[n] / t[n])
            rows.append({"workload": workload, "path": path, "best_n": best, "mat": round(mat[best], 3),
                         "t1_ms": round(1e3 * t[1], 3), "tn_ms": round(1e3 * t[best], 3),
                         "tokens_per_s": round(mat[best] / t[best], 1), "plain_tokens_per_s": round(plain, 1),
                         "speedup_over_plain": round(mat[best] / t[best] / plain, 3)})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", choices=sorted(CONFIGS), default="small")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--dtype", default=None, help="float32 (default on cpu) or bfloat16 (default on cuda)")
    p.add_argument("--context", type=int, default=512, help="prefix tokens before the timed forwards (512)")
    p.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS))
    p.add_argument("--limit", type=int, default=10, help="records per workload in the replay (10)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if args.device.startswith("cuda")
                                                          else torch.float32)
    meta = run_metadata()
    model = random_model(args.config, args.device, dtype)
    times = time_paths(model, args.sizes, args.context, args.repeats, args.device)
    print(format_table([{"n": n, **{k: round(1e3 * times[k][n], 3) for k in ("eager", "static", "captured")},
                         "compile_s": round(times["compile_s"][n], 1)} for n in args.sizes],
                       [("n", "tokens", "d"), ("eager", "eager ms", ".3f"), ("static", "static ms", ".3f"),
                        ("captured", "captured ms", ".3f"), ("compile_s", "compile s", ".1f")]))
    mats = replay_mat(args.workloads, args.sizes, args.limit)
    rows = project(times, mats)
    print(format_table(rows, [("workload", "workload", "s"), ("path", "path", "s"), ("best_n", "n", "d"),
                              ("mat", "MAT", ".2f"), ("tokens_per_s", "tokens/s", ".1f"),
                              ("plain_tokens_per_s", "plain", ".1f"), ("speedup_over_plain", "over plain", ".2f")]))
    out = args.out or RESULTS_DIR / f"gpu_projection_{args.config}.json"
    write_result(out, "gpu_projection", {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                 {"times_s": {k: {str(n): v for n, v in d.items()} for k, d in times.items()},
                  "mat": {w: {str(n): v for n, v in d.items()} for w, d in mats.items()}, "projection": rows},
                 meta=meta)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
