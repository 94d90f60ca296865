"""The jitted GRPO update: one pure function over ``nnx.split`` state with donated buffers.

Loss: clipped surrogate with eps_low / eps_high (DAPO clip-higher), optional k3 KL to a frozen
reference, token-mean aggregation (ARCHITECTURE.md section 7; DeepSeekMath eq. 3, DAPO eq. 8).
A step whose loss or gradients are not finite leaves parameters and optimizer state unchanged and
reports ``finite = 0``; the trainer counts and stops on repeats.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from rhyme_jax.parallel.rules import activation_mesh
from rhyme_jax.train import losses


class TrainShardings(NamedTuple):
    """Layout of the jitted train programs: ``params`` / ``opt_state`` are trees of
    ``NamedSharding`` (``parallel.rules.param_shardings`` / ``opt_state_shardings``), ``batch``
    one ``NamedSharding`` for every batch field (rows over ``("data", "fsdp")``)."""

    mesh: jax.sharding.Mesh
    params: Any
    opt_state: Any
    batch: jax.sharding.NamedSharding


def _target_logprobs(graphdef: nnx.GraphDef, state: nnx.State, batch: dict, temperature: float):
    """Log p(tokens[:, t+1] | tokens[:, :t+1]) under ``softmax(logits / temperature)``.

    Returns f32[B, T-1] logprobs and f32[B, T-1] entropies (aligned with ``loss_mask[:, :-1]``).
    """
    model = nnx.merge(graphdef, state)
    logits = model(batch["tokens"], batch["positions"], batch["attn_mask"])
    return losses.token_logprobs(logits[:, :-1], batch["tokens"][:, 1:], temperature)


def make_logprob_fn(graphdef: nnx.GraphDef, temperature: float,
                    shardings: Optional[TrainShardings] = None) -> Callable:
    """Jitted ``(state, batch) -> f32[B, T-1]`` target logprobs (for the frozen KL reference);
    laid out by ``shardings`` when given (output rows like the batch)."""
    mesh = shardings.mesh if shardings is not None else None

    def logprob_fn(state, batch):
        with activation_mesh(mesh):
            return _target_logprobs(graphdef, state, batch, temperature)[0]

    if shardings is None:
        return jax.jit(logprob_fn)
    return jax.jit(logprob_fn, in_shardings=(shardings.params, shardings.batch),
                   out_shardings=shardings.batch)


def make_grpo_step(graphdef: nnx.GraphDef, optimizer: optax.GradientTransformation, *,
                   eps_low: float, eps_high: float, kl_coef: float, loss_agg: str,
                   temperature: float, shardings: Optional[TrainShardings] = None) -> Callable:
    """Build ``step(state, opt_state, batch) -> (state, opt_state, metrics)``.

    ``batch`` holds ``tokens i32[B,T]``, ``positions i32[B,T]``, ``attn_mask bool[B,T]``,
    ``loss_mask f32[B,T]`` (1 where the next token is a response token), ``old_logprobs f32[B,T-1]``
    (behaviour logprobs aligned with targets ``tokens[:, 1:]``), ``advantages f32[B]`` and, when
    ``kl_coef > 0``, ``ref_logprobs f32[B,T-1]``. ``state`` and ``opt_state`` are donated.
    Metrics are f32 scalars: loss, grad_norm, entropy, clip_fraction, kl, finite (1/0).

    With ``shardings`` the step is jitted with those in/out shardings (FSDP and tensor parallel
    over ``shardings.mesh``; activations constrained to rows over ``("data", "fsdp")``); the
    math is the same, so results equal the single-device step within float tolerance.
    """
    mesh = shardings.mesh if shardings is not None else None

    def loss_fn(state, batch):
        logprobs, entropy = _target_logprobs(graphdef, state, batch, temperature)
        mask = batch["loss_mask"][:, :-1]
        loss, metrics = losses.grpo_loss(
            logprobs, batch["old_logprobs"], batch["advantages"], mask,
            eps_low=eps_low, eps_high=eps_high,
            ref_logprobs=batch.get("ref_logprobs") if kl_coef > 0 else None,
            kl_coef=kl_coef, loss_agg=loss_agg)
        metrics = dict(metrics)
        metrics["entropy"] = jnp.sum(entropy * mask) / jnp.maximum(jnp.sum(mask), 1.0)
        return loss, metrics

    def step(state, opt_state, batch):
        with activation_mesh(mesh):
            (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state, batch)
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        updates, new_opt_state = optimizer.update(grads, opt_state, state)
        new_state = optax.apply_updates(state, updates)
        keep = lambda new, old: jnp.where(finite, new, old)
        new_state = jax.tree.map(keep, new_state, state)
        new_opt_state = jax.tree.map(keep, new_opt_state, opt_state)
        metrics = {k: jnp.asarray(v, jnp.float32) for k, v in metrics.items()}
        metrics.update(loss=loss.astype(jnp.float32), grad_norm=grad_norm.astype(jnp.float32),
                       finite=finite.astype(jnp.float32))
        return new_state, new_opt_state, metrics

    if shardings is None:
        return jax.jit(step, donate_argnums=(0, 1))
    replicated = jax.sharding.NamedSharding(shardings.mesh, jax.sharding.PartitionSpec())
    return jax.jit(step, donate_argnums=(0, 1),
                   in_shardings=(shardings.params, shardings.opt_state, shardings.batch),
                   out_shardings=(shardings.params, shardings.opt_state, replicated))


def params_checksum(state: Any) -> float:
    """Sum of |x| over all parameters (a cheap fingerprint for tests and logs)."""
    leaves = jax.tree.leaves(state)
    return float(sum(jnp.sum(jnp.abs(x.astype(jnp.float32))) for x in leaves))
