"""One thread owns the engine: requests run one at a time, in arrival order, and the asyncio
loop stays free to accept, validate and stream.

A request becomes a ``Job``. The engine thread turns it into prompt ids (tokenizer and chat
template are used on that thread only), runs ``Engine.stream`` with the job's ``cancel`` event
and posts events back to the loop: ``("error", exc)`` for a bad request; for a streaming
request ``("start", prompt_tokens)``, ``("piece", text)`` ... and ``("done", Generation)``, for
another only ``("done", Generation)`` (one wake-up of the loop); ``("cancelled", None)`` if the
client left while the job was still queued. Setting ``job.cancel`` (the client disconnected) ends the
generation before its next step and frees the engine for the next job.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from lookupdec.server.prompts import Prompt, PromptBuilder
from lookupdec.server.protocol import RequestError

log = logging.getLogger("lookupdec.server")

# Engine argument -> request field, to name the field in an engine ValueError's 400.
ENGINE_FIELDS = {"max_new_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p",
                 "top_k": "top_k", "repetition_penalty": "repetition_penalty", "stop": "stop", "seed": "seed",
                 "prompt": "prompt"}


def field_of(message: str) -> str | None:
    """The request field an engine ``ValueError`` message is about (it names it first)."""
    hits = [(message.find(name), field) for name, field in ENGINE_FIELDS.items() if name in message]
    return min(hits)[1] if hits else None


class Job:
    """One request's channel between the event loop and the engine thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop, *, streaming: bool) -> None:
        self.streaming = streaming  # post each text piece (else only the finished Generation)
        self.cancel = threading.Event()  # set when the client disconnects
        self.events: asyncio.Queue = asyncio.Queue()
        self.prompt_tokens = 0
        self.submitted = time.perf_counter()
        self.queue_ms = 0.0  # waiting for the engine thread
        self.engine_ms = 0.0  # on the engine thread: prompt building and the whole generation
        self._loop = loop

    def post(self, kind: str, value=None) -> None:
        """From the engine thread: hand an event to the loop."""
        try:
            self._loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the loop is closed: the server is shutting down
            pass


class EngineWorker:
    def __init__(self, engine) -> None:
        self.engine = engine
        self.prompts = PromptBuilder(engine)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lookupdec-engine")
        self._current: Job | None = None
        # counters (each written by one thread only): requests submitted, started by the engine
        # thread, and how the started ones ended
        self.submitted = self.started = 0
        self.ended = {"completed": 0, "cancelled": 0, "failed": 0}

    def submit(self, build: Callable[[object], Prompt], request) -> Job:
        """Queue ``request`` (``build`` makes its prompt on the engine thread); call on the loop."""
        job = Job(asyncio.get_running_loop(), streaming=request.stream)
        self.submitted += 1
        self._executor.submit(self._run, job, build, request)
        return job

    def health(self) -> dict:
        ended = sum(self.ended.values())
        return {"queued": self.submitted - self.started, "running": self.started - ended, **self.ended}

    def shutdown(self) -> None:
        job = self._current
        if job is not None:
            job.cancel.set()
        self._executor.shutdown(wait=True, cancel_futures=True)

    # -- on the engine thread -------------------------------------------------------------------
    def _run(self, job: Job, build, request) -> None:
        self.started += 1
        self._current = job
        job.queue_ms = (time.perf_counter() - job.submitted) * 1e3
        try:
            self.ended[self._generate(job, build, request)] += 1
        except Exception as exc:  # a bug, not a bad request: the client gets a 500, the log a traceback
            log.exception("generation failed")
            job.post("error", exc)
            self.ended["failed"] += 1
        finally:
            self._current = None

    def _generate(self, job: Job, build, request) -> str:
        if job.cancel.is_set():
            job.post("cancelled")
            return "cancelled"
        start = time.perf_counter()
        try:
            prompt = build(request)
            stream = self.engine.stream(prompt.token_ids, cancel=job.cancel,
                                        **request.engine_kwargs(prompt.max_new_tokens))
        except RequestError as exc:
            job.post("error", exc)
            return "failed"
        except ValueError as exc:  # the engine's own checks
            job.post("error", RequestError(str(exc), field_of(str(exc))))
            return "failed"
        job.prompt_tokens = len(prompt.token_ids)
        if job.streaming:
            job.post("start", job.prompt_tokens)
        for piece in stream:
            if job.streaming:
                job.post("piece", piece)
        job.engine_ms = (time.perf_counter() - start) * 1e3
        job.post("done", stream.generation)
        return "cancelled" if stream.generation.finish_reason == "cancelled" else "completed"
