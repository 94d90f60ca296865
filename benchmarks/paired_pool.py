"""Paired learning units pooled over repeats: rollout and end-to-end ratios, share of the bound.

The learning suite's paired units decode every step's rollout twice or three times back to back on
the same weights, prompts and key, taking turns going first (``rhyme_jax.ablate.paired``):
``learn_goodput_paired`` plain and the goodput drafter, ``learn_oracle_paired`` plain, the goodput
drafter and the source-bound oracle. One unit gives 10 steps per epoch on the demo, and a step's
ratio ranges about 0.6-1.2 around the epoch's on the 2-core machine; a unit takes about 2.5 min,
so repeating it over the same workload (same seed, same tokens) and pooling the steps narrows the
estimate. This script reads the units and prints per epoch each unit's figure and the pooled one,
each with its standard error over steps (``rhyme_jax.ablate.measures.ratio_of_sums``): the rollout
and end-to-end ratios against plain and, for oracle units, the goodput drafter's share of the
bound (oracle seconds / goodput seconds, the oracle's host search time left out, as in the suite).

Usage::

    python -m benchmarks.paired_pool results/rep1 results/rep2 [--unit learn_goodput_paired] [--json]
    python -m benchmarks.paired_pool results/rep1 results/rep2 --unit learn_oracle_paired

Each argument is a results directory (``units/<unit>.json`` inside) or a unit JSON file.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rhyme_jax.ablate.learning import paired_epochs


def load_unit(path: str, unit: str) -> dict:
    """The ``result`` of a paired unit's JSON (``path`` itself or ``path/units/<unit>.json``) with
    its ``commit``; ``"oracle"`` is whether its steps hold the own drafter's rollout too.

    Raises:
      ValueError: no such file, unreadable, or steps without ``plain`` and ``spec`` rollouts (not a
        paired unit); the message names the file.
    """
    p = Path(path)
    f = p if p.is_file() else p / "units" / f"{unit}.json"
    try:
        body = json.loads(f.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{f}: unreadable unit ({exc})") from None
    r = body.get("result", {})
    if not r.get("steps") or not all("plain" in s and "spec" in s for s in r["steps"]):
        raise ValueError(f"{f}: not a paired unit (its steps lack 'plain' and 'spec' rollouts)")
    return {**r, "commit": body.get("commit", "?"), "oracle": all("own" in s for s in r["steps"])}


def epochs(units: list[dict]) -> tuple[list[dict], dict[int, dict]]:
    """Per unit and pooled (all units' steps together) ``learning.paired_epochs``; the host
    drafting time is left out of the last rollout for oracle units (the oracle's search)."""
    oracle = all(u["oracle"] for u in units)
    each = [paired_epochs(u, host_drafting=not oracle) for u in units]
    merged = {"skip": max(u.get("skip", 1) for u in units), "steps": [s for u in units for s in u["steps"]]}
    return each, paired_epochs(merged, host_drafting=not oracle)


def _pm(x: float, se: float | None, pct: bool = False) -> str:
    f = "{:.1%}" if pct else "{:.2f}"
    return f.format(x) + (f" ± {f.format(se)}" if se is not None else "")


def main(argv=None) -> int:
    """Command line (module docstring); returns the exit status (2: a unit could not be read, or
    oracle and plain paired units mixed)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="+", help="results directories or unit JSON files")
    ap.add_argument("--unit", default="learn_oracle_paired", help="unit name inside results directories")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    try:
        units = [load_unit(p, args.unit) for p in args.paths]
        if len({u["oracle"] for u in units}) > 1:
            raise ValueError("oracle units and plain paired units cannot be pooled together")
    except ValueError as exc:
        print(f"benchmarks.paired_pool: {exc}", file=sys.stderr)
        return 2
    each, pool = epochs(units)
    if args.json:
        print(json.dumps({"commits": [u["commit"] for u in units], "units": each, "pooled": pool}))
        return 0
    oracle = units[0]["oracle"]
    print(f"{len(units)} units (commits {', '.join(u['commit'] for u in units)})")
    head = "| epoch | steps | rollout x per unit | rollout x pooled | end-to-end x pooled |"
    if oracle:
        head = ("| epoch | steps | share per unit | pooled share of the bound | goodput rollout x (pooled) | "
                "oracle rollout x (pooled) |")
    print(head)
    print("|---" * (head.count("|") - 1) + "|")
    for ep, row in sorted(pool.items()):
        if oracle:
            per = ", ".join(f"{e[ep]['of_bound']:.0%}" for e in each if ep in e)
            print(f"| {ep} | {row['steps']} | {per} | {_pm(row['of_bound'], row['of_bound_se'], True)} | "
                  f"{row['own_rollout']:.2f} | {row['rollout']:.2f} |")
        else:
            per = ", ".join(f"{e[ep]['rollout']:.2f}" for e in each if ep in e)
            print(f"| {ep} | {row['steps']} | {per} | {_pm(row['rollout'], row['rollout_se'])} | "
                  f"{_pm(row['e2e'], row['e2e_se'])} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
