"""Random inputs shared by the tests that compare a fast path with its reference: token streams,
drafts, tries and scored trees (seeded by the caller's ``rng``: every case is reproducible)."""
from __future__ import annotations

import random

from lookupdec.proposers.suffix import SEPARATOR
from lookupdec.tree import Draft, TokenTree


def random_stream(rng: random.Random, length: int, vocab: int) -> list[int]:
    """Repetitive text: copies of earlier spans, fresh tokens and a few separators."""
    out: list[int] = []
    while len(out) < length:
        if out and rng.random() < 0.6:
            start = rng.randrange(len(out))
            out += out[start:start + rng.randint(1, 12)]
        else:
            out.append(SEPARATOR if rng.random() < 0.03 else rng.randrange(vocab))
    return out[:length]


def comparable_drafts(drafts) -> list[tuple]:
    """Everything a draft carries, for comparing a compiled proposer's drafts with its reference's."""
    return [(d.token_ids, d.parents, d.scores, d.source, d.match_length, d.best_chain()) for d in drafts]


def random_drafts(rng: random.Random, vocab: int = 4) -> list[Draft]:
    """Random drafts over a small vocabulary (so that drafts share prefixes and merge)."""
    drafts = []
    for d in range(rng.randint(1, 4)):
        size = rng.randint(1, 10)
        parents = [rng.randint(-1, i - 1) for i in range(size)]
        tokens = [rng.randrange(vocab) for _ in range(size)]
        scores = [rng.uniform(0.0, 1.0) for _ in range(size)]
        drafts.append(Draft(tuple(tokens), tuple(parents), tuple(scores), f"src{d % 2}"))
    return drafts


def random_trie(rng: random.Random, size: int, vocab: int) -> TokenTree:
    """A trie of up to ``size`` nodes under a root, each hanging under a random earlier node."""
    token_ids, parents, taken = [rng.randrange(vocab)], [-1], set()
    while len(token_ids) < size + 1 and len(taken) < size * vocab:
        parent, token = rng.randrange(len(token_ids)), rng.randrange(vocab)
        if (parent, token) in taken:
            continue
        taken.add((parent, token))
        token_ids.append(token)
        parents.append(parent)
    return TokenTree(token_ids=token_ids, parents=parents)


def random_scored_tree(rng, n: int) -> TokenTree:
    """``n`` nodes with deep paths and expected gains that never rise along a path, as in a merged
    tree (``rng``: a numpy Generator)."""
    parents = [-1] + [int(rng.integers(max(0, i - 3), i)) for i in range(1, n)]  # deep paths
    tokens = [0] + [parents[1:i].count(parents[i]) for i in range(1, n)]  # siblings distinct
    expected = [1.0] + [float(rng.random()) ** 3 for _ in range(1, n)]
    for i in range(1, n):  # a path is never likelier than its prefix, as in a merged tree
        expected[i] = min(expected[i], expected[parents[i]])
    return TokenTree(token_ids=tokens, parents=parents, expected=expected)
