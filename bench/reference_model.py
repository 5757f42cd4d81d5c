"""The built-in model, end to end: its quality, and real acceptance side by side with transformers.

    python bench/reference_model.py                      # quality + e2e -> bench/results/reference_model.json
    python bench/reference_model.py --parts e2e --prompts 4 --max-new-tokens 64   # shorter

1. **quality**: held-out loss (nats per token, perplexity and bits per byte) over the held-out
   files of ``lookupdec.demo.data`` (never trained on), and greedy sample completions.
2. **e2e**: on the code-edit workload (real edits from git history; records whose whole prompt
   fits the 1024-token context with room for the output) and on loghub rewriting (8 real lines
   per record), in one process, each prompt run by every method in rotating order:

   | method | call |
   |---|---|
   | `greedy` | `model.generate(do_sample=False)` |
   | `pld` | the same with `prompt_lookup_num_tokens=10` (transformers' prompt lookup) |
   | `assisted` | the same with `assistant_model=` the built-in draft model |
   | `lookupdec` | `Engine`, n-gram + suffix + retrieval over a stdlib index built with the model's tokenizer |
   | `lookupdec+draft` | the same plus the built-in draft model (`DraftConfig(mode="auto")`) |

   Every output is compared with greedy's token for token. Reports tokens/s and its ratio to
   each transformers method, and tokens per target forward (accepted per step).
   One engine per method is kept across prompts, as a server keeps it.

Writes ``bench/results/reference_model.json``. Threads: 1 by default (``--threads``): the
machine is shared, and the models are small.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import subprocess
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import REPO_ROOT, RESULTS_DIR, SHARED_DIR, format_table, run_metadata, write_result  # noqa: E402

from lookupdec import Engine, EngineConfig  # noqa: E402
from lookupdec.demo import DRAFT_DIR, MODEL_DIR, data as demo_data  # noqa: E402
from lookupdec.model import load  # noqa: E402
from lookupdec.workloads import LOG_INSTRUCTION, code_edit  # noqa: E402

METHODS = ("greedy", "pld", "assisted", "lookupdec", "lookupdec+draft")
PLD_NUM_TOKENS = 10
LOG_LINES = 8  # lines per loghub record: a prompt of about 500 tokens with this tokenizer
WARMUP_TEXT = "The quick brown fox jumps over the lazy dog.\n"
# No final newline: the tokenizer merges a newline with the next line's indent, so a prompt
# ending in a bare newline token ends where, in training, files end (the model answers EOS).
SAMPLE_PROMPTS = ("def fibonacci(n):", "import os\n\n\ndef list_python_files(folder):",
                  "class Stack:\n    \"\"\"A last-in, first-out stack.\"\"\"\n\n    def __init__(self):",
                  "The logging module", "<|fim_prefix|>def add(a, b):\n<|fim_suffix|>\n\nprint(add(2, 3))\n<|fim_middle|>")


# -- quality --------------------------------------------------------------------------------------
@torch.inference_mode()
def heldout_quality(model, tokenizer, window: int) -> dict:
    _, held = demo_data.split_sources(demo_data.find_sources())
    texts = [t for t in (demo_data.read_text(s.path) for s in held) if t]
    eot = tokenizer.eos_token_id
    ids = []
    for t in texts:
        ids += tokenizer(t, add_special_tokens=False).input_ids + [eot]
    total_loss, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        x = torch.tensor([ids[start : start + window + 1]])
        logits = model(input_ids=x[:, :-1]).logits.float()
        total_loss += torch.nn.functional.cross_entropy(logits[0], x[0, 1:], reduction="sum").item()
        count += x.shape[1] - 1
    nats = total_loss / count
    n_bytes = sum(len(t.encode()) for t in texts)
    return {"files": len(texts), "tokens": count, "bytes": n_bytes, "loss_nats_per_token": nats,
            "perplexity": math.exp(nats), "bits_per_byte": total_loss / math.log(2) / n_bytes}


def samples(engine, tokenizer, max_new: int) -> list[dict]:
    out = []
    for prompt in SAMPLE_PROMPTS:
        gen = engine.generate(tokenizer(prompt).input_ids, max_new_tokens=max_new)
        out.append({"prompt": prompt, "completion": tokenizer.decode(gen.token_ids, skip_special_tokens=False),
                    "tokens_per_step": gen.stats.mean_accepted})
    return out


# -- workloads ------------------------------------------------------------------------------------
def code_edit_prompts(tokenizer, n: int, limit: int) -> list[list[int]]:
    out = []
    for record in code_edit(str(SHARED_DIR / "data"), with_diff=True):
        ids = tokenizer(record["prompt"]).input_ids
        if len(ids) <= limit:
            out.append(ids)
        if len(out) == n:
            break
    return out


def loghub_prompts(tokenizer, n: int, limit: int) -> list[list[int]]:
    folder = SHARED_DIR / "data" / "loghub"
    systems = sorted(p.name[: -len("_2k.log")] for p in folder.glob("*_2k.log"))
    out, per_system = [], max(1, math.ceil(n / len(systems)))
    for i in range(per_system):
        for system in systems:
            lines = (folder / f"{system}_2k.log").read_text(encoding="utf-8", errors="replace").splitlines()
            chunk = lines[i * LOG_LINES : (i + 1) * LOG_LINES]
            ids = tokenizer(LOG_INSTRUCTION + "\n".join(chunk) + "\n\nJSON:\n").input_ids
            if len(ids) <= limit and len(out) < n:
                out.append(ids)
    return out


def stdlib_index(tokenizer_dir: str, out: str) -> str:
    """A stdlib index built with the model's tokenizer (reused when it exists)."""
    if not os.path.isfile(os.path.join(out, "manifest.json")):
        import sysconfig

        subprocess.run([sys.executable, "-m", "lookupdec", "index", "build", sysconfig.get_paths()["stdlib"],
                        "--include", "*.py", "--exclude", "test", "tests", "idle_test", "site-packages",
                        "--tokenizer", tokenizer_dir, "--out", out], check=True)
    return out


