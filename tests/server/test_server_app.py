"""The server's app in-process (starlette's TestClient / httpx's ASGI transport; no process, no
port): the request guard (API key, body limit), the docs endpoints, an unknown model, /health
counts, prompts tokenized off the engine thread, and a fuzz of every request field.

The engine is stories260K with a chat template, decoding for real but at most
``QUICK_TOKENS`` tokens per request whatever ``max_tokens`` says, so that thousands of requests
take seconds; every check the engine runs (prompt, sampling values, seed, stop strings) is the
real one.
"""
from __future__ import annotations

import asyncio
import copy
import json
import math
import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi")
import httpx  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from conftest import load_stories  # noqa: E402
from helpers import failing_call, needs_stories  # noqa: E402
from lookupdec import Engine, EngineConfig  # noqa: E402
from lookupdec.server import create_app  # noqa: E402
from lookupdec.server import worker as worker_module  # noqa: E402

pytestmark = needs_stories

MODEL = "stories260K"
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")
QUICK_TOKENS = 3
KEY = "test-key-123"


class QuickEngine(Engine):
    """The real engine, every check included, generating at most QUICK_TOKENS tokens."""

    def _text_pieces(self, prompt_ids, params, max_new_tokens, *args, **kwargs):
        return super()._text_pieces(prompt_ids, params, min(max_new_tokens, QUICK_TOKENS), *args, **kwargs)


@pytest.fixture(scope="module")
def engine():
    model, tokenizer = load_stories()
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = CHAT_TEMPLATE
    return QuickEngine(model, tokenizer, EngineConfig(budget="fixed", max_nodes=16))


@pytest.fixture(scope="module")
def client(engine):
    with TestClient(create_app(engine, MODEL)) as c:
        yield c


def completion(**fields) -> dict:
    return {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 2, "temperature": 0} | fields


# -- /health ----------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_health_is_not_running_once_the_reply_is_sent(client, monkeypatch, stream):
    """The engine thread may be descheduled right after handing over a request's last event;
    /health must already count the request as ended (issue 13: running 1 after the reply)."""
    post = worker_module.Job.post

    def post_then_stall(self, kind, value=None):
        post(self, kind, value)
        if kind in ("done", "error", "cancelled"):
            time.sleep(0.3)  # the engine thread, descheduled after its last event

    monkeypatch.setattr(worker_module.Job, "post", post_then_stall)
    before = client.get("/health").json()
    response = client.post("/v1/completions", json=completion(stream=stream))
    assert response.status_code == 200
    health = client.get("/health").json()
    assert health["running"] == 0 and health["queued"] == 0, health
    assert health["completed"] == before["completed"] + 1
    bad = client.post("/v1/completions", json=completion(prompt=[1, 10**9]))  # fails on the engine thread
    assert bad.status_code == 400
    assert client.get("/health").json()["running"] == 0


@pytest.mark.timeout(120)  # (the regression is a hang: the TestClient ignores request timeouts)
def test_a_failed_batched_prefill_is_a_500_not_a_hang(engine, monkeypatch):
    """A request whose prefill fails as it joins the batch (out of memory) gets a 500 and is
    counted failed; the server goes on (before, it was in no list and its client waited forever)."""
    from lookupdec.model.batch import BatchTarget

    monkeypatch.setattr(BatchTarget, "add", failing_call(BatchTarget.add, 1))
    with TestClient(create_app(engine, MODEL, max_batch=4)) as c:
        first = c.post("/v1/completions", json=completion())
        assert first.status_code == 500
        health = c.get("/health").json()
        assert health["failed"] == 1 and health["running"] == 0 and health["batch"]["max"] == 4
        assert c.post("/v1/completions", json=completion()).status_code == 200


def first_step_takes_both(monkeypatch) -> None:
    """The batching worker's first step waits until two requests are queued (both join it)."""
    take, waited = worker_module.BatchingWorker._take, []

    def take_both(self, decoder, *, block):
        deadline = time.monotonic() + 30
        while not waited and self._incoming.qsize() < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        waited.append(True)
        return take(self, decoder, block=block)

    monkeypatch.setattr(worker_module.BatchingWorker, "_take", take_both)


