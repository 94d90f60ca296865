"""Plain decode beside HistoSpec, step by step: the figures and the report of a paired run.

Each step of a paired run (``ablate.paired.PairedRollouts``: the same prompts, weights and key
decoded plainly and with HistoSpec) gives ``{"plain": stats, "spec": stats}`` with the engine's
``RolloutResult.stats``. ``paired_ratios`` pools steps into tokens/s, forward passes and
acceptance of each side and their ratios; ``write_report`` writes the per-epoch table
(``python -m benchmarks.rollout``, rewritten after every step); ``benchmarks.spec_sweep`` reads
the same figures per live-row count.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path


def paired_ratios(rs: list[dict]) -> dict:
    """Plain vs HistoSpec figures pooled over the steps ``rs`` (each ``{"plain": stats, "spec":
    stats}``, ``stats`` holding ``generated_tokens``, ``seconds``, ``forward_passes``,
    ``sequence_steps``, ``drafted_tokens``, ``accepted_tokens``, ``drafting_seconds``,
    ``compiles``): per side tokens/s, forward passes per token and tokens per sequence forward;
    ``speedup`` (tokens/s ratio), the same without host drafting seconds, ``passes_ratio``,
    ``acceptance``, ``spec_drafted_per_token``, ``drafting_share`` (of rollout seconds) and
    ``compiles``."""
    def tot(kind, key):
        return float(sum(r[kind][key] for r in rs))
    entry = {}
    for kind in ("plain", "spec"):
        entry[f"{kind}_tokens_per_s"] = tot(kind, "generated_tokens") / tot(kind, "seconds")
        entry[f"{kind}_passes_per_token"] = tot(kind, "forward_passes") / tot(kind, "generated_tokens")
        entry[f"{kind}_tokens_per_seq_forward"] = tot(kind, "generated_tokens") / tot(kind, "sequence_steps")
    entry["speedup"] = entry["spec_tokens_per_s"] / entry["plain_tokens_per_s"]
    entry["spec_tokens_per_s_without_drafting"] = tot("spec", "generated_tokens") / (
        tot("spec", "seconds") - tot("spec", "drafting_seconds"))
    entry["speedup_without_drafting"] = entry["spec_tokens_per_s_without_drafting"] / entry["plain_tokens_per_s"]
    entry["passes_ratio"] = entry["plain_passes_per_token"] / entry["spec_passes_per_token"]
    entry["acceptance"] = tot("spec", "accepted_tokens") / max(tot("spec", "drafted_tokens"), 1.0)
    entry["spec_drafted_per_token"] = tot("spec", "drafted_tokens") / tot("spec", "generated_tokens")
    entry["drafting_share"] = tot("spec", "drafting_seconds") / tot("spec", "seconds")
    entry["compiles"] = tot("plain", "compiles") + tot("spec", "compiles")
    return entry


def write_report(rows: list[dict], out: Path, final: bool, meta: dict) -> None:
    """Per-epoch table of ``rows`` (plain vs HistoSpec stats per step, each with its ``epoch``)
    into ``out``/rollout_benchmark.{md,json}; the summary pools epoch 3 on. ``final``: also print
    the table and where it went. ``meta``: what the run measured on (first line, JSON ``meta``)."""
    by_epoch = defaultdict(list)
    for row in rows:
        by_epoch[row["epoch"]].append(row)
    table = [{"epoch": epoch, "steps": len(rs), **paired_ratios(rs)} for epoch, rs in sorted(by_epoch.items())]
    late = [r for r in rows if r["epoch"] >= 3]
    summary = {}
    if late:
        both = paired_ratios(late)
        summary = {k: both[k] for k in ("speedup", "passes_ratio", "drafting_share", "speedup_without_drafting",
                                        "acceptance")}
    lines = ["| epoch | steps | plain tok/s | HistoSpec tok/s | speedup | passes/token plain | "
             "passes/token spec | fewer passes | tokens/seq-forward | acceptance | drafting share | "
             "speedup without drafting | compiles in timed rollouts |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for e in table:
        lines.append(f"| {e['epoch']} | {e['steps']} | {e['plain_tokens_per_s']:.0f} | {e['spec_tokens_per_s']:.0f} "
                     f"| {e['speedup']:.2f}x | {e['plain_passes_per_token']:.4f} | {e['spec_passes_per_token']:.4f} "
                     f"| {e['passes_ratio']:.2f}x | {e['spec_tokens_per_seq_forward']:.2f} | {e['acceptance']:.2f} "
                     f"| {100 * e['drafting_share']:.1f}% | {e['speedup_without_drafting']:.2f}x | {e['compiles']:.0f} |")
    if summary:
        lines.append(f"\nEpoch 3 on: {summary['speedup']:.2f}x rollout tokens/s, {summary['passes_ratio']:.2f}x "
                     f"fewer forward passes per generated token, acceptance {summary['acceptance']:.2f}, "
                     f"host drafting {100 * summary['drafting_share']:.1f}% of rollout time "
                     f"({summary['speedup_without_drafting']:.2f}x without it).")
    lines.insert(0, f"{meta}\n")
    text = "\n".join(lines)
    if final:
        print(text)
    (out / "rollout_benchmark.md").write_text(text + "\n")
    (out / "rollout_benchmark.json").write_text(json.dumps({"meta": meta, "epochs": table, "epoch3_on": summary,
                                                            "steps": rows}, indent=1, default=float))
    if final:
        print(f"written: {out / 'rollout_benchmark.md'}")
