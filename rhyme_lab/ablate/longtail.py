"""L5: the paper's regime at CPU scale, on the ledger task's learning run (``configs/longtail.yaml``).

One GRPO run (unit ``longtail_goodput_paired``: every rollout decoded plain and with HistoSpec's
goodput drafter back to back on the same weights, prompts and key, ``paired.PairedRollouts``)
gives, per epoch of its prompts:

* the response-length distribution (p50, p90, p99, max of the saved rollouts) beside the reward;
* the rollout share of a step, as a plain step would have it: plain rollout seconds over plain
  rollout plus the rest of the step (the update included);
* HistoSpec's paired rollout ratio, its acceptance, and the end-to-end ratio of the step
  (``learning.paired_epochs``);
* HistoPipe on 4 rollout workers against fifo: the run's own steps replayed through the planner
  and the worker simulation (``rhyme_lab.schedule.replay``) under the cost model fitted to the
  run's own plain rollouts (``rollout_fit``: seconds against passes, row-passes and rows), since the 4 workers of a 2-core CPU
  would share its cores; makespan ratio, the workers' idle share, migrated rows; and one Gantt
  plot of the most tail-heavy step, fifo beside HistoPipe.

The held-out gain of each learning seed (``longtail_plain_seed0``: the paired unit's tokens with
HistoSpec off; ``longtail_plain_seed1``: run seed 1), on 400 problems, is the paired difference of greedy accuracy on the same problems before and after GRPO
(``io.summary.paired_gain``), with its z.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np

from rhyme_lab.ablate.compose import cell as compose_cell
from rhyme_lab.ablate.compose import system_figures, whole_system
from rhyme_lab.ablate.learning import by_epoch, paired_epochs
from rhyme_lab.ablate.measures import Inputs, MissingInput, figure, ratio_of_sums
from rhyme_lab.ablate.regime_flops import table_lines as flop_lines

PAIRED_UNIT = "longtail_goodput_paired"
SEED_UNITS = ("longtail_plain_seed0", "longtail_plain_seed1")  # the held-out gain of two seeds
REAL_UNIT = "longtail_smollm2_paired"  # optional: SmolLM2 at 1,024 new tokens (run by hand, quick)
RECUR_UNIT = "longtail_recur_paired"  # L6: 48 steps over 192 prompts seen twice, paired, held-out gain (by hand)
BOUND_UNIT = "longtail_bound_paired"  # optional: the always-right oracle beside the run's drafter (run by hand, quick)
WORKERS = 4
PROMPT_TOKENS = 64.0  # a sample's prefill in the cost model (the ledger prompts' median is ~44 tokens, p90 ~100)


def length_stats(lengths: np.ndarray) -> dict:
    """p50 / p90 / p99 / max and mean of response lengths (tokens)."""
    x = np.asarray(lengths, np.float64).ravel()
    q = np.percentile(x, [50, 90, 99]) if x.size else [float("nan")] * 3
    return {"p50": float(q[0]), "p90": float(q[1]), "p99": float(q[2]), "max": float(x.max(initial=0)),
            "mean": float(x.mean()) if x.size else float("nan"), "rows": int(x.size)}


def epoch_table(r: dict) -> list[dict]:
    """Per epoch of a paired unit: lengths, reward, rollout share, HistoSpec ratios, acceptance."""
    from rhyme_lab.schedule.replay import load_steps

    saved, _ = load_steps(r["run_dir"])
    lengths = {st.step: st.lengths for st in saved}
    scored = scored_rewards(r["run_dir"])
    paired = paired_epochs(r)
    rows = []
    for ep, st in sorted(by_epoch(r).items()):
        plain = np.array([s["plain"]["seconds"] for s in st])
        rest = np.array([s["wall_s"] - s["plain"]["seconds"] - s["spec"]["seconds"] for s in st])
        share, share_se = ratio_of_sums(plain, plain + rest)
        steady = np.array([s.get("compiles", 1) == 0 for s in st])  # steps that compiled nothing (rollout or update)
        steady_share = ratio_of_sums(plain[steady], (plain + rest)[steady])[0] if steady.any() else None
        drafted = sum(s.get("spec/drafted_tokens", 0.0) for s in st)
        lens = [lengths[s["step"]] for s in st if s["step"] in lengths]
        rows.append({"epoch": ep, "steps": len(st),
                     "reward": float(np.mean([scored.get(s["step"], s.get("reward/mean")) for s in st])),
                     **length_stats(np.concatenate([x.ravel() for x in lens]) if lens else np.zeros(0)),
                     "rollout_share": share, "rollout_share_se": share_se,
                     "rollout_share_steady": steady_share, "steady_steps": int(steady.sum()),
                     "plain_rollout_s": float(plain.mean()), "rest_s": float(rest.mean()),
                     "acceptance": sum(s.get("spec/accepted_tokens", 0.0) for s in st) / drafted if drafted else None,
                     **{f"histospec_{k}": v for k, v in paired.get(ep, {}).items() if k != "steps"}})
    return rows


def scored_rewards(run_dir: str | Path) -> dict[int, float]:
    """Each saved step's mean reward over every row it rolled out (``rollouts/step_*.npz``): with
    ``grpo.dynamic_sampling`` the step's ``reward/mean`` covers only the groups it trained."""
    from rhyme_jax.io.rollout_log import list_rollout_steps, load_rollouts

    return {s: float(np.mean(load_rollouts(run_dir, s)["rewards"])) for s in list_rollout_steps(Path(run_dir))}