@pytest.mark.timeout(120)
def test_a_failed_prefill_fails_its_request_only(engine, monkeypatch):
    """Two requests join one step and the second one's prefill fails (out of memory): it gets
    a 500, the first its answer, equal to the same request alone (before, both got a 500)."""
    from lookupdec.model.batch import BatchTarget

    monkeypatch.setattr(BatchTarget, "add", failing_call(BatchTarget.add, 2))
    first_step_takes_both(monkeypatch)
    with TestClient(create_app(engine, MODEL, max_batch=4)) as c, ThreadPoolExecutor(2) as pool:
        one = pool.submit(c.post, "/v1/completions", json=completion(max_tokens=8))
        time.sleep(0.2)  # (queued first: its prefill is the first)
        two = pool.submit(c.post, "/v1/completions", json=completion(max_tokens=8, prompt="Tom had a"))
        assert one.result().status_code == 200 and two.result().status_code == 500
        health = c.get("/health").json()
        assert health["completed"] == 1 and health["failed"] == 1 and health["running"] == 0, health
        alone = c.post("/v1/completions", json=completion(max_tokens=8))  # (the third prefill: fine)
        assert alone.json()["choices"][0]["text"] == one.result().json()["choices"][0]["text"]


@pytest.mark.timeout(120)
def test_a_failed_batched_step_answers_what_it_had_ended(engine, monkeypatch):
    """Two requests in one step, which fails (out of memory) after one of them ended at its
    first token: that one gets its answer (before: never answered, and ``/health`` counted it
    running for ever), the other a 500; the batch's row count is back to 0."""
    from lookupdec.model.batch import BatchTarget

    monkeypatch.setattr(BatchTarget, "verify", failing_call(BatchTarget.verify, 1))
    first_step_takes_both(monkeypatch)
    with TestClient(create_app(engine, MODEL, max_batch=4)) as c, ThreadPoolExecutor(2) as pool:
        one = pool.submit(c.post, "/v1/completions", json=completion(max_tokens=1))
        more = pool.submit(c.post, "/v1/completions", json=completion(max_tokens=8))
        assert one.result().status_code == 200 and more.result().status_code == 500
        health = c.get("/health").json()
        assert health["running"] == 0 and health["completed"] == 1 and health["failed"] == 1, health
        assert health["batch"]["running"] == 0


@pytest.mark.timeout(120)
def test_a_request_failing_as_it_joins_is_a_500_and_the_engine_goes_on(engine, monkeypatch):
    """Any error as a request joins the batch (a MemoryError building its stop strings, say) is
    that request's 500; before, it ended the engine thread and every later request hung."""
    from lookupdec.batch import BatchDecoder

    submit = BatchDecoder.submit
    calls = []

    def fail_once(self, request, field="prompt"):
        calls.append(1)
        if len(calls) == 1:
            raise MemoryError
        return submit(self, request, field)

    monkeypatch.setattr(BatchDecoder, "submit", fail_once)
    with TestClient(create_app(engine, MODEL, max_batch=4)) as c:
        assert c.post("/v1/completions", json=completion()).status_code == 500
        assert c.post("/v1/completions", json=completion()).status_code == 200
        health = c.get("/health").json()
        assert health["failed"] == 1 and health["completed"] >= 1 and health["running"] == 0, health


@pytest.mark.parametrize("rows", [0, 65, 2.5, "4", True])
def test_max_batch_is_checked(engine, rows):
    with pytest.raises(ValueError, match="max_batch"):
        create_app(engine, MODEL, max_batch=rows)


# -- API key --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def keyed(engine):
    with TestClient(create_app(engine, MODEL, api_key=KEY)) as c:
        yield c


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                                     {"Authorization": f"Basic {KEY}"}, {"Authorization": "Bearer "}])
@pytest.mark.parametrize("method, path", [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                                          ("GET", "/v1/models"), ("GET", "/nothing"), ("GET", "/openapi.json")])
def test_api_key_required_everywhere_but_health(keyed, headers, method, path):
    response = keyed.request(method, path, headers=headers, json=completion())
    assert response.status_code == 401
    error = response.json()["error"]
    assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error" and error["param"] is None
    assert "Authorization: Bearer" in error["message"]


def test_api_key_accepted_and_health_open(keyed):
    headers = {"Authorization": f"Bearer {KEY}"}
    assert keyed.post("/v1/completions", json=completion(), headers=headers).status_code == 200
    assert keyed.get("/v1/models", headers={"authorization": f"bearer {KEY}"}).status_code == 200
    assert keyed.get("/health").status_code == 200


def test_no_key_no_check(client):
    assert client.get("/v1/models").status_code == 200


# -- docs ---------------------------------------------------------------------------------------
def test_docs_are_off_by_default(client):
    for path in ("/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect"):
        response = client.get(path)
        assert response.status_code == 404 and "error" in response.json(), path


