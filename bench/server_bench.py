"""Server overhead per request and time to first streamed token, against the library call.

    python bench/server_bench.py                      # stories260K, 10 prompts x 5 repeats
    python bench/server_bench.py --model PATH --max-tokens 64 --repeats 3

One engine in this process (the library call) and one real `lookupdec serve` process on
loopback, both fresh, get the same requests in the same order, so their suffix caches hold the
same history and every request does the same decoding work on both (checked: same text, same
number of steps). For each prompt and repeat, three pairs run back to back, library side first
on even prompts and server first on odd ones:

  generate     engine.generate(...)            vs  POST /v1/completions with httpx (keep-alive)
  openai       engine.generate(...)            vs  the same through the official openai client
  stream       engine.stream(...)              vs  POST /v1/completions stream=true (httpx)

Overhead = server round trip - library time of the same pair; reported as median and p90 over
all pairs. The pair's two decoding runs each carry their own timing noise, so the same overhead
is also measured within each server request: round trip - `engine_ms` (the server's time on
its engine thread: prompt building and generation, from the response's `lookupdec` object);
this one excludes decoding, and with it its noise. Time to first token = from sending the
request to the first non-empty text chunk (library: to the first text piece).

Greedy, float32, `--threads` torch threads on both sides (1 by default; at 2 the server's
engine thread once ran 1.3x slower than the library's main thread, ``lookupdec/model/threads.py``),
`--budget fixed` by default (an `auto` budget
is chosen from measured per-step overhead, so two engines could pick different trees: then
the verify cost curve is measured once here and read by the server from the same cache file).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import REPO_ROOT, RESULTS_DIR, SHARED_DIR, format_table, run_metadata, write_result  # noqa: E402

PROMPTS = [
    "Once upon a time, Lily saw a cat. The cat was big. Once upon a time, Lily",
    "Tom had a red ball. He liked to play with it in the park. One day, Tom",
    "Sue and Ben went to the beach. They saw a big boat. Sue said,",
    "The little dog was sad. He lost his bone. He looked under the bed and",
    "Max wanted to fly like a bird. He made wings out of paper. Then",
    "Anna found a shiny key in the garden. She wondered what it could open.",
    "There was a big tree near the house. Every day, a bird sang in it.",
    "Mom baked a cake for Lucy. Lucy was very happy. She said thank you and",
    "The sun was hot. The children went to the pool. They jumped in the water and",
    "A small frog lived in a pond. One day, the frog met a fish. The fish said,",
]
WARMUP_PROMPT = "Zed the zebra zipped along."  # in no prompt: the warm-up output helps no request
START_TIMEOUT_S = 180
LISTENING = re.compile(r"lookupdec: serving \S+ at (http://[\d.]+:\d+)")


def start_server(model: str, env: dict, extra: list[str]) -> tuple[subprocess.Popen, str, str]:
    log_fd, log_path = tempfile.mkstemp(prefix="lookupdec-serve-", suffix=".log")
    proc = subprocess.Popen([sys.executable, "-m", "lookupdec", "serve", "--model", model, "--port", "0", *extra],
                            cwd=REPO_ROOT, env=env, stdout=log_fd, stderr=log_fd, stdin=subprocess.DEVNULL)
    os.close(log_fd)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline and proc.poll() is None:
        match = LISTENING.search(open(log_path, encoding="utf-8", errors="replace").read())
        if match:
            return proc, match.group(1), log_path
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"server did not start:\n{open(log_path).read()[-2000:]}")


def http_generate(client, url: str, body: dict) -> tuple[float, dict]:
    t = time.perf_counter()
    response = client.post(url + "/completions", json=body)
    elapsed = time.perf_counter() - t
    response.raise_for_status()
    return elapsed, response.json()


def openai_generate(client, body: dict) -> tuple[float, dict]:
    t = time.perf_counter()
    response = client.completions.create(**body)
    elapsed = time.perf_counter() - t
    return elapsed, {"choices": [{"text": response.choices[0].text}], "lookupdec": response.model_extra["lookupdec"]}


def http_stream(client, url: str, body: dict) -> tuple[float, float, str, dict]:
    """(time to first text, total time, text, lookupdec stats of the last chunk)."""
    t = time.perf_counter()
    first, pieces, stats = None, [], None
    with client.stream("POST", url + "/completions", json=body | {"stream": True}) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            text = chunk["choices"][0]["text"]
            if text and first is None:
                first = time.perf_counter() - t
            pieces.append(text)
            stats = chunk.get("lookupdec", stats)
    return first, time.perf_counter() - t, "".join(pieces), stats


def lib_generate(engine, prompt: str, kwargs: dict) -> tuple[float, object]:
    t = time.perf_counter()
    gen = engine.generate(prompt, **kwargs)
    return time.perf_counter() - t, gen


def lib_stream(engine, prompt: str, kwargs: dict) -> tuple[float, float, str, object]:
    t = time.perf_counter()
    first, pieces = None, []
    stream = engine.stream(prompt, **kwargs)
    for piece in stream:
        if first is None:
            first = time.perf_counter() - t
        pieces.append(piece)
    return first, time.perf_counter() - t, "".join(pieces), stream.generation


def run_pairs(engine, http, oai, url: str, model_name: str, prompt: str, n: int, flip: bool) -> list[dict]:
    """The three (library, server) pairs for one prompt; both sides see the same requests."""
    kwargs = {"max_new_tokens": n, "temperature": 0.0}
    body = {"model": model_name, "prompt": prompt, "max_tokens": n, "temperature": 0}
    sides = {
        "generate": (lambda: lib_generate(engine, prompt, kwargs), lambda: http_generate(http, url, body)),
        "openai": (lambda: lib_generate(engine, prompt, kwargs), lambda: openai_generate(oai, body)),
        "stream": (lambda: lib_stream(engine, prompt, kwargs), lambda: http_stream(http, url, body)),
    }
    rows = []
    for method, (lib, server) in sides.items():
        if flip:
            s, l_ = server(), lib()
        else:
            l_, s = lib(), server()
        rows.append(pair_row(method, l_, s))
    return rows


def pair_row(method: str, lib, server) -> dict:
    if method == "stream":
        lib_first, lib_total, lib_text, gen = lib
        srv_first, srv_total, srv_text, stats = server
    else:
        (lib_total, gen), (srv_total, body) = lib, server
        lib_text, lib_first, srv_first = gen.text, None, None
        srv_text, stats = body["choices"][0]["text"], body["lookupdec"]
    return {"method": method, "lib_ms": lib_total * 1e3, "server_ms": srv_total * 1e3,
            "overhead_ms": (srv_total - lib_total) * 1e3, "server_engine_ms": stats["engine_ms"],
            "direct_overhead_ms": srv_total * 1e3 - stats["engine_ms"],
            "lib_first_ms": None if lib_first is None else lib_first * 1e3,
            "server_first_ms": None if srv_first is None else srv_first * 1e3,
            "same_text": lib_text == srv_text, "same_steps": gen.stats.steps == stats["steps"],
            "steps": gen.stats.steps, "new_tokens": gen.stats.new_tokens}


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def summarize(pairs: list[dict]) -> list[dict]:
    rows = []
    for method in ("generate", "openai", "stream"):
        got = [p for p in pairs if p["method"] == method]
        row = {"method": method, "pairs": len(got), "same_output": all(p["same_text"] and p["same_steps"] for p in got)}
        for key in ("lib_ms", "server_ms", "overhead_ms", "direct_overhead_ms", "lib_first_ms", "server_first_ms"):
            values = [p[key] for p in got if p[key] is not None]
            if values:
                row[key + "_p50"] = statistics.median(values)
                row[key + "_p90"] = percentile(values, 0.9)
        rows.append(row)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(SHARED_DIR / "models" / "stories260K"))
    ap.add_argument("--prompts", type=int, default=len(PROMPTS))
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the library and the server (1)")
    ap.add_argument("--budget", default="fixed", choices=("fixed", "auto"), help="EngineConfig.budget (fixed)")
    ap.add_argument("--out", default=str(RESULTS_DIR / "server.json"))
    args = ap.parse_args()

    import httpx
    import openai
    import torch

    from lookupdec import Engine, EngineConfig

    if args.threads < 1:
        ap.error(f"--threads {args.threads}: must be >= 1")
    torch.set_num_threads(args.threads)
    meta = run_metadata(threads_set_by_benchmark=True)
    cost_cache = os.path.join(tempfile.mkdtemp(prefix="lookupdec-bench-"), "cost.json")
    os.environ["LOOKUPDEC_COST_CACHE"] = cost_cache
    prompts = PROMPTS[: args.prompts]
    config = EngineConfig(budget=args.budget)
    if args.budget == "auto":  # measure the cost curves now, for both sides
        warm = Engine.from_pretrained(args.model, device="cpu", dtype="float32", config=config)
        for prompt in prompts + [WARMUP_PROMPT]:
            warm.generate(prompt, max_new_tokens=args.max_tokens)
        del warm
    engine = Engine.from_pretrained(args.model, device="cpu", dtype="float32", config=config)
    env = os.environ | {"OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(REPO_ROOT)}
    proc, base, log_path = start_server(args.model, env, ["--fixed-budget"] if args.budget == "fixed" else [])
    model_name = os.path.basename(os.path.normpath(args.model))
    pairs = []
    try:
        with httpx.Client(timeout=300) as http:
            oai = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
            while http.get(base + "/health").status_code != 200:
                time.sleep(0.1)
            run_pairs(engine, http, oai, base + "/v1", model_name, WARMUP_PROMPT, args.max_tokens, False)
            for repeat in range(args.repeats):
                for i, prompt in enumerate(prompts):
                    for row in run_pairs(engine, http, oai, base + "/v1", model_name, prompt, args.max_tokens,
                                         flip=(i + repeat) % 2 == 1):
                        pairs.append(row | {"prompt": i, "repeat": repeat})
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        os.unlink(log_path)
    summary = summarize(pairs)
    print(format_table(summary, [("method", "method", ""), ("pairs", "pairs", "d"),
                                 ("lib_ms_p50", "library ms p50", ".2f"), ("server_ms_p50", "server ms p50", ".2f"),
                                 ("overhead_ms_p50", "overhead ms p50", ".2f"),
                                 ("overhead_ms_p90", "overhead ms p90", ".2f"),
                                 ("direct_overhead_ms_p50", "direct p50", ".2f"),
                                 ("direct_overhead_ms_p90", "direct p90", ".2f"),
                                 ("lib_first_ms_p50", "lib 1st token p50", ".2f"),
                                 ("server_first_ms_p50", "server 1st token p50", ".2f"),
                                 ("server_first_ms_p90", "server 1st token p90", ".2f"),
                                 ("same_output", "same output", "")]))
    path = write_result(args.out, "server", vars(args), {"summary": summary, "pairs": pairs}, meta=meta,
                        threads_set_by_benchmark=True)
    print(f"wrote {path}")
    return 0 if all(row["same_output"] for row in summary) else 1


if __name__ == "__main__":
    sys.exit(main())
