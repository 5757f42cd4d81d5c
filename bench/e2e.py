"""End-to-end greedy decoding speed on CPU: lookupdec vs transformers, same model, same prompts.

Three methods run side by side on every prompt, in a rotating order per prompt so that machine
noise and cache warmth hit all of them alike:

* ``greedy``  -- ``model.generate(do_sample=False)``
* ``pld``     -- ``model.generate(do_sample=False, prompt_lookup_num_tokens=10)`` (transformers'
  prompt lookup decoding)
* ``lookupdec`` -- ``Engine(model, tokenizer, EngineConfig()).generate(ids, max_new_tokens=N)``
  with the engine's default configuration (``--proposers`` overrides its proposers); one
  Engine per model, kept across prompts as a server keeps it

The generated token ids of the three must be identical (float32 greedy); mismatches are counted
and reported, never hidden. A forward-pre-hook on the model counts (and a forward hook times)
every model call of every method, so "tokens per forward" is measured the same way for all
three; the first call of each run is the prompt's forward (prefill), which gives the
decode-only rate too.

Models: the real pretrained ``stories260K`` (context 512, vocab 512) and randomly initialised
Llama-architecture models of about 20M and 150M parameters with the Llama-2 32k vocabulary.
See ``bench/README.md`` for what the figures mean and ``--help`` for the options.
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR, SHARED_DIR, format_table, load_average, run_metadata, write_result  # noqa: E402

METHODS = ("greedy", "pld", "lookupdec")
# New tokens that come out of a method's first model call, which decode-only rates leave out
# along with that call's time: greedy's prompt forward yields the first token; lookupdec's
# prefill (the prompt but its last token) yields none; prompt lookup's first call (prompt +
# candidates) yields 1 + its matches: 1 is a lower bound, which can only flatter its rate.
FIRST_CALL_TOKENS = {"greedy": 1, "pld": 1, "lookupdec": 0}
PLD_NUM_TOKENS = 10  # transformers' prompt_lookup_num_tokens, as the issue specifies
STORIES_PATH = SHARED_DIR / "models" / "stories260K"
LLAMA2_SPM = SHARED_DIR / "data" / "tokenizers" / "llama2" / "tokenizer.model"
CODE_EDITS = SHARED_DIR / "data" / "code_edits" / "thealgorithms_python.jsonl"
SPEC_BENCH = SHARED_DIR / "data" / "spec_bench" / "question.jsonl"
SEED = 0  # weights of the random models and nothing else (decoding is greedy)
# Random Llama weights drawn with std 0.02 (the HF default) make greedy fall into a one- or
# two-token loop at once, which lookup drafts then predict perfectly: a flattering artefact.
# With std 0.1 the output is pseudo-random (no n-gram repeats): the "nothing accepted" case
# that shows the engine's overhead. --init-std changes it.
DEFAULT_INIT_STD = 0.1
# Story prompts for stories260K: a story it wrote itself, then its first half again.
STORY_OPENINGS = (
    "Once upon a time, there was a little girl named Lily.",
    "One day, a boy named Tim went to the park.",
    "Once upon a time, there was a big red ball.",
    "Tom and Sue were best friends.",
    "Once upon a time, there was a small cat named Kitty.",
    "One sunny day, Ben went to the beach with his mom.",
    "There was a little dog named Max.",
    "Once upon a time, in a big forest, there lived a bear.",
    "Sara liked to play with her toys.",
    "Once upon a time, there was a little bird who could not fly.",
    "Mia had a pretty doll.",
    "One day, a little fish swam in the sea.",
    "Once upon a time, there was a kind old man.",
    "Lucy and her brother went to the store.",
    "Once upon a time, there was a happy frog.",
    "Jack wanted to build a big tower.",
    "Once upon a time, there was a shy bunny.",
    "Anna found a shiny stone in the garden.",
    "Once upon a time, there was a funny clown.",
    "The sun was hot and the children wanted to swim.",
)
WARMUP_TEXT = "The quick brown fox jumps over the lazy dog."
STORY_TOKENS = 160  # length of each generated story before its first half is repeated


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    name: str
    prompts: int  # prompts per workload (default)
    max_new_tokens: int  # default
    max_prompt_tokens: int  # prompts are cut to their LAST tokens (BOS kept) to fit this
    workloads: tuple[str, ...]
    llama: dict = field(default_factory=dict)  # LlamaConfig fields for random models


MODELS = {
    "stories260K": ModelSpec(name="stories260K", prompts=20, max_new_tokens=128, max_prompt_tokens=383,
                             workloads=("stories", "code_edits", "summarization")),
    "llama-20M": ModelSpec(name="llama-20M", prompts=8, max_new_tokens=64, max_prompt_tokens=1024,
                           workloads=("code_edits", "summarization"),
                           llama=dict(hidden_size=256, intermediate_size=688, num_hidden_layers=8,
                                      num_attention_heads=4, num_key_value_heads=4)),
    "llama-150M": ModelSpec(name="llama-150M", prompts=4, max_new_tokens=32, max_prompt_tokens=768,
                            workloads=("code_edits", "summarization"),
                            llama=dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=14,
                                       num_attention_heads=12, num_key_value_heads=12)),
}
QUICK = {"stories260K": (3, 32), "llama-20M": (2, 16), "llama-150M": (1, 16)}  # (prompts, new tokens)


# -- models and tokenizers -----------------------------------------------------------------------
def load_model(spec: ModelSpec, init_std: float):
    """Returns (model, hf_tokenizer, encode, info)."""
    if spec.name == "stories260K":
        from lookupdec.model import load

        model, tokenizer = load(STORIES_PATH, device="cpu", dtype="float32")
        encode = lambda text: tokenizer(text).input_ids  # noqa: E731 (BOS included)
        info = {"source": str(STORIES_PATH), "weights": "pretrained (TinyStories)"}
    else:
        import transformers

        from lookupdec.model import SentencePieceTokenizer

        tokenizer = SentencePieceTokenizer(str(LLAMA2_SPM))  # exact Llama-2 encoding, BOS first
        config = transformers.LlamaConfig(vocab_size=32000, max_position_embeddings=4096, bos_token_id=1,
                                          eos_token_id=2, tie_word_embeddings=False,
                                          initializer_range=init_std, **spec.llama)
        torch.manual_seed(SEED)
        model = transformers.LlamaForCausalLM(config).to(torch.float32).eval()
        encode = tokenizer.encode
        info = {"weights": f"random, seed {SEED}, initializer_range {init_std}", "llama_config": spec.llama,
                "tokenizer": str(LLAMA2_SPM)}
    eos = tokenizer.eos_token_id
    model.generation_config.pad_token_id = eos
    model.generation_config.eos_token_id = eos
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    info.update(params=sum(p.numel() for p in model.parameters()), dtype="float32",
                context=model.config.max_position_embeddings, vocab=model.config.vocab_size)
    return model, tokenizer, encode, info


# -- workloads -----------------------------------------------------------------------------------
def read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        sys.exit(f"benchmark data not found: {path} (set LOOKUPDEC_SHARED to the shared folder)")
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def code_edit_texts(n: int) -> list[str]:
    """The change message, the diff and the file before; the model writes the file after.

    The same prompts as ``lookupdec simulate``'s code-edit workload (``lookupdec.workloads``).
    """
    from lookupdec.workloads import code_edit

    read_jsonl(CODE_EDITS)  # a clear exit if the data is missing
    return [record["prompt"] for record, _ in zip(code_edit(str(SHARED_DIR / "data"), with_diff=True), range(n))]


def summarization_texts(n: int) -> list[str]:
    rows = [r for r in read_jsonl(SPEC_BENCH) if r["category"] == "summarization"][:n]
    return [r["turns"][0] for r in rows]


def story_prompts(model, encode, n: int) -> list[list[int]]:
    """A story stories260K writes itself (greedy), followed by its first half again."""
    out = []
    for opening in STORY_OPENINGS[:n]:
        ids = encode(opening)
        with torch.inference_mode():
            story = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                   do_sample=False, max_new_tokens=STORY_TOKENS)[0].tolist()
        story = [t for t in story if t != model.generation_config.eos_token_id]
        out.append(story + story[1: len(story) // 2])  # BOS not repeated
    return out


def fit(ids: list[int], limit: int, bos: int | None) -> list[int]:
    """Keep the LAST ``limit`` tokens (the end of a prompt says what to write next), BOS first."""
    if len(ids) <= limit:
        return ids
    if bos is not None and ids and ids[0] == bos:
        return [bos, *ids[len(ids) - limit + 1:]]
    return ids[-limit:]


def build_workloads(spec, model, tokenizer, encode, n_prompts, max_new, max_prompt) -> dict[str, list[list[int]]]:
    limit = min(max_prompt, model.config.max_position_embeddings - max_new - 1)
    texts = {"code_edits": lambda: [encode(t) for t in code_edit_texts(n_prompts)],
             "summarization": lambda: [encode(t) for t in summarization_texts(n_prompts)],
             "stories": lambda: story_prompts(model, encode, n_prompts)}
    return {w: [fit(ids, limit, tokenizer.bos_token_id) for ids in texts[w]()] for w in spec.workloads}


# -- timing --------------------------------------------------------------------------------------
class ForwardMeter:
    """Counts and times every call of the model (pre-hook + hook), for every method alike."""

    def __init__(self, model) -> None:
        self.durations: list[float] = []
        self._t0 = 0.0
        self._handles = [model.register_forward_pre_hook(self._pre), model.register_forward_hook(self._post)]

    def _pre(self, module, args):
        self._t0 = time.perf_counter()

    def _post(self, module, args, output):
        self.durations.append(time.perf_counter() - self._t0)

    def reset(self) -> None:
        self.durations = []

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def run_method(method: str, model, engine, prompt: list[int], max_new: int) -> tuple[list[int], dict]:
    extra = {}
    gc.collect()
    start = time.perf_counter()
    if method == "lookupdec":
        gen = engine.generate(prompt, max_new_tokens=max_new)
        seconds = time.perf_counter() - start
        out = list(gen.token_ids)
        s = gen.stats
        extra = {"steps": s.steps, "mean_accepted": s.mean_accepted, "overhead_us": s.overhead_us,
                 "draft_us": s.draft_us, "forward_ms": s.forward_ms, "prefill_ms": s.prefill_ms,
                 "mean_tree_nodes": s.mean_tree_nodes, "accepted_by_source": dict(s.accepted_by_source),
                 "prefix_reused": s.prefix_reused, "prefill_tokens": s.prefill_tokens,
                 # wall time outside prefill and the steps' forward + overhead (text assembly, set-up)
                 "other_ms_per_step": (seconds * 1e3 - s.prefill_ms - s.steps * (s.forward_ms + s.overhead_us / 1e3))
                 / s.steps if s.steps else None}
    else:
        kwargs = {"prompt_lookup_num_tokens": PLD_NUM_TOKENS} if method == "pld" else {}
        ids = torch.tensor([prompt], device=model.device)
        with torch.inference_mode():
            seq = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_new, **kwargs)
        if ids.device.type == "cuda":  # the last token's kernels done, as the engine's own timing
            torch.cuda.synchronize(ids.device)
        seconds = time.perf_counter() - start
        out = seq[0, len(prompt):].tolist()
    return out, {"seconds": seconds, **extra}


def bench_model(name: str, args) -> tuple[dict, list[dict]]:
    from lookupdec import Engine, EngineConfig

    spec = MODELS[name]
    n_prompts, max_new = (args.prompts, args.max_new_tokens)
    if args.quick:
        n_prompts, max_new = n_prompts or QUICK[name][0], max_new or QUICK[name][1]
    n_prompts, max_new = n_prompts or spec.prompts, max_new or spec.max_new_tokens
    max_prompt = args.max_prompt_tokens or (min(spec.max_prompt_tokens, 256) if args.quick else spec.max_prompt_tokens)
    t_load = time.perf_counter()
    model, tokenizer, encode, info = load_model(spec, args.init_std)
    workloads = build_workloads(spec, model, tokenizer, encode, n_prompts, max_new, max_prompt)
    engine_config = EngineConfig(proposers=tuple(args.proposers)) if args.proposers else EngineConfig()
    # One engine per repeat, built before the meter (start-up probes are not counted): an engine
    # with a global cache must never have seen the prompt it is timed on, or a repeat would
    # replay its own earlier output. Each repeat's engine sees the same history as repeat 0's.
    engines = [Engine(model, tokenizer, engine_config) for _ in range(args.repeats)]
    engine = engines[0]
    info.update(prompts_per_workload=n_prompts, max_new_tokens=max_new, max_prompt_tokens=max_prompt,
                engine_config=repr(engine_config), tree_mode=engine.target.tree_mode,
                load_s=round(time.perf_counter() - t_load, 2), load_average_before=load_average())
    print(f"\n== {name}: {info['params'] / 1e6:.2f}M params, {n_prompts} prompts/workload x {max_new} new tokens, "
          f"prompts <= {max_prompt} tokens, tree_mode={engine.target.tree_mode}", flush=True)
    meter = ForwardMeter(model)
    warm = encode(WARMUP_TEXT)  # in no workload: the warm-up output must not help any prompt
    for method in METHODS:  # once per method (and engine): allocator, oneDNN, cost calibration
        for e in engines if method == "lookupdec" else engines[:1]:
            run_method(method, model, e, warm, min(max_new, 16))
    runs = []
    for workload, prompts in workloads.items():
        for i, prompt in enumerate(prompts):
            for repeat in range(args.repeats):
                order = METHODS[(i + repeat) % 3:] + METHODS[: (i + repeat) % 3]  # rotate who goes first
                trio = [run_once(method, model, engines[repeat], meter, prompt, max_new) for method in order]
                outs = {r["method"]: r.pop("_out") for r in trio}
                trio = [{"model": name, "workload": workload, "prompt": i, "repeat": repeat, **r} for r in trio]
                for r in trio:
                    r.update(identical_to_greedy=outs[r["method"]] == outs["greedy"],
                             first_divergence=first_divergence(outs[r["method"]], outs["greedy"]))
                runs.extend(trio)
                print(f"  {workload:13s} #{i:<2d} prompt {len(prompt):4d} tok  " + "  ".join(
                    f"{r['method']} {r['new_tokens'] / r['seconds']:7.1f} tok/s" for r in trio)
                      + ("" if all(r["identical_to_greedy"] for r in trio) else "  MISMATCH"), flush=True)
    meter.remove()
    info["load_average_after"] = load_average()
    return info, runs


def run_once(method, model, engine, meter, prompt, max_new) -> dict:
    """One timed run; the model calls it made are counted and timed by ``meter``."""
    meter.reset()
    out, rec = run_method(method, model, engine, prompt, max_new)
    fw = meter.durations
    return {"method": method, "prompt_tokens": len(prompt), "load_1m": round(os.getloadavg()[0], 2),
            "new_tokens": len(out), "forwards": len(fw), "decode_forwards": max(len(fw) - 1, 0),
            "prompt_forward_s": fw[0] if fw else None,
            "decode_forward_ms": 1e3 * statistics.fmean(fw[1:]) if len(fw) > 1 else None, **rec, "_out": out}


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


# -- summary -------------------------------------------------------------------------------------
def fastest_repeats(runs: list[dict]) -> list[dict]:
    """Per model, workload, prompt and method, the repeat with the least time (noise only adds)."""
    best = {}
    for r in runs:
        key = (r["model"], r["workload"], r["prompt"], r["method"])
        if key not in best or r["seconds"] < best[key]["seconds"]:
            best[key] = r
    return list(best.values())


def summarize(all_runs: list[dict]) -> list[dict]:
    """Per model x workload; timings from each prompt's fastest repeat, identity over all runs."""
    runs, rows = fastest_repeats(all_runs), []
    keys = list(dict.fromkeys((r["model"], r["workload"]) for r in runs))  # first-seen order
    for model, workload in keys:
        group = [r for r in runs if r["model"] == model and r["workload"] == workload]
        row = {"model": model, "workload": workload, "prompts": len(group) // len(METHODS),
               "mean_prompt_tokens": statistics.fmean(r["prompt_tokens"] for r in group)}
        for m in METHODS:
            g = [r for r in group if r["method"] == m]
            tokens, secs = sum(r["new_tokens"] for r in g), sum(r["seconds"] for r in g)
            decode_s = secs - sum(r["prompt_forward_s"] or 0.0 for r in g)
            row[f"{m}_tok_s"] = tokens / secs
            decode_tokens = tokens - FIRST_CALL_TOKENS[m] * len(g)
            row[f"{m}_decode_tok_s"] = decode_tokens / decode_s if decode_s > 0 else None
            row[f"{m}_tok_per_fwd"] = tokens / sum(r["forwards"] for r in g)
            row[f"{m}_mismatches"] = sum(not r["identical_to_greedy"] for r in all_runs
                                         if (r["model"], r["workload"], r["method"]) == (model, workload, m))
            row[f"{m}_decode_forward_ms"] = weighted(g, "decode_forward_ms", "decode_forwards")
        ld = [r for r in group if r["method"] == "lookupdec"]
        steps = sum(r["steps"] for r in ld)
        row.update(lookupdec_mean_accepted=sum(r["new_tokens"] - r.get("prefill_tokens", 0) for r in ld) / steps,
                   lookupdec_tree_nodes=weighted(ld, "mean_tree_nodes", "steps"),
                   lookupdec_overhead_us=weighted(ld, "overhead_us", "steps"),
                   lookupdec_draft_us=weighted(ld, "draft_us", "steps"),
                   lookupdec_forward_ms=weighted(ld, "forward_ms", "steps"),
                   lookupdec_other_ms_per_step=weighted(ld, "other_ms_per_step", "steps"),
                   lookupdec_prefill_ms=statistics.fmean(r["prefill_ms"] for r in ld))
        for a, b in (("lookupdec", "greedy"), ("lookupdec", "pld"), ("pld", "greedy")):
            row[f"{a}/{b}"] = row[f"{a}_tok_s"] / row[f"{b}_tok_s"]
            da, db = row[f"{a}_decode_tok_s"], row[f"{b}_decode_tok_s"]
            row[f"{a}/{b} decode"] = da / db if da and db else None
        for a, b in (("lookupdec", "greedy"), ("lookupdec", "pld")):
            row[f"{a}/{b} median per prompt"] = statistics.median(per_prompt_ratios(group, a, b))
        row["identical"] = row["pld_mismatches"] == 0 and row["lookupdec_mismatches"] == 0
        rows.append(row)
    return rows


