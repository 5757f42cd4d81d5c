"""Checks shared by every entry point (Python API, CLI, server, rewrite pipeline): sampling
values, seeds, token budgets, stop strings, devices, and text that UTF-8 cannot encode
(``check_unicode``). ``check_generation`` runs all of a request's but the prompt's;
``Engine.check_request`` adds the prompt's. A bad value raises
``ParamError``, a ``ValueError`` that carries the name of the field at fault in ``.field``: the
CLI prints its message on one line (exit 2), the server answers 400 with ``param`` set from
``.field`` (mapped to the request's own field name).

No torch import at module level: the CLI validates before loading anything heavy.
"""
from __future__ import annotations

import math
import numbers

SEED_MIN = 0
SEED_MAX = 2**64 - 1  # torch.Generator.manual_seed's range (a negative seed would alias a large one)
MAX_SHOWN = 80  # characters of a bad value quoted in a message


class ParamError(ValueError):
    """A bad value for one named field (``.field``), e.g. ``temperature`` or ``seed``."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


def shown(value) -> str:
    text = repr(value)
    return text if len(text) <= MAX_SHOWN else text[: MAX_SHOWN - 3] + "..."


def bad(field: str, value, rule: str) -> ParamError:
    """``ParamError("field=value: rule", field)``."""
    return ParamError(f"{field}={shown(value)}: {rule}", field)


# a string with a lone surrogate ("\ud800" in JSON, or an undecodable byte of a command-line
# argument, which Python keeps as one): no text a tokenizer can take
NOT_UNICODE = "not valid Unicode text (it holds a lone surrogate such as \\ud800, which UTF-8 cannot encode)"


def check_unicode(field: str, text: str) -> str:
    """``text`` if UTF-8 can encode it, else ``ParamError("FIELD: not valid Unicode text ...",
    field)``: the one explanation every entry point gives (the rewrite pipeline's error lines;
    the server's 400 says the same)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ParamError(f"{field}: {NOT_UNICODE}", field) from None
    return text


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def finite_number(field: str, value, rule: str) -> float:
    """``value`` as a float if it is a finite real number (not a bool), else ``bad``."""
    if not _is_number(value):
        raise bad(field, value, f"expected a number ({rule})")
    try:
        number = float(value)
    except OverflowError:  # an int too large for a float
        raise bad(field, value, f"out of range ({rule})") from None
    if not math.isfinite(number):
        raise bad(field, value, f"must be a finite number ({rule})")
    return number


def check_sampling(*, temperature=0.0, top_k=None, top_p=None, repetition_penalty=None) -> None:
    """The sampling values of ``Engine.generate`` (``SamplingParams`` runs this too)."""
    if not finite_number("temperature", temperature, "0 = greedy, > 0 samples") >= 0:
        raise bad("temperature", temperature, "must be >= 0 (0 = greedy)")
    if top_k is not None and (not _is_int(top_k) or top_k < 1):
        raise bad("top_k", top_k, "must be an integer >= 1")
    if top_p is not None and not 0 < finite_number("top_p", top_p, "in (0, 1]") <= 1:
        raise bad("top_p", top_p, "must be in (0, 1]")
    if repetition_penalty is not None and not finite_number("repetition_penalty", repetition_penalty, "> 0") > 0:
        raise bad("repetition_penalty", repetition_penalty, "must be > 0 (1 = off)")


def check_seed(seed) -> None:
    """None (a fresh random seed) or an integer in [SEED_MIN, SEED_MAX]."""
    if seed is None:
        return
    if not _is_int(seed):
        raise bad("seed", seed, f"expected an integer from {SEED_MIN} to {SEED_MAX} (2**64 - 1)")
    if not SEED_MIN <= seed <= SEED_MAX:
        raise bad("seed", seed, f"out of range: seeds are integers from {SEED_MIN} to {SEED_MAX} (2**64 - 1)")


def check_max_new_tokens(value) -> None:
    if not _is_int(value) or value <= 0:
        raise bad("max_new_tokens", value, "must be a positive integer")


# the longest stop string: text is held back while its tail may still become one, by a set of
# every stop string's prefixes (``stops.StopStrings``), whose size grows with the square of this
MAX_STOP_CHARS = 1000


def check_stop(stop) -> list[str]:
    """Stop strings (None, one string, or a list of non-empty strings of at most
    ``MAX_STOP_CHARS`` characters) as a list."""
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    try:
        stop = list(stop)
    except TypeError:
        raise bad("stop", stop, "expected a string or a list of non-empty strings") from None
    if not all(isinstance(s, str) and s for s in stop):
        raise bad("stop", stop, "stop strings must be non-empty strings")
    longest = max(stop, key=len, default="")
    if len(longest) > MAX_STOP_CHARS:
        raise bad("stop", longest, f"a stop string has {len(longest)} characters, at most {MAX_STOP_CHARS}")
    return stop


def check_generation(*, max_new_tokens=None, temperature=0.0, top_k=None, top_p=None, repetition_penalty=None,
                     seed=None, stop=None) -> None:
    """Every value of a generation request but the prompt, in the order ``Engine.check_request``
    checks them (``max_new_tokens=None``: not checked, e.g. still to be derived from the prompt).
    Needs no model: the CLI runs it before loading one, the server on its event loop, the
    rewrite pipeline on its options."""
    if max_new_tokens is not None:
        check_max_new_tokens(max_new_tokens)
    check_sampling(temperature=temperature, top_k=top_k, top_p=top_p, repetition_penalty=repetition_penalty)
    check_seed(seed)
    check_stop(stop)


def check_device(device) -> str | None:
    """``device`` (None: the default, cuda if available) as a string torch accepts and that
    exists on this machine; a one-line ``ParamError`` naming ``device`` otherwise (a CUDA device
    on a machine without CUDA, a device index past the last GPU, a misspelt name)."""
    if device is None:
        return None
    import torch

    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise bad("device", device, "not a device name; expected cpu, cuda, cuda:N or mps") from None
    kind, index = parsed.type, parsed.index
    if kind == "cpu":
        return str(parsed)
    if kind == "cuda":
        if not torch.cuda.is_available():
            why = ("this torch is built without CUDA" if torch.version.cuda is None
                   else "no CUDA device is visible (driver, CUDA_VISIBLE_DEVICES)")
            raise bad("device", device, f"CUDA is not available: {why}; use --device cpu")
        count = torch.cuda.device_count()
        if index is not None and index >= count:
            raise bad("device", device, f"this machine has {count} CUDA device{'s' if count != 1 else ''} "
                      f"(cuda:0{f' to cuda:{count - 1}' if count > 1 else ''})")
        return str(parsed)
    if kind == "mps":
        backend = getattr(torch.backends, "mps", None)
        if backend is None or not backend.is_available():
            raise bad("device", device, "MPS is not available on this machine; use --device cpu")
        return str(parsed)
    module = getattr(torch, kind, None)  # xpu, ... : the backend says whether it is there
    available = getattr(module, "is_available", None)
    if available is None or not available():
        raise bad("device", device, f"{kind} devices are not available here; use --device cpu")
    count = getattr(module, "device_count", None)
    if index is not None and count is not None and index >= count():
        raise bad("device", device, f"this machine has {count()} {kind} device(s)")
    return str(parsed)
