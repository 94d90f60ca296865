"""Pallas GPU (Triton) ragged paged attention vs the jnp reference, in interpret mode on CPU.

Every kernel run starts from a NaN-filled output buffer (aliased to the kernel output), so a row
the kernel forgets to write shows up as NaN. A lowering test also lowers the kernel to Triton IR
for CUDA (no GPU needed), which applies Triton's shape rules (power-of-two tiles, dot shapes).

Tolerances (``cases.TOLERANCE``): float32 ``2e-5`` is twice (``f32.between_programs``) the
float32 bound of one attention program on these cases (``tests/test_attention_reference.py``: scores of
head_dim-term dot products, a softmax over at most a few dozen keys, a convex combination of
values of |v| < 4), with one more rounding per KV block for the online softmax; bfloat16
``2e-2`` is ``4 x 2**-8`` on values of magnitude ~1 (bf16's unit roundoff 2**-8 on inputs and
output). A misplaced page or a missed mask changes outputs by O(1).
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.compat import pl_triton
from pallas_kernels.ragged_paged_attention import pallas_gpu, reference
from pallas_kernels.ragged_paged_attention.pallas_gpu import GPUBlockSizes
from pallas_kernels.ragged_paged_attention.reference import RaggedAttentionInputError
from pallas_kernels.ragged_paged_attention.cases import TOLERANCE, random_case

PAGE_SIZE = 16
PAGES_PER_SEQ = 5  # capacity 80 tokens: lengths cross page boundaries, q_len 64 fits


def _run(args, *, block_sizes=None, poison_may_show=False, **kw):
    """Kernel output (from a NaN-poisoned output buffer) and the reference, both as f32 numpy.

    Unless ``poison_may_show`` (the inputs hold NaN on purpose), every live row of the kernel's
    block output must have been overwritten."""
    out, blk, blk_ok = pallas_gpu._forward(*args, **kw, block_sizes=block_sizes, interpret=True,
                                           poison_output=True)
    ref = reference.ragged_paged_attention(*args, **kw)
    blk = np.asarray(blk, np.float32)
    blk_ok = np.asarray(blk_ok)
    if not poison_may_show:
        assert not np.isnan(blk[blk_ok]).any(), "kernel left a live row unwritten (poison survived)"
    return np.asarray(out, np.float32), np.asarray(ref, np.float32)


def _check_case(seed, q_lens, *, num_heads, num_kv_heads, head_dim, dtype, soft_cap=None,
                sliding_window=None, block_sizes=None, num_padding_seqs=1):
    rng = np.random.default_rng(seed)
    case = random_case(rng, q_lens, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                       page_size=PAGE_SIZE, pages_per_seq=PAGES_PER_SEQ, num_padding_seqs=num_padding_seqs)
    args = case.args(dtype)
    out, ref = _run(args, block_sizes=block_sizes, sm_scale=head_dim ** -0.5, max_q_len=case.max_q_len,
                    soft_cap=soft_cap, sliding_window=sliding_window)
    assert not np.isnan(out).any()
    tol = TOLERANCE[dtype]
    np.testing.assert_allclose(out, ref, atol=tol, rtol=tol)
    t_live = int(case.cu_q_lens[case.num_seqs[0]])
    assert np.all(out[t_live:] == 0), "padding rows must be zero"
    assert np.abs(out[:t_live]).max() > 0.05, "live rows unexpectedly zero"


# (q_lens, H, KVH, head_dim, dtype, soft_cap, sliding_window, block_sizes)
FAST_CASES = [
    ([1, 3, 9, 33, 64], 2, 2, 64, jnp.float32, None, None, None),
    ([64, 1, 33], 8, 2, 128, jnp.bfloat16, 20.0, None, None),
    ([9, 1, 64, 3], 8, 1, 64, jnp.float32, None, 17, None),
    ([33, 1, 9], 8, 2, 64, jnp.bfloat16, 10.0, 5, GPUBlockSizes(block_q=32, pages_per_kv_block=1)),
    pytest.param([1, 1, 1, 1], 8, 1, 128, jnp.float32, None, None, None, marks=pytest.mark.slow),  # CI time: case 0 decodes
    ([3, 1], 12, 4, 64, jnp.float32, None, None, None),  # G=3: heads padded to 4
]


@pytest.mark.parametrize("q_lens,h,kvh,hd,dtype,soft_cap,window,bs", FAST_CASES)
def test_matches_reference(q_lens, h, kvh, hd, dtype, soft_cap, window, bs):
    _check_case(len(q_lens) * 7 + h + hd, q_lens, num_heads=h, num_kv_heads=kvh, head_dim=hd, dtype=dtype,
                soft_cap=soft_cap, sliding_window=window, block_sizes=bs)


@pytest.mark.slow
@pytest.mark.parametrize("group,hd,dtype", list(itertools.product([1, 4, 8], [64, 128],
                                                                   [jnp.float32, jnp.bfloat16])))
def test_matches_reference_sweep(group, hd, dtype):
    """Sweep: GQA 1/4/8 x head_dim x dtype x {plain, soft cap, window, both} x tile shapes."""
    q_mixes = [[1, 3, 9, 33, 64], [64, 33], [1, 1, 1, 9]]
    features = [(None, None), (30.0, None), (None, 1), (None, 24), (5.0, 40)]
    tilings = [None, GPUBlockSizes(block_q=64, pages_per_kv_block=2), GPUBlockSizes(block_q=16, pages_per_kv_block=1)]
    kvh = 2 if group < 8 else 1
    for i in range(6):  # every q mix, feature and tiling appears; the full product is too slow
        q_lens, (cap, win), bs = q_mixes[i % 3], features[(i + group) % 5], tilings[(i // 3 + hd // 64) % 3]
        _check_case(1000 + i, q_lens, num_heads=group * kvh, num_kv_heads=kvh, head_dim=hd, dtype=dtype,
                    soft_cap=cap, sliding_window=win, block_sizes=bs, num_padding_seqs=2)


def _engine_like_case(seed, dtype=jnp.float32):
    """A case whose page-table entries past each kv_len point at the scratch page 0."""
    rng = np.random.default_rng(seed)
    case = random_case(rng, [1, 9, 33], num_heads=8, num_kv_heads=2, head_dim=64, page_size=PAGE_SIZE,
                       pages_per_seq=PAGES_PER_SEQ, num_padding_seqs=1)
    used = -(-case.kv_lens // PAGE_SIZE)
    for s in range(case.page_indices.shape[0]):
        case.page_indices[s, used[s]:] = 0
    return case


def test_nan_in_unread_slots_does_not_leak():
    case = _engine_like_case(3)
    kw = dict(sm_scale=0.125, max_q_len=case.max_q_len)
    ref = np.asarray(reference.ragged_paged_attention(*case.args(), **kw))
    k, v = case.k_pages.copy(), case.v_pages.copy()
    readable = np.zeros(k.shape[:3], bool)  # [KVH, P, ps]
    for s in range(int(case.num_seqs[0])):
        for j in range(int(case.kv_lens[s])):
            readable[:, case.page_indices[s, j // PAGE_SIZE], j % PAGE_SIZE] = True
    assert not readable[:, 0].any()
    k[~readable] = np.nan  # scratch page 0, tails past kv_len, pages of the padding sequence
    v[~readable] = np.nan
    case.k_pages, case.v_pages = k, v
    out, _ = _run(case.args(), **kw)
    assert not np.isnan(out).any()
    np.testing.assert_allclose(out, ref, atol=TOLERANCE[jnp.float32], rtol=TOLERANCE[jnp.float32])


@pytest.mark.parametrize("which", ["k", "v"])
def test_nan_in_read_slot_reaches_output(which):
    case = _engine_like_case(4)
    s, pos = 2, 5  # sequence 2 (q_len 33) reads position 5 from every query
    assert case.kv_lens[s] - (case.cu_q_lens[s + 1] - case.cu_q_lens[s]) > pos  # first query is past pos
    pool = case.k_pages if which == "k" else case.v_pages
    pool[0, case.page_indices[s, pos // PAGE_SIZE], pos % PAGE_SIZE, 3] = np.nan  # KV head 0
    out, ref = _run(case.args(), sm_scale=0.125, max_q_len=case.max_q_len, poison_may_show=True)
    rows = slice(case.cu_q_lens[s], case.cu_q_lens[s + 1])
    assert np.isnan(out[rows, :4]).any(axis=-1).all(), "rows attending a NaN key/value must be NaN"
    assert not np.isnan(out[rows, 4:]).any(), "KV head 1 does not read the poisoned slot"
    others = np.ones(out.shape[0], bool)
    others[rows] = False
    assert not np.isnan(out[others]).any()
    np.testing.assert_allclose(out[others], ref[others], atol=2e-5, rtol=2e-5)
    if which == "k":  # the reference masks non-attended keys too: identical NaN pattern
        np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))


def test_jit_once_two_metadata():
    """Same shapes, different lengths/pages/num_seqs: one trace, both results right."""
    traces = []

    def f(*args):
        traces.append(1)
        return pallas_gpu.ragged_paged_attention(*args, sm_scale=0.125, max_q_len=33, interpret=True)

    jf = jax.jit(f)
    a = random_case(np.random.default_rng(10), [1, 9, 33], num_heads=4, num_kv_heads=1, head_dim=64,
                    page_size=PAGE_SIZE, pages_per_seq=PAGES_PER_SEQ)
    b = random_case(np.random.default_rng(11), [33, 9, 1], num_heads=4, num_kv_heads=1, head_dim=64,
                    page_size=PAGE_SIZE, pages_per_seq=PAGES_PER_SEQ)
    b.num_seqs = np.array([2], np.int32)  # the third sequence is now dead: its rows must be zero
    for case in (a, b):
        out = np.asarray(jf(*case.args()))
        ref = np.asarray(reference.ragged_paged_attention(*case.args(), sm_scale=0.125, max_q_len=33))
        np.testing.assert_allclose(out, ref, atol=2e-5, rtol=2e-5)
    assert np.all(out[b.cu_q_lens[2]:] == 0)
    assert len(traces) == 1


def test_rows_beyond_max_q_len_are_dropped():
    case = random_case(np.random.default_rng(12), [9, 4], num_heads=4, num_kv_heads=4, head_dim=64,
                       page_size=PAGE_SIZE, pages_per_seq=PAGES_PER_SEQ)
    out, ref = _run(case.args(), sm_scale=0.125, max_q_len=5)
    np.testing.assert_allclose(out, ref, atol=2e-5, rtol=2e-5)
    assert np.all(out[5:9] == 0) and np.abs(out[:5]).max() > 0


@pytest.mark.skipif(pl_triton is None, reason="this jax has no Pallas Triton backend")
@pytest.mark.parametrize("h,kvh,hd,dtype,soft_cap,window,bs", [
    (8, 8, 64, jnp.float32, None, None, None),
    (32, 4, 128, jnp.bfloat16, 30.0, 128, None),
    (8, 1, 128, jnp.bfloat16, None, None, GPUBlockSizes(block_q=64, pages_per_kv_block=4, num_warps=8,
                                                          num_stages=3)),
    (12, 4, 64, jnp.float32, None, 7, GPUBlockSizes(block_q=16, pages_per_kv_block=1)),
])
def test_lowers_to_triton_for_cuda(h, kvh, hd, dtype, soft_cap, window, bs):
    """The kernel lowers to a Triton custom call for CUDA (checks Triton's tile rules on CPU)."""
    s, pps = 5, 7
    shapes = [((40, h, hd), dtype), ((kvh, 50, PAGE_SIZE, hd), dtype), ((kvh, 50, PAGE_SIZE, hd), dtype),
              ((s,), jnp.int32), ((s, pps), jnp.int32), ((s + 1,), jnp.int32), ((1,), jnp.int32)]
    fn = functools.partial(pallas_gpu.ragged_paged_attention, sm_scale=hd ** -0.5, max_q_len=33,
                           soft_cap=soft_cap, sliding_window=window, block_sizes=bs)
    lowered = jax.jit(fn).trace(*[jax.ShapeDtypeStruct(*x) for x in shapes]).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert "xla.gpu.triton" in text or "triton_kernel_call" in text


def test_bad_inputs_raise_named_errors():
    case = random_case(np.random.default_rng(0), [3], num_heads=4, num_kv_heads=2, head_dim=64,
                       page_size=PAGE_SIZE, pages_per_seq=2)
    args = case.args()
    kw = dict(sm_scale=0.1, max_q_len=3, interpret=True)
    with pytest.raises(ValueError, match="block_q"):
        GPUBlockSizes(block_q=24)
    with pytest.raises(ValueError, match="num_warps"):
        GPUBlockSizes(num_warps=3)
    with pytest.raises(RaggedAttentionInputError, match="pages_per_kv_block"):
        pallas_gpu.ragged_paged_attention(*args, **kw, block_sizes=GPUBlockSizes(pages_per_kv_block=3))
    with pytest.raises(RaggedAttentionInputError, match="head_dim"):
        pallas_gpu.ragged_paged_attention(args[0][..., :48], args[1][..., :48], args[2][..., :48], *args[3:], **kw)
    with pytest.raises(RaggedAttentionInputError, match="dtype"):
        pallas_gpu.ragged_paged_attention(args[0], args[1].astype(jnp.bfloat16), *args[2:], **kw)
    with pytest.raises(RaggedAttentionInputError, match="sliding_window"):
        pallas_gpu.ragged_paged_attention(*args, **kw, sliding_window=0)
    with pytest.raises(RaggedAttentionInputError, match="cu_q_lens"):
        pallas_gpu.ragged_paged_attention(*args[:5], args[5][:-1], args[6], **kw)


def _write_case(seed, t, *, kvh=2, hd=64, num_pages=9, page_size=PAGE_SIZE, pad_tokens=3):
    """New K/V for ``t`` tokens: distinct slots on pages >= 1, the last ``pad_tokens`` in page 0."""
    rng = np.random.default_rng(seed)
    pool = [rng.standard_normal((kvh, num_pages, page_size, hd)).astype(np.float32) for _ in range(2)]
    new = [rng.standard_normal((t, kvh, hd)).astype(np.float32) for _ in range(2)]
    slots = rng.choice(np.arange(page_size, num_pages * page_size), size=t, replace=False).astype(np.int32)
    slots[t - pad_tokens:] = np.arange(pad_tokens)  # padding tokens: distinct scratch-page slots
    return pool, new, slots


@pytest.mark.parametrize("t,pool_dtype,block_tokens", [(21, jnp.float32, 16), (5, jnp.bfloat16, 8),
                                                       (32, jnp.float32, 16)])
def test_write_kv_matches_reference(t, pool_dtype, block_tokens):
    (kp, vp), (kn, vn), slots = _write_case(t, t)
    args = (jnp.asarray(kp, pool_dtype), jnp.asarray(vp, pool_dtype), jnp.asarray(kn), jnp.asarray(vn),
            jnp.asarray(slots))
    ref_k, ref_v = reference.write_kv(*args)
    fn = jax.jit(functools.partial(pallas_gpu.write_kv, block_tokens=block_tokens, interpret=True),
                 donate_argnums=(0, 1))
    out_k, out_v = fn(*args)
    assert out_k.dtype == pool_dtype and out_k.shape == kp.shape
    np.testing.assert_array_equal(np.asarray(out_k, np.float32), np.asarray(ref_k, np.float32))
    np.testing.assert_array_equal(np.asarray(out_v, np.float32), np.asarray(ref_v, np.float32))


def test_write_kv_scratch_collisions_and_dropped_slots():
    (kp, vp), (kn, vn), slots = _write_case(7, 20, pad_tokens=6)
    slots[-6:] = 0  # six padding tokens collide on the scratch slot 0
    slots[0] = kp.shape[1] * kp.shape[2]  # out of range: dropped (like the reference's scatter)
    args = (jnp.asarray(kp), jnp.asarray(vp), jnp.asarray(kn), jnp.asarray(vn), jnp.asarray(slots))
    ref_k, ref_v = reference.write_kv(*args)
    out_k, out_v = pallas_gpu.write_kv(*args, interpret=True)
    for out, ref in ((out_k, ref_k), (out_v, ref_v)):
        np.testing.assert_array_equal(np.asarray(out)[:, 1:], np.asarray(ref)[:, 1:])  # real pages exact
        np.testing.assert_array_equal(np.asarray(out)[:, 0, 1:], np.asarray(ref)[:, 0, 1:])
    assert np.isin(np.asarray(out_k)[:, 0, 0], kn[-6:, :, :].transpose(1, 0, 2)).all()  # one of the writers


@pytest.mark.skipif(pl_triton is None, reason="this jax has no Pallas Triton backend")
def test_write_kv_lowers_to_triton_for_cuda():
    shapes = [((4, 30, PAGE_SIZE, 128), jnp.bfloat16)] * 2 + [((37, 4, 128), jnp.bfloat16)] * 2 + [((37,), jnp.int32)]
    lowered = jax.jit(pallas_gpu.write_kv, donate_argnums=(0, 1)).trace(
        *[jax.ShapeDtypeStruct(*x) for x in shapes]).lower(lowering_platforms=("cuda",))
    assert "xla.gpu.triton" in lowered.as_text() or "triton_kernel_call" in lowered.as_text()


def test_write_kv_bad_inputs():
    (kp, vp), (kn, vn), slots = _write_case(1, 8)
    with pytest.raises(RaggedAttentionInputError, match="slot_mapping"):
        pallas_gpu.write_kv(kp, vp, kn, vn, slots[:-1], interpret=True)
    with pytest.raises(RaggedAttentionInputError, match="k_new"):
        pallas_gpu.write_kv(kp, vp, kn[:, :1], vn[:, :1], slots, interpret=True)
    with pytest.raises(RaggedAttentionInputError, match="block_tokens"):
        pallas_gpu.write_kv(kp, vp, kn, vn, slots, block_tokens=12, interpret=True)
