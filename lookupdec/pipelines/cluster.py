"""``lookupdec rewrite --ray``: the records of one run shared among Ray actors, each holding one
engine; the driver (this process) alone reads the inputs and writes the output file.

Why the driver writes everything: every guarantee of ``ResultsFile`` (each finished record
exactly once, whole lines, ``flock`` against a second run, resumable after a kill) holds as it
does for one process, because only one process ever writes. The workers only compute lines.

How records move::

    driver   pending records, per group (the input file, or --group-by's value), in input order
       │ submit(records)          up to WINDOW x batch records in flight per worker
       ▼
    worker   an inbox -> run_records (the same loop as one process: batched, one engine)
       │ take()                   the lines finished since the last call (blocks up to TAKE_WAIT_S)
       ▼
    driver   write(line) -> the output file, the progress bar, the summary

Cache affinity (``sharding="affinity"``): a group's records go to the worker that took the
group's first record while that worker lives, so each engine's suffix cache learns from
similar records as a single engine's does. A worker with room and no group of its own takes a
new group, else the tail of the group with the most records still pending (no worker idles
while another has a queue). ``sharding="spread"``: records in input order to whichever worker
has room; ``"random"``: the same in a shuffled order (seeded): the comparison points of
``bench/ray_bench.py``.

Faults: a worker that dies (killed, out of memory, its node lost) is seen when its ``take``
fails; its records in flight go back to the front of their groups and another worker (a
replacement, while ``max_restarts`` allows) does them. A record in flight on ``MAX_ATTEMPTS``
dying workers in turn gets an error line (a rerun tries it again): the run always ends, with
every record done or an error line. Ctrl-C (``KeyboardInterrupt``) kills the workers; the file
holds what finished and a rerun resumes.

Outputs equal a single-process run: each record's output depends on its prompt, options and
seed only (exact decoding; a record's seed is derived from its id), never on which worker ran
it or what ran beside it.
"""
from __future__ import annotations

import logging
import os
import queue
import random
import socket
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

from lookupdec.pipelines.inputs import Record
from lookupdec.pipelines.rewrite import error_line, result_line

log = logging.getLogger("lookupdec")

RAY_HINT = 'pip install "lookupdec[ray]"'
SHARDINGS = ("affinity", "spread", "random")
RANDOM_SHARDING_SEED = 0  # sharding="random": the records' order is shuffled with this seed
WINDOW = 2  # records in flight per worker: this many times its batch size (its inbox never runs dry)
TAKE_WAIT_S = 1.0  # a worker's take() returns after this long even with no line finished
MAX_ATTEMPTS = 2  # dying workers a record may be in flight on before it gets an error line
START_TIMEOUT_S = 600.0  # a worker that has not loaded its engine by then is given up


class RayUnavailable(ValueError):
    """``--ray`` without the ``ray`` package (a usage error: one line naming the extra)."""


class RayStartError(ValueError):
    """No Ray worker could start (a model path missing on the nodes, ...): one line, the first reason."""


def import_ray():
    try:
        import ray
    except ImportError:
        raise RayUnavailable(f"--ray needs the ray package: {RAY_HINT}") from None
    return ray


@dataclass(frozen=True)
class EngineSpec:
    """How each worker builds its engine: ``Engine.from_pretrained(model, **kwargs)``. Paths
    that exist here are made absolute (a worker does not share the driver's working folder);
    on a cluster they must exist on every node (the same install, or a shared filesystem)."""

    model: str
    kwargs: dict = field(default_factory=dict)

    @classmethod
    def of(cls, model: str, **kwargs) -> "EngineSpec":
        def absolute(path):
            return os.path.abspath(path) if isinstance(path, str) and os.path.exists(path) else path

        return cls(absolute(model), {k: absolute(v) if k in ("index", "draft_model") else v
                                     for k, v in kwargs.items()})

    def load(self):
        from lookupdec.engine import Engine

        return Engine.from_pretrained(self.model, **self.kwargs)


