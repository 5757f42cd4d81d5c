"""The retrieval index: build → open round trip, every corruption refused with a clear error,
interrupted builds leave nothing, the hashed embedder is deterministic, FAISS search agrees with
exact search, and the retrieval proposer drafts the corpus's continuation."""
from __future__ import annotations

import gzip
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import faiss  # the dev extra installs faiss-cpu: these tests must run, not skip
import numpy as np
import pytest

from helpers import needs_llama_tokenizer, run_cli
from lookupdec.index import FORMAT_VERSION, Index, IndexStoreError, build_index
from lookupdec.index.build import build_faiss
from lookupdec.index.embed import HashEmbedder
from lookupdec.model import load_tokenizer, vocab_fingerprint
from repo_paths import LLAMA_SP, STORIES

pytestmark = needs_llama_tokenizer

CODE = textwrap.dedent('''
    def fibonacci(n):
        """Return the n-th Fibonacci number."""
        a, b = 0, 1
        for _ in range(n):
            a, b = b, a + b
        return a


    class Registry:
        def __init__(self):
            self._items = {}

        def register(self, name, value):
            if name in self._items:
                raise KeyError(f"duplicate entry {name!r}")
            self._items[name] = value
''')


def make_corpus(root) -> str:
    """A folder with code, a README, .jsonl records, a .gz file and files to skip."""
    corpus = root / "corpus"
    (corpus / "pkg").mkdir(parents=True)
    (corpus / "pkg" / "core.py").write_text(CODE)
    (corpus / "pkg" / "util.py").write_text("\n".join(f"def helper_{i}(x):\n    return x * {i} + {i * i}\n"
                                                      for i in range(60)))
    (corpus / "README.md").write_text("# Registry\n\nA registry maps names to values. " * 20)
    (corpus / "logs.jsonl").write_text("\n".join(
        [json.dumps({"text": f"2024-01-0{i % 9 + 1} INFO worker {i} finished job {i * 7} in {i}.5s"}) for i in range(40)]
        + ["{not json", json.dumps({"other": "no text field"})]) + "\n")
    with gzip.open(corpus / "old.log.gz", "wt") as f:
        f.write("\n".join(f"kernel: eth0 link up at {i} Mbps" for i in range(50)))
    (corpus / "blob.bin").write_bytes(b"\x00\x01\x02binary" * 100)
    (corpus / "latin1.txt").write_bytes("caf\xe9 cr\xe8me".encode("latin-1"))
    (corpus / "__pycache__").mkdir()
    (corpus / "__pycache__" / "core.cpython-311.pyc").write_bytes(b"\x00" * 10)
    return str(corpus)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("index")
    corpus = make_corpus(root)
    out = str(root / "idx")
    manifest = build_index([corpus], tokenizer=load_tokenizer(LLAMA_SP), out=out, chunk_tokens=32, progress=False)
    return corpus, out, manifest


def fresh_copy(built, tmp_path) -> str:
    dst = str(tmp_path / "copy")
    shutil.copytree(built[1], dst)
    return dst


# -- build and open -------------------------------------------------------------------------------
def test_round_trip_counts_and_tokens(built, llama_tokenizer):
    corpus, out, manifest = built
    index = Index.open(out, tokenizer_fingerprint=vocab_fingerprint(llama_tokenizer))
    c = manifest["counts"]
    assert manifest["format_version"] == FORMAT_VERSION
    assert c["skipped"] == {"binary": 1, "not UTF-8": 1, "bad JSON line": 1, "no string field 'text'": 1}
    assert c["sources"] == 5  # core.py, util.py, README.md, logs.jsonl, old.log.gz (the .pyc is excluded)
    assert c["documents"] == 4 + 40  # one per file, one per good .jsonl record
    assert index.num_chunks == c["chunks"] and len(index.tokens) == c["tokens"]
    # chunks tile each document, in order, without crossing a separator
    doc_names = [os.path.relpath(n, corpus) for n in index.documents]
    assert doc_names[:4] == ["README.md", "logs.jsonl:1", "logs.jsonl:2", "logs.jsonl:3"]
    core = doc_names.index(os.path.join("pkg", "core.py"))
    core_chunks = [i for i in range(index.num_chunks) if index.chunks[i, 2] == core]
    tokens = np.concatenate([index.chunk_tokens(i) for i in core_chunks]).tolist()
    assert tokens == llama_tokenizer.encode(CODE, add_special_tokens=False)
    assert all(index.next_chunk(a) == b for a, b in zip(core_chunks, core_chunks[1:]))
    assert index.next_chunk(core_chunks[-1]) is None
    assert all(len(index.chunk_tokens(i)) <= 32 for i in range(index.num_chunks))
    # sources carry sizes and hashes of the raw files (the .gz compressed)
    gz = next(s for s in manifest["sources"] if s["path"].endswith("old.log.gz"))
    assert gz["bytes"] == os.path.getsize(os.path.join(corpus, "old.log.gz"))


