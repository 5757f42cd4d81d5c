"""One thread owns the engine: requests run one at a time, in arrival order, and the asyncio
loop stays free to accept, validate and stream.

A request's prompt is built first (tokenizer, chat template, FIM) on a small pool of prompt
threads, each with its own copy of the tokenizer, so that tokenizing one large prompt stalls
neither the engine nor the loop. The prompt then becomes a ``Job`` queued for the engine thread,
which runs ``Engine.stream`` with the job's ``cancel`` event and posts events back to the loop:
``("error", exc)`` for a bad request; for a streaming request ``("start", prompt_tokens)``,
``("piece", text)`` ... and ``("done", Generation)``, for another only ``("done", Generation)``
(one wake-up of the loop); ``("cancelled", None)`` if the client left while the job was still
queued. Setting ``job.cancel`` (the client disconnected) ends the generation before its next step
and frees the engine for the next job. The counters of ``/health`` are updated before a job's
last event is posted, so a client that has its answer never sees its request still running.

``BatchingWorker`` (``serve --max-batch N``, N > 1; 8 by default) replaces the one-at-a-time
engine thread by a loop over a ``BatchDecoder`` (``lookupdec.batch``): requests join the running
batch at step boundaries while rows are free and leave it when done, each with its own sampling
values, seed, stop strings and cancel event (checked before every step); pieces are posted as
each step produces them. The events, counters and stats are the same; ``/health`` adds the running batch.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from lookupdec.server.prompts import Prompt, PromptBuilder
from lookupdec.server.protocol import RequestError
from lookupdec.validate import ParamError

log = logging.getLogger("lookupdec.server")

PROMPT_THREADS = 2  # prompts tokenized at once (one large prompt does not hold up the others)

# Engine argument (ParamError.field) -> request field, to name the field in the 400.
ENGINE_FIELDS = {"max_new_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p",
                 "top_k": "top_k", "repetition_penalty": "repetition_penalty", "stop": "stop", "seed": "seed",
                 "prompt": "prompt"}


def request_error(exc: ParamError, request=None) -> RequestError:
    """An engine ``ParamError`` as a 400 naming the request's field (``.field`` mapped to the
    wire name: ``max_new_tokens`` is ``max_tokens``, or ``max_completion_tokens`` when a chat
    request gave that; a chat request's prompt is its ``messages``)."""
    param = ENGINE_FIELDS.get(exc.field, exc.field)
    if request is not None and hasattr(request, "messages"):
        if param == "prompt":
            param = "messages"
        elif param == "max_tokens" and getattr(request, "max_completion_tokens", None) is not None:
            param = "max_completion_tokens"
    return RequestError(str(exc), param)


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
        from lookupdec.model import release_openmp_threads

        self.engine = engine
        self.prompts = PromptBuilder(engine)
        # the thread making the app (serve's main thread: it loaded the model, then runs the event
        # loop) lets its OpenMP workers go, else the engine thread's workers sleep between
        # operators and a client alone waits longer for every token (``model/threads.py``)
        release_openmp_threads()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lookupdec-engine")
        self._prompt_executor = ThreadPoolExecutor(max_workers=PROMPT_THREADS, thread_name_prefix="lookupdec-prompt")
        self._current: Job | None = None
        # counters (each written by one thread only): requests submitted, started by the engine
        # thread, and how the started ones ended
        self.submitted = self.started = 0
        self.ended = {"completed": 0, "cancelled": 0, "failed": 0}

    async def build(self, build: Callable[[object], Prompt], request) -> Prompt:
        """The request's prompt, built on a prompt thread (raises ``RequestError``)."""
        return await asyncio.get_running_loop().run_in_executor(self._prompt_executor, build, request)

    def submit(self, prompt: Prompt, request) -> Job:
        """Queue ``request`` with its built ``prompt`` for the engine thread; call on the loop."""
        job = Job(asyncio.get_running_loop(), streaming=request.stream)
        self.submitted += 1
        self._executor.submit(self._run, job, prompt, request)
        return job

    def health(self) -> dict:
        ended = sum(self.ended.values())
        return {"queued": self.submitted - self.started, "running": self.started - ended, **self.ended,
                "batch": {"running": int(self._current is not None), "max": 1},
                "prefix_cache": self.engine.target.prefixes.report()}

    def shutdown(self) -> None:
        job = self._current
        if job is not None:
            job.cancel.set()
        self._prompt_executor.shutdown(wait=False, cancel_futures=True)
        self._executor.shutdown(wait=True, cancel_futures=True)

    # -- on the engine thread -------------------------------------------------------------------
    def _run(self, job: Job, prompt: Prompt, request) -> None:
        self.started += 1
        self._current = job
        job.queue_ms = (time.perf_counter() - job.submitted) * 1e3
        try:
            outcome, event = self._generate(job, prompt, request)
        except Exception as exc:  # a bug, not a bad request: the client gets a 500, the log a traceback
            log.exception("generation failed")
            outcome, event = "failed", ("error", exc)
        self._current = None
        self.ended[outcome] += 1  # before the last event: once answered, a request is not "running"
        job.post(*event)

    def _generate(self, job: Job, prompt: Prompt, request) -> tuple[str, tuple]:
        """Runs the job; returns (outcome counter, the job's last event, still to post)."""
        if job.cancel.is_set():
            return "cancelled", ("cancelled", None)
        start = time.perf_counter()
        try:
            stream = self.engine.stream(prompt.token_ids, cancel=job.cancel,
                                        **request.engine_kwargs(prompt.max_new_tokens))
        except ParamError as exc:  # the engine's own checks, naming the field
            return "failed", ("error", request_error(exc, request))
        except ValueError as exc:  # an unnamed bad value: still the client's (400), not a 500
            return "failed", ("error", RequestError(str(exc), None))
        job.prompt_tokens = len(prompt.token_ids)
        if job.streaming:
            job.post("start", job.prompt_tokens)
        for piece in stream:
            if job.streaming:
                job.post("piece", piece)
        job.engine_ms = (time.perf_counter() - start) * 1e3
        generation = stream.generation
        return ("cancelled" if generation.finish_reason == "cancelled" else "completed"), ("done", generation)


