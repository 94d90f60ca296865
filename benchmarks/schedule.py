"""HistoPipe scheduling benchmark (issue 6): replay, cost-model profile, real workers.

Three modes:

* ``--mode replay`` (default, part a): saved run lengths through the planner and a cost-model
  simulation of the workers; no model, no device (below).
* ``--mode profile``: the cost model ``T(tokens, batch)`` of ONE rollout worker on the demo policy,
  fitted to the engine's pass-cost profile (``CostModel.from_pass_cost``), checked against timed
  ``generate`` calls and saved for the planner (``sched.cost_model``); see ``run_profile``.
* ``--mode workers``: the same plans on W real rollout workers (one engine per device, driven by
  ``RolloutScheduler``) over a few steps of the demo run's prompts; see ``run_workers_mode``. On
  CPU it must be started with ``XLA_FLAGS=--xla_force_host_platform_device_count=W``.

``--mode replay`` replays the response lengths a real run saved
(``<run_dir>/rollouts/step_*.npz``, ``train/rollout_log.py``) through the planner
(``rhyme_jax/sched/planner.py``; the replay is ``rhyme_lab/schedule/replay.py``) and simulates the rollout workers with the cost model; no model,
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

    python -m benchmarks.schedule                          # replay runs/demo, W = 4
    python -m benchmarks.schedule --workers 8 --stat p90
    python -m benchmarks.schedule --synthetic              # no run dir needed
    python -m benchmarks.schedule --mode profile           # -> benchmarks/results/cost_model.json
    export XLA_FLAGS=--xla_force_host_platform_device_count=4   # CPU: one fake device per worker
    python -m benchmarks.schedule --mode workers --workers 4 --cost-model benchmarks/results/cost_model.json

Replay writes ``benchmarks/results/schedule.json`` (and Gantt PNGs with ``--gantt``), profile
``benchmarks/results/cost_model.json``, workers ``benchmarks/results/schedule_workers.json`` (and
``.md``); each prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rhyme_lab.bench.schedule_real import run_profile, run_workers_mode
from rhyme_jax.io.atomic import atomic_write
from rhyme_jax.sched.cost_model import DEFAULT_COST_MODEL, CostModel, CostModelError
from rhyme_lab.schedule.profile import BenchSetupError
from rhyme_lab.schedule.replay import FULL, format_table, load_steps, replay, synthetic_steps
from rhyme_jax.sched.timeline import plot_gantt


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


def main(argv=None) -> int:
    """Command line entry point; returns the exit status (2: a prerequisite is missing)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--mode", choices=["replay", "profile", "workers"], default="replay",
                    help="replay: saved run lengths through the planner + cost-model simulation (no device); "
                         "profile: one rollout worker's cost model T(tokens, batch) from its pass-cost profile, "
                         "checked on a grid of generate calls, saved; "
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
                    help="training share of a step: replay one-step-off columns, workers cross-step update sleep "
                         "(paper: rollout is 84-91%%)")
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
        print(f"python -m benchmarks.schedule: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
