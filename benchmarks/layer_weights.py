"""Per-layer rollout weights against the stacked scan: one pass program's cost, in one process.

Two engines over the same random weights differ only in ``rollout.layer_weights`` (``split``: the
blocks' weights as ``L`` arrays and a Python layer loop; ``stacked``: a ``lax.scan`` over the
``[L, ...]`` weights; ``rollout/layer_weights.py``). For each K of ``--drafts`` (0 = plain
decode) both run the same pass (``--rows`` live rows of ``--context`` cached tokens, K drafts
each; ``rhyme_lab.measure.pass_cost.pass_inputs``), compiled first (compile seconds reported),
then ``--rounds`` rounds that alternate the layouts, ``--calls`` passes a round. Reported per K:
the median ms per pass of each layout and stacked / split (above 1: split is faster).

Usage::

    python -m benchmarks.layer_weights                                   # SmolLM2-135M shapes, 32 rows
    python -m benchmarks.layer_weights --model demo --rows 64 --drafts 0,3

Writes ``<out>/layer_weights_<model>.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


def _runners(cfg, rows: int, context: int, drafts: list[int]):
    """``{(layout, k): (runner, inputs, compile seconds)}`` over one random float32 state."""
    import numpy as np
    from flax import nnx

    from rhyme_jax.model.transformer import Decoder
    from rhyme_jax.rollout.engine import EngineConfig, RolloutEngine, SamplingParams
    from rhyme_lab.measure.pass_cost import pass_inputs

    graphdef, state = nnx.split(Decoder(cfg, rngs=nnx.Rngs(0)))
    out = {}
    for layout in ("split", "stacked"):
        eng = RolloutEngine(graphdef, cfg, EngineConfig(
            max_slots=rows, page_size=16, max_prompt_len=context + 32, max_new_tokens=64, attention_impl="auto",
            layer_weights=layout, max_verify_tokens=rows * (1 + max(drafts))))
        runner = eng.runner(state, SamplingParams(temperature=1.0, max_new_tokens=64))
        for k in drafts:
            inp, _ = pass_inputs(eng, rows, context, k, np.random.default_rng(0))
            t0 = time.perf_counter()
            runner.lower(inp).compile()
            compile_s = time.perf_counter() - t0
            runner.run(inp)
            out[(layout, k)] = (runner, inp, compile_s)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.layer_weights", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="configs/models/smollm2-135m", help="'demo' or a HF config directory")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--context", type=int, default=96, help="cached tokens per row")
    ap.add_argument("--drafts", default="0", help="comma-separated draft tokens per row (0 = decode)")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--calls", type=int, default=4, help="passes timed per round")
    ap.add_argument("--out", default="runs/bench_layer_weights")
    args = ap.parse_args(argv)
    from rhyme_lab.measure.pass_cost import model_config

    drafts = [int(k) for k in args.drafts.split(",")]
    runs = _runners(model_config(args.model), args.rows, args.context, drafts)
    ms = {key: [] for key in runs}
    for _ in range(args.rounds):
        for key, (runner, inp, _) in runs.items():
            t0 = time.perf_counter()
            for _ in range(args.calls):
                runner.run(inp)
            ms[key].append(1e3 * (time.perf_counter() - t0) / args.calls)
    table = []
    for k in drafts:
        split, stacked = (statistics.median(ms[(lay, k)]) for lay in ("split", "stacked"))
        table.append(dict(drafts=k, split_ms=split, stacked_ms=stacked, stacked_over_split=stacked / split,
                          compile_s={lay: runs[(lay, k)][2] for lay in ("split", "stacked")}))
        print(f"K={k}: split {split:.1f} ms, stacked {stacked:.1f} ms a pass, stacked/split {stacked / split:.3f}; "
              f"compile {runs[('split', k)][2]:.1f} s / {runs[('stacked', k)][2]:.1f} s")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = Path(args.model).name
    (out / f"layer_weights_{name}.json").write_text(json.dumps(dict(
        model=args.model, rows=args.rows, context=args.context, rounds=args.rounds, calls=args.calls,
        passes=table, ms=[dict(layout=lay, drafts=k, ms=v) for (lay, k), v in ms.items()]), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
