"""The mixture (``lookupdec.mixture``): every lookup runs each step, the draft model only where
the lookups are weak (or always, or never), one node budget passed to all, and the lifecycle
forwarded to every source."""
from __future__ import annotations

import pytest

from helpers import SpyProposer
from lookupdec.budget import AcceptanceCalibrator
from lookupdec.config import DraftConfig
from lookupdec.mixture import Mixture
from lookupdec.tree import Draft


def lookup(score: float, name: str = "lookup") -> SpyProposer:
    return SpyProposer(name=name, drafts=[Draft.chain([4, 5], [score, score], name, match_length=3)])


def draft_model() -> SpyProposer:
    return SpyProposer(name="draft", drafts=[Draft.chain([3], [0.5], "draft")])


@pytest.mark.parametrize("mode, lookup_score, runs", [("never", 0.0, False), ("always", 0.99, True),
                                                       ("auto", 0.9, False), ("auto", 0.1, True)])
def test_the_draft_model_runs_where_lookups_are_weak(mode, lookup_score, runs):
    draft = draft_model()
    mixture = Mixture([lookup(lookup_score)], draft, DraftConfig(mode=mode, threshold=0.3))
    mixture.start("r", [1, 2])
    drafts = mixture.propose("r", [1, 2], 16)
    assert (draft.calls == 1) == runs and any(d.source == "draft" for d in drafts) == runs
    assert mixture.draft_steps == int(runs)


def test_auto_mode_reads_the_calibrated_score():
    """A lookup scored 0.9 whose source keeps failing is calibrated down below the threshold:
    the draft model then runs although the raw score is high."""
    calibrator = AcceptanceCalibrator()
    weak = lookup(0.9)
    for _ in range(60):  # its drafts [4, 5] never match what gets committed
        calibrator.learn(weak.drafts, [7, 7])
    draft = draft_model()
    mixture = Mixture([weak], draft, DraftConfig(mode="auto", threshold=0.3), calibrator)
    mixture.start("r", [1])
    mixture.propose("r", [1], 8)
    assert draft.calls == 1


def test_lookups_first_in_order_then_the_draft_model_one_budget_for_all():
    first, second, draft = lookup(0.9, "a"), lookup(0.8, "b"), draft_model()
    mixture = Mixture([first, second], draft, DraftConfig(mode="always"))
    assert mixture.proposers == [first, second, draft]
    mixture.start("r", [1, 2])
    drafts = mixture.propose("r", [1, 2], 12)
    assert [d.source for d in drafts] == ["a", "b", "draft"]
    assert first.asked == second.asked == draft.asked == [12]


def test_lifecycle_reaches_every_source():
    sources = [lookup(0.9, "a"), lookup(0.8, "b")]
    draft = draft_model()
    mixture = Mixture(sources, draft, DraftConfig(mode="never"))
    mixture.start("r", [1])
    mixture.observe("r", [4])
    mixture.stop("r")
    assert all(p.started == ["r"] and p.stopped == ["r"] for p in sources + [draft])
    mixture.start("s", [1])
    assert mixture.propose("s", [1], 8) and draft.calls == 0  # "never": the draft model is not asked
