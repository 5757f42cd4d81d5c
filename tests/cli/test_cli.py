"""The CLI through ``main([...])``: output, JSON, and one-line errors for every bad input."""
import json

import pytest

from helpers import needs_stories, run_cli
from lookupdec.cli import main
from repo_paths import STORIES

pytestmark = needs_stories


def test_generate_json_matches_transformers_greedy(capsys):
    from lookupdec.model import load

    prompt = "Once upon a time, Lily saw a cat. The cat was big. Once upon a time, Lily"
    code, out, _ = run_cli(capsys, "generate", "--model", STORIES, "--prompt", prompt, "--max-new-tokens", "24", "--json")
    assert code == 0
    result = json.loads(out)
    assert set(result) == {"text", "token_ids", "finish_reason", "stats"}
    assert result["finish_reason"] == "length" and len(result["token_ids"]) == 24
    model, tokenizer = load(STORIES)
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    want = model.generate(ids, do_sample=False, max_new_tokens=24)[0, ids.shape[1]:].tolist()
    assert result["token_ids"] == want
    assert result["stats"]["steps"] <= 24 and result["stats"]["mean_accepted"] >= 1.0


def test_generate_streams_text_and_stats(capsys, tmp_path):
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text("Once upon a time")
    code, out, err = run_cli(capsys, "generate", "--model", STORIES, "--prompt-file", str(prompt_file),
                         "--max-new-tokens", "16", "--stats", "--stop", "zzzz")
    assert code == 0 and out.strip()
    assert "tokens/step" in err


def test_stop_string_cuts_output(capsys):
    code, out, _ = run_cli(capsys, "generate", "--model", STORIES, "--prompt", "Once upon a time",
                       "--max-new-tokens", "64", "--stop", ".", "--json")
    result = json.loads(out)
    assert code == 0 and result["finish_reason"] == "stop" and "." not in result["text"]


def _not_causal(tmp_path):
    folder = tmp_path / "vit"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "vit"}))
    return str(folder)


@pytest.mark.parametrize("args, message", [
    (["--model", "/nonexistent/model", "--prompt", "x"], "model path not found"),
    (["--prompt", ""], "prompt is empty"),
    (["--prompt", "x", "--temperature", "-1"], "temperature"),
    (["--prompt", "x", "--top-p", "0"], "top_p"),
    (["--prompt", "x", "--top-p", "1.5"], "top_p"),
    (["--prompt", "word " * 700], "context"),
    (["--prompt-file", "/nonexistent/prompt.txt"], "prompt-file"),
])
def test_bad_input_one_line_error(capsys, args, message):
    if "--model" not in args:
        args = ["--model", STORIES] + args
    code, out, err = run_cli(capsys, "generate", *args)
    assert code == 2
    assert message in err and "Traceback" not in err
    assert err.strip().count("\n") == 0 or err.strip().splitlines()[-1].startswith("lookupdec: error:")


def test_not_a_causal_lm(capsys, tmp_path):
    code, _, err = run_cli(capsys, "generate", "--model", _not_causal(tmp_path), "--prompt", "x")
    assert code == 2 and "not a causal language model" in err


@pytest.mark.parametrize("value", ["0", "-3", "many"])
def test_max_new_tokens_must_be_positive(capsys, value):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--model", STORIES, "--prompt", "x", "--max-new-tokens", value])
    assert exit_info.value.code == 2
    assert "--max-new-tokens" in capsys.readouterr().err


# -- the engine options: one definition, every command that builds an engine ----------------------
ENGINE_COMMANDS = {  # command -> the other arguments it needs to reach Engine.from_pretrained
    "generate": ["--prompt", "x"],
    "serve": [],
    "rewrite": ["--instruction", "Fix:"],  # + --input/--output, in a tmp folder
}
ENGINE_FLAGS = ("--model", "--index", "--draft-model", "--draft-mode", "--max-nodes", "--fixed-budget", "--device",
                "--dtype")


def test_every_engine_command_takes_the_same_engine_flags():
    from lookupdec.cli import build_parser

    commands = next(a for a in build_parser()._actions if a.dest == "command").choices
    seen = {}
    for command in ENGINE_COMMANDS:
        actions = {a.option_strings[0]: a for a in commands[command]._actions if a.option_strings}
        for flag in ENGINE_FLAGS:
            a = actions[flag]
            seen.setdefault(flag, set()).add((a.type, a.choices, a.help, a.nargs, a.const))
    assert all(len(kinds) == 1 for kinds in seen.values()), {f: k for f, k in seen.items() if len(k) > 1}


@pytest.mark.parametrize("command", sorted(ENGINE_COMMANDS))
@pytest.mark.parametrize("value", ["0", "-2", "many"])
def test_max_nodes_is_a_positive_int_everywhere(capsys, tmp_path, command, value):
    with pytest.raises(SystemExit) as exit_info:
        main([command, *_engine_command_args(command, tmp_path), "--max-nodes", value])
    assert exit_info.value.code == 2 and "--max-nodes" in capsys.readouterr().err


def _engine_command_args(command, tmp_path):
    extra = list(ENGINE_COMMANDS[command])
    if command == "rewrite":
        (tmp_path / "in.txt").write_text("one line\n")
        extra += ["--input", str(tmp_path / "in.txt"), "--output", str(tmp_path / "out.jsonl")]
    return extra


@pytest.mark.parametrize("command", sorted(ENGINE_COMMANDS))
def test_engine_flags_reach_the_engine(capsys, tmp_path, monkeypatch, command):
    """Every command hands the same flags to ``Engine.from_pretrained`` (stopped there: no model
    is loaded)."""
    from lookupdec.config import DraftConfig, EngineConfig
    from lookupdec.engine import Engine

    seen = {}

    def from_pretrained(model, **kwargs):
        seen.update(kwargs, model=model)
        raise ValueError("stopped before loading")

    monkeypatch.setattr(Engine, "from_pretrained", from_pretrained)
    code, _, err = run_cli(capsys, command, *_engine_command_args(command, tmp_path), "--model", "some-model",
                       "--max-nodes", "16", "--fixed-budget", "--draft-mode", "never", "--draft-model", "d",
                       "--index", "idx", "--device", "cpu", "--dtype", "float32")
    assert code == 2 and "stopped before loading" in err
    assert seen == dict(model="some-model", device="cpu", dtype="float32", index="idx", draft_model="d",
                        config=EngineConfig(max_nodes=16, budget="fixed", draft=DraftConfig(mode="never")))
