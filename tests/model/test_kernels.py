"""``model/kernels.py``: the output projection's product forms give the same logits (float
rounding apart), the fastest is chosen once per row count outside any timing; the body's
linears on prepacked weights compute what ``nn.Linear`` does, follow weight changes, and are
confined to the block like the head; the engine's output is unchanged with the kernels on or off."""
from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import cached_tiny
from helpers import FakeTokenizer, greedy_alone_and_batched
from lookupdec import Engine, EngineConfig
from lookupdec.reference import model as reference_model
from lookupdec.model.kernels import (BODY_FORMS, FORM_TRIALS, FORMS, GQA_SWITCH, INHERITED_CHECK, FastHead,
                                     PackedLinears, fast_head_for, packed_available, packed_linears_for, skinny_available,
                                     swapped)


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 17, 40])
def test_every_form_computes_the_projection(rows):
    head = torch.nn.Linear(24, 300, bias=False)
    fast = FastHead(head)
    x = torch.randn(1, rows, 24)
    want = head(x)
    for form in fast.forms:
        got = fast._form(form, x.reshape(-1, 24)).reshape(1, rows, 300)
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), form
    for call in range(FORM_TRIALS * len(fast.forms)):  # each form tried FORM_TRIALS times on real calls
        assert not fast.choice
        assert torch.allclose(fast(x), want, rtol=1e-5, atol=1e-5), call
    assert set(fast.choice) == {(rows if rows <= 16 else 1 << (rows - 1).bit_length(), torch.get_num_threads())}
    assert set(fast.choice.values()) <= set(fast.forms) <= set(FORMS)
    assert torch.allclose(fast(x), want, rtol=1e-5, atol=1e-5)
    assert fast.prepare(rows) == 0.0  # the weight's copies are made once


def test_swap_is_confined_to_the_block_and_shared_per_model():
    model = cached_tiny("llama")
    head = model.get_output_embeddings()
    fast = fast_head_for(model)
    assert fast is not None and fast_head_for(model) is fast  # one per head: forms timed once
    before = os.environ.get(GQA_SWITCH)
    with swapped(model, fast, gqa=True):
        assert model.get_output_embeddings() is fast and os.environ[GQA_SWITCH] == "1"
    assert model.get_output_embeddings() is head and os.environ.get(GQA_SWITCH) == before
    with pytest.raises(RuntimeError):
        with swapped(model, fast, gqa=True):
            raise RuntimeError("a failing forward")
    assert model.get_output_embeddings() is head and os.environ.get(GQA_SWITCH) == before


def test_engine_output_is_the_same_with_kernels_on_and_off():
    model = cached_tiny("qwen2")  # grouped K/V heads
    prompt = [5, 6, 7, 5, 6, 7, 5, 6, 9, 10]
    on = Engine(model, FakeTokenizer(), EngineConfig(fast_kernels=True)).generate(prompt, max_new_tokens=40)
    off = Engine(model, FakeTokenizer(), EngineConfig(fast_kernels=False)).generate(prompt, max_new_tokens=40)
    assert on.token_ids == off.token_ids


needs_onednn = pytest.mark.skipif(not packed_available(), reason="this torch has no oneDNN")


@needs_onednn
def test_packed_head_form_is_offered_where_onednn_is():
    assert "packed" in FastHead(torch.nn.Linear(8, 16, bias=False)).forms


def form_of(body, layer) -> str:
    """The form ``layer`` computes in now (``PackedLinears``): its instance forward's."""
    forward = layer.__dict__.get("forward")
    if forward is None:
        return "linear"
    timed = [f for (m, f), call in body._timed.items() if m is layer and call is forward]  # a probe layer
    return timed[0] if timed else next(f for f, forwards in body._forwards.items() if forwards[layer] is forward)


needs_skinny = pytest.mark.skipif(not skinny_available(), reason="the compiled core is not built")


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    """torch's intra-op threads for the test (the skinny product splits its panels over as many)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@needs_skinny
@pytest.mark.parametrize("rows", [1, 2, 7, 8, 9, 13, 16, 17, 24, 33, 64])
@pytest.mark.parametrize("out_features, in_features", [(40, 24), (48, 576), (1, 5), (100, 33), (16, 16)])
def test_skinny_product_equals_linear_on_every_instruction_set(rows, out_features, in_features, threads):
    """``native_kernels.skinny_linear`` on each kernel this CPU runs (AVX-512, AVX2, the
    compiler's default) against ``F.linear``: the same sums up to float32 rounding, panels of 16
    outputs with a partial last one, rows split into register blocks of 8 (or 6, 3)."""
    from lookupdec.model.kernels import skinny_linear, skinny_pack
    from lookupdec.native import kernels as native_kernels

    generator = torch.Generator().manual_seed(rows * 1000 + out_features)
    w = torch.randn(out_features, in_features, generator=generator)
    bias = torch.randn(out_features, generator=generator)
    x = torch.randn(rows, in_features, generator=generator)
    want = torch.nn.functional.linear(x, w, bias)
    panels = skinny_pack(w)
    for isa in native_kernels.skinny_isas():
        got = skinny_linear(x, panels, out_features, bias, isa=isa)
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * in_features ** 0.5), isa


@needs_skinny
def test_skinny_rows_do_not_depend_on_the_other_rows():
    """Each output is one sum over the inputs in order, whatever the row count: a row's values
    are bit for bit the same alone or among others (a tree's node computes what it would in any
    tree, on every kernel)."""
    from lookupdec.model.kernels import skinny_linear, skinny_pack
    from lookupdec.native import kernels as native_kernels

    generator = torch.Generator().manual_seed(7)
    w = torch.randn(70, 96, generator=generator)
    x = torch.randn(20, 96, generator=generator)
    panels = skinny_pack(w)
    for isa in native_kernels.skinny_isas():
        alone = torch.cat([skinny_linear(x[i : i + 1], panels, 70, None, isa=isa) for i in range(20)])
        for m in (2, 9, 13, 20):
            assert torch.equal(skinny_linear(x[:m], panels, 70, None, isa=isa), alone[:m]), (isa, m)


@needs_skinny
@pytest.mark.parametrize("rows", [1, 6, 16, 40])
@pytest.mark.parametrize("out_features", [16, 63, 64, 200, 5003])
def test_skinny_outputs_and_picks_do_not_depend_on_the_thread_count(rows, out_features):
    """The skinny product splits its panels over torch's threads
    (``native_kernels.skinny_threads``: as many as ``torch.set_num_threads`` gives, one per 4
    panels at most): every output and every pick is bit for bit the one-thread product's, on
    every kernel."""
    from lookupdec.model.kernels import skinny_linear, skinny_pack, skinny_threaded
    from lookupdec.native import kernels as native_kernels

    generator = torch.Generator().manual_seed(rows * 7 + out_features)
    w = torch.randn(out_features, 48, generator=generator)
    x = torch.randn(rows, 48, generator=generator)
    panels, bound = skinny_pack(w), float(w.abs().max())
    before = torch.get_num_threads()
    try:
        got = {}
        for count in (1, 2):
            torch.set_num_threads(count)
            want_threads = min(count, max(1, (out_features + 15) // 16 // 4)) if skinny_threaded() else 1
            assert native_kernels.skinny_threads(out_features) == want_threads
            for isa in native_kernels.skinny_isas():
                tops = np.full((rows, 3), -1, dtype=np.int32)
                got[count, isa] = (skinny_linear(x, panels, out_features, None, isa=isa),
                                   skinny_linear(x, panels, out_features, None, isa=isa, tops=tops, weight_bound=bound),
                                   tops)
        for isa in native_kernels.skinny_isas():
            (a, a_tops_rows, a_tops), (b, b_tops_rows, b_tops) = got[1, isa], got[2, isa]
            assert torch.equal(a, b) and torch.equal(a_tops_rows, b_tops_rows) and torch.equal(a, a_tops_rows), isa
            assert a_tops.tolist() == b_tops.tolist(), isa
    finally:
        torch.set_num_threads(before)


@needs_skinny
@pytest.mark.parametrize("rows", [1, 5, 27, 64])
@pytest.mark.parametrize("top_k", [1, 4])
def test_skinny_tops_are_the_top_tokens_of_the_rows_it_writes(rows, top_k, threads):
    """``skinny_linear(tops=...)`` offers each block of outputs to its row's picks as the kernel
    stores it, and gives each row's ``top_k`` best column ids as ``reference.request.top_tokens``
    reads them from the finished row: ties to the earlier id (duplicate weight rows, in
    different panels and panel groups), a NaN row's first ids (a row not known finite by
    ``weight_bound`` is scanned once written; without a bound every row is); the rows
    themselves are bit for bit those without ``tops``, on every kernel; on two threads each
    thread's picks among its panels are merged (the ties above lie on both sides of the split)."""
    from lookupdec.reference import request as reference_request
    from lookupdec.model.kernels import skinny_linear, skinny_pack
    from lookupdec.native import kernels as native_kernels

    generator = torch.Generator().manual_seed(rows * 10 + top_k)
    n, d = 5003, 40
    w = torch.randn(n, d, generator=generator)
    w[4000], w[17], w[2500] = w[3], w[3], w[3] * 1.5  # equal outputs across pieces; one beating them
    x = torch.randn(rows, d, generator=generator)
    x[0] = 3.0 * w[3] + 0.1 * x[0]  # row 0's best: tokens 2500, then 3, 17, 4000 tied (in id order)
    if rows > 2:
        x[2, 7] = float("nan")  # a whole row of NaN: its first ids
    panels = skinny_pack(w)
    for isa, bound in [(isa, bound) for isa in native_kernels.skinny_isas()
                       for bound in (float(w.abs().max()), math.inf)]:
        plain = skinny_linear(x, panels, n, None, isa=isa)
        tops = np.full((rows, top_k), -1, dtype=np.int32)
        got = skinny_linear(x, panels, n, None, isa=isa, tops=tops, weight_bound=bound)
        assert torch.equal(got.isnan(), plain.isnan()) and torch.equal(got.nan_to_num(), plain.nan_to_num()), isa
        assert tops.tolist() == reference_request.top_tokens(got, range(rows), top_k), (isa, bound)
        assert tops[0].tolist() == [2500, 3, 17, 4000][:top_k]
    with pytest.raises(ValueError, match="tops"):
        native_kernels.skinny_linear(x, panels, torch.empty(rows, n), None, np.empty((rows + 1, 2), dtype=np.int32))


