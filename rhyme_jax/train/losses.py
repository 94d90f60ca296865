"""GRPO-family objective: group advantages, token log-probs, the clipped surrogate, batching.

docs/trl_mapping.md maps the modes to TRL's. Everything here except ``sequence_batch`` is pure
``jnp`` and safe under ``jax.jit`` (shape checks use static shapes only).

References:
  * GRPO: Shao et al., "DeepSeekMath", arXiv 2402.03300 (group-normalised advantages, k3 KL).
  * DAPO: Yu et al., arXiv 2503.14476 (clip-higher ``eps_high``, token-level loss mean).
  * Dr.GRPO: Liu et al., "Understanding R1-Zero-Like Training", arXiv 2503.20783 (no std scaling,
    a constant loss normaliser instead of each response's length).
  * k3 KL estimator: J. Schulman, "Approximating KL Divergence" (2020).
  * TRL ``GRPOTrainer`` (trl 1.x, ``trainer/grpo_trainer.py``): the advantage and loss-type
    conventions matched by ``tests/test_trl_parity.py`` (``docs/trl_mapping.md``).

Alignment convention (used by ``sequence_batch``, ``sft.sft_loss`` and the trainer): the model's
``logits[:, t]`` predict ``tokens[:, t + 1]``. Per-token quantities therefore live on the
``T - 1`` grid ``targets = tokens[:, 1:]`` / ``mask = loss_mask[:, :-1]``.

Loss aggregations (``grpo.loss_agg``; the TRL ``loss_type`` each equals, for one optimizer step
of a GRPO step split into ``M = grpo.minibatches`` minibatches):

  * ``token_mean``: sum over the minibatch's tokens / its token count (TRL ``bnpo`` with one
    micro-batch per optimizer step; TRL ``dapo`` when ``M = 1``).
  * ``seq_mean_token_mean``: mean over the minibatch's rows of each row's token mean (TRL ``grpo``).
  * ``seq_mean_token_sum_norm``: sum / (rows of the step / M x ``rollout.max_new_tokens``)
    (TRL ``dr_grpo``; Dr.GRPO's constant normaliser).
  * ``step_token_mean``: sum / (response tokens of the whole step / M) (TRL ``dapo``: its
    ``num_items_in_batch`` counts the whole generation batch).

The last two need a per-step normaliser (``loss_normaliser``) that the minibatch alone does not
determine; the trainer passes it in the batch field ``loss_norm``.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

LOSS_AGGS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm", "step_token_mean")
NORMALISED_AGGS = ("seq_mean_token_sum_norm", "step_token_mean")  # need ``loss_normaliser``
SCALE_REWARDS = ("group", "batch", "none")
IS_LEVELS = ("token", "sequence")  # grpo.importance_sampling_level (TRL's name and values)
ADVANTAGE_EPS = 1e-4  # TRL GRPOTrainer's
SEQ_LEN_MULTIPLE = 16


class LossInputError(ValueError):
    """Inputs to a loss function have inconsistent shapes or invalid settings."""


def group_advantages(
    rewards: Float[Array, "G n"], *, scale_rewards: str = "group", eps: float = ADVANTAGE_EPS
) -> Float[Array, "G n"]:
    """Group-relative advantages ``(r - mean_g) / (std + eps)`` (GRPO; TRL ``scale_rewards``).

    The baseline is always the group's mean; ``scale_rewards`` picks the std:

    * ``group``: each group's sample std (GRPO, DeepSeekMath eq. 3);
    * ``batch``: the sample std of all ``G x n`` rewards around their overall mean (TRL
      ``scale_rewards="batch"``; Hu et al., REINFORCE++, arXiv 2501.03262);
    * ``none``: no division, ``r - mean_g`` (Dr.GRPO).

    The std is Bessel-corrected (divisor ``n - 1``) and ``eps`` defaults to 1e-4, as in TRL
    ``GRPOTrainer`` (``trl.trainer.utils.nanstd``): advantages then equal TRL's for the same
    rewards (``tests/test_trl_parity.py``), so learning rates and clip ranges carry over. (The
    population std and 1e-6 used before made every advantage ``sqrt(n / (n - 1))`` times larger,
    7% at n = 8, and a near-constant group's up to 100x larger.) A group (or batch) of one reward
    has std 0 and advantage 0; a constant group has advantage 0, not NaN.

    Args:
      rewards: f32[G, n], reward of sample j of prompt group g.
      scale_rewards: ``group`` | ``batch`` | ``none``.
      eps: added to the std.

    Returns:
      f32[G, n].

    Raises:
      LossInputError: ``rewards`` is not 2-D or ``scale_rewards`` is unknown.
    """
    rewards = jnp.asarray(rewards, jnp.float32)
    if rewards.ndim != 2:
        raise LossInputError(f"losses.group_advantages: rewards must be [G, n], got shape {rewards.shape}")
    if scale_rewards not in SCALE_REWARDS:
        raise LossInputError(f"losses.group_advantages: scale_rewards must be one of {SCALE_REWARDS}, got "
                             f"{scale_rewards!r} (grpo.scale_rewards)")
    centred = rewards - rewards.mean(axis=1, keepdims=True)
    if scale_rewards == "none":
        return centred
    if scale_rewards == "group":
        std = _sample_std(rewards, axis=1)
    else:
        std = _sample_std(rewards.reshape(-1), axis=0)
    return centred / (std + eps)


def _sample_std(x: Array, axis: int) -> Array:
    """Bessel-corrected std along ``axis`` (kept as a size-1 axis); 0 where fewer than 2 values."""
    n = x.shape[axis]
    if n < 2:
        return jnp.zeros_like(jnp.sum(x, axis=axis, keepdims=True))
    dev = x - x.mean(axis=axis, keepdims=True)
    return jnp.sqrt(jnp.sum(dev * dev, axis=axis, keepdims=True) / (n - 1))


def token_logprobs(
    logits: Float[Array, "B T V"], targets: Int[Array, "B T"], temperature: float = 1.0
) -> tuple[Float[Array, "B T"], Float[Array, "B T"]]:
    """Log-probability of each target token and the entropy, under ``softmax(logits / temperature)``.

    The caller aligns inputs: pass ``logits[:, :-1]`` with ``tokens[:, 1:]`` (module docstring).
    Computed in float32 whatever the logits dtype.

    Args:
      logits: f32/bf16[B, T, V] unnormalised scores.
      targets: i32[B, T] token ids in [0, V).
      temperature: sampling temperature the rollout used (> 0); logits are divided by it so the
        log-probs match the behaviour policy.

    Returns:
      (logprobs f32[B, T] in nats, entropy f32[B, T] in nats).

    Raises:
      LossInputError: shapes disagree or ``temperature <= 0``.
    """
    if logits.ndim != 3 or targets.shape != logits.shape[:2]:
        raise LossInputError(
            f"losses.token_logprobs: logits [B, T, V] and targets [B, T] expected, got "
            f"{logits.shape} and {targets.shape}"
        )
    if isinstance(temperature, (int, float)) and temperature <= 0:
        raise LossInputError(f"losses.token_logprobs: temperature must be > 0, got {temperature}")
    logp_all = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)
    logp = jnp.take_along_axis(logp_all, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    entropy = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
    return logp, entropy


def chunked_token_logprobs(
    hidden: Float[Array, "B T D"], targets: Int[Array, "B T"], unembed: Callable[[Array], Array],
    temperature: float = 1.0, chunk_tokens: int = 0, entropy_grad: bool = False,
) -> tuple[Float[Array, "B T"], Float[Array, "B T"]]:
    """``token_logprobs(unembed(hidden), targets)`` without materialising ``[B, T, V]`` logits.

    The sequence axis is cut into chunks of ``c = max(1, chunk_tokens // B)`` positions (every
    row of a chunk together, so rows stay split over the devices that hold them); a
    ``jax.lax.scan`` computes each chunk's ``f32[B, c, V]`` logits, log-sum-exp, target logit
    and entropy under ``jax.checkpoint``, so the backward pass recomputes one chunk's logits at a
    time instead of storing them: the peak is one chunk of logits (and its cotangent), not the
    batch's (Levanter's blockwise cross-entropy; Liger-Kernel's fused linear cross-entropy).

    Args:
      hidden: residual stream before the output head (``Decoder.hidden``), aligned so that
        ``hidden[:, t]`` predicts ``targets[:, t]``.
      targets: i32[B, T] token ids in [0, V).
      unembed: ``h -> f32[..., V]`` logits (``Decoder.unembed``: final norm + head).
      temperature: the rollout's sampling temperature (> 0).
      chunk_tokens: tokens per chunk (all rows together); 0 or ``>= B * T`` = one chunk
        (still no separate log-softmax array: same values as ``token_logprobs``).
      entropy_grad: differentiate the entropy too (the entropy bonus, ``grpo.entropy_coef``);
        False = the entropy is a gradient-stopped metric.

    Returns:
      (logprobs f32[B, T] in nats, entropy f32[B, T] in nats, gradient-stopped unless
      ``entropy_grad``).

    Raises:
      LossInputError: shapes disagree, ``temperature <= 0`` or ``chunk_tokens < 0``.
    """
    if hidden.ndim != 3 or targets.shape != hidden.shape[:2]:
        raise LossInputError(f"losses.chunked_token_logprobs: hidden [B, T, D] and targets [B, T] expected, "
                             f"got {hidden.shape} and {targets.shape}")
    if isinstance(temperature, (int, float)) and temperature <= 0:
        raise LossInputError(f"losses.chunked_token_logprobs: temperature must be > 0, got {temperature}")
    if chunk_tokens < 0:
        raise LossInputError(f"losses.chunked_token_logprobs: chunk_tokens must be >= 0, got {chunk_tokens}")
    b, t, d = hidden.shape
    c = t if chunk_tokens == 0 else min(t, max(1, chunk_tokens // b))
    pad = -t % c
    h = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
    tg = jnp.pad(targets.astype(jnp.int32), ((0, 0), (0, pad)))
    hs = h.reshape(b, -1, c, d).swapaxes(0, 1)  # [chunks, B, c, D]
    ts = tg.reshape(b, -1, c).swapaxes(0, 1)

    @jax.checkpoint
    def one(hc, tc):
        logits = unembed(hc).astype(jnp.float32) / temperature  # [B, c, V]
        lse = jax.nn.logsumexp(logits, axis=-1)
        target = jnp.take_along_axis(logits, tc[..., None], axis=-1)[..., 0]
        probs = jnp.exp(logits - lse[..., None])
        if entropy_grad:
            return target - lse, lse - jnp.sum(probs * logits, axis=-1)
        entropy = lse - jnp.sum(jax.lax.stop_gradient(probs) * jax.lax.stop_gradient(logits), axis=-1)
        return target - lse, jax.lax.stop_gradient(entropy)

    _, (lp, ent) = jax.lax.scan(lambda _, x: (None, one(*x)), None, (hs, ts))
    lp = lp.swapaxes(0, 1).reshape(b, -1)[:, :t]
    ent = ent.swapaxes(0, 1).reshape(b, -1)[:, :t]
    return lp, ent


def masked_mean(x: Float[Array, "..."], mask: Float[Array, "..."]) -> Float[Array, ""]:
    """Mean of ``x`` over entries where ``mask`` is 1 (0.0 when the mask is empty)."""
    mask = mask.astype(jnp.float32)
    return jnp.sum(x * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def _check_agg(loss_agg: str, loss_norm) -> None:
    if loss_agg not in LOSS_AGGS:
        raise LossInputError(f"losses: loss_agg must be one of {LOSS_AGGS}, got {loss_agg!r} (grpo.loss_agg)")
    if loss_agg in NORMALISED_AGGS and loss_norm is None:
        raise LossInputError(f"losses: loss_agg={loss_agg!r} needs the step's normaliser loss_norm "
                             f"(losses.loss_normaliser; the trainer passes it as batch['loss_norm'])")


def aggregate(per_token: Float[Array, "B T"], mask: Float[Array, "B T"], loss_agg: str,
              loss_norm: float | Array | None = None) -> Float[Array, ""]:
    """Reduce a per-token loss to a scalar (the direct formulas; ``loss_weights`` gives the same
    as weights that add up over micro-batches).

    ``token_mean`` (DAPO): sum over all valid tokens / number of valid tokens in the batch.
    ``seq_mean_token_mean``: each sequence's token mean, then the mean over sequences that have
    at least one valid token (all-padding rows do not dilute the loss).
    ``seq_mean_token_sum_norm`` / ``step_token_mean``: sum over all valid tokens / ``loss_norm``
    (``loss_normaliser``: Dr.GRPO's rows x max_new_tokens, or the step's tokens; per minibatch).

    Args:
      per_token: f32[B, T]; mask: f32/bool[B, T]; loss_norm: f32 scalar (normalised modes only).

    Raises:
      LossInputError: unknown ``loss_agg``, or a normalised mode without ``loss_norm``.
    """
    _check_agg(loss_agg, loss_norm)
    mask = mask.astype(jnp.float32)
    if loss_agg == "token_mean":
        return masked_mean(per_token, mask)
    if loss_agg == "seq_mean_token_mean":
        count = jnp.sum(mask, axis=1)
        seq = jnp.sum(per_token * mask, axis=1) / jnp.maximum(count, 1.0)
        has = (count > 0).astype(jnp.float32)
        return jnp.sum(seq * has) / jnp.maximum(jnp.sum(has), 1.0)
    return jnp.sum(per_token * mask) / loss_norm


def loss_normaliser(loss_agg: str, *, response_tokens: int, rows: int, minibatches: int,
                    max_new_tokens: int) -> float:
    """The denominator of a normalised aggregation for every minibatch of one GRPO step.

    ``step_token_mean``: ``max(response_tokens, 1) / minibatches`` -- TRL ``dapo``, whose
    ``num_items_in_batch`` counts the whole generation batch and is rescaled by
    ``gradient_accumulation_steps / steps_per_generation`` (= 1 / optimizer steps per generation).
    ``seq_mean_token_sum_norm``: ``rows / minibatches x max_new_tokens`` -- TRL ``dr_grpo``
    (``per_token_loss.size(0) * max_completion_length``, summed over the accumulation steps).
    Other aggregations do not use it: 1.0.

    Args:
      loss_agg: one of ``LOSS_AGGS``.
      response_tokens: loss-carrying tokens of the whole step (all minibatches).
      rows: trained rows of the step (padding rows excluded).
      minibatches: optimizer steps of the GRPO step (``grpo.minibatches``).
      max_new_tokens: the rollout's response cap (``rollout.max_new_tokens``).

    Returns:
      float > 0.

    Raises:
      LossInputError: unknown ``loss_agg`` or ``rows`` / ``minibatches`` / ``max_new_tokens`` < 1.
    """
    _check_agg(loss_agg, 1.0)
    if min(rows, minibatches, max_new_tokens) < 1 or response_tokens < 0:
        raise LossInputError(f"losses.loss_normaliser: rows={rows}, minibatches={minibatches} and "
                             f"max_new_tokens={max_new_tokens} must be >= 1, response_tokens={response_tokens} >= 0")
    if loss_agg == "step_token_mean":
        return max(response_tokens, 1) / minibatches
    if loss_agg == "seq_mean_token_sum_norm":
        return rows / minibatches * max_new_tokens
    return 1.0


def grpo_loss(
    logprobs: Float[Array, "B T"],
    old_logprobs: Float[Array, "B T"],
    advantages: Float[Array, "B"],
    mask: Float[Array, "B T"],
    *,
    eps_low: float,
    eps_high: float,
    ref_logprobs: Float[Array, "B T"] | None = None,
    kl_coef: float = 0.0,
    loss_agg: str = "token_mean",
    loss_norm: float | Array | None = None,
    kl_ratio_weighted: bool = False,
    importance_sampling_level: str = "token",
    entropy: Float[Array, "B T"] | None = None,
    entropy_coef: float = 0.0,
    is_weights: Float[Array, "B T"] | None = None,
) -> tuple[Float[Array, ""], dict[str, Array]]:
    """Clipped GRPO surrogate with DAPO clip-higher, an optional k3 KL penalty and entropy bonus.

    Per token: ``ratio = exp(lp - old)``;
    ``pg = -min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A)``;
    with a reference, ``kl = exp(ref - lp) - (ref - lp) - 1`` (k3, >= 0) and the per-token loss is
    ``pg + kl_coef * kl`` (``pg + kl_coef * ratio * kl`` with ``kl_ratio_weighted``: the
    importance-weighted, unbiased reverse-KL gradient of DeepSeek-V3.2, arXiv 2512.02556; the
    ratio is not gradient-stopped). Aggregated with ``aggregate(., mask, loss_agg, loss_norm)``.
    With ``importance_sampling_level="sequence"`` (GSPO, Zheng et al., arXiv 2507.18071) every
    token of a row uses the row's length-normalised ratio ``exp(masked mean of (lp - old))``,
    clipped as one number. With ``entropy_coef > 0`` the loss is minus ``entropy_coef`` x the
    masked token mean of ``entropy`` (whatever ``loss_agg``, as TRL). This is TRL
    ``GRPOTrainer._compute_loss`` (``epsilon`` / ``epsilon_high`` / ``beta`` /
    ``use_bias_correction_kl`` / ``importance_sampling_level`` / ``entropy_coef``). With
    ``is_weights`` (truncated importance sampling, ``grpo.tis``) the ``pg`` term of each token is
    multiplied by its weight (gradient-stopped) before the KL term is added, as TRL does.

    Args:
      logprobs: f32[B, T] log-probs of the sampled tokens under the current policy (differentiable).
      old_logprobs: f32[B, T] behaviour-policy log-probs (treated as constants).
      advantages: f32[B] one advantage per sequence (broadcast over its tokens).
      mask: f32/bool[B, T], 1 on response tokens that count.
      eps_low, eps_high: clip range ``[1 - eps_low, 1 + eps_high]`` (>= 0).
      ref_logprobs: f32[B, T] frozen reference log-probs, or None (no KL term).
      kl_coef: weight of the k3 KL term (used only with ``ref_logprobs``).
      loss_agg: one of ``LOSS_AGGS`` (module docstring).
      loss_norm: the step's normaliser (``loss_normaliser``) for the normalised aggregations.
      kl_ratio_weighted: weight the k3 term by the policy ratio (TRL ``use_bias_correction_kl``).
      importance_sampling_level: ``token`` | ``sequence`` (``IS_LEVELS``).
      entropy: f32[B, T] differentiable per-token entropy in nats (needed when ``entropy_coef > 0``).
      entropy_coef: weight of the entropy bonus (>= 0; 0 = no bonus).
      is_weights: f32[B, T] per-token weights of the policy-gradient term (``tis.truncated_is_weights``),
        or None (no weighting; the same program as before they existed).

    Returns:
      (loss f32[], metrics) with masked-mean metrics (gradient-stopped): ``pg_loss``,
      ``clip_fraction`` (share of tokens where the clipped term is the active one),
      ``ratio_mean``, ``approx_kl`` (k3 estimate of KL(old || new): ``r - 1 - log r``),
      ``kl`` (k3 to the reference; 0 without one); with an entropy bonus also ``entropy_bonus``
      (the masked entropy mean it rewards).

    Raises:
      LossInputError: shapes disagree, negative eps, unknown ``loss_agg``,
        ``importance_sampling_level`` or a missing ``loss_norm`` / ``entropy``.
    """
    _check_loss_inputs(logprobs, old_logprobs, advantages, mask, ref_logprobs, entropy, eps_low, eps_high)
    _check_agg(loss_agg, loss_norm)
    _check_options(importance_sampling_level, entropy, entropy_coef)
    if is_weights is not None and is_weights.shape != logprobs.shape:
        raise LossInputError(f"losses.grpo_loss: is_weights must be {logprobs.shape}, got {is_weights.shape}")
    loss_w, token_w = loss_weights(mask, loss_agg, loss_norm)
    return weighted_grpo_loss(logprobs, old_logprobs, advantages, loss_w, token_w, eps_low=eps_low,
                              eps_high=eps_high, ref_logprobs=ref_logprobs, kl_coef=kl_coef,
                              kl_ratio_weighted=kl_ratio_weighted,
                              importance_sampling_level=importance_sampling_level,
                              entropy=entropy, entropy_coef=entropy_coef, is_weights=is_weights)


def _check_loss_inputs(logprobs, old_logprobs, advantages, mask, ref_logprobs, entropy, eps_low, eps_high) -> None:
    """``grpo_loss``'s shape and clip-range checks (raises ``LossInputError``)."""
    if logprobs.ndim != 2 or old_logprobs.shape != logprobs.shape or mask.shape != logprobs.shape:
        raise LossInputError(
            f"losses.grpo_loss: logprobs, old_logprobs and mask must share shape [B, T], got "
            f"{logprobs.shape}, {old_logprobs.shape}, {mask.shape}"
        )
    if advantages.shape != logprobs.shape[:1]:
        raise LossInputError(
            f"losses.grpo_loss: advantages must be [B]={logprobs.shape[:1]}, got {advantages.shape}"
        )
    if ref_logprobs is not None and ref_logprobs.shape != logprobs.shape:
        raise LossInputError(
            f"losses.grpo_loss: ref_logprobs must be {logprobs.shape}, got {ref_logprobs.shape}"
        )
    if eps_low < 0 or eps_high < 0:
        raise LossInputError(f"losses.grpo_loss: eps_low/eps_high must be >= 0, got {eps_low}, {eps_high}")
    if entropy is not None and entropy.shape != logprobs.shape:
        raise LossInputError(f"losses.grpo_loss: entropy must be {logprobs.shape}, got {entropy.shape}")


