"""Optimizer and learning-rate schedule (optax AdamW + global-norm clipping).

Non-finite updates are not filtered here (no ``optax.apply_if_finite``): the trainer checks the
loss / gradient norm and skips such steps itself, so it can count and report them.

Mixed precision: the trained parameters (the master weights) and the AdamW moments are always
``PARAM_DTYPE`` (float32), whatever ``model.dtype`` the forward and backward compute in; the model
casts its float32 parameters to the compute dtype inside every layer, so gradients arrive in
float32 and every update is added in float32 (Micikevicius et al. 2018, "Mixed Precision
Training", arXiv 1710.03740; Levanter / MaxText keep float32 params under bf16 compute the same
way). A bfloat16 master copy would lose the update: bf16 keeps 8 significant bits, so a step of
1e-6 is below half the bf16 spacing of any weight above ~5e-4 and rounds away.

Schedules count optimizer steps. A GRPO step makes ``grpo.num_iterations x grpo.minibatches`` of
them, so a GRPO run's schedule (``grpo_optimizer``) spans ``grpo.steps x`` that many optimizer
steps and warms up over ``grpo.warmup_steps x`` that many (``grpo.warmup_steps`` is in GRPO steps).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

SCHEDULES = ("cosine", "constant")
PARAM_DTYPE = jnp.float32  # trained parameters and optimizer moments, whatever model.dtype computes in


class OptimizerConfigError(ValueError):
    """An optimizer setting is out of range."""


def make_schedule(
    learning_rate: float,
    total_steps: int,
    warmup_steps: int,
    *,
    schedule: str = "cosine",
    final_lr_fraction: float = 0.0,
) -> optax.Schedule:
    """Learning rate per optimizer step: linear warmup from 0, then cosine decay or constant.

    optax evaluates the schedule at the count of updates made so far, so update ``k`` (0-based)
    runs at ``schedule(k)``. The rate is ``learning_rate * k / warmup_steps`` during warmup (update
    0 runs at 0, so Adam's moments start filling), reaches ``learning_rate`` at count
    ``warmup_steps`` exactly; ``cosine`` then decays to ``final_lr_fraction * learning_rate`` at
    count ``total_steps``, the end of the run (the last update, ``total_steps - 1``, runs just
    above it), and stays there.

    Args:
      learning_rate: peak rate (> 0).
      total_steps: optimizer steps of the run (>= 1); for GRPO ``grpo.steps x grpo.minibatches``
        (``grpo_optimizer``).
      warmup_steps: optimizer steps of linear warmup (0 <= warmup_steps <= total_steps).
      schedule: ``cosine`` | ``constant``.
      final_lr_fraction: cosine end value as a fraction of the peak, in [0, 1].

    Returns:
      ``optax.Schedule`` mapping an int step count to a float32 rate.

    Raises:
      OptimizerConfigError: a value is out of range or ``schedule`` unknown.
    """
    if not learning_rate > 0:
        raise OptimizerConfigError(f"optim: learning_rate must be > 0, got {learning_rate}")
    if total_steps < 1:
        raise OptimizerConfigError(f"optim: total_steps must be >= 1, got {total_steps}")
    if not 0 <= warmup_steps <= total_steps:
        raise OptimizerConfigError(
            f"optim: warmup_steps must be in [0, total_steps={total_steps}], got {warmup_steps}"
        )
    if not 0.0 <= final_lr_fraction <= 1.0:
        raise OptimizerConfigError(f"optim: final_lr_fraction must be in [0, 1], got {final_lr_fraction}")
    if schedule == "constant":
        if warmup_steps == 0:
            return optax.constant_schedule(learning_rate)
        return optax.join_schedules(
            [optax.linear_schedule(0.0, learning_rate, warmup_steps), optax.constant_schedule(learning_rate)],
            [warmup_steps],
        )
    if schedule == "cosine":
        # optax requires decay_steps > warmup_steps; a run that is all warmup just ends at the peak.
        return optax.warmup_cosine_decay_schedule(
            init_value=0.0,
            peak_value=learning_rate,
            warmup_steps=warmup_steps,
            decay_steps=max(total_steps, warmup_steps + 1),
            end_value=final_lr_fraction * learning_rate,
        )
    raise OptimizerConfigError(f"optim: schedule must be one of {SCHEDULES}, got {schedule!r}")


def _first_key(path) -> str:
    for attr in ("key", "name", "idx"):
        if path and hasattr(path[0], attr):
            return str(getattr(path[0], attr))
    return ""


def _decay_mask(params):
    """Weight-decay only matrices: no decay on biases and norm scales. Parameters under
    ``layers`` carry a leading stacked-layer axis (``transformer.stack_layers``), so a block's
    matrix there has ndim 3 and its biases / norm scales ndim 2."""
    def is_matrix(path, p):
        stacked = _first_key(path) == "layers"
        return getattr(p, "ndim", 0) - stacked >= 2

    return jax.tree_util.tree_map_with_path(is_matrix, params)


def make_optimizer(
    learning_rate: float,
    total_steps: int,
    warmup_steps: int,
    weight_decay: float,
    max_grad_norm: float,
    *,
    schedule: str = "cosine",
    final_lr_fraction: float = 0.0,
    b1: float = 0.9,
    b2: float = 0.95,
    eps: float = 1e-8,
) -> optax.GradientTransformation:
    """AdamW with global-norm gradient clipping and a warmup + cosine/constant schedule.

    Chain: ``clip_by_global_norm(max_grad_norm)`` (skipped when ``max_grad_norm <= 0``) then
    ``adamw(make_schedule(...), b1, b2, eps, weight_decay)`` with decoupled weight decay applied
    to parameters of rank >= 2 only (Loshchilov & Hutter, arXiv 1711.05101).

    Args:
      learning_rate, total_steps, warmup_steps: see ``make_schedule``.
      weight_decay: decoupled decay coefficient (>= 0).
      max_grad_norm: clip threshold on the global L2 norm of the gradients; <= 0 disables.
      schedule, final_lr_fraction: see ``make_schedule``.
      b1, b2, eps: Adam moments and epsilon.

    Returns:
      ``optax.GradientTransformation`` whose ``init`` accepts any params pytree (incl. nnx.State).

    Raises:
      OptimizerConfigError: a value is out of range.
    """
    if weight_decay < 0:
        raise OptimizerConfigError(f"optim: weight_decay must be >= 0, got {weight_decay}")
    lr = make_schedule(
        learning_rate, total_steps, warmup_steps, schedule=schedule, final_lr_fraction=final_lr_fraction
    )
    parts = []
    if max_grad_norm > 0:
        parts.append(optax.clip_by_global_norm(max_grad_norm))
    parts.append(optax.adamw(lr, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mask=_decay_mask))
    return optax.chain(*parts)


def grpo_schedule_steps(grpo: Any) -> tuple[int, int]:
    """``(total, warmup)`` of a GRPO run's schedule in optimizer steps: ``grpo.steps x k`` and
    ``grpo.warmup_steps x k`` with ``k = grpo.num_iterations x grpo.minibatches`` (every GRPO step
    makes ``k`` optimizer steps; ``grpo.warmup_steps`` counts GRPO steps).

    Args:
      grpo: the ``grpo`` config section (``steps``, ``warmup_steps``, ``minibatches``,
        ``num_iterations``: ints).
    """
    per_step = int(grpo.minibatches) * int(grpo.num_iterations)
    return int(grpo.steps) * per_step, int(grpo.warmup_steps) * per_step


def grpo_optimizer(grpo: Any) -> optax.GradientTransformation:
    """The AdamW of a GRPO run (``make_optimizer`` with the ``grpo`` section's rate, decay,
    clipping and schedule), its schedule counted in optimizer steps (``grpo_schedule_steps``):
    a cosine run reaches its end value when the run ends, not after ``1 / grpo.minibatches`` of
    it, and warmup lasts ``grpo.warmup_steps`` GRPO steps.

    Args:
      grpo: the ``grpo`` config section.

    Returns:
      ``optax.GradientTransformation`` over float32 (``PARAM_DTYPE``) parameters.

    Raises:
      OptimizerConfigError: a value is out of range (the config checks catch these first).
    """
    total, warmup = grpo_schedule_steps(grpo)
    return make_optimizer(grpo.learning_rate, total, warmup, grpo.weight_decay, grpo.max_grad_norm,
                          schedule=grpo.schedule)
