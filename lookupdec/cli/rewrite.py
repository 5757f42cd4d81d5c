"""``lookupdec rewrite``: many records through one engine (``lookupdec.pipelines``), resumable."""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys

from lookupdec.cli.options import (CliError, add_engine_options, add_sampling_options, batch_rows, check_engine_options,
                                   engine_config, engine_kwargs, load_engine, positive_int)

REWRITE_HELP = """\
Rewrite many records with one model: each record's text goes into a prompt (--instruction or
--template), and each output is one JSON line of --output. One engine serves the whole run,
so its cache of earlier outputs drafts later ones: repetitive work gets faster as it goes.
Greedy outputs are exactly the model's own greedy outputs.

inputs (--input, files or folders, several allowed):
  .jsonl        one record per line: the --field of a JSON object; id from its "id", else PATH:LINE
  text files    --split lines: every --lines-per-record non-blank lines (id PATH:LINE);
                --split paragraphs: blocks between blank lines (id PATH:LINE); --split file (id PATH)
  folders       every file inside, recursively, sorted (binary and non-UTF-8 files skipped)
  PATH is the path as given: rerun from the same folder to resume.

output (--output, one JSON line per record):
  {"id", "input_hash", "output", "finish_reason", "stats": {new_tokens, steps, mean_accepted,
   tokens_per_s, seconds}}  (+ "token_ids" with --token-ids), or {"id", "input_hash", "error"}
  for a record that failed (a .jsonl line that is not UTF-8 or not JSON, a missing field, a
  duplicate id, a prompt longer than the model's context, ...): it is reported on stderr and
  the run goes on.

resuming: run the same command again. Records with a result line are skipped; failed records
are done again (their error lines are replaced); a line torn by a kill is cut off and its record
redone. Each line is written whole (one write) and lines are fsync-ed every second: after any
kill the file holds every finished record exactly once. Only one run may write a file at a time.

batching (--batch-size): several records share each verify forward, a finished record's row
going to the next; outputs are the same as one at a time, and lines come in the order records
finish (each keyed by its id).

Ray (--ray [ADDRESS], the extra: pip install "lookupdec[ray]"): records are shared among Ray
workers, one engine each (--ray-workers, --ray-cpus-per-worker, --ray-gpus-per-worker); this
process alone writes --output, so every guarantee above holds. Records of one input file (or
one --group-by value) go to the same worker, whose cache then learns from similar records. A
worker that dies has its records redone by another. --ray or --ray auto: ray.init()'s choice
(RAY_ADDRESS, a cluster started on this machine with `ray start`, else a new local instance);
--ray HOST:PORT: that cluster (every node needs lookupdec installed and the --model path).

exit status: 0 every record has a result, 1 some records failed (see their lines) or have no
line (said on stderr: run again), 2 a usage
error (bad path, template without {text}, ...), 130 interrupted."""


def add_parser(sub) -> None:
    from lookupdec.pipelines.inputs import SPLITS
    from lookupdec.config import MAX_BATCH
    from lookupdec.pipelines.rewrite import DEFAULT_MAX_NEW_TOKENS, DEFAULT_MODEL

    p = sub.add_parser("rewrite", help="rewrite .jsonl records, text files or folders; resumable, one JSON line each",
                       description=REWRITE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True, nargs="+", action="extend", metavar="PATH",
                   help=".jsonl / text files or folders (repeatable)")
    p.add_argument("--output", required=True, metavar="FILE.jsonl", help="results, appended to (resumable)")
    how = p.add_mutually_exclusive_group(required=True)
    how.add_argument("--instruction", metavar="TEXT",
                     help="prompt = TEXT, a blank line, the record's text, a blank line, 'Output:' and a newline")
    how.add_argument("--template", metavar="FILE",
                     help="prompt template: {text} becomes the record's text, {id} its id; nothing else is special")
    p.add_argument("--field", default="text", help=".jsonl: the field with the text (text)")
    p.add_argument("--split", default="lines", choices=SPLITS, help="text files: what a record is (lines)")
    p.add_argument("--lines-per-record", type=positive_int, default=1, metavar="N",
                   help="--split lines: non-blank lines per record (1)")
    p.add_argument("--limit", type=positive_int, default=None, metavar="N", help="only the first N records")
    add_sampling_options(
        p, ("max_new_tokens", "stop", "temperature", "top_k", "top_p", "repetition_penalty", "seed"),
        max_new_tokens=dict(default=DEFAULT_MAX_NEW_TOKENS, metavar="N",
                            help=f"most tokens per output ({DEFAULT_MAX_NEW_TOKENS}; fewer where the context ends)"),
        stop=dict(help="end each output before any of these strings"),
        seed=dict(help="sampling seed (each record's is derived from it and its id)"))
    add_engine_options(p, model_default=DEFAULT_MODEL)
    p.add_argument("--chat", action="store_true",
                   help="each prompt is a user message in the model's chat template (instruction models such "
                   "as smollm2); an --instruction prompt then has no 'Output:' cue")
    p.add_argument("--batch-size", "--max-batch", dest="batch_size", type=batch_size, default="auto",
                   metavar="N|auto",
                   help=f"records verified together in each forward, 1-{MAX_BATCH} or auto (serve's --max-batch; "
                   "continuous batching; outputs unchanged, lines then in the order records finish). auto (the "
                   "default): from the model's measured verify cost on this machine, 1 where batching does not pay; "
                   "1: one record at a time")
    p.add_argument("--token-ids", action="store_true", help="also write each output's token ids")
    ray = p.add_argument_group("Ray (pip install \"lookupdec[ray]\")")
    ray.add_argument("--ray", nargs="?", const="auto", default=None, metavar="ADDRESS",
                     help="run on Ray workers: no value or 'auto' as ray.init() (a local instance unless a "
                     "cluster is found), else the cluster at ADDRESS")
    ray.add_argument("--ray-workers", type=positive_int, default=None, metavar="N",
                     help="Ray workers, one engine each (default: as many as the cluster's resources hold)")
    ray.add_argument("--ray-cpus-per-worker", type=non_negative_float, default=1.0, metavar="N",
                     help="CPUs per worker, also its torch threads (1)")
    ray.add_argument("--ray-gpus-per-worker", type=non_negative_float, default=0.0, metavar="N",
                     help="GPUs per worker; fractions share a GPU (0)")
    ray.add_argument("--ray-sharding", default="affinity", choices=("affinity", "spread", "random"),
                     help="affinity: a group's records to one worker (its cache learns the group); "
                     "spread: records in input order to whichever worker has room; random: the same, shuffled "
                     "(affinity)")
    ray.add_argument("--group-by", default=None, metavar="FIELD",
                     help=".jsonl: the field whose value groups records for --ray affinity (default: the input file)")
    p.add_argument("--quiet", action="store_true", help="no progress bar and no summary (warnings still)")
    p.add_argument("--json-summary", action="store_true", help="print the summary as one JSON object on stdout")
    p.set_defaults(func=run)


