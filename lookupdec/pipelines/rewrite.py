"""Batch rewrite: each record's text goes into a prompt, ONE engine generates every output
(its suffix cache learns from the earlier records: that is the speed-up on repetitive work),
and each result is one JSON line of the output file.

Output lines (``lookupdec.pipelines.results`` makes them whole and unique per id)::

    {"id": ..., "input_hash": ..., "job": ..., "output": TEXT, "finish_reason": "length"|"eos"|"stop",
     "stats": {"new_tokens", "steps", "mean_accepted", "tokens_per_s", "seconds"}}
    {"id": ..., "input_hash": ..., "error": "PATH:LINE: why"}        # a record that failed

Resuming (``plan``): a record whose id already has a result line is skipped; a record whose
id has an error line is done again (its old line is removed first, atomically), as is one
whose line was torn by a kill; the rest are done in input order. So after any sequence of
runs and kills the file holds each record exactly once, and a rerun until exit status 0
leaves no error lines. ``input_hash`` (SHA-256 of the record's text) tells a changed input:
such a record is still skipped (its old output kept), with a warning. ``job`` (``job_id``: the
model's name, the prompt format and the generation options, hashed) tells another job's file:
a run warns of results another job made (kept, as changed inputs are; lines without one,
from before jobs, are taken as this job's).

Batching (``RewriteOptions.batch_size``, ``--batch-size``): up to that many records share each
verify forward (``lookupdec.batch``), a finished record's row going to the next one. Lines are
then written in the order records finish, not input order (the id keys every line, and every
guarantee above is per line). Outputs are the same as one at a time: greedy identical,
sampled identical for the same seed (each record's seed is its own). ``auto`` picks the size
from the learnt verify cost (``auto_batch_size``).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Sequence

from lookupdec.config import MAX_BATCH  # most records per forward (--batch-size)
from lookupdec.model_files import DEFAULT_MODEL  # noqa: F401  (the model when --model is not given)
from lookupdec.pipelines.inputs import Record
from lookupdec.pipelines.results import ResultsFile
from lookupdec.validate import check_unicode

log = logging.getLogger("lookupdec")

DEFAULT_MAX_NEW_TOKENS = 512
TEXT_SLOT, ID_SLOT = "{text}", "{id}"  # the placeholders a --template may hold ({text} required)
OUTPUT_CUE = "Output:\n"  # ends an --instruction prompt: where the model's answer starts
MAX_WARNINGS = 10  # failed records named on stderr before the rest are only counted
SEED_BYTES = 8  # bytes of SHA-256(seed, id) forming a record's seed (kept below 2**63)
STATS_DIGITS = 4  # decimals of the floats in an output line's stats
AUTO_BATCH_SIZES = (1, 2, 4, 8, 16)  # what --batch-size auto chooses from
AUTO_BATCH_GAIN = 1.15  # ... the largest size whose plain-decoding throughput beats half its size's by this


@dataclass(frozen=True)
class PromptFormat:
    """How a record becomes a prompt: ``parts`` joined by the record's text (the template cut
    at each ``{text}``); ``{id}`` in the parts becomes the record's id. Nothing else in a
    template is special (braces of JSON examples stay as they are)."""

    parts: tuple[str, ...]  # at least two: text before the first {text}, ..., text after the last
    strip_text: bool = False  # drop the text's trailing newlines (instruction prompts)
    chat: bool = False  # the prompt is a user message in the model's chat template (--chat)

    @classmethod
    def from_instruction(cls, instruction: str) -> "PromptFormat":
        """``INSTRUCTION``, a blank line, the text (trailing newlines dropped), a blank line,
        ``Output:`` and a newline."""
        if not instruction.strip():
            raise ValueError("--instruction is empty")
        check_unicode("--instruction", instruction)  # (an argument's undecodable byte is a lone surrogate)
        return cls((instruction + "\n\n", "\n\n" + OUTPUT_CUE), strip_text=True)

    def with_chat(self, chat: bool = True) -> "PromptFormat":
        """The same prompts as user messages in the chat template; an instruction prompt drops
        its ``Output:`` cue there (the template marks where the answer starts)."""
        parts = self.parts
        if chat and self.strip_text and parts[-1] == "\n\n" + OUTPUT_CUE:
            parts = parts[:-1] + ("",)
        return PromptFormat(parts, strip_text=self.strip_text, chat=chat)

    @classmethod
    def from_template(cls, template: str, source: str) -> "PromptFormat":
        if TEXT_SLOT not in template:
            raise ValueError(f"{source}: the template has no {TEXT_SLOT} placeholder (where each record's text goes)")
        return cls(tuple(template.split(TEXT_SLOT)))

    @classmethod
    def from_file(cls, path: str) -> "PromptFormat":
        try:
            with open(path, encoding="utf-8") as f:
                template = f.read()
        except OSError as exc:
            raise ValueError(f"--template {path}: {exc.strerror}") from None
        except UnicodeDecodeError:
            raise ValueError(f"--template {path}: not UTF-8 text") from None
        return cls.from_template(template, f"--template {path}")

    def prompt(self, record: Record) -> str:
        text = record.text.rstrip("\n") if self.strip_text else record.text
        return text.join(part.replace(ID_SLOT, record.id) for part in self.parts)

    def engine_prompt(self, engine, record: Record):
        """What ``engine.generate`` takes: the text, or with ``chat`` its chat-template token ids.
        A prompt UTF-8 cannot encode (an ``{id}`` with a lone surrogate) is a ``ParamError``."""
        text = check_unicode("prompt", self.prompt(record))
        return engine.chat_prompt(text) if self.chat else text


@dataclass(frozen=True, kw_only=True)
class RewriteOptions:
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS  # per record; also capped by the model's context
    temperature: float = 0.0  # 0: greedy (identical to plain greedy decoding)
    top_k: int | None = None  # sampling: among the k most likely tokens (``Engine.generate``'s)
    top_p: float | None = None  # sampling: nucleus mass, in (0, 1]
    repetition_penalty: float | None = None  # > 1 discourages repeats (greedy too)
    seed: int | None = None  # sampling: each record's seed is derived from this and its id
    stop: tuple[str, ...] | None = None  # outputs end before the first of these strings
    token_ids: bool = False  # also write the generated token ids in each line
    batch_size: int | str = 1  # records per verify forward; "auto": from the cost curve (auto_batch_size)
    job: str | None = None  # written in every result line (``job_id``): a rerun of another job warns

    def __post_init__(self) -> None:
        """The checks ``Engine.check_request`` runs on these values (``ParamError`` naming the
        field), before any record is read or any model loaded."""
        from lookupdec.validate import check_generation

        from lookupdec.validate import bad

        check_generation(max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_k=self.top_k,
                         top_p=self.top_p, repetition_penalty=self.repetition_penalty, seed=self.seed,
                         stop=self.stop)
        if self.batch_size != "auto" and not (isinstance(self.batch_size, int) and 1 <= self.batch_size <= MAX_BATCH):
            raise bad("batch_size", self.batch_size, f"expected 'auto' or an integer in [1, {MAX_BATCH}]")

    def sampling(self) -> dict:
        """The keywords ``Engine.generate`` and ``BatchRequest`` take for the sampling options."""
        return {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p,
                "repetition_penalty": self.repetition_penalty}

    def record_seed(self, record_id: str) -> int | None:
        """Per record, so that an output does not depend on which records ran before it."""
        if self.seed is None:
            return None
        digest = hashlib.sha256(f"{self.seed}\0{record_id}".encode("utf-8", "surrogatepass")).digest()
        return int.from_bytes(digest[:SEED_BYTES], "big") >> 1


def job_id(model: str, prompts: PromptFormat, options: RewriteOptions) -> str:
    """What a result line depends on besides its record, hashed (16 hex digits): the model's
    name (its folder's, so a moved folder is the same), the prompt format and the generation
    options (not the batch size nor ``token_ids``: outputs are the same)."""
    name = os.path.basename(os.path.normpath(model)) if model else ""
    what = [name, list(prompts.parts), prompts.strip_text, prompts.chat, options.max_new_tokens, options.temperature,
            options.top_k, options.top_p, options.repetition_penalty, options.seed,
            list(options.stop) if options.stop else None]
    text = json.dumps(what, ensure_ascii=True)
    return hashlib.sha256(text.encode("ascii")).hexdigest()[:16]


@dataclass
class Plan:
    to_do: list[Record]  # in input order: new records, torn ones, and failed ones to redo
    redo: list[str]  # ids whose error lines are replaced
    skipped: int  # records with a result line already
    changed: list[str] = field(default_factory=list)  # skipped ids whose input hash differs
    moved: int = 0  # when no id matches the output's: to-do records whose text has a result there
    other_job: list[int] = field(default_factory=list)  # lines of results another job made (``job_id``)

    @property
    def needs_model(self) -> bool:
        return any(r.error is None for r in self.to_do)


def plan(records: Sequence[Record], results: ResultsFile, job: str | None = None) -> Plan:
    """What a run over ``records`` has to do, given the lines already in ``results``; results
    there that another ``job`` made (``job_id``: another model, prompt or generation option)
    are kept and counted in ``other_job`` (a warning: rerunning with another prompt to redo the
    records that failed is a use)."""
    out = Plan(to_do=[], redo=[], skipped=0)
    out.other_job = [e.line for e in results.entries.values() if e.ok and job and e.job and e.job != job]
    for record in records:
        entry = results.entries.get(record.id)
        if entry is not None and entry.ok:
            out.skipped += 1
            if entry.input_hash != record.input_hash:
                out.changed.append(record.id)
            continue
        if entry is not None:
            out.redo.append(record.id)
        out.to_do.append(record)
    if results.entries and not out.skipped and not out.redo:  # no id matches: were the ids renamed?
        hashes_done = {e.input_hash for e in results.entries.values() if e.ok}
        out.moved = sum(r.input_hash in hashes_done for r in out.to_do)
    return out


@dataclass
class RewriteSummary:
    records: int = 0  # records in the input (after --limit)
    skipped: int = 0  # already done in the output, left as they are
    done: int = 0  # results written by this run
    failed: int = 0  # error lines written by this run
    new_tokens: int = 0
    steps: int = 0  # target forwards
    seconds: float = 0.0  # the run's wall time (records in a batch overlap)
    batch_size: int = 1  # records per forward (--batch-size, resolved; with Ray, the largest of any worker)
    workers: int = 0  # Ray workers that ran records (0: this process alone)
    startup_seconds: float = 0.0  # of ``seconds``: Ray's start and the workers' engine loads
    output: str = ""

    @property
    def missing(self) -> int:
        """Records of the input with no line from this run nor an earlier one (0 unless a bug lost
        them: a run again does them)."""
        return max(0, self.records - self.skipped - self.done - self.failed)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0

    @property
    def mean_accepted(self) -> float:
        return self.new_tokens / self.steps if self.steps else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "tokens_per_s": self.tokens_per_s, "mean_accepted": self.mean_accepted}

    def line(self) -> str:
        return (f"{self.done} records rewritten, {self.failed} failed, {self.skipped} already done "
                f"(of {self.records}); {self.new_tokens} tokens in {self.seconds:.1f} s, "
                f"{self.tokens_per_s:.1f} tokens/s, {self.mean_accepted:.2f} tokens/step"
                + (f", batches of {self.batch_size}" if self.batch_size > 1 else "")
                + (f", on {self.workers} Ray workers (started in {self.startup_seconds:.1f} s)" if self.workers else "")
                + f" -> {self.output}")


def rewrite(engine, work: Plan, prompts: PromptFormat, results: ResultsFile, options: RewriteOptions, *,
            records: int | None = None, progress: bool = False, cluster=None) -> RewriteSummary:
    """Do ``work`` (from ``plan``) with ``engine``, appending one line per record to ``results``;
    or with ``cluster`` (a ``pipelines.cluster.RayRewrite``), whose workers each hold an engine
    (``engine`` is then None, as it may be when ``not work.needs_model``). ``records``: the
    input's size, for the progress bar and summary (default: to-do + skipped)."""
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    _warn_plan(work, results.path)
    results.drop(work.redo)
    total = records if records is not None else len(work.to_do) + work.skipped
    summary = RewriteSummary(records=total, skipped=work.skipped, output=results.path)
    batch = resolve_batch_size(engine, options.batch_size) if work.needs_model and cluster is None else 1
    # rows reserve K/V memory: never more than the records to decode (an input error takes none)
    batch = max(1, min(batch, sum(1 for record in work.to_do if record.error is None)))
    start = time.perf_counter()
    with tqdm(total=total, initial=work.skipped, unit="rec", desc="rewrite", disable=not progress,
              dynamic_ncols=True) as bar, (logging_redirect_tqdm() if progress else contextlib.nullcontext()):
        def write(line: dict) -> None:
            results.append(line)
            _count(summary, line)
            summary.seconds = time.perf_counter() - start
            bar.update(1)
            bar.set_postfix_str(f"{summary.tokens_per_s:.0f} tok/s, {summary.mean_accepted:.2f} tok/step"
                                + (f", {summary.failed} failed" if summary.failed else ""), refresh=False)

        if cluster is not None and work.needs_model:
            batch, summary.workers, summary.startup_seconds = cluster.run(work.to_do, prompts, options, write)
        else:
            todo = iter(work.to_do)
            run_records(engine, lambda wait: next(todo, None), prompts, options, batch, write)
    summary.seconds = time.perf_counter() - start
    summary.batch_size = batch
    if summary.failed > MAX_WARNINGS:
        log.warning("... and %d more failed records (their lines in %s say why)", summary.failed - MAX_WARNINGS,
                    results.path)
    return summary


def resolve_batch_size(engine, batch_size: int | str) -> int:
    """``batch_size``, or for ``"auto"`` the one ``auto_batch_size`` reads off the engine's cost
    curve (1 where the model cannot batch)."""
    if not engine.batchable:  # (run_records goes one at a time whatever the size)
        return 1
    if batch_size != "auto":
        return int(batch_size)
    return auto_batch_size(engine.cost_model())


def auto_batch_size(cost) -> int:
    """The largest size in ``AUTO_BATCH_SIZES`` whose plain-decoding throughput, size / t(size),
    is at least ``AUTO_BATCH_GAIN`` times that of half its size: beyond it, rows cost nearly
    what they bring. One row's curve of n tokens stands for n rows of one token.

    >>> from lookupdec.budget import CostModel
    >>> auto_batch_size(CostModel([1, 2, 4, 8, 16], [1.0, 1.0, 1.1, 1.3, 2.5]))
    8
    """
    dense = cost.dense(max(AUTO_BATCH_SIZES))
    best = 1
    for size in AUTO_BATCH_SIZES[1:]:
        if size / dense[size] >= AUTO_BATCH_GAIN * (size // 2) / dense[size // 2]:
            best = size
        else:
            break
    return best


def _rewrite_batched(engine, take, prompts: PromptFormat, options: RewriteOptions, batch: int, write) -> None:
    """Records from ``take`` through a ``BatchDecoder`` of ``batch`` rows, each line written as its
    record finishes. ``take(wait)`` gives the next record, or None: none yet (``wait`` False: the
    batch goes on with the rows it has) or none ever (``wait`` True, asked only when the batch is
    empty: the loop ends). A record the engine rejects gets its error line; if a batched step
    itself fails, the records in flight are done again one at a time (their lines say what
    failed, if it fails again)."""
    from lookupdec.batch import BatchDecoder, BatchRequest

    decoder = BatchDecoder(engine, batch)
    started: dict[int, float] = {}
    while True:
        while len(decoder.waiting) + len(decoder.active) < batch:
            record = take(decoder.idle)
            if record is None:
                break
            if record.error is not None:
                write(result_line(engine, record, prompts, options))
                continue
            try:
                index = decoder.submit(BatchRequest(
                    prompts.engine_prompt(engine, record), options.max_new_tokens, **options.sampling(),
                    seed=options.record_seed(record.id), stop=list(options.stop) if options.stop else None,
                    tag=record))
            except Exception as exc:  # noqa: BLE001 -- as result_line: the record's line says why
                write(_error_line(record, exc))
                continue
            started[index] = time.perf_counter()
        if decoder.idle:
            return
        failed = False
        try:
            decoder.step()
        except Exception:  # noqa: BLE001 -- redo what was in flight alone: a failure then names its record
            log.warning("a batched step failed; its records still running are done one at a time",
                        exc_info=log.isEnabledFor(logging.DEBUG))
            failed = True
        for seq in decoder.ended_in_step:  # (what the step returns; whole even where it raised later)
            gen = decoder.generation(seq)
            write(_result(seq.request.tag, gen, time.perf_counter() - started.pop(seq.index), options))
        alone = [seq for seq, _ in decoder.failed_in_step]  # (their prefill failed as they joined)
        if failed:
            alone += decoder.abandon()
            decoder = BatchDecoder(engine, batch)
        for seq in alone:
            started.pop(seq.index, None)
            write(result_line(engine, seq.request.tag, prompts, options))


def run_records(engine, take, prompts: PromptFormat, options: RewriteOptions, batch: int, write) -> None:
    """Every record ``take`` gives (see ``_rewrite_batched``) through ``engine``, one line each to
    ``write``: batched when ``batch`` > 1 and the engine can batch, else one at a time. The loop
    of a single-process run and of each Ray worker (``pipelines.cluster``)."""
    if batch > 1 and engine.batchable:
        _rewrite_batched(engine, take, prompts, options, batch, write)
        return
    while (record := take(True)) is not None:
        write(result_line(engine, record, prompts, options))


def error_line(record: Record, why: str) -> dict:
    """A failed record's output line: ``why`` after the record's ``PATH:LINE``."""
    return {"id": record.id, "input_hash": record.input_hash, "error": f"{record.where}: {why}"}


def _error_line(record: Record, exc: Exception) -> dict:
    log.debug("record %s failed", record.id, exc_info=True)
    return error_line(record, str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}")


def _result(record: Record, gen, seconds: float, options: RewriteOptions) -> dict:
    stats = gen.stats
    line = {"id": record.id, "input_hash": record.input_hash, **({"job": options.job} if options.job else {}),
            "output": gen.text, "finish_reason": gen.finish_reason,
            "stats": {"new_tokens": stats.new_tokens, "steps": stats.steps,
                      "mean_accepted": round(stats.mean_accepted, STATS_DIGITS),
                      "tokens_per_s": round(stats.new_tokens / seconds, STATS_DIGITS) if seconds else 0.0,
                      "seconds": round(seconds, STATS_DIGITS)}}
    if options.token_ids:
        line["token_ids"] = gen.token_ids
    return line


def result_line(engine, record: Record, prompts: PromptFormat, options: RewriteOptions) -> dict:
    """The output line for one record: its result, or the error that stopped it."""
    base = {"id": record.id, "input_hash": record.input_hash}
    if record.error is not None:
        return {**base, "error": record.error}
    start = time.perf_counter()
    try:
        gen = engine.generate(prompts.engine_prompt(engine, record), max_new_tokens=options.max_new_tokens,
                              **options.sampling(), seed=options.record_seed(record.id),
                              stop=list(options.stop) if options.stop else None)
    except Exception as exc:  # noqa: BLE001 -- a failed record is reported in its line; the run goes on
        return _error_line(record, exc)
    return _result(record, gen, time.perf_counter() - start, options)


def _count(summary: RewriteSummary, line: dict) -> None:
    if "error" in line:
        summary.failed += 1
        if summary.failed <= MAX_WARNINGS:
            log.warning("%s", line["error"])
        return
    summary.done += 1
    summary.new_tokens += line["stats"]["new_tokens"]
    summary.steps += line["stats"]["steps"]


def _warn_plan(work: Plan, path: str) -> None:
    if work.other_job:
        log.warning("%d results in %s were made by another job (another --model, prompt or generation option "
                    "than this run's; e.g. line %d); they are kept: remove their lines (or choose another --output) "
                    "to redo them", len(work.other_job), path, min(work.other_job))
    if work.changed:
        log.warning("%d records already in %s have another text now (e.g. id %r); their old output is kept: "
                    "remove their lines (or choose another --output) to redo them", len(work.changed), path,
                    work.changed[0])
    if work.moved:
        log.warning("%d records to do have the same text as results in %s under other ids (were the inputs "
                    "renamed, or named by another path?); they are done again", work.moved, path)
