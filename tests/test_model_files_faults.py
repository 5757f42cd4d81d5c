"""The GGUF conversion cache (``lookupdec.model_files.gguf_folder``) against what can sit at an
entry's name and a disk that runs out, with the real conversion (``lookupdec.model.convert_gguf``)
of a real GGUF file: stories260K written as GGUF here (float32, so that the conversion is exact),
whose converted folder gives stories260K's own greedy tokens.

Invariants: whatever is at ``gguf/<hash>`` and is not a valid folder (a file, a dangling
symlink, a half-written folder, a symlink to one) is converted again and replaced whole, a
symlink's target left as it was; a disk that runs out mid-conversion is one line naming the
cache folder (exit 2), and leaves nothing at the entry's name nor any temporary folder.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import STORIES
from lookupdec.model import load
from lookupdec.model.load import convert_gguf
from lookupdec.model_files import STAMP, file_sha256, gguf_folder

gguf = pytest.importorskip("gguf")
FSIZE_LIMIT = 200_000  # bytes: under stories260K's 1 MB of weights, above every other file written
SUBPROCESS_TIMEOUT_S = 120
# stories260K's tensors by their GGUF (llama.cpp) names; its output layer is tied to the embedding
GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def write_stories_gguf(path: str) -> None:
    """stories260K (float32 tensors, sentencepiece vocabulary) as a GGUF file, as llama.cpp's
    converter writes one: q and k rows permuted (transformers permutes them back)."""
    import sentencepiece
    from safetensors.numpy import load_file

    config = json.load(open(os.path.join(STORIES, "config.json")))
    sp = sentencepiece.SentencePieceProcessor(model_file=os.path.join(STORIES, "tokenizer.model"))
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("stories260K")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_dimension_count(config["head_dim"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_tokenizer_model("llama")
    pieces = range(sp.get_piece_size())
    writer.add_token_list([sp.id_to_piece(i).encode("utf-8") for i in pieces])
    writer.add_token_scores([sp.get_score(i) for i in pieces])
    token_type = gguf.TokenType
    writer.add_token_types([token_type.UNKNOWN if sp.is_unknown(i) else token_type.CONTROL if sp.is_control(i)
                            else token_type.BYTE if sp.is_byte(i) else token_type.NORMAL for i in pieces])
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_unk_token_id(sp.unk_id())

    def permute(weight, heads):  # [heads * head_dim, hidden]: each head's two rotary halves interleaved
        return weight.reshape(heads, 2, weight.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(weight.shape)

    for name, weight in load_file(os.path.join(STORIES, "model.safetensors")).items():
        if name == "model.embed_tokens.weight":
            writer.add_tensor("token_embd.weight", weight)
        elif name == "model.norm.weight":
            writer.add_tensor("output_norm.weight", weight)
        else:  # model.layers.N.<module>.weight
            _, _, layer, module = name.removesuffix(".weight").split(".", 3)
            if module == "self_attn.q_proj":
                weight = permute(weight, config["num_attention_heads"])
            elif module == "self_attn.k_proj":
                weight = permute(weight, config["num_key_value_heads"])
            writer.add_tensor(f"blk.{layer}.{GGUF_NAMES[module]}.weight", weight)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def stories_gguf(tmp_path_factory):
    if not os.path.isdir(STORIES):
        pytest.skip(f"stories260K not found at {STORIES}")
    path = tmp_path_factory.mktemp("gguf") / "stories260K.F32.gguf"
    write_stories_gguf(str(path))
    return path


def entry_of(cache, path) -> str:
    return str(cache / "gguf" / file_sha256(str(path))[:32])


def leftovers(cache) -> list[str]:
    """What sits in the cache besides lock files."""
    return sorted(n for n in os.listdir(cache / "gguf") if not n.endswith(".lock"))


def test_the_test_gguf_is_stories260k(model_cache, stories_gguf, stories):
    """The fixture is a real model: its converted folder gives stories260K's greedy tokens."""
    model, tokenizer = load(str(stories_gguf), device="cpu")
    ids = tokenizer("Once upon a time", return_tensors="pt").input_ids
    assert ids.tolist() == stories[1]("Once upon a time", return_tensors="pt").input_ids.tolist()
    want = stories[0].generate(ids, max_new_tokens=8, do_sample=False)
    assert model.generate(ids, max_new_tokens=8, do_sample=False).tolist() == want.tolist()


@pytest.mark.parametrize("damage", ["file", "dangling_symlink", "half_written_folder", "symlink_to_a_damaged_folder"])
def test_whatever_is_not_a_valid_folder_is_converted_again(model_cache, stories_gguf, tmp_path, damage):
    """Before: a file or a dangling symlink made every load convert, then fail ("Not a
    directory"); a symlink to a folder failed ("Cannot call rmtree on a symbolic link")."""
    entry = entry_of(model_cache, stories_gguf)
    os.makedirs(os.path.dirname(entry))
    target = tmp_path / "elsewhere"
    if damage == "file":
        open(entry, "w").write("not a folder")
    elif damage == "dangling_symlink":
        os.symlink(tmp_path / "gone", entry)
    else:
        folder = entry if damage == "half_written_folder" else target
        os.makedirs(folder)
        open(os.path.join(folder, "config.json"), "w").write("{}")  # no stamp: never finished
        if damage == "symlink_to_a_damaged_folder":
            os.symlink(target, entry)
    assert gguf_folder(str(stories_gguf), convert_gguf) == entry
    assert os.path.isdir(entry) and not os.path.islink(entry)
    stamp = json.load(open(os.path.join(entry, STAMP)))
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= set(stamp["files"])
    assert leftovers(model_cache) == [os.path.basename(entry)]  # nothing moved aside is left
    if damage == "symlink_to_a_damaged_folder":  # the link replaced, its target as it was
        assert os.listdir(target) == ["config.json"]


def test_a_full_disk_is_one_line_and_leaves_nothing(model_cache, stories_gguf):
    """A file-size limit (SIGXFSZ ignored: writes fail with EFBIG, as on a full disk) stops the
    conversion while safetensors writes the weights. Before: a SafetensorError traceback, exit 1."""
    entry = entry_of(model_cache, stories_gguf)
    os.makedirs(os.path.dirname(entry))
    open(entry, "w").write("a damaged entry")  # removed for the conversion's room, not restored
    script = ("import resource, signal, sys\n"
              "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
              f"resource.setrlimit(resource.RLIMIT_FSIZE, ({FSIZE_LIMIT}, resource.RLIM_INFINITY))\n"
              "from lookupdec.cli import main\n"
              "sys.exit(main(sys.argv[1:]))\n")
    result = subprocess.run([sys.executable, "-c", script, "generate", "--model", str(stories_gguf),
                             "--prompt", "Once", "--max-new-tokens", "2"],
                            capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("lookupdec: error: ") and "Traceback" not in result.stderr, result.stderr
    assert f"GGUF cache {model_cache / 'gguf'} ran out of space" in last and "LOOKUPDEC_CACHE" in last, last
    assert leftovers(model_cache) == []
