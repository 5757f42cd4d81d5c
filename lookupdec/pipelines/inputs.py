"""Records for batch pipelines, read from ``.jsonl`` files, text files and folders.

What a record is:

- ``.jsonl`` file: one record per non-blank line, a JSON object whose ``field`` (``"text"``)
  holds the text. Its id is the object's ``"id"`` (a string or an integer) if it has one, else
  ``PATH:LINE``. A line that is not a JSON object with a string ``field`` is still a record,
  one that fails: it carries an ``error`` naming the file and line, and is reported, not run.
  So is a line that is not UTF-8 (in a ``.jsonl`` named directly: in a folder the file is
  skipped, as below), and one whose text holds a lone surrogate (``"\\ud800"``: valid JSON,
  but no text UTF-8 can encode).
- Other text file, by ``split``:
  ``"lines"``: every ``lines_per_record`` non-blank lines form a record, id ``PATH:LINE`` of
  its first line (log files: one line, or a few, per record);
  ``"paragraphs"``: blocks of lines separated by blank lines, id ``PATH:LINE``;
  ``"file"``: the whole file, id ``PATH``.
- Folder: every file under it, recursively, in sorted order, read as above (``.git``,
  ``__pycache__`` and the like left out). Binary and non-UTF-8 files in a folder are skipped
  and counted; named directly they are an error.

``PATH`` is the path as given (normalised), joined with the file's path inside a folder: run
the same command from the same folder and the ids are the same, which is what resuming needs.
A record whose id an earlier record has (a repeated ``"id"``, or an ``"id"`` that names another
line's ``PATH:LINE``) fails, under its ``PATH:LINE`` as id, or ``PATH:LINE#2`` (``#3``, ...)
where an earlier record took that one. Only the same file read twice (named twice, or also
inside a folder named) is an ``InputError``.
Line numbers start at 1 and count ``\\n`` only, as editors and ``wc -l`` do.

Example: ``app.log`` holding ``"a\\nb\\n\\nc\\n"`` read with ``split="lines",
lines_per_record=2`` gives ``Record("app.log:1", "a\\nb")`` and ``Record("app.log:4", "c")``.
"""
from __future__ import annotations

import fnmatch
import hashlib
import json
import os
from dataclasses import dataclass, field, replace
from typing import Iterable, Iterator, Sequence

from lookupdec.index.corpus import BINARY_SNIFF_BYTES, DEFAULT_EXCLUDE
from lookupdec.validate import ParamError, check_unicode

SPLITS = ("lines", "paragraphs", "file")
INPUT_HASH_CHARS = 16  # hex digits of SHA-256 kept in ``input_hash`` (64 bits: no accidental clash)
BOM = b"\xef\xbb\xbf"  # the UTF-8 byte-order mark some editors write first: dropped


class InputError(ValueError):
    """An input the user named cannot be read as records (bad path, binary file, ...)."""


def input_hash(text: str) -> str:
    """Short SHA-256 of a record's text: ``input_hash`` in output lines."""
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:INPUT_HASH_CHARS]


@dataclass(frozen=True)
class Record:
    id: str  # unique among the records of one run
    text: str  # the record's text ("" for a record that failed to read)
    where: str  # PATH:LINE (or PATH) where the record starts, for messages
    error: str | None = None  # why the record cannot be run (bad JSON line, ...), else None
    group: str | None = None  # records that belong together (the file, or --group-by's value): Ray affinity

    @property
    def input_hash(self) -> str:
        return input_hash(self.text)


