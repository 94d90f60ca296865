"""Peer rollout engines on rhyme-jax's real workload: tokens/s and response lengths, side by side.

Same model (SmolLM2-135M-Instruct, float32), same prompt tokens (the arithmetic learning recipe's
problems in the model's chat template, ``rhyme_lab.bench.real_workload``), same sampling (temperature T, no top-k, top-p 1.0), same
``max_new_tokens``, stopping at the model's EOS (``<|im_end|>``, id 2). Rows are prompts x samples
(each prompt repeated ``--samples`` times, as in a GRPO group). Each peer runs in its own
environment and is never a dependency of the package:

* **Hugging Face transformers ``generate``** (this process, the project venv, torch on CPU with as
  many threads as the machine has cores): ``--batch`` rows at once, left padding, KV cache.
* **Tunix's sampler** (``google-tunix``, in its own venv ``.venv-tunix``; ``python -m benchmarks.peer_tunix_worker``
  runs there as a subprocess and prints one JSON line): ``--batch`` rows per ``Sampler`` call,
  its KV cache sized to prompt + ``max_new_tokens``. When Tunix cannot be installed or run, the
  report carries the reason (error text, versions) instead of a number.
* **rhyme-jax plain and HistoSpec**, read from ``--rhyme-report`` (``python -m benchmarks.rollout_real``'s
  ``rollout_real.json``) when it exists; see ``read_rhyme_report`` for the keys it looks for.

Per engine and temperature: tokens/s = generated tokens (each row's response up to and including its
first EOS, capped at ``max_new_tokens``; padding after EOS is not counted, as in rhyme-jax's
``generated_tokens``) / wall seconds of the generate calls, after one short warm-up call (which
also compiles, for the JAX peers); and the response-length distribution (mean, p50, p90, max).
Prompts are tokenised once here (no special tokens added) and the same ids go to every peer.

Usage (repository root)::

    python3 -m venv .venv-tunix && .venv-tunix/bin/pip install google-tunix==0.1.7   # once, optional
    . .venv/bin/activate
    python -m benchmarks.peers --quick                    # smoke: 2 prompts x 2 samples, 16 tokens, T=1.0
    python -m benchmarks.peers                            # 8 prompts x 4 samples, 128 tokens, T=1.0,0.6,0.3
    python -m benchmarks.peers --temperatures 1.0 --engines hf,tunix

Writes ``<out>/peers.json`` and ``<out>/peers.md`` (default ``runs/bench_peers``) and prints the
tables. The JSON is rewritten after every engine, so an interrupted run keeps what it measured.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

from rhyme_lab.bench import real_workload
from rhyme_lab.bench.peers import (DEFAULTS, QUICK, TUNIX_PYTHON, read_rhyme_report, run_hf, run_tunix, tunix_check,
                                   workload, write_report)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, help=f"train questions of the recipe (default {DEFAULTS['prompts']})")
    ap.add_argument("--samples", type=int, help=f"samples per prompt (default {DEFAULTS['samples']})")
    ap.add_argument("--max-new-tokens", type=int, help=f"default {DEFAULTS['max_new_tokens']}")
    ap.add_argument("--temperatures", help=f"comma-separated (default {DEFAULTS['temperatures']})")
    ap.add_argument("--batch", type=int, default=32, help="rows per generate / Sampler call (default 32)")
    ap.add_argument("--engines", default="hf,tunix", help="measured here: hf, tunix (default both)")
    ap.add_argument("--torch-threads", type=int, default=0, help="torch threads (default: the machine's cores)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model-dir", default="", help="checkpoint directory (default: the recipe's SmolLM2)")
    ap.add_argument("--tunix-python", default=str(TUNIX_PYTHON), help="python of Tunix's own venv")
    ap.add_argument("--tunix-timeout", type=int, default=3600, help="seconds for the Tunix worker")
    ap.add_argument("--rhyme-report", default="runs/bench_rollout_real/rollout_real.json")
    ap.add_argument("--out", default="runs/bench_peers")
    ap.add_argument("--quick", action="store_true", help="smoke: 2 prompts x 2 samples, 16 new tokens, T=1.0")
    args = ap.parse_args(argv)
    real_workload.fill_defaults(args, QUICK if args.quick else DEFAULTS)
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    args.batch = max(1, min(args.batch, args.prompts * args.samples))
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    t_start = time.perf_counter()
    work = workload(args)
    meta = dict(model="smollm2-135m-instruct", model_dir=work["model_dir"], prompts=args.prompts,
                samples=args.samples, rows=args.prompts * args.samples, max_new_tokens=args.max_new_tokens,
                temperatures=args.temperatures, sampling="temperature T, top_k off, top_p 1.0, stop at EOS id 2",
                prompt_tokens=f"mean {work['prompt_lens']['mean']:.0f} / max {work['prompt_lens']['max']}",
                seed=args.seed, cpu_cores=os.cpu_count(), machine=platform.machine(),
                load_avg_start=[round(x, 2) for x in os.getloadavg()], date=time.strftime("%Y-%m-%d %H:%M"))
    report = dict(meta=meta, engines=[])
    runners = dict(hf=run_hf, tunix=run_tunix)
    for name in args.engines:
        print(f"[{name}] {meta['rows']} rows, batch {args.batch}, {args.max_new_tokens} new tokens, "
              f"T={args.temperatures}", flush=True)
        t0, load0 = time.perf_counter(), os.getloadavg()[0]
        res = runners[name](work, args)
        res["load_avg_1min"] = [round(load0, 2), round(os.getloadavg()[0], 2)]  # start, end (shared machine)
        if name == "tunix" and res.get("status") == "ok":
            res["check_vs_transformers"] = tunix_check(res, work)
        res["wall_s_total"] = round(time.perf_counter() - t0, 1)
        report["engines"].append(res)
        write_report(report, out)  # after every engine: an interrupted run keeps the rest
    report["engines"] += read_rhyme_report(Path(args.rhyme_report), args)
    meta.update(load_avg_end=[round(x, 2) for x in os.getloadavg()],
                wall_s=round(time.perf_counter() - t_start, 1))
    print(write_report(report, out))
    print(f"written: {out / 'peers.json'}, {out / 'peers.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
