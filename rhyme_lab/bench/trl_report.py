"""The report of ``python -m benchmarks.trl_side_by_side``: final-window reward statistics, seconds
per step, held-out paired gains, one seed's record, the summary over seeds, ``report.md``,
``rewards.png`` and the merge of earlier reports.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
from pathlib import Path

import numpy as np

from rhyme_lab.bench.trl_mapping import SideBySideError
from rhyme_jax.io.summary import paired_gain


def mean_se(units) -> tuple[float, float]:
    """Mean and standard error (ddof 1; 0 for a single unit) of ``units``."""
    x = np.asarray(units, np.float64)
    return float(x.mean()), float(x.std(ddof=1) / math.sqrt(x.size)) if x.size > 1 else 0.0

def window_stats(rhyme_units, trl_units) -> dict:
    """Final-window reward means ± SE of both sides and their difference in SEs
    (``(rhyme - trl) / sqrt(se_r^2 + se_t^2)``)."""
    (mr, sr), (mt, st) = mean_se(rhyme_units), mean_se(trl_units)
    se = math.hypot(sr, st)
    return {"rhyme": {"mean": mr, "se": sr, "units": len(rhyme_units)},
            "trl": {"mean": mt, "se": st, "units": len(trl_units)},
            "difference": mr - mt, "difference_se": se, "difference_in_se": (mr - mt) / se if se > 0 else None}

def window_units(side: dict, window: int) -> list[float]:
    """The units of a final-window mean: per-step reward means over the window's steps, or the
    per-rollout rewards when the window is a single step."""
    if window > 1:
        return side["reward_mean"][-window:]
    return list(side["rewards"][-1])

def seconds_per_step(side: dict) -> dict:
    """Mean rollout, update and total seconds per step, over all steps and over steps >= 2 (after
    rhyme-jax's compiles and TRL's first-call warm-up)."""
    def stats(sl):
        ro, up = np.asarray(side["rollout_s"][sl]), np.asarray(side["update_s"][sl])
        return {"rollout_s": float(ro.mean()), "update_s": float(up.mean()), "total_s": float((ro + up).mean())}
    n = len(side["rollout_s"])
    return {"all": stats(slice(0, n)), "steady": stats(slice(1, n)) if n > 1 else None}

def eval_stats(before: np.ndarray, after: np.ndarray) -> dict:
    """Held-out greedy accuracy before / after and the paired gain ± SE."""
    gain, se = paired_gain(before, after)
    return {"before": float(before.mean()), "after": float(after.mean()), "n": int(before.size),
            "gain": gain, "gain_se": se}

def compare_seed(seed: int, cfg, rhyme: dict, trl: dict, trl_run: dict, rhyme_dir: Path, window: int) -> dict:
    """One seed's side-by-side record (report.json ``runs[i]``)."""
    g = cfg.grpo
    expected = trl_run["expected_prompt_ids"]
    same_order = trl["prompt_ids"] == rhyme["prompt_ids"]
    steps_ok = trl["grpo_step_column"] == [[s] for s in range(1, g.steps + 1)]
    rows = g.prompts_per_step * g.samples_per_prompt
    sec_r, sec_t = seconds_per_step(rhyme), seconds_per_step(trl)
    ratio = {k: (sec_r[k]["total_s"] / sec_t[k]["total_s"]) if sec_r[k] and sec_t[k]["total_s"] > 0 else None
             for k in ("all", "steady")}
    return {
        "seed": seed, "rhyme_run_dir": str(rhyme_dir), "steps": g.steps, "rows_per_step": rows,
        "prompts": {"same_order": bool(same_order and steps_ok), "matches_schedule": trl["prompt_ids"] == expected,
                    "trl_rows_per_step": [len(p) for p in trl["prompt_ids"]], "tokens": trl_run["tokens"]},
        "rhyme": {k: rhyme[k] for k in ("reward_mean", "rollout_s", "update_s")},
        "trl": {**{k: trl[k] for k in ("reward_mean", "rollout_s", "update_s", "reward_s", "step_wall_s",
                                       "mean_length", "prompt_ids")},
                "optimizer_steps": len(trl_run["recorder"].spans)},
        "eval": {"rhyme": eval_stats(rhyme["eval_before"], rhyme["eval_after"]),
                 "trl": eval_stats(trl_run["eval_before"], trl_run["eval_after"]),
                 "before_agreement": float(np.mean(rhyme["eval_before"] == trl_run["eval_before"]))},
        "final_window": dict(window_stats(window_units(rhyme, window), window_units(trl, window)),
                             steps=[g.steps - window + 1, g.steps]),
        "seconds_per_step": {"rhyme": sec_r, "trl": sec_t, "ratio_rhyme_over_trl": ratio},
        "trl_train_wall_s": trl_run["train_wall_s"], "trl_eval_s": trl_run["eval_s"],
        "trl_logs": trl_run["recorder"].logs,
    }

