"""Truncated importance sampling (TIS): the correction for a sampler whose logprobs differ from
the trainer's (``grpo.tis`` / ``grpo.tis_cap``; docs/precision.md).

A rollout engine in bfloat16 (``rollout.dtype``), another attention kernel or a stale weight copy
samples from ``pi_sampler``, not from the trainer's ``pi_old`` (the float32 policy whose ratio the
clipped surrogate takes). With ``grpo.tis`` the trainer recomputes the old logprobs in its own
precision before the update (``trainer._update``) and weights each token's policy-gradient term by

    w_t = min(exp(logp_old_trainer_t - logp_sampler_t), C)

(gradient-stopped; ``C = grpo.tis_cap``) while the surrogate's ratio becomes
``exp(logp_new - logp_old_trainer)``. The k3 KL term is not weighted.

Sources: Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL
training" (TIS, C = 2; verl ``tis_imp_ratio_cap``); TRL ``GRPOTrainer`` with
``vllm_importance_sampling_correction=True, vllm_importance_sampling_mode="token_truncate"``
(``importance_sampling_ratio = clamp(exp((old - sampling) * mask), max=clip_max)``, multiplying
``per_token_loss`` before the KL term is added; ``tests/test_tis.py`` checks the loss against
TRL's ``_compute_loss``).
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float

METRICS = ("tis/weight_mean", "tis/weight_max", "tis/clipped_fraction", "tis/logprob_diff_mean",
           "tis/logprob_diff_max")


def truncated_is_weights(trainer_logprobs: Float[Array, "B T"], sampler_logprobs: Float[Array, "B T"],
                         mask: Float[Array, "B T"], cap: float
                         ) -> tuple[Float[Array, "B T"], dict[str, Float[Array, ""]]]:
    """The TIS weights of a batch and their statistics.

    Args:
      trainer_logprobs: f32[B, T] the trainer's recompute of the behaviour tokens' logprobs
        (nats; the old policy in the trainer's precision).
      sampler_logprobs: f32[B, T] the logprobs the rollout engine reported for the same tokens.
      mask: f32/bool[B, T], 1 on response tokens.
      cap: the truncation ``C`` (> 0; ``grpo.tis_cap``).

    Returns:
      ``(weights f32[B, T], metrics)``: ``min(exp(trainer - sampler), cap)`` on response tokens, 1
      elsewhere (TRL zeroes the difference off the mask: the same 1). Metrics over response tokens
      (f32 scalars; 0 without any): ``tis/weight_mean``, ``tis/weight_max``,
      ``tis/clipped_fraction`` (share where the cap is active), ``tis/logprob_diff_mean`` /
      ``tis/logprob_diff_max`` (|trainer - sampler|, nats/token).

    Raises:
      ValueError: shapes differ or ``cap <= 0``.
    """
    if trainer_logprobs.shape != sampler_logprobs.shape or mask.shape != trainer_logprobs.shape:
        raise ValueError(f"tis.truncated_is_weights: trainer {trainer_logprobs.shape}, sampler "
                         f"{sampler_logprobs.shape} and mask {mask.shape} must share one [B, T] shape")
    if not cap > 0:
        raise ValueError(f"tis.truncated_is_weights: cap must be > 0, got {cap}")
    m = jnp.asarray(mask).astype(jnp.float32)
    diff = (jnp.asarray(trainer_logprobs, jnp.float32) - jnp.asarray(sampler_logprobs, jnp.float32)) * m
    raw = jnp.exp(diff)
    on = m > 0
    weights = jnp.where(on, jnp.minimum(raw, jnp.float32(cap)), 1.0)
    n = jnp.sum(m)
    mean = lambda x: jnp.where(n > 0, jnp.sum(x * m) / jnp.maximum(n, 1.0), 0.0)
    top = lambda x: jnp.where(n > 0, jnp.max(jnp.where(on, x, -jnp.inf)), 0.0)
    metrics = {
        "tis/weight_mean": mean(weights),
        "tis/weight_max": top(weights),
        "tis/clipped_fraction": mean((raw > cap).astype(jnp.float32)),
        "tis/logprob_diff_mean": mean(jnp.abs(diff)),
        "tis/logprob_diff_max": top(jnp.abs(diff)),
    }
    return weights, metrics
