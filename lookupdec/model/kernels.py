"""How the engine's own forwards are computed on CPU: the same products, in faster forms.

On CPU a verify forward of a few tokens is far from its fastest under the kernels
``torch.nn.functional.linear`` reaches for, and which form is fastest depends on the machine,
the row count and the thread count (the measurements behind this:
docs/design/measurements-from-comments.md):

- **Body** (``PackedLinears``). The 210 linear layers of the 30 blocks with weights prepacked
  once in oneDNN's blocked layout (``torch.ops.mkldnn._reorder_linear_weight``) and multiplied
  with ``torch.ops.mkldnn._linear_pointwise``, whose cost grows more slowly with the rows than
  ``F.linear``'s; but on some machines, and at two threads, plain ``F.linear`` beats it for
  few rows. So, like the head, the body takes whichever form was faster for the forward's token
  count (bucket) and thread count (a third form since, the compiled core's skinny product:
  ``PackedLinears``): the first forwards of a
  bucket alternate, timed whole, ``FORM_TRIALS`` of each (what the head's own trials took in
  them not counted), then the faster is kept; from then on the chosen form is timed, and
  checked against the other, on one linear layer in ``PROBE_SHARE`` alone
  (``PackedLinears.chosen``). The packed copies take as much memory as the weights they copy,
  so models whose linear weights exceed ``PACKED_MAX_BYTES`` are left as they are.
- **Head** (``FastHead``). The output projection (49,152 x 576, a sixth of SmolLM2) in
  whichever of five forms was fastest for that number of rows: ``F.linear``; ``x @ W^T``
  with ``W^T`` stored; ``(W @ x^T)^T``; the prepacked oneDNN product; the compiled core's
  skinny product (as the body's, at most ``SKINNY_MAX_ROWS`` rows). Which one wins depends on
  the rows (``F.linear`` seldom does). The first calls with a
  row count (bucket) try each form in turn on the real input, ``FORM_TRIALS`` times each, timing
  them; from then on the fastest computes that bucket. (Timing every form on a random input
  the first time a bucket occurred put every trial's whole cost into a process's first
  requests' latency.) The transposed and packed
  copies of the weight are made once (``prepare``, kept out of the engine's cost timings).

Every form computes the same float32 sums up to rounding (tests/model/test_kernels.py). ``swapped``
puts them in for the duration of ``TargetModel``'s own forwards only, so the model object it
was handed behaves as before everywhere else (e.g. ``transformers.generate`` on the same model
in a benchmark). Greedy identity with ``transformers`` is tested as everywhere
(``tests/system/test_real_model.py``, ``tests/system/test_greedy_identity.py``).
"""
from __future__ import annotations

import bisect
import collections
import contextlib
import functools
import logging
import math
import os
import sys
import threading
import time
import typing
import weakref

import numpy as np
import torch
import torch.nn.functional as F

from lookupdec.native import kernels as native_kernels  # the compiled kernels, None where not built
from lookupdec.reference import model as reference_model

log = logging.getLogger("lookupdec")

# the head's: F.linear; x @ (W^T stored); (W @ x^T)^T; oneDNN prepacked; the core's skinny product
FORMS = ("linear", "transposed", "right", "packed", "skinny")
BODY_FORMS = ("packed", "skinny", "linear")  # the body's linears: oneDNN prepacked, the core's skinny product, nn.Linear
FORM_TRIALS = 2  # timed calls of each form per row bucket before the fastest is kept
PROBE_SHARE = 10  # the body's chosen form is timed, and checked, on one linear layer in this many
PACK_ROWS = 16  # the row count oneDNN's weight layout is prepacked for (one layout serves every row count)
PACKED_MAX_BYTES = 4 << 30  # linear weights beyond this are not copied (the copy doubles their memory)


def packed_available() -> bool:
    """oneDNN's prepacked linear product is in this torch build."""
    try:
        return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    except (AttributeError, RuntimeError):
        return False


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] in oneDNN's blocked layout, for ``packed_linear``."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS)


