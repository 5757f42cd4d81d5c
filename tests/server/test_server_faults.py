"""The server's hardening faults, each as a real ``lookupdec serve`` process where the fault is
the process's (its start, its signals, what it prints):

- a node budget whose batch K/V memory no machine could allocate is refused at start, with
  bounds that work (every request was a 500);
- SIGTERM drains: new requests get a 503, those in flight finish, those still in flight past
  the grace period get a 503 error (a stream: an error event, then ``[DONE]``), no traceback,
  exit status 0 (queued and non-streaming clients got uvicorn's plain-text 500, streams were
  cut, CancelledError tracebacks, the process died by the signal);
- ``--host ::1`` prints a URL that clients take (``http://[::1]:PORT``).
"""
from __future__ import annotations

import json
import re
import signal
import socket
import threading
import time

import httpx
import pytest
import torch

from conftest import load_stories
from helpers import needs_stories
from repo_paths import STORIES
from server_process import refused_start, running_server

pytestmark = needs_stories

NEVER_EOS = "<|never|>"  # the tiny model's EOS: an id past its vocabulary, never generated
LONG_MAX_TOKENS = 12000  # a generation of this length runs far past the grace period here
GRACE_S = 3  # the drain test's --grace: far longer than its short request takes
TIMEOUT_S = 60


@pytest.fixture(scope="module")
def never_eos_model(tmp_path_factory) -> str:
    """A tiny random Llama with stories260K's tokenizer whose EOS (id 512) is past the model's
    vocabulary (512): a generation always runs to its max_tokens."""
    import transformers
    from tokenizers import AddedToken

    folder = tmp_path_factory.mktemp("never-eos") / "tiny"
    tokenizer = transformers.AutoTokenizer.from_pretrained(STORIES, local_files_only=True)
    tokenizer.add_tokens([AddedToken(NEVER_EOS, special=True, normalized=False)], special_tokens=True)
    tokenizer.eos_token = NEVER_EOS
    tokenizer.save_pretrained(folder)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=len(tokenizer) - 1, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=16384, bos_token_id=1, eos_token_id=None)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return str(folder)


def sse_events(lines) -> list[dict | str]:
    """The ``data:`` payloads of an SSE stream, JSON decoded ("[DONE]" as is)."""
    payloads = [line[len("data: "):] for line in lines if line.startswith("data: ")]
    return [p if p == "[DONE]" else json.loads(p) for p in payloads]


def assert_shutdown_error(error: dict) -> None:
    assert error["type"] == "server_error" and error["code"] == "server_shutting_down", error
    assert "shutting down" in error["message"] and error["param"] is None, error


# -- 6: a node budget the batch cannot allocate --------------------------------------------------
def test_a_node_budget_the_batch_cannot_hold_is_refused_at_start_with_bounds_that_work():
    """``--max-nodes 10**9`` with the default ``--max-batch``: each joining request reserves K/V
    slots for a tree of that many nodes in every row, terabytes (the issue: SmolLM2, 100000
    nodes, 55 GB), and every request was a 500. Now the server does not start: one line, exit
    status 2, naming the flag and a bound; a batch at that bound serves a request."""
    from starlette.testclient import TestClient

    from lookupdec import Engine, EngineConfig
    from lookupdec.config import SERVE_MAX_BATCH
    from lookupdec.server import create_app

    code, output = refused_start("--model", STORIES, "--max-nodes", str(10**9))
    assert code == 2, f"the server started (exit status {code}):\n{output[-2000:]}"
    lines = output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"lookupdec: error: --max-nodes {10**9} "), output
    assert f"--max-batch {SERVE_MAX_BATCH}" in lines[0] and "Traceback" not in output, output
    bound = int(re.search(r"use --max-nodes (\d+) or less", lines[0]).group(1))
    assert 64 <= bound < 10**9, lines[0]  # (the default budget fits any machine that runs stories260K)
    from lookupdec.server.app import check_batch_memory

    model, tokenizer = load_stories()
    engine = Engine(model, tokenizer, EngineConfig(max_nodes=bound))
    check_batch_memory(engine, SERVE_MAX_BATCH)  # the bound passes the start check ...
    with TestClient(create_app(engine, "stories260K", max_batch=SERVE_MAX_BATCH)) as client:  # ... and serves
        answer = client.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 4})
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == 4


