"""`lookupdec rewrite --ray` against the single-process pipeline on loghub log-to-JSON records.

    python bench/ray_bench.py [--model smollm2] [--records-per-system 6] [--max-new-tokens 96]
                              [--rounds 2] [--batch-size 1]

Records: the first N lines of each ``../shared/data/loghub/<System>_2k.log``, one file per
system in a temporary folder (so each system is one affinity group), one record per line,
the loghub workload's instruction. Every configuration is the real command line run as a
subprocess (`--json-summary`), on the same files, so the same ids:

- ``single``: one process, one torch thread (``OMP_NUM_THREADS=1``), ``--batch-size`` as given;
- ``single-2t``: the same with two torch threads (both cores to one engine);
- ``ray1``, ``ray2``: ``--ray --ray-workers 1|2 --ray-cpus-per-worker 1`` (one torch thread
  per worker), a local Ray instance started by the command, records to workers by affinity;
- ``ray2-spread``, ``ray2-random``: 2 workers, ``--ray-sharding spread`` / ``random`` (records,
  in input order / shuffled, to whichever worker has room, ignoring groups): what affinity is worth;
- ``transformers``: plain greedy ``generate``, one record at a time, one thread, in this
  process (first round only): the reference for speed and for output identity.

Every run starts from the same verify-cost curves: a warm-up (all records, 16 tokens, at one
and at two threads) measures them into a file of its own, copied afresh for each run
(``LOOKUPDEC_COST_CACHE``), so no run learns from another's timings, and a run starts only
once the previous run's Ray processes are gone. Rounds rotate the order of the configurations. Per configuration: median over rounds of the
whole command's wall time, the summary's ``seconds`` and ``startup_seconds`` (Ray's start and
the workers' engine loads), tokens/s over the records phase (``seconds - startup_seconds``) and
over the whole command, accepted tokens per step. Derived: Ray's overhead per record at this
batch size, ``(records phase of ray1 - seconds of single) / records``; and every
configuration's outputs checked identical to ``single``'s and ``transformers``' by id.
Writes ``bench/results/ray.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import RESULTS_DIR, SHARED_DIR, format_table, run_metadata, write_result  # noqa: E402

from lookupdec.workloads import LOG_INSTRUCTION  # noqa: E402

CONFIGS = {  # name -> (extra flags, torch threads of the command's own process)
    "single": [],
    "single-2t": [],
    "ray1": ["--ray", "--ray-workers", "1", "--ray-cpus-per-worker", "1"],
    "ray2": ["--ray", "--ray-workers", "2", "--ray-cpus-per-worker", "1"],
    "ray2-spread": ["--ray", "--ray-workers", "2", "--ray-cpus-per-worker", "1", "--ray-sharding", "spread"],
    "ray2-random": ["--ray", "--ray-workers", "2", "--ray-cpus-per-worker", "1", "--ray-sharding", "random"],
}


def make_inputs(folder: str, per_system: int) -> list[str]:
    loghub = os.path.join(SHARED_DIR, "data", "loghub")
    paths = []
    for name in sorted(f for f in os.listdir(loghub) if f.endswith("_2k.log")):
        with open(os.path.join(loghub, name), encoding="utf-8") as f:
            lines = [line for line in f.read().split("\n") if line.strip()][:per_system]
        path = os.path.join(folder, name[: -len("_2k.log")] + ".log")
        with open(path, "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")
        paths.append(path)
    return paths


def ray_processes() -> int:
    """Processes a local Ray instance left running (its workers and agents are named ray::...)."""
    count = 0
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        count += cmd.startswith(b"ray::") or b"raylet" in cmd.split(b"\0")[0] or b"gcs_server" in cmd.split(b"\0")[0]
    return count


def quiet_machine(timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while ray_processes() and time.monotonic() < deadline:
        time.sleep(0.5)
    time.sleep(1.0)


def run_cli(name: str, args, inputs: list[str], folder: str, extra=(), *, max_new_tokens=None,
            cost_cache: str | None = None) -> dict:
    out = os.path.join(folder, f"{name}-{time.monotonic_ns()}.jsonl")
    argv = [sys.executable, "-m", "lookupdec", "rewrite", "--model", args.model, "--input", *inputs, "--output", out,
            "--instruction", LOG_INSTRUCTION, "--max-new-tokens", str(max_new_tokens or args.max_new_tokens),
            "--batch-size", str(args.batch_size), "--quiet", "--json-summary", *CONFIGS.get(name, []),
            *args.engine_flags.split(), *extra]
    env = dict(os.environ, OMP_NUM_THREADS="2" if name.endswith("-2t") else "1")
    warm = os.path.join(folder, "cost_curves.json")
    if cost_cache is None:  # a fresh copy of the warm-up's curves
        cost_cache = os.path.join(folder, "run_cost_curves.json")
        if os.path.exists(warm):
            shutil.copyfile(warm, cost_cache)
        elif os.path.exists(cost_cache):  # (--fixed-budget measures no curve)
            os.unlink(cost_cache)
    env["LOOKUPDEC_COST_CACHE"] = cost_cache
    quiet_machine()
    start = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{name}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    with open(out, encoding="utf-8") as f:
        lines = [json.loads(line) for line in f]
    os.unlink(out)
    outputs = {line["id"]: line["output"] for line in lines}
    generating = sum(line["stats"]["seconds"] for line in lines)  # each record's own generate time
    return {"wall_s": wall, "summary": summary, "outputs": outputs, "generating_s": generating}


def transformers_greedy(args, inputs: list[str]) -> tuple[dict, float, int]:
    """Plain greedy generate per record, one thread: (id -> text, seconds, new tokens)."""
    import torch

    from lookupdec.model import load
    from lookupdec.pipelines import PromptFormat, read_records

    torch.set_num_threads(1)
    model, tokenizer = load(args.model, device="cpu", dtype=torch.float32)
    prompts = PromptFormat.from_instruction(LOG_INSTRUCTION)
    records = read_records(inputs)[0]
    texts, tokens, seconds = {}, 0, 0.0
    eos = tokenizer.eos_token_id
    with torch.inference_mode():
        for record in records:
            ids = tokenizer(prompts.prompt(record), return_tensors="pt").input_ids
            start = time.perf_counter()
            out = model.generate(ids, do_sample=False, max_new_tokens=args.max_new_tokens,
                                 pad_token_id=eos if eos is not None else 0)
            seconds += time.perf_counter() - start
            new = out[0, ids.shape[1]:].tolist()
            if eos is not None and eos in new:
                new = new[: new.index(eos)]
            tokens += len(new)
            texts[record.id] = tokenizer.decode(new, skip_special_tokens=True)
    return texts, seconds, tokens


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--records-per-system", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch-size", default="1")
    parser.add_argument("--no-transformers", action="store_true", help="leave out the plain transformers row")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS),
                        help="which configurations (single is always run: the reference)")
    parser.add_argument("--engine-flags", default="", metavar="FLAGS",
                        help="more flags for every run, e.g. '--fixed-budget --max-nodes 16' (trees then do not "
                        "depend on timings: tokens per step compare exactly)")
    parser.add_argument("--out", default=str(RESULTS_DIR / "ray.json"))
    args = parser.parse_args(argv)
    meta = run_metadata(threads_set_by_benchmark=True)
    folder = tempfile.mkdtemp(prefix="ray-bench-")
    inputs = make_inputs(folder, args.records_per_system)
    names = ["single"] + [n for n in args.configs if n != "single"]
    print("warm-up (model file cache, cost curves at 1 and 2 threads) ...", flush=True)
    warm = os.path.join(folder, "cost_curves.json")
    run_cli("single", args, inputs, folder, max_new_tokens=16, cost_cache=warm)
    if "single-2t" in names:
        run_cli("single-2t", args, inputs, folder, max_new_tokens=16, cost_cache=warm)
    runs: dict[str, list] = {name: [] for name in names}
    for r in range(args.rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            result = run_cli(name, args, inputs, folder)
            s = result["summary"]
            print(f"round {r + 1} {name:12s} wall {result['wall_s']:6.1f} s  seconds {s['seconds']:6.1f}  startup "
                  f"{s.get('startup_seconds', 0):5.1f}  {s['tokens_per_s']:6.1f} tok/s  {s['mean_accepted']:.2f} "
                  "tok/step", flush=True)
            runs[name].append(result)
    reference = runs["single"][0]["outputs"]
    rows = []
    for name in names:
        rs = runs[name]
        summaries = [x["summary"] for x in rs]
        records_s = [s["seconds"] - s.get("startup_seconds", 0.0) for s in summaries]
        rows.append({
            "config": name, "records": summaries[0]["done"], "new_tokens": summaries[0]["new_tokens"],
            "wall_s": statistics.median(x["wall_s"] for x in rs),
            "startup_s": statistics.median(s.get("startup_seconds", 0.0) for s in summaries),
            "records_s": statistics.median(records_s),
            "tokens_per_s": statistics.median(s["new_tokens"] / t for s, t in zip(summaries, records_s)),
            "tokens_per_s_wall": statistics.median(s["new_tokens"] / x["wall_s"] for s, x in zip(summaries, rs)),
            "mean_accepted": statistics.median(s["mean_accepted"] for s in summaries),
            "identical": sum(all(x["outputs"].get(k) == v for x in rs) for k, v in reference.items()),
            # the records phase less the records' own generation: the pipeline's (and Ray's) cost
            # (one worker only: parallel workers generate more seconds than the wall clock holds)
            "outside_ms_per_record": statistics.median(
                (t - x["generating_s"]) / s["done"] * 1000 for s, t, x in zip(summaries, records_s, rs))
            if all(s.get("workers", 0) <= 1 for s in summaries) else None,
            "runs": [{"wall_s": x["wall_s"], "summary": x["summary"]} for x in rs],
        })
    by = {row["config"]: row for row in rows}
    for row in rows:
        row["vs_single"] = row["tokens_per_s"] / by["single"]["tokens_per_s"]
        row["vs_single_wall"] = row["tokens_per_s_wall"] / by["single"]["tokens_per_s_wall"]
    records = by["single"]["records"]
    overhead_ms = (by["ray1"]["records_s"] - by["single"]["records_s"]) / records * 1000 if "ray1" in by else None
    # the same, free of the two runs' different budget choices: time outside generating, per record
    outside_ms = (by["ray1"]["outside_ms_per_record"] - by["single"]["outside_ms_per_record"]) if "ray1" in by else None
    rival = next((n for n in ("ray2-spread", "ray2-random") if n in by), None)
    affinity = ({"against": rival, "tokens_per_s": by["ray2"]["tokens_per_s"] / by[rival]["tokens_per_s"],
                 "mean_accepted": (by["ray2"]["mean_accepted"], by[rival]["mean_accepted"])}
                if "ray2" in by and rival else None)
    if "ray2" in by and "ray2-random" in by and rival != "ray2-random":
        affinity["random"] = {"tokens_per_s": by["ray2"]["tokens_per_s"] / by["ray2-random"]["tokens_per_s"],
                              "mean_accepted": (by["ray2"]["mean_accepted"], by["ray2-random"]["mean_accepted"])}
    if not args.no_transformers:
        print("transformers greedy, one record at a time ...", flush=True)
        texts, seconds, tokens = transformers_greedy(args, inputs)
        rows.append({"config": "transformers", "records": len(texts), "new_tokens": tokens, "records_s": seconds,
                     "tokens_per_s": tokens / seconds, "vs_single": tokens / seconds / by["single"]["tokens_per_s"],
                     "identical": sum(texts.get(k) == v for k, v in reference.items())})
    print(format_table(rows, [("config", "config", ""), ("records", "records", "d"), ("identical", "identical", "d"),
                              ("startup_s", "startup s", ".1f"), ("records_s", "records s", ".1f"),
                              ("wall_s", "wall s", ".1f"), ("tokens_per_s", "tok/s", ".1f"),
                              ("vs_single", "x single", ".2f"), ("vs_single_wall", "x single (wall)", ".2f"),
                              ("mean_accepted", "tok/step", ".2f"), ("outside_ms_per_record", "outside ms/rec", ".1f")]))
    if overhead_ms is not None:
        print(f"Ray overhead per record (batch {args.batch_size}): {overhead_ms:.1f} ms from the records phases, "
              f"{outside_ms:.1f} ms outside generation")
    if affinity is not None:
        for name, a in [(affinity["against"], affinity)] + [("ray2-random", affinity["random"])] * ("random" in affinity):
            print(f"affinity vs {name} at 2 workers: {a['tokens_per_s']:.2f}x tokens/s, tokens/step "
                  f"{a['mean_accepted'][0]:.2f} vs {a['mean_accepted'][1]:.2f}")
    path = write_result(args.out, "ray", vars(args), rows, threads_set_by_benchmark=True, meta=meta,
                        ray_overhead_ms_per_record=overhead_ms, ray_outside_ms_per_record=outside_ms,
                        affinity=affinity)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
