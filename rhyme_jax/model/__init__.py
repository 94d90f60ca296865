"""Policy model: Flax NNX decoder (Qwen2 / Qwen3 / Llama), HF safetensors I/O, tokenizer."""

from rhyme_jax.model.config import ModelConfig, ModelConfigError
from rhyme_jax.model.loader import CheckpointFormatError, load_hf_checkpoint, save_hf_checkpoint
from rhyme_jax.model.tokenizer import Tokenizer, TokenizerError, train_demo_tokenizer
from rhyme_jax.model.transformer import Attention, Decoder, DecoderLayer, MLP
from rhyme_jax.model.layers import RMSNorm

__all__ = [
    "Attention", "CheckpointFormatError", "Decoder", "DecoderLayer", "MLP", "ModelConfig", "ModelConfigError",
    "RMSNorm", "Tokenizer", "TokenizerError", "load_hf_checkpoint", "save_hf_checkpoint", "train_demo_tokenizer",
]