def test_every_chunk_retrieves_itself_first(built):
    index = Index.open(built[1])
    hits = [index.search_tokens(index.chunk_tokens(i).tolist(), 1)[0] for i in range(index.num_chunks)]
    # identical chunks (repeated README text) may tie; the top hit must have the same tokens
    for i, hit in enumerate(hits):
        assert np.array_equal(index.chunk_tokens(hit.chunk), index.chunk_tokens(i)), i
        assert hit.score == pytest.approx(1.0, abs=1e-4)


def test_include_and_jsonl_field(tmp_path):
    corpus = make_corpus(tmp_path)
    m = build_index([corpus], tokenizer=load_tokenizer(LLAMA_SP), out=str(tmp_path / "py"), include=["*.py"], progress=False)
    assert m["counts"]["sources"] == 2 and m["counts"]["skipped"] == {}
    records = tmp_path / "r.jsonl"
    records.write_text(json.dumps({"body": "alpha beta gamma"}) + "\n" + json.dumps({"text": "x"}) + "\n")
    m = build_index([str(records)], tokenizer=load_tokenizer(LLAMA_SP), out=str(tmp_path / "jl"), field="body", progress=False)
    assert m["counts"]["documents"] == 1 and m["counts"]["skipped"] == {"no string field 'body'": 1}
    with gzip.open(tmp_path / "r2.jsonl.gz", "wt") as f:  # .jsonl inside .gz: records, not one text
        f.write(json.dumps({"text": "first record"}) + "\n" + json.dumps({"text": "second record"}) + "\n")
    m = build_index([str(tmp_path / "r2.jsonl.gz")], tokenizer=load_tokenizer(LLAMA_SP), out=str(tmp_path / "gz"), progress=False)
    assert m["counts"]["documents"] == 2


def test_empty_corpus_and_missing_path_are_clear_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "x.bin").write_bytes(b"\x00" * 10)
    with pytest.raises(ValueError, match=r"no text found .*binary"):
        build_index([str(tmp_path / "empty")], tokenizer=load_tokenizer(LLAMA_SP), out=str(tmp_path / "o"), progress=False)
    with pytest.raises(FileNotFoundError, match="nope"):
        build_index([str(tmp_path / "nope")], tokenizer=load_tokenizer(LLAMA_SP), out=str(tmp_path / "o"), progress=False)
    assert not os.path.exists(tmp_path / "o")


def test_existing_output_needs_force(built, tmp_path):
    dst = fresh_copy(built, tmp_path)
    with pytest.raises(ValueError, match="already exists.*--force"):
        build_index([built[0]], tokenizer=load_tokenizer(LLAMA_SP), out=dst, progress=False)
    m = build_index([built[0]], tokenizer=load_tokenizer(LLAMA_SP), out=dst, chunk_tokens=64, force=True, progress=False)
    assert Index.open(dst).manifest["chunking"]["chunk_tokens"] == 64 == m["chunking"]["chunk_tokens"]
    not_index = tmp_path / "notindex"
    not_index.mkdir()
    (not_index / "precious.txt").write_text("keep me")
    with pytest.raises(IndexStoreError, match="not a lookupdec index"):
        build_index([built[0]], tokenizer=load_tokenizer(LLAMA_SP), out=str(not_index), force=True, progress=False)
    assert (not_index / "precious.txt").read_text() == "keep me"


