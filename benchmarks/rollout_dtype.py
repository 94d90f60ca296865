"""bf16 against float32 rollouts: how far the sampler's logprobs are from the trainer's.

SmolLM2-135M-Instruct (float32 master weights) rolls out ``--prompts`` recipe prompts for exactly
``--max-new`` tokens per engine dtype (``rollout.dtype``: ``bfloat16`` = a bf16 copy of the weights,
bf16 compute and KV pages; ``float32`` = the default); the trainer's float32 forward scores the
same tokens. Per dtype: mean / p99 / max of |trainer - sampler| (nats per token), the ratio
``exp(trainer - sampler)`` (mean, std, min, p1, p99, max) and the truncated-importance-sampling
weights at ``--cap`` (``grpo.tis_cap``: mean, max, share clipped). Method:
``rhyme_lab.bench.rollout_dtype``; the figures and the commit they came from: docs/results.md.

Usage::

    python -m benchmarks.rollout_dtype                      # 8 prompts x 64 tokens, both dtypes
    python -m benchmarks.rollout_dtype --prompts 16 --out /tmp/rollout_dtype.json

Prints a markdown table and writes the JSON report (with commit, machine and date).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv=None) -> int:
    """Command line (module docstring); returns the exit status."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cap", type=float, default=2.0, help="TIS cap (grpo.tis_cap)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/rollout_dtype.json"))
    args = ap.parse_args(argv)

    from rhyme_lab.bench.rollout_dtype import measure
    from rhyme_lab.provenance import stamp

    report = measure(args.prompts, args.max_new, seed=args.seed, cap=args.cap)
    report["stamp"] = stamp()
    cols = ("tokens", "abs_diff_mean", "abs_diff_p99", "abs_diff_max", "ratio_mean", "ratio_std", "ratio_min",
            "ratio_max", "tis_weight_mean", "tis_clipped_fraction")
    print("| rollout dtype | " + " | ".join(cols) + " |\n" + "|---" * (len(cols) + 1) + "|")
    for dtype, row in report["by_dtype"].items():
        print(f"| {dtype} | " + " | ".join(f"{row[c]:.6g}" for c in cols) + " |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out} ({report['stamp']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
