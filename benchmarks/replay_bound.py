"""Upper bound on HistoSpec's rollout speed-up on this machine: a drafter that is always right.

``python -m rhyme_lab replay-drafts`` replays the real drafter along target responses and models each step's
seconds with the engine's pass-cost profile. This script replays the same corpus with a drafter
that knows the targets (``rhyme_lab.measure.oracle_drafters.KnownTargets``): every row's draft is
its next target tokens (up to ``shapes.MAX_DRAFT`` and the tokens left; ``AlwaysRightDrafter``),
with acceptance estimates of 1 and the true remaining length as priority, and the engine's own
allocation (``allocation.choose_pass``) picks each step's program. Every
drafted token is accepted, so no drafter over any source, with any acceptance estimates, can
emit more tokens per modelled second through the engine's programs: the printed
``modelled_speedup`` (plain decode's modelled seconds / the replay's) bounds what HistoSpec
can reach for these targets, rows and pass-cost profile. (The allocation is per step and greedy;
prefill passes are left out of both sides; pages are not simulated.)

Usage::

    python -m benchmarks.replay_bound CORPUS.jsonl --tokenizer TOK --config configs/default.yaml \\
        --rows 128 --step-cost ~/.cache/rhyme_jax/step_cost/<profile>.json [--json]

CORPUS is ``python -m rhyme_lab replay-drafts``' JSONL (``python -m benchmarks.replay_corpus`` builds one from a
run's saved rollouts); only prompts and targets are used.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rhyme_jax.config import load_config
from rhyme_lab.measure.oracle_drafters import KnownTargets
from rhyme_lab.measure.text_replay import read_cases, replay
from rhyme_jax.model.tokenizer import Tokenizer
from rhyme_jax.rollout import shapes
from rhyme_jax.rollout.pass_cost import PassCost


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file")
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--config", default="configs/default.yaml")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--step-cost", required=True, help="pass-cost profile JSON of the engine's plan")
    ap.add_argument("--sources", action="store_true",
                    help="drafts limited to what the draft sources hold (history, siblings, self; best in hindsight)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    cases = read_cases(Path(args.file), Tokenizer.from_file(args.tokenizer).encode)
    r = cfg.rollout
    plan = shapes.plan(max_slots=args.rows, page_size=r.page_size, max_prompt_len=r.max_prompt_len,
                       max_new_tokens=r.max_new_tokens, max_verify_tokens=r.max_verify_tokens)
    cost = PassCost.load(args.step_cost)
    drafter = KnownTargets([c.prompt for c in cases], [c.target for c in cases],
                           [c.history for c in cases] if args.sources else None)
    out = replay(cases, cfg.spec, plan, args.rows, cost, make_drafter=drafter)
    out = {"rows": args.rows, "step_cost": args.step_cost, "sources": args.sources, **out}
    if args.json:
        print(json.dumps(out))
    else:
        what = "best-in-hindsight drafts from the sources" if args.sources else "always-right drafts"
        print(f"{len(cases)} targets, {out['target_tokens']} tokens, {args.rows} rows: {what} give "
              f"{out['tokens_per_forward']:.2f} tokens per sequence pass, modelled speed-up "
              f"{out['modelled_speedup']:.2f}x over plain decode (upper bound)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
