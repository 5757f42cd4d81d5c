"""Concurrent clients against ``lookupdec serve``: continuous batching (``--max-batch N``) against
the server taking requests one at a time, on SmolLM2-135M-Instruct (float32, CPU, loopback).

Three real server processes, ``--max-batch 1``, ``--max-batch N`` and ``--max-batch N --no-draft``
(plain decoding batched on the same engine: lookupdec over it, ``vs_plain``, is what the lookups
add under load and must never fall below 1), get the same requests, in an order rotated per
measurement; one runs at a time: each measurement starts a server, warms it up
on a prompt no measurement uses, measures and stops it before the other starts. (Until 79a461d
both ran side by side all along, the idle one thought to cost nothing. It does not on this VM:
the batching server's 8-client tokens/s was 81.9 and 80.5 with both alive, 100.0 and 106.0 alone,
same code and prompts (README, "Concurrent clients"); ``--together`` keeps that way, for
comparison.) A fresh server's suffix cache has seen only the warm-up, not the earlier
measurements' answers.

* ``single``   -- one client alone, one request after another: latency per request
* ``C clients`` -- C threads, each with its own official ``openai`` client, each sending the
  next prompt nobody has taken as its last answer comes (bounded loops over one shared list:
  C requests in flight until it runs dry); aggregate completion tokens/s over the wall time
  from the first request to the last answer. (Until 905dabc each client had a fixed share,
  prompts ``i, i + C, ...``: with log and code prompts alternating and C even, half the
  clients got every log prompt, and the batch ran half empty while they finished.)

Every answer is greedy and checked against the other server's answer to the same prompt (equal
text). Each measurement sends prompts neither server has seen: the servers' suffix caches keep
every earlier answer, and a prompt sent twice is answered from that cache in a few steps, which
measures prefill, not serving. Prompts (``real_model.py``, chat template, sent as token ids to
``/v1/completions``), ``--workload``:

* ``rewrite`` -- log lines to JSON and code edits, alternating (long prompts, 511 tokens on
  average: prefill is about half of one engine's time, see ``prefill_share.py``)
* ``chat``    -- MT-Bench questions (Spec-Bench's multi-turn category, first turns; short prompts)

    python bench/server_batch_bench.py                # rewrite, 16 prompts, 64 tokens, 8 and 16 clients, 1 thread
    python bench/server_batch_bench.py --workload chat --max-tokens 128
    python bench/server_batch_bench.py --clients 8 --prompts 8 --max-tokens 32     # a quick look

Writes ``bench/results/server_batch.json`` (``--out``).
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO_ROOT, RESULTS_DIR, add_device_option, format_table, run_metadata, write_result  # noqa: E402
from real_model import build_workloads  # noqa: E402

START_TIMEOUT_S = 300
LISTENING = re.compile(r"lookupdec: serving \S+ at (http://\S+:\d+)")


def start_server(model: str, threads: int, max_batch: int, device: str = "cpu",
                 extra: tuple = ()) -> tuple[subprocess.Popen, str]:
    log_fd, log_path = tempfile.mkstemp(prefix="lookupdec-serve-", suffix=".log")
    path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)  # (kept: packages there)
    env = os.environ | {"OMP_NUM_THREADS": str(threads), "PYTHONPATH": path}
    proc = subprocess.Popen([sys.executable, "-m", "lookupdec", "serve", "--model", model, "--port", "0",
                             "--model-name", "m", "--max-batch", str(max_batch), "--device", device,
                             "--dtype", "float32", *extra], cwd=REPO_ROOT, env=env,
                            stdout=log_fd, stderr=log_fd, stdin=subprocess.DEVNULL)
    os.close(log_fd)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        match = LISTENING.search(Path(log_path).read_text(errors="replace"))
        if match:
            return proc, match.group(1) + "/v1"
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"server did not start:\n{Path(log_path).read_text(errors='replace')[-2000:]}")


def ask(client, prompt: list[int], max_tokens: int) -> tuple[str, int, float]:
    start = time.perf_counter()
    r = client.completions.create(model="m", prompt=prompt, max_tokens=max_tokens, temperature=0)
    return r.choices[0].text, r.usage.completion_tokens, time.perf_counter() - start


def single(api: str, prompts, max_tokens: int) -> dict:
    import openai

    client = openai.OpenAI(base_url=api, api_key="x", max_retries=0, timeout=600)
    texts, tokens, latencies = [], 0, []
    for p in prompts:
        text, n, seconds = ask(client, p, max_tokens)
        texts.append(text)
        tokens += n
        latencies.append(seconds)
    return {"texts": texts, "tokens": tokens, "seconds": sum(latencies), "latencies": latencies}


def concurrent(api: str, prompts, max_tokens: int, clients: int) -> dict:
    """``clients`` threads, each sending the next prompt nobody has taken as its last answer
    comes (a shared queue: ``clients`` requests in flight until it runs dry, as a load
    generator at that concurrency keeps them)."""
    import openai

    queue = iter(list(prompts))
    taking = threading.Lock()

    def run(_):
        client = openai.OpenAI(base_url=api, api_key="x", max_retries=0, timeout=600)
        mine = []
        while True:
            with taking:
                p = next(queue, None)
            if p is None:
                return mine
            mine.append((p, *ask(client, p, max_tokens)))

    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        answers = [a for share in pool.map(run, range(clients)) for a in share]
    seconds = time.perf_counter() - start
    by_prompt = {tuple(p): text for p, text, _, _ in answers}
    return {"texts": [by_prompt[tuple(p)] for p in prompts], "tokens": sum(n for _, _, n, _ in answers),
            "seconds": seconds, "latencies": [s for _, _, _, s in answers]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--workload", choices=("rewrite", "chat"), default="rewrite",
                    help="rewrite: log lines to JSON and code edits; chat: MT-Bench questions (rewrite)")
    ap.add_argument("--prompts", type=int, default=16, help="prompts per measurement, new ones each time (16)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--clients", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--max-batch", type=int, default=16, help="the batching server's --max-batch (16)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of each server (1)")
    ap.add_argument("--together", action="store_true",
                    help="both servers alive for the whole run (as before 79a461d) instead of one at a time")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR / "server_batch.json")
    add_device_option(ap)
    args = ap.parse_args(argv)

    from lookupdec import Engine

    meta = run_metadata()
    loader = Engine.from_pretrained(args.model, device="cpu", dtype="float32")
    measurements = [("single", None)] + [(f"{c} clients", c) for c in args.clients]
    needed = args.prompts * len(measurements) + 1  # + the warm-up's
    workloads = build_workloads(loader, needed // 2 + 1 if args.workload == "rewrite" else needed, 1024)
    if args.workload == "rewrite":
        pool = [p for pair in zip(workloads["log_to_json"], workloads["code_edit"]) for p in pair]
    else:
        pool = workloads["chat"]
    if len(pool) < needed:
        raise SystemExit(f"--workload {args.workload} has {len(pool)} prompts, {needed} needed "
                         f"({args.prompts} per measurement x {len(measurements)} + 1)")
    warmup, pool = pool[0], pool[1:]
    del loader
    batches = {"one-at-a-time": (1, ()), f"max-batch-{args.max_batch}": (args.max_batch, ()),
               f"plain-max-batch-{args.max_batch}": (args.max_batch, ("--no-draft",))}
    names = list(batches)
    servers: dict = {}  # name -> (process, api) of the servers alive

    def server(name: str) -> str:
        """The api of ``name``'s server, started (and warmed up: kernels, the cost curve's seed,
        on a prompt no measurement uses) if it is not running; without ``--together`` the other
        one is stopped first."""
        if name not in servers:
            if not args.together:
                stop_all()
            servers[name] = start_server(args.model, args.threads, batches[name][0], args.device, batches[name][1])
            single(servers[name][1], [warmup], 8)
        return servers[name][1]

    def stop_all() -> None:
        while servers:
            proc, _ = servers.pop(next(iter(servers)))
            proc.terminate()
            proc.wait(timeout=30)

    rows, mismatches = [], 0
    try:
        if args.together:
            for name in names:
                server(name)
        for k, (what, clients) in enumerate(measurements):
            prompts = pool[k * args.prompts : (k + 1) * args.prompts]  # new to both servers
            results = {}
            for name in names[k % len(names):] + names[: k % len(names)]:
                api = server(name)
                results[name] = (single(api, prompts, args.max_tokens) if clients is None
                                 else concurrent(api, prompts, args.max_tokens, clients))
                if not args.together:
                    stop_all()
            a = results[names[0]]["texts"]
            diff = sum(x != y for n in names[1:] for x, y in zip(a, results[n]["texts"]))
            mismatches += diff
            base, plain = results[names[0]], results[names[2]]
            for name in names:
                r = results[name]
                rows.append({"measure": what, "server": name, "requests": len(prompts), "tokens": r["tokens"],
                             "seconds": round(r["seconds"], 2), "tokens_per_s": round(r["tokens"] / r["seconds"], 2),
                             "vs_one_at_a_time": round((r["tokens"] / r["seconds"]) / (base["tokens"] / base["seconds"]), 3),
                             "vs_plain": round((r["tokens"] / r["seconds"]) / (plain["tokens"] / plain["seconds"]), 3),
                             "median_latency_s": round(statistics.median(r["latencies"]), 3),
                             "latencies_s": [round(s, 3) for s in r["latencies"]],
                             "texts_differing": diff})
            print("  " + "  ".join(f"{r['measure']} {r['server']}: {r['tokens_per_s']:.1f} tok/s "
                                   f"({r['vs_one_at_a_time']:.2f}x), median latency {r['median_latency_s']:.2f} s"
                                   for r in rows[-len(names):]) + (f"  {diff} texts differ" if diff else ""), flush=True)
    finally:
        stop_all()
    alone = {r["server"]: r["tokens_per_s"] for r in rows if r["measure"] == "single"}
    for r in rows:
        r["vs_single_client_alone"] = round(r["tokens_per_s"] / alone[r["server"]], 3)
    print()
    print(format_table(rows, [("measure", "measure", ""), ("server", "server", ""), ("tokens_per_s", "tokens/s", ".1f"),
                              ("vs_one_at_a_time", "x one-at-a-time", ".2f"), ("vs_plain", "x plain batched", ".2f"),
                              ("vs_single_client_alone", "x one client alone", ".2f"),
                              ("median_latency_s", "median latency s", ".2f"), ("texts_differing", "differ", "d")]))
    write_result(args.out, "server_batch", {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                 rows, meta=meta, mismatches=mismatches)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
