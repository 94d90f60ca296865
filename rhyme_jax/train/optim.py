"""Optimizer and learning-rate schedule (optax AdamW + global-norm clipping).

Non-finite updates are not filtered here (no ``optax.apply_if_finite``): the trainer checks the
loss / gradient norm and skips such steps itself, so it can count and report them.
"""

from __future__ import annotations

import jax
import optax

SCHEDULES = ("cosine", "constant")


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

    The rate reaches ``learning_rate`` at step ``warmup_steps`` exactly; ``cosine`` then decays to
    ``final_lr_fraction * learning_rate`` at ``total_steps`` (and stays there).

    Args:
      learning_rate: peak rate (> 0).
      total_steps: optimizer steps of the run (>= 1).
      warmup_steps: steps of linear warmup (0 <= warmup_steps <= total_steps).
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
