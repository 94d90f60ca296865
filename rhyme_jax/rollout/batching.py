"""Host-side construction of the packed, bucketed inputs of one engine step (numpy only).

Shapes are bucketed so the jitted step compiles a bounded number of times:

* prefill: ``T`` (packed tokens) is a power of two ``>= 16``; ``S = min(max_slots, T)``
  sequence rows; ``max_q_len = min(T, q_cap)``; full page-table rows.
* decode: ``T = S = max_slots`` (one token per slot, inactive slots write/read scratch page 0);
  page-table width is a power of two ``>= 8`` capped at ``pages_per_seq``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rhyme_jax.rollout.forward import RaggedMeta

MIN_PREFILL_BUCKET = 16
MIN_DECODE_WIDTH = 8


def pow2(n: int) -> int:
    """Smallest power of two ``>= n`` (1 for ``n <= 1``)."""
    return 1 << max(0, int(n) - 1).bit_length()


@dataclass
class StepInputs:
    """Arguments of one jitted step: ``tokens/positions i32[T]``, ``meta``, ``logits_rows i32[S]``,
    and the static ``max_q_len``."""

    tokens: np.ndarray
    positions: np.ndarray
    meta: RaggedMeta
    logits_rows: np.ndarray
    max_q_len: int


def prefill_inputs(batch: list[tuple[int, np.ndarray]], page_table: np.ndarray, page_size: int,
                   max_slots: int, q_cap: int) -> StepInputs:
    """Pack ``[(slot, context tokens i32[L])]`` into one prefill step.

    Every context starts at position 0 and its pages must already be allocated in
    ``page_table[slot]`` (``np.int32[max_slots, pages_per_seq]``). Logits rows are each
    sequence's last token; padding tokens write scratch page 0.
    """
    lens = np.array([len(c) for _, c in batch], np.int64)
    total = int(lens.sum())
    t_b = max(MIN_PREFILL_BUCKET, pow2(total))
    s_b = min(max_slots, t_b)
    tokens = np.zeros(t_b, np.int32)
    positions = np.zeros(t_b, np.int32)
    slot_mapping = np.zeros(t_b, np.int32)
    kv_lens = np.zeros(s_b, np.int32)
    pages = np.zeros((s_b, page_table.shape[1]), np.int32)
    cu = np.full(s_b + 1, total, np.int32)
    cu[0] = 0
    cu[1: len(batch) + 1] = np.cumsum(lens)
    off = 0
    for i, (slot, ctx) in enumerate(batch):
        n = len(ctx)
        p = np.arange(n)
        tokens[off: off + n] = ctx
        positions[off: off + n] = p
        slot_mapping[off: off + n] = page_table[slot, p // page_size] * page_size + p % page_size
        kv_lens[i] = n
        pages[i] = page_table[slot]
        off += n
    rows = np.zeros(s_b, np.int32)
    rows[: len(batch)] = cu[1: len(batch) + 1] - 1
    meta = RaggedMeta(kv_lens=kv_lens, page_indices=pages, cu_q_lens=cu,
                      num_seqs=np.array([len(batch)], np.int32), slot_mapping=slot_mapping)
    return StepInputs(tokens, positions, meta, rows, min(t_b, q_cap))


def decode_width(max_pages_held: int, pages_per_seq: int) -> int:
    """Page-table columns a decode step passes (the reference attention gathers all of them)."""
    return min(pages_per_seq, max(MIN_DECODE_WIDTH, pow2(max_pages_held)))


def decode_inputs(active: np.ndarray, slot_len: np.ndarray, slot_last: np.ndarray,
                  page_table: np.ndarray, num_held: np.ndarray, page_size: int) -> StepInputs:
    """One decode step over all slots: active slot ``s`` feeds ``slot_last[s]`` at position
    ``slot_len[s]`` (its page must be allocated); inactive slots attend to scratch page 0."""
    slots, pages_per_seq = page_table.shape
    pos = np.where(active, slot_len, 0).astype(np.int32)
    page = page_table[np.arange(slots), np.minimum(pos // page_size, pages_per_seq - 1)]
    width = decode_width(int(num_held.max()), pages_per_seq)
    meta = RaggedMeta(
        kv_lens=np.where(active, slot_len + 1, 1).astype(np.int32),
        page_indices=page_table[:, :width].copy(),
        cu_q_lens=np.arange(slots + 1, dtype=np.int32),
        num_seqs=np.array([slots], np.int32),
        slot_mapping=np.where(active, page * page_size + pos % page_size, 0).astype(np.int32))
    tokens = np.where(active, slot_last, 0).astype(np.int32)
    return StepInputs(tokens, pos, meta, np.arange(slots, dtype=np.int32), 1)


def dummy_prefill(t_b: int, max_slots: int, pages_per_seq: int, q_cap: int) -> StepInputs:
    """Prefill inputs of bucket ``t_b`` with no live sequence (warm-up; touches page 0 only)."""
    s_b = min(max_slots, t_b)
    z = np.zeros(t_b, np.int32)
    meta = RaggedMeta(kv_lens=np.zeros(s_b, np.int32), page_indices=np.zeros((s_b, pages_per_seq), np.int32),
                      cu_q_lens=np.zeros(s_b + 1, np.int32), num_seqs=np.zeros(1, np.int32), slot_mapping=z)
    return StepInputs(z, z, meta, np.zeros(s_b, np.int32), min(t_b, q_cap))


def dummy_decode(max_slots: int, width: int) -> StepInputs:
    """Decode inputs with every slot inactive and page-table width ``width`` (warm-up)."""
    z = np.zeros(max_slots, np.int32)
    meta = RaggedMeta(kv_lens=np.ones(max_slots, np.int32), page_indices=np.zeros((max_slots, width), np.int32),
                      cu_q_lens=np.arange(max_slots + 1, dtype=np.int32),
                      num_seqs=np.array([max_slots], np.int32), slot_mapping=z)
    return StepInputs(z, z, meta, np.arange(max_slots, dtype=np.int32), 1)
