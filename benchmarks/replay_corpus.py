"""A drafter replay corpus from a training run's saved rollouts (issue 16 scope 4).

Writes the JSONL that ``python -m rhyme_lab replay-drafts`` and ``benchmarks.replay_peer`` read, one line
per target response: ``{"prompt": str, "history": [str, ...], "history_rewards": [float, ...],
"target": str}``. From ``RUN_DIR/rollouts/step_*.npz`` (``rhyme_jax.io.rollout_log``; the library is
``rhyme_lab.ablate.saved_runs.build``):

* ``history`` of a prompt = its responses in the history steps (in step order, as decoded text),
  with their rewards;
* every response of the target steps is one line, with the history of its prompt (prompts with no
  history in those steps get an empty one);
* ``prompt`` = the run's ``model.prompt_template`` applied to the train question of the prompt id
  (the text whose token ids the run fed the model; the rollouts store only the prompt id).

Responses are decoded with the tokenizer (special tokens such as the end marker dropped), so a
target re-encodes to the sampled tokens up to the tokenizer's canonical split. By default the
history steps are the run's first epoch and the target steps its second (``grpo.prompts_per_step``,
``grpo.num_prompts``); ``--max-targets`` keeps a seeded random subset of the target lines, in order.

    python -m benchmarks.replay_corpus /tmp/smol/runs/gsm8k_smollm2_135m \
        --tokenizer ~/.cache/rhyme_jax/models/smollm2-135m-instruct --out /tmp/corpora/smollm2.jsonl \
        --history-steps 1-2 --target-steps 3-4
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rhyme_lab.ablate.saved_runs import build, parse_steps, write_corpus
from rhyme_jax.model.tokenizer import Tokenizer


def main(argv=None) -> int:
    """Command line (see the module docstring); returns the exit status."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--tokenizer", required=True, help="tokenizer.json or a directory holding one")
    ap.add_argument("--out", required=True, type=Path, help="JSONL file to write")
    ap.add_argument("--history-steps", help="a-b: steps whose responses are the history (default: epoch 1)")
    ap.add_argument("--target-steps", help="c-d: steps whose responses are the targets (default: epoch 2)")
    ap.add_argument("--max-targets", type=int, default=0, help="seeded random subset of targets (0 = all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a field of the run's config.yaml (e.g. data.train_path=...)")
    args = ap.parse_args(argv)
    try:
        hist = parse_steps(args.history_steps, "--history-steps") if args.history_steps else None
        tgt = parse_steps(args.target_steps, "--target-steps") if args.target_steps else None
        tok = Tokenizer.from_file(args.tokenizer)
        lines = build(args.run_dir, tok, history_steps=hist, target_steps=tgt, max_targets=args.max_targets,
                      seed=args.seed, overrides=args.overrides)
    except (ValueError, OSError) as exc:  # CorpusError, ConfigError, DataError, RolloutLogError, TokenizerError
        print(f"benchmarks.replay_corpus: {exc}", file=sys.stderr)
        return 2
    print(write_corpus(args.out, lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
