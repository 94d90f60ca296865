"""Logit parity of rhyme_jax.model.Decoder with HF transformers on tiny random checkpoints."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from _hf_fixtures import LLAMA3_SCALING, hf_config, hf_logits, save_hf_model
from rhyme_jax.model.config import ModelConfig
from rhyme_jax.model.loader import load_hf_checkpoint
from rhyme_jax.model.rope import inverse_frequencies
from rhyme_jax.model.transformer import layer_at

import f32



def tol(cfg, seq_len: int, ref) -> float:
    """JAX vs torch logits: two programs, each within the worst-case ``f32.model_logits`` bound of
    this tiny model's depth and widths at the reference's largest |logit| (~1e-4 here; a wrong
    RoPE band, bias or norm moves logits by O(0.1) of their scale)."""
    return f32.logits_between_programs(cfg, seq_len, ref)

CASES = [("qwen2", False), ("qwen3", True), ("llama", False)]


@pytest.fixture(scope="module", params=CASES, ids=[f"{f}-{'tied' if t else 'untied'}" for f, t in CASES])
def pair(request, tmp_path_factory):
    family, tied = request.param
    directory = tmp_path_factory.mktemp(family)
    hf = save_hf_model(family, directory, tied=tied)
    cfg, model = load_hf_checkpoint(directory)
    return family, tied, hf, cfg, model


def _positions(b, t, offset=0):
    return jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32) + offset, (b, t))


def test_config_read(pair):
    family, tied, _, cfg, model = pair
    assert cfg.family == family and cfg.tie_word_embeddings == tied
    assert (model.lm_head is None) == tied
    assert cfg.attention_bias == (family == "qwen2") and cfg.qk_norm == (family == "qwen3")
    if family == "llama":
        assert cfg.rope_scaling_dict == LLAMA3_SCALING and cfg.rope_theta == 500000.0
    if family == "qwen3":
        assert cfg.head_dim == 24 and cfg.eos_token_ids == (3, 4)


def test_logits_match_hf(pair):
    _, _, hf, cfg, model = pair
    tokens = np.random.default_rng(1).integers(0, 128, (2, 37))
    got = np.asarray(model(jnp.asarray(tokens), _positions(2, 37)))
    assert got.dtype == np.float32 and got.shape == (2, 37, 128)
    ref = hf_logits(hf, tokens)
    np.testing.assert_allclose(got, ref, atol=tol(cfg, 37, ref), rtol=0)


def test_logits_match_hf_at_large_positions(pair):
    """Positions beyond llama3's original context (64) exercise all three frequency bands."""
    _, _, hf, cfg, model = pair
    tokens = np.random.default_rng(2).integers(0, 128, (1, 16))
    with torch.no_grad():
        ref = hf(input_ids=torch.as_tensor(tokens), position_ids=torch.arange(16)[None] + 150).logits.numpy()
    got = np.asarray(model(jnp.asarray(tokens), _positions(1, 16, offset=150)))
    np.testing.assert_allclose(got, ref, atol=tol(cfg, 16, ref), rtol=0)


def test_right_padded_batch_matches_unpadded_rows(pair):
    _, _, hf, cfg, model = pair
    rng = np.random.default_rng(3)
    lengths = [20, 7, 13]
    t = max(lengths)
    tokens = np.zeros((3, t), np.int64)
    mask = np.zeros((3, t), bool)
    for i, n in enumerate(lengths):
        tokens[i, :n] = rng.integers(0, 128, n)
        tokens[i, n:] = rng.integers(0, 128, t - n)  # garbage in the padding must not leak
        mask[i, :n] = True
    got = np.asarray(model(jnp.asarray(tokens), _positions(3, t), jnp.asarray(mask)))
    assert np.isfinite(got).all()
    for i, n in enumerate(lengths):
        ref = hf_logits(hf, tokens[i:i + 1, :n])[0]
        np.testing.assert_allclose(got[i, :n], ref, atol=tol(cfg, t, ref), rtol=0)