def per_prompt_ratios(group: list[dict], a: str, b: str) -> list[float]:
    """tokens/s of method a over method b, prompt by prompt (robust to one slow outlier)."""
    rate = {(r["prompt"], r["method"]): r["new_tokens"] / r["seconds"] for r in group}
    return [rate[p, a] / rate[p, b] for p in sorted({r["prompt"] for r in group})]


def weighted(group: list[dict], key: str, weight: str) -> float | None:
    pairs = [(r[key], r[weight]) for r in group if r[key] is not None]
    total = sum(w for _, w in pairs)
    return sum(v * w for v, w in pairs) / total if total else None


def bars(rows: list[dict], runs: list[dict]) -> list[dict]:
    """The issue's bars, evaluated on end-to-end tokens/s and, alongside, decode-only tokens/s."""
    out = []
    story = [r for r in fastest_repeats(runs) if r["model"] == "stories260K"]
    if story:
        tot = {m: (sum(r["new_tokens"] for r in story if r["method"] == m),
                   sum(r["seconds"] for r in story if r["method"] == m)) for m in METHODS}
        ratio = (tot["lookupdec"][0] / tot["lookupdec"][1]) / (tot["pld"][0] / tot["pld"][1])
        per = {r["workload"]: round(r["lookupdec/pld"], 3) for r in rows if r["model"] == "stories260K"}
        out.append({"bar": "stories260K: lookupdec / transformers prompt lookup > 1.0 (aim 1.5)",
                    "value": round(ratio, 3), "per_workload": per, "passed": ratio > 1.0, "aim_met": ratio >= 1.5})
    for r in rows:
        if r["model"] == "llama-150M" and r["lookupdec_mean_accepted"] < NOTHING_ACCEPTED:
            out.append({"bar": f"llama-150M {r['workload']} (nothing accepted): lookupdec / greedy >= 0.95",
                        "value": round(r["lookupdec/greedy"], 3),
                        "decode_only": None if r["lookupdec/greedy decode"] is None
                        else round(r["lookupdec/greedy decode"], 3),
                        "mean_accepted": round(r["lookupdec_mean_accepted"], 3),
                        "passed": r["lookupdec/greedy"] >= 0.95})
    return out


