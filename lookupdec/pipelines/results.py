"""The output of a batch pipeline: JSON Lines, one line per record id, safe against kills.

Contract (what "resumable" rests on):

- **Whole lines only.** The file is opened with ``O_APPEND`` and each result goes out as ONE
  ``os.write`` of the complete encoded line, newline included. A killed process (even
  SIGKILL) leaves whole lines; data handed to ``write`` survives the process. Lines are
  ``fsync``-ed at most every ``FSYNC_INTERVAL_S`` seconds and on close, so a machine crash or
  power cut loses at most the last second of lines, and at worst leaves a torn last line.
- **Repair on open.** A last line without its newline (torn by a crash, a full disk, or an
  editor) is cut off (the file is truncated to the last complete line) and its record done
  again, unless it is a complete result line, which is kept and given its newline. Any other
  line that is not a result object (``{"id": str, ...}``), or an id on two lines, is an error
  naming the file and line: that file was not written by this code alone, and nothing is cut.
- **One line per id.** ``drop(ids)`` removes lines (records to redo, e.g. failed ones) by
  writing the kept lines to ``PATH.tmp``, ``fsync`` and renaming it over ``PATH``: a kill
  leaves the old file or the new one, never a mix.
- **One writer.** An exclusive ``flock`` (Unix) on the file keeps a second run off it (both
  inodes stay locked across a ``drop``); a second run fails at once with a clear error.
"""
from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import time
from dataclasses import dataclass

try:
    import fcntl
except ImportError:  # not Unix: no lock (a second concurrent run is then the user's problem)
    fcntl = None

log = logging.getLogger("lookupdec")

FSYNC_INTERVAL_S = 1.0  # most seconds between fsyncs of written lines (and one on close)
TMP_SUFFIX = ".tmp"  # drop() writes PATH + TMP_SUFFIX, then renames it over PATH


class ResultsFileError(ValueError):
    """The output file cannot be used (another run holds it, a line is not ours, ...)."""


@dataclass(frozen=True)
class Entry:
    line: int  # 1-based line number in the file when it was opened
    ok: bool  # True: a result; False: the line holds an "error"
    input_hash: str | None
    job: str | None = None  # the job that wrote it (``rewrite.job_id``; None: a line from before jobs)


class ResultsFile:
    """Open with ``ResultsFile.open(path)``; ``entries`` maps each id in the file to its line;
    ``append(obj)`` writes one line; ``close()`` fsyncs and releases the lock."""

    def __init__(self, path: str, fd: int, entries: dict[str, Entry], repaired: str | None) -> None:
        self.path = path
        self.entries = entries
        self.repaired = repaired  # what open() cut or fixed, for the user (None: nothing)
        self._fd = fd
        self._held = [fd]  # every fd whose lock we keep until close (old inodes after drop())
        self._last_sync = time.monotonic()

    # -- opening ----------------------------------------------------------------------------------
    @classmethod
    def open(cls, path: str) -> "ResultsFile":
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            raise ResultsFileError(f"--output {path}: folder {folder} does not exist")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError as exc:
            raise ResultsFileError(f"--output {path}: {exc.strerror}") from None
        try:
            _lock(fd, path)
            if os.path.exists(path + TMP_SUFFIX):  # left by a run killed inside drop(): never renamed
                os.unlink(path + TMP_SUFFIX)
            entries, repaired = _scan_and_repair(fd, path)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd, entries, repaired)

    # -- writing ----------------------------------------------------------------------------------
    def append(self, obj: dict) -> None:
        """Write ``obj`` as one whole line (one ``os.write``). A failed write (a full disk) is a
        ``ResultsFileError`` and leaves no part of the line behind (the file is cut back)."""
        line = encode_line(obj)
        size = os.fstat(self._fd).st_size
        try:
            _write_all(self._fd, line)  # a second write only after a short one (full disk)
            if time.monotonic() - self._last_sync >= FSYNC_INTERVAL_S:
                _fsync(self._fd)
                self._last_sync = time.monotonic()
        except OSError as exc:
            with contextlib.suppress(OSError):  # not on a device such as /dev/full
                os.ftruncate(self._fd, size)
            raise ResultsFileError(f"--output {self.path}: cannot write ({exc.strerror or exc}); "
                                   "lines written before are kept, rerun to resume") from None

    def drop(self, ids) -> None:
        """Remove the lines of these ids, atomically (temporary file, fsync, rename)."""
        ids = set(ids) & set(self.entries)
        if not ids:
            return
        tmp = self.path + TMP_SUFFIX
        try:
            new_fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
        except OSError as exc:
            raise ResultsFileError(f"--output {self.path}: cannot write {tmp} ({exc.strerror or exc})") from None
        try:
            _lock(new_fd, tmp)
            kept = [line for line in _read_lines(self._fd) if line.strip() and _line_id(line) not in ids]
            _write_all(new_fd, b"".join(kept))
            os.fsync(new_fd)
            os.replace(tmp, self.path)
        except BaseException as exc:
            os.close(new_fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp)  # the old file is untouched: the run can be done again
            if isinstance(exc, OSError):
                raise ResultsFileError(f"--output {self.path}: cannot write {tmp} ({exc.strerror or exc}); "
                                       "the file is as it was") from None
            raise
        _fsync_folder(self.path)
        self._held.append(new_fd)  # keep the old inode locked too: a run that opened it must fail
        self._fd = new_fd
        self.entries = {i: e for i, e in self.entries.items() if i not in ids}

    def close(self, *, quiet: bool = False) -> None:
        """fsync and release the lock. ``quiet``: a failing fsync raises nothing (the run is
        already failing for another reason, which is the one to report)."""
        if self._held:
            try:
                _fsync(self._fd)
            except OSError as exc:
                if not quiet:
                    raise ResultsFileError(f"--output {self.path}: cannot write ({exc.strerror or exc})") from None
            finally:
                for fd in self._held:
                    os.close(fd)
                self._held = []

    def __enter__(self) -> "ResultsFile":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(quiet=exc_type is not None)


