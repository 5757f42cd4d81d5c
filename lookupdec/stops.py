"""Stop strings and incremental text, for ``generate`` and ``stream``.

A step can accept several tokens at once, and a stop string can span token boundaries or sit in
the middle of such a block. ``StopStrings`` finds the earliest stop string in the text with one
Aho-Corasick pass (pyahocorasick) over the part of the text that could hold a new match;
``TextAssembler`` turns the token stream into text pieces, ends the text exactly before the
first stop string and holds back any tail that could still become one, so streamed text never
shows part of a stop string.
"""
from __future__ import annotations

import re
import weakref
from typing import Sequence

import ahocorasick

# Characters a tokenizer emits for an incomplete UTF-8 sequence; wait for more tokens.
INCOMPLETE_CHAR = "\ufffd"
# SentencePiece's byte-fallback tokens: transformers decodes a run of them as one, and where the
# run's bytes are not UTF-8 every one of them becomes U+FFFD, so a run's text is known only once
# a token of another kind ends it
BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
_byte_ids: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # tokenizer -> its byte-token ids


def byte_token_ids(tokenizer) -> frozenset:
    """The ids of ``tokenizer``'s byte-fallback tokens (``<0x00>`` ... ``<0xFF>``; none for
    byte-level BPE), found once per tokenizer."""
    try:
        return _byte_ids[tokenizer]
    except (KeyError, TypeError):
        pass
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    ids = frozenset(i for token, i in vocab.items() if isinstance(token, str) and BYTE_TOKEN.fullmatch(token))
    try:
        _byte_ids[tokenizer] = ids
    except TypeError:  # (not weakly referable: found again next time)
        pass
    return ids


class StopStrings:
    """A set of stop strings.

    >>> s = StopStrings(["\\n\\n", "END"])
    >>> s.find("abc END x\\n\\n")
    4
    >>> s.holdback("value: EN")      # "EN" may become "END"
    2
    """

    def __init__(self, stop: str | Sequence[str] | None) -> None:
        from lookupdec.validate import check_stop

        stop = check_stop(stop)
        self.strings = list(dict.fromkeys(stop))
        self.max_len = max((len(s) for s in self.strings), default=0)
        self._prefixes = {s[:k] for s in self.strings for k in range(1, len(s))}
        self._automaton = None
        if self.strings:
            self._automaton = ahocorasick.Automaton()
            for s in self.strings:
                self._automaton.add_word(s, len(s))
            self._automaton.make_automaton()

    def __bool__(self) -> bool:
        return bool(self.strings)

    def find(self, text: str, start: int = 0) -> int | None:
        """Index where the earliest stop string in ``text`` begins, among those ending at or
        after ``start`` (text before ``start`` was already searched); ``None`` if there is none."""
        if self._automaton is None:
            return None
        begin = max(0, start - self.max_len + 1)
        best = None
        for end, length in self._automaton.iter(text, begin):
            first = end - length + 1
            if best is not None and end - self.max_len + 1 > best:
                break  # no later match can start before the best one
            if best is None or first < best:
                best = first
        return best

    def holdback(self, text: str) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
        for k in range(min(len(text), self.max_len - 1), 0, -1):
            if text[-k:] in self._prefixes:
                return k
        return 0


class TextAssembler:
    """Token ids in, text pieces out: incremental detokenization plus stop strings.

    Decodes a window that starts a few tokens back (``_prefix``) so that tokenizers which
    treat a leading space specially (SentencePiece) decode exactly as the whole text would. The
    window starts at a token with text of its own, whole characters (``_start``): one that
    decodes to nothing (a special token skipped) would leave the next word at the start of the
    window, where SentencePiece drops its space, and the text would depend on how the tokens
    were grouped into steps. Nor is it a byte-fallback token, and a step ending in one shows
    nothing yet: a run of them decodes as one (``BYTE_TOKEN``).
    """

    def __init__(self, tokenizer, stop: StopStrings) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.token_ids: list[int] = []
        self.text = ""  # all decoded text so far (truncated before a stop string once stopped)
        self.emitted = 0  # characters of ``text`` already handed out
        self.stopped = False
        self._prefix = 0  # first token of the decode window
        self._read = 0  # tokens whose text is already in ``self.text``
        self._stop_tokens = None  # tokens covering the text when a stop string was found
        self._bytes = byte_token_ids(tokenizer)

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, new_ids: Sequence[int]) -> str:
        """Append tokens; return the text that can be shown now."""
        if self.stopped:
            return ""
        self.token_ids.extend(new_ids)
        if self.token_ids and self.token_ids[-1] in self._bytes:  # (a run of byte tokens may go on)
            return ""
        before = self._decode(self.token_ids[self._prefix : self._read])
        window = self._decode(self.token_ids[self._prefix :])
        if window.endswith(INCOMPLETE_CHAR):
            return ""
        searched = len(self.text)
        self.text += window[len(before) :]
        self._prefix, self._read = self._start(self._read, len(self.token_ids)), len(self.token_ids)
        at = self.stop.find(self.text, searched)
        if at is not None:
            self.text = self.text[:at]
            self.stopped = True
            self._stop_tokens = self._tokens_covering(at)
            return self._take(len(self.text))
        return self._take(len(self.text) - self.stop.holdback(self.text))

    def flush(self) -> str:
        """At the end of generation: everything not yet shown (a held-back tail included)."""
        if not self.stopped and self._read < len(self.token_ids):
            tail = self._decode(self.token_ids[self._prefix :])
            self.text += tail[len(self._decode(self.token_ids[self._prefix : self._read])) :]
            self._read = len(self.token_ids)
        return self._take(len(self.text))

    def _start(self, lo: int, hi: int) -> int:
        """The next window's first token: the last of ``[lo, hi)`` whose own text is not empty
        and does not begin inside a character, else the current one."""
        for p in range(hi - 1, lo - 1, -1):
            if self.token_ids[p] in self._bytes:
                continue
            piece = self._decode(self.token_ids[p : p + 1])
            if piece and not piece.startswith(INCOMPLETE_CHAR):
                return p
        return self._prefix

    @property
    def output_ids(self) -> list[int]:
        """The generated tokens, cut after the one where a stop string begins."""
        return self.token_ids if self._stop_tokens is None else self.token_ids[: self._stop_tokens]

    def _take(self, upto: int) -> str:
        piece = self.text[self.emitted : upto] if upto > self.emitted else ""
        self.emitted = max(self.emitted, upto)
        return piece

    def _tokens_covering(self, chars: int) -> int:
        """Fewest tokens whose text reaches ``chars`` characters (binary search on decodes).

        A prefix ending inside a multi-byte character decodes to replacement characters, so
        the length searched on is that of the complete characters (monotone in the prefix)."""
        lo, hi = 0, len(self.token_ids)
        while lo < hi:
            mid = (lo + hi) // 2
            if len(self._decode(self.token_ids[:mid]).rstrip(INCOMPLETE_CHAR)) >= chars:
                hi = mid
            else:
                lo = mid + 1
        return lo
