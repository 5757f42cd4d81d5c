"""Retrieval corpus: reading and chunking files, embedding, FAISS, the versioned on-disk store.

``build_index`` writes an index folder (``indexes/README.md`` documents it); ``Index.open`` reads
one back, checking everything; ``lookupdec.proposers.retrieval`` drafts from it.
"""
from lookupdec.index.build import build_index
from lookupdec.index.store import FORMAT_VERSION, Hit, Index, IndexStoreError

__all__ = ["FORMAT_VERSION", "Hit", "Index", "IndexStoreError", "build_index"]
