"""Padded vs padding-free GRPO update on the long-tailed ledger task's minibatches
(``rhyme_lab.measure.packed_update``; ``grpo.padding_free``).

Usage (repository root)::

    python -m benchmarks.packed_update                       # configs/longtail.yaml, 5 draws of 32 rows
    python -m benchmarks.packed_update --draws 2 --rows 16   # quicker

Each draw samples ``--rows`` train problems of the config's task (prompt + worked solution +
EOS: the lengths of a minibatch once the policy writes the format), with the run's tokenizer
(trained on first use under ``--out``). Prints a line per draw and the mean ratios, and writes
``<out>/packed_update.json`` (default ``runs/bench_packed``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from rhyme_jax.config import load_config
from rhyme_jax.data import load_problems
from rhyme_jax.train.policy import build_tokenizer, tiny_model_config
from rhyme_lab.measure.packed_update import compare

ROOT = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.packed_update", description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "longtail.yaml"))
    ap.add_argument("--draws", type=int, default=5)
    ap.add_argument("--rows", type=int, default=32, help="rows of a minibatch (longtail.yaml: 8 x 8 / 2)")
    ap.add_argument("--repeats", type=int, default=3, help="timed updates per layout after the compile (median)")
    ap.add_argument("--out", default="runs/bench_packed")
    args = ap.parse_args(argv)
    cfg = load_config(args.config, [])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    train, _ = load_problems(cfg.data)
    tok = build_tokenizer(cfg, out, train)
    model_cfg = tiny_model_config(cfg, tok)
    rng = np.random.default_rng(1)
    draws = []
    for _ in range(args.draws):
        probs = [train[i] for i in rng.choice(len(train), args.rows, replace=False)]
        draws.append(([tok.encode(tok.format_prompt(cfg.model.prompt_template, p.question)) for p in probs],
                      [tok.encode(p.solution) + [tok.eos_id] for p in probs]))
    rows = compare(cfg, model_cfg, draws, repeats=args.repeats)
    print(f"mean over {len(rows)} draws: {np.mean([r['speedup'] for r in rows]):.2f}x faster, "
          f"{np.mean([r['memory_ratio'] for r in rows]):.2f} of the padded update's temporaries")
    for name in ("classes", "blocked_padded", "blocked_classes", "blocked_packed"):
        if f"{name}_s" in rows[0]:
            print(f"{name.replace('_', ' ')}: {np.mean([r[name + '_speedup'] for r in rows]):.2f}x faster than "
                  f"padded, {np.mean([r[name + '_memory_ratio'] for r in rows]):.2f} of its temporaries")
    (out / "packed_update.json").write_text(json.dumps(rows, indent=1))
    print(f"wrote {out / 'packed_update.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
