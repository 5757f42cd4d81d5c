"""``lookupdec generate``: one prompt, text to stdout as it is produced."""
from __future__ import annotations

import json
import sys

from lookupdec.cli.options import (CliError, add_engine_options, add_sampling_options, check_engine_options,
                                   check_sampling_options, engine_config, load_engine)


def add_parser(sub) -> None:
    p = sub.add_parser(
        "generate",
        help="generate text from a prompt with lossless lookup drafting",
        description="Generate a continuation of a prompt. The output is exactly what the model "
        "would produce on its own (greedy: token for token; sampling: same distribution); "
        "lookups only make it faster. Text goes to stdout as it is produced.",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="the prompt text")
    src.add_argument("--prompt-file", help="read the prompt from this file ('-' = stdin)")
    p.add_argument("--chat", action="store_true",
                   help="the prompt is a user message: wrap it in the model's chat template (instruction "
                   "models such as smollm2); without it the prompt is raw text to continue")
    p.add_argument("--system", default=None, metavar="TEXT",
                   help="with --chat: a system message first (default: the template's own, if any)")
    add_sampling_options(p)
    add_engine_options(p)
    p.add_argument("--stats", action="store_true", help="print decoding statistics to stderr")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object with text, token_ids, finish_reason, stats")
    p.set_defaults(func=run)


def read_prompt(args) -> str:
    if args.prompt is not None:
        return args.prompt
    try:
        if args.prompt_file == "-":
            return sys.stdin.read()
        with open(args.prompt_file, encoding="utf-8") as f:
            return f.read()
    except OSError as exc:
        raise CliError(f"--prompt-file {args.prompt_file}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise CliError(f"--prompt-file {args.prompt_file}: not UTF-8 text") from None


def run(args) -> int:
    prompt = read_prompt(args)
    if not prompt:
        raise CliError("the prompt is empty")
    if args.system is not None and not args.chat:
        raise CliError("--system needs --chat")
    check_sampling_options(args)  # before loading the model
    check_engine_options(args)
    engine = load_engine(args, engine_config(args))
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system is not None else []) + [
            {"role": "user", "content": prompt}]
        prompt = engine.chat_prompt(messages)
    stream = engine.stream(prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                           top_k=args.top_k, top_p=args.top_p, repetition_penalty=args.repetition_penalty,
                           seed=args.seed, stop=args.stop)
    for piece in stream:
        if not args.json:
            sys.stdout.write(piece)
            sys.stdout.flush()
    gen = stream.generation
    if args.json:
        json.dump({"text": gen.text, "token_ids": gen.token_ids, "finish_reason": gen.finish_reason,
                   "stats": gen.stats.to_dict()}, sys.stdout)
    sys.stdout.write("\n")
    if args.stats:
        s = gen.stats
        print(f"[{gen.finish_reason}] {s.new_tokens} tokens in {s.steps} steps: {s.mean_accepted:.2f} tokens/step, "
              f"{s.tokens_per_s:.1f} tokens/s, forward {s.forward_ms:.2f} ms, overhead {s.overhead_us:.0f} us/step, "
              f"kernel choices {s.kernel_ms:.0f} ms, "
              f"tree {s.mean_tree_nodes:.1f} nodes, accepted {s.realised_accepted:.2f} drafts/step "
              f"(predicted {s.predicted_accepted:.2f}), "
              f"accepted by source {s.accepted_by_source}, nodes by source {s.nodes_by_source}"
              + (f", draft model on {s.draft_model_steps} steps" if s.draft_model_steps else ""), file=sys.stderr)
    return 0
