"""lookupdec against llama.cpp's ``llama-server`` on the CPU, same model, same prompts, side by side.

The peer a CPU user picks is llama.cpp (``llama-server`` is what editor plugins talk to; it has
n-gram speculation). This benchmark builds it from the source the registry's ``llama-cpp-python``
sdist vendors (a pinned version; not a package dependency, not in CI), converts SmolLM2's
dequantised weights to an F32 GGUF (the same numerics as lookupdec's float32), and runs, per
prompt in rotated order:

* ``lookupdec``  -- ``Engine(model, tokenizer, EngineConfig())``
* ``plain``      -- the same engine with ``EngineConfig(proposers=())``
* ``f32``        -- ``llama-server`` on the F32 GGUF, no speculation
* ``f32+ngram-simple`` / ``f32+ngram-mod`` -- with its n-gram speculation (``--spec-type``)
* ``q4``         -- ``llama-server`` on the registry's 4-bit file (``--q4``): 4x fewer bytes per
  token than float32, reported, not a bar

Prompts go to ``/completion`` as token ids (``"prompt": [ids]``, ``"top_k": 1``,
``"cache_prompt": false``), 128 new tokens (``--max-new-tokens``), one request at a time; the
time of a request is the client's wall time, prefill included (llama-server's own prompt and
generation timings are recorded beside it). The F32 outputs are compared token for token with
lookupdec's. Also ``llama-bench`` tg/pp on both files at each thread count.

    python bench/peers_cpu.py build                  # once: about 10 minutes on 2 cores
    python bench/peers_cpu.py run --threads 1 2 --prompts 4
    python bench/peers_cpu.py run --workloads log_to_json code_edit --prompts 10
    python bench/peers_cpu.py decode --threads 1 2   # plain decoding against llama-bench tg128

The build goes to ``$LOOKUPDEC_BENCH_CACHE`` (default ``~/.cache/lookupdec-bench``). Writes
``bench/results/peers_cpu.json`` and ``.png`` (``--out``).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tarfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR, format_table, run_metadata, write_result  # noqa: E402

LLAMA_CPP_PYTHON = "0.3.36"  # the pinned sdist whose vendor/llama.cpp is built
CACHE = Path(os.environ.get("LOOKUPDEC_BENCH_CACHE", Path.home() / ".cache" / "lookupdec-bench"))
SOURCE = CACHE / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp"
BUILD = SOURCE / "build" / "bin"
F32_GGUF = CACHE / "smollm2-135m-instruct-f32.gguf"
# llama-server's n-gram speculation as shipped (its defaults), and ngram-simple with a shorter
# lookup key: the two settings tried on the log prompts, the better kept per workload
SPEC = {"f32+ngram-simple": ["--spec-type", "ngram-simple"],
        "f32+ngram-mod": ["--spec-type", "ngram-mod"]}
PORT0 = 18431


def build(args) -> int:
    """Download the pinned sdist, build llama-server and llama-bench, convert the F32 GGUF."""
    CACHE.mkdir(parents=True, exist_ok=True)
    sdist = CACHE / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
    if not sdist.exists():
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(CACHE)], check=True)
    if not SOURCE.exists():
        with tarfile.open(sdist) as tar:
            tar.extractall(CACHE, filter="data")
    if not (BUILD / "llama-server").exists() or not (BUILD / "llama-bench").exists():
        subprocess.run(["cmake", "-B", "build", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DCMAKE_BUILD_TYPE=Release"],
                       cwd=SOURCE, check=True)
        subprocess.run(["cmake", "--build", "build", f"-j{os.cpu_count()}", "--target", "llama-server", "llama-bench"],
                       cwd=SOURCE, check=True)
    if not F32_GGUF.exists():
        convert_f32()
    print(f"llama-server: {BUILD / 'llama-server'}\nF32 GGUF: {F32_GGUF}")
    return 0


def convert_f32() -> None:
    """SmolLM2's dequantised model folder (lookupdec's GGUF cache) to an F32 GGUF with llama.cpp's
    own converter."""
    from lookupdec import model_files
    from lookupdec.model.load import convert_gguf  # noqa: PLC2701 -- the cache's converter

    folder = model_files.gguf_folder(model_files.smollm2_path(), convert_gguf)
    tmp = F32_GGUF.with_suffix(".tmp")
    env = os.environ | {"PYTHONPATH": str(SOURCE / "gguf-py")}  # the converter's own gguf package
    subprocess.run([sys.executable, str(SOURCE / "convert_hf_to_gguf.py"), folder, "--outtype", "f32",
                    "--outfile", str(tmp)], check=True, env=env)
    os.replace(tmp, F32_GGUF)


class Server:
    """One ``llama-server`` process on ``model`` at ``threads``, with ``extra`` flags."""

    def __init__(self, model: Path, threads: int, port: int, extra: list[str]) -> None:
        self.url = f"http://127.0.0.1:{port}"
        cmd = [str(BUILD / "llama-server"), "-m", str(model), "-t", str(threads), "-tb", str(threads),
               "--port", str(port), "-np", "1", "-c", "4096", "--no-webui", *extra]
        self.log = open(CACHE / f"server-{port}.log", "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if json.load(r).get("status") == "ok":
                        return
            except OSError:
                pass
            if self.proc.poll() is not None:
                raise SystemExit(f"llama-server exited: see {self.log.name}")
            time.sleep(0.3)
        raise SystemExit(f"llama-server did not start: see {self.log.name}")

    def complete(self, ids: list[int], max_new: int) -> tuple[list[int], float, dict]:
        body = json.dumps({"prompt": ids, "n_predict": max_new, "top_k": 1, "temperature": 0.0,
                           "cache_prompt": False, "return_tokens": True, "stream": False}).encode()
        request = urllib.request.Request(self.url + "/completion", body, {"Content-Type": "application/json"})
        start = time.perf_counter()
        with urllib.request.urlopen(request, timeout=600) as r:
            answer = json.load(r)
        return list(answer.get("tokens") or []), time.perf_counter() - start, answer.get("timings", {})

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def llama_bench(model: Path, threads: int, prompt: int = 128, repeats: int = 3) -> dict:
    """``llama-bench``'s tokens/s: ``tg128`` (128 tokens generated) and, with ``prompt``, ``pp128``."""
    out = subprocess.run([str(BUILD / "llama-bench"), "-m", str(model), "-t", str(threads), "-p", str(prompt),
                          "-n", "128", "-r", str(repeats), "-o", "json"], capture_output=True, text=True,
                         check=True).stdout
    return {f"{'pp' if t['n_prompt'] else 'tg'}128": round(t["avg_ts"], 2) for t in json.loads(out)}


