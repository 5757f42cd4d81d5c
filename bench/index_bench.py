"""Retrieval index: build cost over the CPython standard library, retrieval latency, FAISS recall
against exact search, and what retrieval adds to accepted tokens per step (replay).

    python bench/index_bench.py                      # everything (~10 min on 2 cores)
    python bench/index_bench.py --parts build,latency

Parts:
- build: ``lookupdec index build`` (a subprocess) over the stdlib's ``*.py`` (tests, site-packages
  left out; ~3.7M Llama-2 tokens): wall time, peak RSS, index size against the token store.
- latency: ``RetrievalProposer.start`` (embed the prompt's end, search, load the chunks into the
  request's automaton) on the 164 HumanEval prompts: p50 / p99, and embed+search alone.
- recall: IVF and HNSW indexes over the same embeddings against exact search (flat), recall@k on
  HumanEval prompt queries and random 64-token windows of the corpus.
- replay: MAT with and without retrieval; HumanEval canonical solutions over the stdlib index,
  with the cross-request suffix cache (the default engine) and without it (each request alone);
  loghub with, for each system, an index over the other seven systems' logs (raw, or as an
  archive of earlier rewrites: their lines as JSON objects).

Writes ``bench/results/index_stdlib.json``.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import resource
import subprocess
import sys
import sysconfig
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import REPO_ROOT, RESULTS_DIR, SHARED_DIR, format_table, run_metadata, write_result  # noqa: E402

from lookupdec.budget import AcceptanceCalibrator  # noqa: E402
from lookupdec.config import EngineConfig, RetrievalConfig, SuffixConfig  # noqa: E402
from lookupdec.index import Index, build_index  # noqa: E402
from lookupdec.index.build import build_faiss  # noqa: E402
from lookupdec.model import load_tokenizer  # noqa: E402
from lookupdec.proposers import build_proposers  # noqa: E402
from lookupdec.proposers.retrieval import RetrievalProposer  # noqa: E402
from lookupdec.simulate import replay_one, summarize, tokenize_record  # noqa: E402
from lookupdec.workloads import LOG_LINES_PER_RECORD, WORKLOADS  # noqa: E402

STDLIB_EXCLUDE = ("test", "tests", "idle_test", "site-packages")
BUDGET = 64


def part_build(args) -> dict:
    cmd = [sys.executable, "-m", "lookupdec", "index", "build", args.stdlib, "--include", "*.py",
           "--exclude", *STDLIB_EXCLUDE, "--tokenizer", args.tokenizer, "--out", args.index, "--force"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO_ROOT)
    seconds = time.perf_counter() - start
    if proc.returncode:
        raise SystemExit(f"index build failed:\n{proc.stderr}")
    peak_mb = max(before, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss) / 1024
    manifest = Index.open(args.index, check_hashes=False).manifest
    files = {n: m["bytes"] for n, m in manifest["files"].items()}
    out = {"command": " ".join(cmd), "seconds": seconds, "peak_rss_mb": peak_mb, "counts": manifest["counts"],
           "faiss": manifest["faiss"], "bytes": files, "index_over_token_store": files["faiss.index"] / files["tokens.npy"],
           "total_over_token_store": sum(files.values()) / files["tokens.npy"], "cli_output": proc.stdout.strip()}
    print(f"build: {manifest['counts']['tokens']} tokens, {manifest['counts']['chunks']} chunks in {seconds:.1f} s, "
          f"peak {peak_mb:.0f} MB, faiss.index {files['faiss.index'] / 1e6:.1f} MB = "
          f"{out['index_over_token_store']:.2f}x the token store ({files['tokens.npy'] / 1e6:.1f} MB)", flush=True)
    return out


def humaneval_prompts(tokenizer) -> list[list[int]]:
    return [tokenize_record(r, tokenizer, i)[1] for i, r in enumerate(WORKLOADS["humaneval"](None))]


def part_latency(args, tokenizer) -> dict:
    index = Index.open(args.index, check_hashes=False)
    config = RetrievalConfig(index=args.index)
    proposer = RetrievalProposer(index, config)
    embed_search = []
    for i, prompt in enumerate(humaneval_prompts(tokenizer)):
        proposer.start(str(i), prompt)
        proposer.stop(str(i))
        t = time.perf_counter()
        index.search_tokens(prompt[-config.query_tokens :], config.top_k)
        embed_search.append(time.perf_counter() - t)
    start_ms, search_ms = np.array(proposer.query_seconds) * 1e3, np.array(embed_search) * 1e3
    out = {"queries": len(start_ms), "top_k": config.top_k, "follow_chunks": config.follow_chunks,
           "start_ms_p50": float(np.percentile(start_ms, 50)), "start_ms_p99": float(np.percentile(start_ms, 99)),
           "embed_search_ms_p50": float(np.percentile(search_ms, 50)),
           "embed_search_ms_p99": float(np.percentile(search_ms, 99))}
    print(f"latency at request start: p50 {out['start_ms_p50']:.2f} ms, p99 {out['start_ms_p99']:.2f} ms "
          f"(embed + search alone p50 {out['embed_search_ms_p50']:.2f} ms)", flush=True)
    return out


def part_recall(args, tokenizer) -> list[dict]:
    index = Index.open(args.index, check_hashes=False)
    n = index.num_chunks
    vectors = index.faiss_index.reconstruct_n(0, n)
    rng = np.random.default_rng(0)
    queries = [p[-64:] for p in humaneval_prompts(tokenizer)]
    tokens = np.asarray(index.tokens)
    for start in rng.integers(0, len(tokens) - 64, 1000 - len(queries)):
        window = tokens[start : start + 64]
        queries.append(window[window != 2**31 - 1])
    q = np.concatenate([index.embed(x) for x in queries])
    rows = []
    for k in (8, 32):
        exact = np.argsort(-(q @ vectors.T), axis=1, kind="stable")[:, :k]
        exact_scores = np.take_along_axis(q @ vectors.T, exact, axis=1)
        for kind in ("flat", "ivf", "hnsw"):
            t = time.perf_counter()
            faiss_index, info = build_faiss(vectors, kind)
            build_s = time.perf_counter() - t
            for key, value in info["search"].items():
                if key == "nprobe":
                    faiss_index.nprobe = value
                if key == "efSearch":
                    faiss_index.hnsw.efSearch = value
            t = time.perf_counter()
            for row in q:
                faiss_index.search(row[None], k)
            search_ms = (time.perf_counter() - t) / len(q) * 1e3
            scores, got = faiss_index.search(q, k)
            # ties: a returned chunk whose score equals the k-th exact score counts as a hit
            hit = [len(set(g) & set(e)) + int(np.sum((s >= es[-1] - 1e-6) & ~np.isin(g, e)))
                   for g, e, s, es in zip(got, exact, scores, exact_scores)]
            recall = float(np.mean(np.minimum(hit, k)) / k)
            rows.append({"k": k, "kind": kind, "recall": recall, "search_ms": search_ms, "build_s": build_s,
                         "params": {kk: v for kk, v in info.items() if kk not in ("metric",)}})
            print(f"recall@{k} {kind:5s} {recall:.4f}  search {search_ms:.3f} ms/query  build {build_s:.2f} s", flush=True)
    return rows


def replay_records(records, tokenizer, shared, per_record=None):
    """Replay with the shared proposers (kept across records, as in serving) plus, per record,
    ``per_record(record)`` extra proposers (e.g. retrieval over that record's index)."""
    results, draft_seconds, calibrator = [], [], AcceptanceCalibrator()
    queries = []
    for i, record in enumerate(records):
        rid, prompt, response = tokenize_record(record, tokenizer, i)
        extra = per_record(record) if per_record else []
        results.append(replay_one(rid, prompt, response, [*shared, *extra], max_nodes=BUDGET, max_depth=BUDGET,
                                  draft_seconds=draft_seconds, calibrator=calibrator))
        queries += [s for p in extra for s in getattr(p, "query_seconds", [])]
    out = summarize(results, draft_seconds, budget=BUDGET)
    out.pop("per_record")
    if queries:
        out["retrieval_ms_p50"] = float(np.percentile(np.array(queries) * 1e3, 50))
    return out


def _open_built(paths, out, tokenizer_path) -> Index:
    build_index(paths, tokenizer=load_tokenizer(tokenizer_path), out=out, progress=False)
    return Index.open(out, check_hashes=False)


def json_groups(folder: str, system: str) -> list[str]:
    """A system's 2000 parsed lines as JSON objects, in groups of the workload's record size."""
    with open(os.path.join(folder, f"{system}_2k.log_structured.csv"), encoding="utf-8", newline="") as f:
        rows = [json.dumps({k: v for k, v in row.items() if k not in ("LineId", "EventId")}) for row in csv.DictReader(f)]
    return ["\n".join(rows[g : g + LOG_LINES_PER_RECORD]) for g in range(0, len(rows), LOG_LINES_PER_RECORD)]


def part_replay(args, tokenizer) -> list[dict]:
    rows = []
    humaneval = list(WORKLOADS["humaneval"](None))
    index = Index.open(args.index, check_hashes=False)
    for cache, capacity in (("with cross-request cache", 10_000_000), ("each request alone", 0)):
        base = EngineConfig(suffix=SuffixConfig(global_capacity=capacity))
        for with_index in (False, True):
            shared = build_proposers(base, tokenizer=tokenizer)
            if with_index:
                retrieval = RetrievalProposer(index, RetrievalConfig(index=args.index))
                shared.append(retrieval)
            r = replay_records(humaneval, tokenizer, shared)
            if with_index:
                r["retrieval_ms_p50"] = float(np.percentile(np.array(retrieval.query_seconds) * 1e3, 50))
            rows.append({"workload": "humaneval", "index": "stdlib" if with_index else "none", "cache": cache, **r})
            print(f"humaneval  {cache:25s} index={rows[-1]['index']:6s} MAT {r['mat']:.3f}", flush=True)
    # loghub: each system's records with an index over the other seven systems' logs, either
    # raw (`*_2k.log`) or as an archive of earlier rewrites (their lines as JSON objects, the
    # workload's output format)
    folder = os.path.join(args.data, "loghub")
    systems = sorted(f[: -len("_2k.log")] for f in os.listdir(folder) if f.endswith("_2k.log"))
    records = list(WORKLOADS["loghub"](args.data))
    with tempfile.TemporaryDirectory() as tmp:
        indexes: dict = {"raw logs": {}, "JSON archive": {}}
        for system in systems:
            raw = [os.path.join(folder, f"{s}_2k.log") for s in systems if s != system]
            indexes["raw logs"][system] = _open_built(raw, os.path.join(tmp, f"raw-{system}"), args.tokenizer)
            archive = os.path.join(tmp, f"archive-{system}.jsonl")
            with open(archive, "w", encoding="utf-8") as f:
                for s in systems:
                    if s != system:
                        for group in json_groups(folder, s):
                            f.write(json.dumps({"text": group}) + "\n")
            indexes["JSON archive"][system] = _open_built([archive], os.path.join(tmp, f"json-{system}"), args.tokenizer)
        for cache, capacity in (("with cross-request cache", 10_000_000), ("each request alone", 0)):
            base = EngineConfig(suffix=SuffixConfig(global_capacity=capacity))
            for kind in ("none", "raw logs", "JSON archive"):
                per_record = None
                if kind != "none":
                    def per_record(record, by_system=indexes[kind]):
                        index = by_system[record["id"].rsplit("-", 1)[0]]
                        return [RetrievalProposer(index, RetrievalConfig(index=index.path))]
                r = replay_records(records, tokenizer, build_proposers(base, tokenizer=tokenizer), per_record)
                label = "none" if kind == "none" else f"other systems' {kind}"
                rows.append({"workload": "loghub", "index": label, "cache": cache, **r})
                print(f"loghub     {cache:25s} index={label:28s} MAT {r['mat']:.3f}", flush=True)
    for row in rows:
        if row["index"] != "none":
            base_row = next(b for b in rows if b["workload"] == row["workload"] and b["cache"] == row["cache"]
                            and b["index"] == "none")
            row["ratio_to_no_index"] = row["mat"] / base_row["mat"]
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="build,latency,recall,replay")
    ap.add_argument("--stdlib", default=sysconfig.get_paths()["stdlib"], help="CPython standard library folder")
    ap.add_argument("--tokenizer", default=str(SHARED_DIR / "data/tokenizers/llama2/tokenizer.model"))
    ap.add_argument("--data", default=str(SHARED_DIR / "data"))
    ap.add_argument("--index", default=str(REPO_ROOT / "indexes" / "stdlib-llama2"), help="where the index is built")
    ap.add_argument("--out", default=str(RESULTS_DIR / "index_stdlib.json"))
    args = ap.parse_args(argv)
    if not os.path.exists(args.tokenizer):
        print(f"skipped: tokenizer not found at {args.tokenizer}")
        return 0
    meta = run_metadata()
    tokenizer = load_tokenizer(args.tokenizer)
    parts = args.parts.split(",")
    results: dict = {}
    if os.path.exists(args.out):  # parts not run now keep their earlier figures (each part says its commit)
        with open(args.out) as f:
            results = {k: v for k, v in json.load(f)["results"].items() if k not in parts}
    if "build" in parts:
        results["build"] = part_build(args)
    if "latency" in parts:
        results["latency"] = part_latency(args, tokenizer)
    if "recall" in parts:
        results["recall"] = part_recall(args, tokenizer)
    if "replay" in parts:
        results["replay"] = part_replay(args, tokenizer)
        print()
        print(format_table(results["replay"], [("workload", "workload", ""), ("cache", "suffix cache", ""),
                                               ("index", "index", ""), ("mat", "MAT", ".3f"),
                                               ("ratio_to_no_index", "x no index", ".3f"),
                                               ("accepted_share_by_source", "share", "")]))
    for part in parts:
        if part in results:
            results[part] = {"git": meta["git"], "command": meta["command"], "figures": results[part]} \
                if not isinstance(results[part], dict) or "figures" not in results[part] else results[part]
    figures = {k: v["figures"] if isinstance(v, dict) and "figures" in v else v for k, v in results.items()}
    bars = {}
    if "build" in figures:
        b = figures["build"]
        bars["build_minutes_le_5"] = b["seconds"] <= 300
        bars["index_le_4x_token_store"] = b["index_over_token_store"] <= 4
    if "latency" in figures:
        bars["latency_p50_le_20ms"] = figures["latency"]["start_ms_p50"] <= 20
    if "replay" in figures:
        bars["humaneval_ratio_ge_1.3"] = {r["cache"]: r["ratio_to_no_index"] >= 1.3 for r in figures["replay"]
                                          if r["workload"] == "humaneval" and r["index"] != "none"}
    print("bars:", bars)
    path = write_result(args.out, "index", vars(args), results, meta=meta, bars=bars)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
