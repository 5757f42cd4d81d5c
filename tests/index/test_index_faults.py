"""Bad input to the index commands: each is the right output or a one-line error naming the
file, field or value (CLI exit 2), never a traceback, and nothing is lost or half-written.

- ``index build --force`` replaces only a folder that is an index, never a user's folder that
  happens to hold a ``manifest.json``;
- a manifest with any field of the wrong type or shape (with or without its own hash) is an
  ``IndexStoreError`` naming the field when it is read, for ``verify``, ``info``, ``query`` and
  ``generate --index`` alike;
- unreadable corpus input (a corrupt ``.gz``, a record with a lone surrogate, a FIFO) is skipped
  and counted; ``.jsonl`` lines break at ``"\\n"`` only;
- ``--out`` under a file and an absurd ``--dim`` are refused up front.
"""
from __future__ import annotations

import gzip
import json
import os
import shutil
import threading

import pytest

from helpers import needs_llama_tokenizer, run_cli
from lookupdec.index import Index, IndexStoreError, build_index
from lookupdec.index.store import MANIFEST_HASH, file_sha256, manifest_sha256, read_manifest
from lookupdec.model import load_tokenizer
from repo_paths import LLAMA_SP, STORIES

pytestmark = needs_llama_tokenizer

TEXT = "\n".join(f"def handler_{i}(request):\n    return dispatch(request, retries={i})\n" for i in range(12))


@pytest.fixture(scope="module")
def built(tmp_path_factory, llama_tokenizer):
    root = tmp_path_factory.mktemp("faults")
    (root / "corpus").mkdir()
    (root / "corpus" / "code.py").write_text(TEXT)
    out = str(root / "idx")
    build_index([str(root / "corpus")], tokenizer=llama_tokenizer, out=out, chunk_tokens=16, progress=False)
    return str(root / "corpus"), out


def copy_index(built, tmp_path) -> str:
    dst = str(tmp_path / "copy")
    shutil.copytree(built[1], dst)
    return dst


def assert_one_line_error(code: int, err: str, *needles: str) -> None:
    assert code == 2, err
    assert err.startswith("lookupdec: error:") and err.count("\n") == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, (needle, err)


def build(paths, out, tokenizer, **kw) -> dict:
    return build_index([str(p) for p in paths], tokenizer=tokenizer, out=str(out), chunk_tokens=16, progress=False,
                       **kw)


# -- 5: --force replaces only an index ------------------------------------------------------------
def web_app(folder) -> dict:
    folder.mkdir()
    (folder / "manifest.json").write_text(json.dumps({"name": "app", "start_url": "/"}))
    (folder / "index.html").write_text("<h1>mine</h1>")
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def index_with_extra_file(folder, built) -> dict:
    shutil.copytree(built[1], folder)
    (folder / "notes.txt").write_text("my notes, next to the index")
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def manifest_listing_other_files(folder, built) -> dict:
    """A manifest whose ``files`` names files that are no index's: they must not be taken for one."""
    folder.mkdir()
    (folder / "manifest.json").write_text(json.dumps({"files": {"app.js": {"bytes": 2}}}))
    (folder / "app.js").write_text("{}")
    return {p.name: p.read_bytes() for p in folder.iterdir()}


@pytest.mark.parametrize("make, why", [
    (lambda folder, built: web_app(folder), "does not list index files"),
    (index_with_extra_file, "it holds 'notes.txt'"),
    (manifest_listing_other_files, "does not list index files"),
])
def test_force_refuses_a_folder_that_is_not_only_an_index(built, llama_tokenizer, tmp_path, capsys, make, why):
    folder = tmp_path / "site"
    before = make(folder, built)
    with pytest.raises(IndexStoreError, match="not a lookupdec index"):
        build([built[0]], folder, llama_tokenizer, force=True)
    code, _, err = run_cli(capsys, "index", "build", built[0], "--tokenizer", LLAMA_SP, "--out", folder, "--force")
    assert_one_line_error(code, err, str(folder), why)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before  # nothing lost
    assert sorted(os.listdir(tmp_path)) == ["site"]  # refused up front: no temporary folder either


def test_force_still_replaces_an_index_and_an_empty_folder(built, llama_tokenizer, tmp_path):
    old = copy_index(built, tmp_path)
    assert build([built[0]], old, llama_tokenizer, force=True, dim=64)["embedder"]["dim"] == 64
    assert Index.open(old).embedder.dim == 64
    (tmp_path / "empty").mkdir()
    build([built[0]], tmp_path / "empty", llama_tokenizer, force=True)
    assert Index.open(str(tmp_path / "empty")).num_chunks > 0


# -- 10: a malformed manifest is an error naming the field when it is read -----------------------
def _set(path, value):
    def edit(m):
        *parents, last = path
        for key in parents:
            m = m[key]
        m[last] = value
    return edit


