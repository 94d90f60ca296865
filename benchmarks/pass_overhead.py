"""Host time per decode pass, per-pass engine vs chunked engines (``rollout.passes_per_dispatch``).

``rhyme_lab.measure.pass_overhead``: every engine generates the same random prompts with the
same key on random weights (the demo model, or any HF ``config.json``), in alternating rounds;
prints and writes host ms per pass, device ms per pass, tokens/s against the device-only bound,
drafting share, and whether the tokens equal the per-pass engine's.

Usage::

    python -m benchmarks.pass_overhead                                   # demo model, 64 slots, N = 1 vs 8, 16
    python -m benchmarks.pass_overhead --model configs/models/smollm2-135m --rounds 2
    python -m benchmarks.pass_overhead --histospec --temperature 0.3    # every engine drafts (chunks on the device)

Writes ``pass_overhead_<model>.json`` / ``.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rhyme_lab.measure import pass_overhead
from rhyme_lab.measure.pass_cost import model_config


def main(argv=None) -> int:
    """Command line (module docstring); returns the exit status."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo", help="'demo' or a directory with a HF config.json")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--slots", type=int, default=64, help="decode slots (rows)")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=64, help="longest prompt (tokens)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--chunks", default="8,16", help="passes per dispatch of the chunked engines")
    ap.add_argument("--eos", type=int, default=0, help="treat token ids 0 .. EOS-1 as stop tokens (0: none)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--attention", default="auto")
    ap.add_argument("--histospec", action="store_true",
                    help="every engine drafts (history: one rollout of the same prompts with another key)")
    ap.add_argument("--group", type=int, default=8, help="with --histospec: requests per prompt (a GRPO group)")
    ap.add_argument("--no-warmup", action="store_true",
                    help="with --histospec: do not compile every program first (a 30-layer model's take long on CPU)")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    from rhyme_jax.rollout.engine import SamplingParams

    cfg = model_config(args.model)
    chunks = [int(x) for x in args.chunks.split(",") if x]
    engs, state = pass_overhead.engines(cfg, args.dtype, args.slots, args.prompt_len, args.new_tokens, chunks,
                                        range(args.eos), args.attention)
    batch = pass_overhead.prompts(args.prompts, args.prompt_len, cfg.vocab_size)
    sp = SamplingParams(temperature=args.temperature, max_new_tokens=args.new_tokens)
    make = None
    if args.histospec:
        distinct = pass_overhead.prompts(-(-args.prompts // args.group), args.prompt_len, cfg.vocab_size)
        batch = [distinct[i // args.group] for i in range(args.prompts)]
        _, make = pass_overhead.histospec_drafter(engs[1], state, batch, args.group, sp)
    result = pass_overhead.measure(engs, state, batch, sp, args.rounds, log=lambda s: print(s, flush=True),
                                   drafter=make, warmup=not args.no_warmup)
    import jax

    meta = dict(model=args.model, dtype=args.dtype, slots=args.slots, prompts=args.prompts, histospec=args.histospec,
                prompt_len=args.prompt_len, new_tokens=args.new_tokens, eos=args.eos, rounds=args.rounds,
                device=jax.devices()[0].device_kind)
    text = pass_overhead.table(meta, result)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = Path(args.model).name + ("_histospec" if args.histospec else "")
    (out / f"pass_overhead_{name}.json").write_text(json.dumps({"meta": meta, **result}, indent=1))
    (out / f"pass_overhead_{name}.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