def run(args) -> int:
    import torch

    from lookupdec import Engine, EngineConfig, model_files
    from real_model import build_workloads, run_order

    for need in (BUILD / "llama-server", BUILD / "llama-bench", F32_GGUF):
        if not need.exists():
            raise SystemExit(f"{need} missing: run 'python bench/peers_cpu.py build' first")
    meta = run_metadata(threads_set_by_benchmark=True)
    loader = Engine.from_pretrained("smollm2", dtype="float32")
    model, tokenizer = loader.target.model, loader.tokenizer
    workloads = build_workloads(loader, args.prompts, args.max_prompt_tokens)
    if args.workloads:
        workloads = {k: v for k, v in workloads.items() if k in args.workloads}
    q4 = Path(model_files.smollm2_path())
    runs, infos = [], []
    for threads in args.threads:
        torch.set_num_threads(threads)
        info = {"threads": threads, "llama_bench_f32": llama_bench(F32_GGUF, threads)}
        if args.q4:
            info["llama_bench_q4"] = llama_bench(q4, threads)
        print(f"== {threads} thread(s): llama-bench F32 {info['llama_bench_f32']}"
              + (f", Q4 {info['llama_bench_q4']}" if args.q4 else ""), flush=True)
        engines = {"lookupdec": Engine(model, tokenizer, EngineConfig()),
                   "plain": Engine(model, tokenizer, EngineConfig(proposers=()))}
        configs = {"f32": (F32_GGUF, []), **{name: (F32_GGUF, flags) for name, flags in SPEC.items()}}
        if args.q4:
            configs["q4"] = (q4, [])
        servers = {}
        try:
            for i, (name, (path, flags)) in enumerate(configs.items()):
                servers[name] = Server(path, threads, PORT0 + i, flags)
            warm = loader.chat_prompt("Say hello in three languages.")
            for e in engines.values():
                e.generate(warm, max_new_tokens=16)
            for s in servers.values():
                s.complete(warm, 16)
            methods = [*engines, *servers]
            for workload, prompts in workloads.items():
                for k, prompt in enumerate(prompts):
                    group = {}
                    for method in run_order(methods, k, bracket=False):
                        gc.collect()
                        if method in engines:
                            start = time.perf_counter()
                            gen = engines[method].generate(prompt, max_new_tokens=args.max_new_tokens)
                            seconds = time.perf_counter() - start
                            rec = {"tokens": list(gen.token_ids), "seconds": seconds,
                                   "prefill_ms": gen.stats.prefill_ms, "mean_accepted": gen.stats.mean_accepted}
                        else:
                            tokens, seconds, timings = servers[method].complete(prompt, args.max_new_tokens)
                            rec = {"tokens": tokens, "seconds": seconds, "prefill_ms": timings.get("prompt_ms"),
                                   "timings": timings}
                        group[method] = rec
                    ours = group["lookupdec"]["tokens"]
                    for method, rec in group.items():
                        tokens = rec.pop("tokens")
                        runs.append({"threads": threads, "workload": workload, "prompt": k, "method": method,
                                     "prompt_tokens": len(prompt), "new_tokens": len(tokens),
                                     "identical_to_lookupdec": tokens == ours, **rec})
                    rate = {m: len(ours) / r["seconds"] for m, r in group.items()}
                    print(f"  {workload:12s} #{k:<2d} " + "  ".join(f"{m} {rate[m]:5.1f}" for m in methods)
                          + "  identical " + ",".join(m for m in group if m.startswith("f32")
                                                      and next(r for r in runs[::-1] if r["method"] == m)["identical_to_lookupdec"]),
                          flush=True)
        finally:
            for s in servers.values():
                s.close()
        infos.append(info)
        report(args, meta, infos, runs)
    return 0