def batch_reservation(engine, rows: int, max_nodes: int) -> int | None:
    """Bytes of K/V memory that ``rows`` batch rows with the node budget ``max_nodes`` take as
    the smallest request joins (a one-token prompt, one new token), or None where the model's
    config does not say its K/V shape. The batch's K/V buffer is ``[layers, 2, rows, kv heads,
    capacity, head dim]`` for all ``rows`` at once (``model/cache.py``, ``BatchStore.reserve``),
    and a joining row reserves room for its tokens and the widest tree, ``max_nodes + 1`` slots
    (``BatchDecoder._room``): whatever its request, a row needs ``max_nodes + 3`` slots, grown
    by ``GROWTH``. (The rule mirrors those two; where they change, this changes with them.)"""
    from lookupdec.model.cache import GROWTH, INITIAL_SLOTS

    target = engine.target
    text = target.config.get_text_config(decoder=True)
    heads = getattr(text, "num_attention_heads", None)
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or (text.hidden_size // heads if heads else None)
    if not (target.num_layers and kv_heads and head_dim):
        return None
    capacity = max(INITIAL_SLOTS, int((max_nodes + 3) * GROWTH))
    return target.num_layers * 2 * rows * kv_heads * capacity * head_dim * target.dtype.itemsize


def allocatable_bytes(device) -> int | None:
    """The largest allocation ``device`` can grant (None: unknown, or unbounded): a GPU's free
    memory; on Linux the physical memory and swap (what the kernel's overcommit heuristic
    refuses beyond; with overcommit off, the commit limit left)."""
    import torch

    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if device.type != "cpu":
        return None
    try:
        with open("/proc/sys/vm/overcommit_memory") as f:
            mode = f.read().strip()
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.split()[1:]}
    except (OSError, ValueError, IndexError):
        return None
    if mode == "1":  # always overcommit: no allocation is refused
        return None
    if mode == "2":
        return info.get("CommitLimit", 0) - info.get("Committed_AS", 0)
    return info.get("MemTotal", 0) + info.get("SwapTotal", 0) or None


