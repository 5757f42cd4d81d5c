"""Reading a corpus: files, folders (recursively, with include/exclude globs), ``.jsonl`` records
(one text field) and ``.gz`` files of any of these.

A file that cannot be read (or is not a regular file: a FIFO would block the build), is a
corrupt ``.gz``, is binary, or is not UTF-8 is skipped, counted and named in a warning; so is a
``.jsonl`` line that is not a JSON object with the text field, and a record whose text is not
Unicode that UTF-8 can hold (a lone surrogate such as ``"\\ud800"``, which JSON escapes allow).
``.jsonl`` lines are split on ``"\\n"`` only: a raw U+2028 or U+0085 inside a JSON string is
text, not a line break. Folders are walked in sorted order, so the same corpus always gives the
same documents in the same order.
"""
from __future__ import annotations

import fnmatch
import gzip
import hashlib
import json
import logging
import os
import re
import stat
import zlib
import dataclasses
from dataclasses import dataclass
from typing import Iterator, Sequence

log = logging.getLogger("lookupdec")

DEFAULT_EXCLUDE = (".git", ".hg", ".svn", "__pycache__", "node_modules", ".venv", ".tox", "*.pyc")
BINARY_SNIFF_BYTES = 8192  # a NUL byte in this many first bytes marks a file as binary
SURROGATE = re.compile("[\ud800-\udfff]")  # only JSON escapes put these in a str: no UTF-8 for them


@dataclass(frozen=True)
class Document:
    source: int  # index into CorpusReader.sources
    name: str  # file path, plus ":<line>" for a .jsonl record
    text: str


@dataclass
class SourceFile:
    path: str
    bytes: int
    sha256: str
    documents: int = 0


@dataclass
class CorpusReader:
    """Iterate ``documents()``; afterwards ``sources`` and ``skipped`` describe what was read.

    ``include``: globs a file must match (its path relative to the folder given, or its name) to
    be read from a folder; files named directly are always read. ``exclude``: globs for files or
    folders to leave out (``DEFAULT_EXCLUDE`` always applies).
    """

    paths: Sequence[str]
    include: Sequence[str] = ()
    exclude: Sequence[str] = ()
    text_field: str = "text"  # .jsonl: the record field holding the text
    sources: list[SourceFile] = dataclasses.field(default_factory=list)
    skipped: dict[str, int] = dataclasses.field(default_factory=dict)  # reason -> count
    skipped_examples: list[str] = dataclasses.field(default_factory=list)

    def files(self) -> Iterator[str]:
        """Every file to read, in a stable order. A path that does not exist raises."""
        for path in self.paths:
            if os.path.isfile(path):
                yield path
            elif os.path.isdir(path):
                yield from self._walk(path)
            else:
                raise FileNotFoundError(f"{path}: no such file or folder")

    def _excluded(self, rel: str) -> bool:
        name = os.path.basename(rel)
        for pattern in (*DEFAULT_EXCLUDE, *self.exclude):
            if fnmatch.fnmatch(rel, pattern) or fnmatch.fnmatch(name, pattern):
                return True
        return False

    def _walk(self, root: str) -> Iterator[str]:
        for folder, dirs, files in os.walk(root):
            rel_folder = os.path.relpath(folder, root)
            dirs[:] = sorted(d for d in dirs if not self._excluded(os.path.normpath(os.path.join(rel_folder, d))))
            for name in sorted(files):
                rel = os.path.normpath(os.path.join(rel_folder, name))
                if self._excluded(rel):
                    continue
                if self.include and not any(fnmatch.fnmatch(rel, g) or fnmatch.fnmatch(name, g) for g in self.include):
                    continue
                yield os.path.join(folder, name)

    def _skip(self, reason: str, what: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1
        if len(self.skipped_examples) < 5:
            self.skipped_examples.append(f"{what} ({reason})")

    def documents(self) -> Iterator[Document]:
        for path in self.files():
            try:
                # O_NONBLOCK: opening a FIFO must not wait for a writer; fstat then refuses it
                fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
                with open(fd, "rb") as f:
                    if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                        self._skip("not a regular file", path)
                        continue
                    raw = f.read()
            except OSError as exc:
                self._skip("unreadable", f"{path}: {exc.strerror}")
                continue
            source = SourceFile(path=os.path.abspath(path), bytes=len(raw), sha256=hashlib.sha256(raw).hexdigest())
            inner = path
            if path.endswith(".gz"):
                inner = path[: -len(".gz")]
                try:
                    raw = gzip.decompress(raw)
                except (OSError, EOFError, zlib.error) as exc:
                    self._skip("bad gzip", f"{path}: {exc}")
                    continue
            if b"\0" in raw[:BINARY_SNIFF_BYTES]:
                self._skip("binary", path)
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                self._skip("not UTF-8", path)
                continue
            index = len(self.sources)
            self.sources.append(source)
            if inner.endswith(".jsonl"):
                for doc in self._records(index, path, text):
                    source.documents += 1
                    yield doc
            elif text.strip():
                source.documents += 1
                yield Document(index, path, text)

    def _records(self, index: int, path: str, text: str) -> Iterator[Document]:
        # "\n" only: str.splitlines() also breaks at U+2028, U+0085 ..., which JSON strings may hold raw
        for n, line in enumerate(text.split("\n"), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except (ValueError, RecursionError):  # not JSON, a 5000-digit number, nesting too deep
                self._skip("bad JSON line", f"{path}:{n}")
                continue
            value = record.get(self.text_field) if isinstance(record, dict) else None
            if not isinstance(value, str):
                self._skip(f"no string field {self.text_field!r}", f"{path}:{n}")
                continue
            if SURROGATE.search(value):
                self._skip("lone surrogate (not UTF-8)", f"{path}:{n}")
                continue
            if value.strip():
                yield Document(index, f"{path}:{n}", value)

    def warn_skipped(self) -> None:
        if self.skipped:
            counts = ", ".join(f"{n} {reason}" for reason, n in sorted(self.skipped.items()))
            log.warning("skipped %s (e.g. %s)", counts, "; ".join(self.skipped_examples[:3]))
