"""model/blocked_attention.py: block-sparse attention over packed segments against the dense path.

Values and gradients (q, k, v; and the whole decoder's parameters) equal ``dense_attention`` with
the same causal-within-segment mask; the compiled program's temporaries are O(T * block), not
O(T^2); bad shapes and config values fail before any work.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rhyme_jax.config import ConfigError, load_config
from rhyme_jax.model.blocked_attention import _kind, _pure, _segment_ranges, blocked_attention, usable
from rhyme_jax.model.config import ModelConfig
from rhyme_jax.model.transformer import Decoder, dense_attention


def _segments(rows: list[list[int]], t: int) -> jnp.ndarray:
    """Rows packed back to back: ``rows[b]`` lists segment lengths; the rest is padding (0)."""
    out = np.zeros((len(rows), t), np.int32)
    for b, lengths in enumerate(rows):
        start = 0
        for sid, n in enumerate(lengths, 1):
            out[b, start:start + n] = sid
            start += n
    return jnp.asarray(out)


def _allowed(segments):
    t = segments.shape[1]
    return (jnp.tril(jnp.ones((t, t), bool))[None] & (segments[:, :, None] == segments[:, None, :])
            & (segments[:, None, :] != 0))


def _qkv(b, t, h, kvh, d, seed=0, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.normal(size=s), dtype) for s in ((b, t, h, d), (b, t, kvh, d), (b, t, kvh, d)))


@pytest.mark.parametrize("block", [8, 16, 32])
def test_values_and_gradients_equal_the_dense_path(block):
    t = 64
    segments = _segments([[20, 25, 5], [10, 54], [64]], t)
    q, k, v = _qkv(3, t, 4, 2, 8)
    allowed = _allowed(segments)
    blocked = lambda q, k, v: blocked_attention(q, k, v, segments, block)  # noqa: E731
    dense = lambda q, k, v: dense_attention(q, k, v, allowed)  # noqa: E731
    valid = (segments != 0)[:, :, None, None]
    out_b, vjp_b = jax.vjp(blocked, q, k, v)
    out_d, vjp_d = jax.vjp(dense, q, k, v)
    np.testing.assert_allclose(np.where(valid, out_b, 0), np.where(valid, out_d, 0), atol=2e-6)
    assert np.all(np.asarray(out_b)[~np.asarray(valid)[..., 0, 0]] == 0.0)  # padding queries: 0
    cotangent = jnp.asarray(np.random.default_rng(1).normal(size=out_b.shape), jnp.float32) * valid
    for got, want in zip(vjp_b(cotangent), vjp_d(cotangent)):
        assert np.all(np.isfinite(got))
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_pairs_inside_one_segment_skip_the_mask():
    """Block pairs are skipped (no shared segment), visited whole (below the diagonal, both blocks
    inside one segment in every row: no mask) or masked (the rest)."""
    segments = _segments([[16, 12]], 32)  # blocks of 8: segment 1, 1, 2, 2 + padding
    lo, hi = _segment_ranges(segments, 8)
    pure = _pure(segments, 8)
    kinds = [[int(_kind(lo, hi, pure, i, j)) for j in range(i + 1)] for i in range(4)]
    assert kinds == [[1], [2, 1], [0, 0, 1], [0, 0, 1, 1]]  # block 3 holds padding: masked
    two_rows = _segments([[16, 12], [8, 24]], 32)  # row 2's block 1 is segment 2: (1, 0) is masked
    lo, hi = _segment_ranges(two_rows, 8)
    assert int(_kind(lo, hi, _pure(two_rows, 8), 1, 0)) == 1


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_long_segments_with_whole_blocks_match_the_dense_path(dtype):
    """Most pairs of two long rows are whole (unmasked) pairs; values and gradients still equal
    the dense path's, in float32 (queries scaled once) and bfloat16 (scores scaled)."""
    t = 96
    segments = _segments([[70, 26], [40, 40]], t)
    q, k, v = _qkv(2, t, 4, 2, 8, seed=3, dtype=dtype)
    allowed = _allowed(segments)
    valid = (segments != 0)[:, :, None, None]
    out_b, vjp_b = jax.vjp(lambda q, k, v: blocked_attention(q, k, v, segments, 8), q, k, v)
    out_d, vjp_d = jax.vjp(lambda q, k, v: dense_attention(q, k, v, allowed), q, k, v)
    tol = 2e-6 if dtype == jnp.float32 else 3e-2  # bfloat16: a few of its ulps at values up to ~5
    np.testing.assert_allclose(np.where(valid, np.asarray(out_b, np.float32), 0),
                               np.where(valid, np.asarray(out_d, np.float32), 0), atol=tol)
    cotangent = (jnp.asarray(np.random.default_rng(4).normal(size=out_b.shape), jnp.float32) * valid).astype(dtype)
    for got, want in zip(vjp_b(cotangent), vjp_d(cotangent)):
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=5 * tol)