def batch_size(text: str):
    """``--batch-size``: ``auto`` or an integer in [1, MAX_BATCH]."""
    from lookupdec.config import MAX_BATCH

    if text == "auto":
        return text
    try:
        return batch_rows(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected 'auto' or an integer in [1, {MAX_BATCH}], got {text!r}") from None


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{value:g} must be >= 0")
    return value


def ray_rewrite(args):
    """The ``RayRewrite`` that ``--ray`` asks for, or None (checked before any input is read:
    ``--ray`` without the package is a one-line usage error)."""
    if args.ray is None:
        for flag in ("ray_workers", "group_by"):
            if getattr(args, flag) is not None:
                raise CliError(f"--{flag.replace('_', '-')} needs --ray")
        return None
    from lookupdec.pipelines.cluster import EngineSpec, RayOptions, RayRewrite

    options = RayOptions(address=args.ray, workers=args.ray_workers, cpus_per_worker=args.ray_cpus_per_worker,
                         gpus_per_worker=args.ray_gpus_per_worker, sharding=args.ray_sharding)
    return RayRewrite(EngineSpec.of(args.model, **engine_kwargs(args, engine_config(args))), options)


def run(args) -> int:
    from lookupdec.pipelines import PromptFormat, ReadOptions, ResultsFile, RewriteOptions, plan, read_records, rewrite
    from lookupdec.pipelines.rewrite import job_id
    from lookupdec.pipelines.results import TMP_SUFFIX

    cluster = ray_rewrite(args)
    if cluster is None:  # before reading inputs: a device this machine lacks is a usage error
        check_engine_options(args)  # (with --ray the workers' machines are the ones that count)
    config = engine_config(args)
    prompts = (PromptFormat.from_instruction(args.instruction) if args.instruction is not None
               else PromptFormat.from_file(args.template))
    if args.chat:
        prompts = prompts.with_chat()
    options = RewriteOptions(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                             top_p=args.top_p, repetition_penalty=args.repetition_penalty, seed=args.seed,
                             stop=tuple(args.stop) if args.stop else None, token_ids=args.token_ids,
                             batch_size=args.batch_size)
    options = dataclasses.replace(options, job=job_id(args.model, prompts, options))
    records, skipped_files = read_records(
        args.input, ReadOptions(field=args.field, split=args.split, lines_per_record=args.lines_per_record,
                                group_by=args.group_by),
        ignore=(args.output, args.output + TMP_SUFFIX))
    if skipped_files:
        logging.getLogger("lookupdec").warning("skipped %d files that are not text: %s", len(skipped_files),
                                               "; ".join(skipped_files[:3]) + (" ..." if len(skipped_files) > 3 else ""))
    records = records[: args.limit] if args.limit else records
    if not records:
        logging.getLogger("lookupdec").warning("no records in %s (empty, or no line with text): nothing to rewrite",
                                               ", ".join(args.input))
    with ResultsFile.open(args.output) as results:
        if results.repaired:
            logging.getLogger("lookupdec").warning("%s", results.repaired)
        work = plan(records, results, options.job)
        engine = None
        if work.needs_model and cluster is None:
            engine = load_engine(args, config)
            if args.chat and not getattr(engine.tokenizer, "chat_template", None):
                raise CliError(f"--chat: {args.model}'s tokenizer has no chat template; drop --chat to give "
                               "plain prompts")
        summary = rewrite(engine, work, prompts, results, options, records=len(records),
                          progress=not args.quiet and sys.stderr.isatty(), cluster=cluster)
    if args.json_summary:
        json.dump(summary.to_dict(), sys.stdout)
        sys.stdout.write("\n")
    if not args.quiet:
        print(f"lookupdec: {summary.line()}", file=sys.stderr)
    if summary.missing:
        print(f"lookupdec: error: {summary.missing} records got no line in {args.output} (a bug: please report it); "
              "run the same command again to do them", file=sys.stderr)
    return 1 if summary.failed or summary.missing else 0