RESULT_LINE_START = b'{"id": '  # how every line ``encode_line`` writes for a record begins
RESULT_LINE = 'a JSON object with string "id" and "input_hash"'  # what every result line is, for messages


def encode_line(obj: dict) -> bytes:
    """One JSON line in UTF-8 (non-ASCII kept readable; escaped if it holds lone surrogates)."""
    try:
        return (json.dumps(obj, ensure_ascii=False) + "\n").encode("utf-8")
    except UnicodeEncodeError:
        return (json.dumps(obj) + "\n").encode("ascii")


def read_results(path: str) -> list[dict]:
    """Every result line of a finished output file, in order (for readers and tests)."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# -- helpers ---------------------------------------------------------------------------------------
def _lock(fd: int, path: str) -> None:
    if fcntl is None:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise ResultsFileError(f"--output {path}: another run is writing to it (wait for it or "
                               "choose another --output)") from None


def _read_lines(fd: int) -> list[bytes]:
    """The file's lines, each with its ``\\n`` (the last one may lack it); split at ``\\n`` only."""
    size, chunks, offset = os.fstat(fd).st_size, [], 0
    while offset < size:  # one pread returns at most ~2 GB
        chunk = os.pread(fd, size - offset, offset)
        if not chunk:
            break
        chunks.append(chunk)
        offset += len(chunk)
    data = b"".join(chunks)
    parts = data.split(b"\n")
    return [p + b"\n" for p in parts[:-1]] + ([parts[-1]] if parts[-1] else [])


def _line_id(line: bytes):
    obj = _parse(line)
    return obj["id"] if obj is not None else None


def _parse(line: bytes) -> dict | None:
    """The result object on this line, or None if it is not one."""
    try:
        obj = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        return None
    if not (isinstance(obj, dict) and isinstance(obj.get("id"), str) and isinstance(obj.get("input_hash"), str)):
        return None
    return obj


def _scan_and_repair(fd: int, path: str) -> tuple[dict[str, Entry], str | None]:
    """The file's result lines by id, after one repair where its last line lacks its newline:
    a whole result line gets it, a torn one (the start of a result line an interrupted write
    left) is cut. Every complete line is checked first, so a file that is not a results file
    is an error with nothing cut; a last line that does not begin as a result line is one too."""
    lines = _read_lines(fd)
    unended = bool(lines) and not lines[-1].endswith(b"\n")  # (the last line lacks its newline)
    torn = lines.pop() if unended and _parse(lines[-1]) is None else None
    entries: dict[str, Entry] = {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        obj = _parse(line)
        if obj is None:
            raise ResultsFileError(f"{path}:{number}: not a result line ({RESULT_LINE}); fix or remove it, "
                                   "or choose another --output (nothing was changed)")
        if obj["id"] in entries:
            raise ResultsFileError(f"{path}: id {obj['id']!r} is on lines {entries[obj['id']].line} and "
                                   f"{number}; keep one of them")
        entries[obj["id"]] = Entry(number, "error" not in obj, obj["input_hash"], obj.get("job"))
    repaired = None
    if unended and torn is None:
        _write_all(fd, b"\n")
        repaired = f"{path}: gave the last line its missing newline"
    elif torn is not None:
        if not torn.startswith(RESULT_LINE_START):
            raise ResultsFileError(f"{path}:{len(lines) + 1}: not a result line ({RESULT_LINE}), nor the start "
                                   "of one; fix or remove it, or choose another --output (nothing was changed)")
        os.ftruncate(fd, sum(len(line) for line in lines))
        _fsync(fd)
        repaired = (f"{path}: cut a torn last line ({len(torn)} bytes, left by an interrupted run); "
                    "its record is done again")
    return entries, repaired


def _fsync(fd: int) -> None:
    """``os.fsync``, except where the file cannot be synced at all (EINVAL: a pipe or a device
    such as /dev/null): nothing to make durable there."""
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _fsync_folder(path: str) -> None:
    """Make a rename durable (POSIX); a no-op where folders cannot be opened."""
    try:
        fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
