"""``live_pages``: ragged paged attention that reads only the live rows' pages equals the reference,
never reads a page past a row's length or of a dead row, and reads a stacked pool in place.

``SIZES``'s page tables fit in one block of the walk; the ``blocks`` fixture also shrinks the blocks
to 2 page groups, so the same cases run the walk over many blocks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.ragged_paged_attention import api, live_pages, reference
from pallas_kernels.ragged_paged_attention.cases import TOLERANCE, random_case

SIZES = dict(num_heads=4, num_kv_heads=2, head_dim=16, page_size=4, pages_per_seq=20)


@pytest.fixture(params=["many", "one"])
def blocks(request, monkeypatch):
    """``"many"`` shrinks ``PAGES_PER_BLOCK`` to 2 groups of ``SIZES``'s 5 pages (a table of 3-7 rows
    of 20 pages walks in 6-14 blocks: the online softmax carries across blocks); ``"one"`` keeps
    the default (one block holds the table)."""
    if request.param == "many":
        monkeypatch.setattr(live_pages, "PAGES_PER_BLOCK", 10)
    return request.param


def _both(case, dtype=jnp.float32, **kw):
    args = case.args(dtype)
    kw = dict(sm_scale=0.3, max_q_len=case.max_q_len, **kw)
    with jax.default_matmul_precision("highest"):
        want = reference.ragged_paged_attention(*args, **kw)
        got = jax.jit(lambda *a: live_pages.ragged_paged_attention(*a, **kw))(*args)
    return np.asarray(got, np.float32), np.asarray(want, np.float32)


@pytest.mark.parametrize("q_lens", [[1, 1, 1, 1, 1], [3, 1, 9, 2], [33, 2, 17], [64, 5], [1]])
@pytest.mark.parametrize("extra", [{}, {"soft_cap": 4.0}, {"sliding_window": 7}])
def test_matches_reference_on_decode_verify_and_short_prefill(q_lens, extra, blocks):
    table_groups = (len(q_lens) + 2) * SIZES["pages_per_seq"] // live_pages.group_pages(SIZES["pages_per_seq"])
    one = live_pages.block_groups(len(q_lens) + 2, SIZES["pages_per_seq"], SIZES["page_size"], max(q_lens))
    assert (one == table_groups) == (blocks == "one")
    case = random_case(np.random.default_rng(len(q_lens) + sum(q_lens)), q_lens, num_padding_seqs=2, **SIZES)
    got, want = _both(case, **extra)
    np.testing.assert_allclose(got, want, atol=TOLERANCE[jnp.float32], rtol=TOLERANCE[jnp.float32])
    t_live = int(case.cu_q_lens[int(case.num_seqs[0])])
    assert not got[t_live:].any()  # padding rows stay zero


def test_bf16_close_to_reference(blocks):
    case = random_case(np.random.default_rng(3), [1, 4, 1, 7], **SIZES)
    got, want = _both(case, jnp.bfloat16)
    np.testing.assert_allclose(got, want, atol=TOLERANCE[jnp.bfloat16], rtol=TOLERANCE[jnp.bfloat16])


def test_long_query_rows_take_the_reference_layout():
    case = random_case(np.random.default_rng(4), [live_pages.MAX_Q_LEN + 3, 2], **SIZES)
    got, want = _both(case)
    np.testing.assert_allclose(got, want, atol=TOLERANCE[jnp.float32], rtol=TOLERANCE[jnp.float32])


@pytest.mark.parametrize("padding", [0, 2])
def test_never_reads_a_page_past_a_row_or_of_a_dead_row(padding, blocks):
    """NaN in every page no live row holds up to its length (the rest of each row's table, the
    padding rows' pages, the scratch page): the reference's masked gather still multiplies them,
    the walk never loads them, so its output is finite and equal to the reference on clean pools."""
    case = random_case(np.random.default_rng(5), [1, 3, 1, 6], num_padding_seqs=padding, **SIZES)
    ps = SIZES["page_size"]
    held = {int(case.page_indices[s, j]) for s in range(int(case.num_seqs[0]))
            for j in range(-(-int(case.kv_lens[s]) // ps))}
    dead = np.array(sorted(set(range(case.k_pages.shape[1])) - held))
    assert dead.size > 0
    got_clean, want = _both(case)
    case.k_pages[:, dead], case.v_pages[:, dead] = np.nan, np.nan
    got, _ = _both(case)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, got_clean, atol=1e-6)
    np.testing.assert_allclose(got, want, atol=TOLERANCE[jnp.float32], rtol=TOLERANCE[jnp.float32])


def test_stacked_pool_read_at_a_traced_layer_through_the_api(blocks):
    case = random_case(np.random.default_rng(6), [2, 1, 5], **SIZES)
    q, kp, vp, *meta = case.args()
    ks, vs = jnp.stack([kp * 0, kp, kp * 2]), jnp.stack([vp * 3, vp, vp])
    kw = dict(sm_scale=0.3, max_q_len=case.max_q_len)
    fn = jax.jit(lambda li, *a: api.ragged_paged_attention(*a, layer=li, implementation="live_pages", **kw))
    with jax.default_matmul_precision("highest"):
        got = fn(jnp.int32(1), q, ks, vs, *meta)
        want = reference.ragged_paged_attention(q, kp, vp, *meta, **kw)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=TOLERANCE[jnp.float32])


def test_block_groups_bounds_the_score_block_and_the_table():
    assert live_pages.group_pages(384) == live_pages.GROUP_PAGES and live_pages.group_pages(2) == 1
    span = live_pages.group_pages(24)  # a quarter of the table: 6
    assert span == 6 and live_pages.block_groups(64, 24, 16, 1) == live_pages.PAGES_PER_BLOCK // span
    assert live_pages.block_groups(1, 8, 16, 1) == 4  # never more than the page table holds (spans of 2)
    big_q = live_pages.block_groups(64, 384, 16, 64)
    span = live_pages.group_pages(384)
    assert 1 <= big_q * span < live_pages.PAGES_PER_BLOCK and big_q * span * 16 * 64 <= live_pages._SCORE_BLOCK


@pytest.mark.parametrize("q_lens", [[1, 1, 1], [live_pages.MAX_Q_LEN + 3, 2]])
def test_reference_reads_a_stacked_pool_at_a_traced_layer(q_lens):
    """``reference.ragged_paged_attention(layer=)`` (per token for decode, per sequence for long
    queries, where ``live_pages`` sends them) equals the reference on ``pool[layer]``."""
    case = random_case(np.random.default_rng(7), q_lens, **SIZES)
    q, kp, vp, *meta = case.args()
    ks, vs = jnp.stack([kp * 0, kp, kp * 2]), jnp.stack([vp * 3, vp, vp])
    kw = dict(sm_scale=0.3, max_q_len=case.max_q_len)
    with jax.default_matmul_precision("highest"):
        want = reference.ragged_paged_attention(q, kp, vp, *meta, **kw)
        for fn in (reference.ragged_paged_attention, live_pages.ragged_paged_attention):
            got = jax.jit(lambda li, *a: fn(*a, layer=li, **kw))(jnp.int32(1), q, ks, vs, *meta)
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=TOLERANCE[jnp.float32])
