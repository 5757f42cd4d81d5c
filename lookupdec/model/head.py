"""The output projection (hidden -> vocabulary logits) for the few rows a verify forward has.

On CPU the projection is the largest single matrix product of a small model (SmolLM2-135M:
49,152 x 576, a sixth of its weights), and the BLAS kernel ``torch.nn.functional.linear``
reaches for a handful of rows is far from the fastest: measured at one thread on this project's
machine, 1 row 10.1 ms (5.0 ms with the weight stored transposed), 2 rows 22.3 ms (5.5 ms as
``W @ x.T``), 4 rows 16.6 ms (8.1 ms). ``FastHead`` computes the same product, the same
float32 sums up to rounding, with whichever of the three forms was fastest for that number of
rows: the first time a row count (bucket) occurs it times each form on a random input
(``prepare``, about 0.1 s, kept out of the engine's cost timings) and keeps the winner.
Nothing is measured at start-up.

``TargetModel`` swaps it in for the duration of its own forwards only (``swapped``), so the model
object it was handed behaves as before everywhere else (e.g. ``transformers.generate`` on the
same model in a benchmark). Greedy identity with ``transformers`` is tested as everywhere
(``tests/test_real_model.py``, ``tests/test_greedy_identity.py``).
"""
from __future__ import annotations

import contextlib
import os
import time
import weakref

import torch
import torch.nn.functional as F

FORMS = ("linear", "transposed", "right")  # W x^T as F.linear; x @ (W^T stored); (W @ x^T)^T
EXACT_BUCKETS = 16  # row counts up to this are their own bucket; beyond, powers of 2


def _bucket(rows: int) -> int:
    if rows <= EXACT_BUCKETS:
        return rows
    return 1 << (rows - 1).bit_length()


class FastHead(torch.nn.Module):
    """A drop-in for a bias-free ``nn.Linear`` output projection on CPU."""

    def __init__(self, head: torch.nn.Linear) -> None:
        super().__init__()
        self.head = head
        self._transposed: torch.Tensor | None = None  # W^T, contiguous: made on first need
        self.choice: dict[int, str] = {}  # row bucket -> fastest form

    @property
    def weight(self) -> torch.Tensor:
        return self.head.weight

    def _form(self, form: str, flat: torch.Tensor) -> torch.Tensor:
        w = self.head.weight
        if form == "linear":
            return F.linear(flat, w)
        if form == "transposed":
            if self._transposed is None or self._transposed.shape != (w.shape[1], w.shape[0]):
                self._transposed = w.detach().t().contiguous()
            return flat @ self._transposed
        return (w @ flat.t()).t()

    @torch.inference_mode()
    def prepare(self, rows: int) -> float:
        """Choose the form for ``rows`` rows if not chosen yet: time each (twice, on a random
        input; the faster counts) and keep the fastest. Returns the seconds it took (0 if known),
        which the caller keeps out of its timings of the model."""
        bucket = _bucket(rows)
        if bucket in self.choice:
            return 0.0
        start = time.perf_counter()
        w = self.head.weight
        self._form("transposed", w[:1, :])  # the transposed copy is made outside the timing
        flat = torch.randn(rows, w.shape[1], dtype=w.dtype, device=w.device)
        timings: dict[str, float] = {}
        for candidate in FORMS * 2:
            t = time.perf_counter()
            self._form(candidate, flat)
            seconds = time.perf_counter() - t
            timings[candidate] = min(seconds, timings.get(candidate, seconds))
        self.choice[bucket] = min(timings, key=timings.get)
        return time.perf_counter() - start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        self.prepare(flat.shape[0])
        out = self._form(self.choice[_bucket(flat.shape[0])], flat)
        return out.reshape(*x.shape[:-1], out.shape[-1])


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


GQA_SWITCH = "TRANSFORMERS_SDPA_FORCE_GQA"  # transformers' switch: SDPA's enable_gqa even with a mask


@contextlib.contextmanager
def swapped(model, fast: FastHead | None, *, gqa: bool = False):
    """Inside the block: ``model``'s output projection replaced by ``fast`` (if not None) and,
    with ``gqa``, transformers' SDPA told to pass grouped K/V heads to torch as they are
    (``enable_gqa``) instead of copying them ``heads / kv_heads`` times, which it does whenever
    a mask is given, i.e. for every tree of 2 or more tokens. On CPU that copy of the whole
    cache costs SmolLM2 about 6 ms per forward at a 512-token context; the logits are bitwise
    the same. Not on CUDA, where SDPA with a mask and enable_gqa falls back to its slowest kernel."""
    old_gqa = None
    if gqa:
        old_gqa = os.environ.get(GQA_SWITCH)
        os.environ[GQA_SWITCH] = "1"
    if fast is not None:
        model.set_output_embeddings(fast)
    try:
        yield
    finally:
        if fast is not None:
            model.set_output_embeddings(fast.head)
        if gqa:
            if old_gqa is None:
                os.environ.pop(GQA_SWITCH, None)
            else:
                os.environ[GQA_SWITCH] = old_gqa
