"""Loading: model folders, ``.gguf`` files (converted once, ``lookupdec.model_files``), aliases,
tokenizers (Hugging Face folders or sentencepiece ``.model`` files); devices and dtypes."""
from __future__ import annotations

import contextlib
import os
import re

import torch


class ModelLoadError(ValueError):
    """A model path that cannot be loaded as a causal LM (message names the path)."""


def resolve_dtype(dtype: str | torch.dtype | None, device: str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.float32 if device == "cpu" else torch.bfloat16
    names = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
             "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
    if dtype not in names:
        raise ValueError(f"dtype={dtype!r}: expected one of {sorted(names)}")
    return names[dtype]


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def load(model_path: str | os.PathLike, *, device: str | None = None, dtype=None):
    """Load a local causal LM and its tokenizer. ``model_path``: a Hugging Face model folder, a
    ``.gguf`` file (converted once and cached, ``lookupdec.model_files``) or an alias
    (``"smollm2"``, ``"builtin"``, ``"builtin-draft"``). Never downloads."""
    import transformers

    from lookupdec.model_files import ModelFileError, gguf_folder, is_gguf, resolve

    try:
        path = resolve(model_path)
        if os.path.isfile(path) and is_gguf(path):
            path = gguf_folder(path, convert_gguf)
    except ModelFileError as exc:
        raise ModelLoadError(str(exc)) from None
    if os.path.isfile(path):
        raise ModelLoadError(f"{path}: a file, not a model: give a Hugging Face model folder (the one holding "
                             "config.json) or a .gguf file")
    if not os.path.isdir(path):
        raise ModelLoadError(f"model path not found: {path}")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ModelLoadError(f"{path}: no config.json (not a Hugging Face model folder)")
    device = device or default_device()
    torch_dtype = resolve_dtype(dtype, device)
    try:
        config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as exc:  # malformed config.json, unknown model_type
        raise ModelLoadError(f"{path}: cannot read config.json ({exc.__class__.__name__}: {exc})") from None
    if type(config) not in transformers.AutoModelForCausalLM._model_mapping:
        raise ModelLoadError(f"{path}: model type {config.model_type!r} is not a causal language model")
    try:
        with _quiet_progress(transformers):  # a folder loads in seconds: no bar on stderr
            model = transformers.AutoModelForCausalLM.from_pretrained(
                path, dtype=torch_dtype, local_files_only=True
            )
            tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, RuntimeError) as exc:
        raise ModelLoadError(f"{path}: cannot load the model ({exc.__class__.__name__}: {_first_line(exc)})") from None
    except Exception as exc:  # safetensors' SafetensorError (truncated or corrupt weights) and kin
        if type(exc).__name__ != "SafetensorError":
            raise
        raise ModelLoadError(f"{path}: the weights file is damaged ({_first_line(exc)})") from None
    return model.to(device).eval(), tokenizer


@contextlib.contextmanager
def _quiet_progress(transformers):
    logging_utils = transformers.utils.logging
    was_enabled = logging_utils.is_progress_bar_enabled()
    logging_utils.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            logging_utils.enable_progress_bar()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else exc.__class__.__name__


def convert_gguf(gguf_path: str, out_dir: str) -> None:
    """Dequantise a GGUF file to float32 with transformers and save it as a model folder."""
    import transformers

    folder, name = os.path.split(os.path.abspath(gguf_path))
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32,
                                                                  local_files_only=True)
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    except (OSError, ValueError, RuntimeError, KeyError) as exc:
        raise ModelLoadError(f"{gguf_path}: cannot load this GGUF file ({exc.__class__.__name__}: "
                             f"{_first_line(exc)})") from None
    # The weights are plain float32 tensors now: drop the record of the GGUF quantisation so that
    # save_pretrained writes (and from_pretrained later reads) an ordinary model.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False
    try:
        model.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
    except Exception as exc:  # safetensors' SafetensorError wraps the OS error (a full disk) in its text
        error = _os_error(exc)
        if error is None:
            raise
        raise error from None


def _os_error(exc: BaseException) -> OSError | None:
    """The ``OSError`` a ``SafetensorError`` reports (``"... (os error 28)"``), so that the
    cache (``model_files.gguf_folder``) tells a full disk from other failures; else None."""
    found = re.search(r"\(os error (\d+)\)", str(exc)) if type(exc).__name__ == "SafetensorError" else None
    if found is None:
        return None
    code = int(found.group(1))
    return OSError(code, os.strerror(code))


def tokenizer_info(tokenizer) -> dict:
    """What the engine needs from a tokenizer, without importing transformers elsewhere."""
    eos = tokenizer.eos_token_id
    return {"eos_token_ids": {eos} if isinstance(eos, int) else set(eos or [])}



class SentencePieceTokenizer:
    """A sentencepiece ``.model`` file with the small part of the tokenizer API lookupdec uses."""

    def __init__(self, path: str) -> None:
        import sentencepiece

        self._sp = sentencepiece.SentencePieceProcessor(model_file=path)
        self.name_or_path = path
        self.bos_token_id = self._sp.bos_id() if self._sp.bos_id() >= 0 else None
        self.eos_token_id = self._sp.eos_id() if self._sp.eos_id() >= 0 else None
        self.vocab_size = self._sp.get_piece_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._sp.encode(text)
        return [self.bos_token_id] + ids if add_special_tokens and self.bos_token_id is not None else ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """The text of ``ids``; control tokens (BOS, EOS) are left out, or with
        ``skip_special_tokens=False`` written as their pieces (``<s>``, ``</s>``)."""
        ids = [int(i) for i in ids]
        if skip_special_tokens:
            return self._sp.decode(ids)
        parts, run = [], []
        for i in ids:
            if self._sp.is_control(i):
                parts += [self._sp.decode(run), self._sp.id_to_piece(i)]
                run = []
            else:
                run.append(i)
        return "".join(parts + [self._sp.decode(run)])

    def get_vocab(self) -> dict[str, int]:
        return {self._sp.id_to_piece(i): i for i in range(self.vocab_size)}


def load_tokenizer(path: str | os.PathLike):
    """A tokenizer from a Hugging Face folder, a sentencepiece ``.model`` file, a ``.gguf`` file
    or an alias (``lookupdec.model_files``), offline."""
    from lookupdec.model_files import ModelFileError, gguf_folder, is_gguf, resolve

    try:
        path = resolve(path, weights=False)
        if os.path.isfile(path) and is_gguf(path):
            path = gguf_folder(path, convert_gguf)
    except ModelFileError as exc:
        raise ModelLoadError(str(exc)) from None
    if os.path.isfile(path) and path.endswith(".model"):
        return SentencePieceTokenizer(path)
    if not os.path.isdir(path):
        raise ModelLoadError(f"tokenizer not found: {path} (an HF folder or a sentencepiece .model file)")
    import transformers

    try:
        return transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path}: cannot load a tokenizer ({exc})") from None
