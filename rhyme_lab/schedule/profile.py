"""HistoPipe on a real model, the parts without a model: the cost-model profile's grid, its check
of the model derived from the engine's pass-cost profile and the grid's own fit, the saved steps
a workers run replays, and the per-step rows and medians of the workers mode.
``rhyme_lab.bench.schedule_real`` measures with them; ``python -m benchmarks.schedule --mode
profile | workers`` is the command.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from rhyme_jax.sched.cost_model import FORM, CostModel
from rhyme_lab.schedule.replay import StepLengths, load_steps

PROFILE_BATCHES = (1, 4, 16, 64)
PROFILE_TOKENS = (16, 48, 96)
# name -> ``--set`` overrides of the ``sched`` section (mode sync: migration inside the step)
WORKER_CONFIGS: dict[str, list[str]] = {
    "fifo": ["sched.mode=fifo"],
    "tier1": ["sched.mode=histopipe", "sched.tier1=true", "sched.tier2=false", "sched.migration=false"],
    "tier1+tier2": ["sched.mode=histopipe", "sched.tier1=true", "sched.tier2=true", "sched.migration=false"],
    "tier1+tier2+migration": ["sched.mode=histopipe", "sched.tier1=true", "sched.tier2=true",
                              "sched.migration=true"],
}
WORKER_FULL = "tier1+tier2+migration"
# Cross-step worker queues (sched.pipeline=one_step_off, sched.cross_step=true): steps chained,
# each worker starting its part of step s + 1 when its part of step s is done. No migration: a
# one_step_off tail would be deferred, and this benchmark does not train the carried groups.
CROSS_STEP_CONFIGS: dict[str, list[str]] = {
    "fifo cross-step": ["sched.mode=fifo", "sched.pipeline=one_step_off", "sched.cross_step=true"],
    "tier1+tier2 cross-step": ["sched.mode=histopipe", "sched.tier1=true", "sched.tier2=true",
                               "sched.migration=false", "sched.pipeline=one_step_off", "sched.cross_step=true"],
}
# RolloutScheduler metrics summarised per configuration (median over the steps)
WORKER_METRICS = ("sched/bubble_fraction", "sched/earliest_finisher_idle", "time/rollout_makespan_s",
                  "sched/migrated_share", "sched/predicted_makespan_s")


class BenchSetupError(RuntimeError):
    """A prerequisite of the profile/workers modes is missing (SFT params, tokenizer, saved
    rollouts, devices); the message says what to run."""


def profile_grid(max_slots: int, max_new_tokens: int, batches=PROFILE_BATCHES,
                 tokens=PROFILE_TOKENS) -> tuple[list[int], list[int]]:
    """The profile grid: ``batches`` capped at ``rollout.max_slots`` and ``tokens`` capped at
    ``rollout.max_new_tokens`` (duplicates after capping dropped), ascending."""
    return (sorted({min(int(b), int(max_slots)) for b in batches}),
            sorted({min(int(t), int(max_new_tokens)) for t in tokens}))


def check_rows(cm: CostModel, samples) -> list[dict]:
    """``cm``'s relative error at each measured ``(tokens, batch, seconds)`` sample:
    ``(T(tokens, batch) - seconds) / seconds``.

    Returns:
      one row per sample, ``{"tokens", "batch", "measured_s", "fit_s", "rel_error"}`` (seconds;
      ``rel_error`` nan where the measured time is 0).
    """
    return [{"tokens": int(t), "batch": int(b), "measured_s": float(s), "fit_s": float(cm(t, b)),
             "rel_error": float(cm(t, b) / s - 1.0) if s > 0 else float("nan")} for t, b, s in samples]


def fit_report(samples) -> tuple[CostModel, list[dict]]:
    """Fit the cost model to ``(tokens, batch, seconds)`` samples (``CostModel.fit``) and its
    relative error at each sample (``check_rows``): the grid's own fit, which the profile
    reports beside the model derived from the engine's pass-cost profile.

    Returns:
      ``(CostModel, rows)``. ``CostModel.fit`` raises on too few samples.
    """
    cm = CostModel.fit(samples)
    return cm, check_rows(cm, samples)


def format_profile_table(cm: CostModel, rows: list[dict], source: str = "Fitted") -> str:
    """Markdown table of the measured and modelled seconds per grid point (``source`` names
    where ``cm`` comes from: ``"Fitted"`` to the grid, or the pass-cost profile)."""
    lines = [f"{source} {FORM}: a = {cm.a:.4g} s, b = {cm.b:.4g} s, c = {cm.c:.4g} s", "",
             "| batch | tokens | measured (s) | model (s) | relative error |", "|---:|---:|---:|---:|---:|"]
    for r in sorted(rows, key=lambda r: (r["batch"], r["tokens"])):
        lines.append(f"| {r['batch']} | {r['tokens']} | {r['measured_s']:.4f} | {r['fit_s']:.4f} | "
                     f"{r['rel_error']:+.1%} |")
    worst = max(abs(r["rel_error"]) for r in rows)
    lines += ["", f"largest |relative error|: {worst:.1%}"]
    return "\n".join(lines)


def worker_steps(run_dir: str | Path, first: int, count: int) -> list[tuple[StepLengths, dict]]:
    """Steps ``first .. first + count - 1`` of a run's saved rollouts, each with its history: a
    mapping prompt id -> ``int32[n]`` lengths of that prompt's latest earlier occurrence (what the
    trainer's history store holds at that step; ``length_predictor`` accepts the mapping).

    Raises:
      BenchSetupError: no usable saved rollouts, or a wanted step has none.
    """
    try:
        steps, _ = load_steps(run_dir)
    except ValueError as exc:  # no rollouts, or an unreadable / inconsistent file
        raise BenchSetupError(str(exc)) from None
    have = {st.step for st in steps}
    wanted = list(range(int(first), int(first) + int(count)))
    missing = [s for s in wanted if s not in have]
    if missing:
        raise BenchSetupError(f"{run_dir}: no saved rollouts for steps {missing} (saved: {min(have)}..{max(have)}); "
                              f"use --start-step/--steps within them")
    history: dict[int, np.ndarray] = {}
    out = []
    for st in sorted(steps, key=lambda s: s.step):
        if st.step in wanted:
            out.append((st, dict(history)))
        for pid, lengths in zip(st.prompt_ids.tolist(), st.lengths):
            history[int(pid)] = lengths
    return out


def corr(x, y) -> float:
    """Pearson correlation (nan when either side is constant)."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    if x.size < 2 or x.std() == 0 or y.std() == 0:
        return float("nan")
    return float(np.corrcoef(x, y)[0, 1])


