"""The only module that imports ``transformers`` (the demo's training script aside): loading,
tree forward, KV commit, and every detail of the KV cache's layout (``new_cache``,
``crop_cache``, ``gather_cache``), for the target (``TargetModel``) and a draft model
(``DraftLM``).

Cache layout during a step: slots ``[0, n_cached)`` hold the committed prefix; the verify
forward appends the tree's ``1 + n`` nodes at slots ``n_cached + i`` (node index ``i``), with
RoPE positions ``n_cached + depth[i]`` and a 4D additive mask letting node ``i`` see the prefix
and its own ancestors. ``commit`` then moves the accepted nodes' K/V to contiguous slots right
after the root and drops the rest. Tested against transformers 5.20–5.23, where K/V live in
``cache.layers[i].keys / .values`` of a ``DynamicCache``.

Models whose attention cannot take a custom 4D mask fall back to verifying one chain per step
with the ordinary causal mask (detected by a probe at start-up, logged once).
"""
from __future__ import annotations

import contextlib
import logging
import os
from typing import Sequence

import torch

from lookupdec.tokens import vocab_fingerprint  # noqa: F401  (part of this module's API)
from lookupdec.tree import TokenTree

log = logging.getLogger("lookupdec")

# Tolerance of the start-up probe comparing tree logits with one-path logits, relative to the
# spread of the logits: loose enough for bf16 noise, far below what a wrong mask produces.
PROBE_REL_TOL = 0.02


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
            path = gguf_folder(path, _convert_gguf)
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


def _convert_gguf(gguf_path: str, out_dir: str) -> None:
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
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def tokenizer_info(tokenizer) -> dict:
    """What the engine needs from a tokenizer, without importing transformers elsewhere."""
    eos = tokenizer.eos_token_id
    return {"eos_token_ids": {eos} if isinstance(eos, int) else set(eos or [])}


