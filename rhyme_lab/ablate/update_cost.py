"""Time one GRPO update at a recipe's sizes with random weights; its peak device memory.

``time_update`` runs ``train.grpo_step.make_grpo_step`` with the config's
``grpo.micro_batch_tokens``, ``logit_chunk`` and ``remat`` and its decoder options
(``model.scan_unroll``, ``model.attention_block``) over one minibatch of ``rows`` rows x
``tokens`` tokens of random tokens with random behaviour logprobs and advantages
(``random_batch``). Weights are random (normal 0.02), float32 master weights computing in
``model.dtype`` as in a run: memory and time do not depend on their values. The command line is
``python -m benchmarks.update_step``; it needs ``rhyme_jax.train``, hence here, not in ``measure``.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rhyme_lab.measure.timing import seconds_of
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


def random_state(model_cfg, dtype, options: dict | None = None):
    """``(graphdef, state)``: a ``Decoder`` of ``model_cfg`` computing in ``dtype`` with float32
    master weights drawn normal(0, 0.02) (key 0); ``options``: the run's decoder options
    (``ModelSection.decoder_options``: scan unroll, block-sparse attention)."""
    model = nnx.eval_shape(lambda: Decoder(model_cfg, dtype=dtype, param_dtype=PARAM_DTYPE, rngs=nnx.Rngs(0),
                                           **(options or {})))
    graphdef, abstract = nnx.split(model)
    keys = iter(jax.random.split(jax.random.key(0), len(jax.tree.leaves(abstract))))
    state = jax.tree.map(lambda x: (0.02 * jax.random.normal(next(keys), x.shape, jnp.float32)).astype(x.dtype),
                         abstract)
    return graphdef, state


def time_update(cfg, model_cfg, source: str, rows: int, tokens: int, steps: int) -> dict:
    """Compile and time the GRPO update of ``cfg`` (a ``RunConfig``) on ``model_cfg``
    (``source``: where its shape came from) for a ``rows`` x ``tokens`` minibatch: ``steps + 1``
    timed updates, the first apart.

    Returns the report: model, dtype, backend, sizes, ``micro_batches``, ``compile_s``,
    ``first_step_s``, ``step_s`` (median of the rest), ``tokens_per_s``, ``update_temp_bytes``
    (XLA's temporaries), ``peak_bytes_in_use`` (the device's, 0 where it has no memory stats),
    the last ``loss`` and ``finite``.
    """
    g = cfg.grpo
    dtype = jnp.dtype(cfg.model.dtype)
    graphdef, state = random_state(model_cfg, dtype, cfg.model.decoder_options())
    opt = grpo_optimizer(g)
    opt_state = jax.jit(opt.init)(state)
    memory = UpdateMemory(g.micro_batch_tokens, g.logit_chunk, g.remat)
    step = make_grpo_step(graphdef, opt, eps_low=g.eps_low, eps_high=g.eps_high, kl_coef=0.0,
                          loss_agg=g.loss_agg, temperature=cfg.rollout.temperature, memory=memory)
    batch = {k: jnp.asarray(v) for k, v in random_batch(rows, tokens, model_cfg.vocab_size).items()}
    t0 = time.perf_counter()
    compiled = step.lower(state, opt_state, batch).compile()
    compile_s = time.perf_counter() - t0
    carry = [state, opt_state, None]

    def update():
        carry[0], carry[1], carry[2] = compiled(carry[0], carry[1], batch)
        jax.block_until_ready(carry[2])

    times = seconds_of(update, steps + 1)
    m = carry[2]
    stats = getattr(jax.devices()[0], "memory_stats", lambda: None)() or {}
    median = statistics.median(times[1:] or times)
    return {"model": source, "dtype": str(dtype), "backend": jax.default_backend(), "rows": rows,
            "tokens": tokens, "micro_batches": num_micro_batches(rows, tokens, 1, g.micro_batch_tokens),
            "logit_chunk": g.logit_chunk, "remat": bool(g.remat), "attention_block": int(cfg.model.attention_block),
            "compile_s": round(compile_s, 2),
            "first_step_s": round(times[0], 3), "step_s": round(median, 3),
            "tokens_per_s": round(rows * tokens / median, 1),
            "update_temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes),
            "peak_bytes_in_use": int(stats.get("peak_bytes_in_use", 0)),
            "loss": float(m["loss"]), "finite": float(m["finite"])}