# -- methods --------------------------------------------------------------------------------------
def run_method(method, model, draft, engines, prompt, max_new, pad_id) -> tuple[list[int], dict]:
    gc.collect()
    start = time.perf_counter()
    if method.startswith("lookupdec"):
        gen = engines[method].generate(prompt, max_new_tokens=max_new)
        seconds = time.perf_counter() - start
        s = gen.stats
        return list(gen.token_ids), {"seconds": seconds, "steps": s.steps, "accepted_by_source": dict(s.accepted_by_source),
                                     "overhead_us": s.overhead_us, "forward_ms": s.forward_ms,
                                     "draft_model_steps": s.draft_model_steps}
    kwargs = {"pld": {"prompt_lookup_num_tokens": PLD_NUM_TOKENS}, "assisted": {"assistant_model": draft}}.get(method, {})
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        seq = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new,
                             pad_token_id=pad_id, **kwargs)
    return seq[0, len(prompt):].tolist(), {"seconds": time.perf_counter() - start}


def e2e(args, model, tokenizer, draft, index: str) -> tuple[list[dict], list[dict]]:
    base = EngineConfig().with_index(index)
    engines = {"lookupdec": Engine(model, tokenizer, base),
               "lookupdec+draft": Engine(model, tokenizer, base, draft_model=draft)}
    limit = model.config.max_position_embeddings - args.max_new_tokens - 1
    workloads = {"code-edit": code_edit_prompts(tokenizer, args.prompts, limit),
                 "loghub": loghub_prompts(tokenizer, args.prompts, limit)}
    warm = tokenizer(WARMUP_TEXT).input_ids
    for method in METHODS:
        run_method(method, model, draft, engines, warm, 16, tokenizer.pad_token_id)
    for engine in engines.values():  # verify-cost curves of every context bucket, measured before timing
        for prompt in (p for prompts in workloads.values() for p in prompts):
            engine.cost_model(len(prompt) + args.max_new_tokens // 2)
    runs = []
    for workload, prompts in workloads.items():
        for i, prompt in enumerate(prompts):
            order = METHODS[i % len(METHODS):] + METHODS[: i % len(METHODS)]
            outs = {}
            for method in order:
                out, rec = run_method(method, model, draft, engines, prompt, args.max_new_tokens, tokenizer.pad_token_id)
                outs[method] = out
                runs.append({"workload": workload, "prompt": i, "method": method, "prompt_tokens": len(prompt),
                             "new_tokens": len(out), **rec})
            for r in runs[-len(METHODS):]:
                r["identical_to_greedy"] = outs[r["method"]] == outs["greedy"]
            print(f"  {workload:9s} #{i:<2d} {len(prompt):4d} tok  " + "  ".join(
                f"{r['method']} {r['new_tokens'] / r['seconds']:6.0f}" for r in runs[-len(METHODS):])
                + ("" if all(r["identical_to_greedy"] for r in runs[-len(METHODS):]) else "  MISMATCH"), flush=True)
    return summarize(runs), runs


def summarize(runs: list[dict]) -> list[dict]:
    rows = []
    for workload in dict.fromkeys(r["workload"] for r in runs):
        rate = {}
        for method in METHODS:
            rs = [r for r in runs if r["workload"] == workload and r["method"] == method]
            rate[method] = sum(r["new_tokens"] for r in rs) / sum(r["seconds"] for r in rs)
        for method in METHODS:
            rs = [r for r in runs if r["workload"] == workload and r["method"] == method]
            steps = sum(r.get("steps", 0) for r in rs)
            by_source: dict = {}
            for r in rs:
                for k, v in (r.get("accepted_by_source") or {}).items():
                    by_source[k] = by_source.get(k, 0) + v
            rows.append({"workload": workload, "method": method, "prompts": len(rs),
                         "new_tokens": sum(r["new_tokens"] for r in rs), "tokens_per_s": rate[method],
                         "vs_greedy": rate[method] / rate["greedy"], "vs_pld": rate[method] / rate["pld"],
                         "vs_assisted": rate[method] / rate["assisted"],
                         "tokens_per_step": sum(r["new_tokens"] for r in rs) / steps if steps else None,
                         "accepted_by_source": by_source or None,
                         "identical": sum(r["identical_to_greedy"] for r in rs)})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="quality,samples,e2e",
                    help="any of quality,samples,e2e; parts not run are kept from an existing --out file")
    ap.add_argument("--model", default=MODEL_DIR)
    ap.add_argument("--draft", default=DRAFT_DIR)
    ap.add_argument("--prompts", type=int, default=16, help="prompts per workload (16)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--index", default=str(REPO_ROOT / "indexes" / "stdlib-builtin"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(RESULTS_DIR / "reference_model.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    meta = run_metadata(threads_set_by_benchmark=True)
    model, tokenizer = load(args.model, device="cpu", dtype="float32")
    draft, _ = load(args.draft, device="cpu", dtype="float32")
    results: dict = {"model": {"path": os.path.relpath(args.model, REPO_ROOT),
                               "params": sum(p.numel() for p in model.parameters()),
                               "draft_params": sum(p.numel() for p in draft.parameters()),
                               "training": json.load(open(os.path.join(args.model, "training.json")))
                               if os.path.exists(os.path.join(args.model, "training.json")) else None}}
    parts = args.parts.split(",")
    if os.path.exists(args.out):  # keep the parts not rerun, each with the commit it was measured at
        previous = json.load(open(args.out))
        for key in ("quality", "samples", "e2e", "e2e_runs", "measured_at"):
            if key in previous["results"]:
                results.setdefault(key, previous["results"][key])
    measured_at = results.setdefault("measured_at", {})
    if "quality" in parts:
        t = time.perf_counter()
        results["quality"] = {"target": heldout_quality(model, tokenizer, model.config.max_position_embeddings),
                              "draft": heldout_quality(draft, tokenizer, model.config.max_position_embeddings)}
        measured_at["quality"] = meta["git"]["commit"]
        q = results["quality"]
        print(f"held-out: target {q['target']['loss_nats_per_token']:.3f} nats/token "
              f"({q['target']['bits_per_byte']:.3f} bits/byte), draft {q['draft']['loss_nats_per_token']:.3f} "
              f"({time.perf_counter() - t:.0f} s)")
    if "samples" in parts:
        results["samples"] = samples(Engine(model, tokenizer), tokenizer, 64)
        measured_at["samples"] = meta["git"]["commit"]
        for s in results["samples"]:
            print(f"--- {s['prompt']!r}\n{s['completion']}")
    if "e2e" in parts:
        index = stdlib_index(args.model, args.index)
        rows, runs = e2e(args, model, tokenizer, draft, index)
        results["e2e"] = rows
        results["e2e_runs"] = runs
        measured_at["e2e"] = meta["git"]["commit"]
        print()
        print(format_table(rows, [("workload", "workload", ""), ("method", "method", ""), ("prompts", "n", "d"),
                                  ("tokens_per_s", "tokens/s", ".0f"), ("vs_greedy", "x greedy", ".2f"),
                                  ("vs_pld", "x PLD", ".2f"), ("vs_assisted", "x assisted", ".2f"),
                                  ("tokens_per_step", "tokens/step", ".2f"), ("identical", "identical", "d")]))
    path = write_result(args.out, "reference_model", vars(args), results, meta=meta, threads_set_by_benchmark=True)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