@needs_skinny
def test_the_head_picks_top_tokens_only_in_the_skinny_form():
    """``FastHead.project(picks=k)``: the logits of every form, and the rows' k best ids where
    the form is the skinny product (else None: the walk reads the rows)."""
    from lookupdec.reference import request as reference_request

    head = torch.nn.Linear(24, 300, bias=False)
    fast = FastHead(head)
    x = torch.randn(5, 24)
    key = (5, torch.get_num_threads())
    for form in fast.forms:
        fast.choice[key] = form
        logits, tops = fast.project(x, 3)
        assert torch.allclose(logits, head(x), rtol=1e-5, atol=1e-5)
        if form == "skinny":
            assert tops.tolist() == reference_request.top_tokens(logits, range(5), 3)
        else:
            assert tops is None, form


@needs_skinny
def test_skinny_rejects_what_it_cannot_compute():
    from lookupdec.native import kernels as native_kernels

    panels = torch.empty(16 * 8)
    with pytest.raises(ValueError, match="panels"):
        native_kernels.skinny_linear(torch.randn(2, 8), panels, torch.empty(2, 17))  # 17 outputs need 2 panels
    with pytest.raises(ValueError, match="rows"):
        native_kernels.skinny_linear(torch.randn(2, 8), panels, torch.empty(3, 16))
    with pytest.raises(ValueError, match="instruction set"):
        native_kernels.skinny_linear(torch.randn(2, 8), panels, torch.empty(2, 16), "sse9")


@needs_skinny
def test_the_skinny_product_is_tried_on_short_forwards_only():
    """A prefill of hundreds of tokens is compute-bound, where the skinny product (one thread,
    weights re-read per 8 rows) has nothing to win: it is offered up to SKINNY_MAX_ROWS tokens."""
    from lookupdec.model.kernels import SKINNY_MAX_ROWS

    body = PackedLinears([torch.nn.Linear(8, 8)])
    assert "skinny" in body.forms and "skinny" in body._chooser.forms_of((SKINNY_MAX_ROWS, 1))
    assert "skinny" not in body._chooser.forms_of((2 * SKINNY_MAX_ROWS, 1))
    seen = set()
    for _ in range(FORM_TRIALS * (len(body.forms) - 1)):
        with torch.inference_mode(), body.chosen(300):
            seen.add(form_of(body, body.modules[0]))
    assert "skinny" not in seen and (512, torch.get_num_threads()) in body.choice


@needs_skinny
def test_the_head_offers_the_skinny_product_on_short_forwards_only():
    """The output projection takes the skinny product as a fifth form, up to SKINNY_MAX_ROWS
    rows (a verify forward projects the rows ``head_rows`` picks, 8 or more of a large tree);
    a prefill's rows try the other four."""
    from lookupdec.model.kernels import SKINNY_MAX_ROWS

    head = torch.nn.Linear(24, 300, bias=False)
    fast = FastHead(head)
    assert "skinny" in fast.forms and "skinny" in fast._chooser.forms_of((SKINNY_MAX_ROWS, 1))
    assert "skinny" not in fast._chooser.forms_of((2 * SKINNY_MAX_ROWS, 1))
    x = torch.randn(2 * SKINNY_MAX_ROWS, 24)
    for _ in range(FORM_TRIALS * (len(fast.forms) - 1)):
        assert torch.allclose(fast(x), head(x), rtol=1e-5, atol=1e-5)
    assert set(fast.choice) == {(2 * SKINNY_MAX_ROWS, torch.get_num_threads())}  # chosen without trying skinny
    assert fast.choice[(2 * SKINNY_MAX_ROWS, torch.get_num_threads())] != "skinny"


@needs_onednn
@pytest.mark.parametrize("rows", [1, 3, 16, 70])
@pytest.mark.parametrize("form", ["packed", "skinny"])
def test_packed_linears_compute_what_the_layers_do(rows, form):
    layers = [torch.nn.Linear(24, 40), torch.nn.Linear(40, 24, bias=False)]
    body = PackedLinears(layers)
    if form not in body.forms:
        pytest.skip(f"{form}: not in this build")
    x = torch.randn(2, rows, 24)
    want = layers[1](layers[0](x))
    with torch.inference_mode(), body.active(form):
        assert all(form_of(body, m) == form for m in layers)
        got = layers[1](layers[0](x))
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    assert all("forward" not in m.__dict__ for m in layers)  # plain nn.Linear again
    assert torch.equal(layers[1](layers[0](x)), want)