def held_out(run_dir: str | Path, steps: int) -> dict | None:
    """Held-out accuracy before and after ``steps`` GRPO steps and the paired gain (mean, standard
    error, z) from the run's per-problem eval files: greedy, and where the run sampled
    (``run.eval_samples``) the mean@k under ``"sampled"`` (each problem's share of its k samples
    correct, paired the same way); None where either file is missing."""
    from rhyme_jax.io.summary import eval_path, paired_gain

    first, last = eval_path(Path(run_dir), 0), eval_path(Path(run_dir), steps)
    if not (first.is_file() and last.is_file()):
        return None
    a, b = np.load(first), np.load(last)
    out = _gain(a["correct"], b["correct"], paired_gain)
    if a["sampled"].size and a["sampled"].shape == b["sampled"].shape:
        out["sampled"] = _gain(a["sampled"], b["sampled"], paired_gain)
    return out


def _gain(a: np.ndarray, b: np.ndarray, paired_gain) -> dict:
    gain, se = paired_gain(a, b)
    return {"before": float(np.mean(a)), "after": float(np.mean(b)), "gain": gain, "se": se,
            "z": gain / se if se > 0 else None, "n": int(a.size)}


def rollout_fit(r: dict):
    """``(CostModel, r2, steps)`` fitted to the run's own plain rollouts, or None with fewer than 3.

    Each step's plain rollout (the paired unit's ``plain`` record, else the step's own rollout)
    decoded its rows in ``forward_passes`` passes over ``sequence_steps`` row-passes, so under
    the planner's model its seconds are ``a * passes + b * row_steps + c * rows``
    (``CostModel.decode_cost``). (a, b, c) >= 0 minimise the squared error over the steps
    (non-negative least squares by enumerating the active sets of the 3 coefficients); ``r2`` is
    the fit's coefficient of determination. The passes ran at their live context lengths, so
    this is the cost of the run's passes, not of a profile at the pool's full width.
    """
    from rhyme_jax.sched.cost_model import CostModel

    rows = float(r.get("rows_per_step", 0))
    x, y = [], []
    for s in r.get("steps", []):
        p = s.get("plain") or {"seconds": s.get("time/rollout_s"), "forward_passes": s.get("rollout/forward_passes"),
                               "sequence_steps": s.get("rollout/generated_tokens")}
        if p.get("seconds") and p.get("forward_passes") and p.get("sequence_steps"):
            x.append([p["forward_passes"], p["sequence_steps"], rows])
            y.append(p["seconds"])
    if len(y) < 3:
        return None
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    best = None
    for mask in range(1, 8):
        cols = [i for i in range(3) if mask >> i & 1]
        coef, *_ = np.linalg.lstsq(x[:, cols], y, rcond=None)
        if np.any(coef < 0):
            continue
        full = np.zeros(3)
        full[cols] = coef
        err = float(np.sum((x @ full - y) ** 2))
        if best is None or err < best[1]:
            best = (full, err)
    full, err = best if best is not None else (np.zeros(3), float(np.sum(y ** 2)))
    total = float(np.sum((y - y.mean()) ** 2))
    return CostModel(*full), (1.0 - err / total if total > 0 else None), len(y)