DECODE_PROMPT = "Write a long story about a lighthouse keeper and a storm."


def decode(args) -> int:
    """Plain decoding side by side with ``llama-bench`` tg128 on the F32 GGUF: per thread count,
    ``--rounds`` rounds in rotated order of llama-bench (``-p 0 -n 128 -r 1``: 128 tokens from
    an empty context), lookupdec's plain decoding (``EngineConfig(proposers=())``: every step
    one token through the compiled decoder) and the same engine with its eager forward
    (``TargetModel.native`` off), each decoding 128 tokens after a short chat prompt; the decode
    phase's tokens/s (prefill left out). Medians per method, and ours over llama.cpp's."""
    import torch

    from lookupdec import Engine, EngineConfig

    for need in (BUILD / "llama-bench", F32_GGUF):
        if not need.exists():
            raise SystemExit(f"{need} missing: run 'python bench/peers_cpu.py build' first")
    meta = run_metadata(threads_set_by_benchmark=True)
    plain = Engine.from_pretrained("smollm2", dtype="float32", config=EngineConfig(proposers=()))
    eager = Engine(plain.target.model, plain.tokenizer, EngineConfig(proposers=()))
    eager.target.native = None
    prompt = plain.chat_prompt(DECODE_PROMPT)

    def ours(engine) -> float:
        start = time.perf_counter()
        gen = engine.generate(prompt, max_new_tokens=args.max_new_tokens)
        seconds = time.perf_counter() - start - gen.stats.prefill_ms / 1e3
        return (len(gen.token_ids) - 1) / seconds

    methods = {"llama.cpp F32 tg128": lambda t: llama_bench(F32_GGUF, t, prompt=0, repeats=1)["tg128"],
               "lookupdec plain": lambda t: ours(plain), "lookupdec plain, eager forward": lambda t: ours(eager)}
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for e in (plain, eager):
            e.generate(prompt, max_new_tokens=16)
        rates = {m: [] for m in methods}
        names = list(methods)
        for r in range(args.rounds):
            for k in range(len(names)):
                name = names[(r + k) % len(names)]
                gc.collect()
                rates[name].append(methods[name](threads))
            print(f"  {threads} thread(s) round {r}: " + "  ".join(f"{m} {v[-1]:.1f}" for m, v in rates.items()),
                  flush=True)
        row = {"threads": threads, **{m: round(statistics.median(v), 2) for m, v in rates.items()},
               "rates": {m: [round(x, 2) for x in v] for m, v in rates.items()}}
        row["plain / llama.cpp"] = round(row["lookupdec plain"] / row["llama.cpp F32 tg128"], 3)
        row["eager / llama.cpp"] = round(row["lookupdec plain, eager forward"] / row["llama.cpp F32 tg128"], 3)
        rows.append(row)
    print(format_table(rows, [("threads", "threads", "d"), ("llama.cpp F32 tg128", "llama.cpp tg128", ".1f"),
                              ("lookupdec plain", "plain", ".1f"), ("lookupdec plain, eager forward", "eager", ".1f"),
                              ("plain / llama.cpp", "plain/llama", ".3f"), ("eager / llama.cpp", "eager/llama", ".3f")]))
    write_result(args.out, "decode_vs_llama_cpp",
                 {"threads": args.threads, "rounds": args.rounds, "max_new_tokens": args.max_new_tokens,
                  "prompt": DECODE_PROMPT}, rows, threads_set_by_benchmark=True, meta=meta)
    return 0


