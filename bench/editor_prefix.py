"""Editors sharing one engine: what keeping earlier prompts' K/V (``EngineConfig.prefix_cache_mb``)
saves when completions of several files arrive interleaved.

    python bench/editor_prefix.py                      # ~6 minutes on 1 thread; bench/results/editor_prefix.json
    python bench/editor_prefix.py --clients 2 --requests 2 --out /tmp/e.json

``--clients`` editors, each with its own file (the first files of the shared real code edits
of between ``--min-file`` and ``--max-file`` tokens), take turns: request ``r`` of a client is
its file up to ``--start`` + ``r`` x ``--step`` of its tokens (typing on), completed by
``--max-tokens`` new tokens. A request shares its whole file start with the same client's
last request, only a little with the one before it (another client's). Per request, side by
side with the methods in rotated order, on one model:

* ``ld``         -- the default engine: the last prompt's K/V in place, earlier prompts' copies kept
* ``ld/last``    -- ``prefix_cache_mb=0``: the last prompt's K/V only (the engine before the copies)
* ``ld/off``     -- ``prefix_cache=False``: every prompt prefilled whole
* ``greedy``     -- ``transformers`` ``generate`` (greedy)
* ``pld``        -- ``transformers`` prompt lookup (``prompt_lookup_num_tokens=10``)

Every lookupdec output is checked identical to ``greedy``'s. Reported: mean latency per request
(a completion's whole time), its prefill, the prompt tokens reused, the ratios of the means,
and the worst request's ratio ``ld/last`` over ``ld``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR, SHARED_DIR, format_table, load_average, run_metadata, write_result  # noqa: E402
from e2e import run_method  # noqa: E402

CODE_EDITS = SHARED_DIR / "data" / "code_edits" / "thealgorithms_python.jsonl"
ENGINES = {"ld": {}, "ld/last": {"prefix_cache_mb": 0.0}, "ld/off": {"prefix_cache": False}}
METHODS = (*ENGINES, "greedy", "pld")


def client_files(tokenizer, clients: int, lo: int, hi: int) -> list[list[int]]:
    """Token ids of the first ``clients`` distinct files of ``lo`` to ``hi`` tokens."""
    files, seen = [], set()
    with open(CODE_EDITS, encoding="utf-8") as f:
        for line in f:
            edit = json.loads(line)
            if edit["path"] in seen:
                continue
            ids = tokenizer.encode(edit["before"], add_special_tokens=False)
            if lo <= len(ids) <= hi:
                seen.add(edit["path"])
                files.append(ids)
            if len(files) == clients:
                return files
    raise SystemExit(f"only {len(files)} files of {lo}-{hi} tokens in {CODE_EDITS}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--requests", type=int, default=4, help="requests per client")
    p.add_argument("--min-file", type=int, default=400, help="tokens a client's file has at least")
    p.add_argument("--max-file", type=int, default=1200, help="... and at most")
    p.add_argument("--start", type=int, default=200, help="tokens of its file a client's first request holds")
    p.add_argument("--step", type=int, default=40, help="tokens each next request of a client adds")
    p.add_argument("--max-tokens", type=int, default=24, help="new tokens per completion")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "editor_prefix.json")
    args = p.parse_args(argv)
    meta = run_metadata(threads_set_by_benchmark=True)
    torch.set_num_threads(args.threads)
    from lookupdec import Engine, EngineConfig
    from lookupdec.model import load

    model, tokenizer = load(args.model, device="cpu", dtype=torch.float32)
    engines = {name: Engine(model, tokenizer, EngineConfig(**fields)) for name, fields in ENGINES.items()}
    files = client_files(tokenizer, args.clients, args.min_file, args.max_file)
    warm = files[0][:64]
    for name in METHODS:  # kernels, cost curves and allocations, outside the timing
        run_method("lookupdec" if name in engines else name, model, engines.get(name), warm, 8)
    for engine in engines.values():
        engine.target.reset()
        engine.target.prefixes.clear()
    rows, k = [], 0
    for r in range(args.requests):
        for c, ids in enumerate(files):
            prompt = ids[: min(len(ids), args.start + r * args.step)]
            row = {"client": c, "request": r, "prompt_tokens": len(prompt)}
            order = METHODS[k % len(METHODS):] + METHODS[: k % len(METHODS)]
            k += 1
            outs = {}
            for name in order:
                out, info = run_method("lookupdec" if name in engines else name, model, engines.get(name), prompt,
                                       args.max_tokens)
                outs[name] = out
                row[f"{name}_s"] = info["seconds"]
                if name in engines:
                    row[f"{name}_prefill_s"] = info["prefill_ms"] / 1e3
                    row[f"{name}_reused"] = info["prefix_reused"]
            row["identical"] = all(outs[name] == outs["greedy"] for name in engines)
            rows.append(row)
            print(f"client {c} request {r}: {len(prompt)} tokens, ld {row['ld_s']:.2f} s (reused {row['ld_reused']}), "
                  f"ld/last {row['ld/last_s']:.2f} s (reused {row['ld/last_reused']}), greedy {row['greedy_s']:.2f} s",
                  flush=True)
    n = len(rows)
    mean = {name: sum(r[f"{name}_s"] for r in rows) / n for name in METHODS}
    summary = {
        "requests": n,
        "identical": f"{sum(r['identical'] for r in rows)}/{n}",
        "mean_prompt_tokens": sum(r["prompt_tokens"] for r in rows) / n,
        **{f"{name}_mean_s": mean[name] for name in METHODS},
        **{f"{name}_mean_prefill_s": sum(r[f"{name}_prefill_s"] for r in rows) / n for name in ENGINES},
        **{f"{name}_mean_reused": sum(r[f"{name}_reused"] for r in rows) / n for name in ENGINES},
        "ld/last over ld": mean["ld/last"] / mean["ld"],
        "ld/off over ld": mean["ld/off"] / mean["ld"],
        "greedy over ld": mean["greedy"] / mean["ld"],
        "pld over ld": mean["pld"] / mean["ld"],
        "worst request ld/last over ld": min(r["ld/last_s"] / r["ld_s"] for r in rows),
        "load_average_at_end": load_average(),
    }
    table = [{"method": name, "latency": mean[name], "prefill": summary.get(f"{name}_mean_prefill_s"),
              "reused": summary.get(f"{name}_mean_reused"), "speedup": mean[name] / mean["ld"]} for name in METHODS]
    print(format_table(table, [("method", "method", ""), ("latency", "mean s per request", ".3f"),
                               ("prefill", "prefill s", ".3f"), ("reused", "tokens reused", ".1f"),
                               ("speedup", "its latency / ld's", ".2f")]))
    print(f"outputs identical to greedy: {summary['identical']}; worst request ld/last over ld: "
          f"{summary['worst request ld/last over ld']:.2f}")
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    path = write_result(args.out, "editor_prefix", config, {"summary": summary, "requests": rows},
                        threads_set_by_benchmark=True, meta=meta)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