@needs_onednn
def test_the_body_keeps_the_faster_form_per_token_bucket_and_thread_count(monkeypatch):
    """Packed weights lost to nn.Linear on a machine of this project's kind (one token at one
    thread, up to 8 at two), so the body times both forms on the first forwards of a bucket and
    keeps the faster; each form computes the layers, and the slower trials' excess is reported."""
    import lookupdec.model.kernels as kernels

    layers = [torch.nn.Linear(24, 40), torch.nn.Linear(40, 24, bias=False)]
    body = PackedLinears(layers)
    x = torch.randn(1, 3, 24)
    want = layers[1](layers[0](x))
    now = [0.0]
    slow = {"packed": 5.0, "skinny": 3.0, "linear": 1.0}  # seconds a forward takes in each form (a fake clock)
    monkeypatch.setattr(kernels.time, "perf_counter", lambda: now[0])
    seen = []
    for _ in range(FORM_TRIALS * len(body.forms)):
        assert not body.choice
        with torch.inference_mode(), body.chosen(3):
            form = form_of(body, layers[0])
            seen.append(form)
            got = layers[1](layers[0](x))
            now[0] += slow[form]
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    assert sorted(seen) == sorted(body.forms * FORM_TRIALS)
    assert body.choice == {(3, torch.get_num_threads()): "linear"}
    assert body.take_excess() > 0 and body.take_excess() == 0.0
    with torch.inference_mode(), body.chosen(3):
        assert "forward" not in layers[0].__dict__  # plain nn.Linear from now on for 3 tokens
    seen = []
    record = body._chooser.record
    monkeypatch.setattr(body._chooser, "record",
                        lambda key, form, seconds, reference=None: (seen.append(form), record(key, form, seconds, reference))[1])
    for _ in range(INHERITED_CHECK + 1):  # another bucket starts from the nearest one's choice ...
        with torch.inference_mode(), body.chosen(40):
            assert "forward" not in layers[0].__dict__  # (a check runs the probe layer alone in the other form)
    assert body.choice[(64, torch.get_num_threads())] == "linear" and not body._trials
    assert seen == ["linear"] * INHERITED_CHECK + ["packed"]  # ... and checks the other form soon


@needs_onednn
def test_a_form_that_lost_its_trials_to_noise_takes_over_at_a_check():
    """Noise only adds time: a form whose trials were slowed keeps losing unless the choice is
    checked again. The chosen form's calls are timed; after RECHECK_FIRST of them one call tries
    the other form, which takes over where it was faster. A right choice keeps passing its
    checks, ever more rarely (the interval doubles once every other form has failed at it)."""
    from lookupdec.model.kernels import RECHECK_FIRST, FormChooser

    true = {"packed": 55.0, "linear": 100.0}
    chooser = FormChooser(("packed", "linear"))
    key = (8, 1)
    for _ in range(FORM_TRIALS * 2):  # the packed trials fall into a burst of noise
        form = chooser.pick(key)
        chooser.record(key, form, true[form] + (80.0 if form == "packed" else 0.0))
    assert chooser.choice[key] == "linear"
    calls = 0
    while chooser.choice[key] == "linear":
        form = chooser.pick(key)
        chooser.record(key, form, true[form])
        calls += 1
        assert calls <= RECHECK_FIRST + 1
    assert chooser.choice[key] == "packed"
    tried_other = 0
    for _ in range(2000):
        form = chooser.pick(key)
        tried_other += form != "packed"
        assert chooser.record(key, form, true[form]) == (true["linear"] - true["packed"] if form != "packed" else 0.0)
    assert chooser.choice[key] == "packed"
    assert 1 <= tried_other <= 7  # after 16, 32, 64, ... calls: log2(2000 / 16) checks


def _seeded_chooser(choice: str):
    from lookupdec.model.kernels import FormChooser

    chooser = FormChooser(("skinny", "linear"))
    assert chooser.seed({(7, 1): choice}) == 1  # an earlier process's choice, from the cost cache
    return chooser