@dataclass(frozen=True, kw_only=True)
class RayOptions:
    """``--ray [ADDRESS]`` and the ``--ray-*`` flags."""

    address: str | None = None  # None or "auto": ray.init()'s own choice (RAY_ADDRESS, a cluster
    #                             started on this machine, else a new local instance); else a cluster's address
    workers: int | None = None  # None: as many as the cluster's CPUs (and GPUs) hold
    cpus_per_worker: float = 1.0  # Ray resources per worker; also its torch threads (at least 1)
    gpus_per_worker: float = 0.0
    sharding: str = "affinity"  # or "spread", "random" (SHARDINGS)
    max_restarts: int | None = None  # replacement workers for dead ones (None: as many as workers)

    def __post_init__(self) -> None:
        from lookupdec.validate import bad

        if self.workers is not None and (not isinstance(self.workers, int) or self.workers < 1):
            raise bad("ray_workers", self.workers, "expected an integer >= 1")
        for name in ("cpus_per_worker", "gpus_per_worker"):
            if not getattr(self, name) >= 0:  # (NaN too)
                raise bad(f"ray_{name}", getattr(self, name), "expected a number >= 0")
        if self.cpus_per_worker == 0 and self.gpus_per_worker == 0:
            raise bad("ray_cpus_per_worker", 0, "a worker needs some CPUs or GPUs")
        if self.sharding not in SHARDINGS:
            raise bad("ray_sharding", self.sharding, f"expected one of {', '.join(SHARDINGS)}")


# -- the worker (a Ray actor) ------------------------------------------------------------------------
class RewriteWorker:
    """One engine fed from an inbox by ``submit``; ``take`` hands back finished lines. A thread
    runs ``rewrite.run_records`` over the inbox for the worker's whole life, so a batch keeps
    its rows full across ``submit`` calls (continuous batching, as in one process)."""

    def __init__(self, spec: EngineSpec, prompts, options, threads: int) -> None:
        import torch

        from lookupdec.model import release_openmp_threads
        from lookupdec.pipelines.rewrite import resolve_batch_size

        torch.set_num_threads(max(1, threads))
        self.engine = spec.load()
        self.batch = resolve_batch_size(self.engine, options.batch_size)
        release_openmp_threads()  # the loop's thread runs the model, not this one (``model/threads.py``)
        self.inbox: queue.Queue = queue.Queue()
        self.outbox: queue.Queue = queue.Queue()
        self.failure: BaseException | None = None
        self.thread = threading.Thread(target=self._loop, args=(prompts, options), daemon=True,
                                       name="lookupdec-rewrite")
        self.thread.start()

    def ready(self) -> dict:
        return {"pid": os.getpid(), "host": socket.gethostname(), "batch": self.batch}

    def submit(self, records: Sequence[Record]) -> None:
        for record in records:
            self.inbox.put(record)

    def take(self, wait_s: float = TAKE_WAIT_S) -> list[dict]:
        """The lines finished since the last call: waits up to ``wait_s`` for the first one."""
        lines = []
        try:
            lines.append(self.outbox.get(timeout=wait_s))
            while True:
                lines.append(self.outbox.get_nowait())
        except queue.Empty:
            pass
        if not lines and self.failure is not None:  # the loop died: the driver redoes our records elsewhere
            raise RuntimeError(f"the rewrite loop failed: {self.failure!r}")
        return lines

    def _loop(self, prompts, options) -> None:
        from lookupdec.pipelines.rewrite import run_records

        def take(wait: bool):
            try:
                return self.inbox.get() if wait else self.inbox.get_nowait()
            except queue.Empty:
                return None

        try:
            run_records(self.engine, take, prompts, options, self.batch, self.outbox.put)
        except BaseException as exc:  # noqa: BLE001 -- reported by take(); the records go elsewhere
            self.failure = exc


# -- the driver ----------------------------------------------------------------------------------------
class Shards:
    """The records not yet sent, per group, and which worker owns which group (see the module
    docstring). ``sharding="spread"`` / ``"random"``: one queue (input order / shuffled), no owners."""

    def __init__(self, records: Sequence[Record], sharding: str) -> None:
        self.sharding = sharding
        if sharding == "random":
            records = list(records)
            random.Random(RANDOM_SHARDING_SEED).shuffle(records)
        self.order = {r.id: i for i, r in enumerate(records)}
        self.groups: OrderedDict[str, deque] = OrderedDict()
        for record in records:
            self.groups.setdefault(self._key(record), deque()).append(record)
        self.owner: dict[str, int] = {}

    def _key(self, record: Record) -> str:
        return (record.group or "") if self.sharding == "affinity" else ""

    def __len__(self) -> int:
        return sum(len(q) for q in self.groups.values())

    def take(self, worker: int, n: int) -> list[Record]:
        """Up to ``n`` records for ``worker``: its own groups first, then a new group, then the
        tail of the group with the most records pending (one group per call)."""
        out: list[Record] = []
        while len(out) < n:
            key = self._pick(worker)
            if key is None:
                break
            q = self.groups[key]
            stolen = self.owner.get(key, worker) != worker
            while q and len(out) < n:
                out.append(q.pop() if stolen else q.popleft())
            if not q:
                del self.groups[key]
            if stolen:
                out.reverse()  # input order within what this worker takes
                break
        return out

    def _pick(self, worker: int) -> str | None:
        if not self.groups:
            return None
        if self.sharding != "affinity":
            return next(iter(self.groups))
        for key in self.groups:
            if self.owner.get(key) == worker:
                return key
        for key in self.groups:
            if key not in self.owner:
                self.owner[key] = worker
                return key
        return max(self.groups, key=lambda k: len(self.groups[k]))

    def give_back(self, records: Sequence[Record], worker: int) -> None:
        """A dead worker's records in flight go back to the front of their groups, in input
        order; the worker's groups lose their owner (the next worker with room takes them)."""
        for key in [k for k, w in self.owner.items() if w == worker]:
            del self.owner[key]
        for record in sorted(records, key=lambda r: self.order.get(r.id, 0), reverse=True):
            key = self._key(record)
            if key not in self.groups:
                self.groups[key] = deque()
                self.groups.move_to_end(key, last=False)
            self.groups[key].appendleft(record)