def _drop(path):
    def edit(m):
        *parents, last = path
        for key in parents:
            m = m[key]
        del m[last]
    return edit


MANIFEST_EDITS = [  # (edit, the field the error names)
    (_set(["tokenizer"], "llama2"), "'tokenizer'"),  # was: TypeError: string indices must be integers
    (_drop(["files", "tokens.npy", "bytes"]), "'files.tokens.npy.bytes' missing"),  # was: KeyError: 'bytes'
    (_drop(["counts", "tokens"]), "'counts.tokens' missing"),  # was: KeyError: 'tokens'
    (_set(["counts", "tokens"], "12"), "'counts.tokens'"),
    (_set(["counts", "chunks"], -1), "'counts.chunks'"),
    (_set(["counts", "skipped"], ["binary"]), "'counts.skipped'"),
    (_set(["tokenizer", "fingerprint"], 5), "'tokenizer.fingerprint'"),
    (_set(["tokenizer", "path"], ["a"]), "'tokenizer.path'"),
    (_set(["format_version"], True), "format_version True"),
    (_set(["embedder", "name"], "word2vec"), "'embedder.name'"),
    (_set(["embedder", "dim"], 10**9), "'embedder.dim'"),
    (_set(["embedder", "dim"], 64.0), "'embedder.dim'"),
    (_set(["embedder", "orders"], []), "'embedder.orders'"),
    (_set(["embedder", "seed"], -1), "'embedder.seed'"),
    (_drop(["embedder", "idf_tokens"]), "'embedder.idf_tokens' missing"),
    (_set(["chunking", "chunk_tokens"], None), "'chunking.chunk_tokens'"),
    (_set(["faiss", "kind"], "annoy"), "'faiss.kind'"),
    (_set(["faiss", "search"], {"efSearch": 64}), "'faiss.search.efSearch'"),  # efSearch on a flat index
    (_set(["faiss", "search"], "fast"), "'faiss.search'"),
    (_set(["files"], ["tokens.npy"]), "'files'"),
    (_set(["files", "../../etc/passwd"], {"bytes": 1, "sha256": "0" * 64}), "'../../etc/passwd'"),
    (_set(["files", "faiss.index", "sha256"], 5), "'files.faiss.index.sha256'"),
    (_drop(["files", "chunks.npy"]), "'files.chunks.npy' missing"),
    (_set(["sources"], {"a": 1}), "'sources'"),
    (_drop(["sources", 0, "path"]), "'sources.0.path' missing"),
    (_set(["build"], "yesterday"), "'build'"),
]


def edit_manifest(path: str, edit, *, hashed: bool) -> None:
    """``hashed``: the edited manifest keeps a matching ``manifest_sha256`` (a consistent, wrong
    manifest); else it has none, as an older lookupdec's manifest, which is still read."""
    mpath = os.path.join(path, "manifest.json")
    with open(mpath) as f:
        manifest = json.load(f)
    manifest.pop(MANIFEST_HASH)
    edit(manifest)
    if hashed:
        manifest[MANIFEST_HASH] = manifest_sha256(manifest)
    with open(mpath, "w") as f:
        json.dump(manifest, f)


@pytest.mark.parametrize("hashed", [False, True], ids=["older", "rehashed"])
@pytest.mark.parametrize("edit, field", MANIFEST_EDITS, ids=[f for _, f in MANIFEST_EDITS])
def test_a_malformed_manifest_field_is_a_one_line_error(built, tmp_path, capsys, edit, field, hashed):
    path = copy_index(built, tmp_path)
    edit_manifest(path, edit, hashed=hashed)
    with pytest.raises(IndexStoreError, match="manifest.json: (field|format_version)") as err:
        read_manifest(path)
    assert field in str(err.value)
    with pytest.raises(IndexStoreError):
        Index.open(path)
    for argv in (["verify", path], ["info", path], ["info", path, "--json"], ["query", path, "--text", "def handler"]):
        code, out, err = run_cli(capsys, "index", *argv)
        assert_one_line_error(code, err, "manifest.json", field)
        assert out == ""


@pytest.mark.skipif(not os.path.isdir(STORIES), reason="stories260K absent")
@pytest.mark.parametrize("edit, field", MANIFEST_EDITS[:3], ids=[f for _, f in MANIFEST_EDITS[:3]])
def test_generate_with_a_malformed_manifest_is_a_one_line_error(built, tmp_path, capsys, edit, field):
    """An index of the model's own tokenizer, so that the malformed field, not the tokenizer, is
    what stops it (the field was a TypeError or KeyError once the model had loaded)."""
    path = str(tmp_path / "idx")
    build([built[0]], path, load_tokenizer(STORIES))
    edit_manifest(path, edit, hashed=False)
    code, out, err = run_cli(capsys, "generate", "--model", STORIES, "--prompt", "hi", "--max-new-tokens", "2",
                             "--index", path)
    assert_one_line_error(code, err, "manifest.json", field)


