"""Host-side construction of the packed, bucketed inputs of one engine step (numpy only).

Shapes are bucketed so the jitted step compiles a bounded number of times:

* prefill: ``T`` (packed tokens) is a power of two ``>= 16``; ``S = min(max_slots, T)``
  sequence rows; ``max_q_len`` is the longest new context rounded up to a power of two
  (``prefill_q_len``); full page-table rows. A sequence may start after a shared prompt prefix.
* decode / verify: the live slots are compacted into ``S`` sequence rows (``seq_buckets``:
  ``max_slots / 16``, ``/ 4``, ``max_slots``); each feeds its pending token plus its draft (``K``
  in ``K_BUCKETS``; decode is ``K = 0``); ``T = max(S, min(budget, S * (K + 1)))``; page-table
  width is a power of two ``>= 8`` capped at ``pages_per_seq``.
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


def prefill_q_len(longest: int, t_b: int, q_cap: int) -> int:
    """Static ``max_q_len`` of a prefill bucket: the longest context rounded up to a power of
    two ``>= 16``, at most ``t_b`` and ``q_cap`` (attention work scales with it)."""
    return min(t_b, q_cap, max(MIN_PREFILL_BUCKET, pow2(longest)))


def prefill_shapes(buckets, q_cap: int) -> list[tuple[int, int]]:
    """Every ``(T, max_q_len)`` pair a prefill step can use (for warm-up)."""
    out = []
    for t_b in buckets:
        q = MIN_PREFILL_BUCKET
        while True:
            out.append((t_b, min(q, t_b, q_cap)))
            if q >= min(t_b, q_cap):
                break
            q *= 2
    return sorted(set(out))


def prefill_inputs(batch: list[tuple[int, np.ndarray, int]], page_table: np.ndarray, page_size: int,
                   max_slots: int, q_cap: int) -> StepInputs:
    """Pack ``[(slot, new tokens i32[L], start)]`` into one prefill step.

    Sequence ``slot`` already holds ``start`` tokens in its pages (a prompt prefix shared with
    another sample of the same prompt, 0 otherwise); its new tokens sit at positions
    ``start ... start + L - 1`` and their pages must be allocated in ``page_table[slot]``
    (``np.int32[max_slots, pages_per_seq]``). Logits rows are each sequence's last token;
    padding tokens write scratch page 0.
    """
    lens = np.array([len(c) for _, c, _ in batch], np.int64)
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
    for i, (slot, ctx, start) in enumerate(batch):
        n = len(ctx)
        p = start + np.arange(n)
        tokens[off: off + n] = ctx
        positions[off: off + n] = p
        slot_mapping[off: off + n] = page_table[slot, p // page_size] * page_size + p % page_size
        kv_lens[i] = start + n
        pages[i] = page_table[slot]
        off += n
    rows = np.zeros(s_b, np.int32)
    rows[: len(batch)] = cu[1: len(batch) + 1] - 1
    meta = RaggedMeta(kv_lens=kv_lens, page_indices=pages, cu_q_lens=cu,
                      num_seqs=np.array([len(batch)], np.int32), slot_mapping=slot_mapping)
    return StepInputs(tokens, positions, meta, rows, prefill_q_len(int(lens.max()), t_b, q_cap))


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


def seq_buckets(max_slots: int) -> tuple[int, ...]:
    """Sequence-row buckets of decode/verify steps: ``max_slots / 16``, ``/ 4`` and
    ``max_slots`` (at least 1 each), so tail steps with few live sequences run small programs."""
    return tuple(sorted({max(1, max_slots // 16), max(1, max_slots // 4), max_slots}))


def seq_bucket(num_active: int, max_slots: int) -> int:
    """Smallest of ``seq_buckets(max_slots)`` holding ``num_active`` sequences."""
    return next(b for b in seq_buckets(max_slots) if b >= num_active)


def verify_tokens(num_seqs: int, k: int, budget: int, used: int | None = None) -> int:
    """Packed token count ``T`` of a verify step with ``num_seqs`` sequence rows and draft bucket
    ``k``. The cap is every row's ``1 + k`` tokens, limited by the per-step token budget (at least
    one per row); with ``used`` (the tokens actually packed: live rows + their drafts) ``T`` is
    the smallest of ``verify_token_buckets`` holding them, so a step whose rows are mostly
    finished or draft little does not pay for the cap (the layers' work scales with ``T``).

    Raises:
      ValueError: ``used`` exceeds the cap.
    """
    buckets = verify_token_buckets(num_seqs, k, budget)
    if used is None:
        return buckets[-1]
    for t in buckets:
        if t >= used:
            return t
    raise ValueError(f"verify step packs {used} tokens, more than the cap {buckets[-1]}")


def verify_token_buckets(num_seqs: int, k: int, budget: int) -> tuple[int, ...]:
    """Packed-token buckets of a verify step: the cap ``verify_tokens(num_seqs, k, budget)`` and
    its halves and quarters (at least ``num_seqs``), ascending; one bucket (the cap) for plain
    decode (``k == 0``)."""
    cap = max(num_seqs, min(budget, num_seqs * (k + 1)))
    return tuple(sorted({cap, max(num_seqs, -(-cap // 2)), max(num_seqs, -(-cap // 4))}))


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
    """``StepInputs`` of a verify step plus ``draft_tokens i32[S, K]``, ``draft_lens i32[S]`` and
    ``slots i32[n]`` (the engine slot of each of the first ``n`` sequence rows)."""

    draft_tokens: np.ndarray = None
    draft_lens: np.ndarray = None
    slots: np.ndarray = None


def verify_inputs(slots: np.ndarray, slot_len: np.ndarray, slot_last: np.ndarray, drafts: np.ndarray,
                  draft_lens: np.ndarray, page_table: np.ndarray, num_held: np.ndarray, page_size: int,
                  num_rows: int, t_total: int) -> VerifyInputs:
    """One decode/verify step over the live slots ``slots`` (decode: ``drafts`` has ``K = 0``
    columns), compacted into ``num_rows`` sequence rows.

    Row ``i < len(slots)`` is slot ``slots[i]``: it feeds ``slot_last[slot]`` then
    ``drafts[i, :draft_lens[i]]`` at positions ``slot_len[slot] ...`` (their pages must be
    allocated). Rows past ``len(slots)`` are padding sequences (``num_seqs`` excludes them, q_len
    0); packed tokens past the live ones are padding writing scratch page 0.

    Args:
      slots: ``int[n]`` live slot ids; slot_len: ``int[max_slots]`` tokens already in the KV pool;
        slot_last: ``int[max_slots]`` pending token; drafts: ``int[n, K]``; draft_lens: ``int[n]``;
        page_table/num_held: the allocator's arrays; num_rows: sequence-row bucket (>= n);
        t_total: packed token bucket.

    Raises:
      ValueError: the tokens do not fit in ``t_total`` or the slots in ``num_rows``.
    """
    n = len(slots)
    _, pages_per_seq = page_table.shape
    k = drafts.shape[1]
    if n > num_rows:
        raise ValueError(f"verify step has {n} live sequences, more than the row bucket {num_rows}")
    lens = np.zeros(num_rows, np.int64)
    lens[:n] = draft_lens
    q_lens = np.zeros(num_rows, np.int64)
    q_lens[:n] = 1 + lens[:n]
    cu = np.zeros(num_rows + 1, np.int64)
    cu[1:] = np.cumsum(q_lens)
    used = int(cu[-1])
    if used > t_total:
        raise ValueError(f"verify step needs {used} packed tokens, more than the bucket {t_total}")
    base = np.asarray(slot_len)[slots].astype(np.int64)
    owner = np.repeat(np.arange(n), q_lens[:n])  # row of each packed token
    j = np.arange(used) - cu[owner]
    pos = base[owner] + j
    fed = np.concatenate([np.asarray(slot_last)[slots, None], drafts], axis=1)  # [n, K+1]
    tokens = np.zeros(t_total, np.int32)
    positions = np.zeros(t_total, np.int32)
    slot_mapping = np.zeros(t_total, np.int32)
    tokens[:used] = fed[owner, j]
    positions[:used] = pos
    table = page_table[slots]
    slot_mapping[:used] = table[owner, np.minimum(pos // page_size, pages_per_seq - 1)] * page_size + pos % page_size
    width = decode_width(int(num_held[slots].max()) if n else 1, pages_per_seq)
    kv_lens = np.zeros(num_rows, np.int32)
    kv_lens[:n] = base + q_lens[:n]
    pages = np.zeros((num_rows, width), np.int32)
    pages[:n] = table[:, :width]
    jj = np.arange(k + 1)
    rows = (cu[:-1, None] + np.minimum(jj[None, :], np.maximum(q_lens, 1)[:, None] - 1)).reshape(-1)
    d = np.zeros((num_rows, k), np.int32)
    d[:n] = np.where(jj[None, :k] < lens[:n, None], drafts, 0)
    meta = RaggedMeta(kv_lens=kv_lens, page_indices=pages, cu_q_lens=cu.astype(np.int32),
                      num_seqs=np.array([n], np.int32), slot_mapping=slot_mapping)
    return VerifyInputs(tokens, positions, meta, np.minimum(rows, max(t_total - 1, 0)).astype(np.int32), k + 1,
                        draft_tokens=d, draft_lens=lens.astype(np.int32), slots=np.asarray(slots, np.int64))


def dummy_prefill(t_b: int, q_len: int, max_slots: int, pages_per_seq: int) -> StepInputs:
    """Prefill inputs of bucket ``(t_b, q_len)`` with no live sequence (warm-up; page 0 only)."""
    s_b = min(max_slots, t_b)
    z = np.zeros(t_b, np.int32)
    meta = RaggedMeta(kv_lens=np.zeros(s_b, np.int32), page_indices=np.zeros((s_b, pages_per_seq), np.int32),
                      cu_q_lens=np.zeros(s_b + 1, np.int32), num_seqs=np.zeros(1, np.int32), slot_mapping=z)
    return StepInputs(z, z, meta, np.zeros(s_b, np.int32), q_len)


def dummy_verify(num_rows: int, width: int, k: int, t_total: int, pages_per_seq: int) -> VerifyInputs:
    """Verify inputs with no live sequence, ``num_rows`` sequence rows, draft bucket ``k`` and
    page-table width ``width`` (warm-up; touches scratch page 0 only)."""
    table = np.zeros((1, pages_per_seq), np.int32)
    held = np.full(1, width, np.int64)
    inp = verify_inputs(np.zeros(0, np.int64), np.zeros(1, np.int64), np.zeros(1, np.int32),
                        np.zeros((0, k), np.int32), np.zeros(0, np.int64), table, held, 1, num_rows, t_total)
    pages = np.zeros((num_rows, width), np.int32)  # the width a step holding `width` pages uses
    inp.meta = RaggedMeta(inp.meta.kv_lens, pages, inp.meta.cu_q_lens, inp.meta.num_seqs, inp.meta.slot_mapping)
    return inp
