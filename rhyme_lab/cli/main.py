"""``python -m rhyme_lab``: parses the lab's commands and dispatches them (run from the repository
root, where ``configs/`` is)."""

from __future__ import annotations

import argparse
import sys

from rhyme_lab.cli import ablate, analyze, replay

GROUPS = (ablate, analyze, replay)
PROG = "python -m rhyme_lab"

EXAMPLES = """examples:
  python -m rhyme_lab ablate --list                     # every ablation id, its configs, what it measures
  python -m rhyme_lab ablate paper --quick              # the paper's ablations at CPU scale
  python -m rhyme_lab analyze runs/demo                 # RhymeRL O5/O6 over a run's saved rollouts
  python -m rhyme_lab COMMAND --help                    # a command's flags and examples"""


def parser() -> argparse.ArgumentParser:
    """The lab's argument parser: one sub-command per command module."""
    p = argparse.ArgumentParser(prog=PROG, description="rhyme-lab: the measurements of rhyme-jax (the paper's "
                                "ablations, observations and drafter replays).", epilog=EXAMPLES,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for group in GROUPS:
        group.register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m rhyme_lab``; returns the process exit status."""
    args = parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
