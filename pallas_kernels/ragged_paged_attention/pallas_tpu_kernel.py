"""Kernel body of the Pallas Mosaic TPU ragged paged attention (one program of the grid).

``pallas_tpu.ragged_paged_attention`` builds the grid, the block specs and the scratch, and
calls ``attention_kernel`` once per ``(sequence, kv_head, q_block)``; that module's docstring
describes the whole computation. This module holds only what runs inside one program:

* ``visible_kv``: the key tokens ``[lo, hi)`` and KV blocks ``[blk_start, blk_end)`` the q
  block can see (causal limit, ``kv_lens``, sliding window).
* ``KVPageCopies``: the page-by-page HBM -> VMEM DMAs of one KV block into one slot of the
  double buffer (pages without a visible token are not copied).
* ``online_softmax_update``: one KV block folded into the running max / sum / output
  accumulator (flash attention, Dao et al. 2022, Alg. 1), in float32.

Everything here is traced inside ``pl.pallas_call``; the refs are Pallas refs (SMEM, VMEM or
HBM as noted) and the scalars are traced ``int32``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.compat import pl, pltpu

# Finite "minus infinity" of the online softmax (as in JAX's TPU flash attention): keeps
# exp(m_prev - m_next) finite when a row has seen no visible key yet.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


@dataclasses.dataclass(frozen=True)
class KernelStatics:
    """Compile-time parameters of ``attention_kernel`` (Python numbers, baked into the kernel).

    Attributes:
      sm_scale: score scale (usually ``head_dim ** -0.5``).
      soft_cap: if set, scores become ``soft_cap * tanh(scores / soft_cap)``.
      sliding_window: if set, a query only sees keys with ``q_pos - k_pos < sliding_window``.
      group: query heads per KV head (``G = H // KVH``); row ``r`` of a q block is query token
        ``r // G``.
      page_size: tokens per page.
      pages_per_block: pages per KV block (one double-buffer slot).
      pages_per_seq: page-table entries per sequence.
      num_pages: pages in the pool (page ids are clipped to ``[0, num_pages)`` before a DMA).
      q_block: query tokens per q block (grid axis 2).
    """

    sm_scale: float
    soft_cap: float | None
    sliding_window: int | None
    group: int
    page_size: int
    pages_per_block: int
    pages_per_seq: int
    num_pages: int
    q_block: int

    @property
    def block_kv(self) -> int:
        """Tokens per KV block: ``pages_per_block * page_size``."""
        return self.pages_per_block * self.page_size

    @property
    def kv_cap(self) -> int:
        """Tokens one sequence's page table can address: ``pages_per_seq * page_size``."""
        return self.pages_per_seq * self.page_size


def row_token(rows: jax.Array, group: int) -> jax.Array:
    """Query-token index (within the q block) of each row ``r`` of a block: ``r // group``."""
    if group & (group - 1) == 0:  # power of two: a shift, cheap on the VPU
        return jax.lax.shift_right_logical(rows, int(group).bit_length() - 1)
    return jax.lax.div(rows, jnp.int32(group))


class VisibleKV(NamedTuple):
    """What one q block can see of its sequence's cache (traced ``int32`` scalars).

    Attributes:
      lo, hi: key tokens ``[lo, hi)`` visible to at least one query of the block.
      blk_start, blk_end: KV blocks ``[blk_start, blk_end)`` holding them (empty if ``hi <= lo``).
    """

    lo: jax.Array
    hi: jax.Array
    blk_start: jax.Array
    blk_end: jax.Array


def visible_kv(ctx, first_qi, q_len, kv_len, cfg: KernelStatics) -> VisibleKV:
    """Visible key range and KV blocks of the q block starting at query token ``first_qi``.

    ``ctx = kv_len - q_len`` is the cache position of query token 0; the last query of the
    block is ``min(first_qi + q_block, q_len) - 1``. Keys past the causal limit, past
    ``kv_len``, past the page table (``kv_cap``) or before the sliding window are not visible.
    """
    last_qi = jnp.minimum(first_qi + cfg.q_block, q_len) - 1
    hi = jnp.minimum(jnp.minimum(kv_len, ctx + last_qi + 1), cfg.kv_cap)
    lo = jnp.int32(0)
    if cfg.sliding_window is not None:
        lo = jnp.maximum(ctx + first_qi - (cfg.sliding_window - 1), 0)
    blk_start = lo // cfg.block_kv
    blk_end = jnp.where(hi > lo, (hi + cfg.block_kv - 1) // cfg.block_kv, blk_start)
    return VisibleKV(lo, hi, blk_start, blk_end)


@dataclasses.dataclass(frozen=True, eq=False)
class KVPageCopies:
    """Page-by-page DMAs of one (sequence, KV head)'s KV blocks into the VMEM double buffer.

    Attributes:
      pages_ref: flattened page table ``i32[S * pages_per_seq]`` (SMEM).
      k_hbm, v_hbm: ``[KVH, P, ps, hd]`` KV pools (HBM).
      k_buf, v_buf: ``[2, block_kv, hd]`` double buffer (VMEM); slot 0 / 1.
      sems: DMA semaphores ``[k/v, slot]``.
      seq, kv_head: this program's sequence and KV head (traced ``int32``).
      visible: the q block's visible keys; pages without one are neither copied nor waited on.
      cfg: the kernel's static parameters.
    """

    pages_ref: Any
    k_hbm: Any
    v_hbm: Any
    k_buf: Any
    v_buf: Any
    sems: Any
    seq: Any
    kv_head: Any
    visible: VisibleKV
    cfg: KernelStatics

    def _page_copies(self, blk, slot):
        """(needed, k copy, v copy) per page of KV block ``blk`` into buffer ``slot``."""
        cfg, out = self.cfg, []
        for j in range(cfg.pages_per_block):
            pg = blk * cfg.pages_per_block + j
            tok0 = pg * cfg.page_size
            needed = (tok0 < self.visible.hi) & (tok0 + cfg.page_size > self.visible.lo)
            page = self.pages_ref[self.seq * cfg.pages_per_seq + jnp.minimum(pg, cfg.pages_per_seq - 1)]
            page = jnp.clip(page, 0, cfg.num_pages - 1)
            dst = pl.ds(j * cfg.page_size, cfg.page_size)
            h = self.kv_head
            out.append((needed,
                        pltpu.make_async_copy(self.k_hbm.at[h, page], self.k_buf.at[slot, dst],
                                              self.sems.at[0, slot]),
                        pltpu.make_async_copy(self.v_hbm.at[h, page], self.v_buf.at[slot, dst],
                                              self.sems.at[1, slot])))
        return out

    def start(self, blk, slot) -> None:
        """Start the copies of KV block ``blk`` into buffer ``slot``."""
        for needed, kc, vc in self._page_copies(blk, slot):
            @pl.when(needed)
            def _():
                kc.start()
                vc.start()

    def wait(self, blk, slot) -> None:
        """Wait for the copies of KV block ``blk`` into buffer ``slot``."""
        for needed, kc, vc in self._page_copies(blk, slot):
            @pl.when(needed)
            def _():
                kc.wait()
                vc.wait()


def online_softmax_update(q, q_pos, k, v, blk, visible: VisibleKV, scratch, cfg: KernelStatics) -> None:
    """Fold KV block ``blk`` into the running softmax state (Dao et al. 2022, Alg. 1).

    Args:
      q: ``[R, hd]`` the q block's rows (row = query token * G + head in group).
      q_pos: ``i32[R, block_kv]`` cache position of each row's query token.
      k, v: ``[block_kv, hd]`` the block's keys / values from the VMEM buffer.
      blk: the KV block index (its first token is ``blk * block_kv``).
      visible: the q block's visible keys (masks the causal limit, ``kv_lens``, window).
      scratch: ``(m_ref, l_ref, acc_ref)``: running max and sum ``f32[R, 128]`` (lane-replicated)
        and output accumulator ``f32[R, hd]`` (VMEM), updated in place.
      cfg: the kernel's static parameters.
    """
    m_ref, l_ref, acc_ref = scratch
    rows, head_dim = acc_ref.shape
    block_kv = cfg.block_kv
    scores = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                                 preferred_element_type=jnp.float32) * cfg.sm_scale  # [R, bk]
    if cfg.soft_cap is not None:
        scores = cfg.soft_cap * jnp.tanh(scores / cfg.soft_cap)
    k_pos = blk * block_kv + jax.lax.broadcasted_iota(jnp.int32, (rows, block_kv), 1)
    visible_mask = (k_pos <= q_pos) & (k_pos >= visible.lo) & (k_pos < visible.hi)
    if cfg.sliding_window is not None:
        visible_mask = visible_mask & (q_pos - k_pos < cfg.sliding_window)
    scores = jnp.where(visible_mask, scores, MASK_VALUE)

    m_prev = m_ref[...][:, :1]  # [R, 1]
    m_next = jnp.maximum(m_prev, jnp.max(scores, axis=1, keepdims=True))
    alpha = jnp.exp(m_prev - m_next)
    p = jnp.where(visible_mask, jnp.exp(scores - m_next), 0.0)  # [R, bk] f32
    l_next = alpha * l_ref[...][:, :1] + jnp.sum(p, axis=1, keepdims=True)
    # Rows of the buffer outside [lo, hi) may be stale or never written (NaN in interpret
    # mode): zero them so that 0 * NaN cannot leak into the output.
    v_pos = blk * block_kv + jax.lax.broadcasted_iota(jnp.int32, (block_kv, head_dim), 0)
    v = jnp.where((v_pos >= visible.lo) & (v_pos < visible.hi), v, jnp.zeros_like(v))
    pv = jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                             preferred_element_type=jnp.float32)  # [R, hd]
    acc_ref[...] = alpha * acc_ref[...] + pv
    m_ref[...] = jnp.broadcast_to(m_next, m_ref.shape)
    l_ref[...] = jnp.broadcast_to(l_next, l_ref.shape)