# -- corruption -----------------------------------------------------------------------------------
def test_wrong_tokenizer_names_both_fingerprints(built):
    stories_fp = vocab_fingerprint(load_tokenizer(STORIES)) if os.path.isdir(STORIES) else "0123456789abcdef"
    with pytest.raises(IndexStoreError) as err:
        Index.open(built[1], tokenizer_fingerprint=stories_fp)
    assert built[2]["tokenizer"]["fingerprint"] in str(err.value) and stories_fp in str(err.value)


def _edit_manifest(path, edit, *, rehash=True):
    """Edit the manifest; ``rehash``: and its own hash, as a consistent (if wrong) manifest would
    have; else the edit is one the manifest hash catches."""
    from lookupdec.index.store import MANIFEST_HASH, manifest_sha256

    mpath = os.path.join(path, "manifest.json")
    with open(mpath) as f:
        manifest = json.load(f)
    edit(manifest)
    if rehash and MANIFEST_HASH in manifest:
        manifest[MANIFEST_HASH] = manifest_sha256(manifest)
    with open(mpath, "w") as f:
        json.dump(manifest, f)


@pytest.mark.parametrize("corruption, message", [
    ("version", r"format_version 99; this lookupdec reads 1"),
    ("no_manifest", r"manifest.json: missing"),
    ("bad_manifest", r"manifest.json: not a readable manifest"),
    ("missing_field", r"field 'counts' missing"),
    ("missing_file", r"faiss.index: missing"),
    ("truncated_tokens", r"tokens.npy: \d+ bytes, the manifest says \d+ \(truncated"),
    ("edited_tokens", r"tokens.npy: SHA-256 differs"),
    ("edited_faiss", r"faiss.index: SHA-256 differs"),
    ("wrong_counts", r"tokens.npy: expected \d+ int32 tokens"),
    ("garbage_faiss", r"faiss.index: not a readable FAISS index"),
    ("not_a_folder", r"no index folder here"),
])
def test_corruption_is_a_clear_error(built, tmp_path, corruption, message):
    path = fresh_copy(built, tmp_path)
    check_hashes = True
    if corruption == "version":
        _edit_manifest(path, lambda m: m.update(format_version=99))
    elif corruption == "no_manifest":
        os.remove(os.path.join(path, "manifest.json"))
    elif corruption == "bad_manifest":
        with open(os.path.join(path, "manifest.json"), "w") as f:
            f.write('{"format_version": 1, ')
    elif corruption == "missing_field":
        _edit_manifest(path, lambda m: m.pop("counts"))
    elif corruption == "missing_file":
        os.remove(os.path.join(path, "faiss.index"))
    elif corruption == "truncated_tokens":
        with open(os.path.join(path, "tokens.npy"), "r+b") as f:
            f.truncate(os.path.getsize(os.path.join(path, "tokens.npy")) - 8)
    elif corruption in ("edited_tokens", "edited_faiss"):
        name = "tokens.npy" if corruption == "edited_tokens" else "faiss.index"
        with open(os.path.join(path, name), "r+b") as f:
            f.seek(-3, os.SEEK_END)
            byte = f.read(1)
            f.seek(-3, os.SEEK_END)
            f.write(bytes([byte[0] ^ 0xFF]))
    elif corruption == "wrong_counts":
        _edit_manifest(path, lambda m: m["counts"].update(tokens=m["counts"]["tokens"] + 1))
    elif corruption == "garbage_faiss":  # sizes and hashes consistent, content not FAISS
        fpath = os.path.join(path, "faiss.index")
        with open(fpath, "wb") as f:
            f.write(b"garbage" * 10)
        from lookupdec.index.store import file_sha256
        _edit_manifest(path, lambda m: m["files"].update({"faiss.index": {"bytes": 70, "sha256": file_sha256(fpath)}}))
        check_hashes = False
    elif corruption == "not_a_folder":
        path = os.path.join(path, "absent")
    with pytest.raises(IndexStoreError, match=message):
        Index.open(path, check_hashes=check_hashes)


