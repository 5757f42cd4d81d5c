"""``lookupdec serve`` as a real process on loopback, driven by the official ``openai`` client
(and ``httpx`` where the raw bytes or the connection itself matter).

Two servers, one per module: stories260K (real pretrained weights) with a chat template added,
and a tiny random Llama with the stories tokenizer plus FIM tokens — for fill-in-the-middle and
for cancellation, where it samples near-uniformly and its EOS id is outside the model's
vocabulary, so that an uncancelled generation is long and always runs to max_tokens.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
import torch

from helpers import hf_greedy, needs_stories
from repo_paths import REPO, STORIES
from server_process import running_server

pytestmark = needs_stories

CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")
FIM_TOKENS = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"]
NEVER_EOS = "<|never|>"  # the tiny model's EOS: an id past its vocabulary, never generated
TINY_CONTEXT = 16384
LONG_MAX_TOKENS = 12000  # an uncancelled generation of this length takes many seconds here
STORY = "Once upon a time, Lily saw a cat. The cat was big. Once upon a time, Lily"
CANCEL_TIMEOUT_S = 60


# -- models and servers -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> str:
    """stories260K with a chat template in its tokenizer_config.json."""
    folder = tmp_path_factory.mktemp("chat") / "stories260K"
    shutil.copytree(STORIES, folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps(config | {"chat_template": CHAT_TEMPLATE}))
    return str(folder)


@pytest.fixture(scope="module")
def fim_model(tmp_path_factory) -> str:
    """A tiny random Llama (vocab 515) with stories260K's tokenizer plus the three FIM tokens
    (ids 512-514) and an EOS token at id 515, past the model's vocabulary."""
    import transformers
    from tokenizers import AddedToken

    folder = tmp_path_factory.mktemp("fim") / "tiny-fim"
    tokenizer = transformers.AutoTokenizer.from_pretrained(STORIES, local_files_only=True)
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in FIM_TOKENS + [NEVER_EOS]],
                         special_tokens=True)
    tokenizer.eos_token = NEVER_EOS
    tokenizer.save_pretrained(folder)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=len(tokenizer) - 1, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=TINY_CONTEXT, bos_token_id=1, eos_token_id=None)
    model = transformers.LlamaForCausalLM(config)
    # Byte-fallback tokens never win greedy (logit 0 against the best of ~250 random logits):
    # random bytes are invalid UTF-8, whose text the tokenizer renders differently piece by
    # piece than whole, and the FIM test compares text.
    byte_ids = [i for token, i in tokenizer.get_vocab().items() if re.fullmatch(r"<0x[0-9A-F]{2}>", token)]
    with torch.no_grad():
        model.lm_head.weight[byte_ids] = 0.0
    model.save_pretrained(folder)
    return str(folder)


# Every test runs against a server taking requests one at a time and one batching them.
BATCHING = pytest.fixture(scope="module", params=["1", "4"], ids=["one-at-a-time", "max-batch-4"])


@BATCHING
def server(chat_model, request):
    with running_server("--model", chat_model, "--max-batch", request.param) as proc:
        yield proc


@BATCHING
def fim_server(fim_model, request):
    with running_server("--model", fim_model, "--max-batch", request.param) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.api, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def chat_tokenizer(chat_model):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(chat_model, local_files_only=True)


def complete(client, prompt, **kwargs):
    kwargs = {"max_tokens": 24, "temperature": 0} | kwargs
    return client.completions.create(model="stories260K", prompt=prompt, **kwargs)


# -- basics ---------------------------------------------------------------------------------------
def test_models_and_health(client, server):
    assert [m.id for m in client.models.list().data] == ["stories260K"]
    health = server.health()
    assert health["status"] == "ok" and health["model"] == "stories260K"
    before = health["prefix_cache"]
    complete(client, STORY, max_tokens=4)
    complete(client, "A dog ran to the park and played with a red ball all day long.", max_tokens=4)
    complete(client, STORY + " Then", max_tokens=4)  # starts from a copy of the story's K/V
    after = server.health()["prefix_cache"]
    assert after["prompts"] >= 2 and after["mib"] > 0 and after["hits"] == before["hits"] + 1, (before, after)