def _check_options(importance_sampling_level: str, entropy, entropy_coef: float) -> None:
    if importance_sampling_level not in IS_LEVELS:
        raise LossInputError(f"losses: importance_sampling_level must be one of {IS_LEVELS}, got "
                             f"{importance_sampling_level!r} (grpo.importance_sampling_level)")
    if entropy_coef < 0:
        raise LossInputError(f"losses: entropy_coef must be >= 0, got {entropy_coef} (grpo.entropy_coef)")
    if entropy_coef > 0 and entropy is None:
        raise LossInputError("losses: entropy_coef > 0 needs the differentiable per-token entropy")


def loss_weights(mask: Float[Array, "B T"], loss_agg: str, loss_norm: float | Array | None = None
                 ) -> tuple[Float[Array, "B T"], Float[Array, "B T"]]:
    """Per-token weights that turn the aggregations into plain weighted sums.

    ``sum(x * loss_w) == aggregate(x, mask, loss_agg, loss_norm)`` and ``sum(x * token_w) ==
    masked_mean(x, mask)``. Computed once over a whole minibatch, they make a loss summed over
    any split of its rows (gradient-accumulation micro-batches) equal to the minibatch's loss.

    Args:
      mask: f32/bool[B, T]; loss_agg: one of ``LOSS_AGGS``; loss_norm: f32 scalar > 0 for the
        normalised aggregations (``loss_normaliser``), else ignored.

    Returns:
      (loss_w f32[B, T], token_w f32[B, T]).

    Raises:
      LossInputError: unknown ``loss_agg``, or a normalised mode without ``loss_norm``.
    """
    _check_agg(loss_agg, loss_norm)
    mask = mask.astype(jnp.float32)
    token_w = mask / jnp.maximum(jnp.sum(mask), 1.0)
    if loss_agg == "token_mean":
        return token_w, token_w
    if loss_agg == "seq_mean_token_mean":
        count = jnp.sum(mask, axis=1, keepdims=True)
        seqs = jnp.maximum(jnp.sum((count > 0).astype(jnp.float32)), 1.0)
        return mask / jnp.maximum(count, 1.0) / seqs, token_w
    # a minibatch of padding rows only may carry loss_norm 0: its weights are 0, not NaN
    norm = jnp.maximum(jnp.asarray(loss_norm, jnp.float32), jnp.finfo(jnp.float32).tiny)
    return mask / norm, token_w


