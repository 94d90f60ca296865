"""Attention of the long tail's decode and verify passes: the reference against ``live_pages``
(``rhyme_lab.bench.tail_attention``'s docstring gives the cases and the method).

Usage (repository root)::

    python -m benchmarks.tail_attention                  # configs/longtail.yaml's model and tail programs
    python -m benchmarks.tail_attention --repeats 3 --out runs/bench_tail
    python -m benchmarks.tail_attention --model smollm2 --repeats 15

Prints a markdown table (ms per pass of the attention of every layer, and each verify case over
decode of the same program) and writes ``<out>/tail_attention.json`` (``tail_attention_smollm2.json``)
with the commit.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rhyme_lab.bench.tail_attention import IMPLEMENTATIONS, MODELS, sweep, table


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.tail_attention", description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="longtail", help="shape set (MODELS)")
    ap.add_argument("--implementations", default=",".join(IMPLEMENTATIONS),
                    help="comma-separated api names")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", default="runs/bench_tail")
    args = ap.parse_args(argv)
    from rhyme_lab import provenance

    shapes, pool_pages, cases = MODELS[args.model]
    rows = sweep(cases, tuple(args.implementations.split(",")), repeats=args.repeats, pool_pages=pool_pages, **shapes)
    print(table(rows))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / ("tail_attention.json" if args.model == "longtail" else f"tail_attention_{args.model}.json")
    meta = {**provenance.stamp(None), "model": args.model, "shapes": shapes, "pool_pages": pool_pages}
    path.write_text(json.dumps({**meta, "cases": rows}, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