# -- 7: SIGTERM drains ----------------------------------------------------------------------------
def test_sigterm_drains_then_ends_what_is_left_with_errors(never_eos_model):
    """SIGTERM with a long stream, a long non-streaming request and a short request whose body
    is still arriving: new requests get a 503 JSON error, the short one is answered in full, the
    two long ones end past the grace period with a 503 error (the stream: an error event, then
    [DONE]); no traceback in the log, exit status 0."""
    long = {"prompt": "Once", "max_tokens": LONG_MAX_TOKENS, "temperature": 1.0}
    short = json.dumps({"prompt": "Once", "max_tokens": 8, "temperature": 0}).encode()
    results: dict = {}
    head_sent, rest_of_body = threading.Event(), threading.Event()

    def post(name: str, **kwargs) -> None:
        results[name] = httpx.post(server.api + "/completions", timeout=TIMEOUT_S, **kwargs)

    def slow_body():  # sent in two parts: the request is in flight, its prompt not yet known
        yield short[:10]
        head_sent.set()  # (httpx asks for the next part once it has sent the head and the first)
        rest_of_body.wait(TIMEOUT_S)
        yield short[10:]

    with running_server("--model", never_eos_model, "--max-batch", "3", "--grace", str(GRACE_S)) as server:
        json_body = {"content": slow_body(), "headers": {"Content-Type": "application/json"}}
        threads = [threading.Thread(target=post, args=("short",), kwargs=json_body)]
        threads[0].start()
        assert head_sent.wait(TIMEOUT_S)
        with httpx.stream("POST", server.api + "/completions", json=long | {"stream": True},
                          timeout=TIMEOUT_S) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data: ")  # generating now (the short request's head came before)
            threads.append(threading.Thread(target=post, args=("long",), kwargs={"json": long}))
            threads[-1].start()
            deadline = time.monotonic() + TIMEOUT_S
            while server.health()["running"] < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            server.proc.send_signal(signal.SIGTERM)
            refused = httpx.get(server.api + "/models", timeout=TIMEOUT_S)
            while refused.status_code == 200 and time.monotonic() < deadline:  # (until the signal is handled)
                refused = httpx.get(server.api + "/models", timeout=TIMEOUT_S)
            assert refused.status_code == 503, refused.text
            assert_shutdown_error(refused.json()["error"])
            rest_of_body.set()
            streamed = sse_events(lines)
        for thread in threads:
            thread.join(TIMEOUT_S)
        assert server.proc.wait(TIMEOUT_S) == 0
        log = server.log()
    assert results["short"].status_code == 200, results["short"].text
    assert results["short"].json()["usage"]["completion_tokens"] == 8
    assert results["long"].status_code == 503, results["long"].text
    assert_shutdown_error(results["long"].json()["error"])
    assert streamed[-1] == "[DONE]" and "error" in streamed[-2], streamed[-3:]
    assert_shutdown_error(streamed[-2]["error"])
    assert f"({GRACE_S} s)" in streamed[-2]["error"]["message"]
    assert all("choices" in event for event in streamed[:-2]), "only the last event before [DONE] is the error"
    assert "Traceback" not in log and "CancelledError" not in log and "Cancel " not in log, log


@pytest.mark.parametrize("grace", ["-1", "x", "inf", "nan"])
def test_grace_is_checked(capsys, grace):
    from lookupdec.cli import main

    with pytest.raises(SystemExit) as exc:  # argparse's usage error, before anything loads
        main(["serve", "--model", STORIES, "--grace", grace])
    assert exc.value.code == 2
    assert "argument --grace" in capsys.readouterr().err


# -- 13: an IPv6 host's URL ----------------------------------------------------------------------------
def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as sock:
            sock.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback here")
def test_an_ipv6_host_is_printed_in_brackets():
    """``--host ::1`` printed ``http://::1:PORT``, which clients reject."""
    with running_server("--model", STORIES, "--host", "::1") as server:
        assert re.fullmatch(r"http://\[::1\]:\d+", server.base_url), server.base_url
        assert httpx.get(server.base_url + "/health", timeout=TIMEOUT_S).json()["status"] == "ok"
