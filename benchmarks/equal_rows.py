"""Plain decode at equal rows: transformers ``generate`` against rhyme-jax (per-pass and chunked).

Both engines decode the same ``--rows`` random prompts of ``--prompt-len`` tokens on SmolLM2-135M's
shapes (``configs/models/smollm2-135m``; random weights, float32: a pass costs the same whatever
the weights), sampling at T = 1 with no stop token, so every row emits exactly ``--new-tokens``
tokens in both (``min_new_tokens`` for transformers). transformers gets all rows in one
``generate`` call (batch = rows, KV cache, ``torch.set_num_threads(cores)``); rhyme-jax gets as many
decode slots as rows, so both run one pass per token over the same rows. Rounds alternate the
engines after one warm-up call each (compiles rhyme-jax's programs); tokens/s = rows x new tokens
/ the median wall seconds of a call (prefill included in both). Decode alone: each round also
times 1-token calls (prefill and the first sampled token), and decode tokens/s = rows x (new
tokens - 1) / (median seconds of the full call - median of the 1-token call), the same for every
engine. Also printed: rhyme-jax's device ms per decode pass (blocked time of its decode passes,
prefill passes taken out) and the matmul floor of that pass (its float32 FLOPs at this machine's
XLA matmul rate per shape, measured in the same run). ``--layer-weights stacked`` runs rhyme-jax's
layer loop as a scan over the stacked weights instead of the CPU default, per-layer weights
(``rollout/layer_weights.py``).

Usage (repository root; transformers and torch from the test extras)::

    python -m benchmarks.equal_rows                      # 32 rows, 64-token prompts, 64 new tokens, 3 rounds
    python -m benchmarks.equal_rows --rows 16 --rounds 2

Writes ``<out>/equal_rows.json`` (default ``runs/bench_equal_rows``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

MODEL = "configs/models/smollm2-135m"


def matmul_floor_ms(cfg, rows: int) -> tuple[float, dict]:
    """(ms, rates): the decode pass's float32 matmuls (attention projections, MLP, LM head) at
    ``rows`` rows timed one shape at a time with XLA on this machine, summed over the layers."""
    import jax
    import jax.numpy as jnp

    h, f, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_kv_heads * cfg.head_dim
    q = cfg.num_heads * cfg.head_dim
    shapes = {"q": (h, q), "kv": (h, kv), "o": (q, h), "up": (h, f), "down": (f, h), "head": (h, cfg.vocab_size)}
    per_layer = {"q": 1, "kv": 2, "o": 1, "up": 2, "down": 1, "head": 0}
    total, rates = 0.0, {}
    for name, (k, n) in shapes.items():
        a, b = jnp.ones((rows, k), jnp.float32), jnp.ones((k, n), jnp.float32)
        fn = jax.jit(lambda a, b: a @ b)
        fn(a, b).block_until_ready()
        reps = max(5, int(1e9 / (2 * rows * k * n)))
        t0 = time.perf_counter()
        for _ in range(reps):
            fn(a, b).block_until_ready()
        dt = (time.perf_counter() - t0) / reps
        rates[name] = 2 * rows * k * n / dt / 1e9
        total += dt * (per_layer[name] * cfg.num_layers if per_layer[name] else 1)
    return 1e3 * total, rates


def _rounds(calls: dict, new_tokens: int, rounds: int) -> dict:
    """Wall seconds per engine and response length (``{engine: {n: [s, ...]}}``, n = 1 and
    ``new_tokens``): one warm-up call of each, then ``rounds`` rounds that alternate the engines.
    A 1-token call is the prompt's prefill and its first sampled token, so the difference of the
    two lengths is decode alone."""
    for fn in calls.values():
        fn(new_tokens), fn(1)  # warm-up and compiles
    secs = {k: {new_tokens: [], 1: []} for k in calls}
    for r in range(rounds):
        for k, fn in calls.items():
            for n in (new_tokens, 1):
                secs[k][n].append(fn(n))
        print(f"round {r}: " + ", ".join(f"{k} {v[new_tokens][-1]:.2f} s ({v[1][-1]:.2f} s for 1 token)"
                                         for k, v in secs.items()), flush=True)
    return secs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.equal_rows", description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=16, help="passes per dispatch of the chunked engine")
    ap.add_argument("--layer-weights", default="auto", choices=["auto", "split", "stacked"],
                    help="rollout.layer_weights of the rhyme-jax engines (auto: split here)")
    ap.add_argument("--out", default="runs/bench_equal_rows")
    args = ap.parse_args(argv)
    import jax
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from rhyme_jax.rollout.engine import SamplingParams
    from rhyme_jax.rollout.layer_weights import use_split
    from rhyme_lab.measure import pass_overhead
    from rhyme_lab.measure.pass_cost import model_config

    torch.set_num_threads(os.cpu_count() or 1)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(MODEL), dtype=torch.float32).eval()
    prompts = np.random.default_rng(0).integers(3, hf.config.vocab_size, (args.rows, args.prompt_len))
    ids = torch.tensor(prompts)

    def run_hf(new: int) -> float:
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                              top_k=0, top_p=1.0, max_new_tokens=new, min_new_tokens=new, pad_token_id=0)
        assert out.shape[1] == args.prompt_len + new
        return time.perf_counter() - t0

    cfg = model_config(MODEL)
    engs, state = pass_overhead.engines(cfg, "float32", args.rows, args.prompt_len, args.new_tokens, [args.chunk],
                                        layer_weights=args.layer_weights)

    device_ms = []  # the chunked engine's blocked ms per decode pass (its prefills' share taken out)

    def run_rj(n: int, new: int) -> float:
        sp = SamplingParams(temperature=1.0, max_new_tokens=new)
        s = engs[n].generate(state, prompts.tolist(), sp, jax.random.key(0)).stats
        assert s["generated_tokens"] == args.rows * new
        if n == args.chunk and new == args.new_tokens:
            device_ms.append(1e3 * (s["device_wait_seconds"] - s["prefill_wait_seconds"]) / s["decode_steps"])
        return s["seconds"]

    calls = {"transformers": run_hf, "rhyme-jax per-pass": lambda new: run_rj(1, new),
             f"rhyme-jax {args.chunk} passes/dispatch": lambda new: run_rj(args.chunk, new)}
    secs = _rounds(calls, args.new_tokens, args.rounds)
    floor, rates = matmul_floor_ms(cfg, args.rows)
    med = {k: {n: statistics.median(v) for n, v in per.items()} for k, per in secs.items()}
    tps = {k: args.rows * args.new_tokens / m[args.new_tokens] for k, m in med.items()}
    decode_tps = {k: args.rows * (args.new_tokens - 1) / (m[args.new_tokens] - m[1]) for k, m in med.items()}
    layout = "split" if use_split(args.layer_weights, state) else "stacked"
    report = dict(layer_weights=layout, rows=args.rows, prompt_len=args.prompt_len, new_tokens=args.new_tokens, rounds=args.rounds,
                  tokens_per_s=tps, over_transformers={k: v / tps["transformers"] for k, v in tps.items()},
                  decode_tokens_per_s=decode_tps,
                  decode_over_transformers={k: v / decode_tps["transformers"] for k, v in decode_tps.items()},
                  decode_ms_per_token_step={k: 1e3 * args.rows / v for k, v in decode_tps.items()},
                  rhyme_device_ms_per_decode_pass=statistics.median(device_ms), matmul_floor_ms_per_pass=floor,
                  xla_matmul_gflops=rates, seconds=med, cores=os.cpu_count(), torch=torch.__version__)
    print(json.dumps(report, indent=1))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "equal_rows.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
