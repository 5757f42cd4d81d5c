"""The on-disk index (``indexes/README.md`` documents the format) and opening it.

``Index.open`` checks everything before any draft is made: the manifest parses and has a known
``format_version``; every listed file is there with its recorded size (and, by default, its
SHA-256); the tokenizer fingerprint matches the model's; the arrays and the FAISS index agree with
the counts. Any failure raises ``IndexStoreError`` (a ``ValueError``) naming the folder, the file
and the problem.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from dataclasses import dataclass
from typing import Callable, NoReturn, Sequence

import numpy as np

from lookupdec.tokens import SEPARATOR  # noqa: F401  (between documents in tokens.npy)

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
FILES = ("tokens.npy", "chunks.npy", "documents.json", "embedder.npy", "faiss.index")
HASH_BLOCK = 1 << 22
MANIFEST_HASH = "manifest_sha256"  # the manifest's own hash, over its other fields (manifest_sha256())


class IndexStoreError(ValueError):
    """An index folder that cannot be used as it is."""


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(HASH_BLOCK), b""):
            digest.update(block)
    return digest.hexdigest()


def import_faiss():
    try:
        import faiss
    except ImportError:
        raise IndexStoreError("retrieval indexes need FAISS: pip install faiss-cpu "
                              "(or lookupdec[faiss]; faiss-gpu on CUDA machines)") from None
    return faiss


@dataclass(frozen=True)
class Hit:
    chunk: int
    score: float


class Index:
    """An opened index: ``search_tokens`` finds chunks near a token sequence; ``chunk_tokens``
    returns a chunk's tokens (memory-mapped)."""

    def __init__(self, path: str, manifest: dict, tokens: np.ndarray, chunks: np.ndarray,
                 documents: list[str], embedder, faiss_index) -> None:
        self.path, self.manifest = path, manifest
        self.tokens, self.chunks, self.documents = tokens, chunks, documents
        self.embedder, self.faiss_index = embedder, faiss_index

    # -- opening --------------------------------------------------------------------------------
    @classmethod
    def open(cls, path: str | os.PathLike, *, tokenizer_fingerprint: str | None = None,
             check_hashes: bool = True, decode: Callable[[Sequence[int]], str] | None = None) -> "Index":
        from lookupdec.index.embed import embedder_from_manifest

        path = os.fspath(path)
        manifest = read_manifest(path)
        if tokenizer_fingerprint is not None and manifest["tokenizer"]["fingerprint"] != tokenizer_fingerprint:
            raise IndexStoreError(
                f"{path}: index built for tokenizer {manifest['tokenizer']['fingerprint']} "
                f"({manifest['tokenizer'].get('path', '?')}), but this model's tokenizer is {tokenizer_fingerprint}")
        check_files(path, manifest, hashes=check_hashes)
        counts = manifest["counts"]
        try:
            tokens = np.load(os.path.join(path, "tokens.npy"), mmap_mode="r")
            chunks = np.load(os.path.join(path, "chunks.npy"))
            state = np.load(os.path.join(path, "embedder.npy"))
            with open(os.path.join(path, "documents.json"), encoding="utf-8") as f:
                documents = json.load(f)
        except (OSError, ValueError) as exc:
            raise IndexStoreError(f"{path}: cannot read the index arrays ({exc})") from None
        _expect(path, "tokens.npy", tokens.dtype == np.int32 and tokens.shape == (counts["tokens"],),
                f"expected {counts['tokens']} int32 tokens, found {tokens.shape} {tokens.dtype}")
        _expect(path, "chunks.npy", chunks.ndim == 2 and chunks.shape == (counts["chunks"], 3),
                f"expected {counts['chunks']} rows of (start, end, document), found {chunks.shape}")
        _expect(path, "chunks.npy", chunks.dtype.kind in "iu", f"expected integer offsets, found {chunks.dtype}")
        _expect(path, "documents.json", isinstance(documents, list) and len(documents) == counts["documents"]
                and all(isinstance(d, str) for d in documents), f"expected {counts['documents']} document names")
        if len(chunks):
            _expect(path, "chunks.npy", chunks[:, 0].min() >= 0 and chunks[:, 1].max() <= len(tokens)
                    and bool(np.all(chunks[:, 0] < chunks[:, 1])), "chunk offsets outside the token store")
            _expect(path, "chunks.npy", chunks[:, 2].min() >= 0 and chunks[:, 2].max() < len(documents),
                    f"document numbers outside the {len(documents)} of documents.json")
        idf_tokens = manifest["embedder"].get("idf_tokens", 0)
        _expect(path, "embedder.npy", state.dtype.kind == "f" and state.shape == (idf_tokens,),
                f"expected {idf_tokens} float values (the manifest's embedder.idf_tokens), "
                f"found {state.shape} {state.dtype}")
        embedder = embedder_from_manifest(manifest["embedder"], state, decode)
        faiss = import_faiss()
        try:
            faiss_index = faiss.read_index(os.path.join(path, "faiss.index"))
        except RuntimeError as exc:
            raise IndexStoreError(f"{path}/faiss.index: not a readable FAISS index ({str(exc).splitlines()[0]})") from None
        _expect(path, "faiss.index", faiss_index.ntotal == counts["chunks"] and faiss_index.d == embedder.dim,
                f"holds {faiss_index.ntotal} vectors of dim {faiss_index.d}; expected {counts['chunks']} of dim {embedder.dim}")
        kind = manifest["faiss"]["kind"]
        classes = {"flat": faiss.IndexFlat, "ivf": faiss.IndexIVF, "hnsw": faiss.IndexHNSW}
        _expect(path, "faiss.index", isinstance(faiss_index, classes[kind]),
                f"a {type(faiss_index).__name__}, not the {kind} index the manifest's faiss.kind says")
        params = manifest["faiss"].get("search", {})
        if "nprobe" in params:
            faiss_index.nprobe = int(params["nprobe"])
        if "efSearch" in params:
            faiss_index.hnsw.efSearch = int(params["efSearch"])
        return cls(path, manifest, tokens, chunks, documents, embedder, faiss_index)

    # -- use ------------------------------------------------------------------------------------
    @property
    def num_chunks(self) -> int:
        return len(self.chunks)

    def embed(self, token_ids: Sequence[int]) -> np.ndarray:
        return self.embedder.features([np.asarray(token_ids, dtype=np.int64)])

    def search(self, vectors: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """FAISS search: (scores [q, k], chunk ids [q, k], -1 where fewer than k exist)."""
        k = max(1, min(int(k), self.num_chunks))
        return self.faiss_index.search(np.ascontiguousarray(vectors, dtype=np.float32), k)

    def search_tokens(self, token_ids: Sequence[int], k: int) -> list[Hit]:
        if not len(token_ids) or not self.num_chunks:
            return []
        scores, ids = self.search(self.embed(token_ids), k)
        return [Hit(int(i), float(s)) for s, i in zip(scores[0], ids[0]) if i >= 0]

    def chunk_tokens(self, chunk: int) -> np.ndarray:
        start, end, _ = self.chunks[chunk]
        return np.asarray(self.tokens[start:end], dtype=np.int64)

    def next_chunk(self, chunk: int) -> int | None:
        """The chunk that follows ``chunk`` in the same document, if any."""
        nxt = chunk + 1
        return nxt if nxt < self.num_chunks and self.chunks[nxt, 2] == self.chunks[chunk, 2] else None

    def document_name(self, chunk: int) -> str:
        return self.documents[int(self.chunks[chunk, 2])]


def _expect(path: str, name: str, ok: bool, problem: str) -> None:
    if not ok:
        raise IndexStoreError(f"{path}/{name}: {problem}")


def manifest_sha256(manifest: dict) -> str:
    """SHA-256 of the manifest's canonical JSON (keys sorted, no spaces, ASCII), every field but
    ``manifest_sha256`` itself: an edit to any field (say, the tokenizer fingerprint) changes it.
    It catches accidental or careless edits, not a forger, who can recompute it."""
    body = {k: v for k, v in manifest.items() if k != MANIFEST_HASH}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode("ascii")).hexdigest()


