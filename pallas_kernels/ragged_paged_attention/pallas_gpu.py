"""Ragged paged attention as a Pallas kernel for NVIDIA GPUs (Triton lowering).

Same semantics and argument order as ``reference.ragged_paged_attention``; the reference
docstring is the specification. Layout of the computation:

* Outside the kernel (XLA): each sequence's query rows are gathered into ``[S, KVH, NQB, R, hd]``
  where one block of ``R = block_q`` rows folds ``P`` query positions times the ``G = H / KVH``
  query heads of one KV head (``G`` padded to a power of two ``Gp``, ``P = R / Gp``), so a decode
  step (``q_len`` 1) with a small ``G`` still gives the MMA >= 16 rows; padded rows are masked.
  The result is scattered back to packed rows the same way; rows of dead sequences, padding rows
  and padded heads are dropped there, so the output rows not owned by a live sequence are zero.
* Kernel: grid ``(S, KVH, NQB)``. A program whose first query position is past its sequence's
  ``q_len`` exits at once. Otherwise it walks the sequence's cache in tiles of
  ``BK = pages_per_kv_block * page_size`` tokens from the first tile the sliding window can see to
  the last one its causal limit ``min(last q_pos + 1, kv_len)`` reaches (a dynamic trip count).
  For each tile it gathers the tokens' page ids from the page table and the K/V rows from the
  pool (masked loads: tokens outside ``[window start, causal limit)`` are never read and count as
  zero, so NaN/garbage in unread slots, e.g. the scratch page 0, cannot reach the output), then
  runs the flash-attention online softmax in float32 (Dao et al., FlashAttention, 2022,
  Algorithm 1) with the causal / kv_len / window masks and the optional soft cap.

All tile dimensions are powers of two and both ``pl.dot`` operands are >= 16 in each dimension, as
Triton requires. f32 dots run in IEEE precision (``Precision.HIGHEST``, no TF32); bf16 dots take
bf16 operands with f32 accumulation (the softmax weights are cast to bf16 for ``p @ V``, as in
FlashAttention). ``interpret=True`` runs the same kernel on CPU.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, Int

from pallas_kernels.compat import pl, pl_triton, triton_compiler_params
from pallas_kernels.ragged_paged_attention.reference import RaggedAttentionInputError, _check_shapes

_WHERE = "pallas_kernels/ragged_paged_attention/pallas_gpu.py"
_KV_TILE_TARGET = 64  # tokens per inner-loop step when pages_per_kv_block is left to the default


def _is_pow2(x: int) -> bool:
    return x >= 1 and (x & (x - 1)) == 0


def _next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


@dataclass(frozen=True)
class GPUBlockSizes:
    """Tile sizes of the GPU kernel (hashable: passed as a static argument).

    Attributes:
      block_q: query rows per program (query positions x the ``G`` heads of one KV head); a power
        of two >= 16. Raised to ``next_pow2(G)`` when ``G`` is larger. Larger values suit prefill.
      pages_per_kv_block: pages per inner-loop step; ``pages_per_kv_block * page_size`` must be a
        power of two >= 16. ``None``: the fewest pages giving >= 64 tokens (at least 1 page).
      num_warps: Triton warps per program (power of two).
      num_stages: Triton software-pipelining stages (>= 1).

    Raises:
      ValueError: a field out of range (the message names it).
    """

    block_q: int = 16
    pages_per_kv_block: int | None = None
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        if not (isinstance(self.block_q, int) and _is_pow2(self.block_q) and self.block_q >= 16):
            raise ValueError(f"{_WHERE}: GPUBlockSizes.block_q must be a power of two >= 16, got {self.block_q!r}")
        if self.pages_per_kv_block is not None and not (
                isinstance(self.pages_per_kv_block, int) and self.pages_per_kv_block >= 1):
            raise ValueError(f"{_WHERE}: GPUBlockSizes.pages_per_kv_block must be None or an int >= 1, "
                             f"got {self.pages_per_kv_block!r}")
        if not (isinstance(self.num_warps, int) and _is_pow2(self.num_warps)):
            raise ValueError(f"{_WHERE}: GPUBlockSizes.num_warps must be a power of two, got {self.num_warps!r}")
        if not (isinstance(self.num_stages, int) and self.num_stages >= 1):
            raise ValueError(f"{_WHERE}: GPUBlockSizes.num_stages must be an int >= 1, got {self.num_stages!r}")

    def kv_pages(self, page_size: int) -> int:
        """Pages per inner-loop step for this ``page_size`` (resolves the ``None`` default).

        Raises:
          RaggedAttentionInputError: ``pages_per_kv_block * page_size`` is not a power of two >= 16.
        """
        ppb = self.pages_per_kv_block
        if ppb is None:
            ppb = max(1, _KV_TILE_TARGET // page_size)
        bk = ppb * page_size
        if not (_is_pow2(bk) and bk >= 16):
            raise RaggedAttentionInputError(
                f"{_WHERE}: pages_per_kv_block * page_size must be a power of two >= 16 (Triton tile), got "
                f"{ppb} * {page_size} = {bk}; page_size must be a power of two")
        return ppb


@dataclass(frozen=True)
class _Geometry:
    """Static shapes of one call (derived from the inputs and the block sizes)."""

    group: int  # G = H // KVH
    group_pad: int  # Gp = next_pow2(G)
    rows: int  # R rows per program
    positions: int  # P query positions per program
    num_q_blocks: int  # NQB
    page_size: int
    kv_pages: int  # pages per KV tile
    kv_tile: int  # BK tokens per KV tile
    kv_cap: int  # pages_per_seq * page_size


def _geometry(q, k_pages, page_indices, max_q_len, bs: GPUBlockSizes) -> _Geometry:
    _, num_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape[-4:]  # one layer's or the stacked pool
    if not (_is_pow2(head_dim) and head_dim >= 16):
        raise RaggedAttentionInputError(f"{_WHERE}: head_dim must be a power of two >= 16, got {head_dim}")
    group = num_heads // num_kv_heads
    group_pad = _next_pow2(group)
    rows = max(bs.block_q, group_pad)
    positions = rows // group_pad
    ppb = bs.kv_pages(page_size)
    return _Geometry(group=group, group_pad=group_pad, rows=rows, positions=positions,
                     num_q_blocks=-(-max_q_len // positions), page_size=page_size, kv_pages=ppb,
                     kv_tile=ppb * page_size, kv_cap=page_indices.shape[1] * page_size)


def _attention_kernel(meta_ref, layer_ref, q_ref, k_ref, v_ref, pages_ref, *rest, geo: _Geometry,
                      sm_scale: float, soft_cap: float | None, sliding_window: int | None, exact_f32: bool):
    """One program: ``R`` query rows of sequence ``program_id(0)``, KV head ``program_id(1)``,
    query block ``program_id(2)``.

    Refs: ``meta [2]`` = (kv_len, q_len) of the sequence; ``layer [1]`` the layer to read;
    ``q [R, hd]``; ``k, v [L, P*ps, hd]`` the KV head's pool of every layer with flat token slots;
    ``pages [pps_padded]`` the sequence's page table; ``o [R, hd]``.
    """
    o_ref = rest[-1]  # rest = (o_ref,) or (poisoned_init_ref, o_ref)
    rows, head_dim = q_ref.shape
    bk = geo.kv_tile
    kv_len = meta_ref[0]
    q_len = meta_ref[1]
    layer = layer_ref[0]
    first = pl.program_id(2) * geo.positions  # first query index of this block

    @pl.when(first < q_len)
    def _():
        ctx = kv_len - q_len  # position of query index 0
        r = lax.iota(jnp.int32, rows)
        qi = first + lax.div(r, jnp.int32(geo.group_pad))
        q_pos = ctx + qi  # [R]
        row_ok = (qi < q_len) & (lax.rem(r, jnp.int32(geo.group_pad)) < geo.group)
        # Keys this block may see: [kv_lo, kv_hi).
        kv_hi = jnp.minimum(jnp.minimum(ctx + jnp.minimum(first + geo.positions, q_len), kv_len), geo.kv_cap)
        kv_lo = jnp.int32(0)
        if sliding_window is not None:
            kv_lo = jnp.maximum(ctx + first - (sliding_window - 1), 0)
        tile_lo = lax.div(kv_lo, jnp.int32(bk))
        tile_hi = lax.div(jnp.maximum(kv_hi, 0) + (bk - 1), jnp.int32(bk))
        q = q_ref[...]
        precision = lax.Precision.HIGHEST if exact_f32 else None

        def body(t, carry):
            acc, m_prev, l_prev = carry
            tok = t * bk + lax.iota(jnp.int32, bk)  # [BK] key positions
            col_ok = (tok >= kv_lo) & (tok < kv_hi)
            page = pages_ref[lax.div(tok, jnp.int32(geo.page_size))]
            slot = page * geo.page_size + lax.rem(tok, jnp.int32(geo.page_size))
            # Gather [BK, hd] of this layer with three full-shape int indexers (the interpreter
            # cannot mix an array indexer with a slice); Triton turns them into one pointer tensor.
            tile = (bk, head_dim)
            layer_idx = jnp.full(tile, layer, jnp.int32)
            row_idx = jnp.broadcast_to(slot[:, None], tile)
            col_idx = jnp.broadcast_to(lax.iota(jnp.int32, head_dim)[None, :], tile)
            ld_mask = jnp.broadcast_to(col_ok[:, None], tile)
            k = pl_triton.load(k_ref.at[layer_idx, row_idx, col_idx], mask=ld_mask, other=0.0)
            v = pl_triton.load(v_ref.at[layer_idx, row_idx, col_idx], mask=ld_mask, other=0.0)
            s = pl_triton.dot(q, k, trans_b=True, precision=precision) * sm_scale  # [R, BK] f32
            if soft_cap is not None:
                s = soft_cap * jnp.tanh(s / soft_cap)
            mask = row_ok[:, None] & col_ok[None, :] & (tok[None, :] <= q_pos[:, None])
            if sliding_window is not None:
                mask = mask & (q_pos[:, None] - tok[None, :] < sliding_window)
            s = jnp.where(mask, s, -jnp.inf)
            m_new = jnp.maximum(m_prev, jnp.max(s, axis=1))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # fully masked so far: no -inf - -inf
            alpha = jnp.exp(m_prev - m_safe)
            p = jnp.exp(s - m_safe[:, None])
            l_new = alpha * l_prev + jnp.sum(p, axis=1)
            pv = pl_triton.dot(p.astype(v.dtype), v, precision=precision)
            return alpha[:, None] * acc + pv, m_new, l_new

        init = (jnp.zeros((rows, head_dim), jnp.float32), jnp.full((rows,), -jnp.inf, jnp.float32),
                jnp.zeros((rows,), jnp.float32))
        acc, _, l_sum = lax.fori_loop(tile_lo, tile_hi, body, init)
        out = acc / jnp.where(l_sum > 0, l_sum, 1.0)[:, None]  # rows that saw no key stay 0
        o_ref[...] = out.astype(o_ref.dtype)


def _stacked(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, max_q_len, layer):
    """The pools as ``[L, KVH, P, ps, hd]`` (one layer: ``L = 1``) and the layer index as
    ``i32[1]`` clipped to ``[0, L)``, after the shape and dtype checks (per-layer shapes).

    The whole stacked pool becomes the kernel's operand (a free reshape merging page and offset),
    never a slice of it: a slice of a loop-carried pool is an XLA copy per layer. Each program
    sees its KV head's ``[L, P*ps, hd]`` and reads layer ``layer`` inside the kernel."""
    if layer is None:
        k_pages, v_pages, layer = k_pages.reshape(1, *k_pages.shape), v_pages.reshape(1, *v_pages.shape), 0
    elif k_pages.ndim != 5 or v_pages.shape != k_pages.shape:
        raise RaggedAttentionInputError(f"{_WHERE}: with layer=, k_pages/v_pages must both be "
                                        f"[L, KVH, P, ps, hd], got {k_pages.shape} and {v_pages.shape}")
    one = jax.ShapeDtypeStruct(k_pages.shape[1:], k_pages.dtype)
    _check_shapes(q, one, jax.ShapeDtypeStruct(v_pages.shape[1:], v_pages.dtype), kv_lens, page_indices,
                  cu_q_lens, num_seqs, max_q_len)
    if k_pages.dtype != q.dtype or v_pages.dtype != q.dtype:
        raise RaggedAttentionInputError(
            f"{_WHERE}: k_pages/v_pages dtype ({k_pages.dtype}/{v_pages.dtype}) must equal q dtype ({q.dtype})")
    layer = jnp.clip(jnp.asarray(layer, jnp.int32).reshape(1), 0, k_pages.shape[0] - 1)
    return k_pages, v_pages, layer