def test_completion_is_transformers_greedy(client, stories):
    model, tokenizer = stories
    response = complete(client, STORY, max_tokens=32)
    want = hf_greedy(model, tokenizer(STORY).input_ids, 32)
    choice = response.choices[0]
    assert choice.text == tokenizer.decode(want, skip_special_tokens=True)
    assert choice.finish_reason == "length" and response.object == "text_completion"
    assert response.usage.prompt_tokens == len(tokenizer(STORY).input_ids)
    assert response.usage.completion_tokens == 32
    stats = response.model_extra["lookupdec"]
    for key in ("steps", "new_tokens", "mean_accepted", "accepted_by_source", "tokens_per_s", "overhead_us",
                "forward_ms", "queue_ms"):
        assert key in stats
    assert stats["new_tokens"] == 32 and stats["mean_accepted"] == pytest.approx(31 / stats["steps"])  # the first: the prefill's


def test_chat_uses_the_template(client, stories, chat_tokenizer):
    model, _ = stories
    messages = [{"role": "system", "content": "You tell stories."}, {"role": "user", "content": "A cat"}]
    response = client.chat.completions.create(model="stories260K", messages=messages, max_tokens=20, temperature=0)
    text = chat_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "system: You tell stories.\nuser: A cat\nassistant:"
    prompt_ids = chat_tokenizer(text, add_special_tokens=False).input_ids
    want = hf_greedy(model, prompt_ids, 20)
    assert response.object == "chat.completion"
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content == chat_tokenizer.decode(want, skip_special_tokens=True)
    assert response.usage.prompt_tokens == len(prompt_ids) and response.usage.completion_tokens == 20


def test_global_cache_learns_across_requests(client):
    prompt = "Tom found a blue box in the garden. He"
    first, second = (complete(client, prompt, max_tokens=64) for _ in range(2))
    assert first.choices[0].text == second.choices[0].text
    steps = [r.model_extra["lookupdec"]["steps"] for r in (first, second)]
    assert steps[1] < steps[0] / 2, f"the second request should draft from the first's output: {steps}"