NOTHING_ACCEPTED = 1.05  # mean tokens per step below this: drafts (almost) never accepted

TABLE = [("model", "model", ""), ("workload", "workload", ""), ("prompts", "n", "d"),
         ("mean_prompt_tokens", "prompt", ".0f"),
         ("greedy_tok_s", "greedy t/s", ".1f"), ("pld_tok_s", "pld t/s", ".1f"),
         ("lookupdec_tok_s", "lookupdec t/s", ".1f"),
         ("lookupdec/greedy", "ld/greedy", ".2f"), ("lookupdec/pld", "ld/pld", ".2f"),
         ("pld/greedy", "pld/greedy", ".2f"), ("lookupdec/greedy decode", "ld/greedy dec", ".2f"),
         ("lookupdec_mean_accepted", "ld MAT", ".2f"), ("pld_tok_per_fwd", "pld tok/fwd", ".2f"),
         ("lookupdec_tok_per_fwd", "ld tok/fwd", ".2f"), ("lookupdec_tree_nodes", "ld nodes", ".1f"),
         ("lookupdec_overhead_us", "ld ovh us", ".0f"), ("lookupdec_forward_ms", "ld fwd ms", ".2f"),
         ("lookupdec_other_ms_per_step", "ld other ms", ".2f"),
         ("pld_decode_forward_ms", "pld fwd ms", ".2f"), ("greedy_decode_forward_ms", "greedy fwd ms", ".2f"),
         ("identical", "identical", "")]


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python bench/e2e.py",
        description="End-to-end greedy tokens/s on CPU: transformers generate (greedy), transformers "
                    "prompt lookup (prompt_lookup_num_tokens=10) and lookupdec's Engine (default "
                    "config, n-gram proposer), side by side on the same prompts and model, with "
                    "token-for-token identity checked. Writes a table and a JSON result file.",
        epilog="Defaults (per workload): stories260K 20 prompts x 128 new tokens (workloads: stories, "
               "code_edits, summarization; prompts cut to their last 383 tokens to fit the 512 context); "
               "llama-20M 8 x 64 and llama-150M 4 x 32 (code_edits, summarization; prompts cut to 1024 / 768 "
               "tokens). The full run takes about 10 minutes on 2 CPU cores; --quick about 1 minute.")
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS),
                   help="models to run (default: all three)")
    p.add_argument("--prompts", type=int, default=None, metavar="N",
                   help="prompts per workload for every model (default: per model, see below)")
    p.add_argument("--max-new-tokens", type=int, default=None, metavar="N",
                   help="new tokens per prompt for every model (default: per model)")
    p.add_argument("--max-prompt-tokens", type=int, default=None, metavar="N",
                   help="cut prompts to their last N tokens (always also to fit the model's context)")
    p.add_argument("--init-std", type=float, default=DEFAULT_INIT_STD, metavar="S",
                   help=f"initializer_range of the random models (default {DEFAULT_INIT_STD}: outputs do not "
                        "repeat, so nothing is accepted; 0.02 makes them loop, so everything is)")
    p.add_argument("--proposers", type=lambda v: [x for x in v.split(",") if x], default=None, metavar="A,B",
                   help="lookupdec's proposers, comma-separated (default: EngineConfig()'s default; "
                        "the issue-2 bars name the n-gram proposer: --proposers ngram)")
    p.add_argument("--repeats", type=int, default=1, metavar="R",
                   help="run each prompt's three methods R times (order rotated each time) and time each "
                        "method by its fastest repeat; identity is checked on every run (default 1)")
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="torch.set_num_threads(N) (default: leave torch's default, recorded in the JSON); "
                        "on a machine shared with other jobs 1 thread is far less noisy")
    p.add_argument("--quick", action="store_true",
                   help="smoke run of about a minute: few prompts, few tokens, prompts <= 256 tokens")
    p.add_argument("--out", type=Path, default=None,
                   help="result JSON (default bench/results/e2e.json, or e2e_quick.json with --quick)")
    args = p.parse_args(argv)
    for name in ("prompts", "max_new_tokens", "max_prompt_tokens", "threads", "repeats"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    logging.getLogger("lookupdec").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", category=UserWarning)
    if args.threads:
        torch.set_num_threads(args.threads)
    meta = run_metadata(threads_set_by_benchmark=bool(args.threads))  # the code this run imports
    print(f"torch threads {torch.get_num_threads()} ({'--threads' if args.threads else 'default'}), "
          f"load average {load_average()}", flush=True)
    t0 = time.perf_counter()
    models, runs = {}, []
    for name in args.models:
        models[name], model_runs = bench_model(name, args)
        runs.extend(model_runs)
    rows = summarize(runs)
    bar_status = bars(rows, runs)
    print("\n" + format_table(rows, TABLE))
    for b in bar_status:
        print(f"{'PASS' if b['passed'] else 'MISS'}  {b['bar']}: {b['value']}"
              + (f" (decode only {b['decode_only']})" if b.get("decode_only") is not None else ""))
    out = args.out or RESULTS_DIR / ("e2e_quick.json" if args.quick else "e2e.json")
    config = {"methods": {"greedy": "model.generate(do_sample=False)",
                          "pld": f"model.generate(do_sample=False, prompt_lookup_num_tokens={PLD_NUM_TOKENS})",
                          "lookupdec": "Engine(model, tokenizer, EngineConfig(" + (
                              f"proposers={tuple(args.proposers)!r}" if args.proposers else "")
                          + ")).generate(ids, max_new_tokens=N)"},
              "engine_state": "one Engine per model, kept across prompts as a server keeps it (any global "
                              "cache its proposers have sees the warm-up and earlier prompts' outputs)",
              "dtype": "float32", "device": "cpu", "init_std": args.init_std, "seed": SEED,
              "method_order": "rotated per prompt (and per repeat)", "repeats": args.repeats,
              "repeat_engines": "one lookupdec Engine per repeat: none sees a prompt twice",
              "timing_statistic": "sum over prompts of each prompt's fastest repeat", "warmup": f"one run per method (and engine) per model on {WARMUP_TEXT!r}, in no workload",
              "timer": "time.perf_counter around each generate call (prefill included)",
              "decode_only": "(new tokens - tokens of the first model call) / (run time - the first call), "
                             f"first-call tokens {FIRST_CALL_TOKENS} (pld: a lower bound)",
              "models": models}
    path = write_result(out, "e2e", config, runs, summary=rows, bars=bar_status,
                        threads_set_by_benchmark=bool(args.threads), meta=meta,
                        wall_s=round(time.perf_counter() - t0, 1))
    print(f"\nwrote {path} ({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
