"""Cost of one rollout forward pass: plain decode vs HistoSpec verify, by model size (issue 4).

HistoSpec's rollout speed-up is ``(fewer batch passes) x (plain pass cost / verify pass cost)``.
``benchmarks/rollout.py`` measures the first factor on real rollouts; this script measures the
second: the rollout engine's jitted step (``RolloutEngine._run``: host inputs -> forward ->
sampling / lossless verification -> tokens back on the host) for ``--rows`` live sequences of
``--context`` cached tokens each (distinct pages per sequence, as in a rollout), with K draft
tokens per row for each K of ``--drafts`` (K = 0 is plain decode). Weights are random (the cost
does not depend on them). Reported per K: median wall-clock ms per pass over ``--iters`` passes
after a warm-up, tokens per pass, and the cost relative to K = 0; with ``--passes-ratio`` also
the rollout speed-up it implies.

Usage::

    python benchmarks/step_cost.py                                  # the CPU demo model
    python benchmarks/step_cost.py --model configs/models/qwen2.5-1.5b --dtype bfloat16   # on a GPU

Writes ``step_cost.json`` / ``step_cost.md`` under ``--out`` and prints the table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rhyme_jax.config import RolloutSection  # noqa: E402
from rhyme_jax.model.config import ModelConfig  # noqa: E402
from rhyme_jax.model.transformer import Decoder  # noqa: E402
from rhyme_jax.parallel.mesh import train_mesh  # noqa: E402
from rhyme_jax.parallel.reshard import create_sharded  # noqa: E402
from rhyme_jax.rollout import batching  # noqa: E402
from rhyme_jax.rollout.engine import RolloutEngine, SamplingParams  # noqa: E402

# The CPU demo's model (configs/default.yaml model.tiny) with the demo tokenizer's vocabulary.
DEMO = ModelConfig(family="qwen3", vocab_size=512, hidden_size=128, intermediate_size=384, num_layers=4,
                   num_heads=4, num_kv_heads=2, head_dim=32)


def model_config(name: str) -> ModelConfig:
    """``"demo"`` or a directory holding a HF ``config.json`` (architecture only)."""
    return DEMO if name == "demo" else ModelConfig.from_hf_dir(name)


def pass_inputs(eng: RolloutEngine, rows: int, context: int, k: int, rng: np.random.Generator):
    """Verify inputs of ``rows`` sequences with ``context`` cached tokens and ``k`` drafts each,
    every sequence on its own pages (the pool is filled by ``eng.allocator``)."""
    alloc = eng.allocator
    for s in range(rows):
        if alloc.num_held[s] == 0:
            alloc.ensure(s, context + 1 + k)
    ids = np.arange(rows)
    slot_len = np.full(eng.max_slots, context, np.int64)
    slot_last = rng.integers(0, eng.model_cfg.vocab_size, eng.max_slots).astype(np.int32)
    drafts = rng.integers(0, eng.model_cfg.vocab_size, (rows, k)).astype(np.int32)
    lens = np.full(rows, k, np.int64)
    n_rows = batching.seq_bucket(rows, eng.max_slots)
    t, q = eng.plan.step_pair(n_rows, rows * (k + 1))  # the bucket the engine would pick
    width = eng.plan.width(int(alloc.num_held[ids].max()))
    return batching.verify_inputs(ids, slot_len, slot_last, drafts, np.minimum(lens, q - 1), alloc.page_table,
                                  eng.page_size, n_rows, t, q, width), t


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo", help="'demo' or a directory with a HF config.json")
    ap.add_argument("--dtype", default="float32", help="parameter and compute dtype")
    ap.add_argument("--rows", type=int, default=128, help="live sequences per pass")
    ap.add_argument("--context", type=int, default=128, help="cached tokens per sequence")
    ap.add_argument("--drafts", default="0,1,3,7", help="draft tokens per row (0 = plain decode)")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--attention", default="auto")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--passes-ratio", type=float, default=0.0,
                    help="fewer batch passes measured by benchmarks/rollout.py (prints the implied speed-up)")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    ks = [int(x) for x in args.drafts.split(",")]
    if not ks or min(ks) < 0 or max(ks) > batching.MAX_DRAFT:
        print(f"benchmarks/step_cost.py: --drafts: values in [0, {batching.MAX_DRAFT}], got {args.drafts}",
              file=sys.stderr)
        return 2
    cfg = model_config(args.model)
    dtype = jnp.dtype(args.dtype)
    graphdef, state, _ = create_sharded(lambda: Decoder(cfg, dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0)),
                                        train_mesh(1, 1, 1))
    eng = RolloutEngine(graphdef, cfg, max_slots=args.rows, page_size=RolloutSection.page_size, num_pages=0,
                        max_prompt_len=args.context, max_new_tokens=max(ks) + 2, eos_ids=[],
                        attention_impl=args.attention, max_verify_tokens=args.rows * (max(ks) + 1))
    sp = SamplingParams(temperature=args.temperature, max_new_tokens=max(ks) + 2)
    runner = eng.runner(state, sp)
    rng = np.random.default_rng(0)
    results = []
    for k in ks:
        inp, t = pass_inputs(eng, args.rows, args.context, k, rng)
        t0 = time.perf_counter()
        runner.run(inp)  # compile
        compile_s = time.perf_counter() - t0
        for _ in range(3):
            runner.run(inp)
        times = []
        for i in range(args.iters):
            t0 = time.perf_counter()
            runner.run(inp)  # ends with the tokens on the host
            times.append(time.perf_counter() - t0)
        results.append(dict(k=k, tokens=t, ms=1e3 * statistics.median(times), compile_s=compile_s))
        print(f"K={k:2d}: {t} tokens/pass, {results[-1]['ms']:.3f} ms/pass (compile {compile_s:.1f} s)", flush=True)
    base = results[0]["ms"]
    for r in results:
        r["relative"] = r["ms"] / base
    dev = jax.devices()[0]
    meta = dict(model=args.model, dtype=args.dtype, rows=args.rows, context=args.context, device=dev.device_kind,
                backend=jax.default_backend(), jax=jax.__version__, attention=eng.attention_impl,
                params=int(sum(x.size for x in jax.tree.leaves(state))))
    lines = [f"{meta}", "", "| K drafts/row | tokens/pass | ms/pass | vs plain decode |"
             + (" implied speed-up |" if args.passes_ratio else ""),
             "|---|---|---|---|" + ("---|" if args.passes_ratio else "")]
    for r in results:
        lines.append(f"| {r['k']} | {r['tokens']} | {r['ms']:.3f} | {r['relative']:.2f}x |"
                     + (f" {args.passes_ratio / r['relative']:.2f}x |" if args.passes_ratio else ""))
    text = "\n".join(lines)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "step_cost_" + Path(args.model).name
    (out / f"{stem}.md").write_text(text + "\n")
    (out / f"{stem}.json").write_text(json.dumps(dict(meta=meta, results=results), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
