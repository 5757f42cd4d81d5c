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
from dataclasses import dataclass
from typing import Callable, Sequence

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
        _expect(path, "documents.json", isinstance(documents, list) and len(documents) == counts["documents"],
                f"expected {counts['documents']} document names")
        if len(chunks):
            _expect(path, "chunks.npy", chunks[:, 0].min() >= 0 and chunks[:, 1].max() <= len(tokens)
                    and bool(np.all(chunks[:, 0] < chunks[:, 1])), "chunk offsets outside the token store")
        embedder = embedder_from_manifest(manifest["embedder"], state, decode)
        faiss = import_faiss()
        try:
            faiss_index = faiss.read_index(os.path.join(path, "faiss.index"))
        except RuntimeError as exc:
            raise IndexStoreError(f"{path}/faiss.index: not a readable FAISS index ({str(exc).splitlines()[0]})") from None
        _expect(path, "faiss.index", faiss_index.ntotal == counts["chunks"] and faiss_index.d == embedder.dim,
                f"holds {faiss_index.ntotal} vectors of dim {faiss_index.d}; expected {counts['chunks']} of dim {embedder.dim}")
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
    if not os.path.isdir(path):
        raise IndexStoreError(f"{path}: no index folder here")
    mpath = os.path.join(path, MANIFEST)
    try:
        with open(mpath, encoding="utf-8") as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise IndexStoreError(f"{mpath}: missing (not a lookupdec index, or an interrupted build)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise IndexStoreError(f"{mpath}: not a readable manifest ({exc})") from None
    if not isinstance(manifest, dict):
        raise IndexStoreError(f"{mpath}: not a JSON object")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise IndexStoreError(f"{mpath}: format_version {version!r}; this lookupdec reads {FORMAT_VERSION}")
    for key in ("tokenizer", "embedder", "chunking", "counts", "faiss", "files", "sources"):
        if key not in manifest:
            raise IndexStoreError(f"{mpath}: field {key!r} missing")
    if MANIFEST_HASH in manifest and manifest[MANIFEST_HASH] != manifest_sha256(manifest):
        raise IndexStoreError(f"{mpath}: edited after the build (its {MANIFEST_HASH} does not match its "
                              "content); rebuild the index")
    return manifest


def check_files(path: str, manifest: dict, *, hashes: bool) -> list[str]:
    """Every file of the manifest present with its size (and SHA-256 if ``hashes``); returns
    the names checked. Raises ``IndexStoreError`` on the first problem."""
    files = manifest["files"]
    for name in FILES:
        if name not in files:
            raise IndexStoreError(f"{path}/{MANIFEST}: file {name!r} not listed")
    for name, meta in files.items():
        fpath = os.path.join(path, name)
        try:
            size = os.path.getsize(fpath)
        except OSError:
            raise IndexStoreError(f"{fpath}: missing") from None
        if size != meta["bytes"]:
            raise IndexStoreError(f"{fpath}: {size} bytes, the manifest says {meta['bytes']} (truncated or replaced)")
        if hashes and file_sha256(fpath) != meta["sha256"]:
            raise IndexStoreError(f"{fpath}: SHA-256 differs from the manifest (the file was edited)")
    return sorted(files)
