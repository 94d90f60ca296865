"""HistoPipe's exact placement of whole prompts: the assignment of a step's prompts to rollout
workers that minimises the predicted makespan, by dynamic programming over subsets of prompts.

The tiers of ``planner.py`` (RhymeRL s.5: ranking groups, odd/even order, more workers for long
groups) are a heuristic for this problem. When a pass costs far more than a row in it (the CPU's
``a`` about 7-10 x ``b``), a worker's time is set by its longest row plus the rows decoded beside
it, and the heuristic can lose to plain fifo: on the ledger task's run (configs/longtail.yaml,
prompt lengths ranked by the last rollout at Spearman 0.99) the tiers replayed at 0.96x fifo while
this placement, planned from the same history, replayed at 1.17x, 99% of the best whole-prompt
placement that knows the true lengths (1.18x) (docs/results.md, L5).

Cost of a worker holding prompts ``S`` (``CostModel.decode_cost`` with every sample of a prompt
at its predicted length): ``a max_S(pred) + b n sum_S(pred) + c n |S|``. Exact over whole-prompt
placements: ``best_w[mask] = min over submasks s of max(best_{w-1}[mask ^ s], cost[s])``, ``3^P``
steps per worker, so at most ``MAX_PROMPTS`` prompts a step (the planner falls back to its tiers
beyond).
"""

from __future__ import annotations

import numpy as np
from jaxtyping import Float

MAX_PROMPTS = 12  # 3^12 = 531,441 submask steps per worker (about a second in Python)


def best_subsets(lengths: Float[np.ndarray, "P n"], cost_model, workers: int) -> tuple[float, list[int]]:
    """The best placement of whole prompts on ``workers`` workers under ``cost_model``.

    Args:
      lengths: ``float[P, n]`` lengths (tokens) of each prompt's ``n`` samples (true lengths for
        an oracle, a prediction broadcast over the samples for a plan).
      cost_model: a ``sched.cost_model.CostModel`` (``a``, ``b``, ``c`` in seconds).
      workers: W >= 1.

    Returns:
      ``(makespan seconds, masks)``: one bit mask over the P prompts per worker used (at most W;
      together each prompt exactly once).

    Raises:
      ValueError: more than ``MAX_PROMPTS`` prompts, or ``workers < 1``.
    """
    x = np.asarray(lengths, np.float64)
    p = x.shape[0]
    if p > MAX_PROMPTS or workers < 1:
        raise ValueError(f"best_subsets: {p} prompts (at most {MAX_PROMPTS}) on {workers} workers (at least 1)")
    if not p:
        return 0.0, []
    full = (1 << p) - 1
    members = (np.arange(1 << p)[:, None] >> np.arange(p)[None, :]) & 1  # [2^P, P]
    top = np.max(np.where(members > 0, x.max(axis=1)[None, :], 0.0), axis=1)
    cost = cost_model.a * top + cost_model.b * (members @ x.sum(axis=1)) + cost_model.c * (members @ np.full(p, x.shape[1]))
    cost = cost.tolist()
    best, parts = list(cost), [[m] for m in range(full + 1)]  # one worker: the whole subset on it
    for _ in range(min(workers, p) - 1):
        nxt, nparts = list(best), list(parts)
        for mask in range(1, full + 1):
            sub = (mask - 1) & mask
            while sub:  # the last worker takes mask ^ sub, the others sub
                v = max(best[sub], cost[mask ^ sub])
                if v < nxt[mask]:
                    nxt[mask], nparts[mask] = v, parts[sub] + [mask ^ sub]
                sub = (sub - 1) & mask
        best, parts = nxt, nparts
    return float(best[full]), parts[full]


def prompts_of(mask: int, num_prompts: int) -> np.ndarray:
    """``int64`` prompt indices of bit mask ``mask`` (ascending)."""
    return np.array([i for i in range(num_prompts) if mask >> i & 1], np.int64)


__all__ = ["MAX_PROMPTS", "best_subsets", "prompts_of"]
