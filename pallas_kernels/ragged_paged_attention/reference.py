"""Reference (oracle) ragged paged attention in plain ``jax.numpy``; runs on any backend.

Semantics follow the layout JAX's ``ragged_paged_attention`` (jax/experimental/pallas/ops/tpu),
tpu-inference and Levanter converged on:

* ``q [T_total, H, hd]`` packs the new tokens of ``S`` sequences back to back; sequence ``s``
  owns rows ``cu_q_lens[s] : cu_q_lens[s + 1]``.
* ``k_pages, v_pages [KVH, num_pages, page_size, hd]`` hold one layer's KV pool; sequence ``s``
  reads its cache through ``page_indices[s]`` (token ``j`` lives in page
  ``page_indices[s, j // page_size]`` at offset ``j % page_size``).
* ``kv_lens[s]`` counts the cached tokens *including* the new ones, so query ``i`` of sequence
  ``s`` sits at position ``kv_lens[s] - q_len[s] + i`` and attends to keys ``k_pos <= q_pos``
  (and ``q_pos - k_pos < sliding_window`` when a window is set).
* Sequences ``s >= num_seqs[0]`` and rows past ``cu_q_lens[num_seqs[0]]`` produce zeros.
* GQA: query head ``h`` uses KV head ``h // (H // KVH)``.

The implementation is vectorised (no Python loop over sequences): each sequence's query rows
are gathered into ``[S, max_q_len, H, hd]``, its pages into ``[S, pages_per_seq * page_size,
KVH, hd]``, a masked softmax runs in float32, and the result is scattered back to packed rows.
With at most two packed tokens per sequence (decode; a verify step with a few drafts per row,
whose ``[S, max_q_len]`` slots are mostly padding) the same computation is laid out per packed
token instead (``token_layout``, ``_attend_by_token``): each token gathers its sequence's pages.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


NEG_INF = -1e30  # masked scores (finite: no inf - inf in the softmax)


class RaggedAttentionInputError(ValueError):
    """Inconsistent shapes/dtypes passed to ragged paged attention (message names the argument)."""


def _check_shapes(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, max_q_len):
    where = "pallas_kernels/ragged_paged_attention/reference.py"
    if q.ndim != 3:
        raise RaggedAttentionInputError(f"{where}: q must be [T_total, H, hd], got shape {q.shape}")
    if k_pages.ndim != 4 or k_pages.shape != v_pages.shape:
        raise RaggedAttentionInputError(
            f"{where}: k_pages/v_pages must both be [KVH, num_pages, page_size, hd], "
            f"got {k_pages.shape} and {v_pages.shape}")
    _, h, hd = q.shape
    kvh, _, _, khd = k_pages.shape
    if khd != hd:
        raise RaggedAttentionInputError(f"{where}: head_dim of q ({hd}) != head_dim of k_pages ({khd})")
    if h % kvh:
        raise RaggedAttentionInputError(
            f"{where}: num_heads ({h}) must be a multiple of num_kv_heads ({kvh})")
    if page_indices.ndim != 2:
        raise RaggedAttentionInputError(
            f"{where}: page_indices must be [S, pages_per_seq], got {page_indices.shape}")
    s = page_indices.shape[0]
    if kv_lens.shape != (s,):
        raise RaggedAttentionInputError(f"{where}: kv_lens must be [S]={s}, got {kv_lens.shape}")
    if cu_q_lens.shape != (s + 1,):
        raise RaggedAttentionInputError(f"{where}: cu_q_lens must be [S+1]={s + 1}, got {cu_q_lens.shape}")
    if num_seqs.shape != (1,):
        raise RaggedAttentionInputError(f"{where}: num_seqs must be [1], got {num_seqs.shape}")
    if max_q_len < 1:
        raise RaggedAttentionInputError(f"{where}: max_q_len must be >= 1, got {max_q_len}")


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
    """Attention of packed ragged queries over a paged KV cache (one layer).

    Args:
      q: ``[T_total, H, hd]`` queries of the new tokens (f32 or bf16).
      k_pages, v_pages: ``[KVH, num_pages, page_size, hd]`` KV pool of this layer (new tokens
        already written, see ``write_kv``).
      kv_lens: ``i32[S]`` cached tokens per sequence including the new ones.
      page_indices: ``i32[S, pages_per_seq]`` page table; entries past a sequence's length are
        ignored (must still be valid page ids, e.g. 0).
      cu_q_lens: ``i32[S+1]`` cumulative query lengths (``cu_q_lens[0] == 0``).
      num_seqs: ``i32[1]`` number of live sequences; the rest produce zeros.
      sm_scale: score scale (usually ``head_dim ** -0.5``).
      max_q_len: static upper bound on every ``q_len`` (rows beyond it are silently dropped).
      soft_cap: if set, scores become ``soft_cap * tanh(scores / soft_cap)`` (after scaling).
      sliding_window: if set, a query only sees keys with ``q_pos - k_pos < sliding_window``.
      layer: with ``k_pages, v_pages`` the stacked pool ``[L, KVH, num_pages, page_size, hd]``,
        the layer to read (int or int32 scalar): the gathers read that layer in place, with no
        slice of the pool (``live_pages`` sends its long query rows here so). ``None``: the pool
        is one layer's.

    Returns:
      ``[T_total, H, hd]`` in ``q.dtype``; rows not owned by a live sequence are zero.

    Raises:
      RaggedAttentionInputError: inconsistent ranks/shapes.
    """
    _check_shapes(q, *_one_layer(k_pages, v_pages, layer), kv_lens, page_indices, cu_q_lens, num_seqs, max_q_len)
    attend = _attend_by_token if token_layout(q.shape[0], page_indices.shape[0], max_q_len) else _attend_by_sequence
    return attend(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale=sm_scale,
                  max_q_len=max_q_len, soft_cap=soft_cap, sliding_window=sliding_window, layer=layer)


def _one_layer(k_pages, v_pages, layer):
    """One layer's ``(k, v)`` for the shape checks: the pool itself, or with ``layer`` shape
    structs of ``pool[layer]`` (no slice of the stacked pool is traced)."""
    if layer is None:
        return k_pages, v_pages
    return (jax.ShapeDtypeStruct(k_pages.shape[1:], k_pages.dtype),
            jax.ShapeDtypeStruct(v_pages.shape[1:], v_pages.dtype))


def _take_pages(pages, index, layer):
    """Pages ``index i32[...]`` of one layer's pool ``[KVH, P, ps, hd]`` (or, with ``layer``, of
    the stacked pool ``[L, KVH, P, ps, hd]``, read in place): ``[KVH, *index.shape, ps, hd]``.

    16-bit float pages are gathered as ``uint16`` (the same bytes): XLA's CPU backend otherwise
    converts the whole bfloat16 pool to float32 before the gather. A ``uint16`` pool holds
    bfloat16 bits (how the rollout stores a bfloat16 pool on CPU, ``rhyme_jax.rollout.kv_cache.storage_dtype``):
    its pages come back as bfloat16."""
    dtype = jnp.dtype(jnp.bfloat16) if pages.dtype == jnp.uint16 else pages.dtype
    if dtype.itemsize == 2 and jnp.issubdtype(dtype, jnp.floating) and pages.dtype != jnp.uint16:
        pages = jax.lax.bitcast_convert_type(pages, jnp.uint16)
    if layer is None:
        g = pages[:, index]
    else:
        g = jnp.moveaxis(pages[layer, :, index], index.ndim, 0)  # the scalar and the index broadcast first
    return g if g.dtype == dtype else jax.lax.bitcast_convert_type(g, dtype)


def _attend_by_sequence(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale, max_q_len,
                        soft_cap, sliding_window, layer=None):
    """``ragged_paged_attention`` laid out per sequence: each sequence's query rows gathered into
    ``[S, max_q_len]`` slots and its pages into ``[KVH, S, L, hd]``."""
    t_total, num_heads, head_dim, num_kv_heads, page_size, num_s, group, kv_cap = _layout_sizes(
        q, k_pages, page_indices)

    kv_lens = kv_lens.astype(jnp.int32)
    cu_q_lens = cu_q_lens.astype(jnp.int32)
    live = jnp.arange(num_s) < num_seqs[0]
    q_lens = jnp.where(live, cu_q_lens[1:] - cu_q_lens[:-1], 0)  # [S]

    # Gather each sequence's query rows: [S, Q, H, hd].
    qi = jnp.arange(max_q_len, dtype=jnp.int32)
    rows = cu_q_lens[:-1, None] + qi[None, :]  # [S, Q]
    row_ok = qi[None, :] < q_lens[:, None]  # [S, Q]
    q_seq = q[jnp.clip(rows, 0, t_total - 1)]  # [S, Q, H, hd]
    q_seq = q_seq.reshape(num_s, max_q_len, num_kv_heads, group, head_dim)

    # Gather each sequence's pages: [KVH, S, L, hd].
    pages = jnp.clip(page_indices, 0, k_pages.shape[-3] - 1)
    k_seq = _take_pages(k_pages, pages, layer).reshape(num_kv_heads, num_s, kv_cap, head_dim)
    v_seq = _take_pages(v_pages, pages, layer).reshape(num_kv_heads, num_s, kv_cap, head_dim)

    # q is scaled before the dot (T x H x hd values, not S x H x Q x L scores) and the softmax is
    # normalised after the PV product: two fewer passes over the score tensor (``_softmax_parts``)
    scores = jnp.einsum("sqkgd,ksld->skgql", q_seq.astype(jnp.float32) * sm_scale, k_seq.astype(jnp.float32))
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)

    q_pos = kv_lens[:, None] - q_lens[:, None] + qi[None, :]  # [S, Q]
    k_pos = jnp.arange(kv_cap, dtype=jnp.int32)
    mask = k_pos[None, None, :] <= q_pos[:, :, None]  # keys past q_pos, hence past kv_len, are masked
    if sliding_window is not None:
        mask = mask & (q_pos[:, :, None] - k_pos[None, None, :] < sliding_window)
    mask = mask[:, None, None]  # [S, 1, 1, Q, L]

    p, denom = _softmax_parts(scores, mask)
    out = jnp.einsum("skgql,ksld->sqkgd", p, v_seq.astype(jnp.float32))
    out = out / denom.transpose(0, 3, 1, 2)[..., None]
    out = out.reshape(num_s, max_q_len, num_heads, head_dim).astype(q.dtype)

    # Scatter back to packed rows; rows of dead sequences / padding go out of bounds and drop.
    dest = jnp.where(row_ok, rows, t_total)
    packed = jnp.zeros_like(q)
    return packed.at[dest.reshape(-1)].set(out.reshape(-1, num_heads, head_dim), mode="drop")


def _layout_sizes(q, k_pages, page_indices):
    """``(t_total, num_heads, head_dim, num_kv_heads, page_size, num_s, group, kv_cap)``."""
    t_total, num_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape[-4:]  # one layer's shape, stacked pool or not
    num_s, pages_per_seq = page_indices.shape
    return (t_total, num_heads, head_dim, num_kv_heads, page_size, num_s, num_heads // num_kv_heads,
            pages_per_seq * page_size)


def _softmax_parts(scores, mask):
    """``(p, denom)`` of a softmax over the last axis of ``scores`` where ``mask`` (broadcast)
    holds: ``p = exp(scores - max)`` (0 where masked) and its sum, so ``softmax = p / denom``
    (callers divide the PV product, ``denom`` keeps no last axis). Masked scores are set to
    ``NEG_INF`` (finite): a row with no unmasked key gets ``p = 1`` everywhere and a finite result
    that callers drop (every owned query row sees at least its own key); ``denom >= 1``."""
    scores = jnp.where(mask, scores, NEG_INF)
    m = jnp.max(scores, axis=-1, keepdims=True)
    p = jnp.exp(scores - m)
    return p, jnp.sum(p, axis=-1)


def token_layout(t_total: int, num_seqs: int, max_q_len: int) -> bool:
    """Whether ``ragged_paged_attention`` lays its work out per packed token (``_attend_by_token``,
    which gathers every token's pages) rather than per sequence (which gathers each sequence's
    pages once and scores ``num_seqs x max_q_len`` padded query slots): when there are at most
    two packed tokens per sequence (decode, and verify steps with a few drafts per row). On the
    2-core CPU, one layer of the demo model's shapes
    (``python -m benchmarks.attention_layout``): per token 2.6 vs 4.9 ms at (S 128, T 128, Q 1), 4.0 vs
    4.2 ms at (128, 192, 7); per sequence 7.0 vs 14.9 ms at (128, 512, 17), 10.4 vs 134 ms at
    (128, 4224, 33) and 10.9 vs 63 ms for a (256, 2048, 16) prefill."""
    return t_total <= 2 * num_seqs


def _attend_by_token(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale, max_q_len,
                     soft_cap, sliding_window, layer=None):
    """``ragged_paged_attention`` with the work laid out per packed token instead of per sequence:
    each row gathers its sequence's pages (``[KVH, T, L, hd]``) and scores ``T x L`` keys, where
    the per-sequence layout scores ``S x max_q_len x L`` (padded) but gathers only ``S x L``
    positions. Same result; ``token_layout`` says which layout a call takes."""
    t_total, num_heads, head_dim, num_kv_heads, page_size, num_s, group, kv_cap = _layout_sizes(
        q, k_pages, page_indices)
    kv_lens = kv_lens.astype(jnp.int32)
    cu = cu_q_lens.astype(jnp.int32)

    t = jnp.arange(t_total, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(cu[1:], t, side="right"), 0, num_s - 1).astype(jnp.int32)  # [T]
    tok_ok = (t < cu[jnp.clip(num_seqs[0], 0, num_s)]) & (t < cu[seq + 1])  # live, owned rows
    q_pos = kv_lens[seq] - (cu[seq + 1] - cu[seq]) + (t - cu[seq])  # [T]

    pages = jnp.clip(page_indices, 0, k_pages.shape[-3] - 1)[seq]  # [T, pps]
    k_tok = _take_pages(k_pages, pages, layer).reshape(num_kv_heads, t_total, kv_cap, head_dim)
    v_tok = _take_pages(v_pages, pages, layer).reshape(num_kv_heads, t_total, kv_cap, head_dim)
    q_t = q.reshape(t_total, num_kv_heads, group, head_dim).astype(jnp.float32) * sm_scale
    scores = jnp.einsum("tkgd,ktld->tkgl", q_t, k_tok.astype(jnp.float32))
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    k_pos = jnp.arange(kv_cap, dtype=jnp.int32)
    mask = k_pos[None, :] <= q_pos[:, None]  # keys past q_pos, hence past kv_len, are masked
    if sliding_window is not None:
        mask = mask & (q_pos[:, None] - k_pos[None, :] < sliding_window)
    p, denom = _softmax_parts(scores, mask[:, None, None])  # [T, 1, 1, L]
    out = jnp.einsum("tkgl,ktld->tkgd", p, v_tok.astype(jnp.float32)) / denom[..., None]
    out = jnp.where(tok_ok[:, None, None, None], out, 0.0)
    return out.reshape(t_total, num_heads, head_dim).astype(q.dtype)


def write_kv(
    k_pages: Float[Array, "KVH P ps hd"],
    v_pages: Float[Array, "KVH P ps hd"],
    k_new: Float[Array, "T KVH hd"],
    v_new: Float[Array, "T KVH hd"],
    slot_mapping: Int[Array, "T"],
) -> tuple[Float[Array, "KVH P ps hd"], Float[Array, "KVH P ps hd"]]:
    """Write new keys/values into their flat slots of one layer's KV pool.

    Args:
      k_pages, v_pages: ``[KVH, num_pages, page_size, hd]`` pool (donate it under jit to update
        in place).
      k_new, v_new: ``[T, KVH, hd]`` new keys/values (cast to the pool dtype).
      slot_mapping: ``i32[T]`` flat slot ``page * page_size + offset`` per token; padding tokens
        point into the reserved scratch page 0 (their writes may collide; that page is never read
        by a live sequence).

    Returns:
      The updated ``(k_pages, v_pages)``.

    Raises:
      RaggedAttentionInputError: shapes disagree.
    """
    kvh, num_pages, page_size, hd = k_pages.shape
    if k_new.shape != v_new.shape or k_new.ndim != 3 or k_new.shape[1:] != (kvh, hd):
        raise RaggedAttentionInputError(
            "pallas_kernels/ragged_paged_attention/reference.py: write_kv k_new/v_new must be "
            f"[T, {kvh}, {hd}], got {k_new.shape} and {v_new.shape}")
    if slot_mapping.shape != (k_new.shape[0],):
        raise RaggedAttentionInputError(
            "pallas_kernels/ragged_paged_attention/reference.py: write_kv slot_mapping must be "
            f"[T]={k_new.shape[0]}, got {slot_mapping.shape}")
    # (page, offset) on the pool's own shape: a flat reshape around a 1-token write made XLA copy
    # the pool (rhyme_jax/rollout/forward.py _write_layer)
    page, offset = slot_mapping // page_size, slot_mapping % page_size
    k = k_pages.at[:, page, offset].set(k_new.transpose(1, 0, 2).astype(k_pages.dtype))
    v = v_pages.at[:, page, offset].set(v_new.transpose(1, 0, 2).astype(v_pages.dtype))
    return k, v


__all__ = ["RaggedAttentionInputError", "ragged_paged_attention", "write_kv"]