@dataclass
class _Worker:
    number: int
    actor: object
    batch: int = 1
    in_flight: dict = field(default_factory=dict)  # record id -> Record
    take_ref: object = None


class RayRewrite:
    """``rewrite(..., cluster=RayRewrite(spec, ray_options))``: ``run`` does the records on Ray
    workers and calls ``write`` with each line, in the driver."""

    def __init__(self, spec: EngineSpec, options: RayOptions, *, on_start: Callable[[dict], None] | None = None):
        self.spec = spec
        self.options = options
        self.on_start = on_start  # called with the workers' ready() dicts once they are up (tests, logs)
        self.ray = import_ray()
        self._actor_class = None

    def run(self, records: Sequence[Record], prompts, options, write) -> tuple[int, int, float]:
        """Every record through the workers; returns (largest batch size, workers that ran records,
        seconds until the first workers were ready: Ray's start and the engines' loads)."""
        for record in records:
            if record.error is not None:  # a record that failed to read: its line, no worker
                write(result_line(None, record, prompts, options))
        records = [r for r in records if r.error is None]
        if not records:
            return 1, 0, 0.0
        ray = self.ray
        start = time.perf_counter()
        started_here = not ray.is_initialized()
        if started_here:
            self._init()
        try:
            return self._run(records, prompts, options, write, start)
        finally:
            if started_here:
                ray.shutdown()

    def _init(self) -> None:
        address = None if self.options.address in (None, "auto") else self.options.address
        self.ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING,
                      configure_logging=True, log_to_driver=True)

    def worker_count(self, records: int) -> int:
        if self.options.workers is not None:
            return min(self.options.workers, records)
        resources = self.ray.cluster_resources()
        fits = []
        if self.options.cpus_per_worker:
            fits.append(int(resources.get("CPU", 0) // self.options.cpus_per_worker))
        if self.options.gpus_per_worker:
            fits.append(int(resources.get("GPU", 0) // self.options.gpus_per_worker))
        count = min(fits)
        if count < 1:
            raise ValueError(f"--ray: the cluster has {resources.get('CPU', 0):g} CPUs and {resources.get('GPU', 0):g} "
                             f"GPUs; a worker asks for {self.options.cpus_per_worker:g} CPUs and "
                             f"{self.options.gpus_per_worker:g} GPUs (--ray-cpus-per-worker, --ray-gpus-per-worker)")
        return min(count, records)

    def _start(self, number: int, prompts, options) -> _Worker:
        if self._actor_class is None:  # max_concurrency 2: take() waits while submit() feeds the inbox
            self._actor_class = self.ray.remote(RewriteWorker).options(
                num_cpus=self.options.cpus_per_worker, num_gpus=self.options.gpus_per_worker, max_concurrency=2)
        threads = int(self.options.cpus_per_worker) or 1
        return _Worker(number, self._actor_class.remote(self.spec, prompts, options, threads))

    def _run(self, records: Sequence[Record], prompts, options, write, start: float) -> tuple[int, int, float]:
        ray = self.ray
        count = self.worker_count(len(records))
        restarts = count if self.options.max_restarts is None else self.options.max_restarts
        shards = Shards(records, self.options.sharding)
        attempts: dict[str, int] = {}
        workers = self._start_workers(count, prompts, options)
        startup = time.perf_counter() - start
        used: set[int] = set()
        number = count
        try:
            while len(shards) or any(w.in_flight for w in workers):
                for w in workers:  # fill every worker's window
                    room = WINDOW * w.batch - len(w.in_flight)
                    batch = shards.take(w.number, room) if room > 0 else []
                    if batch:
                        w.in_flight.update((r.id, r) for r in batch)
                        w.actor.submit.remote(batch)
                    if w.take_ref is None and w.in_flight:
                        w.take_ref = w.actor.take.remote()
                waiting = {w.take_ref: w for w in workers if w.take_ref is not None}
                if not waiting:
                    break
                ready, _ = ray.wait(list(waiting), num_returns=1)
                w = waiting[ready[0]]
                w.take_ref = None
                try:
                    lines = ray.get(ready[0])
                except Exception as exc:  # noqa: BLE001 -- the worker died or its loop failed
                    workers.remove(w)
                    _kill(ray, w.actor)
                    self._lost(w, exc, shards, attempts, write)
                    if restarts > 0 and (len(shards) or any(x.in_flight for x in workers)):
                        restarts -= 1
                        try:
                            workers += self._start_workers(1, prompts, options, first=number)
                        except RayStartError as start_failed:  # the others (if any) go on
                            log.warning("no replacement Ray worker: %s", start_failed)
                        number += 1
                    if not workers:
                        self._give_up(shards, "every Ray worker died", write)
                        break
                    continue
                for line in lines:
                    if w.in_flight.pop(line["id"], None) is not None:
                        used.add(w.number)
                        write(line)
        finally:
            for w in workers:
                _kill(ray, w.actor)
        return max([w.batch for w in workers] or [1]), len(used), startup

    def _start_workers(self, count: int, prompts, options, *, first: int = 0) -> list[_Worker]:
        ray = self.ray
        workers = [self._start(first + i, prompts, options) for i in range(count)]
        refs = {w.actor.ready.remote(): w for w in workers}
        started, failures = [], []
        pending = list(refs)
        deadline = time.monotonic() + START_TIMEOUT_S
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not done:
                failures.append(f"{len(pending)} workers did not start within {START_TIMEOUT_S:.0f} s")
                for ref in pending:
                    _kill(ray, refs[ref].actor)
                break
            w = refs[done[0]]
            try:
                info = ray.get(done[0])
            except Exception as exc:  # noqa: BLE001 -- a worker that cannot load the engine
                failures.append(_reason(exc))
                continue
            w.batch = info["batch"]
            started.append(w)
            log.info("Ray worker %d: pid %s on %s, batches of %d", w.number, info["pid"], info["host"], w.batch)
            if self.on_start is not None:
                self.on_start(dict(info, number=w.number))
        if failures and not started:
            raise RayStartError(f"--ray: no Ray worker could start: {failures[0]}")
        for failure in failures:
            log.warning("a Ray worker did not start: %s", failure)
        return started

    @staticmethod
    def _lost(w: _Worker, exc: Exception, shards: Shards, attempts: dict, write) -> None:
        log.warning("Ray worker %d stopped (%s); its %d records in flight are done again", w.number, _reason(exc),
                    len(w.in_flight))
        again = []
        for rid, record in w.in_flight.items():
            attempts[rid] = attempts.get(rid, 0) + 1
            if attempts[rid] >= MAX_ATTEMPTS:
                write(error_line(record, f"{attempts[rid]} Ray workers stopped while running it "
                                         f"(last: {_reason(exc)})"))
            else:
                again.append(record)
        shards.give_back(again, w.number)
        w.in_flight.clear()

    @staticmethod
    def _give_up(shards: Shards, why: str, write) -> None:
        while len(shards):
            for record in shards.take(-1, len(shards)):
                write(error_line(record, why))


def _reason(exc: BaseException) -> str:
    """Why a worker failed, in one line: the innermost error a Ray error carries, or for a worker
    that failed to start the last line of the traceback it carries (the exception raised in the
    worker, e.g. the model that would not load), else the error's own first line."""
    seen = set()
    inner = exc
    while id(inner) not in seen:
        seen.add(id(inner))
        cause = getattr(inner, "cause", None)
        if not isinstance(cause, BaseException):
            cause = inner.__cause__
        if not isinstance(cause, BaseException):
            break
        inner = cause
    if inner is not exc and not type(inner).__module__.startswith("ray"):
        lines = str(inner).strip().splitlines()
        return f"{type(inner).__name__}: {lines[0]}" if lines else type(inner).__name__
    text = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    if getattr(exc, "actor_init_failed", False) and len(text) > 1:  # its text ends with the worker's traceback
        return text[-1]
    return text[0] if text else type(exc).__name__


def _kill(ray, actor) -> None:
    try:
        ray.kill(actor)
    except Exception:  # noqa: BLE001 -- already gone
        pass
