"""Plain decode vs HistoSpec, side by side along one real GRPO run (issue 4 benchmark).

One model, one prompt set, one history: a GRPO run with HistoSpec on (``spec.enabled=true``) in
which every step's rollout is *also* generated with plain decoding first, with the same weights,
prompts and key (its output is discarded; training uses the HistoSpec rollout). Both rollouts are
timed on warmed-up programs (every prefill / verify shape compiled before step 1, on
``--compile-threads`` host threads); XLA compilations inside the timed rollouts are counted
(``rhyme_jax.compile_count``) and reported, and should be 0. Per epoch it reports rollout tokens/s
of each and their ratio, forward passes per generated token (whole batch: one verify or decode
step = one pass), tokens per sequence forward pass, acceptance and the host drafting share of
HistoSpec rollout time. The JSON / Markdown are rewritten after every step (a killed run keeps
the steps done) and name the backend, device and attention implementation.

Usage (CPU demo settings; start from the demo's SFT weights)::

    rhyme-jax sft                                  # once, if runs/demo/sft/params is missing
    python -m benchmarks.rollout --init-from runs/demo/sft --steps 50
    python -m benchmarks.rollout --init-from runs/demo/sft --steps 24 --oracle   # the bound of any drafter
    python -m benchmarks.rollout --init-from runs/demo/sft --steps 24 --oracle sources

``--oracle``: the HistoSpec side drafts the plain rollout's own tokens (``AlwaysRightDrafter``:
every draft accepted, sized by the engine's goodput allocation), so its tokens/s bound what any
drafter reaches through this engine on this machine, prefill included. ``--oracle sources`` cuts
each draft to the longest run of those tokens that the prompt's earlier rollouts, its siblings so
far or the row's own context hold after an occurrence of the row's last token
(``SourceBoundDrafter``): the bound of any drafter over those sources. The oracle's own host time
is reported beside it (``spec_tokens_per_s_without_drafting``: generated tokens over rollout
seconds minus host drafting seconds), since a bound should not pay for its hindsight.

Writes ``<runs>/bench_rollout/rollout_benchmark.{json,md}`` (``rhyme_lab.measure.paired_report``)
and prints the table.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from rhyme_lab.ablate.paired import ORACLES, PairedRollouts
from rhyme_lab.measure.paired_report import write_report


def main(argv=None) -> int:
    """Command line (module docstring); returns the exit status (2: no SFT params)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/default.yaml")
    ap.add_argument("--init-from", default="runs/demo/sft", help="SFT params (run `rhyme-jax sft` first)")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--name", default="bench_rollout")
    ap.add_argument("--compile-threads", type=int, default=os.cpu_count() or 1,
                    help="host threads compiling the warm-up's step shapes ahead of time")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--oracle", nargs="?", const="always-right", default="", choices=ORACLES,
                    help="the HistoSpec side drafts the plain rollout's own tokens: always-right (the bound "
                         "of any drafter through the engine on this machine, live) or cut to what the history, "
                         "sibling and self sources hold (sources: the bound of any drafter over them)")
    args = ap.parse_args(argv)
    if not Path(args.init_from).exists():
        print(f"benchmarks.rollout: no SFT params at {args.init_from}; run `rhyme-jax sft` first",
              file=sys.stderr)
        return 2

    import jax

    # Reuse compiled programs across benchmark runs (warm-up is excluded from timings anyway).
    jax.config.update("jax_compilation_cache_dir", str(Path("runs") / ".jax_cache"))
    from rhyme_jax.config import load_config
    from rhyme_jax.rollout.engine import SamplingParams
    from rhyme_jax.train.prompts import epoch_of_step
    from rhyme_jax.train.trainer import GRPOTrainer

    cfg = load_config(args.config, [*args.overrides, "spec.enabled=true", f"grpo.steps={args.steps}",
                                    f"run.name={args.name}", f"run.init_from={args.init_from}",
                                    "run.progress=false", f"run.checkpoint_every={args.steps}"])
    rows = []
    trainer = GRPOTrainer(cfg, callbacks=[PairedRollouts(rows, oracle=args.oracle)])
    r = cfg.rollout
    sp = SamplingParams.from_section(r)
    t0 = time.perf_counter()
    # in the rollout layout the engine runs in (the train layout would be another jit cache entry)
    trainer.engine.warmup(trainer.rollout_states()[0], sp, spec=True,
                          compile_threads=args.compile_threads)
    print(f"warm-up (every prefill/verify shape compiled): {time.perf_counter() - t0:.1f} s", flush=True)

    dev = jax.devices()[0]
    meta = {"backend": jax.default_backend(), "device": dev.device_kind, "jax": jax.__version__,
            "attention_impl": trainer.engine.attention_impl,
            "warmup_s": round(time.perf_counter() - t0, 1)}
    for step in range(1, args.steps + 1):
        trainer.train_step(step)
        trainer.step = step
        p, s = rows[-1]["plain"], rows[-1]["spec"]
        rows[-1]["epoch"] = epoch_of_step(cfg, len(trainer.train_problems), step)
        print(f"step {step:3d} epoch {rows[-1]['epoch']}: plain {p['tokens_per_s']:7.0f} tok/s "
              f"{p['forward_passes']:4d} passes | spec {s['tokens_per_s']:7.0f} tok/s "
              f"{s['forward_passes']:4d} passes, acceptance {s['acceptance_rate']:.2f}", flush=True)
        write_report(rows, trainer.run_dir, final=step == args.steps, meta=meta)  # after every step: a kill keeps the rest
    trainer.save()  # weights + history after the last step (profiling can resume from here)
    trainer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