def cost_model(r: dict, prompt_tokens: float):
    """``(cost model, source)``: fitted to the run's own plain rollouts (``rollout_fit``), else to
    its pass-cost profile (passes timed at the pool's full context width: far above a live pass
    at this task's lengths), else the planner's placeholder."""
    from rhyme_jax.sched.cost_model import DEFAULT_COST_MODEL, CostModel, CostModelError

    fit = rollout_fit(r)
    if fit is not None:
        r2 = "-" if fit[1] is None else f"{fit[1]:.3f}"
        return fit[0], f"fitted to the run's {fit[2]} plain rollouts (seconds = a passes + b row-passes + c rows; R^2 {r2})"
    prof = r.get("step_cost", {}).get("profiled", [])
    try:
        return CostModel.from_pass_cost(SimpleNamespace(seconds={tuple(x[:3]): x[3] for x in prof}),
                                        prompt_tokens), "fitted to the run's pass-cost profile"
    except CostModelError as exc:
        return DEFAULT_COST_MODEL, f"placeholder ({exc})"


def makespan_bound(lengths: np.ndarray, cm, workers: int) -> float:
    """A lower bound on any placement's makespan of one step (seconds, under the cost model
    ``T = tokens x (a + b x batch) + c x batch``): the longest row decoding alone on a worker
    (``(a + b) L_max + c``; no placement or migration shortens a row's own serial decode), or the
    per-row work ``b sum(L) + c N`` split evenly over the workers, whichever is larger."""
    x = np.asarray(lengths, np.float64).ravel()
    if not x.size:
        return 0.0
    return max((cm.a + cm.b) * x.max() + cm.c, (cm.b * x.sum() + cm.c * x.size) / workers)


def oracle_grouped(lengths: np.ndarray, cm, workers: int) -> float:
    """The makespan (seconds) of the best placement that knows every row's length and gives each
    worker a contiguous run of the rows sorted by length, under ``CostModel.decode_cost``
    (``a max(L) + b sum(L) + c rows`` a worker, all its rows admitted at once). Exact over such
    placements (dynamic programming over the cut points); an upper bound on the optimum.

    When the per-pass cost ``a`` dominates, a worker's time is set by its longest row, so the step
    is shortest when the longest rows share their workers with few other rows: the row-level view
    that a placement of whole prompts by their history cannot take when one prompt's samples
    differ in length by tens of times.
    """
    x = np.sort(np.asarray(lengths, np.float64).ravel())[::-1]
    n = x.size
    if not n:
        return 0.0
    total = np.concatenate([[0.0], np.cumsum(x)])
    best = np.full(n + 1, np.inf)
    best[0] = 0.0
    for _ in range(min(workers, n)):  # best[j]: rows 0..j-1 over the workers so far
        nxt = best.copy()
        for j in range(1, n + 1):
            i = np.arange(j)
            cost = cm.a * x[i] + cm.b * (total[j] - total[i]) + cm.c * (j - i)
            nxt[j] = min(nxt[j], float(np.min(np.maximum(best[i], cost))))
        best = nxt
    return float(best[n])