def test_a_manifest_that_parses_only_as_a_deep_nesting_is_unreadable(built, tmp_path, capsys):
    path = copy_index(built, tmp_path)
    with open(os.path.join(path, "manifest.json"), "w") as f:
        f.write("[" * 100_000)  # json: RecursionError
    with pytest.raises(IndexStoreError, match="not a readable manifest"):
        read_manifest(path)
    assert_one_line_error(*run_cli(capsys, "index", "verify", path)[::2], "manifest.json")


def _rewrite_file(path: str, name: str, write) -> None:
    """Replace an index file and record its new size and hash, as a consistent manifest would."""
    fpath = os.path.join(path, name)
    write(fpath)
    edit_manifest(path, _set(["files", name], {"bytes": os.path.getsize(fpath), "sha256": file_sha256(fpath)}),
                  hashed=True)


def test_files_that_disagree_with_a_consistent_manifest_are_errors(built, tmp_path, capsys):
    """What the manifest's fields promise about the files is checked when they are opened: the
    FAISS index's kind, the embedder state's length, the chunks' document numbers."""
    import numpy as np

    path = copy_index(built, tmp_path)
    edit_manifest(path, _set(["faiss"], {"kind": "hnsw", "metric": "inner_product", "search": {"efSearch": 64}}),
                  hashed=True)  # the file holds a flat index: was AttributeError: no attribute 'hnsw'
    assert_one_line_error(*run_cli(capsys, "index", "verify", path)[::2], "faiss.index", "hnsw")

    path = copy_index(built, tmp_path / "b")
    edit_manifest(path, lambda m: m["embedder"].update(idf_tokens=5), hashed=True)
    with pytest.raises(IndexStoreError, match=r"embedder.npy: expected 5 float values"):
        Index.open(path)

    path = copy_index(built, tmp_path / "c")
    chunks = np.load(os.path.join(path, "chunks.npy"))
    chunks[-1, 2] = 99  # a document documents.json does not have: was IndexError in `index query`
    _rewrite_file(path, "chunks.npy", lambda f: np.save(f, chunks))
    with pytest.raises(IndexStoreError, match=r"chunks.npy: document numbers outside"):
        Index.open(path)

    path = copy_index(built, tmp_path / "d")
    os.remove(os.path.join(path, "tokens.npy"))
    os.mkdir(os.path.join(path, "tokens.npy"))  # was IsADirectoryError while hashing
    assert_one_line_error(*run_cli(capsys, "index", "verify", path)[::2], "tokens.npy: not a regular file")


# -- 10: unreadable corpus input is skipped and counted ------------------------------------------
def test_a_corrupt_gz_is_skipped_and_counted(tmp_path, llama_tokenizer):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "code.py").write_text(TEXT)
    data = bytearray(gzip.compress(b"kernel: eth0 link up\n" * 50))
    data[10] ^= 0xFF  # the first deflate byte: zlib.error "invalid code lengths set", not an OSError
    (corpus / "bad.log.gz").write_bytes(bytes(data))
    m = build([corpus], tmp_path / "idx", llama_tokenizer)
    assert m["counts"]["skipped"] == {"bad gzip": 1} and m["counts"]["documents"] == 1


@pytest.mark.parametrize("tokenizer_path", [LLAMA_SP, STORIES], ids=["sentencepiece", "hf"])
def test_records_with_a_lone_surrogate_are_skipped_and_counted(tmp_path, tokenizer_path):
    """JSON escapes can put a lone surrogate in a string; no tokenizer takes one (sentencepiece:
    RuntimeError, HF: TypeError TextEncodeInput) and UTF-8 cannot hold it: skipped like a
    non-UTF-8 file."""
    if not os.path.exists(tokenizer_path):
        pytest.skip(f"{tokenizer_path} absent")
    records = tmp_path / "records.jsonl"
    records.write_text("\n".join([
        json.dumps({"text": "a good record about handlers"}),
        json.dumps({"text": "half an emoji \ud83d here"}),  # written escaped: "\\ud83d", valid JSON
        json.dumps({"text": "a trailing surrogate \udfff"}),
        "[" * 100_000,  # json: RecursionError
        json.dumps({"text": "another good record"}),
    ]) + "\n")
    m = build([records], tmp_path / "idx", load_tokenizer(tokenizer_path))
    assert m["counts"]["skipped"] == {"lone surrogate (not UTF-8)": 2, "bad JSON line": 1}
    names = [os.path.basename(n) for n in Index.open(str(tmp_path / "idx")).documents]
    assert names == ["records.jsonl:1", "records.jsonl:5"]


