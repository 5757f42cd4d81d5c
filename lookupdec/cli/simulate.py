"""``lookupdec simulate``: replay recorded outputs through the proposers, no model."""
from __future__ import annotations

import json
import sys

from lookupdec.cli.options import CliError, positive_int

DEFAULT_DATA = "../shared/data"
DEFAULT_SP_TOKENIZER = "../shared/data/tokenizers/llama2/tokenizer.model"


def add_parser(sub) -> None:
    from lookupdec.workloads import WORKLOADS

    p = sub.add_parser(
        "simulate",
        help="replay recorded outputs through the proposers (no model): accepted tokens per step",
        description="Replay (prompt, response) pairs with no model. At each step the proposers see "
        "the prompt and the response so far; a step accepts the longest draft-tree path matching "
        "the response plus one bonus token, which is exactly what greedy decoding of the model "
        "that wrote the responses would accept. Reports mean accepted tokens per step (MAT).",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--input", help='JSONL: {"prompt": str, "response": str} or prompt_ids/response_ids, optional "id"')
    src.add_argument("--workload", choices=sorted(WORKLOADS), help="build records from the shared data")
    p.add_argument("--data", default=DEFAULT_DATA, help=f"shared data folder for --workload ({DEFAULT_DATA})")
    p.add_argument("--tokenizer", default=None,
                   help=f"HF tokenizer folder or sentencepiece .model file, for text records (default: "
                   f"{DEFAULT_SP_TOKENIZER}; records of token ids need none)")
    p.add_argument("--proposers", default=None,
                   help="comma-separated drafting sources: ngram, suffix, retrieval (default: the engine's but "
                   "recycle, which drafts from the model's logits; "
                   "ngram,suffix; --index adds retrieval)")
    p.add_argument("--budget", type=positive_int, default=64, help="draft-tree nodes per step (64)")
    p.add_argument("--max-depth", type=positive_int, default=64, help="longest draft path (64)")
    p.add_argument("--index", default=None, help="draft also from this corpus index (lookupdec index build)")
    p.add_argument("--cost-curve", default=None, metavar="F.json",
                   help='verify cost t(n), {"sizes": [...], "seconds": [...]}: also report the modelled '
                   "speedup over plain decoding, tokens * t(1) / sum of t(1 + nodes) over steps")
    p.add_argument("--auto-budget", action="store_true",
                   help="with --cost-curve: choose each step's node count as the engine's budget=auto does "
                   "(up to --budget)")
    p.add_argument("--limit", type=positive_int, default=None, help="replay only the first N records")
    p.add_argument("--json", action="store_true", help="print the full result (per record too) as JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    import dataclasses

    from lookupdec import model as model_lib
    from lookupdec.config import EngineConfig
    from lookupdec.proposers import build_proposers
    from lookupdec.simulate import read_jsonl, replay
    from lookupdec.workloads import WORKLOADS

    # token recycling drafts from the target's logits, which a replay has not: not a default here
    names = tuple(n for n in EngineConfig().proposers if n != "recycle")
    if args.proposers is not None:
        names = tuple(s.strip() for s in args.proposers.split(",") if s.strip())
    if "retrieval" in names and not args.index:
        raise CliError("--proposers retrieval needs --index DIR (an index from `lookupdec index build`)")
    # with_index adds "retrieval" (if --proposers did not name it) and its index folder
    config = EngineConfig(proposers=tuple(n for n in names if n != "retrieval"))
    if args.index:
        config = config.with_index(args.index)
        if "retrieval" in names:  # keep the order --proposers gave
            config = dataclasses.replace(config, proposers=names)
    try:
        records = read_jsonl(args.input) if args.input else list(WORKLOADS[args.workload](args.data))
    except OSError as exc:
        raise CliError(f"--input {args.input}: {exc.strerror or exc}" if args.input else str(exc)) from None
    except RuntimeError as exc:
        raise CliError(str(exc)) from None
    if args.limit:
        records = records[: args.limit]
    # records of token ids need no tokenizer (unless --tokenizer names one, or retrieval decodes)
    text = any(not (isinstance(r, dict) and ("prompt_ids" in r or "response_ids" in r)) for r in records)
    tokenizer = None
    if args.tokenizer or text or "retrieval" in config.proposers:
        tokenizer = model_lib.load_tokenizer(args.tokenizer or DEFAULT_SP_TOKENIZER)
    cost = None
    if args.cost_curve:
        from lookupdec.budget import CostModel

        try:
            with open(args.cost_curve, encoding="utf-8") as f:
                curve = json.load(f)
            cost = CostModel(curve["sizes"], curve["seconds"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CliError(f"--cost-curve {args.cost_curve}: expected {{\"sizes\": [...], \"seconds\": [...]}} ({exc})") from None
    elif args.auto_budget:
        raise CliError("--auto-budget needs --cost-curve")
    result = replay(records, tokenizer, build_proposers(config, tokenizer=tokenizer), max_nodes=args.budget,
                    max_depth=args.max_depth, progress=sys.stderr.isatty(), cost=cost, choose=args.auto_budget)
    if cost is not None:
        result["modeled_speedup"] = result["response_tokens"] * cost(1) / result["modeled_seconds"]
    result["workload"] = args.workload or args.input
    if args.json:
        json.dump(result, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        print(f"{result['workload']}: {result['records']} records, {result['response_tokens']} tokens, "
              f"MAT {result['mat']:.3f} tokens/step, tree {result['mean_tree_nodes']:.1f} nodes, "
              f"draft {result['draft_us_p50']:.0f} us p50 / {result['draft_us_p99']:.0f} us p99, "
              f"accepted share {result['accepted_share_by_source']}"
              + (f", {len(result['skipped_empty_responses'])} skipped (empty response)"
                 if result.get("skipped_empty_responses") else "")
              + (f", modelled speedup {result['modeled_speedup']:.2f}x" if "modeled_speedup" in result else ""))
    return 0

