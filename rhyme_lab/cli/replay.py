"""``python -m rhyme_lab replay-drafts FILE.jsonl``: the HistoSpec drafter replayed along target texts
(``rhyme_lab.measure.text_replay``: the input format and the accounting)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rhyme_jax.cli.common import add_command, load_run_config

DEFAULT_ROWS = 64


def register(sub) -> None:
    """Add ``replay-drafts`` to the ``rhyme-jax`` subparsers."""
    sp = add_command(sub, "replay-drafts", "replay the HistoSpec drafter along target texts: predicted "
                     "share, tokens and drafts per forward, acceptance", run,
                     examples=("python -m rhyme_lab replay-drafts corpus.jsonl --tokenizer ~/.cache/rhyme_jax/models/"
                               "smollm2-135m-instruct --set spec.window=goodput --json",))
    sp.add_argument("file", help="JSONL: {prompt, history: [str], history_rewards: [float], target} per line")
    sp.add_argument("--tokenizer", required=True, help="tokenizer.json or a directory holding one")
    sp.add_argument("--rows", type=int, default=DEFAULT_ROWS, help="targets live at once (default: %(default)s)")
    sp.add_argument("--step-cost", default="", help="pass-cost profile JSON the step choice uses (default: the "
                    "config's spec.step_cost, else the analytical prior)")
    sp.add_argument("--draft-price", type=float, default=None, metavar="P",
                    help="instead of a pass-cost model: a step of S rows packing T tokens costs S + P (T - S) "
                    "(one draft token = P row decodes; 0 = drafts are free); traces share against drafts per forward")
    sp.add_argument("--accept-floor", type=float, default=None, metavar="F",
                    help="no step shapes: each row sends the draft tokens whose estimated probability of "
                    "acceptance is >= F (needs spec.window=goodput); traces share against drafts per forward")
    sp.add_argument("--json", action="store_true", help="print one JSON object")


def _fail(message: str) -> int:
    print(f"python -m rhyme_lab replay-drafts: {message}", file=sys.stderr)
    return 2


def _cost(args: argparse.Namespace, cfg):
    """The pass-cost model: ``--draft-price``, else ``--step-cost`` / ``spec.step_cost``, else the
    prior (None). Raises ``PassCostError``."""
    from rhyme_lab.measure.text_replay import priced_cost
    from rhyme_jax.rollout.pass_cost import PassCost, PassCostError

    if args.draft_price is not None:
        if not args.draft_price >= 0:
            raise PassCostError(f"--draft-price: expected >= 0, got {args.draft_price}")
        return priced_cost(args.draft_price)
    path = args.step_cost or cfg.spec.step_cost
    return PassCost.load(path) if path not in ("", "prior") else None


def run(args: argparse.Namespace) -> int:
    """Run ``python -m rhyme_lab replay-drafts``; returns the exit status."""
    from rhyme_lab.measure.text_replay import ReplayInputError, accept_floor_error, read_cases, replay
    from rhyme_jax.model.tokenizer import Tokenizer, TokenizerError
    from rhyme_jax.rollout import shapes
    from rhyme_jax.rollout.pass_cost import PassCostError

    if args.rows < 1:
        return _fail("--rows must be >= 1")
    cfg = load_run_config(args)
    if cfg is None:
        return 2
    try:
        tok = Tokenizer.from_file(args.tokenizer)
        cases = read_cases(Path(args.file), tok.encode)
        bad = accept_floor_error(args.accept_floor, cfg.spec.window)
        if bad:
            return _fail(bad)
        cost = _cost(args, cfg)
    except (TokenizerError, ReplayInputError, PassCostError) as exc:
        return _fail(str(exc))
    r = cfg.rollout
    plan = shapes.plan(max_slots=args.rows, page_size=r.page_size, max_prompt_len=r.max_prompt_len,
                       max_new_tokens=r.max_new_tokens, max_verify_tokens=r.max_verify_tokens)
    out = replay(cases, cfg.spec, plan, args.rows, cost, accept_floor=args.accept_floor)
    if args.json:
        print(json.dumps(out))
    else:
        print(f"{len(cases)} targets, {out['target_tokens']} tokens, {args.rows} rows live: predicted share "
              f"{out['predicted_share']:.3f}, {out['tokens_per_forward']:.2f} tokens and "
              f"{out['drafted_per_forward']:.2f} drafts per forward, acceptance {out['acceptance']:.3f} "
              f"(predicted {out['predicted_acceptance']:.3f}), "
              f"modelled speed-up {out['modelled_speedup']:.2f}x")
    return 0