def oracle_prompts(lengths: np.ndarray, cm, workers: int) -> float:
    """The makespan (seconds) of the best placement of whole prompts that knows each prompt's
    lengths this step (``lengths int[P, n]``: a prompt's ``n`` samples stay on one worker, as
    HistoSpec's groups and HistoPipe's tiers place them), under ``CostModel.decode_cost`` per
    worker (``a max(L) + b sum(L) + c rows``): ``sched.exact_placement.best_subsets`` on the true
    lengths. A placement that keeps prompts whole cannot do better, whatever it predicts.

    Raises:
      ValueError: more than ``exact_placement.MAX_PROMPTS`` prompts in the step.
    """
    from rhyme_jax.sched.exact_placement import best_subsets

    return best_subsets(lengths, cm, workers)[0]


def history_dp(steps, cm, workers: int) -> dict[int, float]:
    """``{step: makespan}`` of whole-prompt placements planned from history: for each step whose
    prompts all have a previous rollout, ``best_subsets`` over those previous lengths (each
    prompt's last ``n`` lengths stand for its samples now), the plan then timed on the step's true
    lengths under the same cost model (all of a worker's rows admitted at once). The planner's
    ``sched.placement: exact`` plans from one predicted length per prompt instead and is replayed
    with admission and migration (``placement``'s ``exact_ratio``)."""
    from rhyme_jax.sched.exact_placement import best_subsets, prompts_of

    last, out = {}, {}
    for st in steps:
        ids, x = st.prompt_ids.tolist(), np.asarray(st.lengths, np.float64)
        if all(p in last for p in ids):
            _, masks = best_subsets(np.stack([last[p] for p in ids]), cm, workers)
            out[st.step] = max(cm.decode_cost(x[prompts_of(m, len(ids))].ravel()) for m in masks)
        for p, lens in zip(ids, x):
            last[p] = lens
    return out


def length_rhyme(steps) -> dict:
    """How well a prompt's last rollout predicts its lengths now (RhymeRL s.3: "length ranks
    barely move"), over the prompts of ``steps`` (``replay.StepLengths``) seen before: the rank
    correlation (Spearman, no ties correction) of the prompt's previous and current mean length and
    max length, and the share of rows longer than twice the longest row of the prompt's previous
    rollout (a tail no prompt-level history predicts). None-valued where fewer than 3 prompts recur."""
    last, prev_mean, now_mean, prev_max, now_max, over, rows = {}, [], [], [], [], 0, 0
    for st in steps:
        for pid, lens in zip(st.prompt_ids.tolist(), np.asarray(st.lengths, np.float64)):
            if pid in last:
                old = last[pid]
                prev_mean.append(old.mean()); now_mean.append(lens.mean())
                prev_max.append(old.max()); now_max.append(lens.max())
                over += int(np.sum(lens > 2 * old.max())); rows += lens.size
            last[pid] = lens
    rank = lambda v: np.argsort(np.argsort(v)).astype(np.float64)  # noqa: E731
    corr = (lambda a, b: float(np.corrcoef(rank(a), rank(b))[0, 1])) if len(prev_mean) >= 3 else (lambda a, b: None)
    return {"prompts": len(prev_mean), "spearman_mean": corr(prev_mean, now_mean),
            "spearman_max": corr(prev_max, now_max), "rows_over_2x_prev_max": over / rows if rows else None}


