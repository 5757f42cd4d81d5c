"""A real ``lookupdec serve`` process on loopback for the tests: started on a free port (the
server binds port 0 and prints the one it got), ready once ``/health`` answers, always killed
on exit — also when the test fails."""
from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import tempfile
import time

import httpx

from repo_paths import REPO
START_TIMEOUT_S = 180  # loading torch + transformers + the model on a loaded 2-core machine
POLL_S = 0.1
LISTENING = re.compile(r"lookupdec: serving \S+ at (http://\S+)\s")  # (an IPv6 host in brackets; the whole line)


class ServerProcess:
    def __init__(self, proc: subprocess.Popen, log_path: str, base_url: str) -> None:
        self.proc, self.log_path, self.base_url = proc, log_path, base_url

    @property
    def api(self) -> str:
        return self.base_url + "/v1"

    def log(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()

    def health(self) -> dict:
        return httpx.get(self.base_url + "/health", timeout=30).json()


def _wait_for_url(proc: subprocess.Popen, log_path: str) -> str:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        with open(log_path, encoding="utf-8", errors="replace") as f:
            match = LISTENING.search(f.read())
        if match:
            return match.group(1)
        if proc.poll() is not None:
            break
        time.sleep(POLL_S)
    with open(log_path, encoding="utf-8", errors="replace") as f:
        raise RuntimeError(f"lookupdec serve did not start (exit code {proc.poll()}):\n{f.read()[-3000:]}")


def _wait_for_health(base_url: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(base_url + "/health", timeout=5).status_code == 200:
                return
        time.sleep(POLL_S)
    raise RuntimeError(f"{base_url}/health never answered")


@contextlib.contextmanager
def _started(args, env: dict | None):
    """``lookupdec serve --port 0 ARGS...`` (``env``: more environment variables) as (process,
    log path); terminated (then killed) on exit."""
    log_fd, log_path = tempfile.mkstemp(prefix="lookupdec-serve-", suffix=".log")
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": REPO} | (env or {})  # tiny models: one thread is faster
    proc = subprocess.Popen([sys.executable, "-m", "lookupdec", "serve", "--port", "0", *args], cwd=REPO,
                            env=env, stdout=log_fd, stderr=log_fd, stdin=subprocess.DEVNULL)
    os.close(log_fd)
    try:
        yield proc, log_path
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        os.unlink(log_path)


@contextlib.contextmanager
def running_server(*args: str, env: dict | None = None):
    """``lookupdec serve --port 0 ARGS...`` as a ServerProcess (``env``: more environment
    variables); terminated (then killed) on exit."""
    with _started(args, env) as (proc, log_path):
        base_url = _wait_for_url(proc, log_path)
        _wait_for_health(base_url)
        yield ServerProcess(proc, log_path, base_url)


def refused_start(*args: str, env: dict | None = None) -> tuple[int | None, str]:
    """``lookupdec serve --port 0 ARGS...`` expected to exit before it listens: (its exit
    status, its output); (None, its output) if it listened instead (then it is terminated)."""
    with _started(args, env) as (proc, log_path):
        deadline = time.monotonic() + START_TIMEOUT_S
        while proc.poll() is None and time.monotonic() < deadline:
            with open(log_path, encoding="utf-8", errors="replace") as f:
                if LISTENING.search(f.read()):
                    break
            time.sleep(POLL_S)
        code = proc.poll()
        with open(log_path, encoding="utf-8", errors="replace") as f:
            return code, f.read()
