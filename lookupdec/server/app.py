"""The FastAPI app: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /health``; and ``serve()``, which loads the engine and runs uvicorn.

Every request first passes ``RequestGuard`` (an ASGI middleware): with an API key, every path
but ``/health`` needs ``Authorization: Bearer KEY`` (401 otherwise); a body larger than
``max_request_bytes`` is a 413 before it is read (by its Content-Length, or once a chunked body
passes the limit). The sampling values are checked on the loop, the prompt is tokenized on a
prompt thread, then the request queues for the one engine thread (``worker.EngineWorker``) in
arrival order. A client that disconnects — streaming or not, running or still queued — sets its job's cancel event;
the engine stops before its next step. The engine's global suffix cache learns from every
request's output, so later requests in the same codebase draft from earlier ones.

SIGTERM (or Ctrl+C) drains the server (``Drain``): every request from then on is a 503, the
requests in flight run on, and once none is left the server exits (status 0 for SIGTERM). Those
still in flight after the grace period (``serve(grace=)``, ``--grace``; or at a second signal) end
at once with a 503 error: a JSON body, or on a stream that has begun an error event and
``[DONE]``.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import socket
import sys
import weakref
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from lookupdec.config import MAX_BATCH, SERVE_GRACE_S, SERVE_MAX_BATCH
from lookupdec.server import protocol
from lookupdec.server.protocol import ChatRequest, CompletionRequest, RequestError, error_body
from lookupdec.server.worker import BatchingWorker, EngineWorker, Job, allocatable_bytes, batch_reservation

log = logging.getLogger("lookupdec.server")


HTTP_BAD_REQUEST = 400
HTTP_UNAUTHORIZED = 401
HTTP_NOT_FOUND = 404
HTTP_TOO_LARGE = 413
HTTP_CLIENT_CLOSED = 499  # nginx's "client closed request": nobody reads it
HTTP_SERVER_ERROR = 500
HTTP_UNAVAILABLE = 503
SSE_DONE = b"data: [DONE]\n\n"
# after the drain (``Drain``): what uvicorn gives the answers still being written (a client that
# does not read its stream) before it cancels them
GRACEFUL_SHUTDOWN_S = 5
DEFAULT_MAX_REQUEST_BYTES = 4 << 20  # 4 MiB: far more than any context holds as text or token ids
API_KEY_ENV = "LOOKUPDEC_API_KEY"
OPEN_PATHS = ("/health",)  # answered without the API key (load balancers, monitoring)


def _json(body: dict, status: int = 200) -> Response:
    return Response(json.dumps(body, separators=(",", ":")), status_code=status, media_type="application/json")


def _sse(body: dict) -> bytes:
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


def _bad_request(exc: RequestError) -> Response:
    return _json(error_body(str(exc), exc.param, exc.code), exc.status)


def http_url(host: str, port: int) -> str:
    """The URL of ``host:port``; an IPv6 address in brackets (``http://[::1]:8000``, RFC 3986)."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _shutting_down(message: str) -> dict:
    return error_body(message, None, "server_shutting_down", "server_error")


REFUSED_BODY = _shutting_down("the server is shutting down and takes no new requests: send it to another "
                              "server, or again once this one has restarted")


class Drain:
    """The server's shutdown, on the loop, in two stages. ``begin``: every request from then on
    is refused (503, by ``RequestGuard``); those admitted before (``active``: admitted and not yet
    fully answered) run on. ``abort`` (past the grace period): each admitted request still
    waiting for its engine job ends at once with a 503 (``_reply``; a stream that has begun: an
    error event, then ``[DONE]``), its job cancelled; a request whose prompt is still being built
    gets the 503 instead of a job. ``wait_idle`` returns once no admitted request is left."""

    def __init__(self, grace: float = SERVE_GRACE_S) -> None:
        self.grace = grace  # (named in the 503 of an aborted request)
        self.draining = self.aborted = False
        self.active = 0
        self.jobs: weakref.WeakSet[Job] = weakref.WeakSet()  # the admitted requests' engine jobs
        self._idle = asyncio.Event()

    def admit(self) -> bool:
        if self.draining:
            return False
        self.active += 1
        self._idle.clear()
        return True

    def leave(self) -> None:
        self.active -= 1
        if not self.active:
            self._idle.set()

    def begin(self) -> None:
        self.draining = True
        if not self.active:
            self._idle.set()

    def abort(self) -> int:
        """End every job still in flight with ("shutdown", None); how many there were. The event
        is queued before the cancel is set, so it comes before whatever the engine thread posts
        on cancelling (a job's earlier events, its pieces or its answer, come first)."""
        self.aborted = True
        jobs = list(self.jobs)
        for job in jobs:
            job.events.put_nowait(("shutdown", None))
            job.cancel.set()
        return len(jobs)

    async def wait_idle(self) -> None:
        await self._idle.wait()

    def aborted_body(self) -> dict:
        return _shutting_down(f"the server is shutting down and this request did not finish within its "
                              f"shutdown grace period ({self.grace:g} s): send it again to another server, "
                              "or once this one has restarted")


class RequestGuard:
    """ASGI middleware in front of the app: the API key (every path but ``OPEN_PATHS``), then
    the body size. The body is read here, at most ``max_request_bytes`` of it, and handed on to
    the app; a larger one is answered 413 at once, and the app never sees it (uvicorn reads the
    rest of that body off the connection and drops it, as it arrives: memory stays flat, and a
    client that sends its whole body before reading still gets the 413 rather than a reset
    connection)."""

    def __init__(self, app, *, api_key: str | None, max_request_bytes: int | None, drain: Drain) -> None:
        self.app, self.max_bytes, self.drain = app, max_request_bytes, drain
        self.api_key = api_key.encode() if api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if not self.drain.admit():  # shutting down: every path, /health too (a load balancer stops routing here)
            return await _send_error(send, HTTP_UNAVAILABLE, REFUSED_BODY, close=True)
        try:  # (the drain waits for this call, which returns once the answer is sent)
            return await self._guarded(scope, receive, send)
        finally:
            self.drain.leave()

    async def _guarded(self, scope, receive, send):
        headers = dict(scope.get("headers") or ())
        if self.api_key is not None and scope.get("path") not in OPEN_PATHS and not self._authorized(headers):
            return await _send_error(send, HTTP_UNAUTHORIZED, error_body(
                "missing or wrong API key: send the header 'Authorization: Bearer KEY' (the server's --api-key)",
                None, "invalid_api_key"), [(b"www-authenticate", b"Bearer")])
        if not self.max_bytes:
            return await self.app(scope, receive, send)
        declared = headers.get(b"content-length")
        if declared is not None:
            try:
                size = int(declared)
            except ValueError:
                size = -1
            if size < 0:
                return await _send_error(send, HTTP_BAD_REQUEST, error_body("bad Content-Length header", None),
                                         close=True)
            if size > self.max_bytes:
                return await self._too_large(send, f" ({size} bytes)")
        body, more = bytearray(), True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left while sending
                return None
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_bytes:
                return await self._too_large(send, "")
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()  # then what the client does next: its disconnect

        return await self.app(scope, replay, send)

    def _authorized(self, headers: dict) -> bool:
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key)

    async def _too_large(self, send, size: str):
        return await _send_error(send, HTTP_TOO_LARGE, error_body(
            f"the request body{size} exceeds this server's limit of {self.max_bytes} bytes "
            "(--max-request-bytes)", None, "request_too_large"))


