"""Where a batch of rewrites spends its time, and what one batched verify forward costs.

Two measurements on SmolLM2-135M-Instruct (float32; CPU, or ``--device cuda``), for reading
the server and batch benchmarks (why batching gives rewrites about 2x, not more):

* ``forwards`` -- one batched verify forward (``BatchTarget.verify``) of ``rows x width``
  chain tokens after a ``--context``-token prefix per row, median of ``--repeats``, for each
  ``--shapes`` ROWSxWIDTH (a 1-row shape is one sequence's tree of that many nodes), and of it
  the time inside attention (``torch.nn.functional.scaled_dot_product_attention`` or the core's
  ``kernels.core_attention``, every layer's call summed, in forwards apart from the timed ones;
  ``--attention`` picks the kernel, several take turns) with the K/V bytes they are given: on a CPU
  rows multiply the K/V a forward reads, which memory bandwidth, not arithmetic, bounds;
* ``split``    -- ``--prompts`` rewrite prompts (log lines to JSON and code edits, alternating,
  as ``server_batch_bench.py --workload rewrite`` sends them) through one ``BatchDecoder`` of
  ``--batch`` rows, greedy, ``--max-tokens`` each: the wall time split into prefill forwards
  (``BatchTarget.add``/``add_many``), verify forwards (``BatchTarget.verify``) and the rest
  (of it: drafting and merging, acceptance, KV commit, observe and learn), with the verified
  slots (nodes and padding) against the tokens produced; and the host work of each step whose
  batch is full (the step less its forward's model call: the forward's inputs and mask count
  as host work), with its parts; ``--cprofile PATH`` writes its
  Python profile. ``--clients N``: the prompts arrive as ``server_batch_bench.py``'s N
  clients send them (each the next prompt nobody has taken as its last one ends), and they
  also run one at a time on a fresh engine: the batching server's ratio in one process,
  without HTTP or a server's threads.

    python bench/batch_profile.py --threads 2      # ~2 minutes, writes bench/results/batch_profile_2t.json
    python bench/batch_profile.py --threads 2 --shapes 1x1 --repeats 1 --batch 16 --clients 8 --out PATH
    python bench/batch_profile.py --threads 2 --shapes 8x4 8x8 16x4 16x8 --batch 16 --clients 8 --out PATH

With ``--clients``, the ratio's ceiling too (``ceiling``): what any exact batching could reach at
most on this machine, from the split's prefill and the fastest verified token of the forwards.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR, add_device_option, format_table, run_metadata, write_result  # noqa: E402
from real_model import build_workloads  # noqa: E402


def shape(text: str) -> tuple[int, int]:
    try:
        rows, width = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected ROWSxWIDTH, e.g. 8x8") from None
    if rows < 1 or width < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: rows and width must be >= 1")
    return rows, width


def chain(root: int, width: int, generator: torch.Generator):
    from lookupdec.tree import Draft, TokenTree

    tokens = torch.randint(0, 40000, (width - 1,), generator=generator).tolist()
    drafts = [Draft(tuple(tokens), tuple(range(-1, width - 2)), tuple([0.9] * (width - 1)), "chain")] if width > 1 else []
    return TokenTree.from_drafts(root, drafts, max_nodes=width - 1, max_depth=width)


class AttentionTimer:
    """Inside ``with``: every ``scaled_dot_product_attention`` call timed (``seconds``, summed)
    with the bytes of the K and V tensors it is given (``kv_bytes``; each read at least once).
    On a GPU each call waits for the device, so the forward it sits in runs slower than untimed.

    >>> q, kv = torch.zeros(2, 4, 1, 8), torch.zeros(2, 2, 16, 8)
    >>> original = torch.nn.functional.scaled_dot_product_attention
    >>> with AttentionTimer(lambda: None) as timer:
    ...     out = torch.nn.functional.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
    >>> out.shape, timer.kv_bytes, timer.seconds > 0   # K and V: 2 x 2 x 16 x 8 floats each
    (torch.Size([2, 4, 1, 8]), 4096, True)
    >>> torch.nn.functional.scaled_dot_product_attention is original
    True
    """

    def __init__(self, sync) -> None:
        self.sync, self.seconds, self.kv_bytes = sync, 0.0, 0

    def __enter__(self):
        self._original = torch.nn.functional.scaled_dot_product_attention

        def timed(query, key, value, *args, **kwargs):
            self.sync()
            start = time.perf_counter()
            out = self._original(query, key, value, *args, **kwargs)
            self.sync()
            self.seconds += time.perf_counter() - start
            self.kv_bytes += (key.numel() + value.numel()) * key.element_size()
            return out

        torch.nn.functional.scaled_dot_product_attention = timed  # (transformers calls it through the module)
        from lookupdec.model import kernels

        self._core = kernels.core_attention  # the core's tree attention (grouped_attention calls it by name)

        def timed_core(query, key, value, plan, scale, *args):
            self.sync()
            start = time.perf_counter()
            out = self._core(query, key, value, plan, scale, *args)
            self.seconds += time.perf_counter() - start
            self.kv_bytes += (key.numel() + value.numel()) * key.element_size()
            return out

        kernels.core_attention = timed_core
        return self

    def __exit__(self, *exc) -> None:
        from lookupdec.model import kernels

        torch.nn.functional.scaled_dot_product_attention = self._original
        kernels.core_attention = self._core


ATTENTION_MODES = ("core", "grouped", "gqa")


def set_attention(mode: str) -> None:
    """core: the compiled tree attention (``kernels.core_attention``, the engine's default);
    grouped: each K/V head's query heads folded into one SDPA call; gqa: transformers' own call
    (SDPA's enable_gqa). Each for masked calls of ``GROUPED_MIN_QUERIES`` or more query tokens."""
    from lookupdec.model import kernels

    kernels.GROUPED_ATTENTION = mode != "gqa"
    kernels.CORE_ATTENTION = mode == "core"


def forwards(engine, shapes, context: int, repeats: int, modes=("grouped",)) -> list[dict]:
    """Each shape's forwards in each attention mode of ``modes`` (``--attention``: core, grouped,
    gqa), the modes taking turns forward by forward so that the machine's drift falls on each alike."""
    from lookupdec.model import kernels
    from lookupdec.model.batch import BatchTarget

    generator = torch.Generator().manual_seed(0)
    out = []
    for rows, width in shapes:
        target = BatchTarget(engine.target, rows)
        for _ in range(rows):
            target.add(torch.randint(0, 40000, (context,), generator=generator).tolist())
        seconds = {m: [] for m in modes}
        attention = {m: [] for m in modes}
        try:
            for r in range(2 * repeats + 2):  # two first rounds choose the kernels' forms, untimed;
                for mode in modes if r % 2 == 0 else modes[::-1]:  # then untimed attention and timed alternate
                    set_attention(mode)
                    trees = [chain(5, width, generator) for _ in range(rows)]
                    timer = AttentionTimer(engine.target.sync) if r >= 2 and r % 2 else None
                    start = time.perf_counter()
                    if timer is None:
                        target.verify(trees)
                    else:
                        with timer:
                            target.verify(trees)
                    engine.target.sync()  # (a GPU's forward ends on the device, not at its launch)
                    if timer is not None:
                        attention[mode].append((timer.seconds, timer.kv_bytes))
                    elif r >= 2:
                        seconds[mode].append(time.perf_counter() - start)
                    target.commit([[] for _ in range(rows)])
        finally:
            set_attention(modes[0])
        for mode in modes:
            median = statistics.median(seconds[mode])
            att_s, kv_bytes = sorted(attention[mode])[len(attention[mode]) // 2]  # (kv_mb: MiB; GB/s: 1e9 bytes)
            out.append({"rows": rows, "width": width, "tokens": rows * width, "attention": mode,
                        "median_ms": median * 1e3, "ms_per_token": median * 1e3 / (rows * width),
                        "attention_ms": att_s * 1e3, "kv_mb": kv_bytes / 2**20,
                        "kv_gb_per_s": kv_bytes / att_s / 1e9 if att_s else None})
    return out


def split(engine, prompts, batch: int, max_tokens: int, cprofile: Path | None = None, clients: int = 0) -> dict:
    from lookupdec.batch import BatchDecoder, BatchRequest

    decoder = BatchDecoder(engine, batch, record_widths=True)
    spent = {"prefill": 0.0, "verify": 0.0, "plan": 0.0, "accept": 0.0, "commit": 0.0, "finish": 0.0}
    slots = {"nodes": 0, "padded": 0, "kv_read": 0, "kv_prefix": 0}
    depth = [0]  # (add_many calls add: time the outer call only)

    def timed(kind, call, sync=False):
        def run(*args, **kwargs):
            depth[0] += 1
            start = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                if sync:
                    engine.target.sync()  # a GPU's work ends on the device, not at its launch
                depth[0] -= 1
                if depth[0] == 0:
                    spent[kind] += time.perf_counter() - start
        return run

    verify = timed("verify", decoder.target.verify, sync=True)
    # host work of the steps whose batch is full (every one of ``batch`` rows active): the step's
    # wall time but its verify forward's model call (the forward's inputs, mask included, are host
    # work), each part's share besides
    full = {"steps": 0, "seconds": 0.0, "forward": 0.0, "inputs": 0.0, "plan": 0.0, "choose": 0.0,
            "accept": 0.0, "commit": 0.0, "finish": 0.0, "emit": 0.0}
    now = {}

    def counting(kind, call):
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                now[kind] = now.get(kind, 0.0) + time.perf_counter() - start
        return run

    decoder.target.inputs = counting("inputs", decoder.target.inputs)
    choose = decoder._choose

    def choosing(*args, **kwargs):  # the joint choice but the plans of rows drafted again (in plan)
        start, planned = time.perf_counter(), now.get("plan", 0.0)
        try:
            return choose(*args, **kwargs)
        finally:
            now["choose"] = now.get("choose", 0.0) + time.perf_counter() - start - (now.get("plan", 0.0) - planned)

    decoder._choose = choosing
    decoder._emit = counting("emit", decoder._emit)

    attention = AttentionTimer(engine.target.sync)

    def counted(trees, rows=None, picks=0):
        slots["nodes"] += sum(len(t) for t in trees)
        slots["padded"] += len(trees) * max(len(t) for t in trees)
        # the K/V slots the rows' attention reads (every row the longest row's, holes masked)
        # against those their prefixes hold
        slots["kv_read"] += len(trees) * decoder.target.store.lengths[0]
        slots["kv_prefix"] += sum(decoder.target.lengths)
        with attention:
            start = time.perf_counter()
            try:
                return verify(trees, rows, picks)
            finally:
                now["verify"] = now.get("verify", 0.0) + time.perf_counter() - start

    decoder.target.add = timed("prefill", decoder.target.add, sync=True)
    decoder.target.add_many = timed("prefill", decoder.target.add_many, sync=True)
    decoder.target.verify = counted
    decoder.target.commit = counting("commit", timed("commit", decoder.target.commit, sync=True))
    decoder._accept = counting("accept", timed("accept", decoder._accept))
    core = engine.step_core
    plan, finish = core.plan, core.finish
    core.plan, core.finish = counting("plan", timed("plan", plan)), counting("finish", timed("finish", finish))
    # with clients: each sends the next prompt nobody has taken as its last one ends
    # (server_batch_bench.py's shared queue)
    waiting = list(prompts)

    def send() -> None:
        if waiting:
            decoder.submit(BatchRequest(waiting.pop(0), max_tokens))

    for _ in range(clients or len(prompts)):
        send()
    start = time.perf_counter()
    profiler = None
    if cprofile is not None:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    try:
        generations = []
        while not decoder.idle:
            now.clear()
            filled = len(decoder.active) == batch and not decoder.waiting
            started = time.perf_counter()
            for seq in decoder.step():
                generations.append(decoder.generation(seq))
                if clients:
                    send()
            if filled and "verify" in now:  # (a full batch admits nothing: no prefill in its step)
                full["steps"] += 1
                full["seconds"] += time.perf_counter() - started
                full["forward"] += now["verify"] - now.get("inputs", 0.0)
                for kind in ("inputs", "plan", "choose", "accept", "commit", "finish", "emit"):
                    full[kind] += now.get(kind, 0.0)
    finally:
        core.plan, core.finish = plan, finish
        if profiler is not None:
            import io
            import pstats

            profiler.disable()
            text = io.StringIO()
            stats = pstats.Stats(profiler, stream=text)
            stats.sort_stats("tottime").print_stats(40)
            stats.sort_stats("cumulative").print_stats(60)
            Path(cprofile).write_text(text.getvalue())
    total = time.perf_counter() - start
    tokens = sum(len(g.token_ids) for g in generations)
    return {"requests": len(prompts), "batch": batch, "clients": clients, "mean_prompt_tokens": sum(map(len, prompts)) / len(prompts),
            "tokens": tokens, "seconds": total, "tokens_per_s": tokens / total, "prefill_s": spent["prefill"],
            "verify_s": spent["verify"], "other_s": total - spent["prefill"] - spent["verify"],
            # of other: drafting and merging (twice for a row drafted again), acceptance, KV commit,
            # observe and learn; the rest is the joint choice, stop strings, bookkeeping
            "plan_s": spent["plan"], "accept_s": spent["accept"], "commit_s": spent["commit"],
            "finish_s": spent["finish"],
            "steps": len(decoder.widths), "mean_width": statistics.mean(decoder.widths),
            "verified_slots": slots["padded"], "node_slots": slots["nodes"],
            "padding_share": 1 - slots["nodes"] / slots["padded"],
            # attention's share of the verify forwards (each SDPA call timed), and the share of the
            # prefix slots it reads that are holes (a row shorter than the longest)
            "attention_s": attention.seconds,
            # per step of a full batch, ms: host work (the step but its forward's model call) and
            # its parts (plan: every row's drafts and merge, a row drafted again twice; choose: the
            # joint budget's width; emit: the text and stop strings); the rest is the step's own
            # bookkeeping (stats, the cost curve)
            "full_steps": full["steps"],
            "host_ms_per_full_step": ((full["seconds"] - full["forward"]) * 1e3 / full["steps"]) if full["steps"] else None,
            "host_parts_ms": {kind: full[kind] * 1e3 / full["steps"] for kind in
                              ("inputs", "plan", "choose", "accept", "commit", "finish", "emit")} if full["steps"] else None,
            "hole_share": 1 - slots["kv_prefix"] / slots["kv_read"] if slots["kv_read"] else 0.0}


def ceiling(summary: dict, rows: list[dict]) -> dict:
    """The most any exact batching could make of the split's requests on this machine, against
    their run one at a time: the same prompts' prefill (as the split measured it) plus one
    verified token per token produced (every draft accepted: a token needs the target's logits
    at the position before it) at the fastest cost per token of the timed forwards (the widest,
    where the body's products run at the CPU's arithmetic peak), nothing else. Where the ratio
    stays under a bar, no scheduling or drafting can reach the bar here; a faster prefill would
    shorten both sides."""
    fastest = min(rows, key=lambda r: r["ms_per_token"])
    alone = summary["one_at_a_time"]["seconds"]
    least = summary["prefill_s"] + summary["tokens"] * fastest["ms_per_token"] / 1e3
    return {"fastest_ms_per_token": fastest["ms_per_token"],
            "fastest_shape": f"{fastest['rows']}x{fastest['width']} {fastest['attention']}",
            "least_seconds": least, "ratio": alone / least,
            "prefill_only_ratio": alone / summary["prefill_s"]}


def one_at_a_time(engine, prompts, max_tokens: int) -> dict:
    """The split's prompts through ``Engine.generate`` one after another (a fresh engine: the
    suffix cache would answer prompts it has seen), prefill timed apart."""
    start, tokens, prefill = time.perf_counter(), 0, 0.0
    for p in prompts:
        g = engine.generate(p, max_new_tokens=max_tokens)
        tokens += len(g.token_ids)
        prefill += g.stats.prefill_ms / 1e3
    total = time.perf_counter() - start
    return {"tokens": tokens, "seconds": total, "tokens_per_s": tokens / total, "prefill_s": prefill}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--threads", type=int, default=2, help="torch threads (2)")
    p.add_argument("--shapes", type=shape, nargs="+", default=[shape(s) for s in ("1x1", "1x64", "8x1", "8x8", "8x16")],
                   metavar="ROWSxWIDTH", help="batched forwards to time (1x1 1x64 8x1 8x8 8x16)")
    p.add_argument("--context", type=int, default=700, help="prefix tokens per row for the forwards (700)")
    p.add_argument("--repeats", type=int, default=5, help="timed forwards per shape (5; the median is kept)")
    p.add_argument("--prompts", type=int, default=16, help="rewrite prompts for the split (16; 0: none)")
    p.add_argument("--offset", type=int, default=17,
                   help="skip this many rewrite prompts first (17: server_batch_bench's 8-client set)")
    p.add_argument("--batch", type=int, default=8, help="rows of the split's batch (8)")
    p.add_argument("--clients", type=int, default=0, metavar="N",
                   help="the split's prompts come from N clients, each sending the next prompt nobody has "
                   "taken as its last one ends (server_batch_bench's arrival in one process, without HTTP), and are also run "
                   "one at a time on a fresh engine for the ratio (0: all submitted at once, no such run)")
    p.add_argument("--max-tokens", type=int, default=192, help="new tokens per prompt in the split (192)")
    p.add_argument("--out", type=Path, default=None, help="result JSON (default: bench/results/batch_profile_<T>t.json)")
    p.add_argument("--cprofile", type=Path, default=None, metavar="PATH",
                   help="write the split's Python profile (by own time, then cumulative) to PATH")
    p.add_argument("--attention", nargs="+", choices=(*ATTENTION_MODES, "both"), default=["core"],
                   help="masked attention of several query tokens, one or more: core (the compiled tree "
                   "attention, the default), grouped (each K/V head's query heads folded into one SDPA call), "
                   "gqa (transformers' call, SDPA's enable_gqa); both: grouped and gqa. Several: the forwards "
                   "in each, taking turns, and the split in the first")
    p.add_argument("--grouped-min-queries", type=int, default=None, metavar="N",
                   help="grouped attention for calls of at least N query tokens (default: the engine's, "
                   "kernels.GROUPED_MIN_QUERIES)")
    add_device_option(p)
    args = p.parse_args(argv)
    from lookupdec.model import kernels

    if args.grouped_min_queries is not None:
        if args.grouped_min_queries < 1:
            p.error(f"--grouped-min-queries {args.grouped_min_queries}: must be >= 1")
        kernels.GROUPED_MIN_QUERIES = args.grouped_min_queries

    modes = tuple(dict.fromkeys(m for a in args.attention for m in (("grouped", "gqa") if a == "both" else (a,))))
    set_attention(modes[0])
    if args.prompts < 0:
        p.error(f"--prompts {args.prompts}: must be >= 0")
    if args.clients < 0:
        p.error(f"--clients {args.clients}: must be >= 0")
    out = args.out or RESULTS_DIR / f"batch_profile_{args.threads}t.json"
    meta = run_metadata(threads_set_by_benchmark=True)
    torch.set_num_threads(args.threads)
    from lookupdec import Engine

    engine = Engine.from_pretrained(args.model, device=args.device, dtype="float32")
    needed = args.offset + args.prompts
    workloads = build_workloads(engine, needed // 2 + 1, 1024)
    pool = [p for pair in zip(workloads["log_to_json"], workloads["code_edit"]) for p in pair]
    if len(pool) < needed:
        raise SystemExit(f"{len(pool)} rewrite prompts, {needed} needed (--offset + --prompts)")
    engine.generate(pool[0][:64], max_new_tokens=8)  # warm-up: kernels, cost curve
    rows = forwards(engine, args.shapes, args.context, args.repeats, modes)
    print(format_table(rows, [("rows", "rows", "d"), ("width", "width", "d"), ("tokens", "tokens", "d"),
                              ("attention", "attention", "s"),
                              ("median_ms", "forward ms", ".1f"), ("ms_per_token", "ms/token", ".2f"),
                              ("attention_ms", "of it attention ms", ".1f"), ("kv_mb", "K/V MiB", ".0f"),
                              ("kv_gb_per_s", "K/V GB/s", ".1f")]))
    summary = None  # --prompts 0: the forwards only
    if args.prompts:
        summary = split(engine, pool[args.offset : needed], args.batch, args.max_tokens, args.cprofile, args.clients)
        print(f"\nsplit: {summary['requests']} rewrite prompts ({summary['mean_prompt_tokens']:.0f} tokens on average), "
              f"B = {summary['batch']}: {summary['tokens']} tokens in {summary['seconds']:.1f} s "
              f"({summary['tokens_per_s']:.1f} tokens/s): prefill {summary['prefill_s']:.1f} s, verify "
              f"{summary['verify_s']:.1f} s, other {summary['other_s']:.1f} s (plan {summary['plan_s']:.3f}, accept "
              f"{summary['accept_s']:.3f}, commit {summary['commit_s']:.3f}, finish {summary['finish_s']:.3f}); "
              f"{summary['steps']} steps, mean width "
              f"{summary['mean_width']:.2f}, padding {100 * summary['padding_share']:.1f}% of verified slots; "
              f"attention {summary['attention_s']:.1f} s of verify, holes {100 * summary['hole_share']:.0f}% "
              f"of the prefix slots it reads")
        if summary["full_steps"]:
            parts = ", ".join(f"{k} {v:.2f}" for k, v in summary["host_parts_ms"].items())
            print(f"host work per step of a full batch ({summary['full_steps']} steps): "
                  f"{summary['host_ms_per_full_step']:.2f} ms ({parts})")
        if args.clients:
            del engine  # (a fresh engine: this one's suffix cache has seen every answer)
            fresh = Engine.from_pretrained(args.model, device=args.device, dtype="float32")
            fresh.generate(pool[0][:64], max_new_tokens=8)
            summary["one_at_a_time"] = alone = one_at_a_time(fresh, pool[args.offset : needed], args.max_tokens)
            summary["vs_one_at_a_time"] = summary["tokens_per_s"] / alone["tokens_per_s"]
            print(f"one at a time: {alone['tokens_per_s']:.1f} tokens/s (prefill {alone['prefill_s']:.1f} s of "
                  f"{alone['seconds']:.1f} s); {args.clients} clients batched: {summary['vs_one_at_a_time']:.2f}x")
            summary["ceiling"] = bound = ceiling(summary, rows)
            print(f"ceiling: at most {bound['ratio']:.2f}x for any exact batching of these requests with these forwards "
                  f"(prefill {summary['prefill_s']:.1f} s + {summary['tokens']} tokens x "
                  f"{bound['fastest_ms_per_token']:.2f} ms, the fastest verified token of the forwards above "
                  f"({bound['fastest_shape']}), against {alone['seconds']:.1f} s one at a time; prefill alone: "
                  f"{bound['prefill_only_ratio']:.2f}x)")
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    write_result(out, "batch_profile", config, {"forwards": rows, "split": summary}, meta=meta,
                 threads_set_by_benchmark=True)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
