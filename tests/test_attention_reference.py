"""Reference ragged paged attention vs a naive per-sequence dense numpy attention.

Tolerances (tests/f32.py): the reference (float32) against a float64 numpy attention over the
same float32 pages, so the difference is one program's rounding error, bounded in ``_bound`` from
the test's own inputs: scores are dot products of ``head_dim`` terms (``gamma(head_dim) x scale x
sum |q k|``), each softmax weight is within twice the score error plus an exp (8 ulps) and
``gamma(kv_len)`` for the normaliser, and the output is a convex combination of the values plus
its own sum's ``gamma(kv_len)``. bfloat16 (``atol=5e-2``): inputs and output rounded to 8 bits
(unit roundoff 2**-8 = 3.9e-3) on values up to ~4: ``4 x 3 x 2**-8``.
"""

import numpy as np
import pytest
import jax.numpy as jnp

import f32

from pallas_kernels.ragged_paged_attention import api, reference


def _naive(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale,
           soft_cap=None, sliding_window=None):
    q = np.asarray(q, np.float64)
    t, h, hd = q.shape
    kvh, _, ps, _ = k_pages.shape
    out = np.zeros_like(q)
    for s in range(int(num_seqs[0])):
        lo, hi = int(cu_q_lens[s]), int(cu_q_lens[s + 1])
        kl = int(kv_lens[s])
        toks = np.arange(kl)
        pages = page_indices[s][toks // ps]
        k = np.asarray(k_pages, np.float64)[:, pages, toks % ps]  # [KVH, kl, hd]
        v = np.asarray(v_pages, np.float64)[:, pages, toks % ps]
        for i in range(hi - lo):
            qp = kl - (hi - lo) + i
            for head in range(h):
                kh = head // (h // kvh)
                sc = k[kh] @ q[lo + i, head] * sm_scale
                if soft_cap is not None:
                    sc = soft_cap * np.tanh(sc / soft_cap)
                ok = toks <= qp
                if sliding_window is not None:
                    ok &= qp - toks < sliding_window
                sc = np.where(ok, sc, -np.inf)
                p = np.exp(sc - sc.max())
                p /= p.sum()
                out[lo + i, head] = p @ v[kh]
    return out


def _batch(rng, q_lens, ctx_lens, num_live, h, kvh, hd=8, ps=4, pps=12, dtype=np.float32):
    """Random ragged batch; pages of all sequences are distinct, shuffled, never page 0."""
    s = len(q_lens)
    num_pages = 1 + s * pps
    perm = rng.permutation(np.arange(1, num_pages)).reshape(s, pps).astype(np.int32)
    kv_lens = np.array([c + q for c, q in zip(ctx_lens, q_lens)], np.int32)
    assert (kv_lens <= pps * ps).all()
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    t_total = int(cu[num_live]) + 5  # trailing padding rows
    q = rng.standard_normal((t_total, h, hd)).astype(dtype)
    kp = rng.standard_normal((kvh, num_pages, ps, hd)).astype(dtype)
    vp = rng.standard_normal((kvh, num_pages, ps, hd)).astype(dtype)
    return q, kp, vp, kv_lens, perm, cu, np.array([num_live], np.int32)


LAYOUTS = {  # q_lens, max_q_len: per packed token (<= 2 tokens per sequence) / per sequence
    "token": ([1, 2, 1, 2, 1, 2], 3),
    "sequence": ([1, 3, 9, 33, 2, 1], 33),
}


def _bound(q, kp, vp, kv_lens, scale, soft_cap=None) -> float:
    """float32 error bound of one attention output against the exact value (module docstring):
    scores within ``gamma(head_dim) scale max sum |q k|`` (plus 8 ulps of the soft cap's tanh),
    each softmax weight within twice that plus an exp and ``gamma(kv_len)`` relative, the output
    a convex combination of values, plus ``gamma(kv_len)`` for its sum."""
    hd = q.shape[-1]
    qa, ka = np.abs(q.astype(np.float64)), np.abs(kp.astype(np.float64)).reshape(-1, hd)
    score_terms = scale * float(np.max(qa.reshape(-1, hd) @ ka.T))
    ds = f32.gamma(hd) * score_terms + f32.short(2) * score_terms
    if soft_cap is not None:
        ds += f32.short(2, 1) * soft_cap
    L = int(np.max(kv_lens))
    return float(np.max(np.abs(vp))) * (2 * ds + f32.short(4, 1) + 2 * f32.gamma(L))


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("h,kvh", [(4, 4), (4, 2), (8, 2)])
@pytest.mark.parametrize("soft_cap,window", [(None, None), (5.0, None), (None, 6)])
def test_matches_naive(h, kvh, soft_cap, window, layout):
    rng = np.random.default_rng(h * 10 + kvh)
    q_lens, max_q = LAYOUTS[layout]
    ctx_lens = [0, 5, 4, 3, 11, 7]  # kv lens cross page boundaries (ps=4)
    num_live = 5  # last sequence is padding
    q, kp, vp, kv_lens, pidx, cu, ns = _batch(rng, q_lens, ctx_lens, num_live, h, kvh)
    assert reference.token_layout(q.shape[0], len(q_lens), max_q) == (layout == "token")
    # Padding sequence: cu_q_lens after num_seqs stays flat in real use; here it is not, to
    # check that dead sequences still yield zeros.
    scale = 8 ** -0.5
    got = api.ragged_paged_attention(
        jnp.asarray(q), jnp.asarray(kp), jnp.asarray(vp), jnp.asarray(kv_lens), jnp.asarray(pidx),
        jnp.asarray(cu), jnp.asarray(ns), sm_scale=scale, max_q_len=max_q, soft_cap=soft_cap,
        sliding_window=window)
    want = _naive(q, kp, vp, kv_lens, pidx, cu, ns, scale, soft_cap, window)
    assert got.shape == q.shape and got.dtype == q.dtype
    np.testing.assert_allclose(np.asarray(got), want, atol=_bound(q, kp, vp, kv_lens, scale, soft_cap), rtol=0)
    assert np.all(np.asarray(got)[cu[num_live]:] == 0)


def test_bf16_close_to_f32():
    rng = np.random.default_rng(0)
    q, kp, vp, kv_lens, pidx, cu, ns = _batch(rng, [1, 9, 3], [6, 2, 13], 3, 4, 2)
    args = (jnp.asarray(kv_lens), jnp.asarray(pidx), jnp.asarray(cu), jnp.asarray(ns))
    got = reference.ragged_paged_attention(
        jnp.asarray(q, jnp.bfloat16), jnp.asarray(kp, jnp.bfloat16), jnp.asarray(vp, jnp.bfloat16),
        *args, sm_scale=0.3, max_q_len=16)
    assert got.dtype == jnp.bfloat16
    want = _naive(q, kp, vp, kv_lens, pidx, cu, ns, 0.3)
    np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=5e-2)