def summarize_workers(per_step: dict[str, list[dict]]) -> dict[str, dict]:
    """Per configuration: the median over the steps of each ``WORKER_METRICS`` entry and of the
    rollout wall time, plus ``bubble_ratio_vs_fifo`` = fifo's median bubble / this median bubble
    (> 1: fewer bubbles than fifo; None without fifo or with a zero bubble), the pooled bubble
    fraction (idle worker-seconds over all steps / worker-seconds of all step windows) and the
    summed makespan."""
    out = {}
    for name, rows in per_step.items():
        out[name] = {k: float(np.median([r[k] for r in rows])) for k in (*WORKER_METRICS, "wall_s")}
        out[name]["steps"] = len(rows)
        span = sum(r["time/rollout_makespan_s"] for r in rows)
        out[name]["pooled_bubble_fraction"] = (sum(r["sched/bubble_fraction"] * r["time/rollout_makespan_s"]
                                                   for r in rows) / span if span else 0.0)
        out[name]["total_makespan_s"] = span
    fifo = out.get("fifo", {}).get("sched/bubble_fraction")
    for a in out.values():
        b = a["sched/bubble_fraction"]
        a["bubble_ratio_vs_fifo"] = fifo / b if fifo is not None and b > 0 else None
    return out


def format_workers_table(summary: dict[str, dict]) -> str:
    """Markdown table of ``summarize_workers``'s medians."""
    lines = ["| config | bubble fraction | fifo bubble / bubble | pooled bubble | earliest-finisher idle "
             "| makespan (s) | summed makespan (s) | migrated share | predicted makespan (s) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, a in summary.items():
        ratio = f"{a['bubble_ratio_vs_fifo']:.2f}x" if a["bubble_ratio_vs_fifo"] else "-"
        lines.append(f"| {name} | {a['sched/bubble_fraction']:.1%} | {ratio} | {a['pooled_bubble_fraction']:.1%} | "
                     f"{a['sched/earliest_finisher_idle']:.1%} | {a['time/rollout_makespan_s']:.3f} | "
                     f"{a['total_makespan_s']:.3f} | {a['sched/migrated_share']:.2%} | "
                     f"{a['sched/predicted_makespan_s']:.3f} |")
    return "\n".join(lines)


def step_row(step: int, sr, wall: float, **extra) -> dict:
    """One configuration's JSON row for a step: ``WORKER_METRICS``, wall seconds, generated
    tokens, mean length, rows per worker, the worker intervals, plus ``extra``."""
    lengths = np.array([len(t) for t in sr.result.tokens])
    return {"step": step, "wall_s": wall, **{k: float(sr.metrics[k]) for k in WORKER_METRICS},
            "generated_tokens": int(lengths.sum()), "mean_length": float(lengths.mean()), **extra,
            "worker_rows": [int(w.size) for w in sr.plan.worker_rows],
            "intervals": [[iv.worker, iv.start, iv.end, iv.kind] for iv in sr.intervals]}