def attend_q_block(q_ref, o_ref, scratch, copies: KVPageCopies, ctx, first_qi) -> None:
    """Attention of one live q block over its visible KV blocks, written to ``o_ref``.

    Walks KV blocks ``[blk_start, blk_end)`` with double buffering (the DMA of block ``i + 1``
    starts before block ``i`` is computed), then divides the accumulator by the softmax sum
    (rows that saw no key stay zero).

    Args:
      q_ref, o_ref: ``[R, hd]`` q block in and output block out (VMEM).
      scratch: ``(m_ref, l_ref, acc_ref)`` as in ``online_softmax_update``; reset here.
      copies: the KV page DMAs of this (sequence, KV head), with the visible range.
      ctx: cache position of query token 0 (``kv_len - q_len``).
      first_qi: first query token of the block (``q_block * program_id(2)``).
    """
    m_ref, l_ref, acc_ref = scratch
    cfg, vis = copies.cfg, copies.visible
    rows = acc_ref.shape[0]
    m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(vis.blk_end > vis.blk_start)
    def _prologue():
        copies.start(vis.blk_start, 0)

    q = q_ref[...]  # [R, hd]
    q_pos = ctx + first_qi + row_token(jax.lax.broadcasted_iota(jnp.int32, (rows, cfg.block_kv), 0), cfg.group)

    def body(blk, carry):
        slot = (blk - vis.blk_start) % 2

        @pl.when(blk + 1 < vis.blk_end)
        def _prefetch():  # double buffering: next block's DMA overlaps this block's math
            copies.start(blk + 1, 1 - slot)

        copies.wait(blk, slot)
        online_softmax_update(q, q_pos, copies.k_buf[slot], copies.v_buf[slot], blk, vis, scratch, cfg)
        return carry

    jax.lax.fori_loop(vis.blk_start, vis.blk_end, body, 0)
    l_fin = l_ref[...][:, :1]
    o_ref[...] = (acc_ref[...] / jnp.where(l_fin > 0, l_fin, 1.0)).astype(o_ref.dtype)


