"""End-of-run summary: a table on the terminal, summary.json and summary.md in the run directory."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from rhyme_jax.io.metrics import read_metrics


def build_summary(run_dir: Path, result: dict, *, wall_seconds: float, compiles: int,
                  compile_stats: dict | None = None) -> dict:
    """Collect the headline figures of a GRPO run from its metrics file and ``fit()`` result.

    Returns a JSON-serialisable dict: greedy accuracy before/after (with n and binomial standard
    error), mean@k sampled accuracy before/after when the run measured it,
    the gain and its standard error (independent-samples approximation), reward per step, rollout
    vs train seconds, mean rollout tokens/s, wall seconds, backend compilations, and
    ``compile_stats`` under ``"compile"`` when given (``compiled``, ``loaded_from_cache``,
    ``seconds`` spent compiling or loading = the run's warm-up, ``cache_dir``, rollout
    ``programs_run`` / ``programs_enumerated``).
    """
    rows = [r for r in read_metrics(run_dir) if r.get("phase") == "train"]
    rows = sorted({r["step"]: r for r in rows}.values(), key=lambda r: r["step"])
    before, after = result["eval_before"], result["eval_after"]
    gain = after["eval/accuracy"] - before["eval/accuracy"]
    gain_se = math.sqrt(after["eval/stderr"] ** 2 + before["eval/stderr"] ** 2)
    t_roll = float(sum(r.get("time/rollout_s", 0.0) for r in rows))
    t_train = float(sum(r.get("time/train_s", 0.0) for r in rows))
    return {
        "run_dir": str(run_dir),
        "steps": result["steps"],
        "accuracy_before": before["eval/accuracy"], "stderr_before": before["eval/stderr"],
        "accuracy_after": after["eval/accuracy"], "stderr_after": after["eval/stderr"],
        "n_eval": int(after["eval/n"]),
        "gain": gain, "gain_stderr": gain_se,
        **_sampled(before, after),
        **_paired(run_dir, result["steps"]),
        "reward_per_step": [round(float(r.get("reward/mean", float("nan"))), 4) for r in rows],
        **_reward_windows([float(r.get("reward/mean", float("nan"))) for r in rows]),
        "rollout_seconds": t_roll, "train_seconds": t_train,
        "rollout_share": t_roll / max(t_roll + t_train, 1e-9),
        # Median: the first step's rollout includes compilation.
        "rollout_tokens_per_s": float(np.median([r.get("rollout/tokens_per_s", 0.0) for r in rows]))
        if rows else 0.0,
        "histospec_per_epoch": _spec_epochs(rows),
        "nonfinite_skipped": result.get("nonfinite_skipped", 0),
        "wall_seconds": wall_seconds,
        "compilations": compiles,
        **({"compile": compile_stats} if compile_stats else {}),
    }


def _spec_epochs(rows: list[dict]) -> list[dict]:
    """Per epoch of the prompt set: HistoSpec acceptance, tokens per sequence forward pass and
    forward passes (batch steps) per 1,000 generated tokens. Epoch 1 drafts nothing (no history
    yet), so its passes per token are the plain-decode baseline of the later epochs."""
    if not rows or not sum(r.get("spec/drafted_tokens", 0.0) for r in rows):
        return []  # HistoSpec off (or no history yet): nothing to report
    out = []
    for epoch in sorted({int(r.get("rollout/epoch", 1)) for r in rows}):
        rs = [r for r in rows if int(r.get("rollout/epoch", 1)) == epoch]
        gen = sum(r.get("rollout/generated_tokens", 0.0) for r in rs)
        drafted = sum(r["spec/drafted_tokens"] for r in rs)
        out.append({
            "epoch": epoch, "steps": len(rs),
            "acceptance": sum(r["spec/accepted_tokens"] for r in rs) / drafted if drafted else 0.0,
            "tokens_per_forward": float(np.mean([r.get("rollout/tokens_per_forward", 1.0) for r in rs])),
            "passes_per_1k_tokens": 1000.0 * sum(r["rollout/forward_passes"] for r in rs) / max(gen, 1.0),
            "tokens_per_s": float(np.median([r.get("rollout/tokens_per_s", 0.0) for r in rs])),
        })
    base = out[0]["passes_per_1k_tokens"]
    for e in out:
        e["passes_saved_vs_epoch1"] = 1.0 - e["passes_per_1k_tokens"] / base if base else 0.0
    return out


def _reward_windows(rewards: list[float], window: int = 10) -> dict:
    """Mean train reward over the first and the last ``window`` steps (fewer when the run is
    shorter than two windows), and their difference: the learning signal of the run."""
    if not rewards:
        return {}
    w = max(1, min(window, len(rewards) // 2))
    first, last = float(np.nanmean(rewards[:w])), float(np.nanmean(rewards[-w:]))
    return {"reward_window": w, "reward_first": first, "reward_last": last, "reward_rise": last - first}

def eval_path(run_dir: Path, step: int) -> Path:
    """Per-problem results of the held-out evaluation after ``step`` GRPO steps (0 = before)."""
    return Path(run_dir) / "eval" / f"step_{step:06d}.npz"


class PairedEvalError(ValueError):
    """Two per-problem evaluations that cannot be paired (a missing or unreadable file, another
    number of problems); ``rhyme-jax eval --paired-with`` reports it in one line."""


def paired_gain(before: np.ndarray, after: np.ndarray) -> tuple[float, float]:
    """Mean and standard error of the per-problem difference ``after - before``.

    Both evaluations score the same problems, so the paired standard error
    ``std(after_i - before_i, ddof=1) / sqrt(n)`` is the right yardstick for the gain (it removes
    the between-problem variance that the unpaired sqrt(se_a^2 + se_b^2) keeps).

    Raises:
      ValueError: the vectors differ in length or are empty.
    """
    before, after = np.asarray(before, np.float64), np.asarray(after, np.float64)
    if before.shape != after.shape or before.size == 0:
        raise ValueError(f"paired_gain: shapes {before.shape} and {after.shape} must match and be non-empty")
    d = after - before
    se = float(d.std(ddof=1) / math.sqrt(d.size)) if d.size > 1 else 0.0
    return float(d.mean()), se


def _paired(run_dir: Path, steps: int) -> dict:
    """Paired gains (same problems before and after) from the per-problem eval files."""
    first, last = eval_path(run_dir, 0), eval_path(run_dir, steps)
    if not (first.is_file() and last.is_file()):
        return {}
    a, b = np.load(first), np.load(last)
    out = {}
    if a["correct"].shape == b["correct"].shape:
        out["gain_paired"], out["gain_paired_stderr"] = paired_gain(a["correct"], b["correct"])
    if a["sampled"].size and a["sampled"].shape == b["sampled"].shape:
        out["sampled_gain_paired"], out["sampled_gain_paired_stderr"] = paired_gain(
            a["sampled"], b["sampled"])
    return out


def _sampled(before: dict, after: dict) -> dict:
    """mean@k rows of the summary (empty when the run did not measure them)."""
    if "eval/sampled_accuracy" not in after or "eval/sampled_accuracy" not in before:
        return {}
    gain = after["eval/sampled_accuracy"] - before["eval/sampled_accuracy"]
    return {"samples": int(after["eval/samples"]),
            "sampled_accuracy_before": before["eval/sampled_accuracy"],
            "sampled_stderr_before": before["eval/sampled_stderr"],
            "sampled_accuracy_after": after["eval/sampled_accuracy"],
            "sampled_stderr_after": after["eval/sampled_stderr"],
            "sampled_gain": gain,
            "sampled_gain_stderr": math.sqrt(after["eval/sampled_stderr"] ** 2
                                             + before["eval/sampled_stderr"] ** 2),
            **({"pass_at_k_before": before["eval/pass_at_k"], "pass_at_k_after": after["eval/pass_at_k"]}
               if "eval/pass_at_k" in before and "eval/pass_at_k" in after else {})}


def summary_rows(summary: dict) -> list[tuple[str, str]]:
    """(metric, formatted value) rows of the summary table."""
    n = summary["n_eval"]
    rows = [
        (f"held-out greedy accuracy before RL (n={n})",
         f"{summary['accuracy_before']:.3f} ± {summary['stderr_before']:.3f}"),
        (f"held-out greedy accuracy after RL (n={n})",
         f"{summary['accuracy_after']:.3f} ± {summary['stderr_after']:.3f}"),
        ("greedy gain (± its standard error)",
         f"{summary['gain']:+.3f} ± {summary['gain_stderr']:.3f}"
         + (f" (paired: ± {summary['gain_paired_stderr']:.3f}, z = {_z(summary)})"
            if "gain_paired_stderr" in summary else "")),
    ]
    if "samples" in summary:
        k = summary["samples"]
        rows += [
            (f"held-out pass@1 at T = 1 (mean of {k} samples) before RL",
             f"{summary['sampled_accuracy_before']:.3f} ± {summary['sampled_stderr_before']:.3f}"),
            (f"held-out pass@1 at T = 1 (mean of {k} samples) after RL",
             f"{summary['sampled_accuracy_after']:.3f} ± {summary['sampled_stderr_after']:.3f}"),
            (f"pass@1 at T = 1 gain (± its standard error)",
             f"{summary['sampled_gain']:+.3f} ± {summary['sampled_gain_stderr']:.3f}"
             + (f" (paired: ± {summary['sampled_gain_paired_stderr']:.3f})"
                if "sampled_gain_paired_stderr" in summary else "")),
        ]
        if "pass_at_k_before" in summary:
            rows.append((f"held-out pass@{k} at T = 1 before -> after RL",
                         f"{summary['pass_at_k_before']:.3f} -> {summary['pass_at_k_after']:.3f}"))
    rewards = summary["reward_per_step"]
    shown = ", ".join(f"{r:.2f}" for r in rewards) if len(rewards) <= 12 else (
        ", ".join(f"{r:.2f}" for r in rewards[:6]) + ", ..., " + ", ".join(f"{r:.2f}" for r in rewards[-6:]))
    rows += [
        ("train reward per step", shown),
        *([(f"train reward, mean of the first -> last {summary['reward_window']} steps",
            f"{summary['reward_first']:.3f} -> {summary['reward_last']:.3f} ({summary['reward_rise']:+.3f})")]
          if "reward_window" in summary else []),
        ("rollout / train seconds", f"{summary['rollout_seconds']:.1f} / {summary['train_seconds']:.1f} "
                                    f"({100 * summary['rollout_share']:.0f}% rollout)"),
        ("rollout tokens/s (median over steps)", f"{summary['rollout_tokens_per_s']:.0f}"),
    ]
    for e in summary.get("histospec_per_epoch", []):
        rows.append((f"HistoSpec epoch {e['epoch']} ({e['steps']} steps)",
                     f"acceptance {e['acceptance']:.2f}, {e['tokens_per_forward']:.2f} tokens/seq-forward, "
                     f"{e['passes_per_1k_tokens']:.1f} passes/1k tokens "
                     + ("(baseline: no history yet), " if e["epoch"] == 1 else
                        f"({100 * e['passes_saved_vs_epoch1']:.0f}% saved vs epoch 1), ")
                     + f"{e['tokens_per_s']:.0f} tok/s"))
    rows += [
        ("non-finite steps skipped", str(summary["nonfinite_skipped"])),
        ("backend compilations", str(summary["compilations"])),
        *_compile_rows(summary.get("compile")),
        ("wall time", f"{summary['wall_seconds']:.0f} s"),
    ]
    return rows


def _z(summary: dict) -> str:
    """The paired greedy gain in standard errors (``inf`` when every problem kept its score)."""
    se = summary["gain_paired_stderr"]
    return f"{summary['gain_paired'] / se:.1f}" if se > 0 else "inf"


def _compile_rows(c: dict | None) -> list[tuple[str, str]]:
    """Summary rows of the warm-up figures (``build_summary``'s ``compile``), if any."""
    if not c:
        return []
    return [("warm-up (XLA compile or cache load)",
             f"{c['seconds']:.0f} s: {c['compiled']} compiled, " + (
                 f"{c['loaded_from_cache']} loaded from {c['cache_dir']}" if c.get("cache_dir")
                 else "persistent cache off")),
            ("rollout step programs", f"{c.get('programs_run', 0)} run of {c.get('programs_enumerated', 0)} "
                                      f"enumerated (rhyme-jax compile-report)")]


def print_summary(summary: dict, *, console: Console | None = None) -> None:
    """Print the summary table of a run."""
    table = Table(title=f"rhyme-jax run summary: {summary['run_dir']}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for metric, value in summary_rows(summary):
        table.add_row(metric, value)
    (console or Console()).print(table)


def write_summary(run_dir: Path, summary: dict, *, console: Console | None = None) -> None:
    """Print the summary table and write summary.json (all figures) and summary.md (the table)."""
    print_summary(summary, console=console)
    (Path(run_dir) / "summary.json").write_text(json.dumps(summary, indent=2))
    md = [f"# rhyme-jax run summary: {run_dir}", "", "| metric | value |", "|---|---|"]
    md += [f"| {m} | {v} |" for m, v in summary_rows(summary)]
    (Path(run_dir) / "summary.md").write_text("\n".join(md) + "\n")
