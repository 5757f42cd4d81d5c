"""The OpenAI-compatible wire format: request models (validated strictly, unknown fields
rejected), error bodies, and the response / stream-chunk builders.

Every bad field is an HTTP 400 with OpenAI's error body, ``param`` naming the field:
``{"error": {"message": ..., "type": "invalid_request_error", "param": "top_p", "code": null}}``.
Fields OpenAI defines that this server cannot honour exactly (``n > 1``, ``logprobs``,
``echo``, penalties, ``logit_bias``, tools ...) are rejected rather than silently ignored.
"""
from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from lookupdec.validate import NOT_UNICODE, ParamError, check_generation

MAX_STOP_STRINGS = 4  # OpenAI's limit on `stop`
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
DEFAULT_TEMPERATURE = 1.0  # OpenAI's default: a request that names no temperature samples
ERROR_TYPE = "invalid_request_error"
MAX_SHOWN_VALUE = 80  # characters of a bad value quoted in its error message

NonEmptyStr = Annotated[str, Field(min_length=1)]
PositiveInt = Annotated[int, Field(gt=0)]


class RequestError(ValueError):
    """A bad request: HTTP ``status`` (400) naming ``param`` (the request field at fault, or
    None), with OpenAI's error ``code`` where it defines one (``model_not_found``)."""

    def __init__(self, message: str, param: str | None, *, status: int = 400, code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


def error_body(message: str, param: str | None, code: str | None = None, kind: str = ERROR_TYPE) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _must_be(value, allowed: tuple, what: str):
    if value not in allowed:
        raise ValueError(f"not supported ({what})")
    return value


class _Sampling(BaseModel):
    """Fields shared by completions and chat. ``top_k`` and ``repetition_penalty`` are
    extensions (pass them with the openai client's ``extra_body``)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: str | None = None  # the served model's id (GET /v1/models); None or "" = that model
    max_tokens: PositiveInt | None = None
    # Types only here: their values are checked by lookupdec.validate, as for every entry point
    # (check_values: finite, in range; a seed from 0 to 2**64 - 1).
    temperature: float = DEFAULT_TEMPERATURE
    top_p: float = 1.0
    top_k: int | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: NonEmptyStr | Annotated[list[NonEmptyStr], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None  # accepted; usage is always in the last chunk
    user: str | None = None  # accepted and ignored, as an opaque client label
    n: int = 1
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, v):
        return _must_be(v, (1,), "one choice per request: n=1")

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, v):
        return _must_be(v, (None, 0, 0.0), "use repetition_penalty")

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, v):
        return _must_be(v, (None, {}), "no logit_bias")

    def check_values(self) -> None:
        """The sampling values, the seed and the stop strings, by the checks the engine itself
        runs (``validate.check_generation``, the model-free part of ``Engine.check_request``;
        raises ``RequestError`` naming the field); run on the loop, before the prompt is built."""
        try:
            check_generation(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                             repetition_penalty=self.repetition_penalty, seed=self.seed, stop=self.stop)
        except ParamError as exc:
            raise RequestError(str(exc), exc.field) from None

    def engine_kwargs(self, max_new_tokens: int) -> dict:
        """Keyword arguments of ``Engine.stream`` (``top_p == 1`` is no nucleus cut)."""
        return dict(max_new_tokens=max_new_tokens, temperature=self.temperature, top_k=self.top_k,
                    top_p=None if self.top_p == 1 else self.top_p, repetition_penalty=self.repetition_penalty,
                    seed=self.seed, stop=self.stop)


class CompletionRequest(_Sampling):
    prompt: NonEmptyStr | Annotated[list[int], Field(min_length=1)]  # text, or token ids
    suffix: str | None = None  # fill-in-the-middle: the text after the gap
    max_tokens: PositiveInt = DEFAULT_COMPLETION_MAX_TOKENS
    echo: bool = False
    best_of: int | None = None
    logprobs: int | None = None

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v):
        return _must_be(v, (False,), "echo=false")

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, v):
        return _must_be(v, (None, 1), "best_of=1")

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v):
        return _must_be(v, (None,), "no logprobs")


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart]
    name: str | None = None

    def as_template_input(self) -> dict:
        """{"role", "content"} with the content as one string (text parts joined)."""
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": self.role, "content": content} | ({"name": self.name} if self.name else {})


class ChatRequest(_Sampling):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: PositiveInt | None = None  # the newer name of max_tokens
    logprobs: bool = False

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v):
        return _must_be(v, (False,), "no logprobs")

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# What a field holds, for the message when a value fits none of a union's alternatives.
EXPECTED = {
    "prompt": "a non-empty string or a non-empty list of token ids",
    "stop": f"a non-empty string or a list of at most {MAX_STOP_STRINGS} non-empty strings",
    "messages": "a non-empty list of {role, content} objects, content a string or a list of "
                "{type: 'text', text} parts",
}


# a string with a lone surrogate ("\ud800" in the JSON): valid JSON, no text a tokenizer can take


def validation_error(errors: list[dict]) -> RequestError:
    """Pydantic's errors as one RequestError naming the top-level field."""
    err = errors[0]
    if err.get("type") == "json_invalid":
        return RequestError(f"the request body is not valid JSON ({err.get('ctx', {}).get('error', '')})", None)
    loc = [str(part) for part in err.get("loc", ()) if part != "body"]
    if not loc:
        return RequestError(f"the request body must be a JSON object ({err.get('msg')})", None)
    param, value = loc[0], err.get("input")
    if err.get("type") == "missing":
        return RequestError(f"{'.'.join(loc)} is required", param)
    if err.get("type") == "extra_forbidden":
        return RequestError(f"{'.'.join(loc)}: unknown or unsupported field", param)
    mine = [e for e in errors if [str(p) for p in e.get("loc", ()) if p != "body"][:1] == [param]]
    if any(e.get("type") == "string_unicode" for e in mine):  # what the union's message would hide
        return RequestError(f"{param}: {NOT_UNICODE}", param)
    if len(mine) > 1:
        return RequestError(f"{param}: expected {EXPECTED.get(param, 'another value')}", param)
    message = str(err.get("ctx", {}).get("error") or err.get("msg", "invalid value"))
    shown = "" if isinstance(value, (dict, list)) or len(repr(value)) > MAX_SHOWN_VALUE else f"={value!r}"
    return RequestError(f"{'.'.join(loc)}{shown}: {message}", param)


# -- responses ----------------------------------------------------------------------------------
OPENAI_FINISH = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "stop"}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_body(rid: str, model: str, text: str, finish: str | None, *, chat: bool, chunk: bool) -> dict:
    """One response (``chunk=False``) or stream chunk, completion or chat shaped."""
    reason = OPENAI_FINISH[finish] if finish else None
    if not chat:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        kind = "text_completion"
    elif chunk:
        choice = {"index": 0, "delta": {"content": text} if text or not finish else {}, "logprobs": None,
                  "finish_reason": reason}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": reason}
        kind = "chat.completion"
    return {"id": rid, "object": kind, "created": int(time.time()), "model": model, "choices": [choice]}
