"""Per-token growth of a sequence's KV pages, decode pass, drafter history and rollout log from
hundreds to thousands of tokens (``rhyme_lab.measure.long_sequences``).

Usage (repository root)::

    python -m benchmarks.long_sequences                          # L = 512 .. 8192, 4 rows, demo model
    python -m benchmarks.long_sequences --lengths 256,1024 --rows 2

Prints a line per length and writes ``<out>/long_sequences.json`` (default ``runs/bench_long``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rhyme_lab.measure.long_sequences import long_sequence_growth


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.long_sequences", description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="512,1024,2048,4096,8192", help="comma-separated sequence lengths")
    ap.add_argument("--rows", type=int, default=4, help="sequences per length")
    ap.add_argument("--model", default="demo", help="demo, or a directory with an HF config.json")
    ap.add_argument("--out", default="runs/bench_long")
    args = ap.parse_args(argv)
    rows = long_sequence_growth([int(x) for x in args.lengths.split(",")], args.rows, model=args.model)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "long_sequences.json").write_text(json.dumps(rows, indent=1))
    print(f"wrote {out / 'long_sequences.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