class TargetModel:
    """A causal LM with a KV cache of the committed prefix, verifying token trees."""

    def __init__(self, model, *, verify: str = "auto") -> None:
        self.model = model
        self.config = model.config
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.max_context = _max_context(self.config)
        self._windows = _sliding_windows(self.config)
        self.cache = None
        self.n_cached = 0
        if verify == "auto":
            verify = "tree" if self._probe_tree_mask() else "chain"
            if verify == "chain":
                log.warning("%s cannot take a custom 4D attention mask: verifying one draft chain per step",
                            self.config.model_type)
        self.tree_mode = verify == "tree"

    # -- cache lifecycle ------------------------------------------------------------------------
    def reset(self) -> None:
        self.cache = new_cache()
        self.n_cached = 0

    @torch.inference_mode()
    def prefill(self, token_ids: Sequence[int]) -> None:
        """Put ``token_ids`` in a fresh cache (everything but the root)."""
        self.reset()
        if len(token_ids):
            ids = torch.tensor([list(token_ids)], device=self.device)
            self.model(input_ids=ids, past_key_values=self.cache, use_cache=True, logits_to_keep=1)
            self.n_cached = len(token_ids)

    @torch.inference_mode()
    def verify(self, tree: TokenTree) -> torch.Tensor:
        """One forward over the tree's nodes. Returns logits [1 + n, vocab] (float32)."""
        n = len(tree)
        ids = torch.tensor([tree.token_ids], device=self.device)
        depth = torch.tensor(tree.depth, device=self.device)
        positions = (self.n_cached + depth)[None]
        # A chain needs no custom mask: the model's own causal mask (and its fastest attention
        # path, the one plain decoding takes) is exactly the tree mask then.
        mask = self._tree_mask(tree, positions[0]) if self.tree_mode and not tree.is_chain else None
        out = self.model(input_ids=ids, position_ids=positions, attention_mask=mask,
                         past_key_values=self.cache, use_cache=True)
        self.n_cached += n
        return out.logits[0].float()

    @torch.inference_mode()
    def commit(self, tree: TokenTree, accepted: Sequence[int]) -> None:
        """Keep the root and the accepted nodes' K/V in contiguous slots; drop the rest."""
        base = self.n_cached - len(tree)  # slot of the root
        keep = base + 1 + len(accepted)
        gather_cache(self.cache, [base + node for node in accepted], base + 1)
        crop_cache(self.cache, keep)
        self.n_cached = keep

    def sync(self) -> None:
        """Wait for the device (for timings)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def chain_forward_timer(self, prefix_len: int):
        """A function ``f(n)`` running one verify forward of ``n`` chain tokens after a dummy
        prefix, for measuring the cost curve; call ``reset()`` when done."""
        vocab = self.vocab_size
        self.prefill([(7 * i + 3) % vocab for i in range(prefix_len)])

        def forward(n: int) -> None:
            tree = TokenTree(token_ids=[(5 * i + 1) % vocab for i in range(n)], parents=list(range(-1, n - 1)))
            self.verify(tree)
            self.sync()
            crop_cache(self.cache, prefix_len)  # back to the prefix: every call sees the same context
            self.n_cached = prefix_len

        return forward

    # -- masks ----------------------------------------------------------------------------------
    def _tree_mask(self, tree: TokenTree, positions: torch.Tensor):
        """Additive 4D mask(s) [1, 1, 1+n, n_cached+1+n]; a dict per layer type where needed."""
        allowed = torch.ones((len(tree), self.n_cached + len(tree)), dtype=torch.bool, device=self.device)
        allowed[:, self.n_cached :] = torch.from_numpy(tree.ancestor_mask()).to(self.device)
        if not self._windows:
            return self._additive(allowed)
        key_pos = torch.cat([torch.arange(self.n_cached, device=self.device), positions])
        masks = {}
        for layer_type, window in self._windows.items():
            visible = allowed if window is None else allowed & (positions[:, None] - key_pos[None, :] < window)
            masks[layer_type] = self._additive(visible)
        return masks.get(None) if set(masks) == {None} else masks

    def _additive(self, allowed: torch.Tensor) -> torch.Tensor:
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device)
        mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)
        return mask[None, None]

    @torch.inference_mode()
    def _probe_tree_mask(self) -> bool:
        """Two sibling branches in one tree forward must give the logits of two separate runs."""
        vocab = min(self.vocab_size, 100)
        prefix, branch_a, branch_b = [1 % vocab, 5 % vocab, 9 % vocab], [11 % vocab, 3 % vocab], [17 % vocab, 2 % vocab]
        tree = TokenTree(token_ids=[7 % vocab] + branch_a + branch_b, parents=[-1, 0, 1, 0, 3])
        self.tree_mode = True
        try:
            self.prefill(prefix)
            got = self.verify(tree)
            want = []
            for branch in (branch_a, branch_b):
                ids = torch.tensor([prefix + [tree.token_ids[0]] + branch], device=self.device)
                want.append(self.model(input_ids=ids).logits[0, len(prefix):].float())
            want = torch.cat([want[0], want[1][1:]])
        except Exception as exc:  # a model type whose attention rejects the mask
            log.debug("tree-mask probe failed: %r", exc)
            return False
        finally:
            self.reset()
        scale = want.std().clamp_min(1e-6)
        return bool(((got - want).abs().max() / scale) < PROBE_REL_TOL)


# -- the KV cache's layout: the only code that knows it ---------------------------------------------
def new_cache():
    """An empty cache (no config: full-length layers; sliding windows live in our masks)."""
    from transformers import DynamicCache

    return DynamicCache()


def crop_cache(cache, length: int) -> None:
    """Keep the first ``length`` slots of every layer. By slicing: ``DynamicCache.crop``'s
    meaning changed across releases (in 5.23 it takes a negative count of tokens to drop)."""
    for layer in cache.layers:
        layer.keys = layer.keys[:, :, :length]
        layer.values = layer.values[:, :, :length]


def gather_cache(cache, slots: Sequence[int], start: int) -> None:
    """Copy the K/V of ``slots`` (in order) to the contiguous slots from ``start`` on."""
    end = start + len(slots)
    if list(slots) == list(range(start, end)):
        return
    src = torch.tensor(list(slots), device=cache.layers[0].keys.device)
    for layer in cache.layers:
        layer.keys[:, :, start:end] = layer.keys[:, :, src]
        layer.values[:, :, start:end] = layer.values[:, :, src]


class DraftLM:
    """A small causal LM that drafts: one KV cache per request (``new_state``) kept in step with
    a token list, fed incrementally."""

    class State:
        def __init__(self) -> None:
            self.cache = new_cache()
            self.tokens: list[int] = []  # tokens whose K/V are in the cache, in order

    def __init__(self, model, *, vocab_size: int | None = None) -> None:
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.vocab_size = vocab_size or model.get_output_embeddings().weight.shape[0]
        self.max_context = getattr(model.config, "max_position_embeddings", None)
        self.forwards = 0  # forward passes, for stats

    def new_state(self) -> "DraftLM.State":
        return DraftLM.State()

    @torch.inference_mode()
    def advance(self, state: "DraftLM.State", context: Sequence[int]) -> torch.Tensor:
        """Crop the cache to what still agrees with ``context`` (at most all but its last
        token), feed the rest in one forward; the logits after ``context``.  [vocab]"""
        context = list(context)
        common = 0
        for a, b in zip(state.tokens, context):
            if a != b:
                break
            common += 1
        keep = min(common, len(context) - 1)
        if keep < len(state.tokens):
            crop_cache(state.cache, keep)
            del state.tokens[keep:]
        return self.feed(state, context[keep:])

    @torch.inference_mode()
    def feed(self, state: "DraftLM.State", ids: Sequence[int]) -> torch.Tensor:
        """Append ``ids`` to the cache in one forward; the logits after the last.  [vocab]"""
        out = self.model(input_ids=torch.tensor([list(ids)], device=self.device), past_key_values=state.cache,
                         use_cache=True, logits_to_keep=1)
        state.tokens.extend(ids)
        self.forwards += 1
        return out.logits[0, -1]


def _max_context(config) -> int | None:
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _sliding_windows(config) -> dict:
    """Window per layer type for the 4D mask: {} (none), {None: w} (one mask), or per type."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        if "sliding_attention" not in layer_types or not window:
            return {}
        return {"full_attention": None, "sliding_attention": int(window)}
    if window and getattr(config, "use_sliding_window", True):
        return {None: int(window)}
    return {}


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
        path = resolve(path)
        if os.path.isfile(path) and is_gguf(path):
            path = gguf_folder(path, _convert_gguf)
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
