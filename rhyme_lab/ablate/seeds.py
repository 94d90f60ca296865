"""L7: L6's run with a second run seed, and the held-out gain of both seeds pooled per problem.

A learning claim needs several seeds (issue 51: paired z >= 4 in two seeds). Both seeds of the
run that learns and recurs (``longtail.RECUR_UNIT``, ``SEED1_UNIT``) start from the same warm
start and are evaluated greedy on the same 400 held-out problems before and after GRPO, so
their gains pool per problem: ``d_i = mean_s(after_s,i) - before_i``, mean and paired standard
error over the problems (``io.summary.paired_gain`` on the seeds' mean). The pooled standard
error keeps the between-seed variance that each problem's mean carries, and no more: it is not
the independent-samples ``sqrt(se_0^2 + se_1^2) / 2``, since both seeds share the before.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from rhyme_lab.ablate.longtail import RECUR_UNIT, gain_cell, regime
from rhyme_lab.ablate.measures import Inputs, MissingInput, figure

SEED1_UNIT = "longtail_recur_seed1_paired"  # L6's config with run.seed 1 (run by hand, ~1.5 h after the warm start)


def pooled_gain(runs: list[tuple[str | Path, int]]) -> dict | None:
    """The greedy held-out gain of several seeds of one run, pooled per problem.

    Args:
      runs: ``(run_dir, steps)`` per seed; each run's ``eval/step_000000.npz`` (before) and
        ``eval/step_{steps:06d}.npz`` (after) hold ``correct: float[n]``, one entry per problem.

    Returns:
      ``{"seeds", "n", "before", "after", "gain", "se", "z"}`` (accuracies in [0, 1]; ``z`` None
      without spread), or None with fewer than 2 seeds evaluated.

    Raises:
      ValueError: the seeds' evaluations differ in their problems (length) or in the before.
    """
    from rhyme_jax.io.summary import eval_path, paired_gain

    before, after = None, []
    for run_dir, steps in runs:
        first, last = eval_path(Path(run_dir), 0), eval_path(Path(run_dir), steps)
        if not (first.is_file() and last.is_file()):
            continue
        a, b = np.load(first)["correct"], np.load(last)["correct"]
        if before is not None and (a.shape != before.shape or not np.array_equal(a, before)):
            raise ValueError(f"{first}: another evaluation before GRPO than the first seed's ({a.shape} vs "
                             f"{before.shape}); the seeds must share the warm start and the problems")
        before = a
        after.append(b)
    if len(after) < 2:
        return None
    mean_after = np.mean(np.stack(after), axis=0)
    gain, se = paired_gain(before, mean_after)
    return {"seeds": len(after), "n": int(before.size), "before": float(before.mean()),
            "after": float(mean_after.mean()), "gain": gain, "se": se, "z": gain / se if se > 0 else None}


def l7(inp: Inputs) -> dict:
    """L7 (module docstring): L6's figures over the seed-1 run (``SEED1_UNIT``), and where L6's
    unit ran in the same output, the held-out gain of both seeds pooled per problem."""
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
        out["ours"] += f"; {pooled['seeds']} seeds pooled per problem: held-out {gain_cell(pooled)}"
        out["figures"].append(figure("held-out greedy accuracy gain (paired), seeds pooled per problem",
                                     f"{pooled['seeds']} seeds", pooled["gain"], pooled["se"], pooled["n"]))
    return out