class BatchingWorker(EngineWorker):
    """Continuous batching: one engine thread steps a ``BatchDecoder`` of up to ``max_batch`` rows."""

    IDLE_WAIT_S = 0.05  # the engine thread's wait for a request when nothing runs

    def __init__(self, engine, max_batch: int) -> None:
        super().__init__(engine)
        self.max_batch = max_batch
        self._incoming: queue.Queue = queue.Queue()
        self._stopping = threading.Event()
        self._jobs: dict[int, tuple[Job, object, float]] = {}  # decoder index -> (job, request, start)
        self.batch_rows = 0  # sequences in the last step (/health)
        self._thread = threading.Thread(target=self._loop, name="lookupdec-engine", daemon=True)
        self._thread.start()

    def submit(self, prompt: Prompt, request) -> Job:
        job = Job(asyncio.get_running_loop(), streaming=request.stream)
        self.submitted += 1
        self._incoming.put((job, prompt, request))
        return job

    def health(self) -> dict:
        return {**super().health(), "batch": {"running": self.batch_rows, "max": self.max_batch}}

    def shutdown(self) -> None:
        self._stopping.set()
        for job, _, _ in list(self._jobs.values()):
            job.cancel.set()
        self._prompt_executor.shutdown(wait=False, cancel_futures=True)
        self._thread.join()
        self._executor.shutdown(wait=False)

    # -- on the engine thread -------------------------------------------------------------------
    def _loop(self) -> None:
        from lookupdec.batch import BatchDecoder

        decoder = BatchDecoder(self.engine, self.max_batch)
        while not self._stopping.is_set():
            self._take(decoder, block=decoder.idle)
            if decoder.idle:
                continue
            error = None
            try:
                decoder.step()
            except Exception as exc:  # a bug, not a bad request: every request in flight gets a 500
                log.exception("batched generation failed")
                error = exc
            for seq, exc in decoder.failed_in_step:  # (its prompt's prefill failed: the others went on)
                log.error("a request's prefill failed as it joined the batch", exc_info=exc)
                self._end(seq.index, "failed", ("error", exc))
            finished = decoder.ended_in_step  # (what the step returns; whole even where it raised later)
            self.batch_rows = len(decoder.active) + len(finished)
            self._answer(decoder, finished)
            if error is not None:
                for seq in decoder.abandon():
                    self._end(seq.index, "failed", ("error", error))
                decoder = BatchDecoder(self.engine, self.max_batch)
            if decoder.idle:
                self.batch_rows = 0
        for index in list(self._jobs):  # shutting down: whatever still runs is cancelled
            self._end(index, "cancelled", ("cancelled", None))

    def _answer(self, decoder, finished) -> None:
        for seq in finished:
            generation = decoder.generation(seq)
            job = self._jobs[seq.index][0]
            job.engine_ms = (time.perf_counter() - self._jobs[seq.index][2]) * 1e3
            self._end(seq.index, "cancelled" if generation.finish_reason == "cancelled" else "completed",
                      ("done", generation))

    def _take(self, decoder, *, block: bool) -> None:
        """Move queued requests into the decoder while rows are free (waiting up to
        ``IDLE_WAIT_S`` for the first one if ``block``)."""
        from lookupdec.batch import BatchRequest

        while len(decoder.active) + len(decoder.waiting) < self.max_batch:
            try:
                job, prompt, request = self._incoming.get(timeout=self.IDLE_WAIT_S) if block \
                    else self._incoming.get_nowait()
            except queue.Empty:
                return
            block = False
            self.started += 1
            job.queue_ms = (time.perf_counter() - job.submitted) * 1e3
            if job.cancel.is_set():
                self.ended["cancelled"] += 1
                job.post("cancelled", None)
                continue
            kwargs = request.engine_kwargs(prompt.max_new_tokens)
            on_text = (lambda piece, job=job: job.post("piece", piece)) if job.streaming else None
            try:
                index = decoder.submit(BatchRequest(prompt.token_ids, cancel=job.cancel, on_text=on_text, **kwargs))
            except ParamError as exc:
                self.ended["failed"] += 1
                job.post("error", request_error(exc, request))
                continue
            except ValueError as exc:
                self.ended["failed"] += 1
                job.post("error", RequestError(str(exc), None))
                continue
            except Exception as exc:  # (out of memory): this request's 500; the engine thread goes on
                log.exception("request failed as it joined the batch")
                self.ended["failed"] += 1
                job.post("error", exc)
                continue
            self._jobs[index] = (job, request, time.perf_counter())
            job.prompt_tokens = len(prompt.token_ids)
            if job.streaming:
                job.post("start", job.prompt_tokens)

    def _end(self, index: int, outcome: str, event: tuple) -> None:
        job = self._jobs.pop(index)[0]
        self.ended[outcome] += 1  # before the last event: once answered, a request is not "running"
        job.post(*event)
