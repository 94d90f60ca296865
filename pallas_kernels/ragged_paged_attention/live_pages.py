"""Ragged paged attention over the live pages only, in plain ``jax.numpy`` (any backend; the
default on CPU for decode and verify steps).

``reference.ragged_paged_attention`` gathers every page-table column of every row of a step:
``S x pages_per_seq`` pages, live or not. On the CPU that gather is the pass: one decode pass of
``configs/longtail.yaml``'s model at 384 page columns cost 22 ms with 5 live rows in a 16-row
program, where their pages held about a fifth of what was read. This implementation flattens the
pages the live rows hold into one list of entries, each up to ``group_pages(width)`` (8) consecutive
page-table columns of one row (row ``s`` owns ``ceil(kv_lens[s] / (span x page_size))`` entries,
rows in order), and walks it in blocks of ``block_groups`` entries (about 256 pages) in a
``lax.while_loop`` whose trip count is a run-time value: a step reads each live page once (plus at
most ``span - 1`` past each row's end), whatever its program's row bucket and page-table width.
Each block gathers its pages, scores them against the query slots of the row that owns each entry
(``[C, KVH, G x Q, span x ps]``) and folds them into a per-row online softmax (running max, sum and
weighted values; Milakov & Gimelshein 2018, "Online normalizer calculation for softmax"; the
flash-decoding split over keys, Dao et al. 2023) with segment reductions over the block's rows
(sorted). A verify step reads the same pages as a decode step of the same rows; only its scores
grow with ``Q``. Measured (docs/results.md, "L7 again at commit 76407a1"): 2.7-12.4x faster than
the reference at the ledger task's tail programs; at SmolLM2-135M's programs the attention of 30
layers is faster but where 16 rows hold nearly all their columns (1.23x slower), while the engine's
whole pass at 4 rows is 1.10-1.14x slower for a cause outside the attention, not located yet.

Same signature and semantics as ``reference.ragged_paged_attention`` (its docstring), plus
``layer`` (the stacked pool ``[L, KVH, P, ps, hd]``: the gather reads the layer in place, no
slice of the pool). Steps with ``max_q_len > MAX_Q_LEN`` (long prefill chunks, whose score
blocks would be ``Q`` times larger) take the reference's layout, which reads the stacked pool in
place as well (``reference.ragged_paged_attention(..., layer=)``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from pallas_kernels.ragged_paged_attention import reference

MAX_Q_LEN = 64  # longer query rows (prefill chunks) take the reference's per-sequence layout
PAGES_PER_BLOCK = 256  # pages a loop iteration gathers (see ``block_groups``)
GROUP_PAGES = 8  # page-table columns of one row gathered as one entry (see ``group_pages``)
_SCORE_BLOCK = 1 << 17  # score entries per KV-head group a block may hold (``block_groups``)


def group_pages(width: int) -> int:
    """Page-table columns of one row that an entry of the flattened list gathers together
    (``GROUP_PAGES``, at most a quarter of the table, at least 1): scores of ``span x page_size``
    keys per (entry, KV head) make dense enough matrix products on the CPU, and a row wastes at most
    ``span - 1`` pages past its end."""
    return max(1, min(GROUP_PAGES, width // 4))


def block_groups(num_rows: int, width: int, page_size: int, max_q_len: int) -> int:
    """Page groups (``group_pages``) one loop iteration gathers: ``PAGES_PER_BLOCK`` pages' worth,
    fewer when a block's scores (pages x ``page_size x max_q_len`` per head) would exceed
    ``_SCORE_BLOCK`` entries, never more than the page table holds (``num_rows`` rows of
    ``ceil(width / span)`` groups); at least 1."""
    span = group_pages(width)
    by_scores = max(1, _SCORE_BLOCK // max(1, span * page_size * max_q_len))
    return max(1, min(PAGES_PER_BLOCK // span, by_scores, num_rows * -(-width // span)))


def ragged_paged_attention(
    q: Float[Array, "T H hd"],
    k_pages: Float[Array, "*L KVH P ps hd"],
    v_pages: Float[Array, "*L KVH P ps hd"],
    kv_lens: Int[Array, "S"],
    page_indices: Int[Array, "S pps"],
    cu_q_lens: Int[Array, "S+1"],
    num_seqs: Int[Array, "1"],
    *,
    sm_scale: float,
    max_q_len: int,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    layer: int | Int[Array, ""] | None = None,
) -> Float[Array, "T H hd"]:
    """Attention of packed ragged queries over the live pages of a paged KV cache (one layer).

    Args: as ``reference.ragged_paged_attention``; ``k_pages, v_pages`` are one layer's pool
      ``[KVH, P, ps, hd]``, or with ``layer`` (int or int32 scalar) the stacked pool
      ``[L, KVH, P, ps, hd]``.

    Returns:
      ``[T_total, H, hd]`` in ``q.dtype``; rows not owned by a live sequence are zero. Equal to the
      reference up to float32 summation order.

    Raises:
      RaggedAttentionInputError: inconsistent ranks/shapes (the reference's checks).
    """
    k_one, v_one = reference._one_layer(k_pages, v_pages, layer)  # one layer's shapes, no slice of the pool
    reference._check_shapes(q, k_one, v_one, kv_lens, page_indices, cu_q_lens, num_seqs, max_q_len)
    t_total, num_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_one.shape
    num_s, width = page_indices.shape
    if max_q_len > MAX_Q_LEN:  # the reference's layout, reading the stacked pool in place
        return reference.ragged_paged_attention(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                                                sm_scale=sm_scale, max_q_len=max_q_len, soft_cap=soft_cap,
                                                sliding_window=sliding_window, layer=layer)
    group = num_heads // num_kv_heads

    cu = cu_q_lens.astype(jnp.int32)
    kv_lens = kv_lens.astype(jnp.int32)
    live = jnp.arange(num_s) < num_seqs[0]
    q_lens = jnp.where(live, cu[1:] - cu[:-1], 0)
    qi = jnp.arange(max_q_len, dtype=jnp.int32)
    rows = cu[:-1, None] + qi[None, :]  # [S, Q] packed row of each query slot
    q_seq = q[jnp.clip(rows, 0, t_total - 1)].astype(jnp.float32) * sm_scale
    q_seq = q_seq.reshape(num_s, max_q_len, num_kv_heads, group, head_dim)
    q_pos = kv_lens[:, None] - q_lens[:, None] + qi[None, :]  # [S, Q]

    span = group_pages(width)
    n_groups = jnp.where(live, jnp.clip(-(-kv_lens // (page_size * span)), 0, -(-width // span)), 0)  # [S]
    ends = jnp.cumsum(n_groups)
    blk = block_groups(num_s, width, page_size, max_q_len)
    state = _fold_pages(q_seq, q_pos, kv_lens, k_pages, v_pages, page_indices, ends, layer=layer, block=blk,
                        span=span, soft_cap=soft_cap, sliding_window=sliding_window)
    _, denom, acc = state
    out = jnp.where(denom[..., None] > 0, acc / jnp.maximum(denom, 1e-30)[..., None], 0.0)  # [S, KVH, G*Q, hd]
    out = out.reshape(num_s, num_kv_heads, group, max_q_len, head_dim).transpose(0, 3, 1, 2, 4)  # [S, Q, KVH, G, hd]
    out = out.reshape(num_s, max_q_len, num_heads, head_dim).astype(q.dtype)
    row_ok = qi[None, :] < q_lens[:, None]
    dest = jnp.where(row_ok, rows, t_total)
    return jnp.zeros_like(q).at[dest.reshape(-1)].set(out.reshape(-1, num_heads, head_dim), mode="drop")


def _fold_pages(q_seq, q_pos, kv_lens, k_pages, v_pages, page_indices, ends, *, layer, block, span, soft_cap,
                sliding_window):
    """The online softmax over the flattened live page groups (``span`` page-table columns of one
    row each, ``ends`` their cumulative count per row): ``(max, denom, acc)`` of shapes
    ``[S, KVH, M]``, ``[S, KVH, M]`` and ``[S, KVH, M, hd]`` (``M = G x Q``, head-major)."""
    num_s, max_q_len, num_kv_heads, group, head_dim = q_seq.shape
    width = page_indices.shape[1]
    page_size = k_pages.shape[-2]
    total = ends[-1]
    starts = ends - jnp.diff(ends, prepend=0)
    num_blocks = (total + block - 1) // block
    offsets = jnp.arange(span * page_size, dtype=jnp.int32)  # key offsets within a group

    q_m = q_seq.transpose(0, 2, 3, 1, 4).reshape(num_s, num_kv_heads, group * max_q_len, head_dim)  # [S, KVH, M, hd]
    pos_m = jnp.broadcast_to(q_pos[:, None, :], (num_s, group, max_q_len)).reshape(num_s, group * max_q_len)

    def body(i, carry):
        m_old, l_old, acc_old = carry
        f = i * block + jnp.arange(block, dtype=jnp.int32)  # flat live-group ids of this block
        r = jnp.clip(jnp.searchsorted(ends, f, side="right"), 0, num_s - 1).astype(jnp.int32)  # owning row
        k_pos = (f - starts[r])[:, None] * (span * page_size) + offsets[None, :]  # [C, span x ps]
        held = (f < total)[:, None] & (k_pos < kv_lens[r][:, None])  # keys the row holds
        cols = jnp.clip(k_pos[:, ::page_size] // page_size, 0, width - 1)  # [C, span]
        page = jnp.where(held[:, ::page_size], page_indices[r[:, None], cols], 0)
        k, v = _gather(k_pages, page, layer), _gather(v_pages, page, layer)  # [C, KVH, span x ps, hd]
        v = jnp.where(held[:, None, :, None], v.astype(jnp.float32), 0.0)  # pages past a row's end: 0 x v
        s = jnp.einsum("ckmd,cknd->ckmn", q_m[r], k.astype(jnp.float32))  # [C, KVH, M, span x ps]
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        qp = pos_m[r]  # [C, M]
        mask = held[:, None, :] & (k_pos[:, None, :] <= qp[:, :, None])  # [C, M, span x ps]
        if sliding_window is not None:
            mask = mask & (qp[:, :, None] - k_pos[:, None, :] < sliding_window)
        mask = mask[:, None]  # [C, 1, M, span x ps]
        s = jnp.where(mask, s, reference.NEG_INF)
        m_blk = jax.ops.segment_max(jnp.max(s, axis=-1), r, num_s, indices_are_sorted=True)
        m_new = jnp.maximum(m_old, m_blk)
        p = jnp.where(mask, jnp.exp(s - m_new[r][..., None]), 0.0)
        corr = jnp.exp(m_old - m_new)
        l_new = l_old * corr + jax.ops.segment_sum(jnp.sum(p, axis=-1), r, num_s, indices_are_sorted=True)
        pv = jnp.einsum("ckmn,cknd->ckmd", p, v)
        acc_new = acc_old * corr[..., None] + jax.ops.segment_sum(pv, r, num_s, indices_are_sorted=True)
        return m_new, l_new, acc_new

    shape = (num_s, num_kv_heads, group * max_q_len)
    init = (jnp.full(shape, reference.NEG_INF, jnp.float32), jnp.zeros(shape, jnp.float32),
            jnp.zeros(shape + (head_dim,), jnp.float32))
    return jax.lax.fori_loop(0, num_blocks, body, init)


def _gather(pages, page, layer):
    """Pages ``page i32[C, span]`` of one layer's pool ``[KVH, P, ps, hd]`` or, with ``layer``, of
    the stacked pool ``[L, KVH, P, ps, hd]`` read in place (``reference._take_pages``):
    ``[C, KVH, span x ps, hd]``."""
    c, span = page.shape
    g = reference._take_pages(pages, page, layer).transpose(1, 0, 2, 3, 4)  # [C, KVH, span, ps, hd]
    return g.reshape(c, g.shape[1], span * g.shape[3], g.shape[4])


__all__ = ["MAX_Q_LEN", "block_groups", "group_pages", "ragged_paged_attention"]