def packed_linear(flat: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(flat, W, bias)`` for 2D ``flat`` with ``packed = pack(W)``."""
    return torch.ops.mkldnn._linear_pointwise(flat, packed, bias, "none", [], "")


EXACT_BUCKETS = 16  # row counts up to this are their own bucket; beyond, powers of 2


def _bucket(rows: int) -> int:
    if rows <= EXACT_BUCKETS:
        return rows
    return 1 << (rows - 1).bit_length()


_TRIAL_EXCESS = [0.0]  # every FastHead's trial excess so far: a body trial does not count the head's


def _record_trial(trials: dict, choice: dict, key, form: str, seconds: float, forms) -> float:
    """Record a timed trial of ``form`` for ``key``; once every form has ``FORM_TRIALS``, the
    fastest becomes ``choice[key]``. Returns what this trial took beyond the best form so far."""
    tried = trials.setdefault(key, {})
    best = min((min(t) for t in tried.values()), default=seconds)
    tried.setdefault(form, []).append(seconds)
    if all(len(tried.get(f, ())) >= FORM_TRIALS for f in forms):
        choice[key] = min(forms, key=lambda f: min(tried[f]))
        del trials[key]
    return max(0.0, seconds - best)


RECHECK_FIRST = 16  # calls of a bucket after its choice (or a switch) before another form is timed again
INHERITED_CHECK = 4  # calls of a bucket that took its nearest bucket's choice before its first check
RECHECK_MARGIN = 0.97  # another form takes over when its call took less than this x the chosen's fastest
# A bucket's check against the rest of the same forward: the machine's speed drifts over
# seconds, and neighbouring forwards share its level (bench/chain_curve.py), so a check's one
# call, made whenever the check falls due, against the chosen form's fastest call since the last
# check (made in the fastest moment of many) lost to the level, not to the form: a slower form
# kept its buckets for good, every failed check doubling the wait for the next. The body's probe
# layers are timed against the rest of their own forward (``FormChooser.record``'s
# ``reference``): milliseconds apart, at one speed.
RECENT_CALLS = 8  # the chosen form's last calls (probe over the rest of the forward) a check is held against


def check_group(key) -> tuple:
    """The group of buckets ``(rows, threads)`` whose checks share one schedule (``FormChooser``):
    row buckets of the same bit length at the same thread count (1; 2-3; 4-7; 8-15; 16; 32; ...).

    >>> [check_group((rows, 1))[0] for rows in (1, 3, 4, 7, 8, 16, 32)]
    [1, 2, 3, 3, 4, 5, 6]
    """
    rows, threads = key
    return (rows.bit_length(), threads)


class _Watch:
    """When a group of buckets checks its chosen forms again (``FormChooser``)."""

    __slots__ = ("left", "interval", "turn")

    def __init__(self, left: int) -> None:
        self.left = left  # calls of a chosen form in the group until the next check
        self.interval = RECHECK_FIRST  # calls between checks (doubles once every other form failed)
        self.turn = 0  # which other form the next check tries


class FormChooser:
    """Which form computes each bucket (``choice``, ``(rows, threads)`` -> form). The first calls
    of the first bucket at a thread count try every form ``FORM_TRIALS`` times and keep the
    fastest (``_record_trial``); a later bucket starts from its nearest bucket's choice
    (``_inherit``). The chosen form's calls stay timed, and after ``RECHECK_FIRST`` of them one
    call tries another form, each in turn (the interval doubles once every other form has failed
    at it): it takes over where it took less than ``RECHECK_MARGIN`` times the chosen form's
    fastest call in that bucket since the bucket's last check. The schedule of checks is kept
    per group of neighbouring buckets (``check_group``: 4-7 rows, 8-15, ...), not per bucket: a
    check lands on whichever bucket of the group is called when it falls due, so a tree size
    chosen now and then does not pay checks of its own (the default budget's varied tree sizes
    would open a bucket per size, and a varied budget would pay several times the checks of a
    fixed one).
    Noise on a shared machine only ever adds time, so a form can lose its two trials to a burst
    of it and then compute its bucket for the whole process, however much slower it is; a check
    costs one call in another form, ever more rarely, and puts that right within a few dozen
    calls. Where the caller times work beside each call at the same moment (the body: the rest
    of the forward), a check compares calls over that reference (``record``), so the machine's
    speed, which drifts over seconds, cannot keep a slower form or unseat a faster one."""

    def __init__(self, forms, forms_of=None) -> None:
        """``forms_of(key)``: the forms that may compute ``key``'s bucket (None: all of ``forms``)."""
        self.forms = tuple(forms)
        self._forms_of = forms_of
        self.choice: dict = {}  # key -> the form that computes it
        self.trials: dict = {}  # key -> form -> seconds of its trials, while every form is being tried
        self._watch: dict[object, _Watch] = {}  # check_group(key) -> the schedule of its checks
        self._best: dict = {}  # key -> its chosen form's fastest call since the bucket's last check
        self._recent: dict = {}  # key -> its chosen form's last calls over their reference (``record``)
        self._turns: dict = {}  # key -> its failed checks (which other form its next check tries)
        self._rows_of: tuple = (-1, {})  # (len(choice) when made, threads -> the rows with a choice, sorted)

    def forms_of(self, key) -> tuple:
        return self.forms if self._forms_of is None else self._forms_of(key)

    def pick(self, key) -> str:
        """The form for the next call in ``key``'s bucket (time it, then ``record``)."""
        form = self.choice.get(key)
        forms = self.forms_of(key)
        if form is None:
            tried = self.trials.get(key)
            if tried is None:
                form = self._inherit(key)
                if form is not None:
                    return form
            tried = tried or {}
            return min(forms, key=lambda f: len(tried.get(f, ())))
        watch = self._watch.get(self._schedule(key))
        if watch is None or watch.left > 0 or self._best.get(key, math.inf) == math.inf:
            return form
        others = [f for f in forms if f != form]
        if not others:
            return form
        near = self._nearest_choice(key)  # first the form the nearest buckets chose (a bucket's
        if near in others:  # checks are a few in a group's; 7 rows tried packed, not skinny, first)
            others.remove(near)
            others.insert(0, near)
        return others[self._turns.get(key, 0) % len(others)]

    def seed(self, choices: dict) -> int:
        """Take ``choices`` (``(rows, threads)`` -> form: an earlier process's, from the cost cache,
        ``kernel_forms``) for buckets with no choice yet, as if their trials had just chosen them
        (trials under way, e.g. of the model probes' first forwards, end there): checked against
        the other forms on the usual schedule (``RECHECK_FIRST``). Forms this chooser does not
        know are skipped. Returns how many it took."""
        taken = 0
        for key, form in choices.items():
            if form in self.forms_of(key) and key not in self.choice:
                self.trials.pop(key, None)
                self.choice[key] = form
                self._watch.setdefault(check_group(key), _Watch(RECHECK_FIRST))
                taken += 1
        return taken

    def _schedule(self, key):
        """Whose schedule of checks ``key``'s bucket follows: its group's (``check_group``), or
        its own where its choice differs from the buckets' on either side: the odd one out is the likely
        stale one, and in a shared schedule its checks are the few that land on it (a stale
        choice outlived many rounds of every size). Its own schedule checks it after
        ``INHERITED_CHECK`` of its calls."""
        chosen, rows, threads = self.choice.get(key), key[0], key[1]
        if chosen is not None and rows > 0:
            if len(self.choice) != self._rows_of[0]:  # (buckets are only ever added)
                by_threads: dict = {}
                for b, t in self.choice:
                    if b > 0:
                        by_threads.setdefault(t, []).append(b)
                self._rows_of = (len(self.choice), {t: sorted(bs) for t, bs in by_threads.items()})
            known = self._rows_of[1].get(threads, ())
            i = bisect.bisect_left(known, rows)  # known[i] == rows: it has a choice
            if 0 < i < len(known) - 1:
                below, above = self.choice[(known[i - 1], threads)], self.choice[(known[i + 1], threads)]
                if chosen != below and chosen != above:  # unlike the bucket on each side
                    return ("own", key)
        return check_group(key)

    def _nearest_choice(self, key) -> str | None:
        """The form chosen by the nearest other bucket (by ratio) at the same thread count, among
        those that may compute ``key``'s bucket; None where there is none (or no rows)."""
        rows, threads = key
        if rows <= 0:
            return None
        allowed = self.forms_of(key)
        near = [(abs(math.log2(b / rows)), b) for b, t in self.choice
                if t == threads and 0 < b != rows and self.choice[(b, t)] in allowed]
        return self.choice[(min(near)[1], threads)] if near else None

    def _inherit(self, key) -> str | None:
        """A new bucket ``(rows, threads)`` takes the choice of the nearest bucket (by ratio) at
        the same thread count, checked against the other forms after ``INHERITED_CHECK`` calls:
        trying every form twice costs every slower trial's excess in every new bucket, all of
        it in the first requests' latency. None where no bucket has a choice yet."""
        form = self._nearest_choice(key)
        if form is None:
            return None
        self.choice[key] = form
        self._watch.setdefault(check_group(key), _Watch(INHERITED_CHECK))  # a group already watched keeps its schedule
        return form

    def record(self, key, form: str, seconds: float, reference: float | None = None) -> float:
        """A timed call of ``form`` in ``key``'s bucket; returns what it took beyond the best
        form known for the bucket (a trial's or a check's excess, kept out of cost timings).
        ``reference``: seconds of work timed beside the call at the same moment whatever the
        form (the rest of the forward); then a check holds the other form's call over its
        reference against the median of the chosen form's last ``RECENT_CALLS`` such ratios,
        so that the machine's speed, which moves both, cancels out."""
        chosen = self.choice.get(key)
        group = self._schedule(key)
        forms = self.forms_of(key)
        if chosen is None:
            excess = _record_trial(self.trials, self.choice, key, form, seconds, forms)
            if key in self.choice:
                self._watch[self._schedule(key)] = _Watch(RECHECK_FIRST)
            return excess
        watch = self._watch.get(group)
        if watch is None:
            watch = self._watch[group] = _Watch(INHERITED_CHECK if group[0] == "own" else RECHECK_FIRST)
        best = self._best.get(key, math.inf)
        relative = reference is not None and reference > 0
        recent = self._recent.get(key)
        if form == chosen:
            watch.left -= 1
            self._best[key] = min(best, seconds)
            if relative:
                if recent is None:
                    recent = self._recent[key] = collections.deque(maxlen=RECENT_CALLS)
                recent.append(seconds / reference)
            return 0.0
        if relative and recent:  # against the chosen form's calls at the speed of their own moments
            base = float(np.median(recent)) * reference
        else:
            base = best
        if seconds < RECHECK_MARGIN * base:  # a check of another form, which won: it computes this bucket
            self.choice[key] = form
            self._watch[self._schedule(key)] = _Watch(RECHECK_FIRST)  # the group's boundary moved: checked again soon
            self._best[key] = seconds
            self._recent.pop(key, None)
            self._turns.pop(key, None)
            return 0.0
        watch.turn += 1
        self._turns[key] = self._turns.get(key, 0) + 1
        if watch.turn % max(1, len(forms) - 1) == 0:  # every other form has failed at this interval
            watch.interval *= 2
        watch.left, self._best[key] = watch.interval, math.inf
        return max(0.0, seconds - base)


class FastHead(torch.nn.Module):
    """A drop-in for a bias-free ``nn.Linear`` output projection on CPU."""

    def __init__(self, head: torch.nn.Linear) -> None:
        super().__init__()
        self.head = head
        # per form with a copy of the weight (``_HEAD_COPIES``): (the weight's shape, the copy), made on first need
        self._copies: dict[str, tuple[torch.Size, object]] = {}
        self.forms = tuple(f for f in FORMS if (f != "packed" or packed_available())
                           and (f != "skinny" or skinny_available()))
        self._chooser = FormChooser(self.forms, skinny_rows_only(self.forms))  # per (row bucket, torch threads)
        self.choice: dict[tuple[int, int], str] = self._chooser.choice  # ... -> the fastest form
        self._trials: dict[tuple[int, int], dict[str, list[float]]] = self._chooser.trials  # while trying
        self.excess_s = 0.0  # seconds trial calls took beyond the best form tried (``take_excess``)

    @property
    def weight(self) -> torch.Tensor:
        return self.head.weight

    def _copy(self, form: str):
        """The weight in ``form``'s layout (``_HEAD_COPIES``; made again where the weight's shape
        changed)."""
        w = self.head.weight
        made = self._copies.get(form)
        if made is None or made[0] != w.shape:
            made = self._copies[form] = (w.shape, _HEAD_COPIES[form](w.detach()))
        return made[1]

    def _form(self, form: str, flat: torch.Tensor, tops: np.ndarray | None = None) -> torch.Tensor:
        w = self.head.weight
        if form == "linear":
            return F.linear(flat, w)
        if form == "transposed":
            return flat @ self._copy(form)
        if form == "packed":
            return packed_linear(flat, self._copy(form), None)
        if form == "skinny":
            panels, bound = self._copy(form)
            return skinny_linear(flat if flat.is_contiguous() else flat.contiguous(), panels, w.shape[0], None,
                                 tops=tops, weight_bound=bound)
        return (w @ flat.t()).t()

    @torch.inference_mode()
    def prepare(self, rows: int) -> float:
        """Make the weight's copies the forms need (once); the seconds it took (0 once made),
        which the caller keeps out of its timings of the model."""
        wanted = [f for f in self.forms if f in _HEAD_COPIES]
        if all(f in self._copies for f in wanted):
            return 0.0
        start = time.perf_counter()
        for form in wanted:
            self._copy(form)
        return time.perf_counter() - start

    def take_excess(self) -> float:
        """Seconds the trial calls since the last call took beyond the best form tried for their
        bucket (reset): the engine keeps them out of its cost timings, as ``prepare``'s."""
        excess, self.excess_s = self.excess_s, 0.0
        return excess

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.project(x.reshape(-1, x.shape[-1]))
        return out.reshape(*x.shape[:-1], out.shape[-1])

    def project(self, flat: torch.Tensor, picks: int = 0) -> tuple[torch.Tensor, np.ndarray | None]:
        """The logits of ``flat`` [m, d] in the form chosen for m rows; with ``picks`` > 0 where
        that form is the skinny product, each row's ``picks`` best token ids too (int32 [m,
        picks], ``engine.top_tokens``' order), picked as the product writes the row, while it
        is in cache (else None): the greedy walk then reads those, not the rows."""
        key = (_bucket(flat.shape[0]), torch.get_num_threads())
        form = self._chooser.pick(key)  # the chosen form, or one being tried (FormChooser)
        self.prepare(flat.shape[0])  # the copies are made before the clock (once; a seeded choice too)
        start = time.perf_counter()
        tops = np.empty((flat.shape[0], picks), dtype=np.int32) if picks > 0 and form == "skinny" else None
        out = self._form(form, flat, tops)
        excess = self._chooser.record(key, form, time.perf_counter() - start)
        if excess:
            self.excess_s += excess  # what trying cost over the best form so far
            _TRIAL_EXCESS[0] += excess
        return out, tops


_SHARED: "weakref.WeakKeyDictionary[torch.nn.Module, FastHead]" = weakref.WeakKeyDictionary()


def fast_head_for(model) -> FastHead | None:
    """The ``FastHead`` of ``model``'s output projection (one per head, shared by every engine on
    the model, so the forms are timed once) where it applies: CPU, float32, a plain bias-free
    ``nn.Linear`` head; else None."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(head) is not torch.nn.Linear or head.bias is not None:
        return None
    if head.weight.device.type != "cpu" or head.weight.dtype != torch.float32:
        return None
    if not hasattr(model, "set_output_embeddings"):
        return None
    if head not in _SHARED:
        _SHARED[head] = FastHead(head)
    return _SHARED[head]


def shares_torch_runtime() -> bool:
    """Whether the core runs on torch's OpenMP runtime: its thread count follows
    ``torch.set_num_threads`` (set to 1, then 2, then back). The core links ``libgomp.so.1``,
    the runtime torch's CPU wheels load; a torch that renames its libgomp, ships libiomp5 or
    runs another thread pool leaves the core its own runtime, whose workers would spin on the
    same cores as torch's. (Other libraries' runtimes, such as faiss's or sentencepiece's
    renamed libgomp copies, sleep while they are not used.)"""
    if native_kernels is None or not getattr(native_kernels, "OPENMP", False):
        return False
    before = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            if native_kernels.omp_max_threads() != count:
                return False
        return True
    finally:
        torch.set_num_threads(before)


def _check_runtimes() -> bool:
    """Whether the skinny product may split over threads: on torch's own OpenMP runtime; a core
    with another is capped at one thread (``native_kernels.set_skinny_thread_cap``)."""
    if shares_torch_runtime():
        return True
    if native_kernels is not None and getattr(native_kernels, "OPENMP", False):
        log.info("the compiled core and torch use different OpenMP runtimes: the skinny product runs on one thread")
        native_kernels.set_skinny_thread_cap(1)
    return False


_THREADED = _check_runtimes()


def skinny_threaded() -> bool:
    """The skinny product splits its panels over torch's OpenMP threads (``skinny_threads`` in
    ``csrc/kernels/skinny.hpp``; the core built with OpenMP, on torch's runtime): at 2
    threads it is another kernel than the one-thread product, so the cost and form caches name
    it apart (``TargetModel.kernels``)."""
    return _THREADED


def skinny_available() -> bool:
    """The compiled core has the skinny product (``csrc/kernels/skinny.hpp``) in a vector
    instruction set of this CPU (AVX-512 or AVX2; the compiler's default kernel, several times
    slower than either, is a reference for tests, not a form)."""
    return (native_kernels is not None and hasattr(native_kernels, "skinny_linear")
            and native_kernels.skinny_isa() != "generic")


def skinny_pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] in the skinny product's panels (16 outputs each, zero-padded)."""
    out, inp = weight.shape
    panels = torch.empty(-(-out // 16) * 16 * inp, dtype=torch.float32)
    native_kernels.skinny_pack(weight.detach().contiguous(), panels)
    return panels


def skinny_linear(flat: torch.Tensor, panels: torch.Tensor, out_features: int, bias: torch.Tensor | None,
                  isa: str | None = None, tops: np.ndarray | None = None,
                  weight_bound: float = math.inf) -> torch.Tensor:
    """``F.linear(flat, W, bias)`` for 2D contiguous ``flat`` with ``panels = skinny_pack(W)``
    (called per layer in every forward: ``native_kernels`` bound at import, not looked up per call);
    ``tops`` (int32 [m, k], bias-free only): each row's k best column indices written there, as
    ``engine.top_tokens`` picks them from the row, as the product stores it (``weight_bound``:
    max |W|, by which a row's outputs are known finite; a row not known so, or every row with
    the default, is scanned once written instead)."""
    out = torch.empty((flat.shape[0], out_features), dtype=torch.float32)
    if tops is not None:
        if bias is not None:
            raise ValueError("skinny_linear: tops of a bias-free product only")
        native_kernels.skinny_linear(flat, panels, out, isa, tops, weight_bound)
        return out
    if (isa is None and _skinny_at is not None and flat.dtype == torch.float32 and flat.device.type == "cpu"
            and flat.stride(1) == 1 and panels.numel() == -(-out_features // 16) * 16 * flat.shape[1]
            and panels.dtype == torch.float32 and panels.device.type == "cpu" and panels.is_contiguous()):
        return skinny_product(flat, panels, out_features, bias)
    native_kernels.skinny_linear(flat, panels, out, isa)
    if bias is not None:
        out += bias
    return out


_skinny_at = getattr(native_kernels, "skinny_linear_at", None)  # (a core built before it: the checked binding)


def skinny_product(flat: torch.Tensor, panels: torch.Tensor, out_features: int, bias: torch.Tensor | None):
    """``skinny_linear``'s hot path, unchecked: the core gets addresses, not tensors (each
    tensor's conversion cost more than a small product). For callers that hold what it needs:
    ``flat`` float32 on the CPU with contiguous rows, ``panels = skinny_pack(W)`` of ``W``
    [out_features, flat's columns] (``PackedLinears``' layers, checked once when packed)."""
    out = torch.empty((flat.shape[0], out_features), dtype=torch.float32)
    _skinny_at(flat.data_ptr(), flat.stride(0), flat.shape[0], flat.shape[1], panels.data_ptr(), out_features,
               out.data_ptr())
    if bias is not None:
        out += bias
    return out

SKINNY_MAX_ROWS = 64  # the skinny product is offered for forwards of at most this many tokens


def skinny_rows_only(forms: tuple):
    """A ``FormChooser``'s ``forms_of``: every one of ``forms`` for buckets of at most
    ``SKINNY_MAX_ROWS`` rows, all but the skinny product beyond (compute-bound there: it re-reads
    the weights per 8 rows on one thread)."""
    wide = tuple(f for f in forms if f != "skinny")
    return lambda key: forms if key[0] <= SKINNY_MAX_ROWS else wide


# the head's forms that compute on a copy of the weight, and how each copy is made (the skinny
# product's: its panels and max |w|, by which its picks know a row's outputs finite)
_HEAD_COPIES = {"transposed": lambda w: w.t().contiguous(), "packed": lambda w: pack(w),
                "skinny": lambda w: (skinny_pack(w), float(w.abs().max()))}


class PackedLinears:
    """The body's linear layers computing in another form while ``active`` (``swapped``): on
    oneDNN-prepacked copies of their weights (``packed``), or the compiled core's skinny product
    on panels of them (``skinny``, forwards of at most ``SKINNY_MAX_ROWS`` tokens); plain
    ``nn.Linear`` everywhere else. One per model (``packed_linears_for``).

    The skinny product (``csrc/kernels/skinny.hpp``) reads each weight once per call and multiplies
    it into up to 8 rows held in registers: a verify forward of a few tokens on a CPU costs about
    the weights' read, and at one thread on an AVX-512 CPU it beats oneDNN's prepacked product
    for the few rows of a verify forward. At two threads and on CPUs without AVX-512 the
    timed choice decides as between the other two."""

    def __init__(self, modules: list[torch.nn.Linear], forms=None) -> None:
        self.modules = modules
        if forms is None:
            forms = tuple(f for f in BODY_FORMS if f == "linear" or (f == "packed" and packed_available())
                          or (f == "skinny" and skinny_available()))
        self.forms = tuple(forms)
        self.default = next((f for f in self.forms if f != "linear"), "linear")  # ``active()``'s form
        # per form: module -> (weight, its version, the copy in that form's layout)
        self._copies: dict[str, dict[torch.nn.Linear, tuple]] = {f: {} for f in self.forms if f != "linear"}
        self._forwards = {f: {m: self._forward_of(m, f) for m in modules} for f in self._copies}
        # the layers whose time stands for the body's once a form is chosen (``chosen``)
        middle = len(modules) // 2
        self._probe = set(modules[middle : middle + max(1, len(modules) // PROBE_SHARE)])
        self._spent = [0.0]  # seconds in the probe layers during this forward
        self._timed = {(m, form): self._timed_forward(m, form) for m in self._probe for form in self.forms}
        self._chooser = FormChooser(self.forms, skinny_rows_only(self.forms))
        self.choice: dict[tuple[int, int], str] = self._chooser.choice  # (token bucket, threads) -> form
        self._trials: dict[tuple[int, int], dict[str, list[float]]] = self._chooser.trials  # while trying
        self.excess_s = 0.0  # seconds trial forwards took beyond the best form tried (``take_excess``)
        self.generation = 0  # copies made so far: a holder of their addresses makes them again when it moves

    def take_excess(self) -> float:
        """Seconds the trial forwards since the last call took beyond the faster form tried for
        their bucket (reset): kept out of the engine's cost timings, as the head's."""
        excess, self.excess_s = self.excess_s, 0.0
        return excess

    @contextlib.contextmanager
    def chosen(self, tokens: int):
        """``active`` in the form that was fastest for a forward of ``tokens`` tokens (its
        bucket) at this thread count. While the forms are being tried (``FormChooser``), the
        form tried least so far computes the whole forward, timed whole (the head's trial and
        check excess left out). Once a form is chosen, only the probe layers (``_probe``: one
        linear layer in ``PROBE_SHARE`` of the body's, in the middle) are timed, and a check of
        another form runs those alone in it: a check costs a tenth of a forward's difference
        between the forms, not all of it (whole-forward checks of a slow form added up to a
        visible share of a run)."""
        key = (_bucket(tokens), torch.get_num_threads())
        form = self._chooser.pick(key)  # the chosen form, or one being tried or checked (FormChooser)
        chosen = self.choice.get(key)
        for f in {form, chosen}:  # (the copies are made before the clock)
            if f in self._copies:
                self.make_copies(f)
        if chosen is None:
            head_excess, start = _TRIAL_EXCESS[0], time.perf_counter()
            with self.active(form):
                yield
            seconds = time.perf_counter() - start - (_TRIAL_EXCESS[0] - head_excess)
            reference = None
        else:
            self._spent[0] = 0.0
            head_excess, start = _TRIAL_EXCESS[0], time.perf_counter()
            with self._probed(chosen, form):
                yield
            seconds = self._spent[0]
            # the rest of the same forward, at the same moment's speed (the head's trial excess out)
            reference = time.perf_counter() - start - seconds - (_TRIAL_EXCESS[0] - head_excess)
        self.excess_s += self._chooser.record(key, form, seconds, reference)

    @contextlib.contextmanager
    def _probed(self, form: str, probe_form: str):
        """Every layer in ``form`` but the probe layers, in ``probe_form`` and timed into ``_spent``."""
        forwards = self._forwards.get(form)
        for m in self.modules:
            if m in self._probe:
                m.__dict__["forward"] = self._timed[m, probe_form]
            elif forwards is not None:
                m.__dict__["forward"] = forwards[m]
        try:
            yield
        finally:
            for m in self.modules:
                m.__dict__.pop("forward", None)

    def _timed_forward(self, m: torch.nn.Linear, form: str):
        call = self._forwards[form][m] if form in self._forwards else functools.partial(torch.nn.Linear.forward, m)
        spent = self._spent

        def forward(x: torch.Tensor) -> torch.Tensor:
            start = time.perf_counter()
            out = call(x)
            spent[0] += time.perf_counter() - start
            return out

        return forward

    def refresh(self, form: str | None = None) -> None:
        """Copy every weight not copied yet, or changed since it was (a new tensor, or written in
        place: its version moved), into ``form``'s layout (None: every form's that has copies
        already). Called once per request (``TargetModel.prefill``)."""
        forms = [form] if form is not None else [f for f, c in self._copies.items() if c]
        with torch.inference_mode(False), torch.no_grad():
            for f in forms:
                copies = self._copies[f]
                for m in self.modules:
                    w = m.weight
                    known = copies.get(m)
                    if known is None or known[0] is not w or known[1] != w._version:
                        copies[m] = (w, w._version, pack(w) if f == "packed" else skinny_pack(w))
                        self.generation += 1

    def make_copies(self, form: str) -> None:
        """Every layer's copy in ``form`` made where missing (weights changed since are packed
        again by ``refresh``, once per request)."""
        if len(self._copies[form]) != len(self.modules):
            self.refresh(form)

    def panels(self, m: torch.nn.Linear) -> torch.Tensor:
        """``m``'s skinny panels as the last ``refresh`` or ``make_copies("skinny")`` left them."""
        return self._copies["skinny"][m][2]

    def _forward_of(self, m: torch.nn.Linear, form: str):
        copies = self._copies[form]
        out_features = m.out_features

        if form == "packed":
            def forward(x: torch.Tensor) -> torch.Tensor:
                flat = x.reshape(-1, x.shape[-1])
                out = packed_linear(flat if flat.is_contiguous() else flat.contiguous(), copies[m][2], m.bias)
                return out.view(*x.shape[:-1], out.shape[-1])
        else:  # (float32 CPU layers, panels of their weights: the unchecked product where the core has it)
            product = skinny_product if _skinny_at is not None else skinny_linear

            def forward(x: torch.Tensor) -> torch.Tensor:
                if x.dtype is not torch.float32:  # (not this layer's dtype: nn.Linear says why)
                    return torch.nn.Linear.forward(m, x)
                flat = x.reshape(-1, x.shape[-1])
                out = product(flat if flat.is_contiguous() else flat.contiguous(), copies[m][2], out_features, m.bias)
                return out.view(*x.shape[:-1], out_features)

        return forward

    @contextlib.contextmanager
    def active(self, form: str | None = None):
        """Every layer in ``form`` (None: ``default``; "linear": as it is) inside the block."""
        form = self.default if form is None else form
        forwards = self._forwards.get(form)
        if forwards is not None:
            self.make_copies(form)
        for m, forward in (forwards or {}).items():
            m.__dict__["forward"] = forward  # an instance attribute: nn.Module.__call__ takes it
        try:
            yield
        finally:
            for m in self.modules:
                m.__dict__.pop("forward", None)


_SHARED_BODIES: "weakref.WeakKeyDictionary[torch.nn.Module, PackedLinears | None]" = weakref.WeakKeyDictionary()


def packed_linears_for(model) -> PackedLinears | None:
    """The ``PackedLinears`` of ``model`` (shared by every engine on it) where it applies: CPU,
    float32, oneDNN in this torch, linear weights (the output projection apart) of at most
    ``PACKED_MAX_BYTES`` in all; else None. Nothing is packed until the first forward."""
    if model in _SHARED_BODIES:
        return _SHARED_BODIES[model]
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    modules = [m for m in model.modules()
               if type(m) is torch.nn.Linear and m is not head
               and m.weight.device.type == "cpu" and m.weight.dtype == torch.float32]
    size = sum(m.weight.numel() * m.weight.element_size() for m in modules)
    body = PackedLinears(modules) if modules and (packed_available() or skinny_available()) \
        and size <= PACKED_MAX_BYTES else None
    _SHARED_BODIES[model] = body
    return body


_SHARED_NORMS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> [(norm, its fused forward)]


def fused_norms_for(model) -> list:
    """``(module, forward)`` for each RMS norm of ``model`` that ``F.rms_norm`` computes bit for
    bit: CPU float32 weights, checked once per module on a probe row against the module's own
    forward (Gemma's ``1 + weight`` norm and any other formula fail it and keep their own).
    The forward is one call of the compiled core (``native_kernels.rms_norm_at``, whose sum of
    squares adds in ATen's order) where a probe of several row counts and scales finds it bit-equal to
    ``F.rms_norm`` on this machine, else that one ATen call (which ATen runs as about ten small
    operations; transformers' own forward makes six Python-level ones): 61 norms in a SmolLM2
    forward, a measurable part of it even through ``F.rms_norm`` (``bench/forward_parts.py``
    measures it). Shared per model."""
    if model in _SHARED_NORMS:
        return _SHARED_NORMS[model]
    found = []
    for m in model.modules():
        weight = getattr(m, "weight", None)
        eps = getattr(m, "variance_epsilon", getattr(m, "eps", None))
        if (not type(m).__name__.endswith("RMSNorm") or not isinstance(weight, torch.nn.Parameter)
                or weight.dim() != 1 or weight.device.type != "cpu" or weight.dtype != torch.float32
                or not isinstance(eps, float)):
            continue
        shape = (weight.shape[0],)
        probe = torch.randn(3, weight.shape[0], generator=torch.Generator().manual_seed(0)) * 3.0
        with torch.inference_mode():
            if not torch.equal(m(probe), F.rms_norm(probe, shape, weight, eps)):
                continue
        own = type(m).forward
        # the weight the core's probe passed (contiguous: checked); a weight set in its place since
        # goes through F.rms_norm
        probed = weight if weight.is_contiguous() and _core_norm_matches(weight, eps) else None

        def forward(x, m=m, shape=shape, eps=eps, own=own, probed=probed, n=shape[0]):
            if x.dtype is torch.float32 and x.is_cpu:
                w = m.weight
                if w is probed and x.is_contiguous() and x.shape[-1] == n and not torch.is_grad_enabled():
                    return core_rms_norm(x, w, eps)
                return F.rms_norm(x, shape, w, eps)
            return own(m, x)

        found.append((m, forward))
    _SHARED_NORMS[model] = found
    return found


def core_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``F.rms_norm(x, (n,), weight, eps)`` for a contiguous float32 CPU ``x`` [..., n] by the
    compiled core (the caller has checked ``_core_norm_matches`` and the layouts)."""
    n = weight.shape[0]
    out = torch.empty_like(x)
    native_kernels.rms_norm_at(x.data_ptr(), n, x.numel() // n, n, weight.data_ptr(), eps, out.data_ptr(), n)
    return out


def _core_norm_matches(weight: torch.Tensor, eps: float) -> bool:
    """Whether the compiled core's RMS norm equals ``F.rms_norm`` bit for bit on probes of 1, 5
    and 37 rows at three scales (its sum adds in the order of this torch's CPU kernel; another
    build, or one that adds otherwise, fails and keeps ``F.rms_norm``)."""
    if native_kernels is None or not hasattr(native_kernels, "rms_norm_at"):
        return False
    g = torch.Generator().manual_seed(1)
    n = weight.shape[0]
    with torch.inference_mode():
        w = weight.detach().contiguous()
        for rows, scale in ((1, 1.0), (5, 1e-3), (37, 40.0)):
            x = torch.randn(rows, n, generator=g) * scale
            if not torch.equal(core_rms_norm(x, w, eps), F.rms_norm(x, (n,), w, eps)):
                return False
    return True


_SHARED_ROTARY: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def fused_rotary_for(model) -> tuple | None:
    """``(module, fused)``: the modeling module whose ``apply_rotary_pos_emb`` the model's
    attention layers call, and in its place a function making each float32 CPU query and key
    tensor's rotation in one call of the compiled core (``native_kernels.rotary_at``: the six ATen
    calls per tensor of transformers' ``q * cos + rotate_half(q) * sin``, each value rounded as they
    round it, so bit for bit theirs; ``bench/forward_parts.py`` measures what the rotation
    costs a forward); any other input (another dtype, device or layout, a keyword it does not
    know) goes to the module's own function. Checked once per model on probes against the
    module's own function, values and memory layout (a family whose rotation differs, e.g.
    partial or interleaved, or whose result is laid out otherwise, keeps its own); None where
    there is nothing to fuse or no compiled core. Shared per model."""
    if model in _SHARED_ROTARY:
        return _SHARED_ROTARY[model]
    found = None
    module = None
    for m in model.modules():
        if type(m).__name__.endswith("Attention"):
            module = sys.modules.get(type(m).__module__)
            break
    own = getattr(module, "apply_rotary_pos_emb", None)
    own = getattr(own, "__wrapped_rotary__", own)  # (another model's fused one set there just now)
    dim = getattr(model.config, "head_dim", None) or (
        getattr(model.config, "hidden_size", 0) // max(1, getattr(model.config, "num_attention_heads", 1)))
    if native_kernels is not None and hasattr(native_kernels, "rotary_at") and callable(own) and dim and dim % 2 == 0:
        fused = _rotary_function(own)
        g = torch.Generator().manual_seed(0)
        ok = True
        with torch.inference_mode():
            for batch, tokens in ((1, 5), (2, 3)):
                q = torch.randn(batch, tokens, 4, dim, generator=g).transpose(1, 2)  # as the layers make them
                k = torch.randn(batch, 2, tokens, dim, generator=g)
                cos, sin = (torch.randn(batch, tokens, dim, generator=g) for _ in range(2))
                try:
                    want = own(q, k, cos, sin)
                    got = fused(q, k, cos, sin)
                except Exception:  # noqa: BLE001 (a signature of its own: it keeps its function)
                    ok = False
                    break
                if not (isinstance(want, tuple) and len(want) == 2
                        and all(torch.equal(a, b) and _layout(a) == _layout(b) for a, b in zip(want, got))):
                    ok = False
                    break
        if ok:
            found = (module, fused)
    _SHARED_ROTARY[model] = found
    return found


def _rotary_function(own):
    f32 = torch.float32

    def fused(q, k, cos, sin, *args, **kwargs):
        if not (args or torch.is_grad_enabled()
                or (kwargs and (kwargs.get("unsqueeze_dim", 1) != 1 or kwargs.get("position_ids") is not None
                                or len(kwargs) > ("unsqueeze_dim" in kwargs) + ("position_ids" in kwargs)))):
            qs, ks, cs = q.shape, k.shape, cos.shape
            if (len(qs) == 4 and len(ks) == 4 and len(cs) == 3 and sin.shape == cs and not qs[3] % 2
                    and cs[1] == qs[2] and cs[2] == qs[3] and (cs[0] == 1 or cs[0] == qs[0])
                    and ks[0] == qs[0] and ks[2] == qs[2] and ks[3] == qs[3]
                    and q.dtype is f32 and k.dtype is f32 and cos.dtype is f32 and sin.dtype is f32
                    and q.is_cpu and k.is_cpu and cos.is_cpu and sin.is_cpu
                    and cos.is_contiguous() and sin.is_contiguous()):
                batch = cos.stride(0) if cs[0] > 1 else 0
                return _rotate(q, cos, sin, batch), _rotate(k, cos, sin, batch)
        return own(q, k, cos, sin, *args, **kwargs)

    fused.__wrapped_rotary__ = own
    return fused


def _layout(x: torch.Tensor) -> list:
    """The strides of ``x``'s dimensions longer than 1 (what its memory layout is)."""
    return [stride for stride, n in zip(x.stride(), x.shape) if n > 1]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: int) -> torch.Tensor:
    out = torch.empty_like(x)  # (x's layout, as ATen's elementwise result keeps it)
    native_kernels.rotary_at(x.data_ptr(), *x.shape, *x.stride(), cos.data_ptr(), sin.data_ptr(), batch,
                    out.data_ptr(), *out.stride())
    return out


def _choosers(head: FastHead | None, body: PackedLinears | None) -> tuple:
    return (("head", head._chooser if head is not None else None),
            ("body", body._chooser if body is not None else None))


def kernel_forms(head: FastHead | None, body: PackedLinears | None) -> dict:
    """The forms chosen so far, for the cost cache (``kernel_forms.store_cached_forms``):
    ``{"head": {"rows,threads": form}, "body": {...}}`` (a part without a chooser left out)."""
    return {part: {f"{rows},{threads}": form for (rows, threads), form in sorted(chooser.choice.items())}
            for part, chooser in _choosers(head, body) if chooser is not None}


def seed_kernel_forms(head: FastHead | None, body: PackedLinears | None, forms: dict) -> int:
    """Give ``head`` and ``body`` the choices ``kernel_forms`` wrote (another process's on the
    same machine, model architecture, dtype and torch: ``kernel_forms.forms_key``), so their buckets
    skip the trials (``FormChooser.seed``); entries that do not parse are skipped. Returns how
    many choices were taken."""
    taken = 0
    for part, chooser in _choosers(head, body):
        entries = forms.get(part) if chooser is not None else None
        if not isinstance(entries, dict):
            continue
        choices = {}
        for key, form in entries.items():
            try:
                rows, threads = (int(x) for x in str(key).split(","))
            except ValueError:
                continue
            if rows > 0 and threads > 0 and isinstance(form, str):
                choices[(rows, threads)] = form
        taken += chooser.seed(choices)
    return taken


GQA_SWITCH = "TRANSFORMERS_SDPA_FORCE_GQA"  # transformers' switch: SDPA's enable_gqa even with a mask

# Grouped queries (``grouped_attention``): inside ``swapped(gqa=True)`` on this thread, a masked
# attention call of 2 or more query tokens folds each K/V head's query heads into its query
# rows. torch's CPU flash kernel given ``enable_gqa`` walks the K/V of a head once per query head
# of its group (SmolLM2: three times); folded, once, with three times the rows. Folding pays
# where K/V reads dominate (batches of several query tokens per row) and gains nothing for
# calls of one query token, hence ``GROUPED_MIN_QUERIES`` (``bench/batch_profile.py
# --attention both`` compares the two).
_GROUPED = threading.local()  # .on: grouped calls wanted on this thread (``swapped``); .mask: the
# last mask folded, (the mask, its group size, the folded copy): every layer of a forward gets the same mask
_UNHANDLED = ("softcap", "position_bias", "cache", "sinks", "s_aux")  # options left to transformers' call
GROUPED_CALLS = [0]  # grouped calls made (tests)
GROUPED_ATTENTION = True  # False: every call as transformers makes it (benchmarks compare the two)
GROUPED_MIN_QUERIES = 2  # calls of fewer query tokens stay transformers' (bench/batch_profile.py --grouped-min-queries)


def fold_query_heads(query: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[batch, heads, q, dim] -> [batch, kv_heads, heads / kv_heads x q, dim]: query head
    ``h`` (of K/V head ``h // groups``, as ``repeat_kv`` pairs them) at rows ``(h % groups) x q``
    on. A copy where ``query`` is strided (a transposed projection)."""
    batch, heads, q, dim = query.shape
    return query.reshape(batch, kv_heads, (heads // kv_heads) * q, dim)


def _folded_mask(mask: torch.Tensor, groups: int) -> torch.Tensor:
    """``mask`` [batch, 1, q, kv] repeated for each query head of a group: [batch, 1, groups x q, kv]
    (row ``r x q + i`` is row ``i``), made once per forward: the layers share the mask tensor, and
    ``swapped`` forgets the copy as each forward begins and ends (a caller may write a mask
    buffer again for its next forward; an inference tensor keeps no version to tell)."""
    last = getattr(_GROUPED, "mask", None)
    if last is not None and last[0] is mask and last[1] == groups:
        return last[2]
    batch, one, q, kv = mask.shape
    folded = mask[:, :, None].expand(batch, one, groups, q, kv).reshape(batch, one, groups * q, kv)
    _GROUPED.mask = (mask, groups, folded)
    return folded


# The core's tree attention (``native_kernels.tree_attention_at``, csrc/kernels/attention.hpp):
# inside ``swapped(gqa=True)`` a masked call of ``CORE_MIN_QUERIES`` to ``CORE_MAX_QUERIES`` query
# tokens, float32 with head dims of 16 to 128 by 16, grouped K/V heads or not, is one call of the
# core: each (row, K/V head, block of up to 16 of its query heads' tokens) reads only the slots
# some query of the row sees, once. The mask's plan (``attention_plan``) is made once per
# forward. ``CORE_ATTENTION`` False: the folded SDPA call above instead
# (``bench/batch_profile.py --attention core grouped`` compares the two: the core's call reads
# fewer slots, so it is the faster one).
CORE_ATTENTION = True
CORE_ATTENTION_CALLS = [0]  # calls the core made (tests)
CORE_HEAD_DIMS = (16, 32, 48, 64, 80, 96, 112, 128)
CORE_MIN_QUERIES = 1  # a batch's rows verifying their roots alone too (folded SDPA gained nothing there)
CORE_MAX_QUERIES = 64  # a tree's or batch width's tokens; more (a prefill's) go to SDPA
_attention_at = getattr(native_kernels, "tree_attention_at", None) if native_kernels is not None else None


def core_attention_available() -> bool:
    return _attention_at is not None


class AttentionPlan(typing.NamedTuple):
    """A 4D mask [B, 1, Q, L] as the core's tree attention reads it: per row its visible slots
    (``cols`` [B, cmax] int32: first those every live query sees with bias 0, ``common``, then the
    rest, each run ascending), ``counts`` [B], each query's bias at those slots (``bias`` [B, Q,
    cmax], -inf where it does not see one) and whether it sees any (``live`` [B, Q] uint8)."""
    cols: torch.Tensor
    counts: torch.Tensor
    common: torch.Tensor
    bias: torch.Tensor
    live: torch.Tensor


_plan_at = getattr(native_kernels, "attention_plan_at", None) if native_kernels is not None else None


def attention_plan(mask: torch.Tensor) -> AttentionPlan:
    """The plan of an additive float32 mask (a slot is hidden at the dtype's minimum or -inf, as
    ``tree_inputs`` and ``BatchTarget`` fill them) or a boolean one (True: seen), made by the
    core (``native_kernels.attention_plan_at``, one pass over the mask, where its definition,
    ``reference.model.attention_plan``, takes a dozen torch calls), its rows ``L`` wide (the slots
    past ``counts`` unused); by the definition where the core does not take the mask (another
    dtype, device or layout, the extension not built)."""
    if (_plan_at is None or mask.dtype not in (torch.float32, torch.bool) or mask.device.type != "cpu"
            or mask.stride(-1) != 1):
        return AttentionPlan(*reference_model.attention_plan(mask))
    batch, _, q, slots = mask.shape
    cols = torch.empty((batch, slots), dtype=torch.int32)
    counts, common = torch.empty(batch, dtype=torch.int32), torch.empty(batch, dtype=torch.int32)
    bias = torch.empty((batch, q, slots), dtype=torch.float32)
    live = torch.empty((batch, q), dtype=torch.uint8)
    _plan_at(mask.data_ptr(), mask.dtype == torch.bool, batch, q, slots, mask.stride(0), mask.stride(2),
             float(torch.finfo(torch.float32).min), slots, cols.data_ptr(), counts.data_ptr(), common.data_ptr(),
             bias.data_ptr(), live.data_ptr())
    return AttentionPlan(cols, counts, common, bias, live)


def _plan_of(mask: torch.Tensor) -> AttentionPlan:
    """``attention_plan(mask)``, made once per forward (the layers share the mask; ``swapped``
    forgets it as each forward begins and ends, as the folded mask)."""
    last = getattr(_GROUPED, "plan", None)
    if last is not None and last[0] is mask:
        return last[1]
    plan = attention_plan(mask)
    _GROUPED.plan = (mask, plan)
    return plan


def core_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, plan: AttentionPlan,
                   scale: float, isa: str | None = None) -> torch.Tensor:
    """Attention of ``query`` [B, H, Q, D] over ``key``/``value`` [B, KVH, L, D] (float32, the
    head dims contiguous) as ``plan`` shows them, into [B, Q, H, D] (transformers' layout after
    attention); a query that sees no slot gets zeros. (Defined in float64 by
    ``reference.model.attention``.)"""
    batch, heads, q, dim = query.shape
    out = torch.empty((batch, q, heads, dim), dtype=torch.float32)
    _attention_at(query.data_ptr(), key.data_ptr(), value.data_ptr(), plan.cols.data_ptr(), plan.counts.data_ptr(),
                  plan.common.data_ptr(), plan.bias.data_ptr(), plan.live.data_ptr(), out.data_ptr(),
                  [batch, heads, key.shape[1], q, dim, plan.cols.shape[1], *query.stride(), *key.stride(),
                   *value.stride()], float(scale), isa)
    CORE_ATTENTION_CALLS[0] += 1
    return out


def _core_takes(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor) -> bool:
    """Whether ``core_attention`` computes this call (``grouped_attention`` has checked the rest:
    a CPU, a 4D mask as wide as the K/V, K/V heads dividing the query heads): float32 tensors
    with contiguous head dims the core takes, ``CORE_MIN_QUERIES`` to ``CORE_MAX_QUERIES`` query
    tokens, one mask row per sequence and query (a mask broadcast over the batch would have the
    kernel read past its plan), V shaped as K."""
    batch, _, q, dim = query.shape
    return (CORE_ATTENTION and _attention_at is not None and dim in CORE_HEAD_DIMS
            and CORE_MIN_QUERIES <= q <= CORE_MAX_QUERIES
            and query.dtype == key.dtype == value.dtype == torch.float32
            and mask.dtype in (torch.float32, torch.bool) and mask.shape[0] == batch and mask.shape[2] == q
            and key.shape[0] == batch and value.shape[:3] == key.shape[:3] and value.shape[-1] == dim
            and query.stride(-1) == 1 and key.stride(-1) == 1 and value.stride(-1) == 1)


def grouped_attention(original):
    """A transformers attention function (``sdpa_attention_forward``'s signature) that, while
    ``_GROUPED.on`` (``swapped``) on a CPU, computes a masked call of ``CORE_MIN_QUERIES`` to
    ``CORE_MAX_QUERIES`` float32 query tokens with a head dim the core takes as the core's tree
    attention (``core_attention``), else one of ``GROUPED_MIN_QUERIES`` or more query tokens with
    grouped K/V heads as one SDPA call over folded query heads (``fold_query_heads``); any other
    call (another thread's, a model outside ``swapped``, no mask, options it does not handle)
    goes to ``original`` unchanged."""

    @functools.wraps(original)
    def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                  is_causal=None, **kwargs):
        groups = getattr(module, "num_key_value_groups", 1)
        if (GROUPED_ATTENTION and getattr(_GROUPED, "on", False) and attention_mask is not None
                and isinstance(groups, int) and groups >= 1 and query.device.type == "cpu" and not dropout
                and attention_mask.dim() == 4 and attention_mask.shape[1] == 1
                and attention_mask.shape[-1] == key.shape[-2] and key.shape[1] * groups == query.shape[1]
                and all(kwargs.get(k) is None for k in _UNHANDLED) and not kwargs.get("output_attentions", False)):
            batch, heads, q, dim = query.shape
            if _core_takes(query, key, value, attention_mask):
                scale = scaling if scaling is not None else 1.0 / math.sqrt(dim)
                GROUPED_CALLS[0] += 1
                return core_attention(query, key, value, _plan_of(attention_mask), scale), None
            if groups > 1 and q >= GROUPED_MIN_QUERIES:
                out = F.scaled_dot_product_attention(fold_query_heads(query, key.shape[1]), key, value,
                                                     attn_mask=_folded_mask(attention_mask, groups), scale=scaling)
                GROUPED_CALLS[0] += 1
                return out.reshape(batch, heads, q, value.shape[-1]).transpose(1, 2).contiguous(), None
        return original(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                        is_causal=is_causal, **kwargs)

    attention.__grouped_original__ = original
    return attention


@contextlib.contextmanager
def swapped(model, fast: FastHead | None, *, gqa: bool = False, body: PackedLinears | None = None,
            tokens: int | None = None, norms: list | None = None, rotary: tuple | None = None,
            layers: list | None = None):
    """Inside the block: ``model``'s output projection replaced by ``fast`` (if not None), its
    body's linear layers on packed weights (``body``, if not None) and,
    with ``gqa``, transformers' SDPA told to pass grouped K/V heads to torch as they are
    (``enable_gqa``) instead of copying them ``heads / kv_heads`` times, which it does whenever
    a mask is given, i.e. for every tree of 2 or more tokens. On CPU that copy of the whole
    cache is paid by every forward and grows with the context; the logits are bitwise the
    same. Not on CUDA, where SDPA with a mask and enable_gqa falls back to its slowest kernel.
    On this thread, a masked call of a tree's tokens is the core's tree attention, or folds each
    K/V head's query heads into one SDPA call (``grouped_attention``).
    ``tokens``: the forward's token count, for the body's choice of form (``PackedLinears.chosen``);
    None: packed weights whatever the count. ``norms``: ``fused_norms_for(model)``, each norm's
    fused forward set on it for the block. ``rotary``: ``fused_rotary_for(model)``, its function
    set in the module for the block (bit for bit the module's own; what it does not take goes to
    that one, so another thread's model of the family is unaffected). ``layers``:
    ``lean.lean_layers_for(model)``, each decoder layer's lean forward set on it for the block
    (bit for bit its own, without a module call per part)."""
    old_gqa = old_grouped = None
    if gqa:
        old_gqa = os.environ.get(GQA_SWITCH)
        os.environ[GQA_SWITCH] = "1"
        old_grouped = getattr(_GROUPED, "on", False)
        _GROUPED.on, _GROUPED.mask, _GROUPED.plan = True, None, None
    if fast is not None:
        model.set_output_embeddings(fast)
    forwards = [*(norms or ()), *(layers or ())]  # modules whose forward is set for the block
    for m, forward in forwards:
        m.__dict__["forward"] = forward  # as the body's: nn.Module.__setattr__ is slow, and runs per module per forward
    if rotary is not None:
        rotary[0].apply_rotary_pos_emb = rotary[1]
    try:
        if body is None:
            context = contextlib.nullcontext()
        else:
            context = body.active() if tokens is None else body.chosen(tokens)
        with context:
            yield
    finally:
        for m, _ in forwards:
            m.__dict__.pop("forward", None)
        if rotary is not None:
            rotary[0].apply_rotary_pos_emb = rotary[1].__wrapped_rotary__
        if fast is not None:
            model.set_output_embeddings(fast.head)
        if gqa:
            _GROUPED.on, _GROUPED.mask, _GROUPED.plan = old_grouped, None, None
            if old_gqa is None:
                os.environ.pop(GQA_SWITCH, None)
            else:
                os.environ[GQA_SWITCH] = old_gqa