def test_openapi_flag_serves_the_schema_but_no_cdn_page(engine):
    with TestClient(create_app(engine, MODEL, openapi=True)) as c:
        schema = c.get("/openapi.json")
        assert schema.status_code == 200 and "/v1/completions" in schema.json()["paths"]
        assert c.get("/docs").status_code == 404 and c.get("/redoc").status_code == 404


# -- body limit -----------------------------------------------------------------------------------
LIMIT = 2000


@pytest.fixture(scope="module")
def limited(engine):
    with TestClient(create_app(engine, MODEL, max_request_bytes=LIMIT)) as c:
        yield c


def _too_large(response):
    assert response.status_code == 413
    error = response.json()["error"]
    assert error["code"] == "request_too_large" and str(LIMIT) in error["message"]


def test_body_over_the_limit_is_413(limited):
    _too_large(limited.post("/v1/completions", json=completion(prompt="a" * LIMIT)))


def test_chunked_body_over_the_limit_is_413(limited):
    def body():
        yield b'{"prompt": "'
        for _ in range(100):
            yield b"a" * 100
        yield b'"}'

    _too_large(limited.post("/v1/completions", content=body(), headers={"content-type": "application/json"}))


def test_body_under_the_limit_passes(limited):
    assert limited.post("/v1/completions", json=completion(prompt="a " * 100)).status_code == 200
    chunked = iter([json.dumps(completion()).encode()])
    assert limited.post("/v1/completions", content=chunked,
                        headers={"content-type": "application/json"}).status_code == 200


def test_content_length_is_checked_before_the_body_is_read(engine):
    """A declared size over the limit is answered at once: the app never asks for the body."""
    app = create_app(engine, MODEL, max_request_bytes=LIMIT)
    sent, asked = [], []

    async def receive():
        asked.append(1)
        return {"type": "http.request", "body": b"x" * 100, "more_body": True}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"content-length", b"20971520")],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}
    asyncio.run(app(scope, receive, send))
    assert sent[0]["status"] == 413 and not asked


# -- unknown model ------------------------------------------------------------------------------
@pytest.mark.parametrize("path, body", [
    ("/v1/completions", completion(model="gpt-4")),
    ("/v1/chat/completions", {"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}),
])
def test_unknown_model_is_404_model_not_found(client, path, body):
    response = client.post(path, json=body)
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model" and "gpt-4" in error["message"]


# -- values checked as the engine checks them ----------------------------------------------------
@pytest.mark.parametrize("raw, param", [
    ('"temperature": Infinity', "temperature"),
    ('"temperature": NaN', "temperature"),
    ('"temperature": 1e999', "temperature"),
    ('"repetition_penalty": Infinity', "repetition_penalty"),
    ('"repetition_penalty": -1', "repetition_penalty"),
    ('"top_p": NaN', "top_p"),
    ('"seed": 1180591620717411303424', "seed"),
    ('"seed": -1', "seed"),
    ('"max_tokens": 0', "max_tokens"),
    ('"top_k": 0', "top_k"),
])
def test_bad_values_name_their_field(client, raw, param):
    body = '{"prompt": "Once", ' + raw + "}"
    response = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param and param in response.json()["error"]["message"]


@pytest.mark.parametrize("path, raw, param", [
    ("/v1/completions", '"prompt": "\\ud800"', "prompt"),
    ("/v1/completions", '"prompt": "a \\ud800 lone"', "prompt"),
    ("/v1/completions", '"prompt": "Once", "stop": ["\\udc00"]', "stop"),
    ("/v1/chat/completions", '"messages": [{"role": "user", "content": "a\\ud800"}]', "messages"),
])
def test_a_lone_surrogate_is_named_as_such(client, path, raw, param):
    """A string with a lone surrogate is valid JSON but no text: the 400 says so and names the field
    (before: "expected a non-empty string or ...", or the tokenizer's TypeError)."""
    response = client.post(path, content="{" + raw + "}", headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"].startswith(f"{param}: not valid Unicode"), error


def test_a_chat_too_long_says_what_is_too_long(client):
    response = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "word " * 1000}]})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages", error
    assert error["message"].startswith("the prompt the chat template makes of the messages has "), error


def test_tiny_temperature_samples_instead_of_failing(client):
    for temperature in (1e-40, 1e-300, 5e-324):
        response = client.post("/v1/completions", json=completion(temperature=temperature, seed=1))
        assert response.status_code == 200, response.text