def weighted_grpo_loss(
    logprobs: Float[Array, "B T"], old_logprobs: Float[Array, "B T"], advantages: Float[Array, "B"],
    loss_w: Float[Array, "B T"], token_w: Float[Array, "B T"], *, eps_low: float, eps_high: float,
    ref_logprobs: Float[Array, "B T"] | None = None, kl_coef: float = 0.0, kl_ratio_weighted: bool = False,
    importance_sampling_level: str = "token", entropy: Float[Array, "B T"] | None = None,
    entropy_coef: float = 0.0, segment_ids: Int[Array, "B T"] | None = None,
    is_weights: Float[Array, "B T"] | None = None,
) -> tuple[Float[Array, ""], dict[str, Array]]:
    """``grpo_loss`` with the aggregation given as weights (``loss_weights``): the loss and every
    metric are weighted sums, so they add up over micro-batches of one minibatch.

    The sequence-level ratio reads each sequence's tokens from ``token_w > 0`` (the mask:
    ``token_w`` is ``mask / minibatch tokens``), so it is the same whichever micro-batch holds the
    row; in a packed batch a sequence is a segment of a row (``segment_ids``).

    Args:
      logprobs, old_logprobs: f32[B, T]; advantages: f32[B] (or f32[B, T] per token: a packed
      batch, ``train/packing.py``); loss_w, token_w: f32[B, T] from
      ``loss_weights``; segment_ids: i32[B, T] on the target grid of a packed batch (target t
      belongs to the segment of token t; None = one sequence per row); the rest as ``grpo_loss``.

    Returns:
      (loss f32[], metrics) as ``grpo_loss``: ``pg_loss`` (times ``is_weights`` when given) weighted by
      ``loss_w``;
      ``clip_fraction``, ``ratio_mean``, ``approx_kl``, ``kl`` (k3, unweighted by the ratio) and
      ``entropy_bonus`` by ``token_w``.

    Raises:
      LossInputError: unknown ``importance_sampling_level``, ``entropy_coef < 0`` or a bonus
        without ``entropy``.
    """
    _check_options(importance_sampling_level, entropy, entropy_coef)
    lp = logprobs.astype(jnp.float32)
    old = jax.lax.stop_gradient(old_logprobs.astype(jnp.float32))
    adv = jax.lax.stop_gradient(advantages.astype(jnp.float32))
    adv = adv[:, None] if adv.ndim == 1 else adv  # per token in a packed batch
    log_ratio = lp - old
    if importance_sampling_level == "sequence":  # GSPO: one length-normalised ratio per sequence
        log_iw = sequence_log_ratio(log_ratio, token_w > 0, segment_ids)
    else:
        log_iw = log_ratio
    ratio = jnp.exp(log_iw)
    unclipped = ratio * adv
    clipped = jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv
    pg = -jnp.minimum(unclipped, clipped)
    if is_weights is not None:  # truncated importance sampling: TRL multiplies before adding the KL
        pg = pg * jax.lax.stop_gradient(is_weights.astype(jnp.float32))
    per_token = pg
    if ref_logprobs is not None:
        d = jax.lax.stop_gradient(ref_logprobs.astype(jnp.float32)) - lp
        kl = jnp.exp(d) - d - 1.0
        per_token = pg + kl_coef * (kl * ratio if kl_ratio_weighted else kl)
    else:
        kl = jnp.zeros_like(lp)
    loss = jnp.sum(per_token * loss_w)
    sg = jax.lax.stop_gradient
    wsum = lambda x, w: sg(jnp.sum(jnp.broadcast_to(x, w.shape) * w))
    metrics = {
        "pg_loss": wsum(pg, loss_w),
        "clip_fraction": wsum((clipped < unclipped).astype(jnp.float32), token_w),
        "ratio_mean": wsum(ratio, token_w),
        "approx_kl": wsum((ratio if log_iw is log_ratio else jnp.exp(log_ratio)) - 1.0 - log_ratio, token_w),
        "kl": wsum(kl, token_w),
    }
    if entropy_coef > 0:  # TRL entropy_coef: the token mean whatever the aggregation
        bonus = jnp.sum(entropy.astype(jnp.float32) * token_w)
        loss = loss - entropy_coef * bonus
        metrics["entropy_bonus"] = sg(bonus)
    return loss, metrics


