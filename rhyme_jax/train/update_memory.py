"""Memory of one GRPO update, read from XLA's compiled memory analysis with abstract weights.

``rhyme-jax memory`` uses this to size a run before any hardware is rented: the update of
``grpo_step.make_grpo_step`` is lowered for ``jax.ShapeDtypeStruct`` parameters, optimizer state
and batch (nothing is allocated, so any model size works on a laptop CPU) and compiled for one
device (a LoRA run, ``lora.rank > 0``: the update of ``train/lora_state.py``, adapters trained, the
base an argument it does not differentiate); ``compiled.memory_analysis().temp_size_in_bytes`` is the update's temporaries (gradients,
activations kept for the backward pass, one logits chunk, optimizer scratch). Parameters and
optimizer state are float32 (``optim.PARAM_DTYPE``: the master weights of mixed precision), the
graph computes in ``model.dtype``, as in a run.
"""

from __future__ import annotations

import math
import time
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from rhyme_jax.config import RunConfig
from rhyme_jax.model.config import ModelConfig
from rhyme_jax.model.transformer import Decoder
from rhyme_jax.train.grpo_step import UpdateMemory, loss_options, make_grpo_step, num_micro_batches
from rhyme_jax.train.lora_state import lora_structure
from rhyme_jax.train.losses import SEQ_LEN_MULTIPLE
from rhyme_jax.train.optim import PARAM_DTYPE, grpo_optimizer


def config_micro_batch(cfg: RunConfig, shards: int) -> tuple[int, int]:
    """``(rows, tokens)`` of one gradient micro-batch per device under ``cfg``: the longest
    sequence (``max_prompt_len + max_new_tokens``, rounded up to 16) and the minibatch's rows per
    device divided into ``num_micro_batches`` under ``grpo.micro_batch_tokens``."""
    g = cfg.grpo
    tokens = -(-(cfg.rollout.max_prompt_len + cfg.rollout.max_new_tokens) // SEQ_LEN_MULTIPLE) * SEQ_LEN_MULTIPLE
    rows = g.prompts_per_step * g.samples_per_prompt // g.minibatches
    per_device = max(1, rows // max(1, shards))
    return per_device // num_micro_batches(per_device, tokens, 1, g.micro_batch_tokens), tokens


def _abstract_batch(rows: int, tokens: int, kl: bool, packed: bool = False) -> dict:
    """The update's batch as shapes: padded rows, or with ``packed`` the buffers of
    ``train.packing`` (segment ids, per-token advantages and loss weights)."""
    i32, f32 = jnp.int32, jnp.float32
    sds = jax.ShapeDtypeStruct
    batch = {"tokens": sds((rows, tokens), i32), "positions": sds((rows, tokens), i32),
             "attn_mask": sds((rows, tokens), jnp.bool_), "loss_mask": sds((rows, tokens), f32),
             "old_logprobs": sds((rows, tokens - 1), f32), "advantages": sds((rows,), f32),
             "loss_norm": sds((rows,), f32)}  # read by the normalised grpo.loss_agg modes
    if packed:
        del batch["loss_norm"]
        batch.update(segment_ids=sds((rows, tokens), i32), advantages=sds((rows, tokens - 1), f32),
                     loss_w=sds((rows, tokens - 1), f32), token_w=sds((rows, tokens - 1), f32))
    if kl:
        batch["ref_logprobs"] = sds((rows, tokens - 1), f32)
    return batch


def update_memory(model_cfg: ModelConfig, cfg: RunConfig, rows: int, tokens: int) -> dict[str, Any]:
    """Compile one update over a micro-batch of ``rows x tokens`` (one device) and report bytes.

    The micro-batch is the whole batch of the compiled step (no further split); logit chunking,
    remat and the packed layout (``grpo.padding_free``: segment ids) follow ``cfg.grpo``, the
    layer scan's unroll and the attention op (``model.attention_block``) follow ``cfg.model``;
    parameters and optimizer moments are float32 (``PARAM_DTYPE``, so the gradients are float32 too) and the forward / backward compute in ``cfg.model.dtype``.

    Args:
      model_cfg: architecture.
      cfg: run config (``grpo``, ``model.dtype``, ``rollout.temperature``).
      rows, tokens: micro-batch shape (``tokens`` is rounded up to a multiple of 16).

    Returns:
      dict with ``dtype`` (compute) and ``param_dtype`` (float32) names, ``update_temp_bytes``
      (XLA temporaries), ``update_argument_bytes``,
      ``update_output_bytes``, ``update_alias_bytes`` (donated outputs), the estimates
      ``residual_bytes`` (activations kept between blocks under remat: L x rows x tokens x D),
      ``logits_chunk_bytes`` (one f32 ``[chunk, V]``), and ``compile_s``.

    Raises:
      ValueError: ``rows`` or ``tokens`` < 1.
    """
    if rows < 1 or tokens < 2:
        raise ValueError(f"update_memory: rows={rows} and tokens={tokens} must be >= 1 and >= 2")
    tokens = -(-tokens // SEQ_LEN_MULTIPLE) * SEQ_LEN_MULTIPLE
    g = cfg.grpo
    dtype = jnp.dtype(cfg.model.dtype)
    abstract = nnx.eval_shape(lambda: Decoder(model_cfg, dtype=dtype, param_dtype=PARAM_DTYPE, rngs=nnx.Rngs(0),
                                              **cfg.model.decoder_options()))
    graphdef, state = nnx.split(abstract)
    frozen = ()
    if cfg.lora.rank > 0:  # LoRA: adapters differentiated and updated, base (and dropout keys) frozen
        graphdef, state, keys = lora_structure(model_cfg, cfg)
        frozen = (nnx.split(abstract)[1], keys)
    opt = grpo_optimizer(g)
    opt_state = jax.eval_shape(opt.init, state)
    memory = UpdateMemory(0, g.logit_chunk, g.remat)
    step = make_grpo_step(graphdef, opt, eps_low=g.eps_low, eps_high=g.eps_high, kl_coef=g.kl_coef,
                          loss_agg=g.loss_agg, temperature=cfg.rollout.temperature, memory=memory,
                          **loss_options(g))
    t0 = time.perf_counter()
    batch = _abstract_batch(rows, tokens, g.kl_coef > 0, packed=g.padding_free)
    compiled = step.lower(state, opt_state, batch, frozen).compile()
    seconds = time.perf_counter() - t0
    ma = compiled.memory_analysis()
    chunk = rows * (tokens - 1) if g.logit_chunk == 0 else min(rows * (tokens - 1), g.logit_chunk)
    return {
        "rows": rows, "tokens": tokens, "dtype": str(dtype), "param_dtype": str(jnp.dtype(PARAM_DTYPE)),
        "logit_chunk": g.logit_chunk, "remat": bool(g.remat),
        "update_temp_bytes": int(ma.temp_size_in_bytes),
        "update_argument_bytes": int(ma.argument_size_in_bytes),
        "update_output_bytes": int(ma.output_size_in_bytes),
        "update_alias_bytes": int(ma.alias_size_in_bytes),
        "residual_bytes": int(model_cfg.num_layers * rows * tokens * model_cfg.hidden_size * dtype.itemsize),
        "logits_chunk_bytes": int(chunk * model_cfg.vocab_size * 4),
        "compile_s": round(seconds, 2),
    }
