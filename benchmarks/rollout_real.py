"""Plain decode vs HistoSpec rollouts on a real model: SmolLM2-135M-Instruct on the learning recipe.

The shared real-model workload (``rhyme_lab.bench.real_workload``: the arithmetic recipe's train problems in the
model's chat template). Per sampling temperature: epoch 1 is a plain-decode rollout of every row (P prompts x
N samples, more rows than ``--max-slots`` so there is a queue, as in RL; key k1); its rewards
(``last_number``) go into a ``HistoryStore`` exactly as the trainer writes them back (step 1,
prompt id = problem id, each prompt's samples grouped) and the drafter's indexes are rebuilt.
Epoch 2 then runs twice on the same weights, prompt tokens and key k2 (``--repeats R``: R rounds
of both, interleaved, tokens/s from each one's median seconds): plain decode, and
HistoSpec with the paper defaults (a default ``SpecSection``: reward branch, AIMD window,
pattern 7/3, min_token_prob 0.1). Timed rollouts run on compiled programs: ``--warmup full``
compiles every step shape first (``engine.warmup``, all draft buckets; the default on
accelerators), ``--warmup rehearse`` (the default on CPU, where the ~200 shapes of a 30-layer model
take about an hour to compile) replays an epoch-2 rollout that compiled anything (same inputs and
key: a deterministic replay that meets only compiled shapes) and keeps the replay's timing; ``--no-warmup`` does
neither. XLA compilations inside the timed rollouts are counted and reported (should be 0; epoch 1
compiles under ``rehearse``).

Side by side per temperature: tokens/s and its ratio; batch forward passes (one prefill, decode or
verify step = one pass) and their ratio; generated tokens per sequence forward pass; acceptance
(accepted / drafted tokens); host drafting share of HistoSpec time; response lengths (mean, p50,
p90, max); the mean per-token entropy of the sampled distribution, estimated as the mean of
-logprob of the plain epoch-2 tokens (their behaviour logprobs under the temperature-scaled
distribution they were drawn from: an unbiased estimate, nats/token); and the bulk / tail split:
the tail is the part of a rollout in which fewer than a quarter of the slots are live (timed per
decode step through ``generate``'s ``monitor``). RhymeRL O5/O6 (``python -m rhyme_lab analyze``) of each
temperature's saved rollouts close the report.

Usage::

    python -m benchmarks.rollout_real              # 8 prompts x 4 samples on 16 slots, T = 1.0, 0.6, 0.3
    python -m benchmarks.rollout_real --quick      # smoke run (2 x 2 rows, 24 new tokens, T = 1.0)

On 2 shared CPU cores the defaults take about an hour (rehearsals included; 4 x 4 rows on 8 slots
took 27 min for one temperature), ``--quick`` about 2 minutes.

Writes ``<out>/rollout_real.{json,md}`` (rewritten after every temperature) and per temperature
``<out>/T<temp>/rollouts/step_000001.npz`` (epoch 1), ``step_000002.npz`` (epoch 2 HistoSpec),
``<out>/T<temp>/plain_epoch2/rollouts/step_000002.npz`` and the analysis files of
``python -m rhyme_lab analyze <out>/T<temp>``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

from rhyme_lab.bench import real_workload
from rhyme_lab.bench.rollout_real import DEFAULTS, QUICK, format_table, load_setup, run_temperature, warm_up, write_report


def parse_args(argv=None) -> argparse.Namespace:
    """Command line; sizes left unset take ``QUICK`` under ``--quick``, else ``DEFAULTS``."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, help=f"train prompts of the recipe (default {DEFAULTS['prompts']})")
    ap.add_argument("--samples", type=int, help=f"samples per prompt (default {DEFAULTS['samples']})")
    ap.add_argument("--max-slots", type=int, help=f"decode slots (default {DEFAULTS['max_slots']})")
    ap.add_argument("--max-new-tokens", type=int, help=f"default {DEFAULTS['max_new_tokens']}")
    ap.add_argument("--temperatures", help=f"comma-separated (default {DEFAULTS['temperatures']})")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--goodput", action="store_true",
                    help="also run HistoSpec with the goodput policy (GOODPUT) beside the paper defaults")
    ap.add_argument("--max-prompt-len", type=int, help="default 256; 0 = the longest prompt, page-rounded")
    ap.add_argument("--repeats", type=int, default=1,
                    help="epoch-2 rounds (plain, then each HistoSpec variant, interleaved); tokens/s from "
                         "the median seconds of each (the same key and a fresh drafter: the same tokens)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seed", type=int, default=0, help="rollout keys k1, k2 = split(key(seed))")
    ap.add_argument("--model", default="", help="HF checkpoint dir (default: real_workload.model_dir())")
    ap.add_argument("--out", default="runs/bench_rollout_real")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: " + ", ".join(f"{k}={v}" for k, v in QUICK.items()))
    ap.add_argument("--warmup", choices=("auto", "full", "rehearse", "none"), default="auto",
                    help="full: compile every step shape first (engine.warmup); rehearse: replay (and time "
                         "again) an epoch-2 rollout that compiled; auto: full on accelerators, rehearse on CPU")
    ap.add_argument("--no-warmup", dest="warmup", action="store_const", const="none", help="--warmup none")
    ap.add_argument("--compile-threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--compile-cache", default="runs/.jax_cache", help="persistent XLA cache ('' = off)")
    args = ap.parse_args(argv)
    return real_workload.fill_defaults(args, QUICK if args.quick else DEFAULTS)