def test_edited_file_without_hashing_still_fails_on_structure(built, tmp_path):
    """With hashing off, a changed FAISS index that holds other vectors still fails the count check."""
    path = fresh_copy(built, tmp_path)
    index = Index.open(path)
    fewer = faiss.IndexFlatIP(index.embedder.dim)
    fewer.add(np.zeros((3, index.embedder.dim), np.float32))
    faiss.write_index(fewer, os.path.join(path, "faiss.index"))
    from lookupdec.index.store import file_sha256
    fpath = os.path.join(path, "faiss.index")
    _edit_manifest(path, lambda m: m["files"].update(
        {"faiss.index": {"bytes": os.path.getsize(fpath), "sha256": file_sha256(fpath)}}))
    with pytest.raises(IndexStoreError, match=r"holds 3 vectors"):
        Index.open(path, check_hashes=False)


def test_edited_manifest_fails_verify_and_open(built, tmp_path, capsys):
    """Issue 13: an edited tokenizer fingerprint passed `index verify` (the manifest had no hash)."""
    path = fresh_copy(built, tmp_path)
    assert run_cli(capsys, "index", "verify", path)[0] == 0
    _edit_manifest(path, lambda m: m["tokenizer"].update(fingerprint="0" * 16), rehash=False)
    code, _, err = run_cli(capsys, "index", "verify", path)
    assert code == 2 and "manifest.json: edited after the build" in err and "Traceback" not in err
    assert run_cli(capsys, "index", "info", path)[0] == 2
    with pytest.raises(IndexStoreError, match="edited after the build"):
        Index.open(path)


def test_older_index_without_manifest_hash_still_opens_and_says_so(built, tmp_path, capsys):
    path = fresh_copy(built, tmp_path)
    _edit_manifest(path, lambda m: m.pop("manifest_sha256"), rehash=False)
    Index.open(path)
    code, out, _ = run_cli(capsys, "index", "verify", path)
    assert code == 0 and "manifest not hashed" in out


def test_info_says_what_it_checked(built, tmp_path, capsys):
    """`index info` checks sizes and the manifest hash, not contents: it says so and points at verify."""
    path = fresh_copy(built, tmp_path)
    with open(os.path.join(path, "tokens.npy"), "r+b") as f:  # same size, other content
        f.seek(-3, os.SEEK_END)
        f.write(b"\xff\xff\xff")
    code, out, _ = run_cli(capsys, "index", "info", path)
    assert code == 0 and "contents not hashed" in out and f"lookupdec index verify {path}" in out
    code, _, err = run_cli(capsys, "index", "info", path, "--json")
    assert code == 0 and "contents not hashed" in err
    assert run_cli(capsys, "index", "verify", path)[0] == 2
    with open(os.path.join(path, "tokens.npy"), "r+b") as f:
        f.truncate(100)
    code, _, err = run_cli(capsys, "index", "info", path)
    assert code == 2 and "truncated" in err


# -- interrupted builds ---------------------------------------------------------------------------
def test_exception_during_write_leaves_no_index(built, tmp_path, monkeypatch):
    import lookupdec.index.build as build_mod

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(build_mod, "file_sha256", boom)
    out = tmp_path / "idx"
    with pytest.raises(KeyboardInterrupt):
        build_index([built[0]], tokenizer=load_tokenizer(LLAMA_SP), out=str(out), progress=False)
    assert os.listdir(tmp_path) == []  # neither the index nor a temporary folder
    old = fresh_copy(built, tmp_path)
    with pytest.raises(KeyboardInterrupt):
        build_index([built[0]], tokenizer=load_tokenizer(LLAMA_SP), out=old, force=True, chunk_tokens=64, progress=False)
    assert Index.open(old).manifest["chunking"]["chunk_tokens"] == 32  # the old index, intact