async def _send_error(send, status: int, body: dict, headers=(), *, close: bool = False) -> None:
    data = json.dumps(body, separators=(",", ":")).encode()
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()), *headers]
    if close:  # the body was not read (or the server is closing): end the connection rather than read the rest
        head.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": data, "more_body": False})


def _server_error(exc: Exception) -> dict:
    body = error_body(f"internal error: {exc.__class__.__name__}: {exc}", None)
    body["error"]["type"] = "server_error"
    return body


async def _cancel_on_disconnect(request: Request, job: Job) -> None:
    """Set the job's cancel event when the client goes away (the body is already read, so the
    next ASGI message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    job.cancel.set()


def _stats(job: Job, generation) -> dict:
    """The ``lookupdec`` object of a response: the engine's statistics, the time waiting for the
    engine thread and the time on it (prompt building and generation)."""
    return generation.stats.to_dict() | {"finish_reason": generation.finish_reason,
                                         "queue_ms": round(job.queue_ms, 3), "engine_ms": round(job.engine_ms, 3)}


class Api:
    """The routes' logic, bound to one worker and model id."""

    def __init__(self, worker: EngineWorker, model_name: str, drain: Drain) -> None:
        self.worker, self.model_name, self.drain = worker, model_name, drain

    async def handle(self, http: Request, body, *, chat: bool) -> Response:
        if body.model and body.model != self.model_name:
            raise RequestError(f"the model {body.model!r} does not exist here; this server serves "
                               f"{self.model_name!r} (GET /v1/models)", "model",
                               status=HTTP_NOT_FOUND, code="model_not_found")
        body.check_values()
        build = self.worker.prompts.chat if chat else self.worker.prompts.completion
        prompt = await self.worker.build(build, body)
        if self.drain.aborted:  # (past the grace period while its prompt was built)
            return _json(self.drain.aborted_body(), HTTP_UNAVAILABLE)
        job = self.worker.submit(prompt, body)
        self.drain.jobs.add(job)
        watcher = asyncio.create_task(_cancel_on_disconnect(http, job))
        try:  # streaming: "start" once the prompt is accepted; otherwise the finished generation
            kind, value = await job.events.get()
        except BaseException:
            job.cancel.set()
            watcher.cancel()
            raise
        rid = protocol.new_id("chatcmpl" if chat else "cmpl")
        if kind == "start":
            return StreamingResponse(self._stream(job, watcher, rid, chat), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        watcher.cancel()
        self.drain.jobs.discard(job)
        return self._reply(kind, value, job, rid, chat)

    def _reply(self, kind: str, value, job: Job, rid: str, chat: bool) -> Response:
        """The whole answer to a non-streaming request, or an error to any request."""
        if kind == "done":
            return _json(self._final(rid, job, value.text, value, chat=chat, chunk=False))
        if kind == "cancelled":
            return _json(error_body("client disconnected before its turn", None), HTTP_CLIENT_CLOSED)
        if kind == "shutdown":
            return _json(self.drain.aborted_body(), HTTP_UNAVAILABLE)
        if isinstance(value, RequestError):
            return _bad_request(value)
        return _json(_server_error(value), HTTP_SERVER_ERROR)

    def _final(self, rid: str, job: Job, text: str, generation, *, chat: bool, chunk: bool) -> dict:
        body = protocol.completion_body(rid, self.model_name, text, generation.finish_reason, chat=chat, chunk=chunk)
        body["usage"] = protocol.usage(job.prompt_tokens, len(generation.token_ids))
        body["lookupdec"] = _stats(job, generation)
        return body

    async def _stream(self, job: Job, watcher: asyncio.Task, rid: str, chat: bool):
        """SSE: text chunks, a last chunk with finish_reason, usage and lookupdec, then [DONE]."""
        finished = False
        try:
            if chat:
                first = protocol.completion_body(rid, self.model_name, "", None, chat=True, chunk=True)
                first["choices"][0]["delta"]["role"] = "assistant"
                yield _sse(first)
            while not finished:
                kind, value = await job.events.get()
                finished = kind != "piece"
                if kind == "piece":
                    yield _sse(protocol.completion_body(rid, self.model_name, value, None, chat=chat, chunk=True))
                elif kind == "done":
                    yield _sse(self._final(rid, job, "", value, chat=chat, chunk=True))
                elif kind == "shutdown":
                    yield _sse(self.drain.aborted_body())
                else:
                    yield _sse(_server_error(value))
            yield SSE_DONE
        finally:  # normal end, or the client left (the response task is cancelled)
            if not finished:
                job.cancel.set()
            watcher.cancel()
            self.drain.jobs.discard(job)


def create_app(engine, model_name: str, *, api_key: str | None = None,
               max_request_bytes: int | None = DEFAULT_MAX_REQUEST_BYTES, openapi: bool = False, max_batch: int = 1,
               grace: float = SERVE_GRACE_S):
    """The OpenAI-compatible app serving ``engine`` under the id ``model_name``, behind
    ``RequestGuard`` (``api_key``: required on every path but /health; ``max_request_bytes``:
    larger bodies are a 413; None or 0: no limit). ``openapi``: also serve ``/openapi.json``.
    No docs pages (/docs, /redoc): FastAPI's load their scripts from a CDN. ``max_batch`` > 1:
    up to that many requests share each verify forward (``BatchingWorker``) where the model can
    batch; else requests run one at a time. ``app.state.drain``: its shutdown (``Drain``;
    ``grace``: the seconds its 503 names)."""
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or not 1 <= max_batch <= MAX_BATCH:
        raise ValueError(f"max_batch={max_batch!r}: expected an integer in [1, {MAX_BATCH}]")
    if max_batch > 1 and not engine.batchable:
        log.warning("max_batch=%d: this model cannot share a forward (no tree masks, or sliding windows): "
                    "requests run one at a time", max_batch)
    worker = BatchingWorker(engine, max_batch) if max_batch > 1 and engine.batchable else EngineWorker(engine)
    drain = Drain(grace)
    api = Api(worker, model_name, drain)

    @asynccontextmanager
    async def lifespan(app):
        yield
        worker.shutdown()

    app = FastAPI(title="lookupdec", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json" if openapi else None)
    app.state.worker, app.state.drain = worker, drain
    app.add_middleware(RequestGuard, api_key=api_key, max_request_bytes=max_request_bytes, drain=drain)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc):
        return _bad_request(protocol.validation_error(exc.errors()))

    @app.exception_handler(RequestError)
    async def _request_error(request, exc):
        return _bad_request(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc):  # unknown path, wrong method: OpenAI's error shape too
        return _json(error_body(f"{request.method} {request.url.path}: {exc.detail}", None), exc.status_code)

    @app.get("/health")
    async def health():
        return _json({"status": "ok", "model": model_name} | worker.health())

    @app.get("/v1/models")
    async def models():
        return _json({"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                                  "owned_by": "lookupdec"}]})

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await api.handle(request, body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        return await api.handle(request, body, chat=True)

    return app


def check_batch_memory(engine, max_batch: int) -> None:
    """``serve``'s start check of the node budget against the batch's K/V memory: a request
    joining the batch reserves its row's slots for ``max_nodes`` tree nodes, in one buffer for
    all ``max_batch`` rows (``worker.batch_reservation``); where that is more than the device can
    allocate, every request would fail, so the server does not start (a ValueError naming
    ``--max-nodes`` and ``--max-batch``, with bounds whose buffer takes at most half of that
    memory: the weights, the forwards and the prefix cache need the rest). One request at a
    time (``max_batch`` 1, or a model that cannot batch) reserves nothing ahead: no check."""
    if max_batch <= 1 or not engine.batchable:
        return
    nodes = engine.config.max_nodes
    need = batch_reservation(engine, max_batch, nodes)
    memory = allocatable_bytes(engine.target.device)
    if need is None or memory is None or need <= memory:
        return
    budget = memory // 2
    low, high = -1, nodes  # the most nodes whose reservation fits the budget: in (low, high]
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if batch_reservation(engine, max_batch, mid) <= budget else (low, mid)
    rows = next((r for r in range(max_batch - 1, 1, -1) if batch_reservation(engine, r, nodes) <= budget), 1)
    fits = f"--max-nodes {low} or less, or " if low >= 1 else ""
    where = "this machine can allocate" if engine.target.device.type == "cpu" else f"{engine.target.device} has free"
    raise ValueError(f"--max-nodes {nodes} with --max-batch {max_batch}: every request would fail, as the batch "
                     f"reserves {need / 2**30:.1f} GiB of K/V memory for its rows' trees, more than the "
                     f"{memory / 2**30:.1f} GiB {where}; use {fits}--max-batch {rows}")


def serve(model: str, *, host: str = "127.0.0.1", port: int = 8000, model_name: str | None = None,
          index=None, draft_model=None, device=None, dtype=None, config=None, log_level: str = "info",
          api_key: str | None = None, max_request_bytes: int | None = DEFAULT_MAX_REQUEST_BYTES,
          openapi: bool = False, max_batch: int = SERVE_MAX_BATCH, grace: float = SERVE_GRACE_S) -> None:
    """Load the engine (never downloads), bind ``host:port`` (0: a free port; an IPv6 address
    with or without brackets) and serve until SIGTERM or Ctrl+C, which drain the server: the
    requests in flight get ``grace`` seconds to finish (``Drain``, ``shutdown.DrainingServer``).
    ``max_batch``: see ``create_app``; a node budget (``config.max_nodes``) whose batch could
    not be allocated is a ValueError (``check_batch_memory``). Prints ``lookupdec: serving NAME
    at URL`` on stderr once listening (``http_url``).
    ``api_key`` (default: ``$LOOKUPDEC_API_KEY``; "" for none): required as a Bearer token on
    every path but /health."""
    import uvicorn

    from lookupdec.engine import Engine
    from lookupdec.server.shutdown import DrainingServer
    from lookupdec.validate import check_device

    check_device(device)  # a one-line error before anything loads
    if api_key is None:
        api_key = os.environ.get(API_KEY_ENV) or None
    if max_request_bytes is not None and max_request_bytes < 0:
        raise ValueError(f"max_request_bytes={max_request_bytes}: must be >= 0 (0: no limit)")
    if not (isinstance(grace, (int, float)) and 0 <= grace < float("inf")):
        raise ValueError(f"grace={grace!r}: expected a number of seconds >= 0")
    if host.startswith("[") and host.endswith("]"):  # an IPv6 address as a URL writes it
        host = host[1:-1]
    engine = Engine.from_pretrained(model, device=device, dtype=dtype, config=config, index=index,
                                    draft_model=draft_model)
    check_batch_memory(engine, max_batch)
    name = model_name or os.path.basename(os.path.normpath(model))
    # proto=IPPROTO_TCP (not 0): asyncio only sets TCP_NODELAY on connections of a socket that
    # says it is TCP; without it a keep-alive client waits out a delayed ACK on every response
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # inherited by accepted connections
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ValueError(f"--host {host} --port {port}: cannot listen ({exc.strerror})") from None
    sock.listen()
    app = create_app(engine, name, api_key=api_key, max_request_bytes=max_request_bytes, openapi=openapi,
                     max_batch=max_batch, grace=grace)
    server = DrainingServer(uvicorn.Config(app, log_level=log_level, access_log=False,
                                           timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S), app.state.drain)
    if not api_key and host not in ("127.0.0.1", "localhost", "::1"):
        print(f"lookupdec: warning: listening on {host} without an API key: anyone who can reach this port "
              f"can use it (--api-key or ${API_KEY_ENV})", file=sys.stderr, flush=True)
    print(f"lookupdec: serving {name} at {http_url(host, sock.getsockname()[1])}"
          + (" (API key required)" if api_key else ""), file=sys.stderr, flush=True)
    server.run(sockets=[sock])
