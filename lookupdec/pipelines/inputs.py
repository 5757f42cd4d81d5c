"""Records for batch pipelines, read from ``.jsonl`` files, text files and folders.

What a record is:

- ``.jsonl`` file: one record per non-blank line, a JSON object whose ``field`` (``"text"``)
  holds the text. Its id is the object's ``"id"`` (a string or an integer) if it has one, else
  ``PATH:LINE``. A line that is not a JSON object with a string ``field`` is still a record,
  one that fails: it carries an ``error`` naming the file and line, and is reported, not run.
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
from typing import Iterator, Sequence

from lookupdec.index.corpus import BINARY_SNIFF_BYTES, DEFAULT_EXCLUDE

SPLITS = ("lines", "paragraphs", "file")
INPUT_HASH_CHARS = 16  # hex digits of SHA-256 kept in ``input_hash`` (64 bits: no accidental clash)


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
        for record in self._records():
            if record.id in first_at:
                record = self._duplicate(record, first_at)
            first_at[record.id] = record.where
            records.append(record)
        return records

    @staticmethod
    def _duplicate(record: Record, first_at: dict) -> Record:
        """A second record with an id already used fails under its position as id."""
        if record.where == record.id:
            raise InputError(f"{record.where}: read twice (a file named twice, or also inside a folder named?)")
        if record.where in first_at:
            raise InputError(f"{record.where}: id {record.id!r} is used twice, and so is {record.where!r}; "
                             "give the records unique ids")
        return Record(record.where, record.text, record.where,
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
        text = self._text(path, in_folder=in_folder)
        if text is None:
            return
        if path.endswith(".jsonl"):
            yield from self._jsonl(path, text)
        elif self.options.split == "file":
            if text.strip():
                yield Record(path, text, path)
        else:
            yield from self._blocks(path, text)

    def _text(self, path: str, *, in_folder: bool) -> str | None:
        """The file's text; None (skipped, counted) for a folder file that is not text."""
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except OSError as exc:
            reason = exc.strerror or str(exc)
        else:
            if b"\0" in raw[:BINARY_SNIFF_BYTES]:
                reason = "binary file"
            else:
                try:
                    return raw.decode("utf-8-sig")  # (a byte-order mark some editors write first: dropped)
                except UnicodeDecodeError as exc:
                    reason = f"not UTF-8 text (byte {exc.start})"
        if not in_folder:
            raise InputError(f"--input {path}: {reason}")
        self.skipped_files.append(f"{path} ({reason})")
        return None

    def _jsonl(self, path: str, text: str) -> Iterator[Record]:
        name = self.options.field
        for number, line in enumerate(text.split("\n"), start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
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