def _level(call: int) -> float:
    """The machine's speed: 30% slower for 20 calls in every 40 (another process, the host)."""
    return 1.3 if (call // 20) % 2 else 1.0


def test_a_check_against_the_rest_of_its_forward_is_not_fooled_by_the_machines_speed():
    """The body's probe layers are timed with the rest of their forward beside them
    (``reference``). A check falls due whenever it does: here in a slow period, after calls of
    the chosen form in a fast one. The skinny product, 20% faster, wins its first check measured
    against the chosen form's calls over their own references; held against the chosen form's
    fastest call alone, it loses to the level (1.3 x 0.8 is above 0.97) and waits for the next."""
    from lookupdec.model.kernels import RECHECK_FIRST

    true = {"skinny": 8.0, "linear": 10.0}  # ms in the probe layers; the rest of the forward: 90 ms
    for relative in (True, False):
        chooser, calls = _seeded_chooser("linear"), 0
        while True:
            form = chooser.pick((7, 1))
            level = _level(calls + 4)  # the first check falls in the slow period
            chooser.record((7, 1), form, true[form] * level, 90.0 * level if relative else None)
            calls += 1
            if form != "linear":
                break
        assert calls == RECHECK_FIRST + 1
        assert chooser.choice[(7, 1)] == ("skinny" if relative else "linear")


def test_a_check_in_a_fast_moment_does_not_unseat_a_faster_form():
    """The converse: a slower form checked in a fast period, against calls of the chosen form
    made in a slow one, looks faster by its raw time and does not take over by its time over
    the rest of its forward. Over many calls with the speed changing, the faster form keeps the
    bucket and the checks grow rarer."""
    true = {"skinny": 7.0, "linear": 7.5}
    for relative in (True, False):
        chooser, checks = _seeded_chooser("skinny"), 0
        for call in range(2000):
            form = chooser.pick((7, 1))
            level = 1.25 if form == "skinny" else 1.0  # every check lands in a fast moment
            checks += form != "skinny"
            chooser.record((7, 1), form, true[form] * level, 90.0 * level if relative else None)
            if chooser.choice[(7, 1)] != "skinny":
                break
        assert (chooser.choice[(7, 1)] == "skinny") == relative
    assert 1 <= checks <= 7  # after 16, 32, 64, ... calls


def test_a_check_tries_the_form_of_the_nearest_buckets_first():
    """A bucket whose choice differs from the buckets' on either side (7 rows on ``nn.Linear`` between
    6 and 8 on the skinny product, from the cost cache: likely stale) is checked on its own
    schedule, after INHERITED_CHECK of its own calls, not when its group's checks happen to
    land on it; and with three forms its first check tries the form the nearest bucket chose,
    not the next in turn. Once it agrees with its neighbours it is back on its group's."""
    from lookupdec.model.kernels import INHERITED_CHECK, FormChooser, check_group

    chooser = FormChooser(("packed", "skinny", "linear"))
    chooser.seed({(5, 1): "skinny", (6, 1): "skinny", (7, 1): "linear", (8, 1): "skinny"})
    assert chooser._schedule((7, 1)) == ("own", (7, 1)) and chooser._schedule((6, 1)) == check_group((6, 1))
    tried = []
    for _ in range(INHERITED_CHECK + 1):
        form = chooser.pick((7, 1))
        tried.append(form)
        chooser.record((7, 1), form, {"linear": 10.0, "packed": 9.9, "skinny": 7.0}[form], 90.0)
    assert tried == ["linear"] * INHERITED_CHECK + ["skinny"] and chooser.choice[(7, 1)] == "skinny"
    assert chooser._schedule((7, 1)) == check_group((7, 1))
    assert chooser._nearest_choice((7, 1)) == "skinny" and chooser._nearest_choice((0, 1)) is None


def test_neighbouring_buckets_share_one_schedule_of_checks():
    """Buckets of one check group (4-7 rows) pay checks at the rate of one bucket, not each its
    own: a budget that varies its tree size between 4 and 7 tokens checks as often as one that
    keeps 5. A check still compares within its own bucket, and a form that wins there takes
    over that bucket only."""
    from lookupdec.model.kernels import RECHECK_FIRST, FormChooser, check_group

    assert check_group((4, 1)) == check_group((7, 1)) != check_group((8, 1)) and check_group((4, 1)) != check_group((4, 2))
    true = {"packed": 50.0, "linear": 90.0}
    chooser = FormChooser(("packed", "linear"))
    for _ in range(FORM_TRIALS * 2):
        form = chooser.pick((5, 1))
        chooser.record((5, 1), form, true[form])
    assert chooser.choice[(5, 1)] == "packed"
    checks, calls = 0, 4 * RECHECK_FIRST * 8
    for i in range(calls):
        key = (4 + i % 4, 1)  # 4, 5, 6, 7 tokens in turn
        form = chooser.pick(key)
        checks += form != "packed"
        chooser.record(key, form, true[form] * (1 + key[0] / 100))
    assert all(chooser.choice[(rows, 1)] == "packed" for rows in range(4, 8))
    assert 1 <= checks <= 5  # after 16, 32, 64, 128, 256 calls of the group (a schedule per bucket: ~4x as many)
    # where linear is faster at 7 rows only, the check that lands on 7 switches 7 alone
    chooser = FormChooser(("packed", "linear"))
    for _ in range(FORM_TRIALS * 2):
        form = chooser.pick((5, 1))
        chooser.record((5, 1), form, true[form])
    true7 = {"packed": 50.0, "linear": 30.0}
    for i in range(4 * RECHECK_FIRST * 16):
        key = (4 + i % 4, 1)
        form = chooser.pick(key)
        chooser.record(key, form, (true7 if key[0] == 7 else true)[form])
        if chooser.choice.get((7, 1)) == "linear":
            break
    assert chooser.choice[(7, 1)] == "linear"
    assert all(chooser.choice[(rows, 1)] == "packed" for rows in range(4, 7))


def test_a_new_bucket_takes_the_nearest_choice_at_its_thread_count():
    from lookupdec.model.kernels import FormChooser

    chooser = FormChooser(("packed", "linear"))
    chooser.choice.update({(1, 1): "linear", (16, 1): "packed", (4, 2): "linear"})
    assert chooser.pick((2, 1)) == "linear" and chooser.pick((32, 1)) == "packed"
    assert chooser.pick((8, 1)) == "packed"  # 8 is nearer 16 than 1 by ratio
    assert chooser.pick((0, 1)) == "packed"  # no ratio to 0 rows: tried afresh (the form tried least)
    assert (0, 1) not in chooser.choice and chooser.pick((64, 3)) == "packed" and (64, 3) not in chooser.choice


def test_every_other_form_is_checked_in_turn():
    from lookupdec.model.kernels import FormChooser

    chooser = FormChooser(FORMS)
    key = (3, 1)
    for _ in range(FORM_TRIALS * len(FORMS)):
        form = chooser.pick(key)
        chooser.record(key, form, 1.0 if form == "linear" else 2.0)
    assert chooser.choice[key] == "linear"
    others = [f for f in FORMS if f != "linear"]
    checked = []
    for _ in range(len(others) * (16 + 1) + 32 + 1):  # each other form after 16 calls, then every 32
        form = chooser.pick(key)
        if form != "linear":
            checked.append(form)
        chooser.record(key, form, 1.0 if form == "linear" else 2.0)
    assert checked == others + others[:1]


def test_packed_linears_follow_weight_changes():
    layer = torch.nn.Linear(8, 8)
    body = PackedLinears([layer])
    x = torch.randn(1, 8)
    with torch.inference_mode(), body.active():
        before = layer(x)
    with torch.no_grad():
        layer.weight.mul_(2)  # in place: its version moves
    body.refresh()
    with torch.inference_mode(), body.active():
        after = layer(x)
    assert torch.allclose(after, layer(x), rtol=1e-5, atol=1e-5) and not torch.allclose(after, before)
    layer.weight = torch.nn.Parameter(torch.zeros(8, 8))  # a new tensor
    body.refresh()
    with torch.inference_mode(), body.active():
        assert torch.allclose(layer(x), layer.bias.expand(1, 8))


@needs_onednn
def test_packed_body_is_shared_per_model_and_skips_the_head():
    model = cached_tiny("llama")
    body = packed_linears_for(model)
    assert body is not None and packed_linears_for(model) is body
    assert model.get_output_embeddings() not in body.modules
    assert len(body.modules) == 7 * model.config.num_hidden_layers
    before = os.environ.get(GQA_SWITCH)
    with pytest.raises(RuntimeError):
        with swapped(model, fast_head_for(model), gqa=True, body=body):
            assert all("forward" in m.__dict__ for m in body.modules)
            raise RuntimeError("a failing forward")
    assert all("forward" not in m.__dict__ for m in body.modules) and os.environ.get(GQA_SWITCH) == before


def test_seeded_choices_skip_the_trials_and_keep_the_checks():
    """Choices an earlier process made (``FormChooser.seed``) compute their buckets at once: no
    trial of another form, no excess; the first check comes after ``RECHECK_FIRST`` calls, as
    after trials. A bucket already chosen here keeps its choice, one being tried takes the seed
    (its trials end); a form the chooser does not know is skipped."""
    from lookupdec.model.kernels import RECHECK_FIRST, FormChooser

    chooser = FormChooser(("packed", "linear"))
    chooser.record((1, 1), "linear", 1.0)  # (1, 1): trials under way
    chooser.choice[(2, 1)] = "linear"
    taken = chooser.seed({(4, 1): "packed", (1, 1): "packed", (2, 1): "packed", (8, 1): "fused"})
    assert taken == 2 and chooser.choice == {(1, 1): "packed", (2, 1): "linear", (4, 1): "packed"}
    assert not chooser.trials and (8, 1) not in chooser.choice
    forms = []
    for _ in range(RECHECK_FIRST + 1):
        form = chooser.pick((4, 1))
        forms.append(form)
        assert chooser.record((4, 1), form, 1.0 if form == "packed" else 2.0) == (1.0 if form == "linear" else 0.0)
    assert forms == ["packed"] * RECHECK_FIRST + ["linear"] and chooser.choice[(4, 1)] == "packed"


def test_kernel_forms_round_trip_into_a_fresh_head_and_body():
    """``kernel_forms`` writes what the choosers chose, ``seed_kernel_forms`` gives it to another
    model's head and body (entries that do not parse skipped), and that head computes its
    chosen bucket with no trial."""
    from lookupdec.model.kernels import kernel_forms, seed_kernel_forms

    torch.manual_seed(0)
    head = FastHead(torch.nn.Linear(16, 40, bias=False))
    x = torch.randn(3, 16)
    while (3, torch.get_num_threads()) not in head.choice:
        head(x)
    body = PackedLinears([torch.nn.Linear(8, 8)]) if packed_available() else None
    if body is not None:
        body.choice[(5, 2)] = "linear"
    forms = kernel_forms(head, body)
    threads = torch.get_num_threads()
    assert forms["head"] == {f"3,{threads}": head.choice[(3, threads)]}
    assert body is None or forms["body"] == {"5,2": "linear"}
    other = FastHead(torch.nn.Linear(16, 40, bias=False))
    other_body = PackedLinears([torch.nn.Linear(8, 8)]) if body is not None else None
    noisy = {"head": {**forms["head"], "x,1": "linear", "0,1": "linear", "7,1": 3}, "body": forms.get("body", {})}
    assert seed_kernel_forms(other, other_body, noisy) == (2 if body is not None else 1)
    assert other.choice == head.choice and (other_body is None or other_body.choice == {(5, 2): "linear"})
    assert seed_kernel_forms(other, None, {"head": "not a dict"}) == 0 and kernel_forms(None, None) == {}
    out = other(x)
    assert not other._trials and other.take_excess() == 0.0
    torch.testing.assert_close(out, F_linear(x, other.weight))


def F_linear(x, w):
    return x @ w.t()


@needs_onednn
def test_a_chosen_form_is_timed_and_checked_on_the_probe_layers_alone(monkeypatch):
    """Once a bucket has a form, only the probe layers (one linear layer in ``PROBE_SHARE``, in
    the middle of the body) are timed, and a check of the other form runs them alone in it,
    every other layer in the chosen form; the output is the layers' own either way."""
    import lookupdec.model.kernels as kernels
    from lookupdec.model.kernels import PROBE_SHARE, RECHECK_FIRST

    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 8) for _ in range(2 * PROBE_SHARE)]
    body = PackedLinears(layers)
    probe = [m for m in layers if m in body._probe]
    assert probe == layers[PROBE_SHARE : PROBE_SHARE + 2]
    key = (5, torch.get_num_threads())
    body.choice[key] = "packed"
    x = torch.randn(1, 5, 8)

    def run(x):
        for m in layers:
            x = m(x)
        return x

    want = run(x)
    ticks = [0.0]  # a fake clock: one second per reading
    monkeypatch.setattr(kernels.time, "perf_counter", lambda: ticks.__setitem__(0, ticks[0] + 1.0) or ticks[0])
    recorded = []
    record = body._chooser.record
    monkeypatch.setattr(body._chooser, "record", lambda k, form, seconds, reference=None: (
        recorded.append((form, seconds, reference)), record(k, form, seconds, reference))[1])
    forms_seen = []
    for _ in range(RECHECK_FIRST + 1):
        with torch.inference_mode(), body.chosen(5):
            rest = {m.__dict__.get("forward") is body._forwards["packed"][m] for m in layers if m not in body._probe}
            assert rest == {True}  # every other layer packed, checks included
            forms_seen.append(next(f for f in body.forms if all(m.__dict__["forward"] is body._timed[m, f]
                                                                 for m in probe)))
            got = run(x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    first_other = [f for f in body.forms if f != "packed"][0]  # the skinny product where it is built
    assert forms_seen == ["packed"] * RECHECK_FIRST + [first_other]
    assert [f for f, _, _ in recorded] == forms_seen
    assert {seconds for _, seconds, _ in recorded} == {float(len(probe))}  # the probe layers' time alone
    # ... beside the rest of the same forward (the fake clock: the forward's span, 2 readings per
    # probe layer and the closing one, less the probe layers' own)
    assert {reference for _, _, reference in recorded} == {float(len(probe) + 1)}
    assert all("forward" not in m.__dict__ for m in layers)


@needs_skinny
def test_the_cache_keys_name_a_threaded_skinny_product():
    """Cost curves and form choices measured with the one-thread skinny product are not those of
    the product split over torch's threads: ``TargetModel.kernels`` (the caches' keys) names it
    ``skinny-mt`` where the core was built with OpenMP."""
    from lookupdec.model.kernels import skinny_threaded

    target = Engine(cached_tiny("llama"), FakeTokenizer(), EngineConfig()).target
    forms = target.kernels.split("+")
    want = "skinny-mt" if skinny_threaded() else "skinny"
    assert f"head-{want}" in forms
    if "skinny" in target.body.forms:
        assert want in forms
    assert ("skinny" in forms or "head-skinny" in forms) != skinny_threaded()


@needs_skinny
@pytest.mark.parametrize("rows", [0, 1, 9, 64])
def test_the_skinny_hot_path_computes_what_the_checked_binding_does(rows, threads):
    """``kernels.skinny_linear`` hands the core addresses (``native_kernels.skinny_linear_at``)
    where the tensors are float32 CPU with rows of contiguous floats, the checked binding otherwise
    (an instruction set named): the same outputs, bit for bit, with rows strided apart (a
    slice of wider rows) and a bias."""
    from lookupdec.model.kernels import skinny_linear, skinny_pack
    from lookupdec.native import kernels as native_kernels

    generator = torch.Generator().manual_seed(rows)
    w = torch.randn(90, 40, generator=generator)
    bias = torch.randn(90, generator=generator)
    wide = torch.randn(rows, 56, generator=generator)
    x = wide[:, 8:48]  # rows 56 floats apart
    panels = skinny_pack(w)
    want = torch.empty(rows, 90)
    native_kernels.skinny_linear(x, panels, want, None)
    assert torch.equal(skinny_linear(x, panels, 90, None), want)
    assert torch.equal(skinny_linear(x, panels, 90, bias), want + bias)
    assert torch.equal(skinny_linear(x, panels, 90, None, isa=native_kernels.skinny_isa()), want)
    with pytest.raises(ValueError):
        native_kernels.skinny_linear_at(x.data_ptr(), 4, rows, 40, panels.data_ptr(), 90,
                                        want.data_ptr())  # rows overlap


def test_the_core_runs_on_torchs_openmp_runtime():
    """The core links ``libgomp.so.1``, the runtime torch's CPU wheel loads: its thread count
    follows ``torch.set_num_threads`` (``shares_torch_runtime``), so the skinny product splits
    over torch's own workers (``skinny_threaded``); faiss's and sentencepiece's renamed copies,
    loaded in this test session, do not change that."""
    from lookupdec.model.kernels import shares_torch_runtime, skinny_threaded
    from lookupdec.native import kernels as native_kernels

    if not getattr(native_kernels, "OPENMP", False):
        pytest.skip("the core was built without OpenMP")
    before = torch.get_num_threads()
    assert shares_torch_runtime() and skinny_threaded()
    assert torch.get_num_threads() == before  # the check leaves torch's count as it was
    torch.set_num_threads(1)
    try:
        assert native_kernels.omp_max_threads() == 1
    finally:
        torch.set_num_threads(before)


@needs_skinny
def test_the_thread_cap_keeps_the_product_on_one_thread():
    from lookupdec.native import kernels as native_kernels

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        native_kernels.set_skinny_thread_cap(1)
        assert native_kernels.skinny_threads(49152) == 1
    finally:
        native_kernels.set_skinny_thread_cap(1 << 20)
        torch.set_num_threads(before)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "gemma"])
