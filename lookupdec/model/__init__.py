"""The only package that imports ``transformers`` (the demo's training script aside):

- ``load.py``: loading a model folder, a ``.gguf`` file or an alias, and tokenizers;
- ``target.py``: ``TargetModel``, the tree forward, KV commit and the 4D masks (``tree_inputs``:
  ids, positions and mask of a tree without a model);
- ``lean.py``: llama-shaped decoder layers as one function each inside the engine's forwards
  (bit for bit their own forward, probed per layer);
- ``cache.py``: every detail of the KV cache's layout (``new_cache``, ``crop_cache``,
  ``gather_cache``, ``commit_accepted``) and ``DraftLM``, the draft model's incremental forward;
- ``threads.py``: ``release_openmp_threads``, handing torch's CPU threads from the thread that
  loaded a model to the thread that runs it (a server's engine thread, a Ray worker's loop).

Cache layout during a step: slots ``[0, n_cached)`` hold the committed prefix; the verify
forward appends the tree's ``1 + n`` nodes at slots ``n_cached + i`` (node index ``i``), with
RoPE positions ``n_cached + depth[i]`` and a 4D additive mask letting node ``i`` see the prefix
and its own ancestors. ``commit`` then moves the accepted nodes' K/V to contiguous slots right
after the root and drops the rest. The target's cache is a ``SlotCache`` (``cache.py``): a
transformers ``DynamicCache`` whose layers are views of one preallocated buffer, appended in
place, so that the commit is one gather over every layer and a change of lengths; a draft
model keeps a plain ``DynamicCache``. Tested against transformers 5.20–5.23, where K/V live in
``cache.layers[i].keys / .values``.

Models whose attention cannot take a custom 4D mask fall back to verifying one chain per step
with the ordinary causal mask (detected by a probe at start-up, logged once).
"""
from lookupdec.model.cache import DraftLM, commit_accepted, crop_cache, gather_cache, new_cache
from lookupdec.model.load import (ModelLoadError, SentencePieceTokenizer, convert_gguf, default_device, load,
                                  load_tokenizer, resolve_dtype, tokenizer_info)
from lookupdec.model.threads import release_openmp_threads
from lookupdec.model.target import PROBE_REL_TOL, TargetModel, model_max_context, tree_inputs
from lookupdec.tokens import vocab_fingerprint

__all__ = ["DraftLM", "ModelLoadError", "PROBE_REL_TOL", "SentencePieceTokenizer", "TargetModel", "commit_accepted", "convert_gguf",
           "crop_cache", "default_device", "gather_cache", "load", "load_tokenizer", "model_max_context", "new_cache",
           "release_openmp_threads", "resolve_dtype", "tokenizer_info", "tree_inputs", "vocab_fingerprint"]
