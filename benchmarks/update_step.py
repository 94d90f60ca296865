"""Time one GRPO update at a recipe's sizes with random weights; report peak device memory.

The update is ``train.grpo_step.make_grpo_step`` with the config's ``grpo.micro_batch_tokens``,
``logit_chunk`` and ``remat``, over one minibatch of ``--rows`` rows x ``--tokens`` tokens
(default: the recipe's minibatch on one device) of random tokens with random behaviour logprobs
and advantages. Weights are random (normal 0.02), float32 master weights computing in
``model.dtype`` as in a run: memory and time do not depend on their values
(``rhyme_lab.ablate.update_cost.time_update``). Prints and writes JSON: compile seconds, median
step seconds, tokens/s, micro-batches, XLA's temporaries and (on GPU/TPU) the device's peak bytes
in use.

    python -m benchmarks.update_step --config configs/gsm8k_qwen2.5_1.5b.yaml \\
        --model-config configs/models/qwen2.5-1.5b --rows 16 --tokens 1536 --out /tmp/upd.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rhyme_lab.ablate.update_cost import time_update
from rhyme_jax.config import load_config
from rhyme_jax.train.memory_plan import model_config_of


def main(argv=None) -> dict:
    """Command line (module docstring); returns the report."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--model-config", default="")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--rows", type=int, default=0, help="minibatch rows (default: the recipe's)")
    ap.add_argument("--tokens", type=int, default=0, help="padded tokens per row (default: prompt + new)")
    ap.add_argument("--steps", type=int, default=3, help="timed updates after the first")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    g = cfg.grpo
    model_cfg, source = model_config_of(cfg, args.model_config)
    rows = args.rows or g.prompts_per_step * g.samples_per_prompt // g.minibatches
    tokens = args.tokens or -(-(cfg.rollout.max_prompt_len + cfg.rollout.max_new_tokens) // 16) * 16
    report = time_update(cfg, model_cfg, source, rows, tokens, args.steps)
    print(json.dumps(report))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
