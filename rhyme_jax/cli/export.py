"""``rhyme-jax export RUN_DIR OUT_DIR``: a run's checkpoint as a Hugging Face checkpoint directory
(safetensors, config, tokenizer, chat template) for transformers or vLLM
(``rhyme_jax.train.export``; docs/export.md)."""

from __future__ import annotations

import argparse

from rhyme_jax.cli.common import add_command, report, user_errors


def register(sub) -> None:
    """Add ``export`` to the ``rhyme-jax`` subparsers."""
    sp = add_command(sub, "export", "write a run's checkpoint as a Hugging Face checkpoint (safetensors, "
                     "config, tokenizer, chat template) in the source model's dtype", run, config=False,
                     examples=("rhyme-jax export runs/arith_smollm2_135m out/arith-smollm2",
                               "rhyme-jax export runs/arith_smollm2_135m out/step10 --step 10",
                               "rhyme-jax export runs/demo out/demo-initial --step initial"))
    sp.add_argument("run_dir", help="run directory (holds config.yaml and checkpoints/)")
    sp.add_argument("out_dir", help="directory to write (must not exist or be empty, unless --overwrite)")
    sp.add_argument("--step", default=None, help="checkpoint step (default: the newest); 'initial' = the "
                    "model GRPO started from")
    sp.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT_DIR")


def run(args: argparse.Namespace) -> int:
    """Run ``rhyme-jax export``; prints the written directory; returns the exit status."""
    from rhyme_jax.config import ConfigError
    from rhyme_jax.train.export import ExportError, export_hf

    try:
        out = export_hf(args.run_dir, args.out_dir, step=args.step, overwrite=args.overwrite)
    except (ExportError, ConfigError, *user_errors()) as exc:
        return report("export", exc)
    print(out)
    return 0