def test_write_kv_then_attend_equals_dense_causal():
    """Write a whole sequence through slot_mapping, then full causal prefill == dense attention."""
    rng = np.random.default_rng(1)
    kvh, hd, ps, h = 2, 8, 4, 4
    n = 10
    kp = jnp.zeros((kvh, 6, ps, hd))
    vp = jnp.zeros((kvh, 6, ps, hd))
    pages = np.array([3, 1, 5, 0], np.int32)  # trailing 0 = unused entry
    pos = np.arange(n)
    slots = pages[pos // ps] * ps + pos % ps
    k_new = rng.standard_normal((n, kvh, hd)).astype(np.float32)
    v_new = rng.standard_normal((n, kvh, hd)).astype(np.float32)
    kp, vp = reference.write_kv(kp, vp, jnp.asarray(k_new), jnp.asarray(v_new), jnp.asarray(slots))
    np.testing.assert_array_equal(np.asarray(kp)[:, 1, 2], k_new[6])
    np.testing.assert_array_equal(np.asarray(vp)[:, 5, 1], v_new[9])
    q = rng.standard_normal((n, h, hd)).astype(np.float32)
    out = reference.ragged_paged_attention(
        jnp.asarray(q), kp, vp, jnp.array([n]), jnp.asarray(pages[None]), jnp.array([0, n]),
        jnp.array([1]), sm_scale=0.5, max_q_len=16)
    kk = np.repeat(k_new, h // kvh, axis=1)  # [n, H, hd]
    vv = np.repeat(v_new, h // kvh, axis=1)
    sc = np.einsum("qhd,khd->hqk", q, kk) * 0.5
    sc = np.where(np.tril(np.ones((n, n), bool)), sc, -np.inf)
    p = np.exp(sc - sc.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    np.testing.assert_allclose(np.asarray(out), np.einsum("hqk,khd->qhd", p, vv), atol=1e-5)


def test_unknown_implementation_and_bad_shapes():
    rng = np.random.default_rng(2)
    q, kp, vp, kv_lens, pidx, cu, ns = _batch(rng, [1], [2], 1, 4, 2)
    args = [jnp.asarray(a) for a in (q, kp, vp, kv_lens, pidx, cu, ns)]
    with pytest.raises(ValueError, match="unknown implementation 'nope'"):
        api.ragged_paged_attention(*args, sm_scale=1.0, max_q_len=1, implementation="nope")
    with pytest.warns(UserWarning, match="falling back"):
        api.resolve_implementation(["pallas_tpu", "reference"])
    with pytest.raises(reference.RaggedAttentionInputError, match="cu_q_lens"):
        api.ragged_paged_attention(*args[:5], args[5][:1], args[6], sm_scale=1.0, max_q_len=1)
    with pytest.raises(reference.RaggedAttentionInputError, match="multiple of num_kv_heads"):
        api.ragged_paged_attention(args[0][:, :3], *args[1:], sm_scale=1.0, max_q_len=1)
