"""Rerun a learning run with HistoSpec off and save the policy's modes beside its rollouts.

``rhyme_lab.ablate.policy_modes``: before each update the step's rollouts are teacher-forced
through the behaviour weights; the argmax and its probability at every response position go to
``<out>/policy_modes/``. Then ``python -m benchmarks.draft_gap OUT --unit UNIT.json --bound`` adds
the policy's own greedy drafts (``policy``, ``policy_known``) to the table: what a drafter that
knows the policy reaches against the run's drafter and the source-bound oracle. With
``--reference`` the new run's rollouts are compared with a saved run's token by token (the same
seed samples the same tokens).

Usage::

    python -m benchmarks.policy_modes results/learning/runs/learn_oracle_paired/config.yaml \\
        --out results/modes/learn_oracle_paired [--reference results/learning/runs/learn_oracle_paired]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rhyme_lab.ablate.policy_modes import CaptureError, capture
from rhyme_lab.ablate.saved_runs import CorpusError, load_run_config


def main(argv=None) -> int:
    """Command line (module docstring); returns the exit status (2: bad config or reference)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config", help="a saved run's config.yaml (or any run config)")
    ap.add_argument("--out", required=True, help="run directory to write (must not hold checkpoints)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--rows", type=int, default=8, help="rollouts per teacher-forced forward")
    ap.add_argument("--reference", default="", help="a saved run whose rollouts must equal the new run's")
    args = ap.parse_args(argv)
    out = Path(args.out)
    sets = [*args.overrides, "spec.enabled=false", f"run.runs_dir={out.parent}", f"run.name={out.name}",
            "run.progress=false"]
    try:
        cfg = load_run_config(Path(args.config), sets)
        stats = capture(cfg, args.rows, log=lambda s: print(s, file=sys.stderr))
    except (CorpusError, CaptureError) as exc:
        print(f"benchmarks.policy_modes: {exc}", file=sys.stderr)
        return 2
    doc = {"config": args.config, "overrides": sets, "steps": stats}
    if args.reference:
        from rhyme_lab.ablate.learning import identity

        doc["identity"] = identity(args.reference, out)
    print(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