def test_sigkill_mid_build_leaves_no_index(built, tmp_path):
    """A real kill -9 while the files are being written: no folder appears at --out."""
    out, flag = tmp_path / "idx", tmp_path / "writing"
    script = textwrap.dedent(f"""
        import time, lookupdec.index.build as b
        from lookupdec.model import load_tokenizer
        real = b.file_sha256
        def slow(path):
            open({str(flag)!r}, "w").close()
            time.sleep(60)
            return real(path)
        b.file_sha256 = slow
        b.build_index([{built[0]!r}], tokenizer=load_tokenizer({LLAMA_SP!r}), out={str(out)!r}, progress=False)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script])
    try:
        deadline = time.time() + 60
        while not flag.exists() and time.time() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert flag.exists(), "the build never reached the write phase"
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        proc.kill()
    assert not out.exists()
    leftovers = [n for n in os.listdir(tmp_path) if n.startswith(".idx.building-")]
    assert len(leftovers) == 1  # the killed build's temporary folder, never mistaken for an index
    with pytest.raises(IndexStoreError, match="no index folder here"):
        Index.open(str(out))
    build_index([built[0]], tokenizer=load_tokenizer(LLAMA_SP), out=str(out), chunk_tokens=32, progress=False)
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".idx.")]  # the next build cleaned up


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_next_build_removes_leftovers_of_dead_builds_only(built, tmp_path, caplog):
    """A killed build leaves `.NAME.building-PID-*`; the next build to the same --out removes it
    (saying so) but leaves a folder whose build is still running, and an older lookupdec's
    folder that changed recently."""
    dead = tmp_path / f".idx.building-{dead_pid()}-abc123"
    running = tmp_path / f".idx.building-{os.getpid()}-def456"
    legacy_old, legacy_new = tmp_path / ".idx.building-zz9x_q1w", tmp_path / ".idx.building-newone12"
    other = tmp_path / f".other.building-{dead_pid()}-x"
    for folder in (dead, running, legacy_old, legacy_new, other):
        folder.mkdir()
        (folder / "tokens.npy").write_bytes(b"\0" * 1000)
    hour_ago = time.time() - 3600
    os.utime(legacy_old / "tokens.npy", (hour_ago, hour_ago))
    os.utime(legacy_old, (hour_ago, hour_ago))
    with caplog.at_level("WARNING", logger="lookupdec"):
        build_index([built[0]], tokenizer=load_tokenizer(LLAMA_SP), out=str(tmp_path / "idx"), chunk_tokens=32, progress=False)
    assert not dead.exists() and not legacy_old.exists()
    assert running.exists() and legacy_new.exists() and other.exists()
    assert str(dead) in caplog.text and "interrupted build" in caplog.text
    assert Index.open(str(tmp_path / "idx")).num_chunks > 0


def test_cli_build_says_it_removed_a_leftover(built, tmp_path):
    """The CLI's stderr has the line (a real process: its logging goes to stderr)."""
    leftover = tmp_path / f".idx.building-{dead_pid()}-abc123"
    leftover.mkdir()
    result = subprocess.run([sys.executable, "-m", "lookupdec", "index", "build", built[0], "--tokenizer", LLAMA_SP,
                             "--out", str(tmp_path / "idx"), "--chunk-tokens", "32"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert not leftover.exists() and f"lookupdec: removed {leftover}" in result.stderr


# -- embedder and search --------------------------------------------------------------------------
def test_hash_embedder_is_deterministic_across_processes():
    chunks = [np.arange(50) * 7 % 1000, np.array([5, 6, 7, 8]), np.array([31999, 0, 1])]
    e = HashEmbedder(dim=64)
    e.fit(chunks)
    a, b = e.features(chunks), HashEmbedder(dim=64, idf=e.state()).features(chunks)
    assert np.array_equal(a, b)
    code = ("import numpy as np; from lookupdec.index.embed import HashEmbedder\n"
            "c=[np.arange(50)*7%1000, np.array([5,6,7,8]), np.array([31999,0,1])]\n"
            "e=HashEmbedder(dim=64); e.fit(c); print(e.features(c).tobytes().hex())")
    for seed in ("0", "12345"):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env={**os.environ, "PYTHONHASHSEED": seed}).stdout.strip()
        assert bytes.fromhex(out) == a.tobytes()
    # fixed values: the hash must not change between versions (indexes on disk depend on it)
    assert np.flatnonzero(a[1]).tolist() == [13, 16, 27, 41, 43, 46, 55, 60, 63]
    assert a[1][[13, 27, 60]].tolist() == pytest.approx([0.3312, -0.2918, -0.3218], abs=1e-4)


def test_hash_embedder_rows_are_unit_and_order_aware():
    e = HashEmbedder(dim=256, orders=(1, 2, 3))
    chunks = [np.array([1, 2, 3, 4, 5, 6]), np.array([6, 5, 4, 3, 2, 1]), np.array([1, 2, 3, 4, 5, 7]), np.zeros(0, int)]
    e.fit(chunks)
    f = e.features(chunks)
    assert np.allclose(np.linalg.norm(f[:3], axis=1), 1.0) and not f[3].any()
    assert f[0] @ f[2] > f[0] @ f[1]  # shares 4 of 5 bigrams vs none (same unigrams)


@pytest.mark.parametrize("kind", ["flat", "ivf", "hnsw"])
def test_faiss_search_agrees_with_exact_search(kind):
    rng = np.random.default_rng(0)
    centers = rng.normal(size=(40, 64))
    x = centers[rng.integers(0, 40, 4000)] + 0.3 * rng.normal(size=(4000, 64))
    x = (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)
    q = x[rng.choice(4000, 100, replace=False)] + 0.05 * rng.normal(size=(100, 64)).astype(np.float32)
    q = (q / np.linalg.norm(q, axis=1, keepdims=True)).astype(np.float32)
    index, info = build_faiss(x, kind)
    assert info["kind"] == kind
    if "nprobe" in info["search"]:
        index.nprobe = info["search"]["nprobe"]
    if "efSearch" in info["search"]:
        index.hnsw.efSearch = info["search"]["efSearch"]
    k = 10
    _, got = index.search(q, k)
    exact = np.argsort(-(q @ x.T), axis=1)[:, :k]
    recall = np.mean([len(set(g) & set(e)) / k for g, e in zip(got, exact)])
    assert recall == 1.0 if kind == "flat" else recall >= 0.9, recall


def test_gpu_flag_without_faiss_gpu_is_a_clear_error(built, tmp_path):
    if hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0:
        pytest.skip("a GPU is here")
    with pytest.raises(ValueError, match=r"--gpu: .*(faiss-gpu|no CUDA device)"):
        build_index([built[0]], tokenizer=load_tokenizer(LLAMA_SP), out=str(tmp_path / "g"), gpu=True, progress=False)
    assert not (tmp_path / "g").exists()


def test_sentence_transformers_embedder_from_a_local_folder(tmp_path):
    """The optional embedder end to end, with a tiny random BERT saved as a sentence-transformers
    folder (no download): build, open, retrieve a chunk by its own text."""
    pytest.importorskip("sentence_transformers")
    from sentence_transformers import SentenceTransformer

    try:  # sentence-transformers >= 6 moved the modules
        from sentence_transformers.sentence_transformer import modules as models
    except ImportError:
        from sentence_transformers import models
    from transformers import BertConfig, BertModel, BertTokenizerFast

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [chr(c) for c in range(97, 123)] + ["def", "return"]
    (tmp_path / "vocab.txt").write_text("\n".join(vocab))
    bert = tmp_path / "bert"
    BertModel(BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=64)).save_pretrained(bert)
    BertTokenizerFast(str(tmp_path / "vocab.txt")).save_pretrained(bert)
    word = models.Transformer(str(bert))
    dim = getattr(word, "get_embedding_dimension", None) or word.get_word_embedding_dimension
    SentenceTransformer(modules=[word, models.Pooling(dim())]).save(str(tmp_path / "st"))
    corpus = make_corpus(tmp_path)
    out = str(tmp_path / "idx")
    m = build_index([corpus], tokenizer=load_tokenizer(LLAMA_SP), out=out, chunk_tokens=32,
                    embedder=f"sentence-transformers:{tmp_path / 'st'}", progress=False)
    assert m["embedder"]["name"] == "sentence-transformers" and m["embedder"]["dim"] == 32
    index = Index.open(out, decode=load_tokenizer(LLAMA_SP).decode)
    assert index.search_tokens(index.chunk_tokens(3).tolist(), 1)[0].score == pytest.approx(1.0, abs=1e-4)
