"""``rhyme-jax memory``: per-device memory of a run's training state and of one GRPO update
(``rhyme_jax.train.memory_plan``; from shapes, nothing allocated)."""

from __future__ import annotations

import argparse
import json

from rhyme_jax.cli.common import add_command, load_run_config, report, user_errors


def register(sub) -> None:
    """Add ``memory`` to the ``rhyme-jax`` subparsers."""
    sp = add_command(sub, "memory", "per-device memory of params, optimizer state and one GRPO update "
                     "under the config (from shapes; allocates nothing)", run,
                     examples=("rhyme-jax memory --config configs/arith_smollm2_135m.yaml",
                               "rhyme-jax memory --config configs/gsm8k_qwen2.5_1.5b.yaml "
                               "--model-config configs/models/qwen2.5-1.5b --devices 8 --json"))
    sp.add_argument("--model-config", default="", help="HF config.json (or its directory) to size; "
                    "default: model.path's, else the tiny demo model")
    sp.add_argument("--devices", type=int, default=0,
                    help="devices to plan for (fills a -1 mesh axis; default: this machine's)")
    sp.add_argument("--rows", type=int, default=0, help="rows of the update's micro-batch per device "
                    "(default: the config's minibatch rows per device under grpo.micro_batch_tokens)")
    sp.add_argument("--tokens", type=int, default=0, help="padded tokens per row (default: "
                    "rollout.max_prompt_len + rollout.max_new_tokens)")
    sp.add_argument("--mean-tokens", type=int, default=0, help="mean real tokens per sequence; with "
                    "grpo.padding_free the update packs rows and is planned over the packed rows")
    sp.add_argument("--no-update", action="store_true", help="skip compiling the update (state only)")
    sp.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def run(args: argparse.Namespace) -> int:
    """Run ``rhyme-jax memory``; returns the exit status."""
    from rhyme_jax.train.memory_plan import memory_report, print_report

    cfg = load_run_config(args)
    if cfg is None:
        return 2
    try:
        rep = memory_report(cfg, model_config=args.model_config, devices=args.devices, rows=args.rows,
                            tokens=args.tokens, update=not args.no_update, mean_tokens=args.mean_tokens)
    except user_errors() as exc:
        return report("memory", exc)
    if args.json:
        print(json.dumps(rep))
    else:
        print_report(rep)
    return 0