def test_bfloat16_inputs_keep_their_dtype_and_match():
    t = 32
    segments = _segments([[12, 20]], t)
    q, k, v = _qkv(1, t, 2, 1, 8, dtype=jnp.bfloat16)
    out = blocked_attention(q, k, v, segments, 8)
    assert out.dtype == jnp.bfloat16
    want = dense_attention(q, k, v, _allowed(segments))
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want, np.float32), atol=2e-2)


def test_memory_follows_t_times_block_not_t_squared():
    """One 256-token row in a 1,024-token buffer: the compiled gradient's temporaries are a small
    fraction of the dense path's (which holds [H, T, T] float32 scores and probabilities)."""
    t, h = 1024, 4
    segments = _segments([[256]], t)
    q, k, v = _qkv(1, t, h, 2, 8)

    def temp_bytes(attend):
        loss = lambda q, k, v: jnp.sum(attend(q, k, v) ** 2)  # noqa: E731
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    dense = temp_bytes(lambda q, k, v: dense_attention(q, k, v, _allowed(segments)))
    blocked = temp_bytes(lambda q, k, v: blocked_attention(q, k, v, segments, 64))
    assert dense >= h * t * t * 4  # at least one f32 [H, T, T]
    assert blocked < dense / 20


def test_a_partial_last_block_is_padded_and_bad_shapes_raise():
    t = 40
    segments = _segments([[25, 15]], t)
    q, k, v = _qkv(1, t, 2, 1, 8)
    out = blocked_attention(q, k, v, segments, 16)
    assert out.shape == q.shape
    np.testing.assert_allclose(out, dense_attention(q, k, v, _allowed(segments)), atol=2e-6)
    with pytest.raises(ValueError, match="must be equal"):
        blocked_attention(q, k[:, :32], v[:, :32], segments, 16)
    assert usable(64, 16) and usable(40, 16) and not usable(16, 16) and not usable(64, 0)


def _tiny_decoder(block: int) -> Decoder:
    cfg = ModelConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8, max_position_embeddings=256, family="qwen3")
    return Decoder(cfg, rngs=nnx.Rngs(0), attention_block=block)


@pytest.mark.parametrize("remat", [False, True])
def test_decoder_hidden_and_parameter_gradients_match_dense(remat):
    """A packed batch through the whole decoder (``model.attention_block``): hidden states and the
    gradient of a masked loss w.r.t. every parameter equal the dense decoder's."""
    t = 64
    segments = _segments([[30, 22], [64]], t)
    positions = jnp.asarray(np.concatenate([np.r_[np.arange(30), np.arange(22), np.zeros(12)],
                                            np.arange(64)]).reshape(2, t), jnp.int32)
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 97, (2, t)), jnp.int32)
    mask = segments != 0
    dense_model, blocked_model = _tiny_decoder(0), _tiny_decoder(16)
    graphdef_d, state = nnx.split(dense_model)
    graphdef_b, _ = nnx.split(blocked_model)

    def loss(graphdef, state):
        h = nnx.merge(graphdef, state).hidden(tokens, positions, mask, remat=remat, segment_ids=segments)
        return jnp.sum(jnp.where(mask[..., None], h, 0.0) ** 2), h

    (loss_d, h_d), grads_d = jax.value_and_grad(lambda s: loss(graphdef_d, s), has_aux=True)(state)
    (loss_b, h_b), grads_b = jax.value_and_grad(lambda s: loss(graphdef_b, s), has_aux=True)(state)
    np.testing.assert_allclose(np.where(mask[..., None], h_b, 0), np.where(mask[..., None], h_d, 0), atol=2e-5)
    np.testing.assert_allclose(loss_b, loss_d, rtol=1e-5)
    for got, want in zip(jax.tree.leaves(grads_b), jax.tree.leaves(grads_d)):
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)


def test_config_rejects_a_block_that_is_not_a_multiple_of_16(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  attention_block: 40\n")
    with pytest.raises(ConfigError, match="attention_block"):
        load_config(path)
