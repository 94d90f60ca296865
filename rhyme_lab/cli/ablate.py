"""``python -m rhyme_lab ablate SUITE [--quick]``: the paper's ablations from ``configs/ablations``.

``python -m rhyme_lab ablate --list`` prints every id with its configs and what it measures;
``python -m rhyme_lab ablate paper --quick`` runs all 14 ids at the quick CPU scale into
``results/paper-quick/`` (table.md, results.csv, plots). See ``rhyme_lab/ablate`` and
docs/reproduction.md.
"""

from __future__ import annotations

import argparse
import sys

from rhyme_jax.cli.common import add_command


def register(sub) -> None:
    """Add ``ablate`` to the ``rhyme-jax`` subparsers."""
    from rhyme_lab.ablate.registry import SCALES, SUITES

    sp = add_command(sub, "ablate", "run the paper's ablations (configs/ablations) and write "
                     "results/<suite>/table.md beside the paper's figures", run, config=False,
                     examples=("python -m rhyme_lab ablate --list", "python -m rhyme_lab ablate paper --quick",
                               "python -m rhyme_lab ablate paper --quick --only A1,K2"))
    sp.add_argument("suite", nargs="?", choices=sorted(SUITES),
                    help="which ids (paper = the paper's 14; learning = L1-L4 on runs that learn)")
    sp.add_argument("--list", action="store_true", help="print every id with its configs and what it measures")
    sp.add_argument("--quick", action="store_true", help="the quick CPU scale (same as --scale quick)")
    sp.add_argument("--scale", choices=sorted(SCALES), default=None,
                    help="full (the configs as written), quick (minutes on 2 CPU cores), tiny (tests) or gpu "
                         "(configs/ablations/gpu: a real model on accelerators; docs/reproduction.md)")
    sp.add_argument("--set", dest="sets", action="append", default=[], metavar="[RUN:]KEY=VALUE",
                    help="config override of every run, or of the runs of one kind (sft, e2e, paired, session) "
                         "or one run: e.g. --set model.path=/ckpt/Qwen2.5-1.5B --set session:rollout.max_slots=64")
    sp.add_argument("--only", default="", metavar="IDS", help="comma-separated ids of the suite, e.g. A1,K2")
    sp.add_argument("--out", default=None, help="results directory (default: results/<suite>[-<scale>])")
    sp.add_argument("--force", action="store_true", help="measure the ids again (units already run are kept; "
                    "delete their units/<unit>.json to rerun one)")
    sp.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")


def run(args: argparse.Namespace) -> int:
    """Run ``python -m rhyme_lab ablate``; returns the exit status (2: bad arguments)."""
    from rhyme_lab.ablate.registry import AblationError, listing

    if args.list:
        print(listing())
        return 0
    if not args.suite:
        print("python -m rhyme_lab ablate: name a suite (e.g. `python -m rhyme_lab ablate paper --quick`) or pass --list",
              file=sys.stderr)
        return 2
    if args.quick and args.scale not in (None, "quick"):
        print(f"python -m rhyme_lab ablate: --quick contradicts --scale {args.scale}", file=sys.stderr)
        return 2
    scale = "quick" if args.quick else (args.scale or "full")
    from rhyme_lab.ablate.runner import run_suite

    try:
        table, results = run_suite(args.suite, scale=scale, out=args.out, only=args.only, force=args.force,
                                   progress=args.progress, sets=tuple(args.sets))
    except AblationError as exc:
        print(f"python -m rhyme_lab ablate: {exc}", file=sys.stderr)
        return 2
    print(table.read_text())
    na = [k for k, r in results.items() if r["status"] != "ok"]
    print(f"written: {table}, {table.with_name('results.csv')}" + (f"; n/a: {', '.join(na)}" if na else ""))
    return 0