def placement(r: dict, out: Path | None = None, gantt: str = "gantt_longtail.png") -> dict:
    """HistoPipe against fifo on ``WORKERS`` simulated workers over the run's steps with history:
    its tiers (tier 1 + 2 + tail migration: ``makespan_ratio``), whole prompts placed exactly
    (``exact_ratio``) and every prompt's samples spread over the workers (``sched.placement:
    spread``, ``spread_ratio``), beside the oracles and the bound; with ``out``,
    ``out / gantt``: the step where fifo's longest row exceeds its median row most, fifo
    beside the spread placement on one time axis."""
    from rhyme_jax.sched.timeline import plot_gantt
    from rhyme_lab.schedule.replay import FULL, load_steps, replay

    steps, max_new = load_steps(r["run_dir"])
    cm, source = cost_model(r, PROMPT_TOKENS)
    res = replay(steps, num_workers=WORKERS, cost=cm, max_new_tokens=max_new)
    fifo, full, exact = res["configs"]["fifo"], res["configs"][FULL], res["configs"]["exact+mig"]
    spread = res["configs"]["spread+mig"]
    per_fifo = {x["step"]: x for x in res["per_step"]["fifo"]}
    per_full = {x["step"]: x for x in res["per_step"][FULL]}
    per_spread = {x["step"]: x for x in res["per_step"]["spread+mig"]}
    ratios = np.array([per_fifo[s]["makespan_s"] / per_full[s]["makespan_s"] for s in per_fifo])
    bound = sum(makespan_bound(st.lengths, cm, WORKERS) for st in steps if st.step in per_fifo)
    oracle = sum(oracle_grouped(st.lengths, cm, WORKERS) for st in steps if st.step in per_fifo)
    prompts = sum(oracle_prompts(st.lengths, cm, WORKERS) for st in steps if st.step in per_fifo)
    planned = history_dp(steps, cm, WORKERS)
    fifo_planned = sum(per_fifo[s]["makespan_s"] for s in planned if s in per_fifo)
    planned_total = sum(v for s, v in planned.items() if s in per_fifo)
    doc = {"steps": res["replayed_steps"], "makespan_ratio": fifo["makespan_s"] / full["makespan_s"],
           "bound_ratio": fifo["makespan_s"] / bound if bound else None,
           "of_bound": bound / full["makespan_s"] if bound else None,
           "oracle_ratio": fifo["makespan_s"] / oracle if oracle else None,
           "prompt_oracle_ratio": fifo["makespan_s"] / prompts if prompts else None,
           "of_prompt_oracle": prompts / full["makespan_s"] if prompts else None,
           "history_dp_ratio": fifo_planned / planned_total if planned_total else None,
           "exact_ratio": fifo["makespan_s"] / exact["makespan_s"], "idle_exact": exact["bubble_fraction"],
           "spread_ratio": fifo["makespan_s"] / spread["makespan_s"], "idle_spread": spread["bubble_fraction"],
           "spread_of_bound": bound / spread["makespan_s"] if bound else None,
           "spread_of_oracle": oracle / spread["makespan_s"] if oracle else None,
           "step_ratio_min": float(ratios.min()) if ratios.size else None,
           "step_ratio_max": float(ratios.max()) if ratios.size else None,
           "idle_fifo": fifo["bubble_fraction"], "idle_histopipe": full["bubble_fraction"],
           "migrated_share": full["migrated_share"],
           "cost_model": {"a": cm.a, "b": cm.b, "c": cm.c, "source": source}, "length_rhyme": length_rhyme(steps),
           "per_step": {s: {"fifo": per_fifo[s]["makespan_s"], "spread": per_spread[s]["makespan_s"]} for s in per_fifo}}
    if out is not None and per_fifo:
        tail = {st.step: float(st.lengths.max() / max(np.median(st.lengths), 1.0)) for st in steps}
        worst = max(per_fifo, key=lambda s: tail.get(s, 0.0))
        doc["gantt_step"] = worst
        doc["gantt"] = str(plot_gantt({0: res["intervals"]["fifo"][worst], 1: res["intervals"]["spread+mig"][worst]},
                                      Path(out) / gantt, num_workers=WORKERS, same_scale=True,
                                      labels={0: f"fifo, step {worst}", 1: f"HistoPipe (spread), step {worst}"},
                                      title="ledger task: one tail-heavy step on 4 rollout workers (replayed)"))
    return doc


