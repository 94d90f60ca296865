"""Shadow rows: each row's runner-up draft verified in the same pass as its best one.

With ``spec.second_candidate`` the goodput drafter hands the engine, beside each row's best
candidate, its runner-up (``DraftBatch.alternates``). A shadow row verifies the runner-up as one
more row of the step's program: it feeds the row's pending token and the runner-up at the same
positions, and its tokens are drawn with the row's own request key (``sampling.position_noise``
keys a draw by request and position), so at every position it samples the token the row itself
would sample given the same tokens before. Whichever of the two accepts the longer run, the
emitted tokens are the ones plain decoding emits: the winner's tokens are draws of a prefix its
own pass verified (``verification.verify_packed``).

KV without copying a sequence: the shadow's page-table row is the row's own up to the page ``P``
holding the pending token (position ``L``), and fresh pages from there. ``P``'s first ``L mod
page_size`` positions are copied into the shadow's fresh page before the pass (``copy_pages``:
one page per shadow); every token the shadow feeds writes into its own pages. When the shadow
accepts more, the sequence adopts its pages from ``P`` on and the row's are freed; else the
shadow's are freed.

Which rows get one: a shadow pays ``1 + len`` packed tokens and one row of the step's bucket for
its expected gain ``sum_{j >= d} P2[j]`` (``P2`` the runner-up's acceptance curve, ``d`` the
first position where it differs from the draft the row sends: while both agree, the row accepts
what the shadow would; past ``d`` at most one of them can be accepted, so the shadow adds
exactly its tokens accepted there). Shadows take the step's free rows; they take its spare
packed tokens first and then, where a shadow's weighted gain is larger, the row drafts' least
likely tokens (the tails that the goodput choice filled the program with). The program the
choice picked is kept, so a step's shape and its cost model are unchanged.

Source: multi-candidate verification as in SpecInfer (Miao et al. 2024) and SuffixDecoding
(Oliaro et al. 2024, arXiv 2411.04975), here as extra rows of a paged ragged batch instead of a
token tree (the attention kernels stay causal per row).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import numpy as np
from jaxtyping import Float, Int

from rhyme_jax.rollout.batching import VerifyInputs
from rhyme_jax.rollout.kv_cache import KVCache
from rhyme_jax.rollout.shapes import pow2

MIN_GAIN = 0.25  # expected accepted tokens below which a shadow row is not worth its row


@dataclass
class ShadowPlan:
    """The shadow rows of one step (m of them).

    Attributes:
      rows: ``int64[m]`` index (into the step's live rows) of the row each shadow doubles.
      tokens: ``int32[m, K]`` runner-up draft of each shadow (0 past ``lens``).
      lens: ``int64[m]`` draft tokens each shadow feeds after the pending token.
      pages: ``int32[m, W]`` page-table row of each shadow: the row's pages before ``first``,
        fresh pages from there (0 past them).
      first: ``int64[m]`` logical page ``P`` where each shadow's own pages begin.
      fresh: ``int32[F]`` every fresh page (taken from the pool; back to it or adopted).
      copies: ``(src int32[C], dst int32[C])`` pages to copy before the pass.
    """

    rows: np.ndarray
    tokens: np.ndarray
    lens: np.ndarray
    pages: np.ndarray
    first: np.ndarray
    fresh: np.ndarray
    copies: tuple[np.ndarray, np.ndarray]


def gains(sent: Int[np.ndarray, "n K"], sent_lens: Int[np.ndarray, "n"], alt: Int[np.ndarray, "n K2"],
          alt_lens: Int[np.ndarray, "n"], alt_est: Float[np.ndarray, "n K2"]) -> tuple[np.ndarray, np.ndarray]:
    """Expected extra accepted tokens of verifying each row's runner-up beside its sent draft.

    Returns:
      ``(gain float64[n], curve float64[n, K2])``: ``curve[i, j]`` the probability that the
      runner-up's first ``j + 1`` tokens are accepted (0 at ``j >= alt_lens[i]``) and
      ``gain[i] = sum_{j >= d_i} curve[i, j]``, ``d_i`` the length of the common prefix of the
      runner-up and the sent draft (module docstring).
    """
    n, k2 = alt.shape
    j = np.arange(k2)[None, :]
    curve = np.cumprod(np.asarray(alt_est, np.float64), axis=1)
    curve[j >= np.asarray(alt_lens)[:, None]] = 0.0
    w = min(k2, sent.shape[1])
    same = np.zeros((n, k2), bool)
    same[:, :w] = (alt[:, :w] == sent[:, :w]) & (j[:, :w] < np.asarray(sent_lens)[:, None])
    d = np.where(same.all(axis=1), k2, np.argmin(same, axis=1)) if k2 else np.zeros(n, np.int64)
    return np.where(j >= d[:, None], curve, 0.0).sum(axis=1), curve


def select(free_rows: int, spare: int, cost: Int[np.ndarray, "n"], value: Float[np.ndarray, "n"],
           sent_value: Float[np.ndarray, "n K"], sent_lens: Int[np.ndarray, "n"]) -> tuple[np.ndarray, np.ndarray]:
    """Which rows get a shadow, and the sent drafts cut to make room.

    Args:
      free_rows: rows of the step's bucket beyond the live ones; spare: its packed tokens
        beyond those the live rows send.
      cost: ``int[n]`` packed tokens of each row's shadow (0: none possible); value:
        ``float[n]`` its weighted expected gain.
      sent_value: ``float[n, K]`` weighted acceptance curve of the sent drafts (non-increasing
        along a row); sent_lens: ``int[n]`` their lengths.

    Returns:
      ``(rows int64[m], sent_lens int64[n])``: greedily by gain per token, a shadow takes spare
      tokens, then the sent tokens of least value (of other rows, from their ends) when its gain
      exceeds theirs.
    """
    lens = np.asarray(sent_lens, np.int64).copy()
    n = lens.size
    i_s, j_s = np.nonzero(np.arange(sent_value.shape[1])[None, :] < lens[:, None])
    ladder = np.lexsort((-j_s, sent_value[i_s, j_s]))  # least valuable first, a row's end first
    ladder_i, ladder_v = i_s[ladder], sent_value[i_s, j_s][ladder]
    taken = np.zeros(ladder.size, bool)
    chosen = []
    for i in np.argsort(-value / np.maximum(cost, 1), kind="stable"):
        if len(chosen) >= free_rows or cost[i] <= 0 or value[i] < MIN_GAIN:
            continue
        need = int(cost[i]) - spare
        if need > 0:
            pick = np.flatnonzero(~taken & (ladder_i != i))[:need]
            if pick.size < need or ladder_v[pick].sum() >= value[i]:
                continue
            taken[pick] = True
            np.subtract.at(lens, ladder_i[pick], 1)
            spare = 0
        else:
            spare -= int(cost[i])
        chosen.append(int(i))
    return np.asarray(sorted(chosen), np.int64), lens


def plan(alternates: tuple[np.ndarray, np.ndarray, np.ndarray], drafts: Int[np.ndarray, "n K"],
         sent_lens: Int[np.ndarray, "n"], curve: Float[np.ndarray, "n Kc"], weights: Float[np.ndarray, "n"],
         step: tuple[int, int, int, int], slots: Int[np.ndarray, "n"], lengths: Int[np.ndarray, "n"],
         allocator) -> tuple[ShadowPlan | None, np.ndarray]:
    """The shadow rows of one step and the row drafts' lengths after making room for them.

    Args:
      alternates: the drafter's runner-ups ``(tokens int32[n, K2], lens int[n], estimates
        float32[n, K2])`` of the live rows.
      drafts, sent_lens: the rows' drafts and the lengths the engine sends (after its cuts);
        curve: their acceptance curve (``allocation.accept_curve``, ``[n, Kc]``); weights:
        ``allocation.makespan_weights`` of the rows.
      step: ``(rows, tokens, q_len, width)`` of the chosen program.
      slots, lengths: each row's engine slot and tokens in its KV (its pending token's position).
      allocator: the engine's ``PageAllocator`` (fresh pages are taken from it here).

    Returns:
      ``(ShadowPlan or None, int64[n] sent lengths)``.
    """
    rows, t_total, q_len, width = step
    n = slots.size
    sent_lens = np.asarray(sent_lens, np.int64)
    ps = allocator.page_size
    alt, alt_lens, alt_est = alternates
    lengths = np.asarray(lengths, np.int64)
    room = np.minimum(q_len - 1, width * ps - lengths - 1)
    caps = np.clip(np.minimum(np.asarray(alt_lens, np.int64), room), 0, None)
    free_rows = rows - n
    if free_rows <= 0 or not caps.any():
        return None, sent_lens
    gain, _ = gains(drafts, sent_lens, alt, caps, alt_est)
    first = lengths // ps
    need = allocator.pages_for(lengths + 1 + caps) - first
    cost = np.where((caps > 0) & (need <= allocator.num_free), 1 + caps, 0)
    w = np.asarray(weights, np.float64)
    kc = curve.shape[1]
    sent_value = np.asarray(curve, np.float64) * w[:, None] if kc else np.zeros((n, 0))
    spare = t_total - n - int(sent_lens.sum())
    chosen, lens = select(free_rows, spare, cost, gain * w, sent_value, sent_lens)
    keep, free = [], allocator.num_free
    for i in chosen:  # each fits alone; together they may not
        if need[i] <= free:
            keep.append(i)
            free -= int(need[i])
    if not keep:
        return None, lens
    chosen = np.asarray(keep, np.int64)
    m = chosen.size
    fresh = allocator.take(int(need[chosen].sum()))
    pages = np.zeros((m, width), np.int32)
    src, dst = [], []
    at = 0
    for h, i in enumerate(chosen):
        p, k = int(first[i]), int(need[i])
        pages[h, :p] = allocator.page_table[slots[i], :p]
        pages[h, p: p + k] = fresh[at: at + k]
        if lengths[i] % ps:  # the pending token's page holds earlier tokens: copy it
            src.append(int(allocator.page_table[slots[i], p]))
            dst.append(int(fresh[at]))
        at += k
    shadow = ShadowPlan(chosen, np.ascontiguousarray(alt[chosen, : int(caps[chosen].max())], np.int32),
                        caps[chosen], pages, first[chosen], fresh,
                        (np.asarray(src, np.int32), np.asarray(dst, np.int32)))
    return shadow, lens


@functools.partial(jax.jit, donate_argnums=(0,))
def _copy(kv: KVCache, src, dst) -> KVCache:
    return KVCache(k=kv.k.at[:, :, dst].set(kv.k[:, :, src]), v=kv.v.at[:, :, dst].set(kv.v[:, :, src]))


def copy_pages(kv: KVCache, src: Int[np.ndarray, "C"], dst: Int[np.ndarray, "C"]) -> KVCache:
    """``kv`` with pages ``dst`` overwritten by pages ``src`` (every layer and head; the pool is
    donated). Padded to a power of two with scratch-to-scratch copies (page 0), one program per
    size."""
    c = pow2(max(len(src), 1))
    s = np.zeros(c, np.int32)
    d = np.zeros(c, np.int32)
    s[: len(src)], d[: len(dst)] = src, dst
    return _copy(kv, s, d)


def append_rows(inp: VerifyInputs, n: int, plan: ShadowPlan, base: Int[np.ndarray, "m"], pending: Int[np.ndarray, "m"],
                streams: Int[np.ndarray, "m"], page_size: int) -> VerifyInputs:
    """``inp`` (a step of ``n`` live rows) with the shadow rows of ``plan`` packed after them:
    rows ``n ... n + m - 1``, each feeding ``pending`` then its runner-up at positions
    ``base ...`` into its own page-table row, drawing with ``streams`` (its row's request).

    Raises:
      ValueError: the shadows do not fit the step's rows, tokens or ``max_q_len``.
    """
    m = plan.rows.size
    meta = inp.meta
    cu = np.asarray(meta.cu_q_lens, np.int64).copy()
    used = int(cu[n])
    q = 1 + plan.lens
    rows, t_total = meta.kv_lens.shape[0], inp.tokens.shape[0]
    if n + m > rows or used + int(q.sum()) > t_total or (m and int(q.max()) > inp.max_q_len):
        raise ValueError(f"shadow rows: {m} rows of {q.tolist()} tokens do not fit {rows - n} free rows, "
                         f"{t_total - used} free tokens and max_q_len {inp.max_q_len}")
    tokens, positions = inp.tokens.copy(), inp.positions.copy()
    slot_mapping, stream_of = meta.slot_mapping.copy(), inp.streams.copy()
    kv_lens, page_idx, lens = meta.kv_lens.copy(), meta.page_indices.copy(), inp.draft_lens.copy()
    for h in range(m):
        a = used + int(q[:h].sum())
        pos = int(base[h]) + np.arange(q[h])
        tokens[a: a + q[h]] = np.concatenate([[pending[h]], plan.tokens[h, : plan.lens[h]]])
        positions[a: a + q[h]] = pos
        slot_mapping[a: a + q[h]] = plan.pages[h, pos // page_size] * page_size + pos % page_size
        stream_of[a: a + q[h]] = streams[h]
        kv_lens[n + h] = pos[-1] + 1
        page_idx[n + h] = plan.pages[h, : page_idx.shape[1]]
        lens[n + h] = plan.lens[h]
        cu[n + h + 1:] = a + q[h]
    new_meta = type(meta)(kv_lens=kv_lens, page_indices=page_idx, cu_q_lens=cu.astype(np.int32),
                          num_seqs=np.array([n + m], np.int32), slot_mapping=slot_mapping)
    return VerifyInputs(tokens, positions, new_meta, inp.logits_rows, inp.max_q_len, stream_of,
                        draft_lens=lens, slots=inp.slots)


def resolve(shadow: ShadowPlan, n: int, toks: Int[np.ndarray, "r w"], lps: Float[np.ndarray, "r w"],
            n_emit: Int[np.ndarray, "r"], slots: Int[np.ndarray, "n"], allocator) -> Int[np.ndarray, "n"]:
    """After the pass: where a shadow emitted more tokens than its row, the row takes the
    shadow's tokens, logprobs and count (``toks``, ``lps``: unpacked ``[n + m, w]``;
    ``n_emit``: ``[n + m]``; rows ``< n`` updated in place) and its slot adopts the shadow's
    pages from its first own page on; the other shadows' pages go back to the pool.

    Returns:
      ``int64[n]`` tokens each row emitted before (its own ``n_emit``).
    """
    own = np.asarray(n_emit[:n], np.int64).copy()
    at = 0
    for h, i in enumerate(shadow.rows):
        k = int(np.count_nonzero(shadow.pages[h, shadow.first[h]:]))
        mine = shadow.fresh[at: at + k]
        at += k
        if n_emit[n + h] > n_emit[i]:
            toks[i], lps[i], n_emit[i] = toks[n + h], lps[n + h], n_emit[n + h]
            allocator.adopt(int(slots[i]), int(shadow.first[h]), mine)
        else:
            allocator.give_back(mine)
    return own
