"""Host-side construction of the packed, bucketed inputs of one engine step (numpy only).

The buckets (which shapes exist) live in ``rhyme_jax.rollout.shapes``; this module packs one
step into them:

* prefill: ``(T, S, Q)`` from ``ShapePlan.prefill_shape``: every sequence cut into attention rows
  of at most ``Q`` tokens, ``S`` rows; full page-table rows; logits of each sequence's last token.
  A sequence may start after a shared prompt prefix.
* decode / verify: the live slots are compacted into ``S`` sequence rows (``seq_buckets``); each
  feeds its pending token plus its draft, packed back to back into ``T`` tokens
  (``ShapePlan.pass_pair``; decode is one token per row); the page table is cut to a width of
  ``shapes.decode_widths``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rhyme_jax.rollout.forward import RaggedMeta
from rhyme_jax.rollout.shapes import (  # noqa: F401 (re-exported)
    MAX_DRAFT, MIN_DECODE_WIDTH, MIN_PREFILL_BUCKET, pow2, seq_bucket, seq_buckets)


@dataclass
class PassInputs:
    """Arguments of one jitted step: ``tokens/positions i32[T]``, ``meta``, ``logits_rows i32[S]``,
    the static ``max_q_len`` and ``streams i32[T]``, the sequence (request) of each packed token,
    which keys its sampling draw (``sampling.position_noise``; 0 for padding)."""

    tokens: np.ndarray
    positions: np.ndarray
    meta: RaggedMeta
    logits_rows: np.ndarray
    max_q_len: int
    streams: np.ndarray = None

    def __post_init__(self):
        if self.streams is None:
            self.streams = np.zeros(len(self.tokens), np.int32)


def _streams_of(slot_streams: np.ndarray | None, slots: np.ndarray) -> np.ndarray:
    """The stream of each of ``slots``: ``slot_streams[slot]`` (``None``: the slot id)."""
    slots = np.asarray(slots, np.int64)
    return (slots if slot_streams is None else np.asarray(slot_streams)[slots]).astype(np.int32)


def prefill_inputs(batch: list[tuple[int, np.ndarray, int]], page_table: np.ndarray, page_size: int,
                   max_slots: int, t_b: int, num_rows: int, q_len: int,
                   slot_streams: np.ndarray | None = None, width: int = 0) -> PassInputs:
    """Pack ``[(slot, new tokens i32[L], start)]`` into one prefill step, each sequence cut into
    attention rows (chunks) of at most ``q_len`` tokens.

    Sequence ``slot`` already holds ``start`` tokens in its pages (a prompt prefix shared with
    another sample of the same prompt, 0 otherwise); its new tokens sit at positions
    ``start ... start + L - 1`` and their pages must be allocated in ``page_table[slot]``
    (``np.int32[max_slots, pages_per_seq]``). A chunk ending at position ``e`` is an attention
    row with ``kv_len = e + 1`` over the sequence's page-table row: it sees its own earlier chunks,
    written into the pages in the same pass before attention. Logits rows
    (``i32[min(max_slots, t_b)]``) are each sequence's last token, in ``batch`` order; padding
    tokens write scratch page 0. ``(t_b, num_rows, q_len)``: the bucket
    (``ShapePlan.prefill_shape``).

    Raises:
      ValueError: the batch needs more than ``num_rows`` chunks or ``t_b`` tokens.
    """
    lens = np.array([len(c) for _, c, _ in batch], np.int64)
    total = int(lens.sum())
    chunks = -(-lens // q_len)
    width = int(width) or page_table.shape[1]
    ends_at = max((start + len(c) for _, c, start in batch), default=0)
    if ends_at > width * page_size:
        raise ValueError(f"prefill reaches position {ends_at - 1}, past a page-table width of {width} "
                         f"pages of {page_size}")
    if total > t_b or int(chunks.sum()) > num_rows or len(batch) > min(max_slots, t_b):
        raise ValueError(f"prefill of {len(batch)} sequences, {total} tokens in {int(chunks.sum())} chunks "
                         f"does not fit bucket T={t_b}, S={num_rows}, Q={q_len}")
    tokens = np.zeros(t_b, np.int32)
    positions = np.zeros(t_b, np.int32)
    slot_mapping = np.zeros(t_b, np.int32)
    kv_lens = np.zeros(num_rows, np.int32)
    pages = np.zeros((num_rows, width), np.int32)
    cu = np.full(num_rows + 1, total, np.int32)
    cu[0] = 0
    row_seq = np.repeat(np.arange(len(batch)), chunks)  # the sequence of every attention row
    seq_off = np.concatenate([[0], np.cumsum(lens)])
    first = np.concatenate([[0], np.cumsum(chunks)])[:-1]
    ends = np.minimum((np.arange(row_seq.size) - first[row_seq] + 1) * q_len, lens[row_seq])  # chunk ends
    cu[1: row_seq.size + 1] = seq_off[row_seq] + ends
    slots = np.array([b[0] for b in batch], np.int64)
    starts = np.array([b[2] for b in batch], np.int64)
    kv_lens[: row_seq.size] = starts[row_seq] + ends
    pages[: row_seq.size] = page_table[slots[row_seq], :width]
    streams = np.zeros(t_b, np.int32)
    seq_streams = _streams_of(slot_streams, slots)
    for i, (slot, ctx, start) in enumerate(batch):
        p = start + np.arange(len(ctx))
        o = seq_off[i]
        tokens[o: o + len(ctx)] = ctx
        streams[o: o + len(ctx)] = seq_streams[i]
        positions[o: o + len(ctx)] = p
        slot_mapping[o: o + len(ctx)] = page_table[slot, p // page_size] * page_size + p % page_size
    rows = np.zeros(min(max_slots, t_b), np.int32)
    rows[: len(batch)] = seq_off[1:] - 1
    meta = RaggedMeta(kv_lens=kv_lens, page_indices=pages, cu_q_lens=cu,
                      num_seqs=np.array([row_seq.size], np.int32), slot_mapping=slot_mapping)
    return PassInputs(tokens, positions, meta, rows, int(q_len), streams)


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


@dataclass
class VerifyInputs(PassInputs):
    """``PassInputs`` of a decode/verify step plus ``draft_lens i32[S]`` (row ``i`` fed
    ``1 + draft_lens[i]`` tokens at ``cu_q_lens[i]``; ``logits_rows`` is unused: the step returns
    every packed position) and ``slots i32[n]`` (the engine slot of each of the first ``n`` rows)."""

    draft_lens: np.ndarray = None
    slots: np.ndarray = None


def verify_inputs(slots: np.ndarray, slot_len: np.ndarray, slot_last: np.ndarray, drafts: np.ndarray,
                  draft_lens: np.ndarray, page_table: np.ndarray, page_size: int, num_rows: int,
                  t_total: int, q_len: int, width: int, slot_streams: np.ndarray | None = None) -> VerifyInputs:
    """One decode/verify step over the live slots ``slots``, compacted into ``num_rows`` rows.

    Row ``i < len(slots)`` is slot ``slots[i]``: it feeds ``slot_last[slot]`` then
    ``drafts[i, :draft_lens[i]]`` at positions ``slot_len[slot] ...`` (their pages must be
    allocated), packed back to back. Rows past ``len(slots)`` are padding sequences (q_len 0,
    ``num_seqs`` excludes them); packed tokens past the live ones are padding writing scratch
    page 0.

    Args:
      slots: ``int[n]`` live slot ids; slot_len: ``int[max_slots]`` tokens already in the KV pool;
        slot_last: ``int[max_slots]`` pending token; drafts: ``int[n, K]`` (any ``K``);
        draft_lens: ``int[n]`` in ``[0, min(K, q_len - 1)]``; page_table: the allocator's
        ``int32[max_slots, pages_per_seq]``; num_rows, t_total, q_len, width: the bucket
        (``ShapePlan.pass_pair``, ``ShapePlan.width``); slot_streams: ``int[max_slots]`` the
        request of each slot, which keys its tokens' sampling draws (default: the slot id).

    Raises:
      ValueError: the tokens do not fit in ``t_total``, a row in ``q_len`` or the slots in
        ``num_rows``.
    """
    n = len(slots)
    _, pages_per_seq = page_table.shape
    if n > num_rows:
        raise ValueError(f"verify step has {n} live sequences, more than the row bucket {num_rows}")
    lens = np.zeros(num_rows, np.int64)
    lens[:n] = draft_lens
    if n and lens.max() + 1 > q_len:
        raise ValueError(f"verify step has a draft of {int(lens.max())} tokens, more than max_q_len={q_len} - 1")
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
    fed = np.concatenate([np.asarray(slot_last)[slots, None], np.asarray(drafts, np.int32)], axis=1)  # [n, K+1]
    tokens = np.zeros(t_total, np.int32)
    positions = np.zeros(t_total, np.int32)
    slot_mapping = np.zeros(t_total, np.int32)
    tokens[:used] = fed[owner, j]
    positions[:used] = pos
    table = page_table[slots]
    slot_mapping[:used] = table[owner, np.minimum(pos // page_size, pages_per_seq - 1)] * page_size + pos % page_size
    kv_lens = np.zeros(num_rows, np.int32)
    kv_lens[:n] = base + q_lens[:n]
    pages = np.zeros((num_rows, width), np.int32)
    pages[:n] = table[:, :width]
    meta = RaggedMeta(kv_lens=kv_lens, page_indices=pages, cu_q_lens=cu.astype(np.int32),
                      num_seqs=np.array([n], np.int32), slot_mapping=slot_mapping)
    streams = np.zeros(t_total, np.int32)
    streams[:used] = _streams_of(slot_streams, slots)[owner]
    return VerifyInputs(tokens, positions, meta, np.zeros(0, np.int32), int(q_len), streams,
                        draft_lens=lens.astype(np.int32), slots=np.asarray(slots, np.int64))


def unpack_rows(values: np.ndarray, cu_q_lens: np.ndarray, n: int, width: int) -> np.ndarray:
    """``values[T]`` of a packed step as ``[n, width]`` rows: ``out[i, j] = values[cu[i] + j]``
    (indices past the end clamp to the last position; callers read ``j < num_emitted[i]``)."""
    idx = np.asarray(cu_q_lens[:n], np.int64)[:, None] + np.arange(width)[None, :]
    return np.asarray(values)[np.minimum(idx, len(values) - 1)]


def dummy_prefill(t_b: int, num_rows: int, q_len: int, max_slots: int, width: int) -> PassInputs:
    """Prefill inputs of bucket ``(t_b, num_rows, q_len)`` at page-table ``width`` with no live
    sequence (warm-up; page 0 only)."""
    z = np.zeros(t_b, np.int32)
    meta = RaggedMeta(kv_lens=np.zeros(num_rows, np.int32),
                      page_indices=np.zeros((num_rows, width), np.int32),
                      cu_q_lens=np.zeros(num_rows + 1, np.int32), num_seqs=np.zeros(1, np.int32), slot_mapping=z)
    return PassInputs(z, z, meta, np.zeros(min(max_slots, t_b), np.int32), q_len)


def dummy_verify(num_rows: int, t_total: int, q_len: int, width: int, pages_per_seq: int) -> VerifyInputs:
    """Decode/verify inputs of bucket ``(num_rows, t_total, q_len, width)`` with no live sequence
    (warm-up; touches scratch page 0 only)."""
    table = np.zeros((1, pages_per_seq), np.int32)
    return verify_inputs(np.zeros(0, np.int64), np.zeros(1, np.int64), np.zeros(1, np.int32),
                         np.zeros((0, 0), np.int32), np.zeros(0, np.int64), table, 1, num_rows, t_total,
                         q_len, width)


def busy_verify(shape, max_slots: int, pages_per_seq: int, page_size: int, num_pages: int = 0) -> VerifyInputs:
    """Decode/verify inputs of a ``shapes.PassShape`` with every row live (the pass-cost profile:
    a step's cost depends on its live rows, drafts and context, which ``dummy_verify`` leaves
    empty): ``shape.rows`` rows, each with a context filling half its page-table width and the
    ``T - rows`` draft tokens spread evenly (at most ``q_len - 1`` per row). With ``num_pages``
    (the pool's size, > 1) each row reads and writes its own pages ``1 ..`` (wrapping), as rows do
    in a rollout: the pool must hold nothing needed (the engine profiles with no slot holding
    pages). Without, every page is the scratch page 0 (cheaper than a rollout's steps: every
    write of the step hits the same page)."""
    rows, q_len = shape.rows, shape.q_len
    lens = np.full(rows, min(q_len - 1, (shape.tokens - rows) // rows), np.int64)
    lens[: min(rows, shape.tokens - rows - int(lens.sum()))] += lens[0] < q_len - 1
    context = max(1, shape.width * page_size // 2 - q_len)
    table = np.zeros((max_slots, pages_per_seq), np.int32)
    if num_pages > 1:
        table[:] = 1 + np.arange(table.size).reshape(table.shape) % (num_pages - 1)
    return verify_inputs(np.arange(rows), np.full(max_slots, context, np.int64), np.zeros(max_slots, np.int32),
                         np.zeros((rows, q_len), np.int32), lens, table, page_size, rows, shape.tokens, q_len,
                         shape.width)


def pass_inputs(shape, max_slots: int, pages_per_seq: int) -> PassInputs:
    """Dummy inputs of one ``shapes.PassShape`` (warm-up, compile reports)."""
    if shape.kind == "prefill":
        return dummy_prefill(shape.tokens, shape.rows, shape.q_len, max_slots, shape.width)
    return dummy_verify(shape.rows, shape.tokens, shape.q_len, shape.width, pages_per_seq)


def shape_of(inp: PassInputs):
    """The ``shapes.PassShape`` program an input runs (the engine records every one it runs)."""
    from rhyme_jax.rollout.shapes import PassShape

    rows, width = inp.meta.page_indices.shape
    kind = "prefill" if not isinstance(inp, VerifyInputs) else ("decode" if inp.max_q_len == 1 else "verify")
    return PassShape(kind, len(inp.tokens), rows, int(inp.max_q_len), width)
