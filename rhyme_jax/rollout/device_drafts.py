"""History drafts computed on the device, inside a chunk of verify passes (``rollout/chunk_spec.py``).

The host gives each row, once per chunk, a padded ``int32[S, H]`` history (its prompt's previous
rollouts and its siblings' text, ``-1`` between pieces and as left padding) and the row's own
last ``C`` tokens (prompt + response, ending with the pending token). Before every pass of the
chunk the device finds, per row, an occurrence in ``history ++ own tokens`` of the longest
suffix of the row (at most ``MATCH`` tokens, at least ``pattern_min``) that has a continuation,
and drafts up to ``K`` tokens that follow it (an occurrence followed by ``-1`` is skipped) (prompt-lookup decoding over RhymeRL's history,
arXiv 2508.18588 s.4; the host drafter's suffix index does the same search with branch
statistics). Longer matches win; among equal ones, the longer continuation (tokens before the
next ``-1`` or the end, up to the row's draft room), then history before the row's own tokens
(as the host drafter falls back to self-lookup only where its index has nothing), then the
latest. The continuation rule matters where a response repeats itself: in a run of one token the
latest occurrence of the suffix ends one token before the pending one and drafts a single token,
an earlier one drafts the whole room (the ledger run's 4,096-token tails, which repeat one digit
to the cap and set each step's makespan, accepted about one draft token a pass under the
latest-first rule).
The work is ``S x (H + C) x MATCH`` compares per pass, a few microseconds on an accelerator.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Int

MATCH = 32  # longest suffix compared (a static loop): long matches tell apart the places where a
# periodic response repeats a shorter pattern (the cost on a CPU is flat in it: 0.45 ms at 64 rows x 1,280)


def lookup_drafts(source: Int[Array, "S L"], pattern_min: Int[Array, ""], max_lens: Int[Array, "S"], k: int,
                  own_from: int = 0) -> tuple[Int[Array, "S K"], Int[Array, "S"]]:
    """Drafts of every row from its own ``source`` row.

    Args:
      source: ``int32[S, L]`` per row: history tokens, then the row's own tokens, right-aligned so
        the row's last token (the pending one) is ``source[:, -1]``; ``-1`` = no token (padding
        and separators; never matched, never drafted).
      pattern_min: shortest matched suffix (the longest is ``MATCH``).
      max_lens: ``int32[S]`` most draft tokens per row (0: no draft).
      k: ``K``, static width of the drafts.
      own_from: static column where the row's own tokens start (history before it).

    Returns:
      ``(drafts int32[S, K], lens int32[S])``: row ``s`` drafts ``drafts[s, :lens[s]]`` (0 after),
      the ``lens[s] <= min(K, max_lens[s])`` valid tokens that follow the chosen occurrence.
    """
    rows, width = source.shape
    pad = jnp.full((rows, MATCH), -2, source.dtype)
    left = jnp.concatenate([pad, source], axis=1)  # left[:, MATCH + j] == source[:, j]
    ends = width - 1  # candidate ends j in [0, L - 2]: each has a continuation token
    run = jnp.ones((rows, ends), bool)
    matched = jnp.zeros((rows, ends), jnp.int32)
    for i in range(MATCH):
        target = source[:, width - 1 - i][:, None]
        here = left[:, MATCH - i: MATCH - i + ends]  # source[:, j - i]
        run = run & (here == target) & (target >= 0)
        matched = matched + run.astype(jnp.int32)
    j = jnp.arange(ends, dtype=jnp.int32)
    # tokens that follow each candidate end before a -1 or the row's end, capped at the row's draft room
    col = jnp.arange(width, dtype=jnp.int32)[None, :]
    next_gap = jax.lax.cummin(jnp.where(source >= 0, width, col), axis=1, reverse=True)  # first -1 at or after
    room = jnp.minimum(jnp.minimum(max_lens, k), MATCH)[:, None]
    avail = jnp.minimum(next_gap[:, 1:] - (j[None, :] + 1), room)
    rank = (matched * (MATCH + 1) + avail) * 2 + (j < own_from).astype(jnp.int32)
    score = jnp.where((matched >= pattern_min) & (avail > 0), rank * width + j, -1)
    best = jnp.argmax(score, axis=1).astype(jnp.int32)
    found = jnp.max(score, axis=1) >= 0
    right = jnp.concatenate([source, jnp.full((rows, k), -1, source.dtype)], axis=1)
    cols = best[:, None] + 1 + jnp.arange(k, dtype=jnp.int32)[None, :]
    cont = jnp.take_along_axis(right, cols, axis=1)
    valid = jnp.cumprod((cont >= 0).astype(jnp.int32), axis=1)
    lens = jnp.where(found, jnp.minimum(valid.sum(axis=1), max_lens), 0).astype(jnp.int32)
    drafts = jnp.where(jnp.arange(k)[None, :] < lens[:, None], cont, 0).astype(jnp.int32)
    return drafts, lens


def fit_to_budget(lens: Int[Array, "S"], live: Int[Array, "S"], total: int,
                  fed: Int[Array, ""] | None = None) -> Int[Array, "S"]:
    """Draft lengths cut so every live row's draft fits ``total`` packed tokens beside the
    ``fed`` tokens every row feeds anyway (``int32[S]``; dead rows 0): each live row first gets
    up to an equal share of the room (``(total - fed) // live rows``), then what is left goes to
    the rows that want more, first come first served. Equal shares keep the rows of a chunk
    advancing together.

    ``fed``: packed tokens taken before any draft (default: one pending token per live row). A
    HistoSpec chunk also feeds one scratch token for each row that finished earlier in the chunk
    (``chunk_spec._pack``), so it passes its row count: counting live rows alone let a pass pack
    more than ``total`` tokens once a row had finished, and the last rows' tail tokens were never
    computed while their K/V pages were assumed written (wrong behaviour logprobs from there on).
    """
    lens = jnp.where(live, lens, 0)
    n_live = jnp.sum(live.astype(jnp.int32))
    room = total - (n_live if fed is None else fed)
    share = jnp.minimum(lens, jnp.maximum(room, 0) // jnp.maximum(n_live, 1))
    want = lens - share
    left = room - jnp.sum(share)
    before = jnp.cumsum(want) - want
    return (share + jnp.clip(left - before, 0, want)).astype(jnp.int32)


def append_tokens(ctx: Int[Array, "S C"], new: Int[Array, "S Q"], counts: Int[Array, "S"]) -> Int[Array, "S C"]:
    """``ctx`` with each row's ``new[s, :counts[s]]`` appended and as many oldest tokens dropped."""
    width = ctx.shape[1]
    both = jnp.concatenate([ctx, new.astype(ctx.dtype)], axis=1)
    cols = jnp.arange(width, dtype=jnp.int32)[None, :] + counts[:, None]
    return jnp.take_along_axis(both, cols, axis=1)


__all__ = ["MATCH", "append_tokens", "fit_to_budget", "lookup_drafts"]
