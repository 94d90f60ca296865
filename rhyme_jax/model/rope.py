"""Rotary position embeddings, HF "rotate_half" (non-interleaved) convention.

Reference: transformers ``modeling_rope_utils`` (default and ``_compute_llama3_parameters``) and
``apply_rotary_pos_emb`` in ``modeling_llama.py``.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from rhyme_jax.model.config import ModelConfig


def inverse_frequencies(head_dim: int, theta: float, scaling: tuple | None = None) -> np.ndarray:
    """RoPE inverse frequencies ``f32[head_dim // 2]`` (radians per position).

    ``inv_freq[i] = theta ** -(2i / head_dim)``; with llama3 ``scaling`` (sorted ``(key, value)``
    pairs: factor, low_freq_factor, high_freq_factor, original_max_position_embeddings) low
    frequencies are divided by ``factor`` and the band between is smoothly interpolated, exactly
    as HF ``_compute_llama3_parameters``. Computed in float32 like HF, on the host (a constant).
    """
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv_freq = (1.0 / (np.float32(theta) ** exponents)).astype(np.float32)
    if scaling is None:
        return inv_freq
    s = dict(scaling)
    factor = np.float32(s["factor"])
    low, high = float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = (2 * math.pi / inv_freq).astype(np.float32)
    scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq).astype(np.float32)
    smooth = ((old_len / wavelen - low) / (high - low)).astype(np.float32)
    smoothed = ((1 - smooth) * scaled / factor + smooth * scaled).astype(np.float32)
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_cos_sin(positions: Int[Array, "..."], cfg: ModelConfig
                 ) -> tuple[Float[Array, "... hd"], Float[Array, "... hd"]]:
    """float32 ``cos, sin`` tables for integer ``positions``; the half-width angles are repeated
    (``concat(freqs, freqs)``) as in HF."""
    inv_freq = jnp.asarray(inverse_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def rotate_half(x: Float[Array, "... hd"]) -> Float[Array, "... hd"]:
    """``concat(-x2, x1)`` where ``x1, x2`` are the two halves of the last axis."""
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([-x2, x1], axis=-1)


def apply_rope(x: Float[Array, "... N hd"], positions: Int[Array, "..."], cfg: ModelConfig
               ) -> Float[Array, "... N hd"]:
    """Rotate ``x`` (``N`` heads sharing each position) by its ``positions``.

    ``x * cos + rotate_half(x) * sin`` with the tables cast to ``x.dtype`` (as HF does); the
    output keeps ``x.dtype``.
    """
    cos, sin = rope_cos_sin(positions, cfg)
    cos = cos[..., None, :].astype(x.dtype)
    sin = sin[..., None, :].astype(x.dtype)
    return x * cos + rotate_half(x) * sin