def attention_kernel(kv_lens_ref, pages_ref, cu_ref, nseq_ref,  # scalar prefetch (SMEM)
                     q_ref, k_hbm, v_hbm,  # q block [R, hd] (VMEM); KV pools [KVH, P, ps, hd] (HBM)
                     o_ref,  # [R, hd] (VMEM)
                     k_buf, v_buf, sems, m_ref, l_ref, acc_ref,  # scratch
                     *, cfg: KernelStatics) -> None:
    """One ``(sequence, kv_head, q_block)`` program: zeros for a dead block, else attention.

    A block is dead when its sequence is past ``num_seqs`` or its first query token is past the
    sequence's ``q_len``. Refs in the order ``pltpu.PrefetchScalarGridSpec`` passes them: the
    four scalar-prefetch arrays (``kv_lens``, flattened page table, ``cu_q_lens``,
    ``num_seqs``), the inputs, the output, then the scratch.
    """
    s, h, qb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    q_lo = cu_ref[s]
    q_len = cu_ref[s + 1] - q_lo
    kv_len = kv_lens_ref[s]
    first_qi = qb * cfg.q_block
    live = (s < nseq_ref[0]) & (first_qi < q_len)

    @pl.when(jnp.logical_not(live))
    def _dead():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)

    @pl.when(live)
    def _live():
        ctx = kv_len - q_len  # position of query token 0
        visible = visible_kv(ctx, first_qi, q_len, kv_len, cfg)
        copies = KVPageCopies(pages_ref, k_hbm, v_hbm, k_buf, v_buf, sems, s, h, visible, cfg)
        attend_q_block(q_ref, o_ref, (m_ref, l_ref, acc_ref), copies, ctx, first_qi)


__all__ = ["KVPageCopies", "KernelStatics", "MASK_VALUE", "VisibleKV", "attend_q_block", "attention_kernel",
           "online_softmax_update", "row_token", "visible_kv"]
