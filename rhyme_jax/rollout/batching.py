"""Host-side construction of the packed, bucketed inputs of one engine step (numpy only).

Shapes are bucketed so the jitted step compiles a bounded number of times:

* prefill: ``T`` (packed tokens) is a power of two ``>= 16``; ``S = min(max_slots, T)``
  sequence rows; ``max_q_len = min(T, q_cap)``; full page-table rows.
* decode / verify: every slot feeds its pending token plus its draft (``K`` in ``K_BUCKETS``;
  decode is ``K = 0``); ``T = max(max_slots, min(budget, max_slots * (K + 1)))``; inactive
  slots write/read scratch page 0; page-table width is a power of two ``>= 8`` capped at
  ``pages_per_seq``.
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


K_BUCKETS = (0, 2, 4, 8, 16, 32)


def draft_bucket(max_len: int) -> int:
    """Smallest draft bucket ``K`` in ``K_BUCKETS`` holding ``max_len`` draft tokens.

    Raises:
      ValueError: ``max_len`` exceeds the largest bucket (32).
    """
    for k in K_BUCKETS:
        if max_len <= k:
            return k
    raise ValueError(f"draft length {max_len} exceeds the largest draft bucket {K_BUCKETS[-1]}")


def verify_tokens(max_slots: int, k: int, budget: int) -> int:
    """Packed token count ``T`` of a verify step with draft bucket ``k``: every slot's
    ``1 + k`` rows, capped by the per-step token budget (at least one row per slot)."""
    return max(max_slots, min(budget, max_slots * (k + 1)))


def trim_drafts(draft_lens: np.ndarray, budget: int) -> np.ndarray:
    """Cut the longest drafts first until ``sum(1 + draft_lens) <= budget`` (water-filling).

    Args:
      draft_lens: ``int[B]`` requested draft lengths of the B active slots.
      budget: packed tokens available to those slots (``>= B``).

    Returns:
      ``int32[B]`` lengths ``min(draft_lens, c)`` for the largest cap ``c`` that fits.
    """
    lens = np.asarray(draft_lens, np.int64)
    room = int(budget) - len(lens)
    if lens.sum() <= room:
        return lens.astype(np.int32)
    cap = int(lens.max())
    while cap > 0 and np.minimum(lens, cap).sum() > room:
        cap -= 1
    return np.minimum(lens, cap).astype(np.int32)


def decode_width(max_pages_held: int, pages_per_seq: int) -> int:
    """Page-table columns a decode/verify step passes (the reference attention gathers all)."""
    return min(pages_per_seq, max(MIN_DECODE_WIDTH, pow2(max_pages_held)))


@dataclass
class VerifyInputs(StepInputs):
    """``StepInputs`` of a verify step plus ``draft_tokens i32[S, K]`` and ``draft_lens i32[S]``."""

    draft_tokens: np.ndarray = None
    draft_lens: np.ndarray = None


def verify_inputs(active: np.ndarray, slot_len: np.ndarray, slot_last: np.ndarray, drafts: np.ndarray,
                  draft_lens: np.ndarray, page_table: np.ndarray, num_held: np.ndarray, page_size: int,
                  t_total: int) -> VerifyInputs:
    """One decode/verify step over all slots (decode: ``drafts`` has ``K = 0`` columns).

    Active slot ``s`` feeds ``slot_last[s]`` then ``drafts[s, :draft_lens[s]]`` at positions
    ``slot_len[s] ...`` (their pages must be allocated); inactive slots feed one token that
    reads and writes scratch page 0. Rows are packed slot after slot; rows past the last slot are
    padding (scratch page 0, attention output zero).

    Args:
      active: ``bool[S]``; slot_len: ``int[S]`` tokens already in the KV pool; slot_last:
        ``int[S]`` pending token; drafts: ``int[S, K]``; draft_lens: ``int[S]`` (0 if inactive);
        page_table/num_held: the allocator's arrays; t_total: packed row count (a bucket).

    Raises:
      ValueError: the slots' tokens do not fit in ``t_total``.
    """
    slots, pages_per_seq = page_table.shape
    k = drafts.shape[1]
    lens = np.where(active, draft_lens, 0).astype(np.int64)
    q_lens = 1 + lens
    cu = np.zeros(slots + 1, np.int64)
    cu[1:] = np.cumsum(q_lens)
    if cu[-1] > t_total:
        raise ValueError(f"verify step needs {cu[-1]} packed tokens, more than the bucket {t_total}")
    base = np.where(active, slot_len, 0).astype(np.int64)
    # Row r of the packed batch belongs to slot owner[r] at offset j (row-major, vectorised).
    owner = np.repeat(np.arange(slots), q_lens)
    j = np.arange(cu[-1]) - cu[owner]
    pos = base[owner] + j
    fed = np.concatenate([slot_last[:, None], drafts], axis=1)  # [S, K+1]
    n = int(cu[-1])
    tokens = np.zeros(t_total, np.int32)
    positions = np.zeros(t_total, np.int32)
    slot_mapping = np.zeros(t_total, np.int32)
    act = active[owner]
    tokens[:n] = np.where(act, fed[owner, j], 0)
    positions[:n] = np.where(act, pos, 0)
    page = page_table[owner, np.minimum(pos // page_size, pages_per_seq - 1)]
    slot_mapping[:n] = np.where(act, page * page_size + pos % page_size, 0)
    width = decode_width(int(num_held.max()), pages_per_seq)
    meta = RaggedMeta(
        kv_lens=np.where(active, slot_len + q_lens, 1).astype(np.int32),
        page_indices=page_table[:, :width].copy(),
        cu_q_lens=cu.astype(np.int32),
        num_seqs=np.array([slots], np.int32),
        slot_mapping=slot_mapping)
    jj = np.arange(k + 1)
    rows = (cu[:-1, None] + np.minimum(jj[None, :], q_lens[:, None] - 1)).reshape(-1).astype(np.int32)
    return VerifyInputs(tokens, positions, meta, rows, k + 1,
                        draft_tokens=np.where(jj[None, :k] < lens[:, None], drafts, 0).astype(np.int32),
                        draft_lens=lens.astype(np.int32))


def dummy_prefill(t_b: int, max_slots: int, pages_per_seq: int, q_cap: int) -> StepInputs:
    """Prefill inputs of bucket ``t_b`` with no live sequence (warm-up; touches page 0 only)."""
    s_b = min(max_slots, t_b)
    z = np.zeros(t_b, np.int32)
    meta = RaggedMeta(kv_lens=np.zeros(s_b, np.int32), page_indices=np.zeros((s_b, pages_per_seq), np.int32),
                      cu_q_lens=np.zeros(s_b + 1, np.int32), num_seqs=np.zeros(1, np.int32), slot_mapping=z)
    return StepInputs(z, z, meta, np.zeros(s_b, np.int32), min(t_b, q_cap))


def dummy_verify(max_slots: int, width: int, k: int, t_total: int) -> VerifyInputs:
    """Verify inputs with every slot inactive, draft bucket ``k`` and page-table width ``width``
    (warm-up; touches scratch page 0 only)."""
    active = np.zeros(max_slots, bool)
    zeros = np.zeros(max_slots, np.int64)
    table = np.zeros((max_slots, width), np.int32)
    return verify_inputs(active, zeros, zeros.astype(np.int32), np.zeros((max_slots, k), np.int32), zeros,
                         table, np.ones(max_slots, np.int64), 1, t_total)
