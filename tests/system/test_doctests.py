"""Every docstring example in the package and in bench/ runs, and must print what it shows.

The examples document small contracts (the budget's formulas, the benchmark's run order, the
replay's list of prompts below 0.97x); without this test nothing ran them, so one could go
stale unnoticed. Modules are found by scanning for ``>>>``: a new example is tested as soon as
it is written.
"""
from __future__ import annotations

import doctest
import importlib
import importlib.util
import sys
from pathlib import Path

import pytest

from repo_paths import REPO

ROOT = Path(REPO)
BENCH = ROOT / "bench"


def _with_examples(paths) -> list[Path]:
    return sorted(p for p in paths if ">>>" in p.read_text(encoding="utf-8"))


PACKAGE = _with_examples((ROOT / "lookupdec").rglob("*.py"))
BENCHES = _with_examples(BENCH.glob("*.py"))


def _package_module(path: Path):
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return importlib.import_module(".".join(parts))


def _bench_module(path: Path):
    if str(BENCH) not in sys.path:  # bench scripts import their neighbours (common.py) by name
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(f"bench_doctest_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(module) -> None:
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS, report=True, verbose=False)
    assert result.attempted > 0, f"{module.__name__}: no example ran (the scan found '>>>' in it)"
    assert result.failed == 0, f"{module.__name__}: {result.failed} of {result.attempted} examples failed"


def test_examples_found():
    # the scan itself: a broken glob would pass every parametrized case by running none
    assert len(PACKAGE) >= 5 and len(BENCHES) >= 2, (PACKAGE, BENCHES)


@pytest.mark.parametrize("path", PACKAGE, ids=lambda p: str(p.relative_to(ROOT)))
def test_package_examples(path):
    _run(_package_module(path))


@pytest.mark.parametrize("path", BENCHES, ids=lambda p: str(p.relative_to(ROOT)))
def test_bench_examples(path):
    _run(_bench_module(path))
