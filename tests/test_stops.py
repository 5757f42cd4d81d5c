"""Stop strings: found across token boundaries and inside blocks of several tokens accepted in one
step; the text ends exactly before the earliest stop string; streamed pieces add up to the final
text (so no streamed prefix ever shows part of a stop string, since pieces are never taken back);
``finish_reason == "stop"``. Real text from the stories260K model and tokenizer."""
from __future__ import annotations

import random

import pytest

from helpers import OracleProposer, hf_greedy
from lookupdec import Engine, EngineConfig
from lookupdec.stops import INCOMPLETE_CHAR, StopStrings, TextAssembler

PROMPT = "Once upon a time"
N_TOKENS = 80


# -- StopStrings -----------------------------------------------------------------------------
def test_docstring_examples():
    s = StopStrings(["\n\n", "END"])
    assert s.find("abc END x\n\n") == 4
    assert s.holdback("value: EN") == 2


def test_earliest_start_wins_over_earliest_end():
    s = StopStrings(["bcd", "abcdef"])
    assert s.find("xxabcdefg") == 2  # "abcdef" starts first though "bcd" ends first
    assert StopStrings("b").find("abc") == 1 and StopStrings(None).find("abc") is None


@pytest.mark.parametrize("bad", [[""], ["ok", ""], [None], [3]])
def test_bad_stop_strings_raise(bad):
    with pytest.raises(ValueError, match="stop"):
        StopStrings(bad)