def test_fused_norms_compute_what_the_models_norms_do(family):
    """``fused_norms_for``: each RMS norm that ``F.rms_norm`` computes bit for bit (probed
    once per module) runs as that one call inside ``swapped``: the same outputs on rows of any
    count and scale, the module's own forward back after the block; Gemma's ``1 + weight``
    norm fails the probe and keeps its own."""
    from lookupdec.model.kernels import fused_norms_for

    model = cached_tiny(family)
    norms = fused_norms_for(model)
    assert fused_norms_for(model) is norms  # one list per model
    all_norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    assert all_norms
    if family == "gemma":
        assert norms == []
        return
    assert [m for m, _ in norms] == all_norms
    generator = torch.Generator().manual_seed(3)
    with torch.inference_mode():
        for rows, scale in [(1, 1.0), (7, 1e-3), (33, 50.0)]:
            x = torch.randn(1, rows, all_norms[0].weight.shape[0], generator=generator) * scale
            want = [m(x) for m in all_norms]
            with swapped(model, None, norms=norms):
                assert all("forward" in m.__dict__ for m in all_norms)
                got = [m(x) for m in all_norms]
            assert all(torch.equal(a, b) for a, b in zip(want, got)), (rows, scale)
    assert not any("forward" in m.__dict__ for m in all_norms)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "gemma", "phi", "gpt_neox", "gpt2"])
