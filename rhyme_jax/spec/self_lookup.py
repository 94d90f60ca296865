"""Fallback drafts from the running sequence itself (prompt lookup decoding; Saxena 2023).

When the history index has no continuation for a sequence (e.g. a response that wanders away
from every earlier rollout, or loops), the last ``m`` tokens (``pattern_max`` down to
``pattern_min``) are searched for in the sequence's own earlier tokens (prompt + response so
far); the tokens that followed the earliest earlier occurrence are the draft. This is an
extension beyond RhymeRL's HistoSpec (``spec.self_lookup``, off by default); like every draft it
is verified losslessly, so it changes speed, never the sampled distribution.
"""

from __future__ import annotations

import numba
import numpy as np
from jaxtyping import Int

from rhyme_jax.config.sections import MAX_DRAFT


@numba.njit(cache=True, nogil=True)
def _lookup(ctx, max_lens, pattern_max, pattern_min, out, lens):  # pragma: no cover - numba
    num, width = ctx.shape
    for b in range(num):
        lens[b] = 0
        if max_lens[b] <= 0:
            continue
        start = 0
        while start < width and ctx[b, start] < 0:
            start += 1
        n = width - start
        m = min(pattern_max, n - 1)
        while m >= pattern_min and lens[b] == 0:
            # Earliest end position e (exclusive) of an earlier occurrence of the last m tokens.
            for e in range(start + m, width):
                ok = True
                for i in range(m):
                    if ctx[b, e - m + i] != ctx[b, width - m + i]:
                        ok = False
                        break
                if ok:
                    if e < width:
                        take = min(max_lens[b], width - e, out.shape[1])
                        for i in range(take):
                            out[b, i] = ctx[b, e + i]
                        lens[b] = take
                    break
            m -= 1


def self_lookup_drafts(
    contexts: Int[np.ndarray, "B W"],
    max_lens: Int[np.ndarray, "B"],
    *,
    pattern_max: int,
    pattern_min: int,
    max_draft: int = MAX_DRAFT,
) -> tuple[Int[np.ndarray, "B D"], Int[np.ndarray, "B"]]:
    """Drafts of B sequences from their own earlier tokens.

    Args:
      contexts: ``int[B, W]`` last W tokens of each running sequence, left-padded with -1.
      max_lens: ``int[B]`` most draft tokens per row.
      pattern_max, pattern_min: longest / shortest suffix searched for.
      max_draft: width D of the returned draft array.

    Returns:
      ``(drafts int32[B, D], lens int32[B])``; ``lens[b] <= max_lens[b]``; a row whose last
      ``pattern_min`` tokens never occurred before drafts nothing.

    Raises:
      ValueError: ``contexts`` is not 2-D or ``max_lens`` does not match it.
    """
    ctx = np.ascontiguousarray(contexts, dtype=np.int64)
    if ctx.ndim != 2:
        raise ValueError(f"contexts: expected [B, W], got shape {ctx.shape}")
    ml = np.asarray(max_lens, dtype=np.int64)
    if ml.shape != (ctx.shape[0],):
        raise ValueError(f"max_lens: expected shape ({ctx.shape[0]},), got {ml.shape}")
    out = np.zeros((ctx.shape[0], max_draft), np.int32)
    lens = np.zeros(ctx.shape[0], np.int32)
    _lookup(ctx, ml, int(pattern_max), int(pattern_min), out, lens)
    return out, lens


__all__ = ["self_lookup_drafts"]