def sequence_log_ratio(log_ratio: Float[Array, "B T"], mask: Bool[Array, "B T"],
                       segment_ids: Int[Array, "B T"] | None = None) -> Float[Array, "B 1"] | Float[Array, "B T"]:
    """GSPO's log importance weight (Zheng et al., arXiv 2507.18071, eq. 7; TRL
    ``importance_sampling_level="sequence"``): each sequence's mean of ``log_ratio`` over its
    ``mask`` tokens, differentiable.

    Args:
      log_ratio: f32[B, T] ``log p_new - log p_behaviour`` per target token (nats).
      mask: bool[B, T] the loss tokens.
      segment_ids: i32[B, T] a packed batch's segment of each target (``train/packing.py``);
        None = each row is one sequence.

    Returns:
      f32[B, 1] (one sequence per row) or f32[B, T] (each target carries its segment's mean); a
      sequence without mask tokens gets 0.
    """
    m = mask.astype(jnp.float32)
    if segment_ids is None:
        return jnp.sum(log_ratio * m, axis=1, keepdims=True) / jnp.maximum(jnp.sum(m, axis=1, keepdims=True), 1.0)
    B, T = log_ratio.shape
    ids = (jnp.arange(B, dtype=jnp.int32)[:, None] * (T + 1) + segment_ids.astype(jnp.int32)).reshape(-1)
    num = jax.ops.segment_sum((log_ratio * m).reshape(-1), ids, num_segments=B * (T + 1))
    den = jax.ops.segment_sum(m.reshape(-1), ids, num_segments=B * (T + 1))
    return (num / jnp.maximum(den, 1.0))[ids].reshape(B, T)


