"""Chunk embedders. All return float32 rows of unit length, so inner product = cosine.

- ``HashEmbedder`` (default): hashed token n-gram features. No model, deterministic on every
  machine (a fixed 64-bit mix of the token ids, no Python ``hash``), fast (numpy, all chunks of a
  batch at once). Counts are damped (``log1p``), signed (colliding n-grams cancel rather than
  pile up) and weighted by their tokens' inverse chunk frequency, fitted on the corpus at build
  time and stored with the index, so rare identifiers and phrases decide the neighbours, not
  ``self`` and ``return``.
- ``SentenceTransformerEmbedder``: a sentence-transformers model from a local folder, on the
  decoded chunk text (optional; ``pip install sentence-transformers``).

Interface: ``fit(chunks)`` once on the whole corpus at build time; ``features(chunks)`` → the
vectors indexed and queried. ``params()`` and ``state()`` are what the manifest and
``embedder.npy`` store; ``embedder_from_manifest`` rebuilds the same embedder.
"""
from __future__ import annotations

import os
from typing import Callable, Sequence

import numpy as np

EMBEDDER_NAMES = ("hash", "sentence-transformers")
# Largest hash dimension. A chunk of ``chunk_tokens`` tokens fills at most ``len(orders) *
# chunk_tokens`` buckets, so far larger dimensions only add empty ones; each chunk costs a float64
# row of ``dim`` while its batch is embedded and a float32 row in FAISS, so a mistyped ``--dim``
# (100000000) is refused here rather than attempted as a 30 GiB allocation.
MAX_DIM = 65536
MAX_ORDER = 32  # longest n-gram hashed (each order is one pass over the batch)

_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_MUL = np.uint64(0x100000001B3)


def _splitmix(h: np.ndarray) -> np.ndarray:
    h = h ^ (h >> np.uint64(30))
    h = h * _MIX1
    h = h ^ (h >> np.uint64(27))
    h = h * _MIX2
    return h ^ (h >> np.uint64(31))


