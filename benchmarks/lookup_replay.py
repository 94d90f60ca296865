"""Passes the device's history lookup would need at a fixed draft room, on a run's saved tokens.

Replays ``rollout.device_drafts.lookup_drafts`` along the longest responses of each saved step
(``rhyme_lab.measure.lookup_replay``: every pass drafts ``--room`` tokens from the row's own
tokens, and with ``--history-width`` from the prompt's responses of its latest earlier step; a
draft token is accepted exactly when it is the saved token). Prints, per step, the plain passes
(the longest response), the replay's passes per row and its accepted draft tokens per pass by
position band: where along a response the lookup's drafts land, with no guard deciding how much
to send. No model runs; seconds per step on a CPU.

Usage::

    python -m benchmarks.lookup_replay results/longtail/runs/longtail_bound_paired --steps 2
    python -m benchmarks.lookup_replay RUN --steps 2 --context 4096     # a longer own window
    python -m benchmarks.lookup_replay RUN --history-width 1024 --json  # with the prompt's history
"""

from __future__ import annotations

import argparse
import json
import sys

from rhyme_jax.rollout.chunk_spec import CONTEXT
from rhyme_jax.rollout.device_drafts import MATCH


def main(argv=None) -> int:
    from rhyme_jax.io.rollout_log import list_rollout_steps
    from rhyme_lab.measure.lookup_replay import step_report

    ap = argparse.ArgumentParser(prog="python -m benchmarks.lookup_replay", description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", help="a run directory with rollouts/step_*.npz")
    ap.add_argument("--steps", type=int, nargs="*", default=None, help="saved steps (default: all)")
    ap.add_argument("--room", type=int, default=MATCH, help=f"draft tokens asked per pass (at most {MATCH})")
    ap.add_argument("--context", type=int, default=CONTEXT, help="own tokens searched")
    ap.add_argument("--history-width", type=int, default=0, help="history columns (0: the row's own tokens only)")
    ap.add_argument("--top", type=int, default=4, help="longest rows of each step replayed")
    ap.add_argument("--band", type=int, default=512, help="position band of the acceptance table (tokens)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    steps = args.steps or list_rollout_steps(args.run_dir)
    if not steps:
        print(f"{args.run_dir}: no rollouts/step_*.npz", file=sys.stderr)
        return 2
    out = []
    for step in steps:
        doc = step_report(args.run_dir, step, room=args.room, context=args.context, history_width=args.history_width,
                          top=args.top, band=args.band)
        out.append(doc)
        if not args.json:
            print(f"step {step}: plain {doc['plain_passes']:,} passes, lookup at room {args.room} "
                  f"{doc['passes']:,} ({doc['plain_passes'] / max(doc['passes'], 1):.2f}x)")
            for x in doc["rows"]:
                bands = " ".join(f"{b}:{v:.1f}" for b, v in x["accepted_by_band"].items())
                print(f"  row {x['row']}: {x['length']:,} tokens in {x['passes']:,} passes; accepted a pass from "
                      f"token {bands}")
    if args.json:
        print(json.dumps({"room": args.room, "context": args.context, "history_width": args.history_width,
                          "steps": out}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
