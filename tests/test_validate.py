"""One set of checks for every entry point (lookupdec/validate.py): the Python API, the CLI
(one line, exit 2) and the server (400 naming the field, server/test_server_app.py) refuse the same
values: non-finite or out-of-range sampling values, seeds outside 0 .. 2**64 - 1, devices this
machine lacks."""
import math

import pytest
import torch

from helpers import needs_stories, run_cli
from lookupdec.cli import main
from lookupdec.sampling import SamplingParams
from lookupdec.validate import MAX_STOP_CHARS, SEED_MAX, ParamError, check_device, check_sampling, check_seed, check_stop
from repo_paths import STORIES

HUGE_SEED = 1180591620717411303424  # 2**70, the probe


@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": math.inf}, "temperature"),
    ({"temperature": math.nan}, "temperature"),
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": True}, "temperature"),
    ({"temperature": "1"}, "temperature"),
    ({"top_k": 0}, "top_k"),
    ({"top_k": 2.5}, "top_k"),
    ({"top_p": math.nan}, "top_p"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": math.inf}, "top_p"),
    ({"repetition_penalty": math.inf}, "repetition_penalty"),
    ({"repetition_penalty": -math.inf}, "repetition_penalty"),
    ({"repetition_penalty": math.nan}, "repetition_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"temperature": 10**400}, "temperature"),  # an int too large for a float
])
def test_bad_sampling_values_name_their_field(kwargs, field):
    with pytest.raises(ParamError) as info:
        check_sampling(**kwargs)
    assert info.value.field == field and str(info.value).startswith(field + "=")
    with pytest.raises(ParamError):
        SamplingParams(**kwargs)


def test_a_stop_string_has_at_most_max_stop_chars():
    """Longer stop strings are refused: the text held back while a tail may become one is found
    in a set of every prefix, whose size grows with the square of the length (a 100 000-character
    stop took 28 s and 5 GB of a server's engine thread)."""
    assert check_stop(["x" * MAX_STOP_CHARS, "y"]) == ["x" * MAX_STOP_CHARS, "y"]
    with pytest.raises(ParamError, match=f"{MAX_STOP_CHARS + 1} characters, at most {MAX_STOP_CHARS}") as info:
        check_stop(["y", "x" * (MAX_STOP_CHARS + 1)])
    assert info.value.field == "stop" and len(str(info.value)) < 200


def test_good_sampling_values_pass():
    check_sampling(temperature=0, top_k=1, top_p=1, repetition_penalty=1.0)
    check_sampling(temperature=1e30, top_k=10**6, top_p=1e-9, repetition_penalty=0.5)


@pytest.mark.parametrize("seed", [-1, SEED_MAX + 1, HUGE_SEED, 1.5, "7", True])
def test_bad_seeds(seed):
    with pytest.raises(ParamError, match="seed") as info:
        check_seed(seed)
    assert info.value.field == "seed" and "18446744073709551615" in str(info.value)


@pytest.mark.parametrize("seed", [None, 0, 7, 2**63, SEED_MAX])
def test_good_seeds_are_what_torch_takes(seed):
    check_seed(seed)
    if seed is not None:
        torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("device", ["cuda:99", "gpu", "cuda:x", ""])
def test_bad_devices(device):
    with pytest.raises(ParamError) as info:
        check_device(device)
    assert info.value.field == "device" and "\n" not in str(info.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine with CUDA")
def test_cuda_without_cuda_says_so():
    with pytest.raises(ParamError, match="CUDA is not available"):
        check_device("cuda:7")


def test_cpu_is_fine():
    assert check_device("cpu") == "cpu" and check_device(None) is None


# -- the API and the CLI ----------------------------------------------------------------------
@needs_stories
@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": math.inf}, "temperature"),
    ({"repetition_penalty": math.inf}, "repetition_penalty"),
    ({"temperature": 1.0, "seed": HUGE_SEED}, "seed"),
    ({"temperature": 1.0, "seed": -5}, "seed"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"stop": 5}, "stop"),
    ({"prompt": [1, 10**30]}, "prompt"),
    ({"prompt": ["a"]}, "prompt"),
])
def test_engine_generate_raises_param_error(kwargs, field):
    from conftest import load_stories
    from lookupdec import Engine

    model, tokenizer = load_stories()
    engine = Engine(model, tokenizer)
    kwargs = {"prompt": "Once", "max_new_tokens": 4} | kwargs
    with pytest.raises(ParamError) as info:
        engine.generate(kwargs.pop("prompt"), **kwargs)
    assert info.value.field == field


