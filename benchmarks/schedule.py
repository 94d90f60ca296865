"""HistoPipe scheduling benchmark (issue 6): replay, cost-model profile, real workers.

Three modes:

* ``--mode replay`` (default, part a): saved run lengths through the planner and a cost-model
  simulation of the workers; no model, no device (below).
* ``--mode profile``: measures the cost model ``T(tokens, batch)`` of ONE rollout worker on the demo
  policy and saves it for the planner (``sched.cost_model``); see ``run_profile``.
* ``--mode workers``: the same plans on W real rollout workers (one engine per device, driven by
  ``RolloutScheduler``) over a few steps of the demo run's prompts; see ``run_workers_mode``. On
  CPU it must be started with ``XLA_FLAGS=--xla_force_host_platform_device_count=W``.

``--mode replay`` replays the response lengths a real run saved
(``<run_dir>/rollouts/step_*.npz``, ``train/rollout_log.py``) through the planner
(``rhyme_jax/sched/planner.py``) and simulates the rollout workers with the cost model; no model,
no device. Per step: each prompt's length is predicted from the lengths of the previous time the
prompt was seen (``length_predictor``; the demo cycles 160 prompts, 16 per step, so a prompt recurs
once per 10-step epoch), the step is planned under each configuration, and every worker is
simulated decode step by decode step (its batch shrinks as rows finish)::

    worker time = sum over decode steps t of (a + b * live_rows_t) + c * rows

Configurations: ``fifo`` (rows over workers in order, as the trainer does today), ``tier1``
(ranking groups, odd/even order, workers spread evenly), ``tier2`` (fifo chunks sized by tier 2),
``tier1+tier2``, and each of the tier-1 ones ``+mig`` with simulated tail migration:

* once a worker has at most ``tail`` (10%) of its rows still running, the first decode step at
  which some running row has generated more than ``growth`` (1.5) x its prompt's predicted length
  migrates every such row to the earliest-idle worker (one whose work is done at that moment; none
  idle = no migration). The destination recomputes their KV (prefill of prompt + partial response,
  approximated by the cost model's per-sequence ``c``) and decodes the remaining tokens:
  ``c * k + a * max(rest) + b * sum(rest)``; its interval is labelled ``migrated``.

Simulation is per step (``sync`` mode: all rows of a step finish before the next starts). The
tier-1 odd/even order pays off across steps in ``one_step_off`` mode, which this replay does not
model; within one sync step tier 1 alone concentrates long prompts on some workers.

Reported per configuration (pooled over the replayed steps): bubble fraction (idle worker-time /
total worker-time), mean idle share of the earliest finisher, summed makespan (and speedup over
fifo), migrated share of rows; and, with the same per-step worker times chained in
``one_step_off`` mode (``one_step_off``: a worker starts step s as soon as its step s-1 work is done
and training of step s-2 has finished; the training time is an assumption, ``--train-share``), the
whole replay's bubble fraction and span. Issue targets: earliest-finisher idle <= 20%, bubble fraction at
most half of fifo's, migrated share <= 6%.

The default cost model (a = 1e-3 s, b = 2e-5 s, c = 1e-3 s) is a placeholder until a device is
profiled; pass ``--cost-model PATH`` (``CostModel.save`` JSON) for measured values.

Usage::

    python benchmarks/schedule.py                          # replay runs/demo, W = 4
    python benchmarks/schedule.py --workers 8 --stat p90
    python benchmarks/schedule.py --synthetic              # no run dir needed
    python benchmarks/schedule.py --mode profile           # -> benchmarks/results/cost_model.json
    export XLA_FLAGS=--xla_force_host_platform_device_count=4   # CPU: one fake device per worker
    python benchmarks/schedule.py --mode workers --workers 4 --cost-model benchmarks/results/cost_model.json

Replay writes ``benchmarks/results/schedule.json`` (and Gantt PNGs with ``--gantt``), profile
``benchmarks/results/cost_model.json``, workers ``benchmarks/results/schedule_workers.json`` (and
``.md``); each prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rhyme_jax.sched.cost_model import DEFAULT_COST_MODEL, FORM, CostModel, CostModelError  # noqa: E402
from rhyme_jax.sched.length_predictor import predict_lengths  # noqa: E402
from rhyme_jax.sched.planner import Plan, check_plan, plan_step  # noqa: E402
from rhyme_jax.sched.timeline import WorkerInterval, bubble_metrics, plot_gantt  # noqa: E402
from rhyme_jax.train.atomic import atomic_write  # noqa: E402

# name -> (plan_step keyword arguments, simulate tail migration)
CONFIGS: dict[str, tuple[dict, bool]] = {
    "fifo": ({"mode": "fifo"}, False),
    "tier1": ({"tier2": False}, False),
    "tier1+mig": ({"tier2": False}, True),
    "tier2": ({"tier1": False}, False),
    "tier1+tier2": ({}, False),
    "tier1+tier2+mig": ({}, True),
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
    from rhyme_jax.train.rollout_log import list_rollout_steps, load_rollouts

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
    """Chain per-step worker durations in ``one_step_off`` mode (rollout of step s+1 overlaps
    training of step s): worker w starts step s when its step s-1 work is done and the weights
    for step s exist, i.e. training of step s-2 has finished; training of step s starts once every
    worker finished step s and the previous training is done, and lasts ``train_s``.

    Args:
      durations: ``float[S, W]`` seconds each worker works in each replayed step (in order).
      train_s: seconds of one training step.

    Returns:
      ``{"span_s", "bubble_fraction"}`` over the whole replay (rollout workers' idle share of
      ``W * span``, span = first start to last rollout end).
    """
    S, W = durations.shape
    end = np.zeros(W)
    train_end: list[float] = []
    for s in range(S):
        ready = train_end[s - 2] if s >= 2 else 0.0
        end = np.maximum(end, ready) + durations[s]
        train_end.append(max(float(end.max()), train_end[-1] if train_end else 0.0) + train_s)
    span = float(end.max())
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
             "| one-step-off bubble | one-step-off span (s) | one-step-off speedup |",
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


def run_replay(args) -> int:
    """``--mode replay``: load (or synthesise) the lengths, replay, print and save."""
    cost = CostModel.load(args.cost_model) if args.cost_model else DEFAULT_COST_MODEL
    if args.synthetic:
        steps, max_new = synthetic_steps(args.seed)
        source = "synthetic length distribution (--synthetic)"
    else:
        steps, max_new = load_steps(args.run_dir)
        source = f"{args.run_dir} ({len(steps)} saved steps)"
    res = replay(steps, num_workers=args.workers, cost=cost, stat=args.stat, num_groups=args.groups,
                 growth=args.growth, tail=args.tail, max_new_tokens=max_new, include_cold=args.include_cold,
                 train_share=args.train_share)
    cm = f"a={cost.a:g} s, b={cost.b:g} s, c={cost.c:g} s" + ("" if args.cost_model else " (placeholder defaults)")
    print(f"HistoPipe replay: {source}; W={args.workers}, groups={args.groups or 'auto'}, stat={args.stat}, "
          f"growth={args.growth}, tail={args.tail}; cost model {cm}")
    print(f"replayed {res['replayed_steps']} steps ({res['rows']} rows); {res['cold_steps_skipped']} cold-start "
          f"steps without history skipped; one-step-off columns assume {res['train_s']:.4f} s per training step\n")
    print(format_table(res))
    out = Path(args.out or "benchmarks/results/schedule.json")
    doc = {k: v for k, v in res.items() if k != "intervals"}
    doc["settings"] = {"source": source, "workers": args.workers, "groups": args.groups, "stat": args.stat,
                       "growth": args.growth, "tail": args.tail, "cost_model": {"a": cost.a, "b": cost.b, "c": cost.c},
                       "cost_model_placeholder": not args.cost_model, "max_new_tokens": max_new}
    with atomic_write(out, "w") as fh:
        json.dump(doc, fh, indent=1)
    print(f"\nwrote {out}")
    if args.gantt:
        for name in ("fifo", FULL):
            png = out.with_name(f"{out.stem}_gantt_{name.replace('+', '_')}.png")
            plot_gantt(res["intervals"][name], png, num_workers=args.workers, title=f"{name} (simulated)")
            print(f"wrote {png}")
    return 0


# ------------------------------------------------------------------ real model: profile / workers
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
# RolloutScheduler metrics summarised per configuration (median over the steps)
WORKER_METRICS = ("sched/bubble_fraction", "sched/earliest_finisher_idle", "time/rollout_makespan_s",
                  "sched/migrated_share", "sched/predicted_makespan_s")


class BenchSetupError(RuntimeError):
    """A prerequisite of the profile/workers modes is missing (SFT params, tokenizer, saved
    rollouts, devices); the message says what to run."""


@dataclass
class Policy:
    """The demo policy as the trainer builds it: config, tokenizer, train problems, model
    ``graphdef``/``model_cfg`` and the SFT ``state`` (on the first device)."""

    cfg: object
    tokenizer: object
    problems: list
    graphdef: object
    model_cfg: object
    state: object

    def prompt_tokens(self, idx: int) -> list[int]:
        """Prompt token ids of train problem ``idx``, built as ``GRPOTrainer._prompt_ids`` does."""
        p = self.problems[int(idx)]
        return self.tokenizer.encode(self.tokenizer.format_prompt(self.cfg.model.prompt_template, p.question))


def _enable_compile_cache(path: str) -> None:
    """Persistent XLA compilation cache (as benchmarks/rollout.py; warm-up is never timed)."""
    import jax

    if path:
        jax.config.update("jax_compilation_cache_dir", str(path))


def _require_params(init_from: str) -> None:
    """Raise ``BenchSetupError`` when ``init_from`` does not exist (checked before any set-up)."""
    if not Path(init_from).exists():
        raise BenchSetupError(f"no params at --init-from {init_from}; run `rhyme-jax sft` (the demo) first")


def load_policy(config: str, overrides: list[str], init_from: str, run_dir: str) -> Policy:
    """Config, the run's tokenizer (``<run_dir>/tokenizer.json`` for the demo model; never trained
    anew, it must match the params), the train problems and the params of ``init_from``
    (``rhyme_jax.train.checkpoint.load_params``: ``runs/demo/sft`` or a ``checkpoints/<step>``).

    Raises:
      BenchSetupError: no params at ``init_from`` or no tokenizer file.
    """
    from rhyme_jax.config import load_config
    from rhyme_jax.data import load_problems
    from rhyme_jax.model.tokenizer import Tokenizer
    from rhyme_jax.parallel.mesh import train_mesh
    from rhyme_jax.train.checkpoint import load_params
    from rhyme_jax.train.policy import build_sharded, tokenizer_file

    _require_params(init_from)
    cfg = load_config(config, overrides)
    tok = tokenizer_file(cfg, Path(run_dir))
    if not tok.is_file():
        raise BenchSetupError(f"no tokenizer at {tok} (the run that trained --init-from writes it; pass --run-dir)")
    tokenizer = Tokenizer.from_file(tok)
    train, _ = load_problems(cfg.data)
    graphdef, state, model_cfg = build_sharded(cfg, tokenizer, cfg.run.seed, train_mesh(1, 1, 1))
    state = load_params(init_from, state)
    return Policy(cfg, tokenizer, train, graphdef, model_cfg, state)


def profile_grid(max_slots: int, max_new_tokens: int, batches=PROFILE_BATCHES,
                 tokens=PROFILE_TOKENS) -> tuple[list[int], list[int]]:
    """The profile grid: ``batches`` capped at ``rollout.max_slots`` and ``tokens`` capped at
    ``rollout.max_new_tokens`` (duplicates after capping dropped), ascending."""
    return (sorted({min(int(b), int(max_slots)) for b in batches}),
            sorted({min(int(t), int(max_new_tokens)) for t in tokens}))


def fit_report(samples) -> tuple[CostModel, list[dict]]:
    """Fit the cost model to ``(tokens, batch, seconds)`` samples and the fit's relative error at
    each sample: ``(T(tokens, batch) - seconds) / seconds``."""
    cm = CostModel.fit(samples)
    rows = [{"tokens": int(t), "batch": int(b), "measured_s": float(s), "fit_s": float(cm(t, b)),
             "rel_error": float(cm(t, b) / s - 1.0) if s > 0 else float("nan")} for t, b, s in samples]
    return cm, rows


def format_profile_table(cm: CostModel, rows: list[dict]) -> str:
    """Markdown table of the measured and fitted seconds per grid point."""
    lines = [f"Fitted {FORM}: a = {cm.a:.4g} s, b = {cm.b:.4g} s, c = {cm.c:.4g} s", "",
             "| batch | tokens | measured (s) | fit (s) | relative error |", "|---:|---:|---:|---:|---:|"]
    for r in sorted(rows, key=lambda r: (r["batch"], r["tokens"])):
        lines.append(f"| {r['batch']} | {r['tokens']} | {r['measured_s']:.4f} | {r['fit_s']:.4f} | "
                     f"{r['rel_error']:+.1%} |")
    worst = max(abs(r["rel_error"]) for r in rows)
    lines += ["", f"largest |relative error|: {worst:.1%}"]
    return "\n".join(lines)



def run_profile(args) -> int:
    """``--mode profile``: measure one rollout worker's ``T(tokens, batch)`` and save the fit.

    One engine as the trainer builds it (``make_engine`` with the config's ``rollout`` section) but
    with ``eos_ids=()``, so every sequence generates exactly ``tokens`` new tokens. The batch is
    GRPO-shaped: ``ceil(batch / n)`` train prompts with ``n = grpo.samples_per_prompt`` samples each
    (prompt-prefix sharing as in training). Per grid point: one warm-up ``generate`` (compiles the
    shapes it needs), then the median wall time of ``--repeats`` calls with fresh keys.
    """
    import jax

    from rhyme_jax.parallel.reshard import reshard
    from rhyme_jax.parallel.rules import param_shardings
    from rhyme_jax.rollout.batching import seq_buckets
    from rhyme_jax.rollout.engine import SamplingParams
    from rhyme_jax.train.trainer import make_engine

    t_start = time.perf_counter()
    _require_params(args.init_from)
    _enable_compile_cache(args.jax_cache)
    pol = load_policy(args.config, args.overrides, args.init_from, args.run_dir)
    cfg, r = pol.cfg, pol.cfg.rollout
    engine = make_engine(pol.graphdef, pol.model_cfg, cfg, (), mesh=None)  # no EOS: exact lengths
    state = reshard(pol.state, param_shardings(pol.state, engine.mesh))
    batches, tokens = profile_grid(r.max_slots, r.max_new_tokens)
    n = int(cfg.grpo.samples_per_prompt)
    dev = jax.devices()[0]
    print(f"HistoPipe profile: one rollout worker on {dev.platform} ({dev.device_kind}), params {args.init_from}; "
          f"batches {batches} (decode row buckets {list(seq_buckets(r.max_slots))}), tokens {tokens}, "
          f"median of {args.repeats} timed calls after one warm-up per shape", flush=True)
    key = jax.random.key(args.seed)
    samples, compile_s = [], {}
    for b in batches:
        prompts = [pol.prompt_tokens(i) for i in range(-(-b // n)) for _ in range(n)][:b]
        for t in tokens:
            sp = SamplingParams(temperature=r.temperature, top_k=r.top_k, top_p=r.top_p, max_new_tokens=t)
            t0 = time.perf_counter()
            out = engine.generate(state, prompts, sp, key)
            compile_s[f"{b}x{t}"] = time.perf_counter() - t0
            got = int(out.stats["generated_tokens"])
            if got != b * t:
                raise RuntimeError(f"profile: batch {b} x {t} tokens generated {got} tokens, expected {b * t} "
                                   f"(eos_ids=() should make every sequence run to max_new_tokens)")
            times = []
            for rep in range(args.repeats):
                t0 = time.perf_counter()
                engine.generate(state, prompts, sp, jax.random.fold_in(key, rep + 1))
                times.append(time.perf_counter() - t0)
            med = float(np.median(times))
            samples.append((t, b, med))
            print(f"  batch {b:3d} tokens {t:3d}: warm-up {compile_s[f'{b}x{t}']:6.2f} s, median {med:.4f} s "
                  f"({b * t / med:7.0f} tok/s; runs {', '.join(f'{x:.4f}' for x in times)})", flush=True)
    cm, rows = fit_report(samples)
    print()
    print(format_profile_table(cm, rows))
    out = Path(args.out or "benchmarks/results/cost_model.json")
    meta = {"source": "benchmarks/schedule.py --mode profile", "platform": dev.platform,
            "device_kind": dev.device_kind, "jax_version": jax.__version__, "init_from": str(args.init_from),
            "config": str(args.config), "overrides": list(args.overrides),
            "model": {k: int(getattr(pol.model_cfg, k)) for k in
                      ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim")},
            "rollout": {"max_slots": int(r.max_slots), "page_size": int(r.page_size),
                        "max_new_tokens": int(r.max_new_tokens), "attention_impl": engine.attention_impl,
                        "temperature": float(r.temperature)},
            "samples_per_prompt": n, "repeats": int(args.repeats),
            "samples": [[int(t), int(b), float(s)] for t, b, s in samples],
            "rel_error": [r_["rel_error"] for r_ in rows], "warmup_s": compile_s,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    cm.save(out, meta=meta)
    print(f"\nwrote {out} ({time.perf_counter() - t_start:.0f} s in all); use it with "
          f"`--set sched.cost_model={out}` (trainer) or `--cost-model {out}` (this script)")
    return 0


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


def _corr(x, y) -> float:
    """Pearson correlation (nan when either side is constant)."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    if x.size < 2 or x.std() == 0 or y.std() == 0:
        return float("nan")
    return float(np.corrcoef(x, y)[0, 1])


def summarize_workers(per_step: dict[str, list[dict]]) -> dict[str, dict]:
    """Per configuration: the median over the steps of each ``WORKER_METRICS`` entry and of the
    rollout wall time, plus ``bubble_ratio_vs_fifo`` = fifo's median bubble / this median bubble
    (> 1: fewer bubbles than fifo; None without fifo or with a zero bubble)."""
    out = {}
    for name, rows in per_step.items():
        out[name] = {k: float(np.median([r[k] for r in rows])) for k in (*WORKER_METRICS, "wall_s")}
        out[name]["steps"] = len(rows)
    fifo = out.get("fifo", {}).get("sched/bubble_fraction")
    for a in out.values():
        b = a["sched/bubble_fraction"]
        a["bubble_ratio_vs_fifo"] = fifo / b if fifo is not None and b > 0 else None
    return out


def format_workers_table(summary: dict[str, dict]) -> str:
    """Markdown table of ``summarize_workers``'s medians."""
    lines = ["| config | bubble fraction | fifo bubble / bubble | earliest-finisher idle | makespan (s) "
             "| migrated share | predicted makespan (s) |", "|---|---:|---:|---:|---:|---:|---:|"]
    for name, a in summary.items():
        ratio = f"{a['bubble_ratio_vs_fifo']:.2f}x" if a["bubble_ratio_vs_fifo"] else "-"
        lines.append(f"| {name} | {a['sched/bubble_fraction']:.1%} | {ratio} | "
                     f"{a['sched/earliest_finisher_idle']:.1%} | {a['time/rollout_makespan_s']:.3f} | "
                     f"{a['sched/migrated_share']:.2%} | {a['sched/predicted_makespan_s']:.3f} |")
    return "\n".join(lines)


def warm_up(engines, states, sampling, *, threads: int = 0) -> list[float]:
    """Compile every step shape of every engine (``engine.warmup(state, sampling,
    draft_buckets=(0,))``) before anything is timed; returns the seconds per engine.

    Each engine sits on its own device, so XLA compiles its programs separately (the persistent
    cache makes later runs cheap). Compilation is mostly single-threaded, so engines are warmed up
    ``threads`` at a time (0 = one per host CPU core, at most one per engine).
    """
    from concurrent.futures import ThreadPoolExecutor

    def one(w):
        t0 = time.perf_counter()
        shapes = engines[w].warmup(states[w], sampling, draft_buckets=(0,))
        dt = time.perf_counter() - t0
        print(f"  warm-up worker {w}: {shapes} step shapes compiled in {dt:.1f} s", flush=True)
        return dt

    n = max(1, min(len(engines), threads or os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=n, thread_name_prefix="warmup") as pool:
        return list(pool.map(one, range(len(engines))))


def run_workers_mode(args) -> int:
    """``--mode workers``: the four configurations on W real rollout workers.

    W engines on ``rollout_meshes(1, W)`` (one device each), the params resharded into each
    worker's layout, every engine warmed up (compiled) before timing. For each step of
    ``--start-step .. + --steps`` of ``--run-dir``'s saved rollouts: that step's prompts (n samples
    each, prompt ids as the trainer built them), the predictions from each prompt's previous
    occurrence (``worker_steps``), the trainer's key for the step; every configuration of
    ``WORKER_CONFIGS`` runs ``RolloutScheduler.rollout`` on the same inputs (configurations
    interleaved per step, so drift of the machine hits all alike). No HistoSpec drafter: only the
    scheduling differs. Medians over the steps go to a markdown table and JSON.
    """
    import jax

    W = int(args.workers)
    if jax.device_count() < W:
        raise BenchSetupError(
            f"--mode workers --workers {W} needs {W} devices (one per worker); JAX sees {jax.device_count()} "
            f"({jax.default_backend()}). On CPU start it with one fake device per worker:\n"
            f"  XLA_FLAGS=--xla_force_host_platform_device_count={W} python benchmarks/schedule.py --mode workers "
            f"--workers {W}")
    if args.cost_model:
        CostModel.load(args.cost_model)  # fail early on a bad file
    from rhyme_jax.config import load_config
    from rhyme_jax.parallel.mesh import rollout_meshes
    from rhyme_jax.parallel.reshard import reshard
    from rhyme_jax.parallel.rules import param_shardings
    from rhyme_jax.rollout.engine import SamplingParams
    from rhyme_jax.sched.scheduler import RolloutScheduler
    from rhyme_jax.train.policy import eos_ids
    from rhyme_jax.train.trainer import make_engine

    t_start = time.perf_counter()
    batches = worker_steps(args.run_dir, args.start_step, args.steps)  # fail before building anything
    _require_params(args.init_from)
    _enable_compile_cache(args.jax_cache)
    pol = load_policy(args.config, args.overrides, args.init_from, args.run_dir)
    cfg, r = pol.cfg, pol.cfg.rollout
    max_new = int(r.max_new_tokens)
    meshes = rollout_meshes(1, W)
    eos = eos_ids(pol.model_cfg, pol.tokenizer)
    engines = [make_engine(pol.graphdef, pol.model_cfg, cfg, eos, mesh=m) for m in meshes]
    states = [reshard(pol.state, param_shardings(pol.state, m)) for m in meshes]
    sampling = SamplingParams(temperature=r.temperature, top_k=r.top_k, top_p=r.top_p, max_new_tokens=max_new)
    cm_set = [f"sched.cost_model={args.cost_model}"] if args.cost_model else []
    scheds = {name: RolloutScheduler(engines, load_config(args.config, [*args.overrides, *sets, *cm_set]).sched,
                                     max_new) for name, sets in WORKER_CONFIGS.items()}
    cost = next(iter(scheds.values())).cost_model
    cost_src = args.cost_model or cfg.sched.cost_model or "placeholder defaults"
    print(f"HistoPipe workers: W={W} engines on {jax.default_backend()} devices "
          f"{[m.devices.ravel()[0].id for m in meshes]} ({os.cpu_count()} host CPU cores), params {args.init_from}, "
          f"steps {[st.step for st, _ in batches]} of {args.run_dir}, temperature {r.temperature}, "
          f"max_new_tokens {max_new}; planner cost model a={cost.a:.4g} s, b={cost.b:.4g} s, c={cost.c:.4g} s "
          f"({cost_src})", flush=True)
    t0 = time.perf_counter()
    warm = warm_up(engines, states, sampling, threads=args.warmup_threads)
    print(f"  warm-up done in {time.perf_counter() - t0:.1f} s", flush=True)

    per_step: dict[str, list[dict]] = {name: [] for name in scheds}
    intervals: dict[str, dict[int, list]] = {name: {} for name in scheds}
    for st, hist in batches:
        ids, n = st.prompt_ids, int(st.lengths.shape[1])
        prompts = [pol.prompt_tokens(int(i)) for i in ids for _ in range(n)]
        key = jax.random.fold_in(jax.random.key(cfg.run.seed), st.step)
        pred = predict_lengths(hist, ids, cfg.sched.length_stat, default=max_new / 2)
        seen = sum(int(p) in hist for p in ids.tolist())
        print(f"step {st.step}: {len(ids)} prompts x {n} samples, {seen} with history; prediction vs the demo "
              f"run's own lengths at this step: r = {_corr(pred, st.lengths.mean(1)):.2f}", flush=True)
        for name, sch in scheds.items():
            t0 = time.perf_counter()
            sr = sch.rollout(st.step, states, ids, prompts, n, sampling, key, history=hist)
            wall = time.perf_counter() - t0
            lengths = np.array([len(t) for t in sr.result.tokens])
            row = {"step": st.step, "wall_s": wall, **{k: float(sr.metrics[k]) for k in WORKER_METRICS},
                   "generated_tokens": int(lengths.sum()), "mean_length": float(lengths.mean()),
                   "prediction_corr": _corr(pred, lengths.reshape(-1, n).mean(1)),
                   "worker_rows": [int(w.size) for w in sr.plan.worker_rows],
                   "intervals": [[iv.worker, iv.start, iv.end, iv.kind] for iv in sr.intervals]}
            per_step[name].append(row)
            intervals[name][st.step] = sr.intervals
            print(f"  {name:22s} bubble {row['sched/bubble_fraction']:6.1%}  earliest-finisher idle "
                  f"{row['sched/earliest_finisher_idle']:6.1%}  makespan {row['time/rollout_makespan_s']:6.3f} s  "
                  f"migrated {row['sched/migrated_share']:5.1%}  rows/worker {row['worker_rows']}  "
                  f"mean length {row['mean_length']:.1f} (r vs prediction {row['prediction_corr']:.2f})", flush=True)

    summary = summarize_workers(per_step)
    table = format_workers_table(summary)
    print(f"\nMedians over {len(batches)} steps (W={W}; wall-clock on {os.cpu_count()} host cores shared by "
          f"the W worker threads):\n")
    print(table)
    out = Path(args.out or "benchmarks/results/schedule_workers.json")
    doc = {"settings": {"workers": W, "steps": [st.step for st, _ in batches], "run_dir": str(args.run_dir),
                        "init_from": str(args.init_from), "config": str(args.config),
                        "overrides": list(args.overrides), "platform": jax.default_backend(),
                        "device_kind": jax.devices()[0].device_kind, "host_cpus": os.cpu_count(),
                        "xla_flags": os.environ.get("XLA_FLAGS", ""), "jax_version": jax.__version__,
                        "cost_model": {"a": cost.a, "b": cost.b, "c": cost.c, "source": cost_src},
                        "sampling": {"temperature": float(r.temperature), "max_new_tokens": max_new},
                        "length_stat": cfg.sched.length_stat, "growth": float(cfg.sched.growth),
                        "tail_fraction": float(cfg.sched.tail_fraction),
                        "configs": WORKER_CONFIGS, "warmup_s": warm,
                        "total_s": time.perf_counter() - t_start},
           "summary": summary, "per_step": per_step}
    with atomic_write(out, "w") as fh:
        json.dump(doc, fh, indent=1)
    with atomic_write(out.with_suffix(".md"), "w") as fh:
        fh.write(table + "\n")
    print(f"\nwrote {out} and {out.with_suffix('.md')} ({time.perf_counter() - t_start:.0f} s in all)")
    if args.gantt:
        for name in ("fifo", WORKER_FULL):
            png = out.with_name(f"{out.stem}_gantt_{name.replace('+', '_')}.png")
            plot_gantt(intervals[name], png, num_workers=W, title=f"{name} ({W} real workers)")
            print(f"wrote {png}")
    return 0


def main(argv=None) -> int:
    """Command line entry point; returns the exit status (2: a prerequisite is missing)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--mode", choices=["replay", "profile", "workers"], default="replay",
                    help="replay: saved run lengths through the planner + cost-model simulation (no device); "
                         "profile: measure one rollout worker's cost model T(tokens, batch) and save it; "
                         "workers: the configurations on W real rollout workers (CPU: needs XLA_FLAGS="
                         "--xla_force_host_platform_device_count=W)")
    ap.add_argument("--run-dir", default="runs/demo",
                    help="run whose saved rollouts (replay, workers) and tokenizer (profile, workers) are used")
    ap.add_argument("--workers", type=int, default=4, help="W rollout workers (replay, workers)")
    ap.add_argument("--cost-model", default=None,
                    help="CostModel JSON for the planner (replay, workers); default: the placeholder a, b, c "
                         "(workers: the config's sched.cost_model if set)")
    ap.add_argument("--out", default=None,
                    help="output file; default benchmarks/results/schedule.json (replay), cost_model.json "
                         "(profile), schedule_workers.json (workers)")
    ap.add_argument("--gantt", action="store_true",
                    help="also write Gantt PNGs of fifo and the full configuration (replay, workers)")
    rp = ap.add_argument_group("replay")
    rp.add_argument("--synthetic", action="store_true", help="synthetic lengths instead of a run dir")
    rp.add_argument("--seed", type=int, default=0, help="seed of --synthetic; profile: sampling key")
    rp.add_argument("--groups", type=int, default=0, help="ranking groups (0 = auto: max(1, W // 2))")
    rp.add_argument("--stat", default="mean", choices=["mean", "max", "p90"],
                    help="length prediction from the last rollout (workers: --set sched.length_stat=...)")
    rp.add_argument("--growth", type=float, default=1.5,
                    help="migration: generated > growth x predicted (workers: --set sched.growth=...)")
    rp.add_argument("--tail", type=float, default=0.1,
                    help="migration: at most this share of a worker's rows left (workers: --set "
                         "sched.tail_fraction=...)")
    rp.add_argument("--include-cold", action="store_true", help="also replay steps without any history")
    rp.add_argument("--train-share", type=float, default=0.15,
                    help="training share of a step for the one-step-off columns (paper: rollout is 84-91%%)")
    mp = ap.add_argument_group("profile and workers (real model)")
    mp.add_argument("--config", default="configs/default.yaml", help="run config (the demo's)")
    mp.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="config override, repeatable (e.g. sched.length_stat=p90)")
    mp.add_argument("--init-from", default="runs/demo/sft", help="params to load (run `rhyme-jax sft` first)")
    mp.add_argument("--jax-cache", default=str(Path("runs") / ".jax_cache"),
                    help="persistent XLA compilation cache dir ('' = off)")
    mp.add_argument("--repeats", type=int, default=3, help="profile: timed generate calls per grid point")
    mp.add_argument("--start-step", type=int, default=11,
                    help="workers: first replayed step (11 = epoch 2 of the demo, every prompt has history)")
    mp.add_argument("--steps", type=int, default=6, help="workers: number of steps")
    mp.add_argument("--warmup-threads", type=int, default=0,
                    help="workers: engines compiled concurrently (0 = one per host CPU core)")
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.steps < 1 or args.workers < 1:
        ap.error("--repeats, --steps and --workers must be >= 1")
    try:
        if args.mode == "profile":
            return run_profile(args)
        if args.mode == "workers":
            return run_workers_mode(args)
        return run_replay(args)
    except (BenchSetupError, CostModelError) as exc:
        print(f"benchmarks/schedule.py: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