def manifest_hashed(manifest: dict) -> bool:
    """Whether the manifest carries its own hash (indexes built before it was added do not;
    ``read_manifest`` has checked it when it is there)."""
    return MANIFEST_HASH in manifest


def read_manifest(path: str) -> dict:
    """The manifest of the index folder ``path``, checked whole: it parses, has a known
    ``format_version``, matches its ``manifest_sha256`` where it has one, and every field has the
    type and range ``check_manifest`` requires, so that nothing after this meets a malformed one.
    Any problem raises ``IndexStoreError`` naming the manifest and the field."""
    if not os.path.isdir(path):
        raise IndexStoreError(f"{path}: no index folder here")
    mpath = os.path.join(path, MANIFEST)
    try:
        with open(mpath, encoding="utf-8") as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise IndexStoreError(f"{mpath}: missing (not a lookupdec index, or an interrupted build)") from None
    except (OSError, ValueError, RecursionError) as exc:  # ValueError: bad JSON or UTF-8, a 5000-digit number
        raise IndexStoreError(f"{mpath}: not a readable manifest ({exc})") from None
    if not isinstance(manifest, dict):
        raise IndexStoreError(f"{mpath}: not a JSON object")
    version = manifest.get("format_version")
    if type(version) is not int or version != FORMAT_VERSION:  # JSON true == 1 in Python: not a version
        raise IndexStoreError(f"{mpath}: format_version {version!r}; this lookupdec reads {FORMAT_VERSION}")
    for key in ("tokenizer", "embedder", "chunking", "counts", "faiss", "files", "sources"):
        if key not in manifest:
            raise IndexStoreError(f"{mpath}: field {key!r} missing")
    if MANIFEST_HASH in manifest and manifest[MANIFEST_HASH] != manifest_sha256(manifest):
        raise IndexStoreError(f"{mpath}: edited after the build (its {MANIFEST_HASH} does not match its "
                              "content); rebuild the index")
    check_manifest(mpath, manifest)
    return manifest


