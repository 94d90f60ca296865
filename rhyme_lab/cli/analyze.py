"""``python -m rhyme_lab analyze RUN_DIR``: RhymeRL's observations O5/O6 (token rhyme, length-rank shifts)
over a finished run's saved rollouts (``rhyme_lab.analyze``)."""

from __future__ import annotations

import argparse

from rhyme_jax.cli.common import add_command, report
from rhyme_jax.config import SpecSection


def register(sub) -> None:
    """Add ``analyze`` to the ``rhyme-jax`` subparsers."""
    an = add_command(sub, "analyze", "RhymeRL O5/O6 (token rhyme, length-rank shifts) of a run's saved "
                     "rollouts", run, config=False,
                     examples=("python -m rhyme_lab analyze runs/demo", "python -m rhyme_lab analyze runs/demo --window fixed"))
    an.add_argument("run_dir", help="run directory holding rollouts/step_*.npz")
    an.add_argument("--branch", choices=("reward", "count"), default=SpecSection.branch,
                    help="draft branch rule (default: %(default)s)")
    an.add_argument("--window", choices=("aimd", "mimd", "fixed"), default=SpecSection.window,
                    help="draft window policy (default: %(default)s)")


def run(args: argparse.Namespace) -> int:
    """Run ``python -m rhyme_lab analyze``; returns the exit status (2: unreadable rollouts)."""
    from rhyme_jax.io.rollout_log import RolloutLogError
    from rhyme_lab.analyze import AnalyzeError, analyze, format_table, write_analysis

    try:
        result = analyze(args.run_dir, branch=args.branch, window=args.window)
    except (AnalyzeError, RolloutLogError) as exc:
        return report("analyze", exc)
    print(format_table(result))
    paths = write_analysis(args.run_dir, result)
    print(f"outputs: {paths['md']}, {paths['json'].name}, {paths['png'].name}")
    return 0
