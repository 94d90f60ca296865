"""Combining the rollouts of several workers: in one process (concatenate) and across
processes (all-gather), so every process of a run sees the whole step's rollouts in prompt order.

Count statistics add up over workers; rates are recomputed from the sums; ``seconds`` and
``drafting_seconds`` add up (worker time, not wall time).
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np

from rhyme_jax.rollout.types import RolloutResult, derive_rates

_FINISH = ("eos", "length", "skipped", "migrated")
COUNT_STATS = ("prefill_tokens", "generated_tokens", "decode_steps", "prefill_steps", "preemptions",
           "skipped", "drafted_tokens", "accepted_tokens", "drafting_seconds", "sequence_steps",
           "forward_passes", "seconds", "predicted_accepted", "decode_dispatches", "device_wait_seconds",
           "prefill_wait_seconds", "spec_chunk_seconds", "spec_chunk_passes", "spec_chunk_row_passes",
           "spec_chunks_declined")


def merge_results(results: Sequence[RolloutResult]) -> RolloutResult:
    """Concatenate workers' results in order; count stats summed, rates recomputed.

    Also records ``stats["workers"]`` and ``stats["max_worker_forward_passes"]`` (the slowest
    worker's batch passes: the rollout's critical path in passes).
    """
    if len(results) == 1:
        out = results[0]
        out.stats.setdefault("workers", 1)
        out.stats.setdefault("max_worker_forward_passes", out.stats["forward_passes"])
        return out
    stats = {k: sum(r.stats.get(k, 0) for r in results) for k in COUNT_STATS}
    stats["workers"] = sum(r.stats.get("workers", 1) for r in results)
    stats["max_worker_forward_passes"] = max(r.stats.get("max_worker_forward_passes", r.stats["forward_passes"])
                                             for r in results)
    return RolloutResult(tokens=[t for r in results for t in r.tokens],
                         logprobs=[lp for r in results for lp in r.logprobs],
                         finish_reasons=[f for r in results for f in r.finish_reasons],
                         stats=derive_rates(stats))


def allgather_results(local: RolloutResult, max_new_tokens: int) -> RolloutResult:
    """Every process's ``local`` result, concatenated in process order (identical on all).

    Single process: ``local`` itself. Multi-process: responses are padded to ``max_new_tokens``
    and rows to the largest process's count, all-gathered with
    ``jax.experimental.multihost_utils.process_allgather``, then unpadded.
    """
    if jax.process_count() == 1:
        return local
    from jax.experimental import multihost_utils

    n = len(local.tokens)
    rows = int(np.max(multihost_utils.process_allgather(np.int32(n))))
    tok = np.zeros((rows, max_new_tokens), np.int32)
    lps = np.zeros((rows, max_new_tokens), np.float32)
    lens = np.full(rows, -1, np.int32)
    fin = np.zeros(rows, np.int32)
    for i, (t, lp, f) in enumerate(zip(local.tokens, local.logprobs, local.finish_reasons)):
        tok[i, :len(t)], lps[i, :len(t)], lens[i], fin[i] = t, lp, len(t), _FINISH.index(f)
    stats = np.array([local.stats.get(k, 0) for k in COUNT_STATS] + [local.stats.get("workers", 1),
                     local.stats.get("max_worker_forward_passes", local.stats["forward_passes"])], np.float64)
    g_tok, g_lps, g_lens, g_fin, g_stats = (multihost_utils.process_allgather(x)
                                            for x in (tok, lps, lens, fin, stats))
    parts = []
    for p in range(g_tok.shape[0]):
        keep = np.flatnonzero(g_lens[p] >= 0)
        st = dict(zip(COUNT_STATS, g_stats[p][:len(COUNT_STATS)].tolist()))
        st["workers"], st["max_worker_forward_passes"] = g_stats[p][len(COUNT_STATS):].tolist()
        parts.append(RolloutResult(
            tokens=[g_tok[p, i, :g_lens[p, i]].copy() for i in keep],
            logprobs=[g_lps[p, i, :g_lens[p, i]].copy() for i in keep],
            finish_reasons=[_FINISH[g_fin[p, i]] for i in keep], stats=derive_rates(st)))
    return merge_results(parts)
