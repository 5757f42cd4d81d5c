"""Tiny randomly initialised causal LMs of several families, built from configs (no download)."""
from __future__ import annotations

import torch
import transformers

VOCAB = 96
_COMMON = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _llama_like(cls, **extra):
    return cls(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=512, **_COMMON, **extra)


CONFIGS = {
    "llama": lambda: _llama_like(transformers.LlamaConfig),
    "qwen2": lambda: _llama_like(transformers.Qwen2Config),
    # a short sliding window, so that the tree mask's window logic is exercised
    "mistral": lambda: _llama_like(transformers.MistralConfig, sliding_window=24),
    "gemma": lambda: transformers.GemmaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                              num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                              max_position_embeddings=512, **_COMMON),
    "phi": lambda: transformers.PhiConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, max_position_embeddings=512, **_COMMON),
    "gpt2": lambda: transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=512,
                                            vocab_size=VOCAB, bos_token_id=1, eos_token_id=2),
    "gpt_neox": lambda: transformers.GPTNeoXConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                   num_attention_heads=4, max_position_embeddings=512,
                                                   **_COMMON),
}
FAMILIES = sorted(CONFIGS)


def tiny_model(family: str, seed: int = 0, *, tie_word_embeddings: bool | None = None):
    """``tie_word_embeddings=False`` unties gemma and gpt2 (tied by default): tied and scaled,
    their greedy output just repeats the last prompt token, which tests little."""
    torch.manual_seed(seed)
    config = CONFIGS[family]()
    if tie_word_embeddings is not None:
        config.tie_word_embeddings = tie_word_embeddings
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    # Random init gives near-uniform logits; scale the output layer so argmaxes are clear and
    # greedy decoding has some structure (still random weights).
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    return model
