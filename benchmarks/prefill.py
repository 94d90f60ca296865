"""Prefill step cost: the plan's chunked layout against one query tile per sequence.

A prefill packs up to ``N = min(max_slots, T)`` sequences into ``T`` tokens. The plan
(``ShapePlan.prefill_layout``) cuts every sequence into attention rows of ``Q = pow2(T / N)``
tokens (``N + T / Q`` rows, padded query work <= 2 T); the layout it replaced gave every sequence
one row whose query tile held the longest prompt (``N`` rows of ``pow2(max_prompt_len)``, or of the
longest prompt in the batch when a program of that size exists). This times both on the engine
of a config's model (random weights of its shape are enough: the cost does not depend on them),
each program on dummy inputs, the median of ``--repeats`` runs after two untimed ones.

Usage::

    python -m benchmarks.prefill                                        # the demo (configs/default.yaml)
    python -m benchmarks.prefill --config configs/gsm8k_smollm2_135m.yaml --tokens 512,1024

Prints a markdown table (milliseconds per prefill step). Nothing is written.
"""

from __future__ import annotations

import argparse
import sys

from rhyme_lab.measure.timing import median_seconds


def time_program(runner, shape, repeats: int) -> float:
    """Median seconds of one prefill program on dummy inputs (two untimed runs first);
    ``runner``: the engine's ``PassRunner``."""
    inp = runner.inputs(shape)
    return median_seconds(lambda: runner.run(inp), repeats, warmup=2)


def main(argv=None) -> int:
    """Command line (module docstring); returns the exit status."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/default.yaml")
    ap.add_argument("--tokens", default="", help="comma-separated prefill buckets T (default: the plan's two largest)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)

    from flax import nnx

    from rhyme_jax.config import load_config
    from rhyme_jax.model.transformer import Decoder
    from rhyme_jax.rollout import shapes
    from rhyme_jax.rollout.engine import EngineConfig, RolloutEngine, SamplingParams
    from rhyme_jax.train.memory_plan import model_config_of

    cfg = load_config(args.config)
    r = cfg.rollout
    model_cfg, source = model_config_of(cfg, "")
    graphdef, state = nnx.split(Decoder(model_cfg, rngs=nnx.Rngs(0)))
    engine = RolloutEngine(graphdef, model_cfg, EngineConfig(
        max_slots=r.max_slots, page_size=r.page_size, num_pages=0, max_prompt_len=r.max_prompt_len,
        max_new_tokens=r.max_new_tokens, eos_ids=()))
    sampling = SamplingParams.from_section(r)
    runner = engine.runner(state, sampling)
    plan = engine.plan
    buckets = [int(t) for t in args.tokens.split(",") if t] or list(plan.prefill_buckets[-2:])
    tile = min(plan.q_cap, max(shapes.MIN_PREFILL_Q, shapes.pow2(r.max_prompt_len)))
    print(f"{args.config} ({source}): max_slots {r.max_slots}, max_prompt_len {r.max_prompt_len}, "
          f"{plan.pages_per_seq} pages per sequence\n")
    print("| T | chunked (S, Q) | ms | one tile (N, Q) | ms | ratio |\n|---|---|---|---|---|---|")
    for t in buckets:
        rows, q = plan.prefill_layout(t)
        n, q_one = min(r.max_slots, t), min(t, tile)
        chunked = shapes.PassShape("prefill", t, rows, q, plan.pages_per_seq)
        one = shapes.PassShape("prefill", t, n, q_one, plan.pages_per_seq)
        a = time_program(runner, chunked, args.repeats)
        b = time_program(runner, one, args.repeats)
        print(f"| {t} | ({rows}, {q}) | {1e3 * a:.1f} | ({n}, {q_one}) | {1e3 * b:.1f} | {b / a:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