class SequenceBatchError(ValueError):
    """``sequence_batch`` got inconsistent or over-long sequences."""


def sequence_batch(
    prompts: list[list[int]], responses: list[list[int]], pad_id: int, max_len: int | None = None
) -> dict[str, np.ndarray]:
    """Right-padded training batch of prompt + response sequences.

    Alignment: ``loss_mask[b, t] = 1`` exactly when ``tokens[b, t + 1]`` is a response token, so
    ``logits[:, t]`` (which predicts ``tokens[:, t + 1]``) is scored there. Consumers use
    ``targets = tokens[:, 1:]`` with ``loss_mask[:, :-1]`` (the last column is always 0).

    Args:
      prompts: B lists of prompt token ids (each non-empty).
      responses: B lists of response token ids (may be empty: the row then has no loss).
      pad_id: id written into padding positions.
      max_len: if given, every sequence must fit in it and ``T = ceil(max_len / 16) * 16`` (one
        fixed shape, one compile); otherwise ``T`` is the longest sequence rounded up to 16.

    Returns:
      dict of numpy arrays: ``tokens`` i32[B, T], ``positions`` i32[B, T] (0..T-1),
      ``attn_mask`` bool[B, T] (True on real tokens), ``loss_mask`` f32[B, T] (see above),
      plus ``prompt_lens`` i32[B] and ``lengths`` i32[B] (prompt + response).

    Raises:
      SequenceBatchError: counts differ, a prompt is empty, or a sequence exceeds ``max_len``.
    """
    if len(prompts) != len(responses):
        raise SequenceBatchError(
            f"losses.sequence_batch: {len(prompts)} prompts but {len(responses)} responses"
        )
    if not prompts:
        raise SequenceBatchError("losses.sequence_batch: empty batch")
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise SequenceBatchError(f"losses.sequence_batch: prompt {i} is empty (need >= 1 token)")
    longest = max(lengths)
    if max_len is not None:
        if longest > max_len:
            i = int(np.argmax(lengths))
            raise SequenceBatchError(
                f"losses.sequence_batch: sequence {i} has {longest} tokens > max_len={max_len}"
            )
        longest = max_len
    T = max(SEQ_LEN_MULTIPLE, -(-longest // SEQ_LEN_MULTIPLE) * SEQ_LEN_MULTIPLE)
    B = len(prompts)
    tokens = np.full((B, T), pad_id, np.int32)
    attn = np.zeros((B, T), bool)
    loss_mask = np.zeros((B, T), np.float32)
    for b, (p, r) in enumerate(zip(prompts, responses)):
        n = len(p) + len(r)
        tokens[b, : len(p)] = p
        tokens[b, len(p) : n] = r
        attn[b, :n] = True
        loss_mask[b, len(p) - 1 : n - 1] = 1.0
    positions = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T)).copy()
    return {
        "tokens": tokens,
        "positions": positions,
        "attn_mask": attn,
        "loss_mask": loss_mask,
        "prompt_lens": np.array([len(p) for p in prompts], np.int32),
        "lengths": np.array(lengths, np.int32),
    }


def response_grid(
    values: list[list[float]], prompt_lens: Int[np.ndarray, "B"], seq_len: int, fill: float = 0.0
) -> Float[np.ndarray, "B Tm1"]:
    """Place per-response-token values (e.g. behaviour log-probs) on the ``T - 1`` target grid.

    ``values[b][i]`` belongs to response token i of row b, i.e. target column
    ``prompt_lens[b] - 1 + i`` of ``tokens[:, 1:]``; other entries get ``fill``.

    Args:
      values: B lists, one value per response token.
      prompt_lens: i32[B] from ``sequence_batch``.
      seq_len: ``T`` of the batch.

    Returns:
      f32[B, T - 1].

    Raises:
      SequenceBatchError: a row does not fit in ``T``.
    """
    out = np.full((len(values), seq_len - 1), fill, np.float32)
    for b, v in enumerate(values):
        start = int(prompt_lens[b]) - 1
        if start + len(v) > seq_len - 1:
            raise SequenceBatchError(
                f"losses.response_grid: row {b} needs {start + len(v) + 1} tokens > T={seq_len}"
            )
        out[b, start : start + len(v)] = v
    return out
