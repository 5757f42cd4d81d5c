"""A JSON cache file that only ever is a regular file.

The cost cache (``budget.py``: measured cost curves, kernel forms) lives at a path a user may
set to anything (``$LOOKUPDEC_COST_CACHE``): a device (``/dev/null`` to turn it off, ``/dev/full``),
a FIFO, a folder, a huge file. The rules:

- only a regular file of at most ``MAX_BYTES`` is read, and only a regular file (or nothing) is
  replaced; anything else is one warning for the process and the cache is off for that path;
- a write goes to a temporary file beside the cache, then renames over it (readers see the old
  document or the new one, never half of one); a failed write removes its temporary file and is
  one warning for the process, not one per write.

No torch import: the CLI reads this before loading anything heavy.
"""
from __future__ import annotations

import json
import logging
import os
import stat
import tempfile

log = logging.getLogger("lookupdec")

MAX_BYTES = 16 << 20  # a cost cache holds a few dozen bounded entries: far below this

_warned: set[tuple[str, str]] = set()  # (path, what) warned about in this process


def _warn_once(path: str, what: str, message: str) -> None:
    if (path, what) not in _warned:
        _warned.add((path, what))
        log.warning("%s", message)


def usable(path: str) -> bool:
    """Whether ``path`` may be read and replaced: nothing there yet, or a regular file of at most
    ``MAX_BYTES`` (a symlink counts as what it points to). Otherwise warns once and says no."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return True
    except OSError as exc:  # (a parent that is a file, a loop of symlinks, no permission)
        _warn_once(path, "kind", f"cost cache {path} unusable ({exc.strerror or exc}): the cache is off for this run")
        return False
    if not stat.S_ISREG(info.st_mode):
        _warn_once(path, "kind", f"cost cache {path} is not a regular file (a folder, device or pipe): "
                                 "the cache is off for this run; set LOOKUPDEC_COST_CACHE to a file path, or to 'off'")
        return False
    if info.st_size > MAX_BYTES:
        _warn_once(path, "kind", f"cost cache {path} holds {info.st_size} bytes, more than a cost cache's "
                                 f"{MAX_BYTES}: not ours, left alone; the cache is off for this run")
        return False
    return True


def read(path: str) -> object | None:
    """The JSON document at ``path``, or None (nothing there, not usable, unreadable)."""
    if not usable(path) or not os.path.exists(path):
        return None
    try:
        # O_NONBLOCK: a FIFO swapped in after ``usable`` opens without waiting for a writer
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                return None
            data = f.read(MAX_BYTES + 1)
        if len(data) > MAX_BYTES:
            return None
        return json.loads(data.decode("utf-8"))
    except (OSError, ValueError) as exc:  # (UnicodeDecodeError is a ValueError)
        log.debug("cost cache %s unreadable (%r)", path, exc)
        return None


def write(path: str, doc: object) -> None:
    """Replace ``path`` with ``doc`` as JSON, atomically (see the module's rules); a path that is
    not usable is left as it is."""
    if not usable(path):
        return
    tmp = None
    try:
        folder = os.path.dirname(os.path.abspath(path))
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=folder)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1)
        if not usable(path):  # (became something else meanwhile)
            return
        os.replace(tmp, path)
        tmp = None
    except (OSError, ValueError, TypeError) as exc:
        _warn_once(path, "write", f"could not write the cost cache {path}: {exc}")
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