def test_fused_rotary_computes_what_the_models_rotation_does(family):
    """``fused_rotary_for``: the compiled core's rotation is bit for bit the modeling module's
    ``apply_rotary_pos_emb`` (queries in the layers' transposed layout, one set of cos/sin rows or
    one per batch entry, any scale), set in the module inside ``swapped`` only; what it does not
    take (float64, another ``unsqueeze_dim``, autograd) goes to the module's own function. GPT-2
    has no rotation, GPT-NeoX's (partial) lays its result out otherwise: nothing fused."""
    import sys

    from lookupdec.model.kernels import fused_rotary_for

    model = cached_tiny(family)
    rotary = fused_rotary_for(model)
    assert fused_rotary_for(model) is rotary  # one per model
    if family in ("gpt2", "gpt_neox"):
        assert rotary is None
        return
    module, fused = rotary
    own = module.apply_rotary_pos_emb
    assert own is fused.__wrapped_rotary__ and sys.modules[type(next(
        m for m in model.modules() if type(m).__name__.endswith("Attention"))).__module__] is module
    dim = model.config.head_dim if getattr(model.config, "head_dim", None) else (
        model.config.hidden_size // model.config.num_attention_heads)
    generator = torch.Generator().manual_seed(5)
    with torch.inference_mode():
        for batch, tokens, cos_batch, scale in [(1, 1, 1, 1.0), (1, 9, 1, 30.0), (3, 4, 3, 1e-3), (2, 6, 1, 1.0)]:
            q = torch.randn(batch, tokens, 4, dim, generator=generator).transpose(1, 2) * scale
            k = torch.randn(batch, 2, tokens, dim, generator=generator) * scale
            cos, sin = (torch.randn(cos_batch, tokens, dim, generator=generator) for _ in range(2))
            want = own(q, k, cos, sin)
            with swapped(model, None, rotary=rotary):
                assert module.apply_rotary_pos_emb is fused
                got = module.apply_rotary_pos_emb(q, k, cos, sin)
            assert module.apply_rotary_pos_emb is own
            assert all(torch.equal(a, b) and [st for st, n in zip(a.stride(), a.shape) if n > 1]
                       == [st for st, n in zip(b.stride(), b.shape) if n > 1]
                       for a, b in zip(want, got)), (batch, tokens)
        q64, k64, c64, s64 = (t.double() for t in (q, k, cos, sin))
        assert all(torch.equal(a, b) for a, b in zip(fused(q64, k64, c64, s64), own(q64, k64, c64, s64)))
        assert all(torch.equal(a, b) for a, b in zip(fused(q, k, cos[:, None], sin[:, None], unsqueeze_dim=2),
                                                     own(q, k, cos[:, None], sin[:, None], unsqueeze_dim=2)))
    q, k, cos, sin = (t.clone() for t in (q, k, cos, sin))  # (normal tensors: autograd takes no inference ones)
    leaf = q.requires_grad_(True)  # autograd: the module's own function, which records the graph
    assert all(torch.equal(a, b) for a, b in zip(fused(leaf, k, cos, sin), own(leaf, k, cos, sin)))
    assert fused(leaf, k, cos, sin)[0].requires_grad


def test_engine_forwards_use_the_fused_rotary():
    """A SmolLM2-shaped model's verify forwards rotate through the compiled core (the module's
    function is the fused one during the forward) and generate transformers' tokens."""
    from helpers import hf_greedy

    model = cached_tiny("llama")
    engine = Engine(model, FakeTokenizer(), EngineConfig())
    assert engine.target.rotary is not None
    from lookupdec.model import kernels

    module, fused = engine.target.rotary
    calls = []
    rotate = kernels._rotate

    def counted(*args):
        calls.append(module.apply_rotary_pos_emb is fused)
        return rotate(*args)

    prompt = [5, 9, 13, 17, 21] * 4
    try:
        kernels._rotate = counted
        gen = engine.generate(prompt, max_new_tokens=12)
    finally:
        kernels._rotate = rotate
    assert gen.token_ids == hf_greedy(model, prompt, 12)
    assert calls and all(calls)  # queries and keys of every layer of every forward, through the core
    assert module.apply_rotary_pos_emb is fused.__wrapped_rotary__


def test_core_rms_norm_equals_torch_bit_for_bit():
    """The compiled core's RMS norm adds its sum of squares in the order of torch's CPU sum, so
    on this build it is ``F.rms_norm`` bit for bit: row lengths with and without a vector tail,
    one and several levels of partial sums, many rows and scales. (Where it is not, the engine
    keeps ``F.rms_norm``: ``_core_norm_matches`` probes it per model.)"""
    import torch.nn.functional as F

    from lookupdec.model.kernels import _core_norm_matches, core_rms_norm

    generator = torch.Generator().manual_seed(11)
    with torch.inference_mode():
        for n, rows in [(576, 1), (576, 40), (64, 7), (13, 5), (100, 3), (960, 9), (5120, 2), (8, 4)]:
            w = torch.randn(n, generator=generator)
            assert _core_norm_matches(w, 1e-5), n
            for scale in (1e-4, 1.0, 300.0):
                x = torch.randn(1, rows, n, generator=generator) * scale
                assert torch.equal(core_rms_norm(x, w, 1e-5), F.rms_norm(x, (n,), w, 1e-5)), (n, rows, scale)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_engine_norms_run_in_the_core_and_match_transformers(family):
    """The engine's forwards normalise through the compiled core (every norm of the model, each
    forward) and its greedy output stays transformers'."""
    from helpers import hf_greedy

    from lookupdec.model import kernels

    model = cached_tiny(family)
    engine = Engine(model, FakeTokenizer(), EngineConfig())
    calls = []
    core = kernels.core_rms_norm

    def counted(*args):
        calls.append(args[0].shape)
        return core(*args)

    prompt = [5, 9, 13, 17, 21] * 4
    try:
        kernels.core_rms_norm = counted
        gen = engine.generate(prompt, max_new_tokens=12)
    finally:
        kernels.core_rms_norm = core
    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    assert len(calls) >= 2 * len(norms)  # the prefill and at least one step, every norm
    assert gen.token_ids == hf_greedy(model, prompt, 12)


def test_a_norm_whose_weight_was_replaced_leaves_the_core():
    """The core's norm runs only on the weight its probe passed: a weight set in its place goes
    through ``F.rms_norm`` (same values), and the module's own forward is back after ``swapped``."""
    import torch.nn.functional as F

    from lookupdec.model import kernels

    model = cached_tiny("llama")
    norms = kernels.fused_norms_for(model)
    m, forward = norms[0]
    old = m.weight
    x = torch.randn(1, 3, old.shape[0], generator=torch.Generator().manual_seed(2))
    calls = []
    core = kernels.core_rms_norm

    def counted(*args):
        calls.append(1)
        return core(*args)

    try:
        kernels.core_rms_norm = counted
        with torch.inference_mode():
            forward(x)
            assert calls == [1]  # the probed weight: the core
            m.weight = torch.nn.Parameter(old.detach() * 2)
            got = forward(x)
            assert calls == [1]  # a new weight: F.rms_norm
            assert torch.equal(got, F.rms_norm(x, (old.shape[0],), m.weight, m.variance_epsilon))
    finally:
        kernels.core_rms_norm = core
        m.weight = old


# -- grouped queries: masked attention with grouped K/V heads ----------------------------------
class _Attention(torch.nn.Module):  # what transformers' attention functions read of the module
    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups, self.is_causal, self.training = groups, True, False


def _attention_inputs(batch, heads, kv_heads, q, kv, seed=0):
    g = torch.Generator().manual_seed(seed)
    # the layouts a model hands over: the query a transposed projection, K/V views of a longer buffer
    query = torch.randn(batch, q, heads, 16, generator=g).transpose(1, 2)
    buffer = torch.randn(2, batch, kv_heads, kv + 7, 16, generator=g)
    allowed = torch.rand(batch, 1, q, kv, generator=g) < 0.7
    allowed[..., 0] = True  # every query sees at least one slot
    mask = torch.zeros(batch, 1, q, kv).masked_fill_(~allowed, torch.finfo(torch.float32).min)
    return query, buffer[0, :, :, :kv], buffer[1, :, :, :kv], mask


@pytest.mark.parametrize("batch,heads,kv_heads,q,kv", [(1, 9, 3, 2, 40), (1, 9, 3, 17, 300), (8, 9, 3, 5, 90),
                                                       (3, 4, 2, 4, 33), (2, 8, 1, 3, 50)])
def test_grouped_attention_computes_what_transformers_sdpa_does(batch, heads, kv_heads, q, kv, monkeypatch):
    """Inside ``swapped(gqa=True)`` a masked call of several query tokens with grouped K/V heads is
    one SDPA call over each K/V head's query heads folded into its rows (the core's attention
    off): the same output (float rounding apart), in the same layout, as transformers' own call;
    outside, every call is transformers' own, bit for bit."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from lookupdec.model import kernels

    monkeypatch.setattr(kernels, "CORE_ATTENTION", False)

    model = cached_tiny("llama")
    query, key, value, mask = _attention_inputs(batch, heads, kv_heads, q, kv)
    module = _Attention(heads // kv_heads)
    want, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.25)
    grouped = kernels.grouped_attention(sdpa_attention_forward)
    calls = kernels.GROUPED_CALLS[0]
    assert torch.equal(grouped(module, query, key, value, mask, scaling=0.25)[0], want)  # not on: transformers'
    assert kernels.GROUPED_CALLS[0] == calls
    with swapped(model, None, gqa=True):
        got, weights = grouped(module, query, key, value, mask, scaling=0.25)
        again, _ = grouped(module, query, key, value, mask, scaling=0.25)  # the folded mask made once
    assert kernels.GROUPED_CALLS[0] == calls + 2 and weights is None
    assert got.shape == want.shape == (batch, q, heads, 16) and got.is_contiguous()
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6) and torch.equal(got, again)


@pytest.mark.parametrize("core", [False, True])
def test_grouped_attention_leaves_other_calls_to_transformers(core, monkeypatch):
    """No mask, or not inside ``swapped(gqa=True)``: transformers' own call; with the core's
    attention off also one query token or K/V heads not grouped (the core takes those: the same
    output within rounding); ``swapped`` sets the switch for its block only, on its thread only,
    and forgets the folded mask and the core's plan (a caller may write its mask buffer again
    for the next forward)."""
    import threading

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from lookupdec.model import kernels

    monkeypatch.setattr(kernels, "CORE_ATTENTION", core and kernels.core_attention_available())

    model = cached_tiny("llama")
    grouped = kernels.grouped_attention(sdpa_attention_forward)
    query, key, value, mask = _attention_inputs(2, 6, 2, 4, 30)
    module = _Attention(3)
    calls = kernels.GROUPED_CALLS[0]
    taken = 2 if kernels.CORE_ATTENTION else 0  # the one-token and the ungrouped call: the core's
    with swapped(model, None, gqa=True):
        assert kernels._GROUPED.on
        want, _ = sdpa_attention_forward(module, query, key, value, None)
        assert torch.equal(grouped(module, query, key, value, None)[0], want)
        repeated = (key.repeat_interleave(3, 1), value.repeat_interleave(3, 1))
        for m, args in ((module, (query[:, :, :1], key, value, mask[:, :, :1])), (_Attention(1), (query, *repeated, mask))):
            want, _ = sdpa_attention_forward(m, *args)
            got = grouped(m, *args)[0]
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-6) if kernels.CORE_ATTENTION else torch.equal(got, want)
            kernels._GROUPED.plan = None  # (each its own mask: a forward's layers share one)
        seen = []
        thread = threading.Thread(target=lambda: seen.append(getattr(kernels._GROUPED, "on", False)))
        thread.start()
        thread.join()
        assert seen == [False]
        grouped(module, query, key, value, mask)
        mask[..., 1] = torch.finfo(torch.float32).min  # written again in place (next forward's)
        assert (kernels._GROUPED.plan if kernels.CORE_ATTENTION else kernels._GROUPED.mask) is not None
    assert kernels.GROUPED_CALLS[0] == calls + 1 + taken
    assert not kernels._GROUPED.on and kernels._GROUPED.mask is None and kernels._GROUPED.plan is None
    want, _ = sdpa_attention_forward(module, query, key, value, mask)
    with swapped(model, None, gqa=True):
        got, _ = grouped(module, query, key, value, mask)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)


def test_the_engine_verifies_trees_with_grouped_queries():
    """A grouped-K/V model's tree and batched verify forwards on a CPU go through the grouped
    call (transformers' "sdpa" attention wrapped), and the output stays ``transformers``' greedy."""
    from lookupdec.model import kernels

    model = cached_tiny("qwen2")  # grouped K/V heads
    assert model.config.num_attention_heads > model.config.num_key_value_heads
    engine = Engine(model, FakeTokenizer(), EngineConfig(budget="fixed", max_nodes=8))
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6, 9, 10], [11, 12, 13, 11, 12, 13, 14]]
    greedy_alone_and_batched(engine, model, prompts, kernels.GROUPED_CALLS)


def kernels_core_attention() -> bool:
    from lookupdec.model import kernels

    return kernels.core_attention_available()


# -- the core's tree attention -----------------------------------------------------------------
def _tree_attention_inputs(batch, heads, kv_heads, q, kv, dim, seed=0, dtype=torch.float32):
    """A ragged batch's verify call as the engine makes it: the query a transposed projection,
    K/V views of a longer buffer; every row's prefix with holes (some rows' own), its last ``q``
    slots a tree (the ancestor mask: each query itself and some earlier ones), one padded query
    that sees nothing, and some slots seen with a bias other than 0 (a float mask may hold any)."""
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, q, heads, dim, generator=g).transpose(1, 2)
    buffer = torch.randn(2, batch, kv_heads, kv + 7, dim, generator=g)
    allowed = torch.ones(batch, q, kv, dtype=torch.bool)
    tree = torch.tril(torch.rand(q, q, generator=g) < 0.5) | torch.eye(q, dtype=torch.bool)
    allowed[:, :, kv - q:] = tree
    allowed[:, :, 1:4] = False  # holes every row has
    for b in range(batch):
        start = int(torch.randint(4, max(5, kv - q), (1,), generator=g))
        allowed[b, :, start:start + b % 3 * 2] = False  # and each its own
    if q > 1:
        allowed[-1, -1] = False  # a padded query: sees nothing
    mask = torch.zeros(batch, 1, q, kv, dtype=dtype).masked_fill_(~allowed[:, None], torch.finfo(dtype).min)
    biased = torch.rand(batch, 1, q, kv, generator=g) < 0.05
    mask.masked_fill_(biased & allowed[:, None], -1.5)
    return query, buffer[0, :, :, :kv], buffer[1, :, :, :kv], mask, allowed


@pytest.mark.skipif(not kernels_core_attention(), reason="compiled core without tree attention")
@pytest.mark.parametrize("batch,heads,kv_heads,q,kv,dim", [(1, 9, 3, 8, 600, 64), (8, 9, 3, 4, 300, 64),
                                                           (3, 4, 2, 2, 50, 32), (2, 8, 8, 5, 70, 128),
                                                           (16, 9, 3, 2, 120, 64), (1, 9, 3, 17, 40, 64),
                                                           (2, 4, 1, 6, 25, 48), (1, 4, 2, 9, 40, 16),
                                                           (2, 6, 2, 64, 90, 112), (1, 2, 1, 3, 3, 80),
                                                           (8, 9, 3, 1, 200, 64), (2, 4, 4, 1, 30, 32)])
def test_core_attention_matches_its_float64_definition(batch, heads, kv_heads, q, kv, dim):
    """``kernels.core_attention`` (the compiled tree attention) in every instruction set this CPU
    runs against ``reference.model.attention`` (float64 by definition): each query's softmax over the
    slots its mask row shows, bias added, zeros for one that sees nothing; and against torch's
    SDPA where a query sees something. Rounding apart, the same; the builds agree with each other
    as closely."""
    from lookupdec.model import kernels
    from lookupdec.native import kernels as native_kernels

    query, key, value, mask, allowed = _tree_attention_inputs(batch, heads, kv_heads, q, kv, dim)
    plan = kernels.attention_plan(mask)
    want = reference_model.attention(query, key, value, mask, dim ** -0.5)
    groups = heads // kv_heads
    sdpa = F.scaled_dot_product_attention(query, key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1),
                                          attn_mask=mask).transpose(1, 2)
    live = allowed.any(-1)
    assert not live.all() or q == 1
    outs = {}
    for isa in native_kernels.attention_isas():
        got = kernels.core_attention(query, key, value, plan, dim ** -0.5, isa)
        assert got.shape == (batch, q, heads, dim) and got.is_contiguous()
        assert torch.allclose(got, want, rtol=1e-5, atol=2e-6), (isa, (got - want).abs().max())
        assert torch.equal(got[~live], torch.zeros_like(got[~live]))
        assert torch.allclose(got[live], sdpa[live], rtol=1e-5, atol=2e-6)
        outs[isa] = got
    for isa, got in outs.items():
        assert torch.allclose(got, outs["generic"], rtol=1e-5, atol=2e-6), isa


@pytest.mark.parametrize("made_by", ["core", "reference"])
def test_attention_plan_lists_the_slots_each_row_shows(made_by):
    """The plan: per row the slots some query sees, those every live query sees with bias 0
    first (the prefix), then the rest ascending (the tree, and a slot seen with another bias);
    each query's bias at them (-inf: hidden); a query that sees nothing not live and not
    deciding what is common. A boolean mask plans as its additive twin. The core's plan
    (``attention_plan``) and the torch definition (``reference.model.attention_plan``) alike."""
    from lookupdec.model import kernels

    if made_by == "core" and not kernels_core_attention():
        pytest.skip("compiled core without tree attention")
    plan_of = (kernels.attention_plan if made_by == "core"
               else lambda mask: kernels.AttentionPlan(*reference_model.attention_plan(mask)))

    def used(plan):  # each row's entries up to its count (the core's rows are L wide)
        return ([row[:n] for row, n in zip(plan.cols.tolist(), plan.counts.tolist())],
                [[q[:n] for q in rows] for rows, n in zip(plan.bias.tolist(), plan.counts.tolist())])

    hidden = torch.finfo(torch.float32).min
    rows = [[0, hidden, 0, 0, hidden, 0],       # query 0: slots 0, 2, 3, 5
            [0, hidden, 0, -2.0, 0, hidden],    # query 1: 0, 2, 3 (bias -2), 4
            [hidden] * 6]                       # query 2: nothing (a padded node)
    mask = torch.tensor(rows)[None, None]
    plan = plan_of(mask)
    cols, bias = used(plan)
    assert cols == [[0, 2, 3, 4, 5]] and plan.counts.tolist() == [5] and plan.common.tolist() == [2]
    assert plan.live.tolist() == [[1, 1, 0]]
    inf = -math.inf
    assert bias == [[[0, 0, 0, inf, 0], [0, 0, -2.0, 0, inf], [inf] * 5]]
    boolean = plan_of(mask > hidden)
    cols, bias = used(boolean)
    assert cols == [[0, 2, 3, 4, 5]] and boolean.common.tolist() == [3]
    assert bias[0][1] == [0, 0, 0, 0, inf]
    empty = plan_of(torch.full((2, 1, 3, 4), hidden))
    assert empty.counts.tolist() == [0, 0] and not empty.live.any()


@pytest.mark.skipif(not kernels_core_attention(), reason="compiled core without tree attention")
@pytest.mark.parametrize("shape", [(1, 9, 3, 8, 600, 64), (8, 9, 3, 4, 300, 64), (2, 6, 2, 64, 90, 112),
                                   (3, 4, 2, 2, 50, 32), (5, 4, 2, 1, 17, 16)])
def test_the_cores_attention_plan_is_the_references(shape):
    """The core's plan (``native_kernels.attention_plan_at``) of ragged tree masks -- holes, a padded
    query, biased slots; additive, boolean, and a strided view of a wider buffer -- holds the
    values ``reference.model.attention_plan`` computes, entry for entry up to each row's count."""
    from lookupdec.model import kernels

    mask = _tree_attention_inputs(*shape)[3]
    wide = torch.full((*mask.shape[:3], mask.shape[3] + 5), 7.0)
    wide[..., : mask.shape[3]] = mask
    for m in (mask, mask > torch.finfo(torch.float32).min, wide[..., : mask.shape[3]]):
        got, want = kernels.attention_plan(m), kernels.AttentionPlan(*reference_model.attention_plan(m))
        assert got.cols.shape[1] == m.shape[3]
        for name in ("counts", "common", "live"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name
        for b, n in enumerate(want.counts.tolist()):
            assert torch.equal(got.cols[b, :n], want.cols[b, :n]) and torch.equal(got.bias[b, :, :n], want.bias[b, :, :n])


@pytest.mark.skipif(not kernels_core_attention(), reason="compiled core without tree attention")
def test_grouped_attention_calls_the_core_where_it_applies(monkeypatch):
    """Inside ``swapped(gqa=True)``: a masked float32 call of 2 to ``CORE_MAX_QUERIES`` query
    tokens with head dims the core takes is the core's (the plan made once per forward, forgotten
    as ``swapped`` ends); other head dims, more query tokens, or ``CORE_ATTENTION`` off: the folded
    SDPA call; the same output as transformers' either way."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from lookupdec.model import kernels

    model = cached_tiny("llama")
    grouped = kernels.grouped_attention(sdpa_attention_forward)
    module = _Attention(3)
    query, key, value, mask, _ = _tree_attention_inputs(2, 9, 3, 5, 60, 64)
    want, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.125)
    live = mask[:, 0].amax(-1) > torch.finfo(torch.float32).min
    core = kernels.CORE_ATTENTION_CALLS[0]
    with swapped(model, None, gqa=True):
        got, _ = grouped(module, query, key, value, mask, scaling=0.125)
        plan = kernels._GROUPED.plan[1]
        again, _ = grouped(module, query, key, value, mask, scaling=0.125)
        assert kernels._GROUPED.plan[1] is plan
    assert kernels._GROUPED.plan is None
    assert kernels.CORE_ATTENTION_CALLS[0] == core + 2 and torch.equal(got, again)
    assert torch.allclose(got[live], want[live], rtol=1e-5, atol=2e-6)
    odd = _tree_attention_inputs(2, 9, 3, 5, 60, 24)[:4]  # a head dim the core does not take
    monkeypatch.setattr(kernels, "CORE_MAX_QUERIES", 4)
    with swapped(model, None, gqa=True):
        grouped(module, *odd)
        broadcast = mask[:1].clone()  # one mask row for both rows: SDPA broadcasts it, the core's plan would not
        want_broadcast, _ = sdpa_attention_forward(module, query[:, :, :4], key, value, broadcast[:, :, :4], scaling=0.125)
        got_broadcast, _ = grouped(module, query[:, :, :4], key, value, broadcast[:, :, :4], scaling=0.125)
        assert torch.allclose(got_broadcast[:, :3], want_broadcast[:, :3], rtol=1e-5, atol=2e-6)
        grouped(module, query, key, value, mask, scaling=0.125)  # 5 query tokens > 4
        monkeypatch.setattr(kernels, "CORE_MAX_QUERIES", 64)
        monkeypatch.setattr(kernels, "CORE_ATTENTION", False)
        folded, _ = grouped(module, query, key, value, mask, scaling=0.125)
    assert kernels.CORE_ATTENTION_CALLS[0] == core + 2
    assert torch.allclose(folded[live], want[live], rtol=1e-5, atol=2e-6)


@pytest.mark.skipif(not kernels_core_attention(), reason="compiled core without tree attention")
def test_the_engine_verifies_with_the_core_attention():
    """A grouped-K/V model whose head dim the core takes (16): its tree and batched verify
    forwards call the core's tree attention, and the output stays ``transformers``' greedy."""
    import transformers

    from lookupdec.model import kernels

    torch.manual_seed(3)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=96, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0)).eval()
    assert model.config.hidden_size // model.config.num_attention_heads == 16
    engine = Engine(model, FakeTokenizer(), EngineConfig(budget="fixed", max_nodes=8))
    engine.target.native = None  # the eager forward's attention (the compiled decoder calls it from C++)
    prompts = [[5, 6, 7, 5, 6, 8, 5, 6, 9, 5, 6], [11, 12, 13, 11, 12, 14, 11, 12], [20, 21, 22, 20, 21, 23, 20]]
    greedy_alone_and_batched(engine, model, prompts, kernels.CORE_ATTENTION_CALLS)