def table_lines(rows: list[dict]) -> list[str]:
    """The per-epoch markdown table."""
    f = lambda v, fmt="{:.2f}": "-" if v is None or (isinstance(v, float) and not np.isfinite(v)) else fmt.format(v)  # noqa: E731
    lines = ["| epoch | steps | reward | length p50 / p90 / p99 / max | rollout share (steps without a compile) | "
             "HistoSpec rollout x | acceptance | end-to-end x |", "|" + "---|" * 8]
    for x in rows:
        steady = f"{f(x.get('rollout_share_steady'), '{:.1%}')}, {x.get('steady_steps', 0)}"
        lines.append(f"| {x['epoch']} | {x['steps']} | {f(x['reward'], '{:.3f}')} | {x['p50']:.0f} / {x['p90']:.0f} / "
                     f"{x['p99']:.0f} / {x['max']:.0f} | {f(x['rollout_share'], '{:.1%}')} ({steady}) | "
                     f"{f(x.get('histospec_rollout'))} ± {f(x.get('histospec_rollout_se'))} | "
                     f"{f(x['acceptance'], '{:.1%}')} | {f(x.get('histospec_e2e'))} ± {f(x.get('histospec_e2e_se'))} |")
    return lines


def l5(inp: Inputs) -> dict:
    """L5 (module docstring): the per-epoch table, the held-out gains, the HistoPipe replay."""
    return regime(inp, PAIRED_UNIT, SEED_UNITS, "gantt_longtail.png")


def l6(inp: Inputs) -> dict:
    """L6: L5's figures over the run that both learns and recurs (``RECUR_UNIT``: 48 steps over 192
    prompts seen twice, paired HistoSpec), its own held-out gain on 400 problems."""
    return regime(inp, RECUR_UNIT, (RECUR_UNIT,), "gantt_longtail_recur.png")


