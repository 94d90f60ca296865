"""Tiny random HF checkpoints built locally with transformers (no downloads) for model tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64}


def hf_config(family: str, *, tied: bool):
    """A tiny transformers config of ``family`` (qwen2 / qwen3 / llama+llama3 scaling)."""
    import transformers as tf

    if family == "qwen2":
        return tf.Qwen2Config(**TINY, tie_word_embeddings=tied, rope_theta=10000.0, eos_token_id=3)
    if family == "qwen3":
        return tf.Qwen3Config(**TINY, head_dim=24, tie_word_embeddings=tied, eos_token_id=[3, 4])
    if family == "llama":
        cfg = tf.LlamaConfig(**TINY, tie_word_embeddings=tied, rope_scaling=dict(LLAMA3_SCALING, rope_theta=500000.0))
        return cfg
    raise ValueError(family)


def make_hf_model(family: str, *, tied: bool, seed: int = 0):
    """Random float32 HF causal LM; norms and biases are perturbed so they matter in parity."""
    import torch
    import transformers as tf

    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(hf_config(family, tied=tied), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
    return model.eval()


def save_hf_model(family: str, directory: Path, *, tied: bool, seed: int = 0):
    """Build and ``save_pretrained`` (safetensors) a tiny model; returns the torch model."""
    model = make_hf_model(family, tied=tied, seed=seed)
    model.save_pretrained(str(directory), safe_serialization=True)
    return model


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    """float32 logits ``[B, T, V]`` of an unpadded batch, positions ``arange(T)``."""
    import torch

    with torch.no_grad():
        return model(input_ids=torch.as_tensor(tokens, dtype=torch.long)).logits.float().numpy()
