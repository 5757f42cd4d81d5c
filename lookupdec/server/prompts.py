"""Request → prompt token ids: plain text or ids, chat messages through the tokenizer's chat
template, and fill-in-the-middle through the tokenizer's FIM tokens. Runs on the server's prompt
threads, each with its own copy of the tokenizer (a tokenizer is not shared between threads;
the engine thread keeps the original for decoding).

Fill-in-the-middle is PSM (prefix, suffix, middle) as token ids:
``[specials the tokenizer adds at the start] + <fim_prefix> + prompt + <fim_suffix> + suffix +
<fim_middle>``; the model then writes the middle. Recognised spellings: ``<|fim_prefix|>``,
``<|fim_suffix|>``, ``<|fim_middle|>`` (lookupdec's own code model, Qwen2.5-Coder) and
``<fim_prefix>``, ``<fim_suffix>``, ``<fim_middle>`` (StarCoder, SantaCoder).
"""
from __future__ import annotations

import copy
import threading
from dataclasses import dataclass

from lookupdec.server.protocol import NOT_UNICODE, ChatRequest, CompletionRequest, RequestError
from lookupdec.tokens import chat_text
from lookupdec.validate import ParamError

FIM_SPELLINGS = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
)
UNBOUNDED_CONTEXT_MAX_TOKENS = 4096  # chat without max_tokens on a model with no context limit


def fim_token_ids(tokenizer) -> tuple[int, int, int] | None:
    """(prefix, suffix, middle) token ids of the first spelling the tokenizer holds whole, else None."""
    vocab = tokenizer.get_vocab()
    for spelling in FIM_SPELLINGS:
        if all(token in vocab for token in spelling):
            return tuple(vocab[token] for token in spelling)
    return None


@dataclass(frozen=True)
class Prompt:
    token_ids: list[int]
    max_new_tokens: int


class PromptBuilder:
    """Turns validated requests into prompt token ids, checked against the model's context."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self._original = engine.tokenizer
        self._local = threading.local()
        self.fim_ids = fim_token_ids(self._original)
        self.has_chat_template = bool(getattr(self._original, "chat_template", None))
        self.max_context = engine.target.max_context

    @property
    def tokenizer(self):
        """This thread's own copy of the engine's tokenizer."""
        tokenizer = getattr(self._local, "tokenizer", None)
        if tokenizer is None:
            tokenizer = self._local.tokenizer = copy.deepcopy(self._original)
        return tokenizer

    def completion(self, request: CompletionRequest) -> Prompt:
        if request.suffix:  # "" is the same as no suffix: nothing after the gap
            ids = self._fim_ids(request.prompt, request.suffix)
        elif isinstance(request.prompt, str):
            ids = self._tokenize(request.prompt, "prompt", special=True)
        else:
            ids = request.prompt
        ids = self._checked(ids, "prompt")
        return Prompt(ids, request.max_tokens)

    def chat(self, request: ChatRequest) -> Prompt:
        if not self.has_chat_template:
            raise RequestError("this model's tokenizer has no chat template (tokenizer_config.json "
                               "chat_template); use /v1/completions", "messages")
        messages = [m.as_template_input() for m in request.messages]
        try:
            text = chat_text(self.tokenizer, messages)
        except ParamError as exc:
            raise RequestError(str(exc), exc.field) from None
        ids = self._checked(self._tokenize(text, "messages", special=False), "messages")
        max_tokens = request.requested_max_tokens()
        if max_tokens is None:
            room = None if self.max_context is None else self.max_context - len(ids)
            max_tokens = room if room is not None else UNBOUNDED_CONTEXT_MAX_TOKENS
        return Prompt(ids, max_tokens)

    def _fim_ids(self, prompt, suffix: str) -> list[int]:
        if self.fim_ids is None:
            raise RequestError("suffix (fill-in-the-middle) needs a tokenizer with FIM tokens ("
                               + " / ".join(" ".join(s) for s in FIM_SPELLINGS) + "); this one has none",
                               "suffix")
        prefix_tok, suffix_tok, middle_tok = self.fim_ids
        if isinstance(prompt, list):  # token ids: the prefix exactly as given
            start, prefix = [], prompt
        else:  # the tokens a plain prompt starts with (e.g. BOS), then the text's own
            start, prefix = list(self.tokenizer("").input_ids), self._tokenize(prompt, "prompt", special=False)
        return start + [prefix_tok] + prefix + [suffix_tok] + self._tokenize(suffix, "suffix", special=False) + [middle_tok]

    def _tokenize(self, text: str, param: str, *, special: bool) -> list[int]:
        """``text``'s token ids (``special``: with the specials the tokenizer adds, e.g. BOS)."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise RequestError(f"{param}: {NOT_UNICODE}", param) from None
        try:
            return list(self.tokenizer(text, add_special_tokens=special).input_ids)
        except (TypeError, ValueError, UnicodeError) as exc:  # (a tokenizer that refuses some text)
            raise RequestError(f"{param}: cannot tokenize this text ({exc.__class__.__name__}: "
                               f"{str(exc)[:200]})", param) from None

    def _checked(self, prompt, param: str) -> list[int]:
        """The engine's own prompt checks (empty, vocabulary, context), naming ``param``."""
        try:
            return self.engine.prompt_ids(prompt, field=param)
        except ParamError as exc:
            raise RequestError(str(exc), exc.field) from None