# -- the manifest's fields ------------------------------------------------------------------------
# Every field the readers use, with its type and range. Unknown fields are ignored (a later
# lookupdec may add some under the same format_version, as manifest_sha256 was added); a known
# field of another type or outside its range is an error naming it.
FAISS_KINDS = ("flat", "ivf", "hnsw")
FAISS_SEARCH = {"flat": (), "ivf": ("nprobe",), "hnsw": ("efSearch",)}  # search parameters per kind
FAISS_PARAM_MAX = 2**31 - 1  # FAISS stores these as C ints
SHA256_HEX = re.compile(r"[0-9a-f]{64}")
_MISSING = object()  # what _Fields.get returns for an absent optional field


class _Fields:
    """Typed reads of one manifest object, each failure an ``IndexStoreError`` naming the field by
    its dotted path (``counts.tokens``, ``files.tokens.npy.bytes``). ``optional``: the field may be
    absent (``None`` then); present, it must have its type."""

    def __init__(self, mpath: str, obj, name: str) -> None:
        self.mpath, self.name = mpath, name
        if not isinstance(obj, dict):
            self.fail(name, f"expected an object, found {_show(obj)}")
        self.obj = obj

    def fail(self, field: str, problem: str) -> NoReturn:
        raise IndexStoreError(f"{self.mpath}: field {field!r}: {problem}")

    def path(self, key: str) -> str:
        return f"{self.name}.{key}" if self.name else key

    def get(self, key: str, *, optional: bool = False):
        if key not in self.obj:
            if optional:
                return _MISSING
            raise IndexStoreError(f"{self.mpath}: field {self.path(key)!r} missing")
        return self.obj[key]

    def sub(self, key: str, *, optional: bool = False) -> "_Fields | None":
        value = self.get(key, optional=optional)
        return None if value is _MISSING else _Fields(self.mpath, value, self.path(key))

    def integer(self, key: str, low: int = 0, high: int | None = None, *, optional: bool = False) -> int | None:
        value = self.get(key, optional=optional)
        if value is _MISSING:
            return None
        if type(value) is not int or value < low or (high is not None and value > high):  # JSON true is no integer
            bounds = f"in [{low}, {high}]" if high is not None else f">= {low}"
            self.fail(self.path(key), f"expected an integer {bounds}, found {_show(value)}")
        return value

    def string(self, key: str, *, optional: bool = False, null: bool = False, choices: Sequence[str] | None = None,
               sha256: bool = False) -> str | None:
        value = self.get(key, optional=optional)
        if value is _MISSING or (value is None and null):
            return None
        if not isinstance(value, str) or (choices is not None and value not in choices) or \
                (sha256 and not SHA256_HEX.fullmatch(value)):
            expected = (f"one of {', '.join(choices)}" if choices is not None else
                        "a SHA-256 (64 lowercase hex digits)" if sha256 else "a string")
            self.fail(self.path(key), f"expected {expected}, found {_show(value)}")
        return value