def _normalize(rows: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(rows, axis=1, keepdims=True)
    return (rows / np.maximum(norms, 1e-12)).astype(np.float32)


class HashEmbedder:
    name = "hash"

    def __init__(self, dim: int = 512, orders: Sequence[int] = (1, 2, 3), seed: int = 0,
                 idf: np.ndarray | None = None) -> None:
        if not 8 <= dim <= MAX_DIM:
            raise ValueError(f"hash embedder dim={dim}: must be in [8, {MAX_DIM}]")
        if not orders or not all(1 <= o <= MAX_ORDER for o in orders):
            raise ValueError(f"hash embedder orders={tuple(orders)}: must be in [1, {MAX_ORDER}]")
        self.dim, self.orders, self.seed = int(dim), tuple(int(o) for o in orders), int(seed)
        self.idf = None if idf is None else np.asarray(idf, dtype=np.float32)  # [vocab] per token

    def params(self) -> dict:
        return {"name": self.name, "dim": self.dim, "orders": list(self.orders), "seed": self.seed,
                "idf_tokens": 0 if self.idf is None else int(len(self.idf))}

    def state(self) -> np.ndarray:
        return self.idf if self.idf is not None else np.zeros(0, np.float32)

    def fit(self, chunks: Sequence[np.ndarray]) -> None:
        """Inverse chunk frequency of each token id over the corpus: ``log((N+1)/(df+1)) + 1``."""
        n = len(chunks)
        lengths = np.fromiter((len(c) for c in chunks), dtype=np.int64, count=n)
        tokens = np.concatenate([np.asarray(c, dtype=np.int64) for c in chunks]) if n else np.zeros(0, np.int64)
        vocab = int(tokens.max()) + 1 if len(tokens) else 1
        pairs = np.unique(np.repeat(np.arange(n, dtype=np.int64), lengths) * vocab + tokens)
        df = np.bincount(pairs % vocab, minlength=vocab).astype(np.float64)
        self.idf = (np.log((n + 1.0) / (df + 1.0)) + 1.0).astype(np.float32)

    def _token_weights(self, tokens: np.ndarray) -> np.ndarray:
        if self.idf is None:
            return np.ones(len(tokens))
        top = float(np.log(len(self.idf) + 1.0) + 1.0) if len(self.idf) else 1.0  # unseen token: rare
        inside = tokens < len(self.idf)
        return np.where(inside, self.idf[np.minimum(tokens, max(len(self.idf) - 1, 0))], top).astype(np.float64)

    def features(self, chunks: Sequence[np.ndarray]) -> np.ndarray:
        """Unit rows of damped, signed, idf-weighted n-gram counts, one per chunk (token-id arrays).

        An n-gram's weight is the mean idf of its tokens; its bucket and sign come from a 64-bit
        hash of its token ids and its order.
        """
        n = len(chunks)
        if n == 0:
            return np.zeros((0, self.dim), np.float32)
        lengths = np.fromiter((len(c) for c in chunks), dtype=np.int64, count=n)
        ids = np.concatenate([np.asarray(c, dtype=np.int64) for c in chunks]) if lengths.sum() else np.zeros(0, np.int64)
        tokens = ids.astype(np.uint64) + np.uint64(1)
        weight_sum = np.concatenate([[0.0], np.cumsum(self._token_weights(ids))])
        row = np.repeat(np.arange(n, dtype=np.int64), lengths)
        pos = np.arange(len(ids), dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        counts = np.zeros(n * self.dim, np.float64)
        h = np.full(len(ids), np.uint64(self.seed), dtype=np.uint64)
        with np.errstate(over="ignore"):
            for order in range(1, max(self.orders) + 1):
                # h[i] covers ids[i-order+1 .. i]: the previous order's hash at i-1, then ids[i]
                if order > 1:
                    h = np.concatenate([np.zeros(1, np.uint64), h[:-1]])
                h = (h * _MUL) ^ tokens
                if order not in self.orders:
                    continue
                at = np.flatnonzero(pos >= order - 1)
                mixed = _splitmix(h[at] ^ np.uint64(order * 0x9E3779B97F4A7C15 % 2**64))
                bucket = ((mixed >> np.uint64(1)) % np.uint64(self.dim)).astype(np.int64)
                weight = (weight_sum[at + 1] - weight_sum[at + 1 - order]) / order
                sign = np.where(mixed & np.uint64(1), 1.0, -1.0)
                counts += np.bincount(row[at] * self.dim + bucket, weights=sign * weight, minlength=n * self.dim)
        counts = counts.reshape(n, self.dim)
        return _normalize(np.sign(counts) * np.log1p(np.abs(counts)))


class SentenceTransformerEmbedder:
    name = "sentence-transformers"

    def __init__(self, path: str, decode: Callable[[Sequence[int]], str]) -> None:
        if not os.path.isdir(path):
            raise ValueError(f"sentence-transformers embedder: {path} is not a folder (a local model is needed)")
        try:
            from sentence_transformers import SentenceTransformer
        except ImportError:
            raise ValueError("the sentence-transformers embedder needs: pip install sentence-transformers") from None
        self.path = os.path.abspath(path)
        self._model = SentenceTransformer(self.path, local_files_only=True)
        self._decode = decode
        dim = getattr(self._model, "get_embedding_dimension", None) or self._model.get_sentence_embedding_dimension
        self.dim = int(dim())

    def params(self) -> dict:
        return {"name": self.name, "path": self.path, "dim": self.dim}

    def state(self) -> np.ndarray:
        return np.zeros(0, np.float32)

    def features(self, chunks: Sequence[np.ndarray]) -> np.ndarray:
        texts = [self._decode([int(t) for t in c]) for c in chunks]
        return _normalize(np.asarray(self._model.encode(texts), dtype=np.float32))

    def fit(self, chunks: Sequence[np.ndarray]) -> None:
        pass


def make_embedder(spec: str, decode: Callable[[Sequence[int]], str], dim: int | None = None):
    """``hash`` or ``sentence-transformers:PATH`` (the ``--embedder`` option)."""
    if spec == "hash":
        check_dim(dim)
        return HashEmbedder(dim=dim or 512)
    if spec.startswith("sentence-transformers:"):
        return SentenceTransformerEmbedder(spec.split(":", 1)[1], decode)
    raise ValueError(f"--embedder {spec!r}: expected hash or sentence-transformers:PATH")


def check_dim(dim: int | None) -> None:
    """``--dim``: None (the default, 512) or an integer in [8, ``MAX_DIM``]."""
    if dim is not None and not 8 <= dim <= MAX_DIM:
        raise ValueError(f"--dim {dim}: the hash embedder's dimension must be in [8, {MAX_DIM}] (default 512)")


def embedder_from_manifest(params: dict, state: np.ndarray, decode: Callable[[Sequence[int]], str]):
    name = params.get("name")
    if name == "hash":
        return HashEmbedder(dim=params["dim"], orders=params["orders"], seed=params["seed"],
                            idf=state if params.get("idf_tokens") else None)
    if name == "sentence-transformers":
        return SentenceTransformerEmbedder(params["path"], decode)
    raise ValueError(f"unknown embedder {name!r} in the manifest")
