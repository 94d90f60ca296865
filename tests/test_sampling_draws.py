"""Per-position sampling draws (``rollout/sampling.py``: ``position_noise``, ``gumbel_draw``,
``sample_at``): exact draws from the processed distribution, keyed by (sequence, position) only,
and stable under last-bit differences of the logits."""

import jax
import jax.numpy as jnp
import numpy as np

from rhyme_jax.rollout.sampling import (GUMBEL_BLOCK, Noise, gumbel_draw, key_noise, position_noise, processed_logprobs,
                                        sample, sample_at)
import f32
from test_verification import LOGITS, _chi2_pvalue


def test_gumbel_draw_takes_the_block_then_the_token_with_the_largest_noisy_logprob():
    vocab = 2 * GUMBEL_BLOCK + 3  # three blocks, the last one padded
    lp = jnp.full((1, vocab), -30.0).at[0, 5].set(-1.0).at[0, GUMBEL_BLOCK + 7].set(-0.5)
    lp = lp.at[0, 2 * GUMBEL_BLOCK + 1].set(-jnp.inf)
    zero = Noise(jnp.zeros((1, 3)), jnp.zeros((1, GUMBEL_BLOCK)))
    assert int(gumbel_draw(lp, zero)[0]) == GUMBEL_BLOCK + 7  # block 1 has the larger mass
    first = Noise(jnp.array([[2.0, 0.0, 0.0]]), jnp.zeros((1, GUMBEL_BLOCK)))
    assert int(gumbel_draw(lp, first)[0]) == 5  # noise moves the block, then the token within it
    last = Noise(jnp.array([[0.0, 0.0, 90.0]]), jnp.zeros((1, GUMBEL_BLOCK)).at[0, 1].set(50.0))
    assert int(gumbel_draw(lp, last)[0]) != 2 * GUMBEL_BLOCK + 1  # never a filtered token
    assert int(gumbel_draw(lp, last)[0]) < vocab  # never a padding slot


def test_gumbel_draw_is_exact_across_blocks():
    vocab = 2 * GUMBEL_BLOCK + 40
    logits = jnp.asarray(np.random.default_rng(0).normal(0.0, 2.0, vocab), jnp.float32)[None]
    lp = jax.nn.log_softmax(logits, axis=-1)
    n = 20000
    toks = np.asarray(gumbel_draw(jnp.tile(lp, (n, 1)), key_noise(jax.random.key(1), n, vocab)))
    p = np.exp(np.asarray(lp[0], np.float64))
    top = np.argsort(-p)[:30]  # the 30 likeliest tokens, the rest pooled into one cell
    counts = np.append(np.bincount(toks, minlength=vocab)[top], n - np.isin(toks, top).sum())
    assert _chi2_pvalue(counts, np.append(p[top], 1.0 - p[top].sum())) > 1e-3


def test_a_last_bit_change_of_the_logits_almost_never_changes_the_draw():
    """Decode and verify passes compute a position's logits in programs of other shapes, which
    round differently (up to about 1e-5 nats on SmolLM2); the draw must not follow those bits.
    On these 512 draws from a 49,152-token vocabulary (entropy 5.7 nats) an inverse-CDF draw with
    one uniform per token (the sampler before the Gumbel-max draw) changed 4 tokens under such
    noise; the Gumbel-max draw changes none (at most one allowed)."""
    rng = np.random.default_rng(0)
    n, vocab = 512, 49152
    lp = jax.nn.log_softmax(jnp.asarray(rng.normal(0.0, 2.0, (n, vocab)), jnp.float32) / 0.6, axis=-1)
    bumped = lp + jnp.asarray(rng.normal(0.0, 1e-5, (n, vocab)), jnp.float32)
    noise = position_noise(jax.random.key(2), jnp.arange(n), jnp.zeros(n, jnp.int32), vocab)
    same = np.asarray(gumbel_draw(lp, noise)) == np.asarray(gumbel_draw(bumped, noise))
    assert same.sum() >= n - 1


def test_sample_at_draws_from_the_processed_distribution():
    logits = jnp.asarray(LOGITS[0][0])[None]  # [1, V]
    p = np.exp(np.asarray(processed_logprobs(logits, 0.8, 0, 0.9), np.float64))[0]
    n = 4000
    draw = jax.jit(jax.vmap(lambda s: sample_at(logits, jax.random.key(3), s[None], jnp.zeros(1, jnp.int32), 0.8, 0,
                                                0.9, mode="filtered")[0][0]))
    toks = np.asarray(draw(jnp.arange(n, dtype=jnp.int32)))  # n sequences, one draw each
    assert _chi2_pvalue(np.bincount(toks, minlength=p.size), p) > 1e-3


def test_a_draw_depends_on_its_sequence_and_position_only():
    key = jax.random.key(7)
    g = np.asarray(position_noise(key, jnp.array([3, 3, 4, 3]), jnp.array([10, 11, 10, 10]), 1000).token)
    assert np.array_equal(g[0], g[3])  # same (sequence, position): same draw
    assert not np.array_equal(g[0], g[1]) and not np.array_equal(g[0], g[2])
    alone = position_noise(key, jnp.array([4]), jnp.array([10]), 1000)
    assert np.array_equal(np.asarray(alone.token)[0], g[2])  # whatever else the batch holds
    assert alone.block.shape == (1, 4) and alone.token.shape == (1, GUMBEL_BLOCK)


def test_sample_with_one_key_draws_from_the_processed_distribution():
    logits = jnp.tile(jnp.asarray(LOGITS[0][1])[None], (4000, 1))  # 4000 rows of one distribution
    p = np.exp(np.asarray(processed_logprobs(logits[:1], 0.7, 5, 1.0), np.float64))[0]
    toks, lps = sample(logits, jax.random.key(9), 0.7, 5, 1.0)
    assert _chi2_pvalue(np.bincount(np.asarray(toks), minlength=p.size), p) > 1e-3
    # the behaviour logprob is the token's under softmax(logits / 0.7) without the top-5 filter
    scored = np.asarray(jax.nn.log_softmax(logits[0].astype(jnp.float32) / 0.7), np.float64)
    atol = f32.log_softmax_between_programs(LOGITS[0][1], 0.7)  # sample's program vs this one
    np.testing.assert_allclose(np.asarray(lps), scored[np.asarray(toks)], rtol=0, atol=atol)
    assert np.all(np.asarray(lps) < np.log(p[np.asarray(toks)]))  # below the filtered logprob
