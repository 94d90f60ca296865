"""HistoPipe replay: a run's saved response lengths through the planner and a cost-model
simulation of the rollout workers; no model, no device (``python -m benchmarks.schedule --mode
replay`` prints and saves it; its module docstring describes the method and the issue targets).

Per step, each prompt's length is predicted from its previous occurrence (``length_predictor``),
the step is planned under each of ``CONFIGS`` (``planner.plan_step``) and every worker is
simulated decode step by decode step (``simulate``: ``sum_t (a + b * live_rows_t) + c * rows``,
with optional tail migration); ``one_step_off`` chains the per-step worker times across steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rhyme_jax.sched.cost_model import DEFAULT_COST_MODEL, CostModel
from rhyme_jax.sched.length_predictor import predict_lengths
from rhyme_jax.sched.planner import Plan, check_plan, plan_step
from rhyme_jax.sched.timeline import WorkerInterval, bubble_metrics

# name -> (plan_step keyword arguments, simulate tail migration)
CONFIGS: dict[str, tuple[dict, bool]] = {
    "fifo": ({"mode": "fifo"}, False),
    "tier1": ({"tier2": False}, False),
    "tier1+mig": ({"tier2": False}, True),
    "tier2": ({"tier1": False}, False),
    "tier1+tier2": ({}, False),
    "tier1+tier2+mig": ({}, True),
    "exact+mig": ({"exact": True}, True),  # whole prompts by exact_placement (sched.placement: exact)
    "spread": ({"spread": True}, False),  # every prompt's samples over all workers (sched.placement: spread)
    "spread+mig": ({"spread": True}, True),
}
FULL = "tier1+tier2+mig"


@dataclass(frozen=True)
class StepLengths:
    """One step's batch: ``prompt_ids int64[P]`` and actual response ``lengths int32[P, n]``."""

    step: int
    prompt_ids: np.ndarray
    lengths: np.ndarray


def load_steps(run_dir: str | Path) -> tuple[list[StepLengths], int]:
    """The saved steps of a run and its ``rollout.max_new_tokens`` (from ``config.yaml``; else the
    longest response seen).

    Raises:
      ValueError: no rollout files, or a step whose rows are not n consecutive samples per prompt.
    """
    from rhyme_jax.io.rollout_log import list_rollout_steps, load_rollouts

    run_dir = Path(run_dir)
    steps = list_rollout_steps(run_dir)
    if not steps:
        raise ValueError(f"{run_dir}: no rollouts/step_*.npz files (run a training first or use --synthetic)")
    out = []
    for s in steps:
        d = load_rollouts(run_dir, s)
        ids = d["prompt_ids"]
        n = int(np.argmax(ids != ids[0])) if np.any(ids != ids[0]) else ids.size
        if n == 0 or ids.size % n or np.any(ids.reshape(-1, n) != ids.reshape(-1, n)[:, :1]):
            raise ValueError(f"{run_dir} step {s}: rows are not n consecutive samples per prompt")
        out.append(StepLengths(s, ids[::n].astype(np.int64), d["lengths"].reshape(-1, n)))
    max_new = int(max(st.lengths.max() for st in out))
    cfg = run_dir / "config.yaml"
    if cfg.is_file():
        import yaml

        max_new = int(((yaml.safe_load(cfg.read_text()) or {}).get("rollout") or {}).get("max_new_tokens", max_new))
    return out, max_new


def synthetic_steps(seed: int = 0, num_prompts: int = 160, prompts_per_step: int = 16, n: int = 8,
                    steps: int = 60, max_new_tokens: int = 64) -> tuple[list[StepLengths], int]:
    """A demo-shaped synthetic length distribution: each prompt has a log-normal base length that
    drifts slowly between epochs (keeps its rank); samples scatter around it (+-15%); 3% of samples
    run to ``max_new_tokens`` (truncated outliers). Prompts are reshuffled every epoch."""
    rng = np.random.default_rng(seed)
    base = np.exp(rng.normal(np.log(max_new_tokens * 0.45), 0.35, num_prompts))
    out, order, pos = [], rng.permutation(num_prompts), 0
    for s in range(1, steps + 1):
        if pos + prompts_per_step > num_prompts:
            order, pos = rng.permutation(num_prompts), 0
            base *= np.exp(rng.normal(0.0, 0.05, num_prompts))
        ids = order[pos:pos + prompts_per_step]
        pos += prompts_per_step
        L = base[ids, None] * np.exp(rng.normal(0.0, 0.15, (ids.size, n)))
        L[rng.random(L.shape) < 0.03] = max_new_tokens
        out.append(StepLengths(s, ids.astype(np.int64), np.clip(np.rint(L), 1, max_new_tokens).astype(np.int32)))
    return out, max_new_tokens


def _finish_after(cost: CostModel, lengths: np.ndarray, t: int) -> float:
    """Seconds for rows of ``lengths`` (already ``t`` tokens in) to finish their remaining steps."""
    rest = lengths[lengths > t] - t
    return float(cost.a * rest.max() + cost.b * rest.sum()) if rest.size else 0.0


