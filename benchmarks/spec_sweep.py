"""HistoSpec vs plain decode across live-row counts: is the drafting policy ever slower?

For each ``--rows`` R, ``python -m benchmarks.rollout`` runs the CPU demo's GRPO loop with R decode
slots (``rollout.max_slots=R``) and one prompt set of ``max(1, R / 8)`` prompts x 8 samples
repeated every step (``grpo.num_prompts = grpo.prompts_per_step``: step s is epoch s), the
learning rate at ``--lr`` (default ~0, so the policy barely moves and epoch 2 rhymes with
epoch 1 as much as sampling allows); every step's rollout runs twice on the same weights, prompts
and key, plain and with HistoSpec (``--policy``: ``goodput`` = the goodput policy of
``benchmarks.rollout_real``'s ``GOODPUT``; ``paper`` = the paper defaults). Reported per R:
tokens/s of each over the steps from epoch 2 on, their ratio, tokens per sequence forward pass,
acceptance and the host drafting share. The "never slower" target is ratio >= 0.98 at every R.

Usage::

    python -m benchmarks.spec_sweep --init-from runs/demo/sft                 # R = 1, 8, 32, 128, 256
    python -m benchmarks.spec_sweep --init-from runs/demo/sft --policy paper
    python -m benchmarks.spec_sweep --init-from runs/demo/sft --rows 128 --set rollout.temperature=0.05

Writes ``runs/spec_sweep_<policy>/sweep.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from rhyme_lab.measure.paired_report import paired_ratios

ROOT = Path(__file__).resolve().parents[1]
POLICIES = {
    "goodput": ["spec.window=goodput", "spec.pattern_min=1", "spec.self_lookup=true", "spec.siblings=true",
                "spec.min_token_prob=0.0"],
    "paper": ["spec.window=aimd", "spec.pattern_min=3", "spec.self_lookup=false", "spec.siblings=false",
              "spec.min_token_prob=0.1"],
}


def run_rows(rows: int, args) -> dict:
    """One ``python -m benchmarks.rollout`` run with ``rows`` slots; returns its figures
    (``measure.paired_report.paired_ratios``) over the steps from epoch 2 on."""
    prompts = max(1, rows // 8)
    name = f"spec_sweep_{args.policy}_R{rows}"
    sets = [*POLICIES[args.policy], f"rollout.max_slots={rows}", f"grpo.prompts_per_step={prompts}",
            f"grpo.num_prompts={prompts}", "grpo.samples_per_prompt=8", f"grpo.learning_rate={args.lr}",
            "grpo.minibatches=1", *args.overrides]
    cmd = [sys.executable, "-m", "benchmarks.rollout", "--init-from", args.init_from,
           "--steps", str(args.steps), "--name", name, "--compile-threads", "2"]
    for s in sets:
        cmd += ["--set", s]
    subprocess.run(cmd, check=True, cwd=ROOT)
    report = json.loads((ROOT / "runs" / name / "rollout_benchmark.json").read_text())
    late = [r for r in report["steps"] if r["epoch"] >= 2]
    e = paired_ratios(late)
    return {"rows": rows, "steps": len(late), "plain_tokens_per_s": e["plain_tokens_per_s"],
            "spec_tokens_per_s": e["spec_tokens_per_s"], "tokens_per_seq_forward": e["spec_tokens_per_seq_forward"],
            "acceptance": e["acceptance"], "drafted_per_token": e["spec_drafted_per_token"],
            "drafting_share": e["drafting_share"]}


def main(argv=None) -> int:
    """Command line (module docstring); returns the exit status."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--init-from", default="runs/demo/sft", help="SFT params (run `rhyme-jax sft` first)")
    ap.add_argument("--rows", default="1,8,32,128,256", help="comma-separated slot counts")
    ap.add_argument("--policy", choices=sorted(POLICIES), default="goodput")
    ap.add_argument("--steps", type=int, default=3, help="GRPO steps per R (step s = epoch s)")
    ap.add_argument("--lr", type=float, default=1e-9, help="GRPO learning rate (~0: the policy stays put)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args(argv)
    out = ROOT / "runs" / f"spec_sweep_{args.policy}"
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        results.append(run_rows(rows, args))
        r = results[-1]
        r["speedup"] = r["spec_tokens_per_s"] / r["plain_tokens_per_s"]
        lines = ["| live rows | plain tok/s | HistoSpec tok/s | speed-up | tokens/seq-forward | acceptance | "
                 "drafts/token | drafting share |", "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {x['rows']} | {x['plain_tokens_per_s']:.0f} | {x['spec_tokens_per_s']:.0f} | "
                  f"{x['speedup']:.2f}x | {x['tokens_per_seq_forward']:.2f} | {x['acceptance']:.2f} | "
                  f"{x['drafted_per_token']:.2f} | {100 * x['drafting_share']:.1f}% |" for x in results]
        text = f"policy {args.policy}, overrides {args.overrides}, epochs >= 2\n\n" + "\n".join(lines)
        (out / "sweep.md").write_text(text + "\n")
        (out / "sweep.json").write_text(json.dumps(results, indent=1))
        print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