def regime(inp: Inputs, paired_unit: str, seed_units: tuple[str, ...], gantt: str) -> dict:
    """The per-epoch table of the paired unit ``paired_unit``, the held-out gains of the units
    ``seed_units`` that evaluated (``Unit.held_out``), the HistoPipe replay over the paired unit's
    steps (Gantt plot ``gantt`` under the suite's output), the bound and SmolLM2 units where run."""
    r = inp.unit(paired_unit)
    rows = epoch_table(r)
    later = [x for x in rows if x["epoch"] >= 2]
    figs = []
    for x in rows:
        v = f"epoch {x['epoch']}"
        figs += [figure("rollout share of the step (plain)", v, x["rollout_share"], x["rollout_share_se"], x["steps"]),
                 figure("HistoSpec paired rollout speed-up", v, x.get("histospec_rollout"),
                        x.get("histospec_rollout_se"), x["steps"]),
                 figure("HistoSpec end-to-end ratio", v, x.get("histospec_e2e"), x.get("histospec_e2e_se"), x["steps"])]
    gains = {}
    for name in seed_units:
        try:
            u = inp.unit(name)
        except MissingInput:
            continue
        g = held_out(u["run_dir"], max(s["step"] for s in u["steps"]))
        if g:
            gains[name] = g
            figs.append(figure("held-out greedy accuracy gain (paired)", name, g["gain"], g["se"], g["n"]))
            if "sampled" in g:
                sg = g["sampled"]
                figs.append(figure("held-out sampled accuracy (mean@k) gain (paired)", name, sg["gain"], sg["se"], sg["n"]))
    sched = placement(r, inp.out, gantt)
    figs += [figure("HistoPipe makespan ratio vs fifo (replayed, 4 workers)", "epochs with history",
                    sched["makespan_ratio"], n=sched["steps"]),
             figure("bound on any placement's makespan ratio vs fifo", "epochs with history", sched["bound_ratio"],
                    n=sched["steps"]),
             figure("HistoPipe spread placement's makespan ratio vs fifo (replayed, 4 workers)", "epochs with history",
                    sched["spread_ratio"], n=sched["steps"]),
             figure("exact-length grouped placement's makespan ratio vs fifo (oracle)", "epochs with history",
                    sched["oracle_ratio"], n=sched["steps"]),
             figure("best whole-prompt placement's makespan ratio vs fifo (oracle)", "epochs with history",
                    sched["prompt_oracle_ratio"], n=sched["steps"])]
    cells = []
    if later:
        roll = [x["histospec_rollout"] for x in later if x.get("histospec_rollout")]
        cells.append(f"epochs 2-{later[-1]['epoch']}: HistoSpec {min(roll):.2f}-{max(roll):.2f}x rollout" if roll
                     else "no paired epoch with history")
    cells.append(f"rollout {min(x['rollout_share'] for x in rows):.0%}-{max(x['rollout_share'] for x in rows):.0%} "
                 f"of the step" if rows else "no steps")
    cells.append(f"HistoPipe {sched['spread_ratio']:.2f}x makespan with sched.placement spread (idle "
                 f"{sched['idle_fifo']:.0%} -> {sched['idle_spread']:.0%}; {sched['spread_of_bound']:.0%} of the bound), "
                 f"{sched['makespan_ratio']:.2f}x with its tiers, {sched['exact_ratio']:.2f}x with "
                 f"sched.placement exact (replayed; the best whole-prompt placement "
                 f"{sched['prompt_oracle_ratio']:.2f}x, the same planned exactly from the last rollout's lengths "
                 f"{_x(sched['history_dp_ratio'])}, the exact-length grouped placement "
                 f"{sched['oracle_ratio']:.2f}x, any placement at most {sched['bound_ratio']:.2f}x), "
                 f"idle with the tiers {sched['idle_fifo']:.0%} -> {sched['idle_histopipe']:.0%}")
    system = whole_system(r, sched["per_step"])
    figs += system_figures(system)
    cells += [compose_cell(system)] if system else []
    lr = sched["length_rhyme"]
    if lr["spearman_mean"] is not None:
        cells.append(f"length ranks from the prompt's last rollout: Spearman {lr['spearman_mean']:.2f} (mean), "
                     f"{lr['spearman_max']:.2f} (max); {lr['rows_over_2x_prev_max']:.1%} of rows past twice its last max")
    cells += [f"{n}: held-out {gain_cell(g)}" + (f"; sampled mean@k {gain_cell(g['sampled'])}" if "sampled" in g else "")
              for n, g in gains.items()]
    details = "\n".join(table_lines(rows))
    flops = _flop_rates(r)
    cells += [flops["cell"]] if flops else []
    details += flops["details"] if flops else ""
    bound = _bound(inp, cells, figs)
    real = _real_model(inp)
    if real:
        cells.append(real["cell"])
        details += f"\n\n{REAL_UNIT}:\n" + "\n".join(table_lines(real["epochs"]))
    return {"ours": "; ".join(cells), "figures": figs, "details": details, "epochs": rows,
            "held_out": gains, "histopipe": sched, "whole_system": system, "real_model": real, "histospec_bound": bound,
            "flops": flops["rows"] if flops else None,
            "notes": f"{r['rows_per_step']} rows per step, 1 rollout worker; HistoPipe replayed on {WORKERS} simulated "
                     f"workers under the cost model fitted to the run's plain rollouts (a, b, c and the fit in 'histopipe')"}


def _bound(inp: Inputs, cells: list, figs: list) -> dict | None:
    """``histospec_bound`` of the bound unit where it ran, its cell and figure appended."""
    try:
        bound = histospec_bound(inp.unit(BOUND_UNIT))
    except MissingInput:
        return None
    if bound:
        cells.append(f"HistoSpec bound (always-right drafts, same engine, {bound['steps']} steps): {bound['bound']:.2f}x "
                     f"rollout; the run's drafter {bound['own']:.2f}x there ({bound['of_bound']:.0%} of the bound)")
        figs.append(figure("HistoSpec bound: always-right oracle rollout speed-up", "epoch 1", bound["bound"],
                           bound["bound_se"], bound["steps"]))
    return bound


