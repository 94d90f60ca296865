"""Goodput's share of the live oracle bound, pooled over repeated oracle units (issue 32).

One oracle unit of the learning suite (``learn_oracle_paired``: every step's rollout decoded plain,
then by the run's own goodput drafter, then by the source-bound oracle, back to back) gives per
epoch the share ``oracle seconds / own seconds`` of 10 steps, and a step's share ranges 0.6-1.2 on
the 2-core machine. The unit is cheap (2-3 min at full scale on the demo), so running it several
times over the same workload (same seed, same tokens) and pooling the steps narrows the estimate;
this script reads the units and prints, per epoch, each unit's share and the pooled one, each with
its standard error over steps (``rhyme_jax.ablate.measures.ratio_of_sums``), and the pooled
rollout ratios of the drafter and the oracle against plain. The oracle's host search time is left
out, as in the suite (``learning.paired_epochs``).

Usage::

    python -m rhyme_jax.ablate.units learn_oracle_paired --out results/rep1 --scale full   # per repeat
    python -m benchmarks.bound_share results/rep1 results/rep2 results/rep3 [--unit NAME] [--json]

Each argument is a results directory (``units/<unit>.json`` inside) or a unit JSON file.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rhyme_jax.ablate.learning import paired_epochs


def load_unit(path: str, unit: str) -> dict:
    """The ``result`` of a unit JSON (``path`` itself or ``path/units/<unit>.json``).

    Raises:
      ValueError: no such file, unreadable, or a unit without own-drafter rollouts (not an oracle
        unit: ``"own"`` missing from its steps); the message names the file.
    """
    p = Path(path)
    f = p if p.is_file() else p / "units" / f"{unit}.json"
    try:
        body = json.loads(f.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{f}: unreadable unit ({exc})") from None
    r = body.get("result", {})
    if not r.get("steps") or not all("own" in s for s in r["steps"]):
        raise ValueError(f"{f}: not an oracle unit (its steps have no 'own' rollout)")
    return {**r, "commit": body.get("commit", "?")}


def pooled(units: list[dict]) -> dict[int, dict]:
    """Per epoch, ``paired_epochs`` of all units' steps together (the oracle's search time out)."""
    merged = {"skip": max(u.get("skip", 1) for u in units), "steps": [s for u in units for s in u["steps"]]}
    return paired_epochs(merged, host_drafting=False)


def main(argv=None) -> int:
    """Command line (module docstring); returns the exit status (2: a unit could not be read)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="+", help="results directories or unit JSON files")
    ap.add_argument("--unit", default="learn_oracle_paired")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    try:
        units = [load_unit(p, args.unit) for p in args.paths]
    except ValueError as exc:
        print(f"benchmarks.bound_share: {exc}", file=sys.stderr)
        return 2
    each = [paired_epochs(u, host_drafting=False) for u in units]
    pool = pooled(units)
    if args.json:
        print(json.dumps({"commits": [u["commit"] for u in units], "units": each, "pooled": pool}))
        return 0
    print(f"{len(units)} units (commits {', '.join(u['commit'] for u in units)})")
    print("| epoch | steps | share per unit | pooled share | own x (pooled) | oracle x (pooled) |")
    print("|---|---|---|---|---|---|")
    for ep, row in sorted(pool.items()):
        per = ", ".join(f"{e[ep]['of_bound']:.0%}" for e in each if ep in e)
        se = row.get("of_bound_se")
        share = f"{row['of_bound']:.1%}" + (f" ± {se:.1%}" if se is not None else "")
        print(f"| {ep} | {row['steps']} | {per} | {share} | {row['own_rollout']:.2f} | {row['rollout']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
