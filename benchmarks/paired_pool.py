"""Paired learning units pooled over repeats: rollout and end-to-end ratios, share of the bound.

Reads the learning suite's paired units (``learn_goodput_paired``: plain and the goodput drafter;
``learn_oracle_paired``: plain, the goodput drafter and the source-bound oracle; each step decoded
back to back, the compared rollouts taking turns going first) from several results directories,
repeats of the same workload, and prints per epoch each unit's figure and the pooled one with its
standard error over steps: ``rhyme_lab.ablate.pool`` (the method).

Usage::

    python -m benchmarks.paired_pool results/rep1 results/rep2 [--unit learn_goodput_paired] [--json] [--passes]

``--passes`` adds where the passes go: per epoch each rollout's batch passes, milliseconds per pass,
the drafter's acceptance and its host drafting share (``pool.pass_lines``).

Each argument is a results directory (``units/<unit>.json`` inside) or a unit JSON file.
"""

from __future__ import annotations

import argparse
import json
import sys

from rhyme_lab.ablate.pool import load_unit, pass_lines, pooled, table_lines


def main(argv=None) -> int:
    """Command line (module docstring); returns the exit status (2: a unit could not be read, or
    oracle and plain paired units mixed)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="+", help="results directories or unit JSON files")
    ap.add_argument("--unit", default="learn_oracle_paired", help="unit name inside results directories")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--passes", action="store_true", help="add the table of passes per epoch")
    args = ap.parse_args(argv)
    try:
        units = [load_unit(p, args.unit) for p in args.paths]
        if args.json:
            each, pool = pooled(units)
            out = json.dumps({"commits": [u["commit"] for u in units], "units": each, "pooled": pool})
        else:
            out = "\n".join(table_lines(units) + (["", *pass_lines(units)] if args.passes else []))
    except ValueError as exc:
        print(f"benchmarks.paired_pool: {exc}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