def _flop_rates(r: dict) -> dict | None:
    """``regime_flops.epoch_rates`` of the paired unit ``r``: ``{"rows", "cell", "details"}`` (the
    last epoch's rates in words, the table), None where its run's files are gone."""
    from rhyme_lab.ablate.regime_flops import epoch_rates, step_flops

    try:
        rows = epoch_rates(r, step_flops(r["run_dir"]))
    except (FileNotFoundError, ValueError):
        return None
    if not rows:
        return None
    last = rows[-1]
    cell = (f"FLOPs (epoch {last['epoch']}): rollout {last['rollout_gflops']:.2f} GFLOP/s, update "
            f"{last['update_gflops']:.2f}: the update {last['gap']:.1f}x the rollout's rate over the rows it computes "
            f"on ({last['updated']:.0%} of the rollout's FLOPs), a rollout share of {last['share_of_gap']:.0%} from "
            f"these alone (all rows: 70% needs 7x; regime_flops)")
    return {"rows": rows, "cell": cell,
            "details": "\n\nFLOPs against seconds (rhyme_lab/ablate/regime_flops.py):\n" + "\n".join(flop_lines(rows))}


def _x(v) -> str:
    return "-" if v is None else f"{v:.2f}x"


def gain_cell(g: dict) -> str:
    """A held-out gain (``held_out``'s dict) as "before -> after (gain ± se, z)" for the report."""
    if g["z"] is None:
        return f"{g['before']:.3f} -> {g['after']:.3f} (no spread)"
    return f"{g['before']:.3f} -> {g['after']:.3f} (gain {g['gain']:+.3f} ± {g['se']:.3f}, z {g['z']:.1f})"


def histospec_bound(r: dict) -> dict | None:
    """HistoSpec's bound in this regime from a unit paired with the always-right oracle
    (``BOUND_UNIT``): over its steps after the first ``skip`` (compiles), the plain rollout's
    seconds over the oracle's (``bound``: no drafter through this engine on this machine does
    better) and over the run's own drafter's in the same steps (``own``), ratios of sums with
    their standard errors, and the own drafter's share of the bound. None without such steps."""
    st = [s for s in r.get("steps", []) if s["step"] > r.get("skip", 1) and {"plain", "own", "spec"} <= set(s)]
    if not st:
        return None
    plain, own, bound = (np.array([s[k]["seconds"] for s in st]) for k in ("plain", "own", "spec"))
    b, b_se = ratio_of_sums(plain, bound)
    o, o_se = ratio_of_sums(plain, own)
    passes = lambda k: float(sum(s[k]["forward_passes"] for s in st))  # noqa: E731
    return {"steps": len(st), "bound": b, "bound_se": b_se, "own": o, "own_se": o_se, "of_bound": o / b,
            "passes_plain": passes("plain"), "passes_bound": passes("spec"), "passes_own": passes("own")}


def _real_model(inp: Inputs) -> dict | None:
    """The SmolLM2 unit's per-epoch table and HistoPipe replay, where it was run (else None)."""
    try:
        r = inp.unit(REAL_UNIT)
    except MissingInput:
        return None
    rows = epoch_table(r)
    sched = placement(r)
    share = ", ".join(f"{x['rollout_share']:.0%}" for x in rows)
    roll = ", ".join(f"{x['histospec_rollout']:.2f}x" for x in rows if x.get("histospec_rollout"))
    cell = (f"SmolLM2 at 1,024 new tokens: rollout {share} of the step by epoch, HistoSpec {roll or '-'} rollout, "
            f"HistoPipe {sched['makespan_ratio']:.2f}x tiers, {sched['spread_ratio']:.2f}x spread "
            f"(exact-length grouped {sched['oracle_ratio']:.2f}x, "
            f"bound {sched['bound_ratio']:.2f}x)")
    return {"epochs": rows, "histopipe": sched, "cell": cell}
