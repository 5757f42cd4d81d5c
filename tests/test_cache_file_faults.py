"""The cost cache at paths that are not regular files (``lookupdec/cache_file.py``): it reads and
replaces only regular files; anything else is one warning and the cache off for the run, and a
failed write leaves the old cache whole and no temporary file.
"""
from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from repo_paths import REPO

CACHE_RUN = r"""
import logging, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))  # reading a device to its end would pass this
sys.path.insert(0, "tests/support")
logging.basicConfig(level=logging.WARNING)
from helpers import FakeTokenizer
from lookupdec import Engine, EngineConfig
from tiny_models import tiny_model
e = Engine(tiny_model("llama", tie_word_embeddings=False), FakeTokenizer(), EngineConfig())
print(e.generate([5, 6, 7, 8], max_new_tokens=8).token_ids)
"""


def _run_with_cache(path) -> subprocess.CompletedProcess:
    env = os.environ | {"LOOKUPDEC_COST_CACHE": str(path), "PYTHONPATH": REPO}
    return subprocess.run([sys.executable, "-c", CACHE_RUN], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full")
def test_a_cache_at_an_endless_device_is_not_read_nor_replaced():
    before = os.stat("/dev/full")
    done = _run_with_cache("/dev/full")
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("is not a regular file") == 1, done.stderr
    after = os.stat("/dev/full")
    assert stat.S_ISCHR(after.st_mode) and after.st_rdev == before.st_rdev


def test_a_cache_at_a_fifo_neither_blocks_nor_is_replaced(tmp_path):
    fifo = tmp_path / "cache.json"
    os.mkfifo(fifo)
    done = _run_with_cache(fifo)
    assert done.returncode == 0, done.stderr
    assert stat.S_ISFIFO(os.stat(fifo).st_mode) and os.listdir(tmp_path) == ["cache.json"]


def test_a_cache_at_a_device_node_is_left_a_device(tmp_path):
    node = tmp_path / "null"
    try:
        os.mknod(node, 0o666 | stat.S_IFCHR, os.makedev(1, 3))  # /dev/null's numbers
    except (PermissionError, OSError):
        pytest.skip("mknod needs root")
    done = _run_with_cache(node)
    assert done.returncode == 0, done.stderr
    assert stat.S_ISCHR(os.stat(node).st_mode) and os.listdir(tmp_path) == ["null"]


def test_a_cache_at_a_folder_warns_once_and_leaves_nothing(tmp_path):
    folder = tmp_path / "cache"
    folder.mkdir()
    done = _run_with_cache(folder)
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("cost cache") == 1, done.stderr
    assert os.listdir(tmp_path) == ["cache"] and os.listdir(folder) == []


def test_a_huge_cache_file_is_not_read_nor_replaced(tmp_path):
    from lookupdec import cache_file

    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate(cache_file.MAX_BYTES + 1)  # (sparse)
    assert cache_file.read(str(big)) is None
    cache_file.write(str(big), {"version": 1})
    assert os.path.getsize(big) == cache_file.MAX_BYTES + 1 and os.listdir(tmp_path) == ["big.json"]


def test_a_full_disk_leaves_the_cache_as_it_was_and_no_temporary_file(tmp_path):
    """Writes past a file-size limit fail (EFBIG, as on a full disk): the old cache stays whole."""
    cache = tmp_path / "cache.json"
    cache.write_text('{"version": 0}')
    script = (
        "import resource, signal, sys\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (64, 64))\n"
        "from lookupdec import cache_file\n"
        f"cache_file.write({str(cache)!r}, {{'version': 1, 'curves': {{'k': 'x' * 1000}}}})\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=os.environ | {"PYTHONPATH": REPO},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "could not write the cost cache" in done.stderr and done.stderr.count("\n") == 1
    assert cache.read_text() == '{"version": 0}' and os.listdir(tmp_path) == ["cache.json"]