# -- streaming ------------------------------------------------------------------------------------
def test_streamed_completion_equals_plain(client):
    plain = complete(client, STORY, max_tokens=40)
    chunks = list(complete(client, STORY, max_tokens=40, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == plain.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 40 and "lookupdec" in chunks[-1].model_extra


def test_streamed_chat_equals_plain(client):
    messages = [{"role": "user", "content": "Tell me about a dog"}]
    plain = client.chat.completions.create(model="stories260K", messages=messages, max_tokens=30, temperature=0)
    chunks = list(client.chat.completions.create(model="stories260K", messages=messages, max_tokens=30,
                                                 temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == plain.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].usage.completion_tokens == 30


def test_raw_sse_ends_with_done(server):
    body = {"prompt": STORY, "max_tokens": 12, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.api + "/completions", json=body, timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][len("data: "):])["choices"][0]["finish_reason"] == "length"


# -- stop strings and seeds -----------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_ends_text_exactly_before_it(client, stream):
    full = complete(client, STORY, max_tokens=64).choices[0].text
    stop = full[20:26]  # a string the output is known to contain
    want = full[: full.index(stop)]
    response = complete(client, STORY, max_tokens=64, stop=[stop, "zzzz"], stream=stream)
    if stream:
        chunks = list(response)
        text, finish = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
    else:
        text, finish = response.choices[0].text, response.choices[0].finish_reason
    assert (text, finish) == (want, "stop")


def test_seed_reproducibility(client):
    def sample(seed):
        return complete(client, "Once upon a time", max_tokens=24, temperature=1.0, seed=seed).choices[0].text

    assert sample(7) == sample(7) == sample(7)
    assert len({sample(seed) for seed in range(5)}) > 1, "different seeds should give different samples"


# -- bad requests ---------------------------------------------------------------------------------
BAD_COMPLETIONS = [  # a field set to None is left out of the request
    ({"prompt": None}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": "word " * 700}, "prompt"),  # longer than the 512-token context
    ({"prompt": [1, 100000]}, "prompt"),  # a token id outside the vocabulary
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": 2.5}, "max_tokens"),
    ({"max_tokens": "16"}, "max_tokens"),
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": 0}, "top_k"),
    ({"stop": 5}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": [1]}, "stop"),
    ({"seed": 1.5}, "seed"),
    ({"seed": "x"}, "seed"),
    ({"n": 2}, "n"),
    ({"best_of": 3}, "best_of"),
    ({"echo": True}, "echo"),
    ({"logprobs": 2}, "logprobs"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"logit_bias": {"5": 10}}, "logit_bias"),
    ({"stream": "yes"}, "stream"),
    ({"suffix": "return x"}, "suffix"),  # stories260K has no FIM tokens
    ({"max_token": 5}, "max_token"),  # a misspelt field is an error, not ignored
]


@pytest.mark.parametrize("fields,param", BAD_COMPLETIONS, ids=[f"{p}-{i}" for i, (_, p) in enumerate(BAD_COMPLETIONS)])
def test_bad_completion_field_is_a_400_naming_it(client, fields, param):
    body = {"model": "stories260K", "prompt": "Once"} | fields
    body = {k: v for k, v in body.items() if v is not None}
    with pytest.raises(openai.BadRequestError) as info:
        client.post("/completions", body=body, cast_to=object)
    assert info.value.status_code == 400 and info.value.param == param
    assert info.value.body["type"] == "invalid_request_error" and info.value.body["code"] is None
    assert param in info.value.message


BAD_CHATS = [
    ({"messages": None}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": "hello"}, "messages"),
    ({"messages": [{"role": "user"}]}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages"),
    ({"messages": [{"role": "user", "content": "word " * 700}]}, "messages"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"logprobs": True}, "logprobs"),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"temperature": -1}, "temperature"),
]


@pytest.mark.parametrize("fields,param", BAD_CHATS, ids=[f"{p}-{i}" for i, (_, p) in enumerate(BAD_CHATS)])
def test_bad_chat_field_is_a_400_naming_it(client, fields, param):
    body = {"model": "stories260K", "messages": [{"role": "user", "content": "hi"}]} | fields
    body = {k: v for k, v in body.items() if v is not None}
    with pytest.raises(openai.BadRequestError) as info:
        client.post("/chat/completions", body=body, cast_to=object)
    assert info.value.status_code == 400 and info.value.param == param


def test_malformed_bodies_and_paths(server):
    bad_json = httpx.post(server.api + "/completions", content=b"{", headers={"content-type": "application/json"})
    assert bad_json.status_code == 400 and "JSON" in bad_json.json()["error"]["message"]
    not_object = httpx.post(server.api + "/completions", json=[1, 2])
    assert not_object.status_code == 400 and not_object.json()["error"]["param"] is None
    missing = httpx.get(server.api + "/nothing")
    assert missing.status_code == 404 and missing.json()["error"]["message"].endswith("Not Found")


KEEP_ALIVE_MEDIAN_LIMIT_MS = 20  # a response held back by Nagle + delayed ACK takes ~40 ms


def test_keep_alive_requests_do_not_stall(server):
    """Many requests on one connection (as the openai client does): no ~40 ms delayed-ACK stall."""
    times = []
    with httpx.Client(timeout=30) as http:
        for _ in range(20):
            start = time.perf_counter()
            http.get(server.base_url + "/health").raise_for_status()
            times.append((time.perf_counter() - start) * 1e3)
    assert sorted(times)[len(times) // 2] < KEEP_ALIVE_MEDIAN_LIMIT_MS, times


def test_unknown_model_is_404_model_not_found(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-4", prompt="Once", max_tokens=2)
    assert info.value.status_code == 404 and info.value.code == "model_not_found" and info.value.param == "model"


def test_served_model_name_or_none_accepted(server):
    for body in ({"prompt": "Once", "max_tokens": 2}, {"prompt": "Once", "max_tokens": 2, "model": "stories260K"}):
        assert httpx.post(server.api + "/completions", json=body, timeout=60).status_code == 200


# -- concurrency ----------------------------------------------------------------------------------
NAMES = ["Lily", "Tom", "Sue", "Ben", "Max"]
THINGS = ["ball", "cat", "kite", "boat"]


def test_twenty_concurrent_clients_get_their_own_answers(server, stories):
    model, tokenizer = stories
    prompts = [f"{name} had a {thing}. One day, {name}" for name in NAMES for thing in THINGS]
    want = {p: tokenizer.decode(hf_greedy(model, tokenizer(p).input_ids, 16), skip_special_tokens=True)
            for p in prompts}
    got, errors = {}, []
    client = openai.OpenAI(base_url=server.api, api_key="unused", max_retries=0, timeout=300)

    def ask(prompt):
        try:
            got[prompt] = complete(client, prompt, max_tokens=16).choices[0].text
        except Exception as exc:  # reported below; a thread's exception would otherwise vanish
            errors.append(exc)

    threads = [threading.Thread(target=ask, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and got == want


# -- fill-in-the-middle and cancellation (tiny random model) -------------------------------------
def test_fim_tokens_of_both_spellings():
    from types import SimpleNamespace

    from lookupdec.server.prompts import fim_token_ids

    def tokenizer(vocab):
        return SimpleNamespace(get_vocab=lambda: vocab)

    assert fim_token_ids(tokenizer({"<fim_prefix>": 7, "<fim_suffix>": 8, "<fim_middle>": 9, "a": 1})) == (7, 8, 9)
    assert fim_token_ids(tokenizer({"<|fim_prefix|>": 3, "<|fim_suffix|>": 4, "<|fim_middle|>": 5})) == (3, 4, 5)
    assert fim_token_ids(tokenizer({"<fim_prefix>": 7, "<fim_suffix>": 8})) is None  # incomplete set


def test_fim_prompt_is_prefix_suffix_middle(fim_server, fim_model):
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(fim_model, local_files_only=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(fim_model, local_files_only=True).float().eval()
    prefix_id, suffix_id, middle_id = tokenizer.convert_tokens_to_ids(FIM_TOKENS)
    prompt, suffix = "def add(a, b):\n    ", "\n\nprint(add(1, 2))"
    ids = ([1, prefix_id] + tokenizer(prompt, add_special_tokens=False).input_ids + [suffix_id]
           + tokenizer(suffix, add_special_tokens=False).input_ids + [middle_id])
    client = openai.OpenAI(base_url=fim_server.api, api_key="unused", max_retries=0, timeout=120)
    response = client.completions.create(model="tiny-fim", prompt=prompt, suffix=suffix, max_tokens=12, temperature=0)
    assert response.usage.prompt_tokens == len(ids)
    assert response.choices[0].text == tokenizer.decode(hf_greedy(model, ids, 12), skip_special_tokens=True)


def test_chat_without_template_is_a_400(fim_server):
    client = openai.OpenAI(base_url=fim_server.api, api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="chat template") as info:
        client.chat.completions.create(model="tiny-fim", messages=[{"role": "user", "content": "hi"}])
    assert info.value.param == "messages"


def wait_for(server, predicate, what: str) -> dict:
    deadline = time.monotonic() + CANCEL_TIMEOUT_S
    while time.monotonic() < deadline:
        health = server.health()
        if predicate(health):
            return health
        time.sleep(0.05)
    raise AssertionError(f"{what}: /health still says {health}")


def test_disconnect_cancels_generation(fim_server):
    """A streaming client, a queued client and a waiting non-streaming client all disconnect:
    each generation ends "cancelled" (before its max_tokens, which would take long), none
    completes, and the engine is free at once for the next request."""
    before = fim_server.health()
    long = {"model": "tiny-fim", "prompt": "Once", "max_tokens": LONG_MAX_TOKENS, "temperature": 1.0}
    with httpx.stream("POST", fim_server.api + "/completions", json=long | {"stream": True}, timeout=120) as stream:
        lines = stream.iter_lines()  # kept: a discarded line iterator would close the connection
        assert next(lines).startswith("data: ")  # generating now
        with pytest.raises(httpx.ReadTimeout):  # queued behind the stream; leaves after 0.5 s
            httpx.post(fim_server.api + "/completions", json=long, timeout=httpx.Timeout(30, read=0.5))
        # with --max-batch 4 the second request ran beside the stream: the server notices its
        # client left on its next check, not at once
        wait_for(fim_server, lambda h: h["running"] == 1, "the request that left should be cancelled, the stream run on")
    # the stream's connection is closed here
    wait_for(fim_server, lambda h: h["cancelled"] == before["cancelled"] + 2 and h["running"] == 0,
             "the stream and the queued request should both be cancelled")
    with pytest.raises(httpx.ReadTimeout):  # runs, then leaves while its generation is under way
        httpx.post(fim_server.api + "/completions", json=long, timeout=httpx.Timeout(30, read=1.0))
    health = wait_for(fim_server, lambda h: h["cancelled"] == before["cancelled"] + 3 and h["running"] == 0,
                      "the non-streaming request should be cancelled")
    assert health["completed"] == before["completed"], "no cancelled request may run to its end"
    short = httpx.post(fim_server.api + "/completions", json={"prompt": "Once", "max_tokens": 4}, timeout=60)
    assert short.status_code == 200 and short.json()["usage"]["completion_tokens"] == 4


def test_health_shows_the_running_batch(fim_server):
    """Two long streams at once with --max-batch 4: both run in one batch (/health says 2 of
    4); one at a time, a single stream shows a batch of 1 of 1. Closing cancels them."""
    long = {"model": "tiny-fim", "prompt": "Once", "max_tokens": LONG_MAX_TOKENS, "temperature": 1.0, "stream": True}
    batching = fim_server.health()["batch"]["max"] > 1
    lines = []  # kept: a discarded line iterator would close its connection
    with contextlib.ExitStack() as streams:
        for seed in (1, 2) if batching else (1,):
            response = streams.enter_context(httpx.stream("POST", fim_server.api + "/completions",
                                                          json=long | {"seed": seed}, timeout=120))
            lines.append(response.iter_lines())
            assert next(lines[-1]).startswith("data: ")  # generating now
        if batching:
            health = wait_for(fim_server, lambda h: h["batch"]["running"] == 2, "two requests in the batch")
            assert health["batch"]["max"] == 4 and health["running"] == 2 and health["queued"] == 0
        else:
            health = fim_server.health()
            assert health["batch"] == {"running": 1, "max": 1} and health["running"] == 1
    wait_for(fim_server, lambda h: h["running"] == 0 and h["batch"]["running"] == 0, "the streams cancelled")


# -- the example --------------------------------------------------------------------------------
def test_example_complete_code(server):
    result = subprocess.run([sys.executable, os.path.join(REPO, "examples", "complete_code.py"), server.api],
                            capture_output=True, text=True, timeout=300, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert "tokens per step" in result.stdout


# -- the command line ---------------------------------------------------------------------------
def test_serve_without_server_extra_says_what_to_install(capsys, monkeypatch):
    from lookupdec.cli import main

    for name in [m for m in sys.modules if m == "lookupdec.server" or m.startswith("lookupdec.server.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "fastapi", None)  # as if not installed: importing it raises ImportError
    assert main(["serve", "--model", STORIES]) == 2
    assert 'pip install "lookupdec[server]"' in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--model", "/nonexistent/model"], "model path not found"),
    (["--model", STORIES, "--port", "70000"], "--port"),
])
def test_serve_bad_arguments_one_line_error(capsys, args, message):
    from lookupdec.cli import main

    assert main(["serve", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("lookupdec: error:") and "Traceback" not in err


@pytest.mark.parametrize("rows", ["0", "65", "x", "2.5"])
def test_serve_max_batch_is_checked(capsys, rows):
    from lookupdec.cli import main

    with pytest.raises(SystemExit) as exc:  # argparse's usage error, before anything loads
        main(["serve", "--model", STORIES, "--max-batch", rows])
    assert exc.value.code == 2
    assert "argument --max-batch" in capsys.readouterr().err


# -- hardening: API key from the environment, request body limit ---------------------------------
API_KEY = "s3cret-key"
BIG = 20 << 20  # the 20 MB request


@pytest.fixture(scope="module")
def guarded_server(chat_model):
    with running_server("--model", chat_model, env={"LOOKUPDEC_API_KEY": API_KEY}) as proc:
        yield proc


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        line = next(line for line in f if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def raw_request(url: str, head: str, body: bytes) -> tuple[int, dict, float]:
    """Send ``head`` then ``body`` on a raw socket, stopping as soon as the server answers or
    closes; returns (status, error object, seconds until the answer)."""
    import select
    import socket
    from urllib.parse import urlparse

    where = urlparse(url)
    start = time.monotonic()
    with socket.create_connection((where.hostname, where.port), timeout=30) as sock:
        sock.sendall(head.encode())
        view, answer = memoryview(body), b""
        while view and not answer:
            readable, writable, _ = select.select([sock], [sock], [], 30)
            if readable:
                answer = sock.recv(65536)
                break
            if writable:
                try:
                    view = view[sock.send(view[:65536]):]
                except (BrokenPipeError, ConnectionResetError):
                    break
        took = time.monotonic() - start
        while b"\r\n\r\n" not in answer or len(answer.partition(b"\r\n\r\n")[2]) < _length(answer):
            more = sock.recv(65536)  # the rest of the answer (its Content-Length)
            if not more:
                break
            answer += more
    head_part, _, content = answer.partition(b"\r\n\r\n")
    return int(head_part.split()[1]), json.loads(content)["error"], took


def _length(answer: bytes) -> int:
    for line in answer.partition(b"\r\n\r\n")[0].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


def test_api_key_from_the_environment(guarded_server):
    base = guarded_server.base_url
    assert httpx.get(base + "/health").status_code == 200  # open: monitoring needs no key
    refused = httpx.get(base + "/v1/models")
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    client = openai.OpenAI(base_url=guarded_server.api, api_key=API_KEY, max_retries=0, timeout=60)
    assert [m.id for m in client.models.list().data] == ["stories260K"]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=guarded_server.api, api_key="wrong", max_retries=0).models.list()
    assert httpx.get(base + "/docs").status_code == 401
    assert httpx.get(base + "/docs", headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 404


def test_20_mb_request_refused_at_once_memory_unchanged(guarded_server):
    """The issue's probe: a 20 MB prompt was tokenized for 28 s and the server grew by 1.3 GB.
    Now: 413 within a second, by Content-Length or (chunked) once 4 MiB have arrived, and the
    server's memory stays where it was; the server still answers afterwards."""
    pid = guarded_server.proc.pid
    auth = f"Authorization: Bearer {API_KEY}\r\n"
    before = rss_bytes(pid)
    text = b'{"prompt": "' + b"word " * (BIG // 5) + b'"}'
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: application/json\r\n"
            f"Content-Length: {len(text)}\r\n\r\n")
    status, error, took = raw_request(guarded_server.base_url, head, text)
    assert status == 413 and error["code"] == "request_too_large" and took < 1.0, (status, error, took)
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(text[i:i + 65536]), text[i:i + 65536])
                       for i in range(0, len(text), 65536)) + b"0\r\n\r\n"
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: application/json\r\n"
            "Transfer-Encoding: chunked\r\n\r\n")
    status, error, took = raw_request(guarded_server.base_url, head, chunked)
    assert status == 413 and error["code"] == "request_too_large" and took < 1.0, (status, error, took)
    grown = rss_bytes(pid) - before
    assert grown < 16 << 20, f"the server grew by {grown / 1e6:.1f} MB"
    ok = httpx.post(guarded_server.api + "/completions", json={"prompt": "Once", "max_tokens": 2},
                    headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    assert ok.status_code == 200
