"""L7: L6's run with a second run seed, and the held-out gain of both seeds pooled.

A learning claim needs several seeds (issue 51: paired z >= 4 in two seeds). Seeds of the run
that learns and recurs (``longtail.RECUR_UNIT``, ``SEED1_UNIT``) run on one machine start from
the same warm start and are evaluated greedy on the same 400 held-out problems before and after
GRPO, so their gains pool per problem: ``d_i = mean_s(after_s,i) - before_i``, mean and paired
standard error over the problems (``io.summary.paired_gain`` on the seeds' mean). That standard
error keeps the between-seed variance that each problem's mean carries, and no more: it is not
the independent-samples ``sqrt(se_0^2 + se_1^2) / 2``, since the seeds share the before.

The warm start is deterministic on one machine but not across CPU models (presumably XLA's
float32 kernels differ by CPU; the same SFT scores 0.42 on an Intel Xeon and 0.47 on an AMD
EPYC on the first 100 problems). Seeds run on different machines therefore start from different
weights and their befores differ; their gains are then independent and pool as the mean gain
with ``sqrt(sum_s se_s^2) / S``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from rhyme_lab.ablate.longtail import RECUR_UNIT, gain_cell, regime
from rhyme_lab.ablate.measures import Inputs, MissingInput, figure

SEED1_UNIT = "longtail_recur_seed1_paired"  # L6's config with run.seed 1 (run by hand, 1-1.5 h after the warm start)


def pooled_gain(runs: list[tuple[str | Path, int]]) -> dict | None:
    """The greedy held-out gain of several seeds of one run, pooled (module docstring).

    Args:
      runs: ``(run_dir, steps)`` per seed; each run's ``eval/step_000000.npz`` (before) and
        ``eval/step_{steps:06d}.npz`` (after) hold ``correct: float[n]``, one entry per problem.

    Returns:
      ``{"seeds", "n", "before", "after", "gain", "se", "z", "pooling"}`` (accuracies in [0, 1],
      ``before`` and ``after`` the seeds' means; ``z`` None without spread; ``pooling``
      ``"per problem"`` where the seeds share the before, else ``"independent"``), or None with
      fewer than 2 seeds evaluated.

    Raises:
      ValueError: the seeds' evaluations differ in their number of problems.
    """
    from rhyme_jax.io.summary import eval_path, paired_gain

    befores, afters = [], []
    for run_dir, steps in runs:
        first, last = eval_path(Path(run_dir), 0), eval_path(Path(run_dir), steps)
        if not (first.is_file() and last.is_file()):
            continue
        a, b = np.load(first)["correct"], np.load(last)["correct"]
        if befores and a.shape != befores[0].shape:
            raise ValueError(f"{first}: {a.shape[0]} problems, the first seed's evaluation has "
                             f"{befores[0].shape[0]}; the seeds must be scored on the same problems")
        befores.append(a)
        afters.append(b)
    if len(afters) < 2:
        return None
    if all(np.array_equal(a, befores[0]) for a in befores):
        gain, se = paired_gain(befores[0], np.mean(np.stack(afters), axis=0))
        pooling = "per problem"
    else:
        gains = [paired_gain(a, b) for a, b in zip(befores, afters)]
        gain = float(np.mean([g for g, _ in gains]))
        se = float(np.sqrt(sum(e * e for _, e in gains)) / len(gains))
        pooling = "independent"
    return {"seeds": len(afters), "n": int(befores[0].size), "before": float(np.mean(befores)),
            "after": float(np.mean(afters)), "gain": gain, "se": se, "z": gain / se if se > 0 else None,
            "pooling": pooling}


def l7(inp: Inputs) -> dict:
    """L7 (module docstring): L6's figures over the seed-1 run (``SEED1_UNIT``), and where L6's
    unit ran in the same output, the held-out gain of both seeds pooled (``pooled_gain``)."""
    out = regime(inp, SEED1_UNIT, (SEED1_UNIT,), "gantt_longtail_recur_seed1.png")
    runs = []
    for name in (RECUR_UNIT, SEED1_UNIT):
        try:
            u = inp.unit(name)
        except MissingInput:
            continue
        runs.append((u["run_dir"], max(s["step"] for s in u["steps"])))
    pooled = pooled_gain(runs)
    out["pooled_held_out"] = pooled
    if pooled:
        out["ours"] += f"; {pooled['seeds']} seeds pooled ({pooled['pooling']}): held-out {gain_cell(pooled)}"
        out["figures"].append(figure(f"held-out greedy accuracy gain (paired), seeds pooled ({pooled['pooling']})",
                                     f"{pooled['seeds']} seeds", pooled["gain"], pooled["se"], pooled["n"]))
    return out
