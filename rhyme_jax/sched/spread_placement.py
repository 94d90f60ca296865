"""HistoPipe's sample-level spread: every prompt's samples dealt over the rollout workers.

RhymeRL s.5 gives long groups more workers (tier 2); this placement takes that to its limit: every
prompt gets ``min(n, W)`` workers. It exists for the regime where a pass costs many row-passes
(the CPU: ``a`` about 10 x ``b``) and one prompt's samples differ in length by tens of times.
There a worker's time is ``a x`` its longest row ``+ b x`` the row-passes beside it
(``CostModel.decode_cost``), so the makespan is the longest row's serial decode plus the long rows
that share its worker; keeping a prompt whole stacks its long samples on one worker. On the
ledger task (configs/longtail.yaml) a prompt's last rollout ranks its lengths now at Spearman 1.00
but not which of its samples runs long (samples are exchangeable): in three runs placements of
whole prompts planned from history replayed at 0.97-1.03x fifo and the best that knows the true
lengths at 1.05-1.06x, while spreading the samples replayed at 1.19x, 1.30x and 1.19x
(docs/results.md, L5).

Order (history's part): prompts by descending predicted length (ties by index) and their rows
dealt round-robin over the workers, continuing where the last prompt stopped, so every worker
gets ``floor`` or ``ceil`` of ``P n / W`` rows and of each prompt's ``n / W`` samples; each
worker's samples of a prompt are then given as one contiguous run of the prompt's rows (samples
are exchangeable: which indices a worker holds changes nothing but where they run).
"""

from __future__ import annotations

import numpy as np
from jaxtyping import Float


def spread_counts(pred: Float[np.ndarray, "P"], n: int, workers: int) -> np.ndarray:
    """``int64[W, P]`` samples of each prompt on each worker (module docstring: round-robin in
    descending predicted length).

    Raises:
      ValueError: ``pred`` not 1-D, ``n < 1`` or ``workers < 1``.
    """
    pred = np.asarray(pred, np.float64)
    if pred.ndim != 1 or n < 1 or workers < 1:
        raise ValueError(f"spread_counts: need float[P], n >= 1, workers >= 1; got {pred.shape}, {n}, {workers}")
    counts = np.zeros((workers, pred.size), np.int64)
    k = 0
    for p in np.argsort(-pred, kind="stable"):
        for _ in range(n):
            counts[k % workers, p] += 1
            k += 1
    return counts


def rows_of(counts: np.ndarray, n: int) -> list[np.ndarray]:
    """Each worker's ``int64`` rows (row ``r`` of prompt ``r // n``, ascending) for ``counts
    int[W, P]`` samples of each prompt on each worker (``spread_counts``; columns summing to
    ``n``): contiguous runs of each prompt's rows in worker order, every row of the step once."""
    start = np.cumsum(np.vstack([np.zeros((1, counts.shape[1]), np.int64), counts]), axis=0)  # [W+1, P]
    out = []
    for w in range(counts.shape[0]):
        runs = [np.arange(p * n + start[w, p], p * n + start[w + 1, p]) for p in range(counts.shape[1])]
        out.append(np.concatenate(runs).astype(np.int64) if runs else np.zeros(0, np.int64))
    return out


__all__ = ["rows_of", "spread_counts"]