def summarize(runs: list[dict]) -> list[dict]:
    rows = []
    for threads, workload in dict.fromkeys((r["threads"], r["workload"]) for r in runs):
        group = [r for r in runs if (r["threads"], r["workload"]) == (threads, workload)]
        methods = list(dict.fromkeys(r["method"] for r in group))
        rate = {m: sum(r["new_tokens"] for r in group if r["method"] == m)
                / sum(r["seconds"] for r in group if r["method"] == m) for m in methods}
        row = {"threads": threads, "workload": workload, "prompts": len({r["prompt"] for r in group})}
        for m in methods:
            row[f"{m} t/s"] = rate[m]
        spec = [m for m in methods if m.startswith("f32+")]
        best = max(spec, key=lambda m: rate[m]) if spec else None
        row["best llama n-gram"] = best
        if best:
            row["ld/llama best n-gram"] = rate["lookupdec"] / rate[best]
            per = {}
            for r in group:
                per.setdefault(r["prompt"], {})[r["method"]] = r["new_tokens"] / r["seconds"]
            row["worst ld/llama best n-gram"] = min(p["lookupdec"] / p[best] for p in per.values())
        row["ld/plain"] = rate["lookupdec"] / rate["plain"]
        row["ld/f32"] = rate["lookupdec"] / rate["f32"]
        row["f32 identical"] = (f"{sum(r['identical_to_lookupdec'] for r in group if r['method'] == 'f32')}"
                                f"/{row['prompts']}")
        rows.append(row)
    return rows


def report(args, meta, infos, runs) -> None:
    rows = summarize(runs)
    columns = [("threads", "threads", "d"), ("workload", "workload", ""), ("prompts", "n", "d")]
    for key in rows[0]:
        if key.endswith("t/s"):
            columns.append((key, key, ".1f"))
    columns += [("ld/plain", "ld/plain", ".2f"), ("ld/f32", "ld/f32", ".2f"),
                ("best llama n-gram", "best llama n-gram", ""), ("ld/llama best n-gram", "ld/best", ".2f"),
                ("worst ld/llama best n-gram", "worst", ".2f"), ("f32 identical", "f32 identical", "")]
    print()
    print(format_table(rows, columns))
    config = {"command": "python " + " ".join(sys.argv), "prompts": args.prompts, "threads": args.threads,
              "max_new_tokens": args.max_new_tokens, "llama_cpp_python": LLAMA_CPP_PYTHON, "spec": SPEC,
              "workloads": args.workloads}
    write_result(args.out, "peers_cpu", config, {"per_workload": rows, "llama_bench": infos, "runs": runs}, meta=meta)
    plot(rows, Path(args.out).with_suffix(".png"))
    print(f"wrote {args.out}", flush=True)


def plot(rows: list[dict], path: Path) -> None:
    """Per thread count and workload: every method's tokens/s per request (prefill included)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    methods = [k[: -len(" t/s")] for k in rows[0] if k.endswith(" t/s")]
    panels = list(dict.fromkeys(r["threads"] for r in rows))
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.2), squeeze=False)
    width = 0.8 / len(methods)
    for ax, threads in zip(axes[0], panels):
        mine = [r for r in rows if r["threads"] == threads]
        for j, m in enumerate(methods):
            ax.bar([i + (j - (len(methods) - 1) / 2) * width for i in range(len(mine))],
                   [r[f"{m} t/s"] for r in mine], width, label=m)
        ax.set_xticks(range(len(mine)), [r["workload"] for r in mine])
        ax.set_ylabel("tokens/s per request (prefill included)")
        ax.set_title(f"SmolLM2-135M float32, {threads} thread(s): lookupdec and llama-server")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("build", help="download, build llama-server and llama-bench, convert the F32 GGUF")
    r = sub.add_parser("run", help="the side-by-side run")
    r.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="thread counts (1 2)")
    r.add_argument("--prompts", type=int, default=4, metavar="N", help="prompts per workload (4)")
    r.add_argument("--max-new-tokens", type=int, default=128, metavar="N", help="tokens per prompt (128)")
    r.add_argument("--max-prompt-tokens", type=int, default=1536, metavar="N", help="skip longer prompts (1536)")
    r.add_argument("--workloads", nargs="+", default=None, help="only these workloads (default: all eight)")
    r.add_argument("--q4", action="store_true", help="also the registry's 4-bit file (not a bar: 4x fewer bytes)")
    r.add_argument("--out", type=Path, default=RESULTS_DIR / "peers_cpu.json", help="result JSON")
    d = sub.add_parser("decode", help="plain decoding against llama-bench tg128, side by side")
    d.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="thread counts (1 2)")
    d.add_argument("--rounds", type=int, default=5, help="rotated rounds per thread count (5)")
    d.add_argument("--max-new-tokens", type=int, default=128, metavar="N", help="tokens per run (128)")
    d.add_argument("--out", type=Path, default=RESULTS_DIR / "decode_vs_llama_cpp.json", help="result JSON")
    args = p.parse_args(argv)
    return {"build": build, "run": run, "decode": decode}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