def test_decomposition_equals_call(pair):
    """The engine's composition (embed_tokens / project_qkv / project_out / unembed) == __call__."""
    _, _, _, cfg, model = pair
    tokens = jnp.asarray(np.random.default_rng(4).integers(0, 128, (2, 11)))
    pos = _positions(2, 11)
    h = model.embed_tokens(tokens)
    g = cfg.num_heads // cfg.num_kv_heads
    causal = np.tril(np.ones((11, 11), bool))
    for i in range(cfg.num_layers):
        layer = layer_at(model.layers, i)
        q, k, v = layer.attn.project_qkv(layer.input_norm(h), pos)
        assert q.shape == (2, 11, cfg.num_heads, cfg.head_dim) and k.shape == (2, 11, cfg.num_kv_heads, cfg.head_dim)
        # brute-force per-head attention in numpy
        qn, kn, vn = (np.asarray(x, np.float64) for x in (q, k, v))
        o = np.zeros_like(qn)
        for head in range(cfg.num_heads):
            s = qn[:, :, head] @ kn[:, :, head // g].transpose(0, 2, 1) * cfg.head_dim ** -0.5
            s = np.where(causal, s, -np.inf)
            p = np.exp(s - s.max(-1, keepdims=True))
            o[:, :, head] = (p / p.sum(-1, keepdims=True)) @ vn[:, :, head // g]
        h = h + layer.attn.project_out(jnp.asarray(o, jnp.float32))
        h = h + layer.mlp(layer.post_attn_norm(h))
    want = np.asarray(model(tokens, pos))  # numpy attention vs XLA's: two programs
    np.testing.assert_allclose(np.asarray(model.unembed(h)), want, atol=tol(cfg, tokens.shape[1], want), rtol=0)


def test_llama3_inverse_frequencies_match_hf():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_cfg = hf_config("llama", tied=False)
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    cfg = ModelConfig.from_hf_dict(hf_cfg.to_dict())
    ours = inverse_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    np.testing.assert_allclose(ours, ref.numpy(), rtol=1e-6, atol=0)
    plain = inverse_frequencies(cfg.head_dim, cfg.rope_theta)
    # the test config covers all three bands: unchanged, interpolated, divided by factor
    ratio = plain / ours
    assert np.isclose(ratio, 1.0).any() and np.isclose(ratio, 8.0).any()
    assert ((ratio > 1.01) & (ratio < 7.99)).any()


def test_bf16_compute_close_to_f32(pair):
    _, _, _, cfg, model = pair
    from flax import nnx

    from rhyme_jax.model.transformer import Decoder

    graphdef, state = nnx.split(model)
    bf = nnx.eval_shape(lambda: Decoder(cfg, dtype=jnp.bfloat16, param_dtype=jnp.float32, rngs=nnx.Rngs(0)))
    nnx.update(bf, state)
    tokens = jnp.asarray(np.random.default_rng(5).integers(0, 128, (1, 9)))
    lo = np.asarray(bf(tokens, _positions(1, 9)))
    hi = np.asarray(model(tokens, _positions(1, 9)))
    assert lo.dtype == np.float32
    assert np.abs(lo - hi).max() < 0.05 * np.abs(hi).max() + 0.05


def test_scan_unroll_gives_the_same_logits(pair):
    """Unrolling the layer scan (``model.scan_unroll``) changes the program, not the values."""
    _, _, _, cfg, model = pair
    tokens = jnp.asarray(np.random.default_rng(5).integers(0, 128, (2, 9)))
    pos = _positions(2, 9)
    scanned = np.asarray(model(tokens, pos))
    model.scan_unroll = cfg.num_layers
    try:
        unrolled = np.asarray(model(tokens, pos))
    finally:
        model.scan_unroll = 1
    np.testing.assert_allclose(unrolled, scanned, atol=tol(cfg, 9, scanned), rtol=0)  # two programs
    assert np.abs(scanned).max() > 0.1
