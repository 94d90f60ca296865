"""Lossless draft verification, dense reference (``tests/verify_reference.py``, the textbook rule
that tests/test_verification_packed.py compares the engine's ``verify_packed`` with): emitted
tokens follow the target distribution exactly.

Fixed logits over a small vocabulary; many independent verifications (vmap over keys) are
compared with the target by chi-square tests (fixed seeds). The joint law checked is that of the
first two emitted tokens: P(t0 = x) = p0(x) for x != d0 and P(t0 = d0, t1 = y) = p0(d0) p1(y).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from rhyme_jax.rollout.sampling import processed_logprobs, sampling_mode

import f32
from verify_reference import verify

V, K = 6, 3
N = 40_000
LOGITS = jnp.asarray(np.random.default_rng(0).normal(size=(1, K + 1, V)) * 1.5, jnp.float32)


@functools.partial(jax.jit, static_argnames=("mode",))
def _many(logits, drafts, lens, keys, temperature, top_k, top_p, mode):
    fn = lambda k: verify(logits, drafts, lens, k, temperature, top_k, top_p, mode=mode)
    return jax.vmap(fn)(keys)


def _run(drafts, lens, temperature, top_k=0, top_p=1.0, logits=LOGITS, n=N, seed=1):
    mode = sampling_mode(temperature, top_k, top_p)
    keys = jax.random.split(jax.random.key(seed), n)
    toks, lps, num = _many(logits, jnp.asarray(drafts, jnp.int32)[None], jnp.asarray([lens], jnp.int32),
                           keys, temperature, top_k, top_p, mode)
    return np.asarray(toks[:, 0]), np.asarray(lps[:, 0]), np.asarray(num[:, 0])


def _target(temperature, top_k=0, top_p=1.0, logits=LOGITS):
    lp = processed_logprobs(logits[0], temperature, top_k, top_p)
    return np.exp(np.asarray(lp, np.float64))  # [K+1, V]


def _scored(temperature, logits=LOGITS):
    """``[K+1, V]`` log-probs the behaviour logprobs report: ``log_softmax(logits / temperature)``
    without the top-k / top-p filter (what the GRPO loss scores; ``sampling.behaviour_logprobs``)."""
    x = np.asarray(logits[0], np.float64) / temperature
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _chi2_pvalue(counts, probs):
    counts, probs = np.asarray(counts, float), np.asarray(probs, float)
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token outside the support was emitted"
    expected = probs[keep] / probs[keep].sum() * counts.sum()
    return stats.chisquare(counts[keep], expected).pvalue


def _joint_check(toks, num, drafts, p):
    """Chi-square of the first two emitted tokens against p0 x p1 (see module docstring)."""
    d0 = drafts[0]
    cats, probs = [], []
    for x in range(V):
        if x != d0:
            cats.append((toks[:, 0] == x).sum())
            probs.append(p[0, x])
    for y in range(V):
        sel = (toks[:, 0] == d0) & (num >= 2) & (toks[:, 1] == y)
        cats.append(sel.sum())
        probs.append(p[0, d0] * p[1, y])
    return _chi2_pvalue(cats, probs)


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 1.0), (1.0, 0.9)])
def test_emitted_tokens_follow_target(temperature, top_p):
    p = _target(temperature, top_p=top_p)
    drafts = [int(np.argsort(p[0])[-2]), int(np.argmax(p[1])), int(np.argmax(p[2]))]  # d0 not the argmax
    toks, lps, num = _run(drafts, K, temperature, top_p=top_p)
    assert _chi2_pvalue(np.bincount(toks[:, 0], minlength=V), p[0]) > 1e-3
    assert _joint_check(toks, num, drafts, p) > 1e-3
    # Bonus token (all K accepted) follows p_K.
    full = num == K + 1
    assert full.sum() > 200
    assert _chi2_pvalue(np.bincount(toks[full, K], minlength=V), p[K]) > 1e-3
    # Emitted tokens carry their logprob under softmax(logits / temperature), unfiltered (the
    # distribution the GRPO loss scores), though they are drawn from the top-p filtered p_i.
    rows = np.arange(K + 1)[None, :] < num[:, None]
    want = _scored(temperature)[np.arange(K + 1)[None, :], toks]
    # verify's log_softmax and _scored's: two programs, f32 bound over V logits / temperature
    atol = f32.log_softmax_between_programs(LOGITS, temperature)
    np.testing.assert_allclose(lps[rows], want[rows], rtol=0, atol=atol)
    assert np.all(lps[~rows] == 0)


def test_always_wrong_drafts_give_target():
    # top_p 0.9 filters the least likely tokens; drafting one of them is always rejected.
    p = _target(1.0, top_p=0.9)
    bad = int(np.argmin(p[0]))
    assert p[0, bad] == 0
    toks, _, num = _run([bad, 1, 2], K, 1.0, top_p=0.9)
    assert np.all(num == 1) and not np.any(toks[:, 0] == bad)
    assert _chi2_pvalue(np.bincount(toks[:, 0], minlength=V), p[0]) > 1e-3


def test_always_right_drafts_give_target():
    # With top_k 1 every position is deterministic: drafts equal to the argmax are always
    # accepted and the bonus token is the argmax of the last position.
    arg = np.asarray(jnp.argmax(LOGITS[0], -1))
    toks, _, num = _run(arg[:K].tolist(), K, 1.0, top_k=1, n=500)
    assert np.all(num == K + 1) and np.all(toks == arg[None, :])


def test_empty_draft_is_plain_sampling():
    p = _target(0.7)
    toks, _, num = _run([0, 0, 0], 0, 0.7)
    assert np.all(num == 1)
    assert _chi2_pvalue(np.bincount(toks[:, 0], minlength=V), p[0]) > 1e-3


def test_greedy_accepts_while_draft_is_argmax():
    arg = np.asarray(jnp.argmax(LOGITS[0], -1))
    wrong = (arg[1] + 1) % V
    toks, lps, num = _run([arg[0], wrong, arg[2]], K, 0.0, n=3)
    assert np.all(num == 2)
    assert np.all(toks[:, :2] == arg[None, :2])  # accepted arg0, then the argmax, not the draft
    ls = np.asarray(jax.nn.log_softmax(LOGITS[0], -1))
    np.testing.assert_allclose(lps[0, :2], ls[[0, 1], arg[:2]], rtol=0, atol=f32.log_softmax_between_programs(LOGITS))


def test_detects_a_biased_verifier():
    """The chi-square check has power: accepting drafts with probability sqrt(p) is caught."""
    p = _target(1.0)
    d0 = int(np.argsort(p[0])[-2])
    rng = np.random.default_rng(0)
    u = rng.random(N)
    acc = u < np.sqrt(p[0, d0])
    resid = p[0].copy()
    resid[d0] = 0
    other = rng.choice(V, size=N, p=resid / resid.sum())
    toks = np.where(acc, d0, other)
    assert _chi2_pvalue(np.bincount(toks, minlength=V), p[0]) < 1e-6


def test_shape_errors_name_arguments():
    with pytest.raises(ValueError, match="draft_tokens"):
        verify(LOGITS, jnp.zeros((1, 2), jnp.int32), jnp.zeros((1,), jnp.int32), jax.random.key(0), 1.0,
               mode="plain")
