"""Prefill step cost at each page-table width of the plan.

A prefill packs up to ``N = min(max_slots, T)`` sequences into ``T`` tokens, cut into attention
rows of ``Q = pow2(T / N)`` tokens (``ShapePlan.prefill_layout``). Its page-table width is the
smallest of the plan's widths holding the batch's pages (``engine._prefill``); until commit
``274f237`` every prefill read all ``pages_per_seq`` columns, which the reference attention
gathers and scores whether or not a sequence holds them. This times the program of each bucket at
each width on the engine of a config's model (random weights of its shape are enough: the cost
does not depend on them), on dummy inputs, the median of ``--repeats`` runs after two untimed ones.

Usage::

    python -m benchmarks.prefill                                        # the demo (configs/default.yaml)
    python -m benchmarks.prefill --config configs/longtail.yaml --tokens 1024,4096

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
    widths = plan.widths
    print(f"{args.config} ({source}): max_slots {r.max_slots}, {plan.pages_per_seq} pages per sequence of "
          f"{r.page_size} tokens\n")
    print("| T | (S, Q) | " + " | ".join(f"ms at {w} pages" for w in widths) + " | full / narrowest |")
    print("|---|---|" + "---|" * len(widths) + "---|")
    for t in buckets:
        rows, q = plan.prefill_layout(t)
        ms = [1e3 * time_program(runner, shapes.PassShape("prefill", t, rows, q, w), args.repeats) for w in widths]
        print(f"| {t} | ({rows}, {q}) | " + " | ".join(f"{m:.1f}" for m in ms) + f" | {ms[-1] / ms[0]:.1f}x |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
