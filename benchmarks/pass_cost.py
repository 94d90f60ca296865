"""Cost of one rollout forward pass: plain decode vs HistoSpec verify, by model size (issue 4).

HistoSpec's rollout speed-up is ``(fewer batch passes) x (plain pass cost / verify pass cost)``.
``python -m benchmarks.rollout`` measures the first factor on real rollouts; this script measures
the second (``rhyme_lab.measure.pass_cost``): the rollout engine's jitted step for ``--rows`` live
sequences of ``--context`` cached tokens each, with K draft tokens per row for each K of
``--drafts`` (K = 0 is plain decode), random weights. Reported per K: median wall-clock ms per
pass over ``--iters`` passes after a warm-up, tokens per pass, and the cost relative to K = 0;
with ``--passes-ratio`` also the rollout speed-up it implies.

Usage::

    python -m benchmarks.pass_cost                                  # the CPU demo model
    python -m benchmarks.pass_cost --model configs/models/qwen2.5-1.5b --dtype bfloat16   # on a GPU

Writes ``pass_cost_<model>.json`` / ``.md`` under ``--out`` and prints the table.
"""

from __future__ import annotations

import argparse
import sys

from rhyme_lab.measure.pass_cost import (cost_table, model_config, parse_drafts, pass_costs, pass_engine, run_meta,
                                         write_cost_report)


def main(argv=None) -> int:
    """Command line (module docstring); returns the exit status (2: a bad ``--drafts``)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo", help="'demo' or a directory with a HF config.json")
    ap.add_argument("--dtype", default="float32", help="parameter and compute dtype")
    ap.add_argument("--rows", type=int, default=128, help="live sequences per pass")
    ap.add_argument("--context", type=int, default=128, help="cached tokens per sequence")
    ap.add_argument("--drafts", default="0,1,3,7", help="draft tokens per row (0 = plain decode)")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--attention", default="auto")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--passes-ratio", type=float, default=0.0,
                    help="fewer batch passes measured by benchmarks.rollout (prints the implied speed-up)")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    try:
        ks = parse_drafts(args.drafts)
    except ValueError as exc:
        print(f"benchmarks.pass_cost: {exc}", file=sys.stderr)
        return 2
    eng, state = pass_engine(model_config(args.model), args.dtype, args.rows, args.context, max(ks), args.attention)
    results = pass_costs(eng, state, ks, args.rows, args.context, args.iters, args.temperature,
                         log=lambda line: print(line, flush=True))
    meta = run_meta(args.model, args.dtype, args.rows, args.context, eng, state)
    text = cost_table(meta, results, args.passes_ratio)
    print(text)
    write_cost_report(args.out, args.model, meta, results, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