def summarize(runs: list[dict], window: int) -> dict:
    """Across seeds: the final-window means ± SE (units pooled over seeds) and seconds per step."""
    units = {side: [u for r in runs for u in r["_units"][side]] for side in ("rhyme", "trl")}
    ratios = {k: [r["seconds_per_step"]["ratio_rhyme_over_trl"][k] for r in runs] for k in ("all", "steady")}
    return {
        "final_window": dict(window_stats(units["rhyme"], units["trl"]), window_steps=window),
        "ratio_rhyme_over_trl": {k: float(np.mean(v)) if all(x is not None for x in v) else None
                                 for k, v in ratios.items()},
        "eval_gain": {side: mean_se([r["eval"][side]["gain"] for r in runs]) for side in ("rhyme", "trl")},
        "prompts_same_order_all_seeds": all(r["prompts"]["same_order"] and r["prompts"]["matches_schedule"]
                                            for r in runs),
        "prompt_tokens_identical_all_seeds": all(r["prompts"]["tokens"]["identical"] for r in runs),
    }

def machine() -> dict:
    """Where the benchmark ran."""
    import torch
    import transformers
    import trl

    return {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}

def fmt(x, spec: str = ".3f") -> str:
    """A number for the markdown tables (``-`` for None)."""
    return "-" if x is None else format(x, spec)

def seed_markdown(r: dict) -> list[str]:
    """The report section of one seed."""
    p, ev, fw, sec = r["prompts"], r["eval"], r["final_window"], r["seconds_per_step"]
    lines = [f"## Seed {r['seed']} (rhyme-jax run `{r['rhyme_run_dir']}`)", "",
             f"- Same prompts in the same order on both sides: **{'yes' if p['same_order'] else 'NO'}** "
             f"({r['steps']} steps x {r['rows_per_step']} rows; TRL rows per step "
             f"{sorted(set(p['trl_rows_per_step']))}; "
             f"matches the prompt schedule: {'yes' if p['matches_schedule'] else 'NO'}); prompt tokens identical "
             f"(HF tokenizer vs ours, {p['tokens']['unique_prompts']} prompts): "
             f"{'yes' if p['tokens']['identical'] else 'NO'}; EOS ids rhyme-jax {p['tokens']['eos_ours']}, "
             f"TRL {p['tokens']['eos_trl']}", "",
             "| step | reward rhyme-jax | reward TRL | rollout s rhyme-jax | rollout s TRL | update s rhyme-jax "
             "| update s TRL |", "|---|---|---|---|---|---|---|"]
    rh, tr = r["rhyme"], r["trl"]
    for k in range(r["steps"]):
        lines.append(f"| {k + 1} | {fmt(rh['reward_mean'][k])} | {fmt(tr['reward_mean'][k])} | "
                     f"{fmt(rh['rollout_s'][k], '.2f')} | {fmt(tr['rollout_s'][k], '.2f')} | "
                     f"{fmt(rh['update_s'][k], '.2f')} | {fmt(tr['update_s'][k], '.2f')} |")
    after = ev.get("after_step", {"rhyme": r["steps"], "trl": r["steps"]})
    lines += ["", "| held-out greedy | n | before | after | after step | paired gain ± SE |",
              "|---|---|---|---|---|---|"]
    for side, name in (("rhyme", "rhyme-jax"), ("trl", "TRL")):
        e = ev[side]
        lines.append(f"| {name} | {e['n']} | {fmt(e['before'])} | {fmt(e['after'])} | {after[side]} | "
                     f"{e['gain']:+.3f} ± {e['gain_se']:.3f} |")
    lines += ["", f"Before-training greedy correctness agrees on {ev['before_agreement']:.1%} of the problems "
              "(same weights, two engines).", "",
              f"Final window (steps {fw['steps'][0]}-{fw['steps'][1]}): reward rhyme-jax "
              f"{fw['rhyme']['mean']:.3f} ± {fw['rhyme']['se']:.3f}, TRL {fw['trl']['mean']:.3f} ± "
              f"{fw['trl']['se']:.3f}; difference {fw['difference']:+.3f} = "
              f"{fmt(fw['difference_in_se'], '+.2f')} SE.", ""]
    for k, label in (("all", "all steps"), ("steady", "steps >= 2")):
        if sec["rhyme"][k] is None:
            continue
        a, b = sec["rhyme"][k], sec["trl"][k]
        lines.append(f"- Seconds per step, {label}: rhyme-jax {a['total_s']:.2f} (rollout {a['rollout_s']:.2f}, "
                     f"update {a['update_s']:.2f}), TRL {b['total_s']:.2f} (rollout {b['rollout_s']:.2f}, update "
                     f"{b['update_s']:.2f}); ratio rhyme-jax / TRL **{fmt(sec['ratio_rhyme_over_trl'][k], '.2f')}**")
    return lines + [""]

