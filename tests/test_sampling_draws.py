"""Per-position sampling draws (``rollout/sampling.py``: ``position_uniforms``, ``inverse_cdf``,
``sample_at``): exact draws from the processed distribution, keyed by (sequence, position) only."""

import jax
import jax.numpy as jnp
import numpy as np

from rhyme_jax.rollout.sampling import inverse_cdf, position_uniforms, processed_logprobs, sample, sample_at
from test_verification import LOGITS, _chi2_pvalue


def test_inverse_cdf_picks_the_first_token_whose_cumulative_mass_passes_u():
    p = np.array([[0.1, 0.0, 0.6, 0.3]], np.float32)
    lp = jnp.log(jnp.asarray(p))
    got = [int(inverse_cdf(lp, jnp.array([u], jnp.float32))[0]) for u in (0.0, 0.05, 0.1, 0.5, 0.69, 0.71, 0.999)]
    assert got == [0, 0, 2, 2, 2, 3, 3]  # never the zero-probability token 1


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
    u = np.asarray(position_uniforms(key, jnp.array([3, 3, 4, 3]), jnp.array([10, 11, 10, 10])))
    assert u[0] == u[3] and len({u[0], u[1], u[2]}) == 3  # same (sequence, position): same draw
    alone = np.asarray(position_uniforms(key, jnp.array([4]), jnp.array([10])))
    assert alone[0] == u[2]  # whatever else the batch holds
    assert np.all((u >= 0) & (u < 1))


def test_sample_with_one_key_draws_from_the_processed_distribution():
    logits = jnp.tile(jnp.asarray(LOGITS[0][1])[None], (4000, 1))  # 4000 rows of one distribution
    p = np.exp(np.asarray(processed_logprobs(logits[:1], 0.7, 5, 1.0), np.float64))[0]
    toks, lps = sample(logits, jax.random.key(9), 0.7, 5, 1.0)
    assert _chi2_pvalue(np.bincount(np.asarray(toks), minlength=p.size), p) > 1e-3
    # the behaviour logprob is the token's under softmax(logits / 0.7) without the top-5 filter
    scored = np.asarray(jax.nn.log_softmax(logits[0].astype(jnp.float32) / 0.7), np.float64)
    np.testing.assert_allclose(np.asarray(lps), scored[np.asarray(toks)], rtol=1e-5)
    assert np.all(np.asarray(lps) < np.log(p[np.asarray(toks)]))  # below the filtered logprob