def simulate(plan: Plan, lengths: np.ndarray, pred_rows: np.ndarray, cost: CostModel, *,
             migrate: bool, growth: float = 1.5, tail: float = 0.1) -> tuple[list[WorkerInterval], int]:
    """Simulated intervals of one step's workers (see the module docstring) and the number of rows
    migrated.

    Args:
      plan: the step's plan.
      lengths: ``int[P*n]`` actual response length of each row.
      pred_rows: ``float[P*n]`` predicted length of each row (its prompt's).
      cost: cost model.
      migrate: simulate tail migration.
      growth: a row migrates once it has generated more than ``growth`` x its prediction.
      tail: migration is considered once at most this share of a worker's rows still runs.
    """
    W = plan.num_workers
    L = [lengths[r].astype(np.int64) for r in plan.worker_rows]
    finish = np.array([cost.decode_cost(l) for l in L])
    events = []  # (time, source worker, decode step, row mask)
    if migrate:
        for w, l in enumerate(L):
            if l.size == 0:
                continue
            p = pred_rows[plan.worker_rows[w]]
            live_after = np.array([(l > t).sum() for t in range(int(l.max()) + 1)])  # live_after[t]
            limit = max(1, int(np.floor(tail * l.size)))
            cum_live = np.concatenate([[0], np.cumsum(live_after[:-1])])  # sum_{u<=t} live_u
            for t in range(1, int(l.max())):
                if 0 < live_after[t] <= limit:
                    mask = (l > t) & (t > growth * p)
                    if mask.any():
                        tau = cost.c * l.size + cost.a * t + cost.b * cum_live[t]
                        events.append((float(tau), w, t, mask))
                        break
    own_end = finish.copy()  # end of each worker's own rows; finish also covers received rows
    received, migrated = [], 0
    for tau, w, t, mask in sorted(events, key=lambda e: (e[0], e[1])):
        idle = [d for d in range(W) if d != w and finish[d] <= tau]
        if not idle:
            continue
        d = min(idle, key=lambda d: (finish[d], d))
        moved = L[w][mask]
        dest_cost = cost.c * moved.size + _finish_after(cost, moved, t)
        received.append(WorkerInterval(d, tau, tau + dest_cost, "migrated"))
        finish[d] = tau + dest_cost
        L[w] = L[w][~mask]
        own_end[w] = finish[w] = tau + _finish_after(cost, L[w], t)
        migrated += int(moved.size)
    own = [WorkerInterval(w, 0.0, float(own_end[w])) for w in range(W) if plan.worker_rows[w].size]
    return own + received, migrated


def one_step_off(durations: np.ndarray, train_s: float) -> dict:
    """Chain per-step worker durations through cross-step worker queues in ``one_step_off`` mode
    (``sched.cross_step``; rollout of step s+1 overlaps training of step s): worker w starts step s
    when its step s-1 work is done and the weights for step s exist, i.e. training of step s-2 has
    finished; training of step s starts once every worker finished step s and the previous
    training is done, and lasts ``train_s``.

    Args:
      durations: ``float[S, W]`` seconds each worker works in each replayed step (in order).
      train_s: seconds of one training step.

    Returns:
      ``{"span_s", "bubble_fraction"}``: ``span_s`` = the summed step windows, window s =
      ``[max(weights ready for s, end of step s-1), end of step s]`` (the trainer's windows with
      cross-step queues; time when every worker waits for the weights is outside every window, as
      training is outside a sync step's window), and the workers' idle share of ``W * span_s``.
      Unlike the trainer, which counts an update inside a window as busy (it runs on the same
      devices), this counts a worker waiting for an update as idle: an upper bound.
    """
    S, W = durations.shape
    end = np.zeros(W)
    train_end: list[float] = []
    span, prev_end = 0.0, -np.inf
    for s in range(S):
        ready = train_end[s - 2] if s >= 2 else 0.0
        end = np.maximum(end, ready) + durations[s]
        step_end = float(end.max())
        span += max(step_end - max(ready, prev_end), 0.0)
        prev_end = step_end
        train_end.append(max(step_end, train_end[-1] if train_end else 0.0) + train_s)
    return {"span_s": span, "bubble_fraction": 1.0 - float(durations.sum()) / (W * span) if span else 0.0}


