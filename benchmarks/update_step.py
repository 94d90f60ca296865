"""Time one GRPO update at a recipe's sizes with random weights; report peak device memory.

The update is ``train.grpo_step.make_grpo_step`` with the config's ``grpo.micro_batch_tokens``,
``logit_chunk`` and ``remat``, over one minibatch of ``--rows`` rows x ``--tokens`` tokens
(default: the recipe's minibatch on one device) of random tokens with random behaviour logprobs
and advantages. Weights are random (normal 0.02), float32 master weights computing in
``model.dtype`` as in a run: memory and time do not depend on their values. Prints and writes
JSON: compile seconds, median step seconds, tokens/s, micro-batches, XLA's temporaries and (on
GPU/TPU) the device's peak bytes in use.

    python benchmarks/update_step.py --config configs/gsm8k_qwen2.5_1.5b.yaml \\
        --model-config configs/models/qwen2.5-1.5b --rows 16 --tokens 1536 --out /tmp/upd.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rhyme_jax.train.memory_plan import model_config_of
from rhyme_jax.config import load_config
from rhyme_jax.model.transformer import Decoder
from rhyme_jax.train.grpo_step import UpdateMemory, make_grpo_step, num_micro_batches
from rhyme_jax.train.optim import PARAM_DTYPE, grpo_optimizer


def random_batch(rows: int, tokens: int, vocab: int, seed: int = 0) -> dict:
    """A minibatch with the trainer's fields: half prompt, half response, all valid."""
    rng = np.random.default_rng(seed)
    loss_mask = np.zeros((rows, tokens), np.float32)
    loss_mask[:, tokens // 2 - 1: tokens - 1] = 1.0
    return {"tokens": rng.integers(0, vocab, (rows, tokens)).astype(np.int32),
            "positions": np.broadcast_to(np.arange(tokens, dtype=np.int32), (rows, tokens)).copy(),
            "attn_mask": np.ones((rows, tokens), bool), "loss_mask": loss_mask,
            "old_logprobs": (-rng.random((rows, tokens - 1)) * 4).astype(np.float32),
            "advantages": rng.normal(size=rows).astype(np.float32),
            "loss_norm": np.full(rows, loss_mask.sum(), np.float32)}  # read by the normalised loss_agg modes


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--model-config", default="")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--rows", type=int, default=0, help="minibatch rows (default: the recipe's)")
    ap.add_argument("--tokens", type=int, default=0, help="padded tokens per row (default: prompt + new)")
    ap.add_argument("--steps", type=int, default=3, help="timed updates after the first")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    g = cfg.grpo
    model_cfg, source = model_config_of(cfg, args.model_config)
    rows = args.rows or g.prompts_per_step * g.samples_per_prompt // g.minibatches
    tokens = args.tokens or -(-(cfg.rollout.max_prompt_len + cfg.rollout.max_new_tokens) // 16) * 16
    dtype = jnp.dtype(cfg.model.dtype)
    # As in a run: float32 master weights and AdamW moments, compute in model.dtype.
    model = nnx.eval_shape(lambda: Decoder(model_cfg, dtype=dtype, param_dtype=PARAM_DTYPE, rngs=nnx.Rngs(0)))
    graphdef, abstract = nnx.split(model)
    keys = iter(jax.random.split(jax.random.key(0), len(jax.tree.leaves(abstract))))
    state = jax.tree.map(lambda x: (0.02 * jax.random.normal(next(keys), x.shape, jnp.float32)).astype(x.dtype),
                         abstract)
    opt = grpo_optimizer(g)
    opt_state = jax.jit(opt.init)(state)
    memory = UpdateMemory(g.micro_batch_tokens, g.logit_chunk, g.remat)
    step = make_grpo_step(graphdef, opt, eps_low=g.eps_low, eps_high=g.eps_high, kl_coef=0.0,
                          loss_agg=g.loss_agg, temperature=cfg.rollout.temperature, memory=memory)
    batch = {k: jnp.asarray(v) for k, v in random_batch(rows, tokens, model_cfg.vocab_size).items()}
    t0 = time.perf_counter()
    compiled = step.lower(state, opt_state, batch).compile()
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(args.steps + 1):
        t0 = time.perf_counter()
        state, opt_state, m = compiled(state, opt_state, batch)
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t0)
    stats = getattr(jax.devices()[0], "memory_stats", lambda: None)() or {}
    ma = compiled.memory_analysis()
    report = {"model": source, "dtype": str(dtype), "backend": jax.default_backend(), "rows": rows,
              "tokens": tokens, "micro_batches": num_micro_batches(rows, tokens, 1, g.micro_batch_tokens),
              "logit_chunk": g.logit_chunk, "remat": bool(g.remat), "compile_s": round(compile_s, 2),
              "first_step_s": round(times[0], 3), "step_s": round(statistics.median(times[1:] or times), 3),
              "tokens_per_s": round(rows * tokens / statistics.median(times[1:] or times), 1),
              "update_temp_bytes": int(ma.temp_size_in_bytes),
              "peak_bytes_in_use": int(stats.get("peak_bytes_in_use", 0)),
              "loss": float(m["loss"]), "finite": float(m["finite"])}
    print(json.dumps(report))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
