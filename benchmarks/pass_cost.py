"""Cost of one rollout forward pass: plain decode vs HistoSpec verify, by model size (issue 4).

HistoSpec's rollout speed-up is ``(fewer batch passes) x (plain pass cost / verify pass cost)``.
``python -m benchmarks.rollout`` measures the first factor on real rollouts; this script measures
the second (``rhyme_lab.measure.pass_cost``): the rollout engine's jitted step for ``--rows`` live
sequences of ``--context`` cached tokens each, with K draft tokens per row for each K of
``--drafts`` (K = 0 is plain decode), random weights. Reported per K: median wall-clock ms per
pass over ``--iters`` passes after a warm-up, tokens per pass, and the cost relative to K = 0;
with ``--passes-ratio`` also the rollout speed-up it implies.

``--buckets 4x4,4x6,64x64,...`` times those ``(rows, packed tokens)`` programs instead (each filled
exactly: drafts spread evenly over the rows; ``--rows`` is then the engine's slots, and
``--max-new-tokens`` / ``--verify-tokens`` size its pool and verify budget as a run's config
would); ``--memory`` adds each program's compiled temporaries against the pool's size.

Usage::

    python -m benchmarks.pass_cost                                  # the CPU demo model
    python -m benchmarks.pass_cost --model configs/models/qwen2.5-1.5b --dtype bfloat16   # on a GPU
    python -m benchmarks.pass_cost --model configs/models/smollm2-135m --rows 64 --context 128 \
        --max-new-tokens 128 --verify-tokens 256 --buckets 4x4,4x6,64x64,64x96,64x256,4x132 --memory

Writes ``pass_cost_<model>.json`` / ``.md`` under ``--out`` and prints the table.
"""

from __future__ import annotations

import argparse
import sys

from rhyme_lab.measure.pass_cost import (bucket_costs, bucket_table, cost_table, model_config, parse_buckets,
                                         parse_drafts, pass_costs, pass_engine, run_meta, write_cost_report)


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
    ap.add_argument("--buckets", default="", help="ROWSxTOKENS programs to time instead of --drafts, e.g. 4x4,64x96")
    ap.add_argument("--max-new-tokens", type=int, default=0, help="engine's max_new_tokens (pool size; 0: drafts + 2)")
    ap.add_argument("--verify-tokens", type=int, default=0, help="engine's max_verify_tokens (0: rows x (drafts + 1))")
    ap.add_argument("--memory", action="store_true", help="with --buckets: compiled temporaries of each program")
    ap.add_argument("--row-buckets", default="", help="extra row buckets (rollout.row_buckets), e.g. 1,8")
    args = ap.parse_args(argv)
    try:
        ks = parse_drafts(args.drafts)
        buckets = parse_buckets(args.buckets) if args.buckets else []
    except ValueError as exc:
        print(f"benchmarks.pass_cost: {exc}", file=sys.stderr)
        return 2
    max_k = max(-(-(t - r) // r) for r, t in buckets) if buckets else max(ks)  # most drafts of one row
    eng, state = pass_engine(model_config(args.model), args.dtype, args.rows, args.context, max_k, args.attention,
                             max_new_tokens=args.max_new_tokens, verify_tokens=args.verify_tokens,
                             row_buckets=tuple(int(b) for b in args.row_buckets.split(",") if b))
    if buckets:
        return _buckets(args, eng, state, buckets)
    results = pass_costs(eng, state, ks, args.rows, args.context, args.iters, args.temperature,
                         log=lambda line: print(line, flush=True))
    meta = run_meta(args.model, args.dtype, args.rows, args.context, eng, state)
    text = cost_table(meta, results, args.passes_ratio)
    print(text)
    write_cost_report(args.out, args.model, meta, results, text)
    return 0


def _buckets(args, eng, state, buckets) -> int:
    try:
        results = bucket_costs(eng, state, buckets, args.context, args.iters, args.temperature,
                               log=lambda line: print(line, flush=True), memory=args.memory)
    except ValueError as exc:
        print(f"benchmarks.pass_cost: {exc}", file=sys.stderr)
        return 2
    meta = run_meta(args.model, args.dtype, args.rows, args.context, eng, state)
    text = bucket_table(meta, results)
    print(text)
    write_cost_report(args.out, args.model, meta, results, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