@dataclass(frozen=True, kw_only=True)
class ReadOptions:
    """How files become records (see the module docstring)."""

    field: str = "text"  # .jsonl: the object field holding the text
    split: str = "lines"  # other text files: "lines", "paragraphs" or "file"
    lines_per_record: int = 1  # split="lines": non-blank lines per record
    group_by: str | None = None  # .jsonl: the field whose value groups records (default: the file)

    def __post_init__(self) -> None:
        if self.split not in SPLITS:
            raise ValueError(f"split={self.split!r}: must be one of {', '.join(SPLITS)}")
        if not isinstance(self.lines_per_record, int) or self.lines_per_record < 1:
            raise ValueError(f"lines_per_record={self.lines_per_record!r}: must be an integer >= 1")
        if not self.field:
            raise ValueError("field='': must name the .jsonl field holding the text")
        if self.group_by == "":
            raise ValueError("group_by='': must name a .jsonl field (or be None: records grouped by file)")


@dataclass
class RecordReader:
    """``read()`` gives every record of ``paths`` in order, ids unique; ``skipped_files`` then
    names the folder files that were not text. ``ignore``: files never read as input (the
    pipeline's own output file and its temporary file, should they sit in an input folder)."""

    paths: Sequence[str]
    options: ReadOptions = field(default_factory=ReadOptions)
    ignore: Sequence[str] = ()
    skipped_files: list[str] = field(default_factory=list)  # "PATH (reason)"

    def read(self) -> list[Record]:
        records, first_at = [], {}  # id -> where it was first used
        read_at = set()  # every record's PATH:LINE, its own: met again, a file is read twice
        for record in self._records():
            if record.where in read_at:
                raise InputError(f"{record.where}: read twice (a file named twice, or also inside a folder named?)")
            read_at.add(record.where)
            if record.id in first_at:
                record = self._duplicate(record, first_at)
            first_at[record.id] = record.where
            records.append(record)
        return records

    @staticmethod
    def _duplicate(record: Record, first_at: dict) -> Record:
        """A second record with an id already used fails, under its position as id (or, where an
        earlier record took that as its id, the position with ``#2``, ``#3``, ...)."""
        rid, n = record.where, 1
        while rid in first_at:
            n += 1
            rid = f"{record.where}#{n}"
        return Record(rid, record.text, record.where,
                      f"{record.where}: duplicate id {record.id!r} (first at {first_at[record.id]})", record.group)

    def _records(self) -> Iterator[Record]:
        ignored = {os.path.realpath(p) for p in self.ignore}
        for path in self.paths:
            if os.path.isdir(path):
                for file in self._walk(path):
                    if os.path.realpath(file) not in ignored:
                        yield from self._file(file, in_folder=True)
            elif os.path.exists(path):
                if os.path.realpath(path) in ignored:
                    raise InputError(f"--input {path} is the output file")
                yield from self._file(os.path.normpath(path), in_folder=False)
            else:
                raise InputError(f"--input {path}: no such file or folder")

    @staticmethod
    def _walk(root: str) -> Iterator[str]:
        def excluded(name: str) -> bool:
            return any(fnmatch.fnmatch(name, pattern) for pattern in DEFAULT_EXCLUDE)

        found = []
        for folder, dirs, files in os.walk(os.path.normpath(root)):
            dirs[:] = [d for d in dirs if not excluded(d)]
            found.extend(os.path.join(folder, name) for name in files if not excluded(name))
        yield from sorted(found, key=lambda path: path.split(os.sep))  # a/z.md before b.txt, as `find | sort`

    def _file(self, path: str, *, in_folder: bool) -> Iterator[Record]:
        """The file's records, each in the file's group unless ``group_by`` gave it another."""
        for record in self._file_records(path, in_folder=in_folder):
            yield record if record.group is not None else replace(record, group=path)

    def _file_records(self, path: str, *, in_folder: bool) -> Iterator[Record]:
        raw = self._bytes(path, in_folder=in_folder)
        if raw is None:
            return
        if path.endswith(".jsonl"):
            # named directly, a line that is not UTF-8 is one record that fails; in a folder the
            # file is skipped, as any file that is not UTF-8 text
            if not in_folder or self._text(path, raw, in_folder=True) is not None:
                yield from self._jsonl(path, raw.removeprefix(BOM).split(b"\n"))
            return
        text = self._text(path, raw, in_folder=in_folder)
        if text is None:
            return
        if self.options.split == "file":
            if text.strip():
                yield Record(path, text, path)
        else:
            yield from self._blocks(path, text)

    def _bytes(self, path: str, *, in_folder: bool) -> bytes | None:
        """The file's bytes; None (skipped, counted) for a folder file that is not text."""
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except OSError as exc:
            return self._not_text(path, exc.strerror or str(exc), in_folder=in_folder)
        if b"\0" in raw[:BINARY_SNIFF_BYTES]:
            return self._not_text(path, "binary file", in_folder=in_folder)
        return raw

    def _text(self, path: str, raw: bytes, *, in_folder: bool) -> str | None:
        """The file's text; None (skipped, counted) for a folder file that is not UTF-8."""
        body = raw.removeprefix(BOM)
        try:
            return body.decode("utf-8")
        except UnicodeDecodeError as exc:
            return self._not_text(path, f"not UTF-8 text (byte {exc.start + len(raw) - len(body)})",
                                  in_folder=in_folder)

    def _not_text(self, path: str, reason: str, *, in_folder: bool) -> None:
        if not in_folder:
            raise InputError(f"--input {path}: {reason}")
        self.skipped_files.append(f"{path} ({reason})")
        return None

    def _jsonl(self, path: str, lines: Iterable[bytes]) -> Iterator[Record]:
        name = self.options.field
        for number, data in enumerate(lines, start=1):
            where = f"{path}:{number}"
            try:
                line = data.decode("utf-8")
            except UnicodeDecodeError as exc:
                column = len(data[:exc.start].decode("utf-8")) + 1  # (in characters, as JSON's errors count)
                yield Record(where, data.decode("utf-8", "replace"), where,
                             f"{where}: not UTF-8 text (byte 0x{data[exc.start]:02x} at column {column})")
                continue
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                yield Record(where, line, where, f"{where}: not valid JSON ({exc.msg}, column {exc.colno})")
                continue
            if not isinstance(obj, dict) or not isinstance(obj.get(name), str):
                what = "not a JSON object" if not isinstance(obj, dict) else f"no string field {name!r}"
                yield Record(where, line, where, f"{where}: {what}")
                continue
            rid = obj.get("id", where)
            if isinstance(rid, bool) or not isinstance(rid, (str, int)):
                yield Record(where, line, where, f"{where}: \"id\" must be a string or an integer, not {rid!r}")
                continue
            try:  # a lone surrogate ("\\ud800") is valid JSON, but no text a tokenizer takes
                check_unicode(name, obj[name])
            except ParamError as exc:
                yield Record(where, line, where, f"{where}: {exc}")
                continue
            group = obj.get(self.options.group_by) if self.options.group_by else None
            if group is not None and not isinstance(group, str):
                group = json.dumps(group, ensure_ascii=False, sort_keys=True)
            yield Record(str(rid), obj[name], where, group=group)

    def _blocks(self, path: str, text: str) -> Iterator[Record]:
        """split="lines" (groups of non-blank lines) or "paragraphs" (runs of non-blank lines)."""
        per_record = self.options.lines_per_record if self.options.split == "lines" else None
        block: list[str] = []
        start = 0
        for number, line in enumerate(text.split("\n"), start=1):
            line = line.removesuffix("\r")
            if line.strip():
                start = start if block else number
                block.append(line)
            if block and (len(block) == per_record or (per_record is None and not line.strip())):
                yield Record(f"{path}:{start}", "\n".join(block), f"{path}:{start}")
                block = []
        if block:
            yield Record(f"{path}:{start}", "\n".join(block), f"{path}:{start}")


def read_records(paths: Sequence[str], options: ReadOptions | None = None, *,
                 ignore: Sequence[str] = ()) -> tuple[list[Record], list[str]]:
    """(records, skipped folder files as "PATH (reason)"); see ``RecordReader``."""
    reader = RecordReader(list(paths), options or ReadOptions(), ignore)
    return reader.read(), reader.skipped_files