def write_markdown(report: dict, path: Path) -> None:
    """``report.md`` at ``path``: settings, what is not matched, each seed, the summary."""
    m, s = report["machine"], report["summary"]
    lines = ["# TRL GRPOTrainer vs rhyme-jax on the same run", "",
             f"Config `{report['config']}`"
             + (f" with `{' '.join(report['overrides'])}`" if report["overrides"] else "")
             + f"; seeds {report['seeds']}. trl {m['trl']}, transformers {m['transformers']}, torch {m['torch']} "
             f"({m['torch_threads']} threads, OMP_WAIT_POLICY={m['omp_wait_policy'] or 'unset'}); {m['platform']}, "
             f"{m['cpus']} CPUs, load average {m['loadavg_start'][0]:.1f} at the start and "
             f"{m['loadavg_end'][0]:.1f} at the end; {m['date']}.", "",
             "Rollout seconds: rhyme-jax `time/rollout_s`; TRL the trainer's `_generate` (tokenise, `generate`, "
             "decode). Update seconds: rhyme-jax `time/train_s`; TRL the optimizer steps' wall time minus "
             "rollout and reward (it includes TRL's log-prob forward passes). Neither includes the reward.", "",
             *([f"Compared: the first {report['compared_steps']} GRPO steps. TRL trains "
                f"{report['compared_steps']} steps; the rhyme-jax side is the first {report['compared_steps']} steps "
                "of its longer run (a constant learning rate without warm-up: the same run's beginning), and its "
                "held-out 'after' is at the end of that run (the 'after step' column).", ""]
               if report.get("compared_steps") else []),
             "## Summary", "",
             f"- Same prompts in the same order, every seed: {'yes' if s['prompts_same_order_all_seeds'] else 'NO'}; "
             f"same prompt tokens: {'yes' if s['prompt_tokens_identical_all_seeds'] else 'NO'}"]
    fw = s["final_window"]
    lines += [f"- Final-window reward (last {fw['window_steps']} steps, pooled over seeds): rhyme-jax "
              f"{fw['rhyme']['mean']:.3f} ± {fw['rhyme']['se']:.3f}, TRL {fw['trl']['mean']:.3f} ± "
              f"{fw['trl']['se']:.3f};"
              f" difference {fw['difference']:+.3f} = {fmt(fw['difference_in_se'], '+.2f')} SE",
              f"- Held-out paired gain, mean over seeds: rhyme-jax {s['eval_gain']['rhyme'][0]:+.3f}, "
              f"TRL {s['eval_gain']['trl'][0]:+.3f}",
              f"- Seconds per step, rhyme-jax / TRL: {fmt(s['ratio_rhyme_over_trl']['all'], '.2f')} (all steps), "
              f"{fmt(s['ratio_rhyme_over_trl']['steady'], '.2f')} (steps >= 2)", "",
              "## TRL settings (mapped from the config, docs/trl_mapping.md)", "", "```",
              *[f"{k} = {v!r}" for k, v in report["trl_settings"].items()], "```", "",
              "## Not matched", ""]
    lines += [f"- **{u['setting']}**: {u['why']}" for u in report["unmatched"]] + [""]
    for r in report["runs"]:
        lines += seed_markdown(r)
    path.write_text("\n".join(lines) + "\n")

def plot_rewards(report: dict, path: Path) -> None:
    """``rewards.png``: per-step mean reward of both sides, one colour per seed (rhyme-jax solid,
    TRL dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for k, r in enumerate(report["runs"]):
        steps = np.arange(1, r["steps"] + 1)
        ax.plot(steps, r["rhyme"]["reward_mean"], "-o", color=f"C{k}", ms=3, label=f"rhyme-jax seed {r['seed']}")
        ax.plot(steps, r["trl"]["reward_mean"], "--s", color=f"C{k}", ms=3, label=f"TRL seed {r['seed']}")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("mean reward")
    ax.set_title("rhyme-jax vs TRL GRPOTrainer, same prompts")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

def merge_reports(dirs: list[str], out: Path) -> dict:
    """One report from several ``report.json`` (the same config, other seeds): runs concatenated,
    the summary recomputed over all of them (final-window units: per-step reward means).

    Raises:
      SideBySideError: a report is missing or the reports disagree on config, steps or window.
    """
    reports = []
    for d in dirs:
        path = Path(d) / "report.json"
        if not path.is_file():
            raise SideBySideError(f"--merge: {path} not found")
        reports.append(json.loads(path.read_text()))
    first = reports[0]
    for r in reports[1:]:
        for key in ("window_steps", "compared_steps", "trl_settings"):
            if r.get(key) != first.get(key):
                raise SideBySideError(f"--merge: the reports differ in {key}")
    window = first["window_steps"]
    runs = [dict(run) for r in reports for run in r["runs"]]
    for run in runs:
        run["_units"] = {side: run[side]["reward_mean"][-window:] for side in ("rhyme", "trl")}
    report = dict(first, seeds=[run["seed"] for run in runs], summary=summarize(runs, window),
                  runs=[{k: v for k, v in run.items() if not k.startswith("_")} for run in runs],
                  merged_from=[str(d) for d in dirs])
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=1, default=float) + "\n")
    write_markdown(report, out / "report.md")
    plot_rewards(report, out / "rewards.png")
    return report