def _forward(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale: float,
             max_q_len: int, soft_cap: float | None = None, sliding_window: int | None = None,
             block_sizes: GPUBlockSizes | None = None, interpret: bool = False, poison_output: bool = False,
             layer=None):
    """``ragged_paged_attention`` plus ``poison_output``: when set, the kernel's block output starts
    NaN-filled (an aliased input), so a row the kernel forgets to write surfaces as NaN (tests).

    Returns ``(packed_output [T, H, hd], block_output [S, KVH, NQB, R, hd], row_ok [S, KVH, NQB, R])``.
    """
    k_pages, v_pages, layer = _stacked(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                                       max_q_len, layer)
    if sliding_window is not None and sliding_window < 1:
        raise RaggedAttentionInputError(f"{_WHERE}: sliding_window must be >= 1, got {sliding_window}")
    if soft_cap is not None and not soft_cap > 0:
        raise RaggedAttentionInputError(f"{_WHERE}: soft_cap must be > 0, got {soft_cap}")
    bs = GPUBlockSizes() if block_sizes is None else block_sizes
    geo = _geometry(q, k_pages, page_indices, max_q_len, bs)
    t_total, num_heads, head_dim = q.shape
    num_layers, num_kv_heads, num_pages, page_size, _ = k_pages.shape
    num_s, pages_per_seq = page_indices.shape
    g, gp, npos, nqb = geo.group, geo.group_pad, geo.positions, geo.num_q_blocks
    q_pad = nqb * npos  # query positions covered by the blocks (>= max_q_len)

    kv_lens = kv_lens.astype(jnp.int32)
    cu_q_lens = cu_q_lens.astype(jnp.int32)
    live = jnp.arange(num_s) < num_seqs[0]
    q_lens = jnp.where(live, cu_q_lens[1:] - cu_q_lens[:-1], 0)  # [S]
    meta = jnp.stack([kv_lens, q_lens], axis=1)  # [S, 2]

    # Gather queries into blocks: [S, Qpad, KVH, Gp, hd] -> [S, KVH, NQB, R, hd].
    qi = jnp.arange(q_pad, dtype=jnp.int32)
    rows = cu_q_lens[:-1, None] + qi[None, :]  # [S, Qpad]
    row_ok = (qi[None, :] < q_lens[:, None]) & (qi[None, :] < max_q_len)  # [S, Qpad]
    q_seq = q[jnp.clip(rows, 0, t_total - 1)].reshape(num_s, q_pad, num_kv_heads, g, head_dim)
    q_seq = jnp.where(row_ok[:, :, None, None, None], q_seq, 0)
    q_seq = jnp.pad(q_seq, ((0, 0), (0, 0), (0, 0), (0, gp - g), (0, 0)))
    q_blk = q_seq.transpose(0, 2, 1, 3, 4).reshape(num_s, num_kv_heads, nqb, geo.rows, head_dim)

    # Page table padded to whole KV tiles with the scratch page 0 and clipped to the pool (the
    # kernel never reads past the causal limit, so the padding only keeps addresses in bounds).
    tiles_per_seq = -(-pages_per_seq // geo.kv_pages)
    pages = jnp.clip(page_indices.astype(jnp.int32), 0, num_pages - 1)
    pages = jnp.pad(pages, ((0, 0), (0, tiles_per_seq * geo.kv_pages - pages_per_seq)))
    flat = (num_layers, num_kv_heads, num_pages * page_size, head_dim)

    blk = pl.BlockSpec((None, None, None, geo.rows, head_dim), lambda s, h, b: (s, h, b, 0, 0))
    pool = pl.BlockSpec((num_layers, None, num_pages * page_size, head_dim), lambda s, h, b: (0, h, 0, 0))
    in_specs = [pl.BlockSpec((None, 2), lambda s, h, b: (s, 0)), pl.BlockSpec((1,), lambda s, h, b: (0,)),
                blk, pool, pool, pl.BlockSpec((None, pages.shape[1]), lambda s, h, b: (s, 0))]
    args = [meta, layer, q_blk, k_pages.reshape(flat), v_pages.reshape(flat), pages]
    aliases = {}
    if poison_output:
        in_specs.append(blk)
        args.append(jnp.full(q_blk.shape, jnp.nan, q.dtype))
        aliases = {len(args) - 1: 0}
    kernel = functools.partial(_attention_kernel, geo=geo, sm_scale=float(sm_scale),
                               soft_cap=None if soft_cap is None else float(soft_cap),
                               sliding_window=None if sliding_window is None else int(sliding_window),
                               exact_f32=q.dtype == jnp.float32)
    out_blk = pl.pallas_call(
        kernel,
        grid=(num_s, num_kv_heads, nqb),
        in_specs=in_specs,
        out_specs=blk,
        out_shape=jax.ShapeDtypeStruct(q_blk.shape, q.dtype),
        input_output_aliases=aliases,
        compiler_params=triton_compiler_params(num_warps=bs.num_warps, num_stages=bs.num_stages),
        interpret=interpret,
        name="ragged_paged_attention_gpu",
    )(*args)

    # Scatter back: [S, KVH, NQB, R, hd] -> [S, Qpad, H, hd] -> packed rows (others dropped).
    out_seq = out_blk.reshape(num_s, num_kv_heads, q_pad, gp, head_dim)[:, :, :, :g]
    out_seq = out_seq.transpose(0, 2, 1, 3, 4).reshape(num_s, q_pad, num_heads, head_dim)
    dest = jnp.where(row_ok, rows, t_total)
    packed = jnp.zeros_like(q).at[dest.reshape(-1)].set(out_seq.reshape(-1, num_heads, head_dim), mode="drop")
    blk_ok = (row_ok.reshape(num_s, 1, nqb, npos, 1) & (jnp.arange(gp) < g))
    blk_ok = jnp.broadcast_to(blk_ok, (num_s, num_kv_heads, nqb, npos, gp))
    return packed, out_blk, blk_ok.reshape(num_s, num_kv_heads, nqb, geo.rows)


def ragged_paged_attention(
    q: Float[Array, "T H hd"],
    k_pages: Float[Array, "KVH P ps hd"],
    v_pages: Float[Array, "KVH P ps hd"],
    kv_lens: Int[Array, "S"],
    page_indices: Int[Array, "S pps"],
    cu_q_lens: Int[Array, "S+1"],
    num_seqs: Int[Array, "1"],
    *,
    sm_scale: float,
    max_q_len: int,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    block_sizes: GPUBlockSizes | None = None,
    interpret: bool = False,
    layer: int | Int[Array, ""] | None = None,
) -> Float[Array, "T H hd"]:
    """Ragged paged attention with a Pallas Triton kernel; semantics of ``reference.py``.

    Args:
      q: ``[T_total, H, hd]`` packed queries (f32 or bf16; ``hd`` a power of two >= 16).
      k_pages, v_pages: ``[KVH, num_pages, page_size, hd]`` KV pool of one layer, or with
        ``layer`` the stacked pool ``[L, KVH, num_pages, page_size, hd]`` of every layer; dtype of
        ``q`` (``page_size`` a power of two).
      kv_lens: ``i32[S]`` cached tokens per sequence including the new ones.
      page_indices: ``i32[S, pages_per_seq]`` page table (entries past a sequence's length are
        never read; out-of-range ids are clipped like the reference does).
      cu_q_lens: ``i32[S+1]`` cumulative query lengths.
      num_seqs: ``i32[1]`` live sequences; the others produce zeros.
      sm_scale: score scale. max_q_len: static bound on every ``q_len``.
      soft_cap: ``soft_cap * tanh(scores / soft_cap)`` after scaling, if set (> 0).
      sliding_window: a query sees keys with ``q_pos - k_pos < sliding_window`` (>= 1), if set.
      block_sizes: tile sizes (``GPUBlockSizes()`` when None).
      interpret: run the kernel in the Pallas interpreter (CPU tests).
      layer: the layer of the stacked pool to read (a Python int or an int32 scalar, e.g. a
        ``lax.scan`` layer index; clipped to ``[0, L)``). The kernel takes the whole stacked pool
        as its operand and indexes the layer inside, so no program slices or copies the pool.

    Static under ``jax.jit``: sm_scale, max_q_len, soft_cap, sliding_window, block_sizes, interpret.

    Returns:
      ``[T_total, H, hd]`` in ``q.dtype``; rows not owned by a live sequence are zero.

    Raises:
      RaggedAttentionInputError: inconsistent shapes/dtypes, a non-power-of-two ``head_dim`` or
        KV tile, or an invalid ``soft_cap`` / ``sliding_window``.
      ValueError: invalid ``GPUBlockSizes`` fields.
    """
    out, _, _ = _forward(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale=sm_scale,
                         max_q_len=max_q_len, soft_cap=soft_cap, sliding_window=sliding_window,
                         block_sizes=block_sizes, interpret=interpret, layer=layer)
    return out


def _write_kv_kernel(slot_ref, k_new_ref, v_new_ref, _k_in, _v_in, k_out_ref, v_out_ref, *, num_slots: int):
    """One program: ``BT`` new tokens of KV head ``program_id(1)``. Refs: ``slot [BT]``,
    ``k_new, v_new [BT, hd]``, ``k_out, v_out [P*ps, hd]`` (aliased to the pool inputs)."""
    bt, head_dim = k_new_ref.shape
    slot = slot_ref[...]
    ok = (slot >= 0) & (slot < num_slots)  # padded tokens carry slot -1
    tile = (bt, head_dim)
    # Masked-off lanes keep an out-of-range row: Triton never dereferences them, and the
    # interpreter (which rewrites masked lanes with their old value) drops them instead of racing
    # a real write to the same slot.
    row_idx = jnp.broadcast_to(jnp.where(ok, slot, num_slots)[:, None], tile)
    col_idx = jnp.broadcast_to(lax.iota(jnp.int32, head_dim)[None, :], tile)
    st_mask = jnp.broadcast_to(ok[:, None], tile)
    pl_triton.store(k_out_ref.at[row_idx, col_idx], k_new_ref[...].astype(k_out_ref.dtype), mask=st_mask)
    pl_triton.store(v_out_ref.at[row_idx, col_idx], v_new_ref[...].astype(v_out_ref.dtype), mask=st_mask)


def write_kv(
    k_pages: Float[Array, "KVH P ps hd"],
    v_pages: Float[Array, "KVH P ps hd"],
    k_new: Float[Array, "T KVH hd"],
    v_new: Float[Array, "T KVH hd"],
    slot_mapping: Int[Array, "T"],
    *,
    block_tokens: int = 16,
    interpret: bool = False,
) -> tuple[Float[Array, "KVH P ps hd"], Float[Array, "KVH P ps hd"]]:
    """Scatter new keys/values into their flat slots of one layer's pool with a Triton kernel.

    Same semantics as ``reference.write_kv``; the pool is an aliased input/output of the kernel, so
    under ``jax.jit`` with the pool donated it is updated in place. Grid
    ``(cdiv(T, block_tokens), KVH)``; each program stores ``block_tokens`` rows of ``hd`` values.

    Args:
      k_pages, v_pages: ``[KVH, num_pages, page_size, hd]`` pool (``hd`` a power of two).
      k_new, v_new: ``[T, KVH, hd]`` new keys/values (cast to the pool dtype).
      slot_mapping: ``i32[T]`` flat slot ``page * page_size + offset``; padding tokens point into
        the scratch page 0 (colliding writes there land in an unspecified order). Slots outside
        ``[0, num_pages * page_size)`` are dropped (the reference wraps negative ones).
      block_tokens: tokens per program, a power of two (static).
      interpret: run in the Pallas interpreter (CPU tests).

    Returns:
      The updated ``(k_pages, v_pages)``.

    Raises:
      RaggedAttentionInputError: shapes disagree, or ``hd`` / ``block_tokens`` not a power of two.
    """
    kvh, num_pages, page_size, hd = k_pages.shape
    if v_pages.shape != k_pages.shape or v_pages.dtype != k_pages.dtype:
        raise RaggedAttentionInputError(
            f"{_WHERE}: write_kv k_pages/v_pages must match, got {k_pages.shape}/{k_pages.dtype} and "
            f"{v_pages.shape}/{v_pages.dtype}")
    if k_new.shape != v_new.shape or k_new.ndim != 3 or k_new.shape[1:] != (kvh, hd):
        raise RaggedAttentionInputError(
            f"{_WHERE}: write_kv k_new/v_new must be [T, {kvh}, {hd}], got {k_new.shape} and {v_new.shape}")
    if slot_mapping.shape != (k_new.shape[0],):
        raise RaggedAttentionInputError(
            f"{_WHERE}: write_kv slot_mapping must be [T]={k_new.shape[0]}, got {slot_mapping.shape}")
    if not _is_pow2(hd):
        raise RaggedAttentionInputError(f"{_WHERE}: write_kv head_dim must be a power of two, got {hd}")
    if not _is_pow2(block_tokens):
        raise RaggedAttentionInputError(f"{_WHERE}: write_kv block_tokens must be a power of two, got {block_tokens}")
    t = k_new.shape[0]
    if t == 0:
        return k_pages, v_pages
    t_pad = -(-t // block_tokens) * block_tokens
    slots = jnp.pad(slot_mapping.astype(jnp.int32), (0, t_pad - t), constant_values=-1)
    k_new = jnp.pad(k_new, ((0, t_pad - t), (0, 0), (0, 0)))
    v_new = jnp.pad(v_new, ((0, t_pad - t), (0, 0), (0, 0)))
    num_slots = num_pages * page_size
    flat = (kvh, num_slots, hd)
    new_spec = pl.BlockSpec((block_tokens, None, hd), lambda i, h: (i, h, 0))
    pool_spec = pl.BlockSpec((None, num_slots, hd), lambda i, h: (h, 0, 0))
    k_out, v_out = pl.pallas_call(
        functools.partial(_write_kv_kernel, num_slots=num_slots),
        grid=(t_pad // block_tokens, kvh),
        in_specs=[pl.BlockSpec((block_tokens,), lambda i, h: (i,)), new_spec, new_spec, pool_spec, pool_spec],
        out_specs=[pool_spec, pool_spec],
        out_shape=[jax.ShapeDtypeStruct(flat, k_pages.dtype), jax.ShapeDtypeStruct(flat, v_pages.dtype)],
        input_output_aliases={3: 0, 4: 1},
        compiler_params=triton_compiler_params(num_warps=4, num_stages=1),
        interpret=interpret,
        name="write_kv_gpu",
    )(slots, k_new, v_new, k_pages.reshape(flat), v_pages.reshape(flat))
    return k_out.reshape(k_pages.shape), v_out.reshape(v_pages.shape)


__all__ = ["GPUBlockSizes", "ragged_paged_attention", "write_kv"]