# -- prompts are tokenized off the engine thread -------------------------------------------------
def test_slow_tokenization_does_not_hold_up_the_engine(engine, monkeypatch):
    """While one request's prompt is still being tokenized, another request is answered."""
    app = create_app(engine, MODEL)
    builder = app.state.worker.prompts
    original = builder.completion

    def slow_completion(request):
        if request.prompt == "SLOW":
            time.sleep(2.0)
        return original(request)

    monkeypatch.setattr(builder, "completion", slow_completion)

    async def scenario():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30) as http:
            done = {}

            async def ask(name, prompt):
                response = await http.post("/v1/completions", json=completion(prompt=prompt))
                done[name] = time.monotonic(), response.status_code

            slow = asyncio.create_task(ask("slow", "SLOW"))
            await asyncio.sleep(0.2)
            await ask("fast", "Once upon a time")
            await slow
            return done

    try:
        done = asyncio.run(scenario())
    finally:
        app.state.worker.shutdown()
    assert done["fast"][1] == done["slow"][1] == 200
    assert done["fast"][0] < done["slow"][0] - 1.0, done


# -- fuzz -----------------------------------------------------------------------------------------
FUZZ_CASES = int(os.environ.get("LOOKUPDEC_FUZZ_CASES", "4000"))
FUZZ_SECONDS = 60  # time budget: cases stop there (4000 take ~16-35 s on the 2-core CI machine)
FUZZ_MIN_CASES = 1000  # fewer than this in the budget would be a hang, not a slow machine
REQUEST_SECONDS = 10  # one request answering slower than this is a hang
COMMON_FIELDS = ["model", "max_tokens", "temperature", "top_p", "top_k", "repetition_penalty", "seed", "stop",
                 "stream", "stream_options", "user", "n", "presence_penalty", "frequency_penalty", "logit_bias"]
FIELDS = {"/v1/completions": COMMON_FIELDS + ["prompt", "suffix", "echo", "best_of", "logprobs"],
          "/v1/chat/completions": COMMON_FIELDS + ["messages", "max_completion_tokens", "logprobs", "tools"]}
STRINGS = ["", "a", "Once", "\ud800", "\x00", "é😀", "<|fim_prefix|>", "16", "1e400", MODEL, "user", "text", "\n"]
FLOATS = [math.inf, -math.inf, math.nan, 0.0, -0.0, 1e-300, 5e-324, 1e308, 1e-40, 0.5, 1.0, 2.0, -1.0]


def random_value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(15 if depth < 2 else 8)
    if kind == 0:
        return None
    if kind == 1:
        return rng.random() < 0.5
    if kind == 2:
        return rng.randint(-3, 600)
    if kind == 3:
        return rng.choice([-1, 1]) * rng.randrange(2 ** rng.randrange(31, 80))
    if kind == 4:
        return rng.choice(FLOATS)
    if kind == 5:
        return rng.uniform(-3, 3)
    if kind == 6:
        return rng.choice(STRINGS)
    if kind == 7:
        return "".join(chr(rng.choice([rng.randrange(32, 127), rng.randrange(0x80, 0x3000)]))
                       for _ in range(rng.randrange(0, 40)))
    if kind == 8:
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(0, 5))]
    if kind == 9:
        return {rng.choice(["role", "content", "type", "text", "x"]): random_value(rng, depth + 1)
                for _ in range(rng.randrange(0, 4))}
    if kind == 10:  # token ids, some outside the vocabulary
        return [rng.choice([rng.randrange(0, 512), rng.randrange(-5, 2**40)]) for _ in range(rng.randrange(0, 8))]
    if kind == 11:
        return [rng.choice(STRINGS) for _ in range(rng.randrange(0, 6))]
    if kind == 12:  # messages, more or less
        return [{"role": rng.choice(["user", "assistant", "system", "tool", "wizard"]),
                 "content": rng.choice([rng.choice(STRINGS), [{"type": "text", "text": "hi"}], random_value(rng, 2)])}
                for _ in range(rng.randrange(0, 4))]
    if kind == 13:
        return "word " * rng.randrange(50, 800)  # up to longer than the 512-token context
    return rng.choice([{}, [], 0, 1, 0.0, True, "stories260K"])


