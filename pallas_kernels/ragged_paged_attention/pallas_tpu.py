"""Ragged paged attention as a Pallas Mosaic TPU kernel.

Same semantics and argument order as ``reference.ragged_paged_attention`` (the oracle); this
module only changes how the work is done:

* Outside the kernel (plain XLA) the packed queries are gathered into per-sequence blocks
  ``[S, KVH, Q_pad * G, hd]``: row ``r`` of a block is query token ``r // G`` of the sequence and
  query head ``r % G`` of the KV head's group (``G = H // KVH``), so a KV head's whole query-head
  group shares one pass over the pages (GQA).
* Grid ``(sequence, kv_head, q_block)``. The metadata ``kv_lens``, ``page_indices`` (flattened),
  ``cu_q_lens`` and ``num_seqs`` are scalar-prefetched into SMEM
  (``pltpu.PrefetchScalarGridSpec``), so they are data, not compile-time constants.
* ``k_pages`` / ``v_pages`` stay in HBM (``pl.ANY``). The kernel walks only the KV blocks of
  ``pages_per_kv_block`` pages that the q block can see (past ``kv_lens``, beyond the causal
  limit and outside the sliding window are skipped, a dynamic ``fori_loop`` range) and copies
  them page by page into a double-buffered VMEM scratch with ``pltpu.make_async_copy`` and DMA
  semaphores: the copy of block ``i + 1`` starts before block ``i`` is computed. Pages of a block
  that hold no visible token are not copied at all.
* Online softmax (flash attention, Dao et al. 2022, Alg. 1) with running max / sum / output
  accumulator in float32 VMEM scratch; scores and ``p @ v`` accumulate in float32 for bf16 inputs.
* The kernel output is scattered back to packed rows outside the kernel; rows of dead sequences
  and padding rows are zero.

The attention kernel body (one grid program) lives in ``pallas_tpu_kernel``; this module builds
its grid, block specs and scratch, and does the gather / scatter around it.

``write_kv`` (same semantics as ``reference.write_kv``) updates the pool in place from a Pallas
kernel: pools aliased input -> output in HBM, one DMA per token row and KV head.

The kernel bodies index their DMA buffers with slices only (no ref reshapes/bitcasts, which the
TPU interpreter rejects). On CPU run it with ``interpret=True`` (the TPU interpreter with race
detection and NaN-poisoned uninitialised memory).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from pallas_kernels.compat import pl, pltpu, tpu_compiler_params, tpu_interpret_params
from pallas_kernels.ragged_paged_attention.pallas_tpu_kernel import KernelStatics, attention_kernel
from pallas_kernels.ragged_paged_attention.reference import RaggedAttentionInputError, _check_shapes

_WHERE = "pallas_kernels/ragged_paged_attention/pallas_tpu.py"
_LANES = 128  # m / l scratch rows are replicated over one lane tile


@dataclasses.dataclass(frozen=True)
class TPUBlockSizes:
    """Static tiling of the TPU kernel (hashable: used as a static argument).

    Attributes:
      pages_per_kv_block: pages copied HBM -> VMEM per KV block (two blocks are in flight:
        double buffering). A KV block holds ``pages_per_kv_block * page_size`` tokens.
      q_tokens_per_block: query tokens per q block (grid axis 2); ``None`` = one block of
        ``max_q_len`` tokens. Rounded up so that ``tokens * G`` is a multiple of the sublane
        tile (8 rows for f32, 16 for bf16). Smaller q blocks skip more KV blocks past the
        causal limit during prefill.
    """

    pages_per_kv_block: int = 8
    q_tokens_per_block: int | None = None

    def __post_init__(self):
        if not isinstance(self.pages_per_kv_block, int) or self.pages_per_kv_block < 1:
            raise RaggedAttentionInputError(
                f"{_WHERE}: TPUBlockSizes.pages_per_kv_block must be an int >= 1, "
                f"got {self.pages_per_kv_block!r}")
        if self.q_tokens_per_block is not None and (
                not isinstance(self.q_tokens_per_block, int) or self.q_tokens_per_block < 1):
            raise RaggedAttentionInputError(
                f"{_WHERE}: TPUBlockSizes.q_tokens_per_block must be None or an int >= 1, "
                f"got {self.q_tokens_per_block!r}")


def _q_block_tokens(max_q_len: int, group: int, requested: int | None, sublanes: int) -> int:
    """Query tokens per q block: ``requested`` (or ``max_q_len``), capped at ``max_q_len`` and
    rounded up so that ``tokens * group`` fills whole sublane tiles."""
    tokens = min(requested or max_q_len, max_q_len)
    step = sublanes // np.gcd(sublanes, group)
    return -(-tokens // step) * step


def _interpret_params(interpret: bool | Any) -> Any:
    if interpret is True:
        return tpu_interpret_params(detect_races=True, uninitialized_memory="nan")
    return interpret or None


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
    block_sizes: TPUBlockSizes | None = None,
    interpret: bool | Any = False,
) -> Float[Array, "T H hd"]:
    """Attention of packed ragged queries over a paged KV cache (one layer), Pallas TPU kernel.

    Semantics are exactly those of ``reference.ragged_paged_attention`` (see its docstring);
    jit-able with ``sm_scale, max_q_len, soft_cap, sliding_window, block_sizes, interpret``
    static.

    Args:
      q: ``[T_total, H, hd]`` queries of the new tokens (f32 or bf16).
      k_pages, v_pages: ``[KVH, num_pages, page_size, hd]`` KV pool of this layer (left in HBM,
        copied page by page).
      kv_lens: ``i32[S]`` cached tokens per sequence including the new ones.
      page_indices: ``i32[S, pages_per_seq]`` page table (entries past a sequence's length are
        never read).
      cu_q_lens: ``i32[S+1]`` cumulative query lengths (``cu_q_lens[0] == 0``).
      num_seqs: ``i32[1]`` number of live sequences; the rest produce zeros.
      sm_scale: score scale (usually ``head_dim ** -0.5``).
      max_q_len: static upper bound on every ``q_len``.
      soft_cap: if set, scores become ``soft_cap * tanh(scores / soft_cap)`` (after scaling).
      sliding_window: if set, a query only sees keys with ``q_pos - k_pos < sliding_window``.
      block_sizes: kernel tiling (default ``TPUBlockSizes()``).
      interpret: ``False`` compiles for a TPU; ``True`` runs the TPU interpreter (any backend)
        with ``detect_races=True, uninitialized_memory="nan"``; a ``pltpu.InterpretParams`` is
        passed through.

    Returns:
      ``[T_total, H, hd]`` in ``q.dtype``; rows not owned by a live sequence are zero.

    Raises:
      RaggedAttentionInputError: inconsistent shapes, or a bad ``soft_cap`` / ``sliding_window``
        / ``block_sizes``.
    """
    _check_shapes(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, max_q_len)
    block_sizes = _checked_options(soft_cap, sliding_window, block_sizes)

    num_heads = q.shape[1]
    num_kv_heads, num_pages, page_size, _ = k_pages.shape
    pages_per_seq = page_indices.shape[1]
    group = num_heads // num_kv_heads
    sublanes = 8 * max(1, 4 // jnp.dtype(q.dtype).itemsize)  # rows per (8, 128) tile: f32 8, bf16 16
    q_block = _q_block_tokens(max_q_len, group, block_sizes.q_tokens_per_block, sublanes)
    q_pad = -(-max_q_len // q_block) * q_block
    cfg = KernelStatics(
        sm_scale=float(sm_scale), soft_cap=None if soft_cap is None else float(soft_cap),
        sliding_window=None if sliding_window is None else int(sliding_window), group=group,
        page_size=page_size, pages_per_block=min(block_sizes.pages_per_kv_block, pages_per_seq),
        pages_per_seq=pages_per_seq, num_pages=num_pages, q_block=q_block)

    kv_lens = kv_lens.astype(jnp.int32)
    cu_q_lens = cu_q_lens.astype(jnp.int32)
    num_seqs = num_seqs.astype(jnp.int32)
    qi = jnp.arange(q_pad, dtype=jnp.int32)  # query token within its sequence
    q_seq = _gather_q_blocks(q, cu_q_lens, qi, num_kv_heads)
    out = _attention_call(q_seq, k_pages, v_pages, (kv_lens, page_indices, cu_q_lens, num_seqs), cfg, interpret)
    return _scatter_to_packed(out, q, cu_q_lens, num_seqs, qi, max_q_len)


def _checked_options(soft_cap: float | None, sliding_window: int | None,
                     block_sizes: TPUBlockSizes | None) -> TPUBlockSizes:
    """``block_sizes`` or the default, after checking the options of ``ragged_paged_attention``.

    Raises:
      RaggedAttentionInputError: ``soft_cap <= 0``, ``sliding_window < 1``, or ``block_sizes``
        not a ``TPUBlockSizes``.
    """
    if soft_cap is not None and not soft_cap > 0:
        raise RaggedAttentionInputError(f"{_WHERE}: soft_cap must be > 0 or None, got {soft_cap}")
    if sliding_window is not None and sliding_window < 1:
        raise RaggedAttentionInputError(f"{_WHERE}: sliding_window must be >= 1 or None, got {sliding_window}")
    block_sizes = block_sizes or TPUBlockSizes()
    if not isinstance(block_sizes, TPUBlockSizes):
        raise RaggedAttentionInputError(f"{_WHERE}: block_sizes must be a TPUBlockSizes, got {block_sizes!r}")
    return block_sizes


def _gather_q_blocks(q: Float[Array, "T H hd"], cu_q_lens: Int[Array, "S+1"], qi: Int[Array, "Q_pad"],
                     num_kv_heads: int) -> Float[Array, "S KVH Q_pad*G hd"]:
    """Packed queries -> per-sequence blocks ``[S, KVH, Q_pad * G, hd]`` (row = token * G + head
    in group). Rows past a sequence's ``q_len`` hold some other token's query (clipped index)."""
    t_total, num_heads, head_dim = q.shape
    num_s, q_pad, group = cu_q_lens.shape[0] - 1, qi.shape[0], num_heads // num_kv_heads
    src = cu_q_lens[:-1, None] + qi[None, :]
    q_seq = q[jnp.clip(src, 0, t_total - 1)].reshape(num_s, q_pad, num_kv_heads, group, head_dim)
    return q_seq.transpose(0, 2, 1, 3, 4).reshape(num_s, num_kv_heads, q_pad * group, head_dim)


def _attention_call(q_seq, k_pages, v_pages, metadata, cfg: KernelStatics, interpret: bool | Any):
    """``pl.pallas_call`` of ``attention_kernel`` over the grid ``(sequence, kv_head, q_block)``.

    Args:
      q_seq: ``[S, KVH, Q_pad * G, hd]`` from ``_gather_q_blocks``.
      k_pages, v_pages: ``[KVH, P, ps, hd]`` pools (left in HBM).
      metadata: ``(kv_lens i32[S], page_indices i32[S, pps], cu_q_lens i32[S+1], num_seqs i32[1])``,
        scalar-prefetched into SMEM (the page table flattened).
      cfg: static kernel parameters.
      interpret: as in ``ragged_paged_attention``.

    Returns:
      ``[S, KVH, Q_pad * G, hd]`` in ``q_seq.dtype``; blocks of dead sequences / q blocks are zero.
    """
    kv_lens, page_indices, cu_q_lens, num_seqs = metadata
    num_s, num_kv_heads, q_rows, head_dim = q_seq.shape
    rows = cfg.q_block * cfg.group
    block = pl.BlockSpec((None, None, rows, head_dim), lambda s, h, b, *_: (s, h, b, 0))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=4,
        grid=(num_s, num_kv_heads, q_rows // rows),
        in_specs=[block, pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=block,
        scratch_shapes=[
            pltpu.VMEM((2, cfg.block_kv, head_dim), k_pages.dtype),
            pltpu.VMEM((2, cfg.block_kv, head_dim), v_pages.dtype),
            pltpu.SemaphoreType.DMA((2, 2)),  # [k/v, buffer slot]
            pltpu.VMEM((rows, _LANES), jnp.float32),  # running max
            pltpu.VMEM((rows, _LANES), jnp.float32),  # running sum
            pltpu.VMEM((rows, head_dim), jnp.float32),  # output accumulator
        ])
    params = _interpret_params(interpret)
    return pl.pallas_call(
        functools.partial(attention_kernel, cfg=cfg),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(q_seq.shape, q_seq.dtype),
        compiler_params=None if params is not None else tpu_compiler_params(
            dimension_semantics=("parallel", "parallel", "parallel")),
        interpret=params if params is not None else False,
        name="ragged_paged_attention_tpu",
    )(kv_lens, page_indices.reshape(-1).astype(jnp.int32), cu_q_lens, num_seqs, q_seq, k_pages, v_pages)


def _scatter_to_packed(out, q: Float[Array, "T H hd"], cu_q_lens: Int[Array, "S+1"], num_seqs: Int[Array, "1"],
                       qi: Int[Array, "Q_pad"], max_q_len: int) -> Float[Array, "T H hd"]:
    """Kernel output ``[S, KVH, Q_pad * G, hd]`` -> packed rows ``[T, H, hd]`` like ``q``; dead
    sequences, padding and tokens past ``max_q_len`` are dropped, so unowned rows are zero."""
    t_total, num_heads, head_dim = q.shape
    num_s, num_kv_heads, q_pad = out.shape[0], out.shape[1], qi.shape[0]
    out = out.reshape(num_s, num_kv_heads, q_pad, num_heads // num_kv_heads, head_dim).transpose(0, 2, 1, 3, 4)
    out = out[:, :max_q_len].reshape(num_s, max_q_len, num_heads, head_dim)
    q_lens = jnp.where(jnp.arange(num_s) < num_seqs[0], cu_q_lens[1:] - cu_q_lens[:-1], 0)
    qi = qi[:max_q_len]
    dest = jnp.where(qi[None, :] < q_lens[:, None], cu_q_lens[:-1, None] + qi[None, :], t_total)
    packed = jnp.zeros_like(q)
    return packed.at[dest.reshape(-1)].set(out.reshape(-1, num_heads, head_dim), mode="drop")


def _write_kv_kernel(slots_ref, keep_ref,  # scalar prefetch (SMEM): flat slot, keep flag per token
                     k_new_ref, v_new_ref,  # [KVH, tokens_per_block, hd] (VMEM)
                     k_in, v_in,  # pools (HBM), aliased to the outputs
                     k_out, v_out,  # [KVH, P, ps, hd] (HBM)
                     sems, *, page_size, tokens_per_block, num_kv_heads):
    del k_in, v_in  # same buffers as k_out / v_out (input_output_aliases)
    first = pl.program_id(0) * tokens_per_block

    def copies(t):
        slot = slots_ref[first + t]
        page, offset = slot // page_size, slot % page_size
        out = []
        for h in range(num_kv_heads):
            row = pl.ds(t, 1)
            dst = pl.ds(offset, 1)
            out.append(pltpu.make_async_copy(k_new_ref.at[h, row], k_out.at[h, page, dst], sems.at[0]))
            out.append(pltpu.make_async_copy(v_new_ref.at[h, row], v_out.at[h, page, dst], sems.at[1]))
        return keep_ref[first + t] != 0, out

    def start(t, carry):
        keep, cps = copies(t)

        @pl.when(keep)
        def _():
            for cp in cps:
                cp.start()
        return carry

    def wait(t, carry):
        keep, cps = copies(t)

        @pl.when(keep)
        def _():
            for cp in cps:
                cp.wait()
        return carry

    jax.lax.fori_loop(0, tokens_per_block, start, 0)  # all rows of the block in flight at once
    jax.lax.fori_loop(0, tokens_per_block, wait, 0)


def write_kv(
    k_pages: Float[Array, "KVH P ps hd"],
    v_pages: Float[Array, "KVH P ps hd"],
    k_new: Float[Array, "T KVH hd"],
    v_new: Float[Array, "T KVH hd"],
    slot_mapping: Int[Array, "T"],
    *,
    tokens_per_block: int = 16,
    interpret: bool | Any = False,
) -> tuple[Float[Array, "KVH P ps hd"], Float[Array, "KVH P ps hd"]]:
    """Write new keys/values into their flat slots of one layer's KV pool (Pallas TPU kernel).

    Same semantics as ``reference.write_kv``. The pools stay in HBM and are aliased to the
    outputs (``input_output_aliases``), so under ``jax.jit`` with the pools donated the update is
    in place; each token's ``[1, hd]`` row per KV head is one DMA from VMEM. Tokens whose slot is
    written again by a later token (padding tokens colliding in the scratch page 0) are skipped,
    so the last writer wins and no two DMAs of a block target the same slot. Slots outside
    ``[-P * ps, P * ps)`` are dropped; negative slots count from the end, as in ``jnp`` indexing.

    Args:
      k_pages, v_pages: ``[KVH, num_pages, page_size, hd]`` pool.
      k_new, v_new: ``[T, KVH, hd]`` new keys/values (cast to the pool dtype).
      slot_mapping: ``i32[T]`` flat slot ``page * page_size + offset`` per token.
      tokens_per_block: tokens per grid step (their DMAs are in flight together); a multiple of
        8 keeps the VMEM block tile-aligned.
      interpret: as in ``ragged_paged_attention``.

    Returns:
      The updated ``(k_pages, v_pages)``.

    Raises:
      RaggedAttentionInputError: shapes disagree, or ``tokens_per_block < 1``.
    """
    _check_write_kv_shapes(k_pages, v_pages, k_new, v_new, slot_mapping, tokens_per_block)
    kvh, num_pages, page_size, hd = k_pages.shape
    num_tokens = k_new.shape[0]
    if num_tokens == 0:
        return k_pages, v_pages

    slots, keep = _last_writer_slots(slot_mapping, num_pages * page_size)
    num_blocks = -(-num_tokens // tokens_per_block)
    pad = num_blocks * tokens_per_block - num_tokens
    slots, keep = jnp.pad(slots, (0, pad)), jnp.pad(keep, (0, pad))  # padding tokens: keep = 0
    k_rows = jnp.pad(k_new.astype(k_pages.dtype).transpose(1, 0, 2), ((0, 0), (0, pad), (0, 0)))
    v_rows = jnp.pad(v_new.astype(v_pages.dtype).transpose(1, 0, 2), ((0, 0), (0, pad), (0, 0)))

    kernel = functools.partial(_write_kv_kernel, page_size=page_size, tokens_per_block=tokens_per_block,
                               num_kv_heads=kvh)
    rows = pl.BlockSpec((kvh, tokens_per_block, hd), lambda b, *_: (0, b, 0))
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2, grid=(num_blocks,), in_specs=[rows, rows, hbm, hbm], out_specs=[hbm, hbm],
        scratch_shapes=[pltpu.SemaphoreType.DMA((2,))])
    params = _interpret_params(interpret)
    k_out, v_out = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=(jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
                   jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype)),
        input_output_aliases={4: 0, 5: 1},  # operand index counts the 2 scalar-prefetch arrays
        compiler_params=None if params is not None else tpu_compiler_params(
            dimension_semantics=("arbitrary",)),
        interpret=params if params is not None else False,
        name="write_kv_tpu",
    )(slots, keep, k_rows, v_rows, k_pages, v_pages)
    return k_out, v_out


def _check_write_kv_shapes(k_pages, v_pages, k_new, v_new, slot_mapping, tokens_per_block) -> None:
    """Raise ``RaggedAttentionInputError`` unless the ``write_kv`` arguments agree: pools of one
    shape and dtype ``[KVH, P, ps, hd]``, ``k_new`` / ``v_new`` ``[T, KVH, hd]``,
    ``slot_mapping`` ``[T]`` and an int ``tokens_per_block >= 1``."""
    kvh, _, _, hd = k_pages.shape
    if k_pages.shape != v_pages.shape or k_pages.dtype != v_pages.dtype:
        raise RaggedAttentionInputError(
            f"{_WHERE}: write_kv k_pages/v_pages must match, got {k_pages.shape} {k_pages.dtype} and "
            f"{v_pages.shape} {v_pages.dtype}")
    if k_new.shape != v_new.shape or k_new.ndim != 3 or k_new.shape[1:] != (kvh, hd):
        raise RaggedAttentionInputError(
            f"{_WHERE}: write_kv k_new/v_new must be [T, {kvh}, {hd}], got {k_new.shape} and {v_new.shape}")
    num_tokens = k_new.shape[0]
    if slot_mapping.shape != (num_tokens,):
        raise RaggedAttentionInputError(
            f"{_WHERE}: write_kv slot_mapping must be [T]={num_tokens}, got {slot_mapping.shape}")
    if not isinstance(tokens_per_block, int) or tokens_per_block < 1:
        raise RaggedAttentionInputError(f"{_WHERE}: write_kv tokens_per_block must be an int >= 1, "
                                        f"got {tokens_per_block!r}")


def _last_writer_slots(slot_mapping: Int[Array, "T"], num_slots: int) -> tuple[Int[Array, "T"], Int[Array, "T"]]:
    """``(slots, keep)``: slots in ``[0, num_slots)`` (negative ones counted from the end) and
    ``keep = 1`` for the last token writing each valid slot; tokens with a slot outside
    ``[-num_slots, num_slots)`` get slot 0 and ``keep = 0``. Both ``i32[T]``."""
    slots = slot_mapping.astype(jnp.int32)
    valid = (slots >= -num_slots) & (slots < num_slots)
    slots = jnp.where(valid, jnp.where(slots < 0, slots + num_slots, slots), 0)
    # Last writer wins: a stable sort groups equal slots in token order; keep the last of each run.
    key = jnp.where(valid, slots, -1)
    order = jnp.argsort(key, stable=True)
    sorted_key = key[order]
    last_of_run = jnp.concatenate([sorted_key[1:] != sorted_key[:-1], jnp.array([True])])
    keep = jnp.zeros(slots.shape[0], jnp.int32).at[order].set(last_of_run.astype(jnp.int32)) * valid
    return slots, keep


__all__ = ["TPUBlockSizes", "ragged_paged_attention", "write_kv"]
