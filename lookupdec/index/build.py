"""``build_index``: corpus → tokens → chunks → embeddings → FAISS → a store folder, atomically.

Everything is written into a temporary folder beside the destination and renamed into place at
the very end, so an interrupted build (an exception, Ctrl-C, a kill) never leaves a folder that
looks like an index: the destination either does not exist or is the old, complete index.
"""
from __future__ import annotations

import datetime
import json
import logging
import math
import os
import shutil
import stat
import tempfile
import time
from typing import Sequence

import numpy as np

from lookupdec.index.corpus import CorpusReader
from lookupdec.index.embed import check_dim, make_embedder
from lookupdec.index.store import (FILES, FORMAT_VERSION, MANIFEST, MANIFEST_HASH, SEPARATOR, IndexStoreError,
                                   file_sha256, import_faiss, manifest_sha256)
from lookupdec.tokens import vocab_fingerprint
from lookupdec.version import __version__

log = logging.getLogger("lookupdec")

FLAT_MAX_CHUNKS = 50_000  # "auto": exact (flat) search below this many chunks, HNSW above
EMBED_BATCH = 2048  # chunks embedded per batch
HNSW_M = 32  # graph degree
HNSW_EF_CONSTRUCTION = 80
HNSW_EF_SEARCH = 256  # recall@32 vs exact on the stdlib index: ef 64/128/256/512 -> 0.84/0.91/0.96/0.99
IVF_POINTS_PER_LIST = 64  # nlist ~ chunks / this, within [1, 4 sqrt(chunks)]
IVF_NPROBE_SHARE = 1 / 4  # lists searched per query (stdlib, recall@32: 1/8 -> 0.80, 1/4 -> 0.90, 1/2 -> 0.98)


def gpu_available() -> tuple[bool, str]:
    faiss = import_faiss()
    if not hasattr(faiss, "StandardGpuResources"):
        return False, f"this FAISS ({faiss.__version__}) is built without GPU support: install faiss-gpu"
    if faiss.get_num_gpus() < 1:
        return False, "FAISS has GPU support but sees no CUDA device"
    return True, ""


