"""Facts about token ids that several layers share, with no dependency of their own.

- ``SEPARATOR``: a token id no vocabulary uses. It joins documents in an index's token store
  (``index/store.py``), earlier outputs in the suffix cache's global stream and retrieved chunk
  runs (``proposers/suffix.py``, ``proposers/retrieval.py``), so that no match spans two of them.
  Drafts never contain it (the suffix drafts drop it: ``reference.drafting.without_separator``).
- ``vocab_fingerprint``: ties caches and indexes to a tokenizer's vocabulary.
"""
from __future__ import annotations

import hashlib

SEPARATOR = 2**31 - 1  # the largest int32: above every vocabulary, storable in int32 arrays


def vocab_fingerprint(tokenizer) -> str:
    """A short hash of the vocabulary (token -> id), to tie caches and indexes to a tokenizer."""
    items = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    digest = hashlib.sha256("\n".join(f"{i}\t{t}" for t, i in items).encode("utf-8", "surrogatepass"))
    return digest.hexdigest()[:16]


def chat_text(tokenizer, messages, *, add_generation_prompt: bool = True) -> str:
    """``messages`` (``{"role", "content"}`` dicts) through the tokenizer's chat template, as
    text to tokenize without added special tokens. A tokenizer without a template, or a
    template that rejects the messages (its own checks, e.g. role order), is a ``ParamError``
    on ``messages``."""
    from lookupdec.validate import ParamError

    if not getattr(tokenizer, "chat_template", None):
        raise ParamError("this model's tokenizer has no chat template; give a plain prompt", "messages")
    try:
        return tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt,
                                             tokenize=False)
    except Exception as exc:  # jinja2's raise_exception and kin
        raise ParamError(f"the chat template rejects these messages: {exc}", "messages") from None
