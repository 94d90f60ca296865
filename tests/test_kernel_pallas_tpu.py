"""Pallas TPU ragged paged attention (interpret mode on CPU) vs the jnp reference.

Every kernel run uses the TPU interpreter with ``detect_races=True`` and NaN-poisoned
uninitialised memory: a row the kernel forgets to write, or a read of a VMEM buffer before its
DMA landed, shows up as NaN; a DMA racing a read of the same buffer is reported by the race
detector, which the tests check after each run.

Tolerances (``cases.TOLERANCE``): as tests/test_kernel_pallas_gpu.py: twice one float32
attention program's error bound on these cases (``2e-5``), ``4 x 2**-8`` in bfloat16.
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.compat import tpu_interpret_params, tpu_interpret_races_found
from pallas_kernels.ragged_paged_attention import pallas_tpu, reference
from pallas_kernels.ragged_paged_attention.reference import RaggedAttentionInputError
from pallas_kernels.ragged_paged_attention.cases import TOLERANCE, random_case

_STATIC = ("sm_scale", "max_q_len", "soft_cap", "sliding_window", "block_sizes", "interpret")
_kernel = jax.jit(pallas_tpu.ragged_paged_attention, static_argnames=_STATIC)
_reference = jax.jit(reference.ragged_paged_attention,
                     static_argnames=("sm_scale", "max_q_len", "soft_cap", "sliding_window"))
BS = pallas_tpu.TPUBlockSizes


def _run(args, *, max_q_len, head_dim, soft_cap=None, window=None, block_sizes=None, kernel=_kernel):
    kw = dict(sm_scale=head_dim ** -0.5, max_q_len=max_q_len, soft_cap=soft_cap, sliding_window=window)
    out = jax.block_until_ready(kernel(*args, **kw, block_sizes=block_sizes, interpret=True))
    assert tpu_interpret_races_found() is not True, "TPU interpreter reported a data race"
    assert out.dtype == args[0].dtype and out.shape == args[0].shape
    want = np.asarray(_reference(*args, **kw).astype(jnp.float32))
    return np.asarray(out.astype(jnp.float32)), want


def _check_case(seed, q_lens, *, group, head_dim, dtype, soft_cap=None, window=None, block_sizes=None,
                page_size=8, pages_per_seq=10, num_kv_heads=2, num_padding_seqs=1):
    rng = np.random.default_rng(seed)
    case = random_case(rng, q_lens, num_heads=group * num_kv_heads, num_kv_heads=num_kv_heads,
                       head_dim=head_dim, page_size=page_size, pages_per_seq=pages_per_seq,
                       num_padding_seqs=num_padding_seqs)
    args = case.args(dtype)
    got, want = _run(args, max_q_len=case.max_q_len, head_dim=head_dim, soft_cap=soft_cap, window=window,
                     block_sizes=block_sizes)
    assert not np.isnan(got).any(), "NaN in the output (a row was not written or poison leaked)"
    tol = TOLERANCE[dtype]
    np.testing.assert_allclose(got, want, atol=tol, rtol=tol)
    live_rows = int(case.cu_q_lens[case.num_seqs[0]])
    assert np.all(got[live_rows:] == 0), "padding rows must be zero"
    assert np.abs(got[:live_rows]).max() > 0.05  # the comparison is not between two zero arrays


# Default (fast) set: every feature at least once, small pools, page sizes 8 and 16.
@pytest.mark.parametrize("seed,q_lens,group,head_dim,dtype,soft_cap,window,block_sizes,page_size", [
    (0, [1, 3, 9, 1], 1, 64, jnp.float32, None, None, None, 8),  # decode + verify, MHA
    (1, [64, 1, 33], 4, 128, jnp.float32, None, None, BS(2, 16), 8),  # prefill, q blocks, GQA 4
    (2, [9, 1, 3], 8, 64, jnp.bfloat16, None, None, BS(3), 16),  # bf16, GQA 8, pps % ppb != 0
    # CI time: cap alone and window alone are slow; case 5 holds both
    pytest.param(3, [33, 3, 1], 4, 64, jnp.float32, 4.0, None, BS(1, 8), 8, marks=pytest.mark.slow),  # soft cap
    pytest.param(4, [33, 9, 1], 1, 128, jnp.bfloat16, None, 6, BS(2, 8), 8, marks=pytest.mark.slow),  # window
    (5, [64, 3], 8, 128, jnp.float32, 3.0, 20, BS(4, 16), 16),  # cap + window, GQA 8, hd 128
])
def test_matches_reference(seed, q_lens, group, head_dim, dtype, soft_cap, window, block_sizes, page_size):
    _check_case(seed, q_lens, group=group, head_dim=head_dim, dtype=dtype, soft_cap=soft_cap, window=window,
                block_sizes=block_sizes, page_size=page_size, pages_per_seq=80 // page_size)


def _poison_unreadable(case, window):
    """NaN in every pool slot no live query may see: scratch page 0, pages of padding
    sequences, pages and in-page tails past ``kv_len``, and tokens before every query's window."""
    k, v = case.k_pages.copy(), case.v_pages.copy()
    ps = k.shape[2]
    readable = np.zeros(k.shape[1:3], bool)  # [P, ps]
    for s in range(int(case.num_seqs[0])):
        q_len = int(case.cu_q_lens[s + 1] - case.cu_q_lens[s])
        kv_len = int(case.kv_lens[s])
        lo = 0 if window is None else max(0, kv_len - q_len - window + 1)
        for tok in range(lo, kv_len):
            readable[case.page_indices[s, tok // ps], tok % ps] = True
    assert not readable[0].any()
    k[:, ~readable] = np.nan
    v[:, ~readable] = np.nan
    return k, v


@pytest.mark.parametrize("window,block_sizes", [pytest.param(None, BS(4), marks=pytest.mark.slow), (5, BS(4, 8))])  # CI time
def test_nan_in_unreadable_pages_does_not_leak(window, block_sizes):
    rng = np.random.default_rng(11)
    case = random_case(rng, [9, 1, 33], num_heads=4, num_kv_heads=2, head_dim=64, page_size=8,
                       pages_per_seq=8, num_padding_seqs=2)
    case.kv_lens[:3] = [13, 22, 40]  # partial last pages, a page past kv_len for each sequence
    clean = case.args()
    k_bad, v_bad = _poison_unreadable(case, window)
    poisoned = (clean[0], jnp.asarray(k_bad), jnp.asarray(v_bad)) + clean[3:]
    got, want_poisoned = _run(poisoned, max_q_len=case.max_q_len, head_dim=64, window=window,
                              block_sizes=block_sizes)
    _, want = _run(clean, max_q_len=case.max_q_len, head_dim=64, window=window, block_sizes=block_sizes)
    assert np.isnan(want_poisoned).any()  # the poison sits in gathered pages (the oracle leaks it)
    assert not np.isnan(got).any()
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


def test_nan_in_read_page_reaches_output():
    rng = np.random.default_rng(12)
    case = random_case(rng, [3, 9], num_heads=4, num_kv_heads=2, head_dim=64, page_size=8, pages_per_seq=6)
    ps = 8
    k, v = case.k_pages.copy(), case.v_pages.copy()
    k[0, case.page_indices[0, 0], 0] = np.nan  # key 0 of sequence 0, kv head 0: every query sees it
    last = int(case.kv_lens[1]) - 1  # value of the newest token of sequence 1, kv head 1
    v[1, case.page_indices[1, last // ps], last % ps] = np.nan
    args = case.args()
    args = (args[0], jnp.asarray(k), jnp.asarray(v)) + args[3:]
    got, _ = _run(args, max_q_len=case.max_q_len, head_dim=64, block_sizes=BS(2))
    cu = case.cu_q_lens
    assert np.isnan(got[cu[0]:cu[1], 0:2]).all()  # seq 0, query heads of kv head 0
    assert np.isnan(got[cu[2] - 1, 2:4]).all()  # seq 1's last query attends to its own value
    finite = np.ones(got.shape[:2], bool)
    finite[cu[0]:cu[1], 0:2] = False
    finite[cu[1]:cu[2], 2:4] = False
    assert np.isfinite(got[finite]).all()


def test_metadata_is_data_not_constants():
    """One compiled kernel serves batches with different kv_lens / page tables / cu_q_lens /
    num_seqs of the same shapes."""
    def fresh(*args, **kw):  # own jit cache (jax.jit of the same function object shares one)
        return pallas_tpu.ragged_paged_attention(*args, **kw)

    fn = jax.jit(fresh, static_argnames=_STATIC)
    kw = dict(num_heads=8, num_kv_heads=2, head_dim=64, page_size=8, pages_per_seq=6)
    a = random_case(np.random.default_rng(21), [1, 9, 3], **kw)
    b = random_case(np.random.default_rng(22), [9, 3, 1], **kw)
    b.num_seqs[0] = 2  # sequence 2 becomes padding
    assert a.q.shape == b.q.shape and a.k_pages.shape == b.k_pages.shape
    assert not np.array_equal(a.cu_q_lens, b.cu_q_lens) and not np.array_equal(a.kv_lens, b.kv_lens)
    for case in (a, b):
        got, want = _run(case.args(), max_q_len=9, head_dim=64, block_sizes=BS(2), kernel=fn)
        assert not np.isnan(got).any()
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
    assert fn._cache_size() == 1


def test_interpret_params_passed_through():
    case = random_case(np.random.default_rng(31), [3, 1], num_heads=2, num_kv_heads=2, head_dim=64,
                       page_size=8, pages_per_seq=3)
    params = tpu_interpret_params(detect_races=False, uninitialized_memory="zero")
    kw = dict(sm_scale=0.125, max_q_len=3)
    got = pallas_tpu.ragged_paged_attention(*case.args(), **kw, interpret=params)
    want = reference.ragged_paged_attention(*case.args(), **kw)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)


def test_bad_input_names_the_argument():
    case = random_case(np.random.default_rng(41), [1], num_heads=2, num_kv_heads=1, head_dim=64,
                       page_size=8, pages_per_seq=2)
    args = case.args()
    kw = dict(sm_scale=0.125, max_q_len=1, interpret=True)
    with pytest.raises(RaggedAttentionInputError, match="pages_per_kv_block"):
        BS(pages_per_kv_block=0)
    with pytest.raises(RaggedAttentionInputError, match="q_tokens_per_block"):
        BS(q_tokens_per_block=0)
    with pytest.raises(RaggedAttentionInputError, match="sliding_window"):
        pallas_tpu.ragged_paged_attention(*args, **kw, sliding_window=0)
    with pytest.raises(RaggedAttentionInputError, match="soft_cap"):
        pallas_tpu.ragged_paged_attention(*args, **kw, soft_cap=-1.0)
    with pytest.raises(RaggedAttentionInputError, match="block_sizes"):
        pallas_tpu.ragged_paged_attention(*args, **kw, block_sizes=(8,))
    with pytest.raises(RaggedAttentionInputError, match="kv_lens"):
        pallas_tpu.ragged_paged_attention(args[0], args[1], args[2], args[3][:0], *args[4:], **kw)


def _write_kv_case(seed, num_tokens, *, kvh=2, num_pages=7, page_size=8, head_dim=64):
    rng = np.random.default_rng(seed)
    pool = rng.standard_normal((2, kvh, num_pages, page_size, head_dim)).astype(np.float32)
    new = rng.standard_normal((2, num_tokens, kvh, head_dim)).astype(np.float32)
    live = num_tokens - 4
    slots = np.zeros(num_tokens, np.int32)  # 4 padding tokens collide in scratch page 0, slot 0
    slots[:live] = rng.permutation(np.arange(page_size, num_pages * page_size))[:live]
    return pool, new, slots


@pytest.mark.parametrize("dtype,tokens_per_block", [(jnp.float32, 8), (jnp.bfloat16, 16)])
def test_write_kv_matches_reference_in_place(dtype, tokens_per_block):
    pool, new, slots = _write_kv_case(51, 21)
    fn = jax.jit(pallas_tpu.write_kv, static_argnames=("tokens_per_block", "interpret"), donate_argnums=(0, 1))
    k_pool, v_pool = jnp.asarray(pool[0], dtype), jnp.asarray(pool[1], dtype)
    want_k, want_v = reference.write_kv(k_pool, v_pool, jnp.asarray(new[0]), jnp.asarray(new[1]), jnp.asarray(slots))
    args = (k_pool, v_pool, jnp.asarray(new[0]), jnp.asarray(new[1]), jnp.asarray(slots))
    kw = dict(tokens_per_block=tokens_per_block, interpret=True)
    # Updated in place: the compiled program aliases both donated pools to its outputs. (Buffer
    # addresses are not a stable check: the CPU runtime may still copy in interpret mode.)
    hlo = fn.lower(*args, **kw).compile().as_text()
    aliases = next(line for line in hlo.splitlines() if "input_output_alias=" in line)
    assert aliases.split("entry_computation_layout")[0].count("may-alias") == 2
    got_k, got_v = fn(*args, **kw)
    assert tpu_interpret_races_found() is not True
    assert got_k.dtype == dtype and got_k.shape == pool[0].shape
    for got, want, src in ((got_k, want_k, new[0]), (got_v, want_v, new[1])):
        got, want = np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32))
        np.testing.assert_array_equal(got[:, 1:], want[:, 1:])  # exact copy (pages >= 1)
        np.testing.assert_array_equal(got[:, 0, 1:], want[:, 0, 1:])  # untouched scratch slots
        # Colliding padding writes to slot 0: the last token wins.
        np.testing.assert_array_equal(got[:, 0, 0], np.asarray(jnp.asarray(src[-1], dtype).astype(jnp.float32)))


def test_write_kv_bad_input():
    pool, new, slots = _write_kv_case(52, 6)
    args = [jnp.asarray(x) for x in (pool[0], pool[1], new[0], new[1], slots)]
    with pytest.raises(RaggedAttentionInputError, match="slot_mapping"):
        pallas_tpu.write_kv(*args[:4], args[4][:3], interpret=True)
    with pytest.raises(RaggedAttentionInputError, match="k_new/v_new"):
        pallas_tpu.write_kv(args[0], args[1], args[2][:, :1], args[3][:, :1], args[4], interpret=True)
    with pytest.raises(RaggedAttentionInputError, match="tokens_per_block"):
        pallas_tpu.write_kv(*args, tokens_per_block=0, interpret=True)


_SWEEP_TILINGS = [(None, 16), (BS(3, 8), 8), (BS(1, 4), 8), (BS(8, 16), 16)]  # (block_sizes, page_size)


@pytest.mark.slow
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("soft_cap,window", [(None, None), (5.0, None), (None, 17), (2.0, 40)])
def test_sweep(group, head_dim, dtype, soft_cap, window):
    seed = zlib.crc32(repr((group, head_dim, jnp.dtype(dtype).name, soft_cap, window)).encode())
    rng = np.random.default_rng(seed)
    block_sizes, page_size = _SWEEP_TILINGS[seed % len(_SWEEP_TILINGS)]
    q_lens = rng.choice([1, 3, 9, 33, 64], size=5).tolist()
    _check_case(seed, q_lens, group=group, head_dim=head_dim, dtype=dtype, soft_cap=soft_cap, window=window,
                block_sizes=block_sizes, page_size=page_size, pages_per_seq=160 // page_size,
                num_padding_seqs=2)