def build_faiss(vectors: np.ndarray, kind: str = "auto", gpu: bool = False):
    """A FAISS index over unit ``vectors`` (inner product = cosine). Returns (index, manifest info)."""
    faiss = import_faiss()
    n, dim = vectors.shape
    if kind == "auto":
        kind = "flat" if n < FLAT_MAX_CHUNKS else "hnsw"
    info: dict = {"kind": kind, "metric": "inner_product", "search": {}}
    if kind == "flat":
        index = faiss.IndexFlatIP(dim)
    elif kind == "ivf":
        nlist = max(1, min(int(4 * math.sqrt(n)), n // IVF_POINTS_PER_LIST))
        index = faiss.IndexIVFFlat(faiss.IndexFlatIP(dim), dim, nlist, faiss.METRIC_INNER_PRODUCT)
        info.update(nlist=nlist)
        info["search"]["nprobe"] = max(1, math.ceil(nlist * IVF_NPROBE_SHARE))
    elif kind == "hnsw":
        index = faiss.IndexHNSWFlat(dim, HNSW_M, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = HNSW_EF_CONSTRUCTION
        info.update(M=HNSW_M, efConstruction=HNSW_EF_CONSTRUCTION)
        info["search"]["efSearch"] = HNSW_EF_SEARCH
    else:
        raise ValueError(f"--faiss {kind!r}: expected auto, flat, ivf or hnsw")
    info["gpu"] = False
    if gpu:
        ok, why = gpu_available()
        if not ok:
            raise ValueError(f"--gpu: {why}")
        if kind == "hnsw":
            log.warning("--gpu: FAISS has no GPU HNSW; building the HNSW index on the CPU")
        else:
            resources = faiss.StandardGpuResources()
            gpu_index = faiss.index_cpu_to_gpu(resources, 0, index)
            if not gpu_index.is_trained:
                gpu_index.train(vectors)
            gpu_index.add(vectors)
            info["gpu"] = True
            return faiss.index_gpu_to_cpu(gpu_index), info
    if not index.is_trained:
        index.train(vectors)
    index.add(vectors)
    return index, info


def chunk_documents(doc_lengths: Sequence[int], chunk_tokens: int) -> np.ndarray:
    """Rows (start, end, document) over a store where documents follow one another, each
    followed by one separator. Chunks never cross a document boundary; a document's last
    chunk may be shorter."""
    rows, start = [], 0
    for d, length in enumerate(doc_lengths):
        for s in range(0, length, chunk_tokens):
            rows.append((start + s, start + min(s + chunk_tokens, length), d))
        start += length + 1
    return np.array(rows, dtype=np.int64).reshape(-1, 3)


def build_index(paths: Sequence[str], *, tokenizer, out: str, chunk_tokens: int = 256,
                embedder: str = "hash", dim: int | None = None, faiss_kind: str = "auto", gpu: bool = False,
                include: Sequence[str] = (), exclude: Sequence[str] = (), field: str = "text",
                force: bool = False, progress: bool = True) -> dict:
    """Build an index folder at ``out``; returns its manifest. ``tokenizer``: the model's, loaded
    by the caller (``lookupdec.model.load_tokenizer``); its ``name_or_path`` is recorded."""
    from tqdm import tqdm

    out = check_build_args(out=out, force=force, chunk_tokens=chunk_tokens, dim=dim, faiss_kind=faiss_kind)
    faiss = import_faiss()
    if gpu:
        ok, why = gpu_available()
        if not ok:
            raise ValueError(f"--gpu: {why}")
    remove_leftovers(out)
    emb = make_embedder(embedder, tokenizer.decode, dim=dim)
    started = time.time()

    reader = CorpusReader(paths, include=include, exclude=exclude, text_field=field)
    files = list(reader.files())
    total = sum(os.path.getsize(f) for f in files if os.path.exists(f))
    docs, names, doc_ids = [], [], []
    with tqdm(total=total, unit="B", unit_scale=True, desc="tokenize", disable=not progress) as bar:
        last = 0
        for doc in reader.documents():
            ids = tokenizer.encode(doc.text, add_special_tokens=False)
            if ids:
                docs.append(np.asarray(ids, dtype=np.int32))
                names.append(doc.name)
                doc_ids.append(doc.source)
            if len(reader.sources) != last:
                bar.update(sum(s.bytes for s in reader.sources[last:]))
                last = len(reader.sources)
    reader.warn_skipped()
    if not docs:
        raise ValueError(f"no text found in {', '.join(map(str, paths))} "
                         f"({len(files)} files; skipped: {reader.skipped or 'none'})")

    lengths = [len(d) for d in docs]
    tokens = np.concatenate([np.append(d, np.int32(SEPARATOR)) for d in docs])
    chunks = chunk_documents(lengths, chunk_tokens)
    check_memory(len(chunks), emb.dim)
    chunk_list = [tokens[s:e] for s, e, _ in chunks]
    emb.fit(chunk_list)
    vectors = np.zeros((len(chunks), emb.dim), np.float32)
    with tqdm(total=len(chunks), unit="chunk", desc="embed", disable=not progress) as bar:
        for b in range(0, len(chunks), EMBED_BATCH):
            vectors[b : b + EMBED_BATCH] = emb.features(chunk_list[b : b + EMBED_BATCH])
            bar.update(min(EMBED_BATCH, len(chunks) - b))
    if progress:
        log.info("building the FAISS index over %d chunks", len(chunks))
    index, faiss_info = build_faiss(vectors, faiss_kind, gpu)

    parent = os.path.dirname(out)
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.building-{os.getpid()}-", dir=parent)
    except OSError as exc:
        raise IndexStoreError(f"--out {out}: cannot create a folder in {parent} ({exc.strerror})") from None
    try:
        np.save(os.path.join(tmp, "tokens.npy"), tokens)
        np.save(os.path.join(tmp, "chunks.npy"), chunks)
        np.save(os.path.join(tmp, "embedder.npy"), emb.state())
        with open(os.path.join(tmp, "documents.json"), "w", encoding="utf-8") as f:
            json.dump(names, f)
        faiss.write_index(index, os.path.join(tmp, "faiss.index"))
        manifest = {
            "format_version": FORMAT_VERSION,
            "tokenizer": {"fingerprint": vocab_fingerprint(tokenizer),
                          "path": _abspath(getattr(tokenizer, "name_or_path", None))},
            "embedder": emb.params(),
            "chunking": {"chunk_tokens": chunk_tokens, "document_separator": SEPARATOR},
            "counts": {"sources": len(reader.sources), "documents": len(docs), "chunks": int(len(chunks)),
                       "tokens": int(len(tokens)), "skipped": dict(reader.skipped)},
            "faiss": faiss_info,
            "files": {name: {"bytes": os.path.getsize(os.path.join(tmp, name)),
                             "sha256": file_sha256(os.path.join(tmp, name))} for name in FILES},
            "sources": [{"path": s.path, "bytes": s.bytes, "sha256": s.sha256, "documents": s.documents}
                        for s in reader.sources],
            "build": {"created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                      "seconds": round(time.time() - started, 3), "lookupdec": __version__,
                      "faiss": faiss.__version__, "include": list(include), "exclude": list(exclude),
                      "field": field, "inputs": [os.path.abspath(p) for p in paths]},
        }
        manifest[MANIFEST_HASH] = manifest_sha256(manifest)
        with open(os.path.join(tmp, MANIFEST), "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        _replace(tmp, out)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, OSError):  # a full disk, a folder made read-only meanwhile: one line, not a traceback
            raise IndexStoreError(f"--out {out}: cannot write the index ({exc.strerror or exc})") from None
        raise
    return manifest


def _abspath(path) -> str | None:
    return os.path.abspath(path) if path else None


def check_build_args(*, out: str, force: bool, chunk_tokens: int = 256, dim: int | None = None,
                     faiss_kind: str = "auto") -> str:
    """The checks of ``build_index``'s arguments that need no tokenizer, model or corpus (the CLI
    runs them before loading anything); returns ``out`` made absolute. An existing ``out`` needs
    ``force`` and must be an index (``not_an_index``); the nearest existing folder above ``out``
    must be a writable folder (not a file where a folder of the path should be)."""
    if chunk_tokens < 8:
        raise ValueError(f"--chunk-tokens {chunk_tokens}: must be >= 8")
    check_dim(dim)
    if faiss_kind not in ("auto", "flat", "ivf", "hnsw"):
        raise ValueError(f"--faiss {faiss_kind!r}: expected auto, flat, ivf or hnsw")
    out = os.path.abspath(out)
    if os.path.lexists(out):
        if not force:
            raise ValueError(f"{out} already exists (pass --force to replace it)")
        why = not_an_index(out)
        if why:
            raise IndexStoreError(f"{out} exists and is not a lookupdec index ({why}): not replacing it")
    ancestor = os.path.dirname(out)  # where the build's temporary folder goes
    while not os.path.lexists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor):
        raise IndexStoreError(f"--out {out}: {ancestor} is not a folder")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise IndexStoreError(f"--out {out}: cannot create it in {ancestor} (not writable)")
    return out


def not_an_index(path: str) -> str | None:
    """Why ``--force`` must not replace the existing ``path``, or None when it may: only a folder
    that is empty, or that holds a manifest (a JSON object whose ``files`` names index files) and
    nothing but that manifest and index files it names (``FILES``), all regular files. Whatever
    else a folder holds (a web app's own ``manifest.json`` and its pages, say) would be lost."""
    if not os.path.isdir(path):  # a link to an index folder: the link is replaced, its target kept
        return "not a folder"
    try:
        entries = os.listdir(path)
    except OSError as exc:
        return f"cannot list it: {exc.strerror}"
    if not entries:
        return None
    if MANIFEST not in entries:
        return f"no {MANIFEST}"
    try:
        with open(os.path.join(path, MANIFEST), encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError, RecursionError):
        return f"its {MANIFEST} is not readable JSON"
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not files or not set(files) <= set(FILES):
        return f"its {MANIFEST} does not list index files"
    for entry in sorted(entries):
        if entry != MANIFEST and entry not in files:
            return f"it holds {entry!r}, which its {MANIFEST} does not list"
        try:
            regular = stat.S_ISREG(os.lstat(os.path.join(path, entry)).st_mode)
        except OSError as exc:
            return f"cannot stat {entry!r}: {exc.strerror}"
        if not regular:
            return f"{entry!r} is not a regular file"
    return None


def available_memory() -> int | None:
    """Bytes this machine can still give: RAM available plus free swap (``/proc/meminfo``), or
    None where that is not known."""
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.split()[1:2]}
        return info["MemAvailable"] + info.get("SwapFree", 0)
    except (OSError, KeyError, ValueError, IndexError):
        return None


def check_memory(chunks: int, dim: int) -> None:
    """Refuse, before allocating, a build whose vectors cannot fit in memory: the float32 matrix
    of ``chunks`` x ``dim`` twice (ours and FAISS's copy) plus an embedding batch's float64 work
    arrays (four of ``EMBED_BATCH`` x ``dim``). An estimate of the largest arrays, not a bound on
    the whole build."""
    need = 2 * chunks * dim * 4 + 4 * min(chunks, EMBED_BATCH) * dim * 8
    have = available_memory()
    if have is not None and need > have:
        raise ValueError(f"--dim {dim}: the vectors of {chunks} chunks of dimension {dim} need about "
                         f"{need / 2**30:.1f} GiB, more than the {have / 2**30:.1f} GiB of memory available; "
                         "use a smaller --dim (or a larger --chunk-tokens)")


def _replace(tmp: str, out: str) -> None:
    """Move the finished ``tmp`` folder to ``out`` (replacing an old index only now, and only an
    index: ``not_an_index``, checked again as the folder may have changed during the build)."""
    if not os.path.lexists(out):
        os.rename(tmp, out)
        return
    why = not_an_index(out)
    if why:
        raise IndexStoreError(f"{out} exists and is not a lookupdec index ({why}): not replacing it")
    old = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.old-{os.getpid()}-", dir=os.path.dirname(out))
    os.rename(out, os.path.join(old, "index"))
    os.rename(tmp, out)
    shutil.rmtree(old, ignore_errors=True)


LEGACY_QUIET_S = 15 * 60  # a leftover without a pid (older lookupdec) untouched this long is dead


def remove_leftovers(out: str) -> list[str]:
    """Remove the temporary folders that interrupted builds to ``out`` left beside it
    (``.NAME.building-PID-*``; ``.NAME.old-PID-*`` once ``out`` exists again), saying so on the
    log. Only those whose build is over: its process ``PID`` is gone (a build running now keeps
    its folder). A folder of an older lookupdec (no PID in its name) goes once nothing in it
    changed for ``LEGACY_QUIET_S``. Returns the folders removed."""
    parent, base = os.path.dirname(out), os.path.basename(out)
    try:
        entries = sorted(os.listdir(parent))
    except OSError:
        return []
    removed = []
    for entry in entries:
        kind = next((k for k in ("building", "old") if entry.startswith(f".{base}.{k}-")), None)
        path = os.path.join(parent, entry)
        if kind is None or os.path.islink(path) or not os.path.isdir(path):
            continue
        if kind == "old" and not os.path.exists(out):  # the previous index, moved aside: keep it
            log.warning("%s holds the index that was at %s before an interrupted build replaced it; "
                        "move %s/index back to %s to keep it", path, out, path, out)
            continue
        pid_text, dash, _ = entry[len(f".{base}.{kind}-"):].partition("-")
        if dash and pid_text.isdigit():
            if _process_alive(int(pid_text)):
                continue
            why = f"its build (process {pid_text}) is gone"
        else:
            quiet = time.time() - _newest_mtime(path)
            if quiet < LEGACY_QUIET_S:
                continue
            why = f"left by an older lookupdec, untouched for {quiet / 60:.0f} min"
        size = _folder_bytes(path)
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.exists(path):
            removed.append(path)
            log.warning("removed %s (%.1f MB), the temporary folder of an interrupted build: %s",
                        path, size / 1e6, why)
    return removed


def _process_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):  # someone else's process: alive
        return True
    return True


def _newest_mtime(path: str) -> float:
    newest = os.path.getmtime(path)
    for root, _, files in os.walk(path):
        for name in files:
            try:
                newest = max(newest, os.path.getmtime(os.path.join(root, name)))
            except OSError:
                pass
    return newest


def _folder_bytes(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                pass
    return total
