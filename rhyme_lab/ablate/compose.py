"""The whole system end to end at CPU scale: HistoSpec measured, HistoPipe replayed, one ratio per epoch.

Issue 51 asks for the whole system (HistoSpec and HistoPipe on 4 rollout workers) against sync
FIFO with HistoSpec off, end to end (RhymeRL s.7.2, Fig. 12: 2.6x over veRL). On a 2-core CPU
4 workers would share the cores, so the rollout's makespan comes from the replay of the run's own
steps (``longtail.placement``: the planner and the worker simulation under the cost model fitted
to the run's plain rollouts), and HistoSpec's gain from the paired unit's own measurement: each
step was decoded plain and with HistoSpec back to back, same weights, prompts and key.

For a step ``k`` with plain rollout seconds ``P_k`` and HistoSpec seconds ``S_k`` (measured, one
engine, all rows), the rest of the step ``U_k`` (its wall time less both rollouts: the update,
the reference and old logprobs, the rewards; measured on the one device), and the replayed
4-worker makespans ``F_k`` (fifo) and ``H_k`` (HistoPipe's ``spread`` placement with migration):

* baseline, sync fifo with HistoSpec off: ``U_k + F_k``;
* HistoPipe alone: ``U_k + H_k``;
* the whole system: ``U_k + H_k * S_k / P_k``: HistoSpec's measured ratio of the step applied to
  every worker's replayed time. The step's makespan is its longest rows' worker, and on one
  engine ``S_k / P_k`` is set by the same longest rows (every pass waits for them), so the
  scaling follows what sets the makespan; a worker without them may gain more or less, which
  moves its idle time, not the makespan.

Each ratio is a ratio of sums over an epoch's steps with its delta-method standard error
(``measures.ratio_of_sums``). ``U_k`` stays the one device's: an update split over 4 devices
would be shorter and every ratio here larger, so the figures are conservative in that respect.
"""

from __future__ import annotations

import numpy as np

from rhyme_lab.ablate.learning import by_epoch
from rhyme_lab.ablate.measures import figure, ratio_of_sums


def whole_system(r: dict, makespans: dict[int, dict[str, float]]) -> dict[int, dict]:
    """Per epoch of the paired unit ``r`` (``e2e.run_paired``'s steps: ``plain`` and ``spec``
    records with ``seconds``, and ``wall_s``): the composed end-to-end ratios over its timed steps
    that the replay covers.

    Args:
      r: the paired unit's results (``steps``, ``skip``).
      makespans: ``{step: {"fifo": s, "spread": s}}``, replayed 4-worker makespans in seconds
        (``longtail.placement``'s ``per_step``).

    Returns:
      ``{epoch: {"steps", "system", "system_se", "histopipe", "histopipe_se", "histospec",
      "histospec_se", "rollout_share_fifo"}}``: ``system`` is the whole system against sync
      fifo with HistoSpec off, ``histopipe`` HistoPipe alone (spread placement, HistoSpec off),
      ``histospec`` HistoSpec's rollout ratio over the same steps (measured), and
      ``rollout_share_fifo`` the baseline's rollout share ``sum F / sum (U + F)``. Epochs with no
      replayed step are left out; an SE is None for a single step.
    """
    out = {}
    for ep, steps in sorted(by_epoch(r).items()):
        st = [s for s in steps if s["step"] in makespans and s["plain"]["seconds"] > 0]
        if not st:
            continue
        plain = np.array([s["plain"]["seconds"] for s in st])
        spec = np.array([s["spec"]["seconds"] for s in st])
        rest = np.array([s["wall_s"] - s["plain"]["seconds"] - s["spec"]["seconds"] for s in st])
        fifo = np.array([makespans[s["step"]]["fifo"] for s in st])
        spread = np.array([makespans[s["step"]]["spread"] for s in st])
        system, system_se = ratio_of_sums(rest + fifo, rest + spread * spec / plain)
        pipe, pipe_se = ratio_of_sums(rest + fifo, rest + spread)
        roll, roll_se = ratio_of_sums(plain, spec)
        out[ep] = {"steps": len(st), "system": system, "system_se": system_se, "histopipe": pipe,
                   "histopipe_se": pipe_se, "histospec": roll, "histospec_se": roll_se,
                   "rollout_share_fifo": float(fifo.sum() / (rest + fifo).sum())}
    return out


def cell(epochs: dict[int, dict]) -> str | None:
    """The report's one-line summary of ``whole_system`` (None without a composed epoch)."""
    if not epochs:
        return None
    se = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    parts = [f"epoch {ep}: {x['system']:.2f} ± {se(x['system_se'])}x (HistoPipe alone {x['histopipe']:.2f}x, "
             f"HistoSpec's measured rollout {x['histospec']:.2f}x; baseline rollout {x['rollout_share_fifo']:.0%} "
             f"of its step, {x['steps']} steps)" for ep, x in sorted(epochs.items())]
    return ("whole system end to end against sync fifo with HistoSpec off (4 workers: HistoSpec measured "
            "paired, HistoPipe spread replayed, the update on one device): " + "; ".join(parts))


def system_figures(epochs: dict[int, dict]) -> list[dict]:
    """The report's figures (``measures.figure``) of ``whole_system``, one per composed epoch."""
    return [figure("whole system end-to-end ratio vs sync fifo, HistoSpec off (HistoSpec measured, HistoPipe "
                   "spread replayed, 4 workers)", f"epoch {ep}", x["system"], x["system_se"], x["steps"])
            for ep, x in sorted(epochs.items())]