@needs_stories
def test_engine_from_pretrained_refuses_a_missing_device():
    from lookupdec import Engine

    with pytest.raises(ParamError, match="device"):
        Engine.from_pretrained(STORIES, device="cuda:99")


@needs_stories
@pytest.mark.parametrize("args, message", [
    (["--temperature", "inf"], "temperature=inf"),
    (["--temperature", "nan"], "temperature=nan"),
    (["--repetition-penalty", "inf"], "repetition_penalty=inf"),
    (["--repetition-penalty", "nan"], "repetition_penalty=nan"),
    (["--top-p", "nan"], "top_p=nan"),
    (["--top-k", "0"], "top_k=0"),
    (["--seed", str(HUGE_SEED)], "seed=1180591620717411303424"),
    (["--seed", "-1"], "seed=-1"),
    (["--device", "cuda:99"], "device='cuda:99'"),
    (["--device", "gpu"], "device='gpu'"),
])
def test_generate_bad_values_one_line_exit_2(capsys, args, message):
    code, out, err = run_cli(capsys, "generate", "--model", STORIES, "--prompt", "x", "--max-new-tokens", "2", *args)
    assert code == 2 and not out
    assert err.startswith("lookupdec: error: ") and message in err and err.count("\n") == 1, err


@needs_stories
def test_serve_with_a_missing_device_one_line_exit_2(capsys):
    pytest.importorskip("fastapi")
    code, _, err = run_cli(capsys, "serve", "--model", STORIES, "--device", "cuda:99")
    assert code == 2 and err.startswith("lookupdec: error: device=") and err.count("\n") == 1, err


@needs_stories
@pytest.mark.parametrize("args, message", [
    (["--temperature", "inf"], "temperature=inf"),
    (["--seed", str(HUGE_SEED)], "seed="),
    (["--device", "cuda:99"], "device="),
])
def test_rewrite_bad_values_one_line_exit_2(capsys, tmp_path, args, message):
    source = tmp_path / "in.txt"
    source.write_text("one\ntwo\n")
    out_path = tmp_path / "out.jsonl"
    code, _, err = run_cli(capsys, "rewrite", "--model", STORIES, "--input", str(source), "--output", str(out_path),
                       "--instruction", "Rewrite", "--max-new-tokens", "2", *args)
    assert code == 2 and message in err and err.count("\n") == 1, err
    assert not out_path.exists() or out_path.read_text() == ""


@pytest.mark.parametrize("argv, message", [
    (["rewrite", "--input", "x", "--output", "o.jsonl", "--instruction", "x", "--batch-size", "0"],
     "lookupdec rewrite: argument --batch-size/--max-batch: expected 'auto' or an integer in [1, 64], got '0'"),
    (["generate", "--prompt", "x", "--max-new-tokens", "1.5"], "lookupdec generate: argument --max-new-tokens"),
    (["serve", "--max-batch", "65"], "lookupdec serve: argument --max-batch"),
    (["index", "query"], "lookupdec index query: the following arguments are required"),
    (["nothing"], "lookupdec: argument COMMAND: invalid choice: 'nothing'"),
])
def test_argument_errors_are_one_line_exit_2(capsys, argv, message):
    """What argparse itself refuses is one line as every other usage error (it had printed its
    usage screen first, ~20 lines), naming the command and how to see its help."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.startswith(f"lookupdec: error: {message}") and err.count("\n") == 1, err
    assert "--help')" in err