def _show(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_manifest(mpath: str, manifest: dict) -> None:
    """Check the type and range of every field the readers use (``indexes/README.md`` lists them);
    raises ``IndexStoreError`` naming the first bad one."""
    from lookupdec.index.embed import EMBEDDER_NAMES, MAX_DIM, MAX_ORDER

    top = _Fields(mpath, manifest, "")
    tokenizer = top.sub("tokenizer")
    tokenizer.string("fingerprint")
    tokenizer.string("path", optional=True, null=True)

    embedder = top.sub("embedder")
    name = embedder.string("name", choices=EMBEDDER_NAMES)
    if name == "hash":
        embedder.integer("dim", 8, MAX_DIM)
        orders = embedder.get("orders")
        if not isinstance(orders, list) or not orders or \
                any(type(o) is not int or not 1 <= o <= MAX_ORDER for o in orders):
            embedder.fail("embedder.orders", f"expected a non-empty list of integers in [1, {MAX_ORDER}], "
                          f"found {_show(orders)}")
        embedder.integer("seed", 0, 2**64 - 1)
        embedder.integer("idf_tokens", 0)
    else:
        embedder.string("path")
        embedder.integer("dim", 1, MAX_DIM)

    chunking = top.sub("chunking")
    chunking.integer("chunk_tokens", 1)
    chunking.integer("document_separator", 0)

    counts = top.sub("counts")
    for key in ("sources", "documents", "chunks", "tokens"):
        counts.integer(key, 0)
    skipped = counts.sub("skipped")
    for reason in skipped.obj:
        skipped.integer(reason, 0)

    faiss = top.sub("faiss")
    kind = faiss.string("kind", choices=FAISS_KINDS)
    faiss.string("metric", choices=("inner_product",))
    for key in ("nlist", "M", "efConstruction"):
        faiss.integer(key, 1, FAISS_PARAM_MAX, optional=True)
    if "gpu" in faiss.obj and not isinstance(faiss.obj["gpu"], bool):
        faiss.fail("faiss.gpu", f"expected true or false, found {_show(faiss.obj['gpu'])}")
    search = faiss.sub("search", optional=True)
    if search is not None:
        for key in search.obj:
            if key not in FAISS_SEARCH[kind]:
                search.fail(f"faiss.search.{key}", f"not a search parameter of a {kind} index")
            search.integer(key, 1, FAISS_PARAM_MAX)

    files = top.sub("files")
    for fname in files.obj:
        if fname not in FILES:
            files.fail("files", f"lists {fname!r}, not a file of a format_version {FORMAT_VERSION} index "
                       f"({', '.join(FILES)})")
    for fname in FILES:
        meta = files.sub(fname)
        meta.integer("bytes", 0)
        meta.string("sha256", sha256=True)

    sources = top.get("sources")
    if not isinstance(sources, list):
        top.fail("sources", f"expected a list, found {_show(sources)}")
    for i, source in enumerate(sources):
        entry = _Fields(mpath, source, f"sources.{i}")
        entry.string("path")
        entry.integer("bytes", 0)
        entry.string("sha256", sha256=True)
        entry.integer("documents", 0)

    top.sub("build", optional=True)  # what info prints of it, it prints as it is


def check_files(path: str, manifest: dict, *, hashes: bool) -> list[str]:
    """Every file of the manifest (checked by ``read_manifest``) present as a regular file with its
    size (and SHA-256 if ``hashes``); returns the names checked. Raises ``IndexStoreError`` on the
    first problem."""
    files = manifest["files"]
    for name in FILES:
        if name not in files:
            raise IndexStoreError(f"{path}/{MANIFEST}: file {name!r} not listed")
    for name, meta in files.items():
        fpath = os.path.join(path, name)
        try:
            st = os.stat(fpath)
        except OSError:
            raise IndexStoreError(f"{fpath}: missing") from None
        if not stat.S_ISREG(st.st_mode):
            raise IndexStoreError(f"{fpath}: not a regular file")
        if st.st_size != meta["bytes"]:
            raise IndexStoreError(f"{fpath}: {st.st_size} bytes, the manifest says {meta['bytes']} "
                                  "(truncated or replaced)")
        try:
            if hashes and file_sha256(fpath) != meta["sha256"]:
                raise IndexStoreError(f"{fpath}: SHA-256 differs from the manifest (the file was edited)")
        except OSError as exc:
            raise IndexStoreError(f"{fpath}: unreadable ({exc.strerror})") from None
    return sorted(files)
