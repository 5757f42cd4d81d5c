"""Helpers shared by the benchmarks: run metadata (machine, versions, git commit) and JSON output.

Every result file written through ``write_result`` has the same top-level shape::

    {"benchmark": "e2e", "meta": {...run_metadata()...}, "config": {...}, "results": [...]}

so that results from different benchmarks and machines can be compared by the same reader.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "bench" / "results"
# Benchmark data lives outside the repo (DESIGN / data README: read it from ../shared/).
SHARED_DIR = Path(os.environ.get("LOOKUPDEC_SHARED", REPO_ROOT.parent / "shared"))


def cpu_model() -> str:
    """CPU model name from /proc/cpuinfo (Linux), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def memory_gb() -> float | None:
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def load_average() -> list[float] | None:
    """1, 5 and 15 minute load averages: other processes on a shared machine skew timings."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def code_checkout() -> Path:
    """The checkout whose ``lookupdec`` this process runs. Usually this benchmark's own; but an
    editable install resolves ``import lookupdec`` to the checkout it was installed from even
    when the benchmark runs from another worktree (its finder comes before ``sys.path``), and the
    result must name the code that ran."""
    try:
        import lookupdec
    except ImportError:
        return REPO_ROOT
    return Path(lookupdec.__file__).resolve().parent.parent


def git_info() -> dict:
    """Commit of the checkout whose code ran (``code_checkout``) and whether it had uncommitted
    changes (results must say); ``checkout``: that checkout where it is not this benchmark's."""
    root = code_checkout()

    def git(*args: str) -> str | None:
        try:
            return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True,
                                  check=True, timeout=10).stdout
        except (OSError, subprocess.SubprocessError):
            return None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")  # "XY path" lines
    changed = [line[3:] for line in status.splitlines() if line.strip()] if status is not None else None
    info = {"commit": commit.strip() if commit else None, "dirty": None if changed is None else bool(changed),
            "dirty_files": changed or None}
    if root != REPO_ROOT:
        info["checkout"] = str(root)  # lookupdec came from there, not from the benchmark's checkout
    return info


def versions() -> dict:
    out = {"python": platform.python_version()}
    for name in ("torch", "transformers", "tokenizers", "numpy", "lookupdec"):
        try:
            module = __import__(name)
            out[name] = getattr(module, "__version__", "?")
        except ImportError:
            out[name] = None
    return out


def machine_info(threads_set_by_benchmark: bool = False) -> dict:
    import torch

    info = {"cpu": cpu_model(), "cpu_cores": os.cpu_count(), "memory_gb": memory_gb(),
            "platform": platform.platform(), "torch_num_threads": torch.get_num_threads(),
            "torch_num_threads_note": "set by the benchmark's --threads" if threads_set_by_benchmark
            else "left at torch's default (not set by the benchmark)",
            "load_average_at_end": load_average(), "cuda": torch.cuda.is_available()}
    if info["cuda"]:
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def run_metadata(threads_set_by_benchmark: bool = False) -> dict:
    """Everything needed to interpret a result later: when, where, what code, how invoked."""
    return {"timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(["python", *sys.argv]), "argv": sys.argv,
            "machine": machine_info(threads_set_by_benchmark), "versions": versions(), "git": git_info()}


def write_result(path: str | os.PathLike, benchmark: str, config: dict, results, *,
                 threads_set_by_benchmark: bool = False, meta: dict | None = None, **extra) -> Path:
    """Write the result JSON atomically (a ``.tmp`` file renamed into place).

    ``meta``: ``run_metadata()`` taken when the run started (the code a run imports is the
    working tree at its start; others may commit while it runs); default: taken now.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if meta is None:
        meta = run_metadata(threads_set_by_benchmark)
    else:
        meta = {**meta, "finished": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                "machine": {**meta["machine"], "load_average_at_end": load_average()}}
    doc = {"benchmark": benchmark, "meta": meta, "config": config, "results": results, **extra}
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2, sort_keys=False) + "\n", encoding="utf-8")
    tmp.replace(path)
    return path


def add_device_option(parser) -> None:
    """``--device``: where a real-model benchmark's model runs (the same flag in each)."""
    parser.add_argument("--device", default="cpu",
                        help="where the model runs: cpu (default) or cuda; --threads then sets only the host's torch threads")


def format_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """Plain-text table. ``columns`` is ``[(key, header, format spec)]``; None prints as '-'."""
    cells = [[h for _, h, _ in columns]]
    for row in rows:
        line = []
        for key, _, spec in columns:
            value = row.get(key)
            line.append("-" if value is None else format(value, spec) if spec else str(value))
        cells.append(line)
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    out = []
    for n, r in enumerate(cells):
        out.append("  ".join(c.rjust(w) if n and i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))))
        if n == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)