def test_jsonl_lines_break_at_newline_only(tmp_path, llama_tokenizer):
    """A raw U+2028, U+2029, U+0085 or form feed inside a JSON string is text (str.splitlines()
    broke lines there and dropped both halves as bad JSON)."""
    texts = ["first\u2028record", "second\x85record", "third\u2029record\x0cend", "fourth\r\nrecord"]
    path = tmp_path / "r.jsonl"
    path.write_bytes(("\r\n".join(json.dumps({"text": t}, ensure_ascii=False) for t in texts) + "\n").encode())
    m = build([path], tmp_path / "idx", llama_tokenizer)
    assert m["counts"]["skipped"] == {} and m["counts"]["documents"] == 4
    index = Index.open(str(tmp_path / "idx"))
    assert [os.path.basename(n) for n in index.documents] == [f"r.jsonl:{i}" for i in range(1, 5)]
    first = [int(t) for t in index.tokens[: len(llama_tokenizer.encode(texts[0], add_special_tokens=False))]]
    assert first == llama_tokenizer.encode(texts[0], add_special_tokens=False)


def test_a_fifo_in_the_corpus_is_skipped_not_waited_on(tmp_path, llama_tokenizer):
    from lookupdec.index.corpus import CorpusReader

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "code.py").write_text(TEXT)
    fifo = corpus / "pipe.txt"
    os.mkfifo(fifo)
    reader = CorpusReader([str(corpus)])
    docs: list = []
    worker = threading.Thread(target=lambda: docs.extend(reader.documents()), daemon=True)
    worker.start()
    worker.join(10)
    if worker.is_alive():  # blocked opening the FIFO: let it go, then fail
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        worker.join(10)
        pytest.fail("reading the corpus waited on a FIFO")
    assert [os.path.basename(d.name) for d in docs] == ["code.py"]
    assert reader.skipped == {"not a regular file": 1}


# -- 10: --out under a file, an absurd --dim: refused up front -------------------------------------
def test_out_under_a_file_is_a_one_line_error(built, llama_tokenizer, tmp_path, capsys):
    blocker = tmp_path / "notes.txt"
    blocker.write_text("keep me")
    with pytest.raises(IndexStoreError, match=f"{blocker} is not a folder"):
        build([built[0]], blocker / "sub" / "idx", llama_tokenizer)
    code, _, err = run_cli(capsys, "index", "build", built[0], "--tokenizer", LLAMA_SP, "--out", blocker / "sub")
    assert_one_line_error(code, err, f"{blocker} is not a folder")
    assert blocker.read_text() == "keep me" and sorted(os.listdir(tmp_path)) == ["notes.txt"]


def test_out_in_a_folder_that_cannot_be_written_is_refused_up_front(built, tmp_path, capsys, monkeypatch):
    """Refused before the corpus is read, not after the whole build when the temporary folder
    cannot be made (``os.access`` stands in for a read-only folder: tests may run as root)."""
    from lookupdec import model as model_lib

    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == str(tmp_path) else real_access(p, mode))
    monkeypatch.setattr(model_lib, "load_tokenizer", lambda path: pytest.fail("the tokenizer was loaded"))
    code, _, err = run_cli(capsys, "index", "build", built[0], "--tokenizer", LLAMA_SP, "--out", tmp_path / "a" / "idx")
    assert_one_line_error(code, err, f"cannot create it in {tmp_path} (not writable)")


@pytest.mark.parametrize("dim", [100_000_000, 65537, 4])
def test_absurd_dim_is_refused_before_anything_loads(built, tmp_path, capsys, monkeypatch, dim):
    from lookupdec import model as model_lib

    def no_tokenizer(path):
        raise AssertionError("the tokenizer was loaded before --dim was checked")

    monkeypatch.setattr(model_lib, "load_tokenizer", no_tokenizer)
    code, _, err = run_cli(capsys, "index", "build", built[0], "--tokenizer", LLAMA_SP, "--out", tmp_path / "idx",
                           "--dim", dim)
    assert_one_line_error(code, err, f"--dim {dim}", "[8, 65536]")
    assert not (tmp_path / "idx").exists()


def test_a_dim_whose_vectors_do_not_fit_in_memory_is_refused(built, llama_tokenizer, tmp_path, monkeypatch):
    import lookupdec.index.build as build_mod

    monkeypatch.setattr(build_mod, "available_memory", lambda: 1 << 20)  # 1 MiB
    with pytest.raises(ValueError, match=r"--dim 4096: the vectors of \d+ chunks .* need about .* GiB, more than"):
        build([built[0]], tmp_path / "idx", llama_tokenizer, dim=4096)
    assert os.listdir(tmp_path) == []
    monkeypatch.setattr(build_mod, "available_memory", lambda: None)  # unknown: not refused
    assert build([built[0]], tmp_path / "idx", llama_tokenizer, dim=4096)["embedder"]["dim"] == 4096
