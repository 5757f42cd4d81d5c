"""Drafting quality, model-free: mean accepted tokens per step (MAT) on real recorded outputs.

Replays each workload (``lookupdec simulate``'s builders over ``../shared/data``) through
lookupdec and its peers, side by side, with the same tokenizer (Llama-2, as Vicuna-7B uses),
the same tree merge and the same acceptance rule (longest matching tree path + one bonus
token: exact for greedy decoding). Writes ``bench/results/replay.json`` and
``bench/results/replay.png``.

    python bench/replay.py                       # every workload, every method
    python bench/replay.py --workloads mtbench --limit 20 --quick
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import RESULTS_DIR, SHARED_DIR, format_table, write_result  # noqa: E402
from peers import SuffixDecodingPeer, TransformersPromptLookup, suffixdecoding_available  # noqa: E402

from lookupdec.config import EngineConfig  # noqa: E402
from lookupdec.model import load_tokenizer  # noqa: E402
from lookupdec.proposers import build_proposers  # noqa: E402
from lookupdec.simulate import replay  # noqa: E402
from lookupdec.workloads import WORKLOADS  # noqa: E402

BUDGETS = (16, 32, 64, 128)
PLD_CHAINS = (10, 64, 128)
DEFAULT_WORKLOADS = ("mtbench", "code-edit", "code-edit-nodiff", "loghub")
# The bars: (workload, budget cap, MAT at least)
BARS = {"mtbench": (64, 2.2), "code-edit": (128, 30.0), "loghub": (64, 12.0)}


def methods(budgets, proposers: str):
    """(label, budget, factory) for every method in the comparison."""
    out = [(f"pld-chain{n}", n, lambda n=n: [TransformersPromptLookup(num_output_tokens=n)]) for n in PLD_CHAINS]
    if suffixdecoding_available():
        out += [(f"suffixdecoding@{b}", b, lambda: [SuffixDecodingPeer()]) for b in budgets]
        # its paper's settings for long drafts: no probability floor, drafts up to 4x the match
        out += [(f"suffixdecoding-wide@{b}", b, lambda: [SuffixDecodingPeer(max_spec_factor=4.0, min_token_prob=0.0,
                                                                            name="suffixdecoding-wide")])
                for b in budgets]
    names = tuple(proposers.split(","))
    out += [(f"lookupdec@{b}", b, lambda: build_proposers(EngineConfig(proposers=names))) for b in budgets]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default=",".join(DEFAULT_WORKLOADS), help="comma-separated workload names")
    ap.add_argument("--data", default=str(SHARED_DIR / "data"), help="shared data folder")
    ap.add_argument("--tokenizer", default=str(SHARED_DIR / "data/tokenizers/llama2/tokenizer.model"))
    ap.add_argument("--proposers", default="ngram,suffix", help="lookupdec's proposers")
    ap.add_argument("--budgets", default=",".join(map(str, BUDGETS)))
    ap.add_argument("--limit", type=int, default=None, help="records per workload (all by default)")
    ap.add_argument("--methods", default=None, help="only methods whose label contains one of these (comma-separated)")
    ap.add_argument("--out", default=str(RESULTS_DIR / "replay.json"))
    args = ap.parse_args(argv)
    if not os.path.isdir(args.data):
        print(f"skipped: shared data not found at {args.data}")
        return 0
    tokenizer = load_tokenizer(args.tokenizer)
    budgets = [int(b) for b in args.budgets.split(",")]
    rows = []
    for workload in args.workloads.split(","):
        records = list(WORKLOADS[workload](args.data))[: args.limit]
        for label, budget, factory in methods(budgets, args.proposers):
            if args.methods and not any(m in label for m in args.methods.split(",")):
                continue
            start = time.perf_counter()
            r = replay(records, tokenizer, factory(), max_nodes=budget, max_depth=budget)
            r.pop("per_record")
            rows.append({"workload": workload, "method": label, "budget": budget, "mat": r["mat"],
                         "tree_nodes": r["mean_tree_nodes"], "draft_us_p50": r["draft_us_p50"],
                         "draft_us_p99": r["draft_us_p99"], "records": r["records"],
                         "tokens": r["response_tokens"], "share": r["accepted_share_by_source"],
                         "seconds": time.perf_counter() - start})
            print(f"{workload:18s} {label:22s} MAT {r['mat']:7.3f}  tree {r['mean_tree_nodes']:6.1f}"
                  f"  draft p50 {r['draft_us_p50']:7.1f} us  p99 {r['draft_us_p99']:8.1f} us", flush=True)
    bars = check_bars(rows)
    print()
    print(format_table(rows, [("workload", "workload", ""), ("method", "method", ""), ("mat", "MAT", ".3f"),
                              ("tree_nodes", "nodes", ".1f"), ("draft_us_p50", "draft p50 us", ".1f"),
                              ("draft_us_p99", "draft p99 us", ".1f")]))
    for bar in bars:
        print(f"bar {bar['workload']}: MAT {bar['mat']:.3f} at <= {bar['budget']} nodes, need {bar['need']}: "
              f"{'PASS' if bar['pass'] else 'FAIL'}; ahead of SuffixDecoding at every budget: {bar['ahead_of_suffixdecoding']}")
    path = write_result(args.out, "replay", vars(args), rows, bars=bars)
    plot(rows, path.with_suffix(".png"))
    print(f"wrote {path}")
    return 0


def check_bars(rows) -> list[dict]:
    out = []
    for workload, (cap, need) in BARS.items():
        ours = [r for r in rows if r["workload"] == workload and r["method"].startswith("lookupdec@")]
        if not ours:
            continue
        best = max((r for r in ours if r["budget"] <= cap), key=lambda r: r["mat"], default=None)
        theirs = {}
        for r in rows:
            if r["workload"] == workload and r["method"].startswith("suffixdecoding"):
                theirs[r["budget"]] = max(theirs.get(r["budget"], 0.0), r["mat"])
        ahead = all(r["mat"] > theirs.get(r["budget"], 0.0) for r in ours) if theirs else None
        out.append({"workload": workload, "budget": cap, "need": need, "mat": best["mat"] if best else 0.0,
                    "pass": bool(best and best["mat"] >= need), "ahead_of_suffixdecoding": ahead})
    return out


def plot(rows, path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed (pip install -e '.[bench]'): no plot")
        return
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    labels = list(dict.fromkeys(r["method"] for r in rows))
    fig, axes = plt.subplots(1, len(workloads), figsize=(4.5 * len(workloads), 4.5), squeeze=False)
    for ax, workload in zip(axes[0], workloads):
        mats = {r["method"]: r["mat"] for r in rows if r["workload"] == workload}
        colors = ["tab:gray" if m.startswith("pld") else "tab:orange" if m.startswith("suffix") else "tab:blue"
                  for m in labels]
        ax.barh(labels, [mats.get(m, 0.0) for m in labels], color=colors)
        ax.set_title(workload)
        ax.set_xlabel("mean accepted tokens per step")
        ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
