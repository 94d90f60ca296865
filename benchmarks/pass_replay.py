"""Exact replay of HistoSpec's forward passes from a run's saved rollouts (issue 4 analysis).

The run's own drafter (its ``spec`` settings, ``--set`` overrides) replayed over
``<run>/rollouts/step_*.npz`` with a history store written back step by step as the trainer
writes it gives every sequence's verify passes without a model (a draft token is accepted
exactly when it equals the emitted token): ``rhyme_lab.measure.pass_replay`` (the replay, the
ratios, the oracle) driven over the run by ``rhyme_lab.ablate.saved_runs.pass_replay_run``.
Prints one JSON summary (``batch_ratio``: plain decode's forward passes / HistoSpec's, one batch
pass waiting for its slowest row; ``per_sequence_ratio``: generated tokens per sequence forward
pass, prefill included) and one row per step.

``--siblings`` also drafts from the responses of the same prompt that already finished in the
same step. ``--oracle`` gives an upper bound for any drafter over the same sources: every pass
accepts the longest continuation, up to ``--oracle-window`` tokens, that follows an occurrence of
the context's last 7..3 tokens in the previous rollout's responses or in the sequence itself.
The replay ignores preemption, the verify token budget and page limits.

Usage::

    python -m benchmarks.pass_replay runs/bench_rollout            # a run with HistoSpec on
    python -m benchmarks.pass_replay runs/bench_rollout --siblings --from-epoch 3
    python -m benchmarks.pass_replay runs/demo --set spec.window=goodput --set spec.pattern_min=1 \
        --set spec.siblings=true --set spec.min_token_prob=0     # the goodput drafter's sources

With ``spec.window=goodput`` every proposed draft token is sent (the engine would send only those
that pay for their step), so the replay bounds what the goodput sources can save in passes.
"""

from __future__ import annotations

import argparse
import json
import sys

from rhyme_lab.ablate.saved_runs import CorpusError, pass_replay_run


def main(argv=None) -> int:
    """Command line (module docstring); returns the exit status (2: no config or no steps)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", help="run directory with config.yaml, tokenizer.json and rollouts/")
    ap.add_argument("--from-epoch", type=int, default=3, help="report steps of this epoch on")
    ap.add_argument("--siblings", action="store_true", help="also draft from finished responses of the same step")
    ap.add_argument("--oracle", action="store_true", help="upper bound: best continuation among all matches")
    ap.add_argument("--oracle-window", type=int, default=32)
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override the run's config, e.g. spec.window=goodput (the goodput drafter's sources, "
                    "every drafted token sent: its bound without the engine's cost-aware cuts)")
    args = ap.parse_args(argv)
    try:
        summary, rows = pass_replay_run(args.run, args.overrides, args.from_epoch, args.siblings, args.oracle,
                                        args.oracle_window)
    except CorpusError as exc:
        print(f"benchmarks.pass_replay: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(summary))
    for r in rows:
        print(r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
