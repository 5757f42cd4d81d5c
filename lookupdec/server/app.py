"""The FastAPI app: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /health``; and ``serve()``, which loads the engine and runs uvicorn.

Requests queue for the one engine thread (``worker.EngineWorker``) in arrival order. A client
that disconnects — streaming or not, running or still queued — sets its job's cancel event;
the engine stops before its next step. The engine's global suffix cache learns from every
request's output, so later requests in the same codebase draft from earlier ones.
"""
from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from lookupdec.server import protocol
from lookupdec.server.protocol import ChatRequest, CompletionRequest, RequestError, error_body
from lookupdec.server.worker import EngineWorker, Job


HTTP_BAD_REQUEST = 400
HTTP_CLIENT_CLOSED = 499  # nginx's "client closed request": nobody reads it
HTTP_SERVER_ERROR = 500
SSE_DONE = b"data: [DONE]\n\n"
GRACEFUL_SHUTDOWN_S = 5  # on SIGTERM / Ctrl+C: open streams get this long, then the engine is cancelled


def _json(body: dict, status: int = 200) -> Response:
    return Response(json.dumps(body, separators=(",", ":")), status_code=status, media_type="application/json")


def _sse(body: dict) -> bytes:
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


def _bad_request(exc: RequestError) -> Response:
    return _json(error_body(str(exc), exc.param), HTTP_BAD_REQUEST)


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

    def __init__(self, worker: EngineWorker, model_name: str) -> None:
        self.worker, self.model_name = worker, model_name

    async def handle(self, http: Request, body, *, chat: bool) -> Response:
        if body.model and body.model != self.model_name:
            raise RequestError(f"model {body.model!r} is not served here; this server serves "
                               f"{self.model_name!r} (GET /v1/models)", "model")
        build = self.worker.prompts.chat if chat else self.worker.prompts.completion
        job = self.worker.submit(build, body)
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
        return self._reply(kind, value, job, rid, chat)

    def _reply(self, kind: str, value, job: Job, rid: str, chat: bool) -> Response:
        """The whole answer to a non-streaming request, or an error to any request."""
        if kind == "done":
            return _json(self._final(rid, job, value.text, value, chat=chat, chunk=False))
        if kind == "cancelled":
            return _json(error_body("client disconnected before its turn", None), HTTP_CLIENT_CLOSED)
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
                else:
                    yield _sse(_server_error(value))
            yield SSE_DONE
        finally:  # normal end, or the client left (the response task is cancelled)
            if not finished:
                job.cancel.set()
            watcher.cancel()


def create_app(engine, model_name: str) -> FastAPI:
    """The OpenAI-compatible app serving ``engine`` under the id ``model_name``."""
    worker = EngineWorker(engine)
    api = Api(worker, model_name)

    @asynccontextmanager
    async def lifespan(app):
        yield
        worker.shutdown()

    app = FastAPI(title="lookupdec", lifespan=lifespan)
    app.state.worker = worker

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


def serve(model: str, *, host: str = "127.0.0.1", port: int = 8000, model_name: str | None = None,
          index=None, draft_model=None, device=None, dtype=None, config=None, log_level: str = "info") -> None:
    """Load the engine (never downloads), bind ``host:port`` (0: a free port) and serve until
    interrupted. Prints ``lookupdec: serving NAME at http://HOST:PORT`` on stderr once listening."""
    import uvicorn

    from lookupdec.engine import Engine

    engine = Engine.from_pretrained(model, device=device, dtype=dtype, config=config, index=index,
                                    draft_model=draft_model)
    name = model_name or os.path.basename(os.path.normpath(model))
    # proto=IPPROTO_TCP (not 0): asyncio only sets TCP_NODELAY on connections of a socket that
    # says it is TCP; without it a keep-alive client waits ~40 ms per response for a delayed ACK
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # inherited by accepted connections
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ValueError(f"--host {host} --port {port}: cannot listen ({exc.strerror})") from None
    sock.listen()
    server = uvicorn.Server(uvicorn.Config(create_app(engine, name), log_level=log_level, access_log=False,
                                          timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S))
    print(f"lookupdec: serving {name} at http://{host}:{sock.getsockname()[1]}", file=sys.stderr, flush=True)
    server.run(sockets=[sock])