def main(argv=None) -> int:
    args = parse_args(argv)
    import jax

    if args.compile_cache:  # warm-up is never timed; the cache only saves repeated compiles
        jax.config.update("jax_compilation_cache_dir", str(Path(args.compile_cache)))
    if args.warmup == "auto":  # a CPU compiles the ~200 step shapes of a full warm-up in about an hour
        args.warmup = "rehearse" if jax.default_backend() == "cpu" else "full"
    out = Path(args.out)
    t0 = time.perf_counter()
    setup = load_setup(args)
    load_s = time.perf_counter() - t0
    warm_s, shapes = warm_up(setup, args) if args.warmup == "full" else (0.0, 0)
    lens = [len(p) for p in setup.prompts]
    meta = {"backend": jax.default_backend(), "device": jax.devices()[0].device_kind, "jax": jax.__version__,
            "attention_impl": setup.engine.attention_impl, "model": real_workload.MODEL,
            "model_dir": str(real_workload.model_dir(args.model)), "params": setup.params, "dtype": args.dtype,
            "prompts": args.prompts, "samples": args.samples, "rows": len(setup.prompts),
            "max_slots": args.max_slots, "max_new_tokens": args.max_new_tokens, "page_size": args.page_size,
            "max_prompt_len": args.max_prompt_len, "prompt_tokens_mean_max": f"{np.mean(lens):.0f}/{max(lens)}",
            "load_s": round(load_s, 1), "warmup": args.warmup, "warmup_s": round(warm_s, 1),
            "warmup_shapes": shapes, "compile_threads": args.compile_threads}
    print(f"loaded in {load_s:.1f} s; warm-up {args.warmup}: {warm_s:.1f} s, {shapes} step shapes", flush=True)
    if args.goodput:  # the goodput policy's pass-cost model: cached profile of this machine, or profiled now
        from rhyme_jax.rollout.engine import SamplingParams

        cost = setup.engine.use_pass_cost(setup.state, SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens))
        meta["step_cost"] = f"{len(cost.seconds)} programs ({cost.meta.get('source', '')})"
    rows = []
    for temp in args.temperatures:
        rows.append(run_temperature(setup, temp, args, out))
        write_report(rows, meta, out)  # after every temperature: a killed run keeps the rest
        print(format_table(rows[-1]), flush=True)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s; written: {out / 'rollout_real.md'}, {out / 'rollout_real.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
