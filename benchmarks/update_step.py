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

With ``--run-dir RUN --step N`` it times instead the whole update of a step that run logged: its
rows, minibatches and packing under the run's config plus ``--set`` overrides
(``rhyme_lab.ablate.logged_update``), e.g. the ledger task's step 16 with and without remat::

    python -m benchmarks.update_step --run-dir results/longtail/runs/longtail_recur_paired --step 16
    python -m benchmarks.update_step --run-dir results/longtail/runs/longtail_recur_paired --step 16 \\
        --set grpo.remat=true
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rhyme_lab.ablate.update_cost import time_update
from rhyme_lab.ablate.logged_update import time_logged_update
from rhyme_jax.config import load_config
from rhyme_jax.train.memory_plan import model_config_of


def main(argv=None) -> dict:
    """Command line (module docstring); returns the report."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="", help="the recipe (required without --run-dir)")
    ap.add_argument("--run-dir", default="", help="a run whose logged step --step to time (its config.yaml)")
    ap.add_argument("--step", type=int, default=1)
    ap.add_argument("--model-config", default="")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--rows", type=int, default=0, help="minibatch rows (default: the recipe's)")
    ap.add_argument("--tokens", type=int, default=0, help="padded tokens per row (default: prompt + new)")
    ap.add_argument("--steps", type=int, default=3, help="timed updates after the first")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    if args.run_dir:
        report = time_logged_update(args.run_dir, args.step, args.overrides, repeats=args.steps)
        return _emit(report, args.out)
    if not args.config:
        ap.error("--config is required without --run-dir")
    cfg = load_config(args.config, args.overrides)
    g = cfg.grpo
    model_cfg, source = model_config_of(cfg, args.model_config)
    rows = args.rows or g.prompts_per_step * g.samples_per_prompt // g.minibatches
    tokens = args.tokens or -(-(cfg.rollout.max_prompt_len + cfg.rollout.max_new_tokens) // 16) * 16
    return _emit(time_update(cfg, model_cfg, source, rows, tokens, args.steps), args.out)


def _emit(report: dict, out: str) -> dict:
    print(json.dumps(report))
    if out:
        Path(out).write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