PLAUSIBLE = {  # values of the right type, mostly valid: they reach the engine
    "model": lambda r: r.choice([MODEL, "", None]),
    "max_tokens": lambda r: r.choice([1, 2, 5, 600, 2**40]),
    "max_completion_tokens": lambda r: r.choice([1, 3, 2**40]),
    "temperature": lambda r: r.choice([0, 0.0, 0.7, 1, 2.5, 1e-40, 1e-300, 1e300]),
    "top_p": lambda r: r.choice([1, 1.0, 0.9, 1e-300, 0.5]),
    "top_k": lambda r: r.choice([1, 5, 2**40]),
    "repetition_penalty": lambda r: r.choice([1.0, 1.3, 0.5, 1e-300, 1e300]),
    "seed": lambda r: r.choice([0, 7, 2**63, 2**64 - 1]),
    "stop": lambda r: r.choice([".", ["a", "b"], "\ud800", ["é😀"], "Once"]),
    "stream": lambda r: r.choice([True, False]),
    "prompt": lambda r: r.choice(["Once", "\ud800 lone", [1, 2, 3], [0], "word " * 600, "é😀" * 50]),
    "suffix": lambda r: r.choice(["", "tail"]),
    "messages": lambda r: r.choice([[{"role": "user", "content": "hi"}],
                                    [{"role": "system", "content": "be nice"}, {"role": "user", "content": [
                                        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
                                    [{"role": "user", "content": "\ud800"}]]),
    "n": lambda r: 1,
    "user": lambda r: "someone",
    "stream_options": lambda r: {"include_usage": True},
}


def random_case(rng: random.Random):
    """(path, body bytes, fields the case changed: the ones an error may name; None: the body
    is not a JSON object, so an error names no field)."""
    path = rng.choice(sorted(FIELDS))
    roll = rng.random()
    if roll < 0.03:
        raw = rng.choice([b"{", b"", b"[1, 2]", b"null", b'"x"', b"\xff\xfe", b'{"prompt": ' + b"1" * 5000 + b"}",
                          b'{"prompt": "a", "prompt": 5}', json.dumps(random_value(rng)).encode()])
        return path, raw, None
    if path == "/v1/completions":
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 2}
    else:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    changed = set()
    for _ in range(rng.choice([1, 1, 2, 3])):
        field = rng.choice(FIELDS[path] + ["bogus_field"])
        if rng.random() < 0.1 and field in body:
            del body[field]
        elif field in PLAUSIBLE and rng.random() < 0.5:
            body[field] = PLAUSIBLE[field](rng)
        else:
            body[field] = random_value(rng)
        changed.add(field)
    return path, json.dumps(body).encode(), changed


def check_response(path, raw, changed, response) -> str | None:
    """What is wrong with ``response`` (None: nothing)."""
    status = response.status_code
    if status == 200:
        if b"server_error" in response.content:
            return "a streamed server error"
        return None
    if not 400 <= status < 500 or status == 499:
        return f"status {status}"
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return f"status {status} without OpenAI's error body"
    if changed is not None:
        if error["param"] not in changed and not (error["param"] in ("prompt", "messages") and
                                                   changed & {"prompt", "messages", "suffix"}):
            return f"status {status} names {error['param']!r}, not a changed field {sorted(changed)}"
    return None


@pytest.mark.timeout(FUZZ_SECONDS * 4)
def test_fuzz_every_field(client):
    """Random JSON values for every field of both POSTs (and bodies that are not objects): every
    answer is a 200 or a 4xx in OpenAI's shape naming a field the case changed; never a 5xx,
    never slower than REQUEST_SECONDS."""
    rng = random.Random(int(os.environ.get("LOOKUPDEC_FUZZ_SEED", "20240613")))
    failures, statuses, start = [], {}, time.monotonic()
    for case in range(FUZZ_CASES):
        path, raw, changed = random_case(rng)
        t = time.monotonic()
        response = client.post(path, content=raw, headers={"content-type": "application/json"})
        took = time.monotonic() - t
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        problem = check_response(path, raw, changed, response)
        if problem is None and took > REQUEST_SECONDS:
            problem = f"took {took:.1f} s"
        if problem:
            failures.append(f"case {case} {path} {raw[:300]!r}: {problem}: {response.text[:300]}")
        if time.monotonic() - start > FUZZ_SECONDS:
            break
    assert case + 1 >= min(FUZZ_MIN_CASES, FUZZ_CASES), f"only {case + 1} cases in {FUZZ_SECONDS} s"
    assert not failures, f"{len(failures)} bad answers:\n" + "\n".join(failures[:10])
    assert statuses.get(200, 0) > (case + 1) // 20 and statuses.get(400, 0) > (case + 1) // 4, statuses
    health = client.get("/health").json()
    assert health["running"] == 0 and health["queued"] == 0


def test_fuzz_runs_in_threads_too(client):
    """A few clients at once, for good measure: no 5xx, every thread finishes."""
    errors = []

    def worker(seed):
        rng = random.Random(seed)
        for _ in range(40):
            path, raw, changed = random_case(rng)
            response = client.post(path, content=raw, headers={"content-type": "application/json"})
            problem = check_response(path, raw, changed, response)
            if problem:
                errors.append(f"{raw[:200]!r}: {problem}")

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads) and not errors, errors[:5]
