"""``rhyme-jax``: the console script. Each command group registers itself (``register(sub)``) and
names the function that runs it; ``main`` parses and dispatches.

Every command that reads a run config takes ``--config configs/X.yaml`` and any number of
``--set a.b=c`` overrides; outputs go to ``<run.runs_dir>/<run.name>/``.
"""

from __future__ import annotations

import argparse
import sys

from rhyme_jax.cli import compile_report, export, memory, models, training

GROUPS = (training, export, memory, models, compile_report)

EXAMPLES = """examples:
  rhyme-jax demo                                              # the CPU demo: SFT warm start + GRPO + summary
  rhyme-jax train --config configs/arith_smollm2_135m.yaml    # GRPO on SmolLM2-135M-Instruct
  rhyme-jax train --config configs/arith_smollm2_135m.yaml --dry-run   # config, memory plan, programs
  rhyme-jax eval --config configs/arith_smollm2_135m.yaml --checkpoint initial --set run.eval_samples=8
  rhyme-jax memory --config configs/gsm8k_qwen2.5_1.5b.yaml --model-config configs/models/qwen2.5-1.5b --devices 8
  rhyme-jax COMMAND --help                                    # a command's flags and examples"""


def parser() -> argparse.ArgumentParser:
    """The ``rhyme-jax`` argument parser: one sub-command per registered command."""
    p = argparse.ArgumentParser(prog="rhyme-jax", description="RL post-training (GRPO) of LLMs in JAX with "
                                "history-drafted speculative rollouts (RhymeRL).", epilog=EXAMPLES,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for group in GROUPS:
        group.register(sub)
    return p


def main(argv: list[str] | None = None, *, reward_fn=None) -> int:
    """Entry point of the ``rhyme-jax`` console script; returns the process exit status.

    Args:
      argv: the arguments (default ``sys.argv[1:]``).
      reward_fn: ``(response_text, problem) -> float`` GRPO reward of ``train`` / ``demo`` instead
        of the configured one (for tests and scripts driving the CLI in process).
    """
    args = parser().parse_args(argv)
    args.reward_fn = reward_fn
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