def test_find_and_holdback_against_brute_force():
    rng = random.Random(0)
    for _ in range(2000):
        stops = ["".join(rng.choice("ab ") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        text = "".join(rng.choice("ab c") for _ in range(rng.randint(0, 20)))
        s = StopStrings(stops)
        hits = [i for i in (text.find(x) for x in stops) if i >= 0]
        assert s.find(text) == (min(hits) if hits else None), (stops, text)
        start = rng.randint(0, len(text))  # text before `start` searched already and free of stops
        if s.find(text[:start]) is None:
            assert s.find(text, start) == (min(hits) if hits else None), (stops, text, start)
        want = max((k for k in range(1, len(text) + 1) for x in stops if len(x) > k and text.endswith(x[:k])),
                   default=0)
        assert s.holdback(text) == want, (stops, text)


# -- TextAssembler ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def story(stories):
    """Greedy reference continuation of PROMPT: (token ids, text, char offset of each token)."""
    model, tokenizer = stories
    ids = hf_greedy(model, tokenizer(PROMPT).input_ids, N_TOKENS)
    text = tokenizer.decode(ids, skip_special_tokens=True)
    offsets = [len(tokenizer.decode(ids[:k], skip_special_tokens=True)) for k in range(len(ids) + 1)]
    assert offsets[-1] == len(text)
    return ids, text, offsets


def spanning_stop(story, token: int, across: int = 2) -> str:
    """A stop string starting inside token ``token``'s text and ending inside a later token's."""
    ids, text, offsets = story
    while offsets[token + 1] - offsets[token] < 2 or offsets[token + across + 1] - offsets[token + across] < 2:
        token += 1
    return text[offsets[token] + 1 : offsets[token + across] + 1]


def assemble(tokenizer, ids, stop, rng):
    """Feed ``ids`` in random blocks; returns (pieces, assembler)."""
    asm, pieces, i = TextAssembler(tokenizer, StopStrings(stop)), [], 0
    while i < len(ids) and not asm.stopped:
        k = rng.randint(1, 6)
        pieces.append(asm.add(ids[i : i + k]))
        i += k
    pieces.append(asm.flush())
    return pieces, asm


def check_output_ids(tokenizer, asm) -> None:
    """The output tokens cover the text and end with the token where the stop string begins."""
    decoded = tokenizer.decode(asm.output_ids, skip_special_tokens=True)
    assert decoded.startswith(asm.text)
    if asm.output_ids and asm.text:
        assert len(tokenizer.decode(asm.output_ids[:-1], skip_special_tokens=True)) < len(asm.text)


def test_assembler_without_stops_streams_the_whole_text(stories, story):
    _, tokenizer = stories
    ids, text, _ = story
    for seed in range(5):
        pieces, asm = assemble(tokenizer, ids, None, random.Random(seed))
        assert "".join(pieces) == asm.text == text and not asm.stopped
        assert asm.output_ids == ids


@pytest.mark.parametrize("block", [1, 2, 3])
def test_assembler_text_is_the_tokens_whatever_the_steps_with_a_special_token_inside(stories, block):
    """A special token in the middle of the output (stories260K emits ``<s>`` between stories)
    decodes to nothing: the word after it keeps its space however the tokens come, one per
    step included (a window starting at the ``<s>`` alone had dropped it: "as.Once")."""
    _, tokenizer = stories
    ids = tokenizer("as. Once upon a time").input_ids[1:]  # (no leading <s>)
    ids = ids[:3] + [tokenizer.bos_token_id] + ids[3:]
    whole = tokenizer.decode(ids, skip_special_tokens=True)
    assert "Once" in whole and ". Once" in whole
    asm = TextAssembler(tokenizer, StopStrings(None))
    pieces = [asm.add(ids[i : i + block]) for i in range(0, len(ids), block)] + [asm.flush()]
    assert "".join(pieces) == asm.text == whole


def test_assembler_byte_fallback_runs_whatever_the_steps(stories):
    """SentencePiece byte-fallback tokens: a run whose bytes are not UTF-8 decodes to one U+FFFD
    per token, even the bytes that alone are ASCII ("<", "x", "h" here), so its text is known
    only when the run ends; a valid run (an emoji, "ï") is its character. Whatever the steps,
    the text is the whole decode (one token per step had given "C<xh\ufffd)")."""
    _, tokenizer = stories
    invalid = tokenizer.convert_tokens_to_ids(["C", "<0x3C>", "<0x78>", "<0x68>", "<0x9D>", ")"])
    valid = tokenizer("café 😀 naïve").input_ids[1:]
    assert {"<0xF0>", "<0xC3>"} <= set(tokenizer.convert_ids_to_tokens(valid))
    rng = random.Random(0)
    for ids in (invalid, valid, valid + invalid + valid, invalid + invalid):
        whole = tokenizer.decode(ids, skip_special_tokens=True)
        for _ in range(20):
            asm, pieces, i = TextAssembler(tokenizer, StopStrings(None)), [], 0
            while i < len(ids):
                k = rng.randint(1, 4)
                pieces.append(asm.add(ids[i : i + k]))
                i += k
            pieces.append(asm.flush())
            assert "".join(pieces) == asm.text == whole
    assert tokenizer.decode(invalid) == "C" + INCOMPLETE_CHAR * 4 + ")"


def test_assembler_stop_across_boundaries_and_blocks(stories, story):
    _, tokenizer = stories
    ids, text, _ = story
    rng = random.Random(1)
    for token in range(2, len(ids) - 8, 3):
        stop = spanning_stop(story, token, across=rng.randint(1, 3))
        want = text[: text.find(stop)]
        for _ in range(3):
            pieces, asm = assemble(tokenizer, ids, [stop, "never seen"], rng)
            assert asm.stopped and asm.text == want, stop
            assert "".join(pieces) == want, f"streamed {''.join(pieces)!r}, want {want!r}"
            check_output_ids(tokenizer, asm)


def test_assembler_releases_a_pending_prefix_that_does_not_become_the_stop(stories, story):
    _, tokenizer = stories
    ids, text, offsets = story
    word = text[offsets[3]:offsets[6]].strip()
    stop = word + "\u2603 never"  # the text has `word` but never this continuation
    assert stop not in text and word in text
    pieces, asm = assemble(tokenizer, ids, stop, random.Random(2))
    assert "".join(pieces) == text and not asm.stopped


def test_assembler_holds_back_incomplete_utf8(stories):
    _, tokenizer = stories
    text = "Lily said café 😀 and ü ok"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    asm = TextAssembler(tokenizer, StopStrings(["😀 and"]))
    pieces = [asm.add([t]) for t in ids] + [asm.flush()]
    assert all(INCOMPLETE_CHAR not in p for p in pieces)
    assert "".join(pieces) == asm.text == text[: text.find("😀 and")]


@pytest.mark.parametrize("block", [1, 100])
def test_output_ids_after_multibyte_characters(stories, block):
    _, tokenizer = stories
    text = "a 🙂🙂 STOP"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    asm = TextAssembler(tokenizer, StopStrings("STOP"))
    for i in range(0, len(ids), block):
        asm.add(ids[i : i + block])
    assert asm.text == "a 🙂🙂 "
    check_output_ids(tokenizer, asm)


# -- the engine ------------------------------------------------------------------------------
def run_stream(engine, **kwargs):
    stream = engine.stream(PROMPT, max_new_tokens=N_TOKENS, **kwargs)
    pieces = list(stream)
    return pieces, stream.generation


@pytest.fixture(scope="module")
def engines(stories, story):
    """One engine without drafts, and one whose oracle drafts the whole reference at once
    (so a stop string lands inside a block of many tokens accepted in one step)."""
    model, tokenizer = stories
    ids, _, _ = story
    plain = Engine(model, tokenizer, EngineConfig(proposers=(), budget="fixed"))
    prompt_ids = tokenizer(PROMPT).input_ids
    oracle = Engine(model, tokenizer, EngineConfig(proposers=(), budget="fixed", max_nodes=64, max_depth=48),
                    proposers=[OracleProposer({tuple(prompt_ids): prompt_ids + ids})])
    return {"one token per step": plain, "many tokens per step": oracle}


@pytest.mark.parametrize("mode", ["one token per step", "many tokens per step"])
def test_engine_stops_exactly_before_the_stop_string(stories, story, engines, mode):
    _, tokenizer = stories
    ids, text, _ = story
    engine = engines[mode]
    for token in (3, 17, 30, 45):
        stop = spanning_stop(story, token)
        pieces, gen = run_stream(engine, stop=[stop])
        want = text[: text.find(stop)]
        assert gen.finish_reason == "stop" and gen.text == want, f"stop {stop!r}: {gen.text!r}"
        assert "".join(pieces) == want, f"stop {stop!r}: streamed {''.join(pieces)!r}"
        assert engine.generate(PROMPT, max_new_tokens=N_TOKENS, stop=stop).text == want
        assert not any(getattr(p, "active", ()) for p in engine.proposers), "request not stopped"
        assert gen.token_ids == ids[: len(gen.token_ids)]
        assert tokenizer.decode(gen.token_ids, skip_special_tokens=True).startswith(want)
        assert len(tokenizer.decode(gen.token_ids[:-1], skip_special_tokens=True)) < len(want)
        if mode == "many tokens per step":  # the stop string arrived inside one block of 49 tokens
            assert gen.stats.steps == 1 and gen.stats.accepted_by_source["oracle"] == 48, gen.stats


@pytest.mark.parametrize("mode", ["one token per step", "many tokens per step"])
def test_engine_stop_edge_cases(story, engines, mode):
    ids, text, offsets = story
    engine = engines[mode]
    # the earliest of several stop strings wins
    late, early = spanning_stop(story, 40), spanning_stop(story, 10)
    gen = engine.generate(PROMPT, max_new_tokens=N_TOKENS, stop=[late, early])
    assert gen.text == text[: text.find(early)] and gen.finish_reason == "stop"
    # a stop string at the very start: nothing is shown
    pieces, gen = run_stream(engine, stop=text[:3])
    assert gen.text == "" and pieces == [] and gen.finish_reason == "stop"
    # a stop string in the prompt only does not stop the output
    gen = engine.generate(PROMPT, max_new_tokens=N_TOKENS, stop="upon a")
    assert "upon a" not in text and gen.text == text and gen.finish_reason == "length"
    # the output ends in a proper prefix of a stop string: held back while pending, then shown
    tail = text[-4:]
    pieces, gen = run_stream(engine, stop=tail + "\u2603")
    assert gen.finish_reason == "length" and "".join(pieces) == gen.text == text