def replay(steps: list[StepLengths], *, num_workers: int = 4, cost: CostModel = DEFAULT_COST_MODEL,
           stat: str = "mean", num_groups: int = 0, growth: float = 1.5, tail: float = 0.1,
           max_new_tokens: int = 64, include_cold: bool = False, train_share: float = 0.15,
           configs: dict = CONFIGS) -> dict:
    """Replay ``steps`` (in order) under every configuration.

    A step is replayed when at least one of its prompts has history (with ``include_cold`` also the
    cold-start steps, where every prompt is predicted ``max_new_tokens / 2``). Besides the
    per-step (``sync``) metrics, each configuration's step durations are chained in
    ``one_step_off`` mode with a training step of ``train_share / (1 - train_share)`` x fifo's mean
    sync makespan (rollout is 84-91% of a step in the paper; 0.15 by default).

    Returns:
      ``{"replayed_steps", "cold_steps_skipped", "rows", "configs": {name: aggregate dict},
      "per_step": {name: [per-step dicts]}, "intervals": {name: {step: intervals}}}``.
    """
    history: dict[int, np.ndarray] = {}
    per_step = {name: [] for name in configs}
    intervals = {name: {} for name in configs}
    skipped, total_rows = 0, 0
    for st in steps:
        P, n = st.lengths.shape
        seen = any(int(p) in history for p in st.prompt_ids)
        if seen or include_cold:
            pred = predict_lengths(history, st.prompt_ids, stat, default=max_new_tokens / 2)
            rows_len, pred_rows = st.lengths.reshape(-1), np.repeat(pred, n)
            total_rows += P * n
            for name, (kw, mig) in configs.items():
                plan = plan_step(st.step, pred, n, num_workers, cost, num_groups=num_groups, **kw)
                check_plan(plan, P)
                ivs, moved = simulate(plan, rows_len, pred_rows, cost, migrate=mig, growth=growth, tail=tail)
                m = bubble_metrics(ivs, num_workers)
                per_step[name].append({"step": st.step, "migrated_rows": moved,
                                       "predicted_makespan_s": plan.predicted_makespan, **m})
                intervals[name][st.step] = ivs
        else:
            skipped += 1
        for p, l in zip(st.prompt_ids.tolist(), st.lengths):
            history[int(p)] = l
    agg = {}
    for name, rows in per_step.items():
        span = sum(r["makespan_s"] for r in rows)
        idle = sum(sum(r["idle_s"]) for r in rows)
        agg[name] = {
            "bubble_fraction": idle / (num_workers * span) if span else 0.0,
            "bubble_fraction_mean_per_step": float(np.mean([r["bubble_fraction"] for r in rows])) if rows else 0.0,
            "earliest_finisher_idle": float(np.mean([r["earliest_finisher_idle"] for r in rows])) if rows else 0.0,
            "makespan_s": span,
            "migrated_share": sum(r["migrated_rows"] for r in rows) / total_rows if total_rows else 0.0,
        }
    fifo_span = agg.get("fifo", {}).get("makespan_s", 0.0)
    first = next(iter(configs))
    train_s = train_share / (1.0 - train_share) * agg[first]["makespan_s"] / max(len(per_step[first]), 1)
    for name, a in agg.items():
        a["speedup_vs_fifo"] = fifo_span / a["makespan_s"] if a["makespan_s"] and fifo_span else None
        dur = np.array([[max((iv.end for iv in ivs if iv.worker == w), default=0.0) for w in range(num_workers)]
                        for ivs in intervals[name].values()]).reshape(-1, num_workers)
        pipe = one_step_off(dur, train_s)
        a["one_step_off_span_s"], a["one_step_off_bubble_fraction"] = pipe["span_s"], pipe["bubble_fraction"]
    fifo_pipe = agg.get("fifo", {}).get("one_step_off_span_s")
    for a in agg.values():
        a["one_step_off_speedup_vs_fifo"] = fifo_pipe / a["one_step_off_span_s"] if fifo_pipe and a["one_step_off_span_s"] else None
    return {"replayed_steps": len(per_step[first]), "cold_steps_skipped": skipped,
            "rows": total_rows, "train_s": train_s, "configs": agg, "per_step": per_step, "intervals": intervals}


def format_table(result: dict) -> str:
    """Markdown table of the aggregates and the issue targets for the full configuration."""
    lines = ["| config | bubble fraction | earliest-finisher idle | makespan (s) | speedup vs fifo | migrated "
             "| cross-step bubble | cross-step span (s) | cross-step speedup |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    fmt = lambda v: f"{v:.3f}x" if v else "-"  # noqa: E731
    for name, a in result["configs"].items():
        lines.append(f"| {name} | {a['bubble_fraction']:.1%} | {a['earliest_finisher_idle']:.1%} | "
                     f"{a['makespan_s']:.3f} | {fmt(a['speedup_vs_fifo'])} | {a['migrated_share']:.2%} | "
                     f"{a['one_step_off_bubble_fraction']:.1%} | {a['one_step_off_span_s']:.3f} | "
                     f"{fmt(a['one_step_off_speedup_vs_fifo'])} |")
    c = result["configs"]
    if FULL in c and "fifo" in c:
        f, h = c["fifo"], c[FULL]
        ok = lambda b: "met" if b else "NOT met"  # noqa: E731
        lines += ["", f"Targets ({FULL} vs fifo; sync columns):",
                  f"* earliest-finisher idle <= 20%: {h['earliest_finisher_idle']:.1%} "
                  f"(fifo {f['earliest_finisher_idle']:.1%}) - {ok(h['earliest_finisher_idle'] <= 0.2)}",
                  f"* bubble fraction at most half of fifo's: {h['bubble_fraction']:.1%} vs "
                  f"{f['bubble_fraction']:.1%} - {ok(h['bubble_fraction'] <= 0.5 * f['bubble_fraction'])}",
                  f"* migrated share <= 6%: {h['migrated_share']:.2%} - {ok(h['migrated_share'] <= 0.06)}"]
    return "\n".join(lines)
