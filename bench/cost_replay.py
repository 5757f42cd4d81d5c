"""Model-free: the per-step chooser learning the verify cost online, against the true curve and fixed budgets.

SmolLM2's own greedy outputs (``transformers`` ``generate``, 128 new tokens) on the prompts of
``bench/real_model.py`` (10 per workload, its order) are replayed through the engine's step
(``StepCore``, as ``lookupdec.simulate``: proposers, calibrator and size record kept across
the prompts, as one engine keeps them; token recycling fed, after each step, the model's top
tokens after every node the walk visited, recorded with the outputs from one teacher-forced
forward per prompt, as the engine's verify forward hands them over) and timed with a true cost
curve ``t(n)``: SmolLM2's
verify cost measured by ``bench/chain_curve.py`` (``--curve``: its result JSON, the machine's
level taken out; a ``real_model.py`` result's chain curve is read too). A prompt's modelled time
is ``t(prompt)`` (its prefill) plus, per step, ``t(1 + nodes)`` and ``--overhead-ms``; greedy's is
``t(prompt)`` plus ``t(1)`` per token after the first. Methods:

* ``oracle``  -- the chooser reads the true curve (every size, counted often)
* ``learnt``  -- as the engine: seeded by one forward of each of ``SEED_SIZES``, then every
  step's forward observed, its time the true one times noise as ``chain_curve.py`` measured it
  on this machine: log-normal (``--sigma``), most of its variance (``--shared``) a level every
  size shares that moves slowly (``--persistence``: its correlation from one forward to the
  next), the rest each forward's own, and a fraction ``--spikes`` of forwards doubled
* ``fixed4``, ``fixed16`` -- ``budget="fixed"`` (no cost model)

over ``--seeds`` seeds of the noise. Reported per curve, method and workload: the modelled
speedup over greedy (total tokens over total time), the default's over the best fixed budget
and the worst prompt; for the learnt methods the mean and the worst over seeds, and the prompts
below 0.97x greedy in any seed; a row ``all`` per curve totals every prompt. Acceptance is
exact (the recorded output is what greedy verification accepts); only time is modelled.

    python bench/cost_replay.py                   # outputs generated first (~8 min, 2 threads), then ~15 s
    python bench/cost_replay.py --outputs /tmp/smollm2_outputs.json --seeds 4 --curve bench/results/chain_curve_2t.json

The outputs are kept in ``--outputs`` (default ``~/.cache/lookupdec/bench/smollm2_outputs.json``;
not in the repository: they derive from ``../shared/data``). Writes ``bench/results/cost_replay.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import RESULTS_DIR, format_table, run_metadata, write_result  # noqa: E402

from lookupdec import budget  # noqa: E402
from lookupdec.budget import SEED_SIZES, AcceptanceCalibrator, CostModel, DraftBudget  # noqa: E402
from lookupdec.config import EngineConfig  # noqa: E402
from lookupdec.mixture import Mixture  # noqa: E402
from lookupdec.proposers import build_proposers  # noqa: E402
from lookupdec.simulate import recorded_verdict  # noqa: E402
from lookupdec.step import StepCore, Verdict  # noqa: E402

DEFAULT_OUTPUTS = Path(os.path.expanduser("~")) / ".cache" / "lookupdec" / "bench" / "smollm2_outputs.json"
DEFAULT_CURVES = [RESULTS_DIR / "chain_curve_2t.json", RESULTS_DIR / "chain_curve_1t.json"]
SPIKE_FACTOR = 2.0
# the learnt methods: the engine's cost model as it is, and with settings of budget.py changed
LEARNT = {"learnt": {}}
MAX_NEW = 128


def generate_outputs(path: Path, threads: int, outputs: dict | None = None) -> dict:
    """SmolLM2's greedy outputs on real_model.py's prompts (token ids) and the model's top tokens
    after each of their positions (``add_tops``), written to ``path``; given ``outputs`` (a file
    from before the top tokens were kept), only the top tokens are added."""
    import torch
    from tqdm import tqdm

    import real_model
    from e2e import run_method
    from lookupdec import Engine

    torch.set_num_threads(threads)
    loader = Engine.from_pretrained("smollm2", dtype="float32")
    if outputs is None:
        workloads = real_model.build_workloads(loader, 10, 1536)
        outputs = {}
        with tqdm(total=sum(len(p) for p in workloads.values()), desc="greedy outputs", unit="prompt") as bar:
            for name, prompts in workloads.items():
                outputs[name] = []
                for prompt in prompts:
                    ids, _ = run_method("greedy", loader.target.model, None, prompt, MAX_NEW)
                    outputs[name].append({"prompt": list(prompt), "response": list(ids)})
                    bar.update()
    add_tops(loader.target.model, outputs)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(outputs))
    tmp.replace(path)  # never half-written
    return outputs


def add_tops(model, outputs: dict) -> None:
    """Each record's ``tops``: the model's ``successors`` best token ids (best first) after the
    prompt's last token and after each response token, from one teacher-forced forward: what the
    engine's verify forward hands token recycling for the nodes a step's walk visits (the same
    context, so the same distribution). Checked: their first is the greedy response."""
    import torch
    from tqdm import tqdm

    k = EngineConfig().recycle.successors
    records = [r for rs in outputs.values() for r in rs]
    for record in tqdm(records, desc="top tokens", unit="prompt"):
        prompt, response = record["prompt"], record["response"]
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1:]
        tops = logits.topk(k, dim=-1).indices
        if tops[: len(response), 0].tolist() != response:
            raise SystemExit("the teacher-forced argmax differs from the greedy output: not the model that made it")
        record["tops"] = tops.tolist()


def read_curve(path: Path) -> tuple[str, list[int], list[float]]:
    """The cost curve (label, sizes, seconds) of a ``bench/chain_curve.py`` result (the machine's
    level taken out), or the chain cost curve a ``bench/real_model.py`` result recorded."""
    try:
        data = json.loads(path.read_text())
        if data.get("benchmark") == "chain_curve":
            res = data["results"]
            return res["label"], list(res["sizes"]), list(res["seconds"])
        info = data["results"]["threads"][0]
        curve = info["cost_curve"]
        return f"{info['threads']}t", list(curve["sizes"]), list(curve["seconds"])
    except (OSError, ValueError, KeyError, IndexError, TypeError, AttributeError) as e:
        raise SystemExit(f"--curve {path}: not a bench/chain_curve.py or bench/real_model.py result with a cost curve ({e})")


def true_cost(sizes: list[int], seconds: list[float]):
    """``t(n)``: linear between the measured sizes, and past the last one along the last segment."""
    xs, ys = np.asarray(sizes, float), np.asarray(seconds, float)
    slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])

    def t(n: int) -> float:
        return float(np.interp(n, xs, ys)) if n <= xs[-1] else float(ys[-1] + slope * (n - xs[-1]))
    return t


def replay_method(outputs: dict, t, method: str, *, sigma: float, spikes: float, seed: int,
                  overhead_s: float, shared: float = 0.0, persistence: float = 0.0,
                  steps: dict | None = None) -> dict[str, list[tuple[float, int]]]:
    """Per workload, per prompt: (greedy's modelled time over the method's, tokens). With
    ``steps``, each verified tree's (the request's drafted step number, tokens predicted,
    tokens accepted) is appended to ``steps[workload]`` (``StepResult.predicted``: the tree's
    promise times the step's correction, as the chooser read it)."""
    fixed = method.startswith("fixed")
    config = EngineConfig(budget="fixed", max_nodes=int(method[5:])) if fixed else EngineConfig()
    calibrator = AcceptanceCalibrator()
    core = StepCore(Mixture(build_proposers(config), None, config.draft, calibrator), max_nodes=config.max_nodes,
                    calibrator=calibrator, draft_budget=DraftBudget())
    rng = np.random.default_rng(seed)
    shared_sd, own_sd = sigma * np.sqrt(shared), sigma * np.sqrt(1.0 - shared)
    level = float(rng.normal(0.0, shared_sd))  # the machine's log speed now (AR(1) per forward)

    def observed(n: int) -> float:
        nonlocal level
        noise = 1.0
        if sigma > 0:
            level = persistence * level + np.sqrt(1.0 - persistence**2) * shared_sd * rng.normal()
            noise = float(np.exp(level + rng.normal(0.0, own_sd)))
        return t(n) * noise * (SPIKE_FACTOR if rng.random() < spikes else 1.0)

    if fixed:
        cost = None
    elif method == "oracle":
        top = 2 * config.max_nodes + 2
        cost = CostModel(range(1, top), [t(n) for n in range(1, top)], [100.0] * (top - 1))
    else:
        cost = CostModel(list(SEED_SIZES), [observed(n) for n in SEED_SIZES])
    learns = method in LEARNT
    result = {}
    for name, records in outputs.items():
        result[name] = []
        for i, record in enumerate(records):
            prompt, response = record["prompt"], record["response"]
            rid, context, seconds, drafted = f"{name}-{i}", list(prompt), 0.0, 0
            tops = record["tops"]

            def verdict(tree, rest):  # the recorded walk, and the target's top tokens after each visited node
                walk = recorded_verdict(tree, rest)
                visited = [0, *walk.accepted]
                at = len(context) - len(prompt)  # tops[at]: after the root (the context's last token)
                return Verdict(walk.accepted, walk.new_tokens, (context[-2] if len(context) > 1 else -1,
                                                                tree.tokens_of(visited), tops[at: at + len(visited)]))
            core.start(rid, context)
            try:
                core.first(rid, response[:1])  # the prefill's token, as RequestCore.first
                context.append(response[0])
                while len(context) - len(prompt) < len(response):
                    rest = response[len(context) - len(prompt):]
                    step = core.run(rid, context, lambda tree: verdict(tree, rest), max_depth=config.max_depth,
                                    cost=cost)
                    seconds += t(len(step.tree)) + overhead_s
                    if steps is not None and step.tree.num_draft_nodes:
                        drafted += 1
                        steps.setdefault(name, []).append((drafted, step.predicted, len(step.accepted)))
                    if learns:
                        cost.observe(len(step.tree), observed(len(step.tree)))
                    context.extend(step.new_tokens)
            finally:
                core.stop(rid)
            prefill = t(len(prompt))
            greedy = prefill + (len(response) - 1) * t(1)
            result[name].append((greedy / (prefill + seconds), len(response)))
    return result


def total(rows: list[tuple[float, int]]) -> float:
    """Total tokens over total time, relative to greedy's."""
    return sum(n for _, n in rows) / sum(n / r for r, n in rows)


STEP_BUCKETS = ((1, 1), (2, 2), (3, 4), (5, 8), (9, 16), (17, None))  # a request's drafted steps, grouped


def by_step(records: list[tuple[int, float, int]]) -> list[dict]:
    """Accepted over predicted tokens per group of a request's drafted steps (``STEP_BUCKETS``):
    whether the calibration, learnt across requests, holds at a request's start.

    >>> by_step([(1, 2.0, 0), (1, 1.0, 0), (2, 1.0, 1), (3, 0.5, 1), (30, 1.0, 2)])[:3]
    [{'steps': '1', 'trees': 2, 'predicted': 3.0, 'accepted': 0, 'ratio': 0.0}, {'steps': '2', 'trees': 1, 'predicted': 1.0, 'accepted': 1, 'ratio': 1.0}, {'steps': '3-4', 'trees': 1, 'predicted': 0.5, 'accepted': 1, 'ratio': 2.0}]
    """
    out = []
    for lo, hi in STEP_BUCKETS:
        inside = [(p, a) for k, p, a in records if k >= lo and (hi is None or k <= hi)]
        predicted, accepted = sum(p for p, _ in inside), sum(a for _, a in inside)
        label = str(lo) if lo == hi else f"{lo}-{hi}" if hi is not None else f"{lo}+"
        out.append({"steps": label, "trees": len(inside), "predicted": round(predicted, 3), "accepted": accepted,
                    "ratio": round(accepted / predicted, 3) if predicted > 0 else None})
    return out


def below_prompts(of, runs: list[dict], bar: float = 0.97) -> list[dict]:
    """The prompts below ``bar`` in any seed: index (``bench/real_model.py``'s), the worst seed's
    ratio, the seeds below, the response's tokens.

    >>> runs = [{"w": [(1.2, 100), (0.9, 13)]}, {"w": [(1.1, 100), (0.95, 13)]}]
    >>> below_prompts(lambda r: r["w"], runs)
    [{'prompt': 1, 'worst': 0.9, 'seeds_below': 2, 'tokens': 13}]
    """
    out = []
    for i in range(len(of(runs[0]))):
        ratios = [of(r)[i][0] for r in runs]
        if min(ratios) < bar:
            out.append({"prompt": i, "worst": round(min(ratios), 3), "seeds_below": sum(x < bar for x in ratios),
                        "tokens": of(runs[0])[i][1]})
    return out


def run(outputs: dict, curve_path: Path, args) -> tuple[list[dict], dict]:
    label, sizes, seconds = read_curve(curve_path)
    t = true_cost(sizes, seconds)
    overhead = args.overhead_ms / 1e3
    fixed = {m: replay_method(outputs, t, m, sigma=0, spikes=0, seed=0, overhead_s=overhead)
             for m in ("fixed4", "fixed16")}
    oracle = replay_method(outputs, t, "oracle", sigma=0, spikes=0, seed=0, overhead_s=overhead)
    learnt: dict[str, list[dict]] = {name: [] for name in LEARNT}
    steps: dict[str, list] = {}  # the default's ("learnt") verified trees over every seed, per workload
    for seed in range(args.seeds):
        for method, settings in LEARNT.items():
            original = {name: getattr(budget, name) for name in settings}
            try:
                for name, value in settings.items():
                    setattr(budget, name, value)
                learnt[method].append(replay_method(outputs, t, method, sigma=args.sigma, spikes=args.spikes,
                                                    seed=seed, overhead_s=overhead, shared=args.shared,
                                                    persistence=args.persistence,
                                                    steps=steps if method == "learnt" else None))
            finally:
                for name, value in original.items():
                    setattr(budget, name, value)
    rows = []
    for name in [*outputs, "all"]:
        def of(result: dict) -> list[tuple[float, int]]:  # a workload's prompts, or every prompt
            return [x for n in outputs for x in result[n]] if name == "all" else result[name]
        best = max(total(of(fixed[m])) for m in fixed)
        row = {"curve": label, "workload": name, "oracle": total(of(oracle)),
               "fixed4": total(of(fixed["fixed4"])), "fixed16": total(of(fixed["fixed16"]))}
        for method, runs in learnt.items():
            speed = [total(of(r)) for r in runs]
            row[f"{method}_mean"] = float(np.mean(speed))
            row[f"{method}_worst"] = min(speed)
            row[f"{method}/best_fixed_worst"] = min(speed) / best
            row[f"{method}_worst_prompt"] = min(min(x for x, _ in of(r)) for r in runs)
            row[f"{method}_below_0.97"] = sum(any(of(r)[i][0] < 0.97 for r in runs) for i in range(len(of(runs[0]))))
            if name != "all":  # which prompts, to set beside a real run's (bench/real_model.py's prompt index)
                row[f"{method}_prompts_below_0.97"] = below_prompts(of, runs)
        row["learnt_by_step"] = by_step([x for n in outputs for x in steps.get(n, [])] if name == "all"
                                        else steps.get(name, []))
        rows.append(row)
    return rows, {"curve": str(curve_path), "label": label, "sizes": sizes, "seconds": seconds}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--outputs", type=Path, default=DEFAULT_OUTPUTS,
                   help=f"SmolLM2's greedy outputs (JSON; generated if absent) ({DEFAULT_OUTPUTS})")
    p.add_argument("--curve", type=Path, nargs="+", default=DEFAULT_CURVES,
                   help="bench/real_model.py results whose cost curve is the truth (the 2- and 1-thread tables)")
    p.add_argument("--seeds", type=int, default=8, help="seeds of the observation noise (8)")
    p.add_argument("--sigma", type=float, default=0.15, help="log-normal noise of an observed forward (0.15)")
    p.add_argument("--spikes", type=float, default=0.03, help="fraction of observed forwards doubled (0.03)")
    p.add_argument("--shared", type=float, default=0.93,
                   help="share of the noise's variance that is the machine's level, shared by every size (0.93)")
    p.add_argument("--persistence", type=float, default=0.98,
                   help="correlation of the machine's level from one forward to the next (0.98)")
    p.add_argument("--overhead-ms", type=float, default=0.5, help="per-step overhead added to every step (0.5)")
    p.add_argument("--threads", type=int, default=2, help="torch threads to generate the outputs with (2)")
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "cost_replay.json", help="result JSON")
    args = p.parse_args(argv)
    if (args.seeds < 1 or args.sigma < 0 or not 0 <= args.spikes <= 1 or args.overhead_ms < 0
            or not 0 <= args.shared <= 1 or not 0 <= args.persistence < 1):
        p.error("--seeds must be >= 1, --sigma and --overhead-ms >= 0, --spikes and --shared in [0, 1], "
                "--persistence in [0, 1)")
    meta = run_metadata()
    if args.outputs.exists():
        try:
            outputs = json.loads(args.outputs.read_text())
        except ValueError as e:
            raise SystemExit(f"--outputs {args.outputs}: not JSON ({e}); delete it to generate it again")
    else:
        outputs = generate_outputs(args.outputs, args.threads)
    if any("tops" not in r for rs in outputs.values() for r in rs):  # a file from before they were kept
        print(f"{args.outputs}: adding the model's top tokens after each position (token recycling's input)")
        outputs = generate_outputs(args.outputs, args.threads, outputs)
    start = time.perf_counter()
    rows, curves = [], []
    for path in args.curve:
        r, c = run(outputs, path, args)
        rows.extend(r)
        curves.append(c)
    columns = [("curve", "curve", "s"), ("workload", "workload", "s"), ("oracle", "oracle", ".2f"),
               ("fixed4", "fixed4", ".2f"), ("fixed16", "fixed16", ".2f"),
               ("learnt_mean", "learnt mean", ".2f"), ("learnt_worst", "worst seed", ".2f"),
               ("learnt/best_fixed_worst", "/best fixed", ".2f"), ("learnt_worst_prompt", "worst prompt", ".2f"),
               ("learnt_below_0.97", "< 0.97", "d")]
    print("modelled speedup over greedy (SmolLM2's outputs, model-free); learnt methods over "
          f"{args.seeds} seeds (sigma {args.sigma}, {args.shared:.0%} of it shared, persistence {args.persistence}, "
          f"{args.spikes:.0%} spikes):")
    print(format_table(rows, columns))
    print("\nthe default's accepted over predicted tokens by the request's drafted step (every seed; "
          "trees in parentheses):")
    labels = [b["steps"] for b in rows[0]["learnt_by_step"]]
    print(format_table([{"curve": row["curve"], "workload": row["workload"],
                         **{f"s{b['steps']}": (f"{b['ratio']:.2f} ({b['trees']})" if b["ratio"] is not None else "-")
                            for b in row["learnt_by_step"]}} for row in rows],
                       [("curve", "curve", "s"), ("workload", "workload", "s")]
                       + [(f"s{label}", f"step {label}", "s") for label in labels]))
    print()
    for row in rows:
        for method in LEARNT:
            for b in row.get(f"{method}_prompts_below_0.97", ()):
                print(f"{row['curve']} {method}: {row['workload']} #{b['prompt']} ({b['tokens']} tokens) below 0.97x "
                      f"greedy in {b['seeds_below']} of {args.seeds} seeds, worst {b['worst']:.3f}")
    config = {"command": "python bench/cost_replay.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "outputs": str(args.outputs), "seeds": args.seeds, "sigma": args.sigma, "spikes": args.spikes,
              "spike_factor": SPIKE_FACTOR, "shared": args.shared, "persistence": args.persistence,
              "overhead_ms": args.overhead_ms, "curves": curves, "methods": LEARNT, "seconds": round(time.perf_counter() - start, 1)}
    write_result(args.out, "cost_replay", config, rows, meta=meta)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
