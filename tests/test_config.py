"""The configuration dataclasses (``lookupdec.config``): every bad value raises ``ValueError``
naming its field, the objects are frozen and keyword-only, ``with_index`` adds retrieval once,
and the match-length default is one value shared with the automaton."""
from __future__ import annotations

import dataclasses
import inspect

import pytest

from lookupdec.automaton import SuffixAutomaton
from lookupdec.config import (DEFAULT_MAX_MATCH, DraftConfig, EngineConfig, NgramConfig, RetrievalConfig,
                              SuffixConfig)

BAD = [
    (NgramConfig, dict(min_ngram=0), "min_ngram"),
    (NgramConfig, dict(min_ngram=3, max_ngram=2), "max_ngram"),
    (NgramConfig, dict(max_draft_tokens=0), "max_draft_tokens"),
    (NgramConfig, dict(max_branches=0), "max_branches"),
    (SuffixConfig, dict(max_match=0), "max_match"),
    (SuffixConfig, dict(min_match=0), "min_match"),
    (SuffixConfig, dict(global_min_match=-1), "global_min_match"),
    (SuffixConfig, dict(global_capacity=-1), "global_capacity"),
    (RetrievalConfig, dict(top_k=0), "top_k"),
    (RetrievalConfig, dict(query_tokens=0), "query_tokens"),
    (RetrievalConfig, dict(max_match=0), "max_match"),
    (RetrievalConfig, dict(follow_chunks=-1), "follow_chunks"),
    (RetrievalConfig, dict(refresh_every=-1), "refresh_every"),
    (DraftConfig, dict(mode="sometimes"), "mode"),
    (DraftConfig, dict(threshold=1.5), "threshold"),
    (DraftConfig, dict(max_tokens=0), "max_tokens"),
    (DraftConfig, dict(branch=0), "branch"),
    (EngineConfig, dict(max_nodes=-1), "max_nodes"),
    (EngineConfig, dict(max_depth=0), "max_depth"),
    (EngineConfig, dict(budget="huge"), "budget"),
    (EngineConfig, dict(verify="maybe"), "verify"),
    (EngineConfig, dict(proposers=("telepathy",)), "proposers"),
    (EngineConfig, dict(proposers=("retrieval",)), "proposers"),  # retrieval needs an index
]


@pytest.mark.parametrize("cls,kwargs,field", BAD, ids=[f"{c.__name__}.{f}" for c, _, f in BAD])
def test_bad_value_names_its_field(cls, kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field}="):
        cls(**kwargs)


@pytest.mark.parametrize("cls", [NgramConfig, SuffixConfig, RetrievalConfig, DraftConfig, EngineConfig])
def test_frozen_and_keyword_only(cls):
    config = cls()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.__setattr__(dataclasses.fields(cls)[0].name, None)
    with pytest.raises(TypeError):
        cls(1)


def test_defaults_are_valid_and_edges_accepted():
    EngineConfig(max_nodes=0)  # no drafts at all
    DraftConfig(threshold=0.0), DraftConfig(threshold=1.0)
    SuffixConfig(global_capacity=0, global_min_match=0)
    assert EngineConfig().proposers == ("ngram", "suffix", "recycle") and EngineConfig().budget == "auto"


def test_with_index_adds_retrieval_once(tmp_path):
    config = EngineConfig().with_index(tmp_path)
    assert config.proposers == ("ngram", "suffix", "recycle", "retrieval") and config.retrieval.index == str(tmp_path)
    again = config.with_index(tmp_path / "other")
    assert again.proposers == config.proposers and again.retrieval.index == str(tmp_path / "other")
    assert EngineConfig().retrieval.index is None  # the original is unchanged


def test_one_match_length_default():
    """The suffix and retrieval proposers and the automaton's propose_tree share one default."""
    assert SuffixConfig().max_match == RetrievalConfig().max_match == DEFAULT_MAX_MATCH == 64
    default = inspect.signature(SuffixAutomaton.propose_tree).parameters["max_match"].default
    assert default == DEFAULT_MAX_MATCH
