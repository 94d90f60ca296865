"""Packed verification (drafts as query tokens, ``verify_packed``): the same lossless law as
``verify``, checked with the chi-square tests of test_verification.py on a row that sits between
other rows and padding; greedy results equal ``verify``'s row by row."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rhyme_jax.rollout.sampling import sampling_mode
from rhyme_jax.rollout.verification import verify_packed

import f32
from verify_reference import verify
from test_verification import K, LOGITS, N, V, _chi2_pvalue, _joint_check, _scored, _target

LEAD = 2  # tokens of a row packed before the checked one
T_TOTAL = LEAD + K + 1 + 3  # ... and padding after it


def _packed(drafts, lens):
    """``(logits [T, V], fed [T], cu [4])``: a 2-token row, the checked row (pending token +
    ``lens`` drafts over ``LOGITS``), a padding row; padding tokens after them."""
    logits = np.zeros((T_TOTAL, V), np.float32)
    logits[LEAD: LEAD + K + 1] = np.asarray(LOGITS[0])
    fed = np.zeros(T_TOTAL, np.int32)
    fed[LEAD + 1: LEAD + 1 + lens] = drafts[:lens]
    cu = np.array([0, LEAD, LEAD + 1 + lens, LEAD + 1 + lens], np.int32)
    return jnp.asarray(logits), jnp.asarray(fed), jnp.asarray(cu)


@functools.partial(jax.jit, static_argnames=("mode",))
def _many(logits, fed, cu, keys, temperature, top_k, top_p, mode):
    fn = lambda k: verify_packed(logits, fed, cu, k, temperature, top_k, top_p, mode=mode)
    return jax.vmap(fn)(keys)


def _run(drafts, lens, temperature, top_k=0, top_p=1.0, n=N, seed=1):
    """Emitted ``tokens [n, K+1]``, ``logprobs [n, K+1]``, ``num [n]`` of the checked row."""
    mode = sampling_mode(temperature, top_k, top_p)
    keys = jax.random.split(jax.random.key(seed), n)
    toks, lps, num = _many(*_packed(np.asarray(drafts), lens), keys, temperature, top_k, top_p, mode)
    toks, lps, num = np.asarray(toks), np.asarray(lps), np.asarray(num)
    assert np.all(num[:, 2] == 0) and np.all((num[:, 0] >= 1) & (num[:, 0] <= 2))  # padding row: nothing
    return toks[:, LEAD: LEAD + K + 1], lps[:, LEAD: LEAD + K + 1], num[:, 1]


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (1.0, 0.9)])
def test_packed_emitted_tokens_follow_target(temperature, top_p):
    p = _target(temperature, top_p=top_p)
    drafts = [int(np.argsort(p[0])[-2]), int(np.argmax(p[1])), int(np.argmax(p[2]))]
    toks, lps, num = _run(drafts, K, temperature, top_p=top_p)
    assert _chi2_pvalue(np.bincount(toks[:, 0], minlength=V), p[0]) > 1e-3
    assert _joint_check(toks, num, drafts, p) > 1e-3
    full = num == K + 1
    assert full.sum() > 200
    assert _chi2_pvalue(np.bincount(toks[full, K], minlength=V), p[K]) > 1e-3
    rows = np.arange(K + 1)[None, :] < num[:, None]
    want = _scored(temperature)[np.arange(K + 1)[None, :], toks]  # unfiltered, as the loss scores them
    atol = f32.log_softmax_between_programs(LOGITS, temperature)  # two programs' log_softmax
    np.testing.assert_allclose(lps[rows], want[rows], rtol=0, atol=atol)
    assert np.all(lps[~rows] == 0) and np.all(toks[~rows] == 0)


def test_packed_empty_draft_is_plain_sampling():
    p = _target(0.7)
    toks, _, num = _run([0, 0, 0], 0, 0.7)
    assert np.all(num == 1)
    assert _chi2_pvalue(np.bincount(toks[:, 0], minlength=V), p[0]) > 1e-3


def test_packed_greedy_equals_verify_row_by_row():
    """Random rows (draft lengths 0..K, drafts near the argmax) packed back to back: greedy
    packed verification emits what ``verify`` emits for each row."""
    rng = np.random.default_rng(3)
    s, k, vocab = 6, 5, 11
    lens = rng.integers(0, k + 1, s)
    logits = jnp.asarray(rng.normal(size=(s, k + 1, vocab)) * 2, jnp.float32)
    arg = np.asarray(jnp.argmax(logits, -1))
    drafts = np.where(rng.random((s, k)) < 0.7, arg[:, :k], rng.integers(0, vocab, (s, k))).astype(np.int32)
    want_t, want_lp, want_n = verify(logits, jnp.asarray(drafts), jnp.asarray(lens, jnp.int32),
                                     jax.random.key(0), 0.0, mode="greedy")
    q = 1 + lens
    cu = np.concatenate([[0], np.cumsum(q)]).astype(np.int32)
    t_total = int(cu[-1]) + 4
    flat = np.zeros((t_total, vocab), np.float32)
    fed = np.zeros(t_total, np.int32)
    for i in range(s):
        flat[cu[i]: cu[i + 1]] = np.asarray(logits[i, : q[i]])
        fed[cu[i] + 1: cu[i + 1]] = drafts[i, : lens[i]]
    toks, lps, num = verify_packed(jnp.asarray(flat), jnp.asarray(fed), jnp.asarray(cu), jax.random.key(0), 0.0,
                                   mode="greedy")
    np.testing.assert_array_equal(np.asarray(num), np.asarray(want_n))
    assert int(np.asarray(want_n).sum()) > s  # some drafts accepted
    for i in range(s):
        m = int(want_n[i])
        np.testing.assert_array_equal(np.asarray(toks)[cu[i]: cu[i] + m], np.asarray(want_t)[i, :m])
        np.testing.assert_allclose(np.asarray(lps)[cu[i]: cu[i] + m], np.asarray(want_lp)[i, :m], rtol=0,
                                   atol=f32.log_softmax_between_programs(logits))  # packed vs padded rows
