"""``lookupdec index build | info | query | verify``: retrieval indexes over a user's corpora."""
from __future__ import annotations

import json
import logging
import sys

from lookupdec.cli.options import CliError, positive_int

def add_parser(sub) -> None:
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
    b.add_argument("--chunk-tokens", type=positive_int, default=256, help="tokens per chunk (256)")
    b.add_argument("--embedder", default="hash",
                   help="hash (default: hashed token n-grams, no model) or sentence-transformers:PATH (local folder)")
    b.add_argument("--dim", type=positive_int, default=None, help="hash embedder dimension, 8 to 65536 (512)")
    b.add_argument("--faiss", default="auto", choices=("auto", "flat", "ivf", "hnsw"),
                   help="FAISS index type (auto: flat below 50k chunks, HNSW above)")
    b.add_argument("--gpu", action="store_true", help="build on the GPU (needs faiss-gpu and CUDA)")
    b.add_argument("--include", nargs="+", default=(), metavar="GLOB",
                   help="in folders, read only files matching one of these (e.g. '*.py' '*.md')")
    b.add_argument("--exclude", nargs="+", default=(), metavar="GLOB",
                   help="leave out files or folders matching these (.git, __pycache__ ... always)")
    b.add_argument("--field", default="text", help=".jsonl: the record field with the text (text)")
    b.add_argument("--force", action="store_true",
                   help="replace an existing index at --out (only an index: a folder holding anything else is refused)")
    b.set_defaults(func=run_build)
    i = isub.add_parser("info", help="show an index's manifest, sizes and counts",
                        description="Print what an index holds. Checks the manifest's own hash and the "
                        "files' sizes, not their contents: `index verify` hashes every file.")
    i.add_argument("dir", help="index folder")
    i.add_argument("--json", action="store_true", help="print the whole manifest as JSON")
    i.set_defaults(func=run_info)
    q = isub.add_parser("query", help="show the chunks a text retrieves and the drafts they give",
                        description="Embed --text as a prompt would be, print the top chunks with their "
                        "scores and sources, then the drafts retrieval would propose after that text.")
    q.add_argument("dir", help="index folder")
    q.add_argument("--text", required=True, help="query text (as the end of a prompt)")
    q.add_argument("--k", type=positive_int, default=5, help="chunks to show (5)")
    q.add_argument("--tokenizer", default=None, help="tokenizer (default: the one recorded in the manifest)")
    q.set_defaults(func=run_query)
    v = isub.add_parser("verify", help="check every file of an index against its manifest (SHA-256)",
                        description="Exit 0 if the manifest matches its own hash, every file is present "
                        "with the size and SHA-256 the manifest records and the index opens; else print "
                        "the problem and exit 2. (Indexes built before the manifest was hashed pass with "
                        "a note.)")
    v.add_argument("dir", help="index folder")
    v.set_defaults(func=run_verify)


def run_build(args) -> int:
    from lookupdec import model as model_lib
    from lookupdec.index import build_index
    from lookupdec.index.build import check_build_args

    logging.getLogger("lookupdec").setLevel(logging.INFO)
    # --out, --dim ...: refused before the tokenizer loads and the corpus is read
    check_build_args(out=args.out, force=args.force, chunk_tokens=args.chunk_tokens, dim=args.dim,
                     faiss_kind=args.faiss)
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


def run_info(args) -> int:
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
    build = manifest.get("build", {})  # read_manifest: an object when present
    print(f"built        {build.get('created')} in {build.get('seconds')} s "
          f"(lookupdec {build.get('lookupdec')}, faiss {build.get('faiss')})")
    print(f"checked      {checked}")
    return 0


def run_query(args) -> int:
    from lookupdec import model as model_lib
    from lookupdec.config import RetrievalConfig
    from lookupdec.index import Index
    from lookupdec.index.store import read_manifest
    from lookupdec.proposers.retrieval import drafts_after

    manifest = read_manifest(args.dir)
    tokenizer_path = args.tokenizer or manifest["tokenizer"].get("path")
    if not tokenizer_path:
        raise CliError(f"{args.dir}: the manifest records no tokenizer path: pass --tokenizer")
    tokenizer = model_lib.load_tokenizer(tokenizer_path)
    index = Index.open(args.dir, tokenizer_fingerprint=model_lib.vocab_fingerprint(tokenizer), decode=tokenizer.decode)
    ids = list(tokenizer.encode(args.text, add_special_tokens=False))
    if not ids:
        raise CliError("--text gives no tokens")
    for rank, hit in enumerate(index.search_tokens(ids, args.k), start=1):
        text = tokenizer.decode(index.chunk_tokens(hit.chunk).tolist())
        print(f"#{rank}  score {hit.score:.3f}  chunk {hit.chunk}  {index.document_name(hit.chunk)}")
        print("    " + text[:300].replace("\n", "\n    ") + (" ..." if len(text) > 300 else ""))
    drafts = drafts_after(index, ids, RetrievalConfig(index=args.dir, top_k=args.k))
    print(f"drafts after the text ({len(drafts)}):" if drafts else "drafts after the text: none (no match)")
    for d in drafts:
        chain, _ = d.best_chain()
        print(f"  {len(d.token_ids)} nodes, best path {tokenizer.decode(chain)!r}")
    return 0


def run_verify(args) -> int:
    from lookupdec.index import Index
    from lookupdec.index.store import check_files, manifest_hashed, read_manifest

    manifest = read_manifest(args.dir)  # a manifest edited after the build fails here
    names = check_files(args.dir, manifest, hashes=True)
    Index.open(args.dir, check_hashes=False, decode=lambda ids: "")
    covered = ("the manifest matches its hash" if manifest_hashed(manifest) else
               "manifest not hashed (an index built by an older lookupdec: rebuild it to cover the manifest too)")
    print(f"{args.dir}: OK ({len(names)} files match their SHA-256; {covered}; {manifest['counts']['chunks']} chunks)")
    return 0

