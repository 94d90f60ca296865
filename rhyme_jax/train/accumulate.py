"""The GRPO update over several packed calls: gradients accumulated call by call, applied once.

With ``grpo.pack_lengths`` a minibatch arrives as a list of packed calls of different buffer
lengths (``train/length_classes.py``). Each call runs one jitted gradient program for its shape,
adding its loss, metrics and gradient into a float32 accumulator (donated, so it is updated in
place); one jitted program then takes the optimizer step (``grpo_step.apply_grads``). The loss
weights of every call are the whole minibatch's, so the sums are the one-pass update's loss and
gradient (``tests/test_length_classes.py`` checks the new parameters against the padded step).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from rhyme_jax.parallel.rules import activation_mesh
from rhyme_jax.train.grpo_step import (TrainShardings, UpdateMemory, apply_grads, batch_shards, make_grads_fn,
                                       make_grpo_step)


def make_accumulating_step(graphdef: nnx.GraphDef, optimizer: optax.GradientTransformation, *,
                           eps_low: float, eps_high: float, kl_coef: float, loss_agg: str, temperature: float,
                           shardings: Optional[TrainShardings] = None, memory: UpdateMemory = UpdateMemory(),
                           frozen_shardings: Any = None, **loss_kw: Any) -> Callable:
    """Build ``step(state, opt_state, calls[, frozen]) -> (state, opt_state, metrics)``.

    Args:
      graphdef, optimizer, eps_low, eps_high, kl_coef, loss_agg, temperature, shardings, memory,
        frozen_shardings, loss_kw: as ``grpo_step.make_grpo_step`` (``loss_kw``: its
        ``kl_ratio_weighted`` / ``importance_sampling_level`` / ``entropy_coef``).

    Returns:
      ``step``: ``calls`` is a non-empty list of packed minibatches (``length_classes
      .pack_by_length``; each carries ``loss_w`` / ``token_w`` of the whole minibatch), already on
      the devices; ``state`` and ``opt_state`` are donated. Metrics as ``make_grpo_step``'s, the
      loss and the token-weighted metrics summed over the calls.

    Raises:
      ValueError: ``calls`` is empty.
    """
    mesh = shardings.mesh if shardings is not None else None
    grads_of = make_grads_fn(graphdef, eps_low=eps_low, eps_high=eps_high, kl_coef=kl_coef, loss_agg=loss_agg,
                             temperature=temperature, shards=batch_shards(shardings), memory=memory, **loss_kw)

    def accumulate(acc, state, batch, frozen=()):
        with activation_mesh(mesh):
            out = grads_of(state, batch, frozen)
        return jax.tree.map(lambda a, x: a + x.astype(jnp.float32), acc, out)

    def apply(state, opt_state, acc):
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype), acc[1], state)
        return apply_grads(optimizer, state, opt_state, (acc[0], grads))

    if shardings is None:
        add, finish, zeros_sh = jax.jit(accumulate, donate_argnums=(0,)), jax.jit(apply, donate_argnums=(0, 1, 2)), None
    else:
        replicated = jax.sharding.NamedSharding(shardings.mesh, jax.sharding.PartitionSpec())
        zeros_sh = ((replicated, replicated), shardings.params)
        extra = () if frozen_shardings is None else (frozen_shardings,)
        add = jax.jit(accumulate, donate_argnums=(0,), in_shardings=(zeros_sh, shardings.params, shardings.batch, *extra),
                      out_shardings=zeros_sh)
        finish = jax.jit(apply, donate_argnums=(0, 1, 2), in_shardings=(shardings.params, shardings.opt_state, zeros_sh),
                         out_shardings=(shardings.params, shardings.opt_state, replicated))
    zeros_fn: list = []

    def step(state, opt_state, calls, frozen=()):
        if not calls:
            raise ValueError("accumulating step: no packed calls in the minibatch")
        if not zeros_fn:  # the accumulator's structure: the gradient program's output, in float32
            shapes = jax.eval_shape(grads_of, state, calls[0], frozen)
            make = lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), shapes)
            zeros_fn.append(jax.jit(make) if zeros_sh is None else jax.jit(make, out_shardings=zeros_sh))
        acc = zeros_fn[0]()
        extra = (frozen,) if frozen else ()  # as make_grpo_step's callers: no frozen argument without one
        for batch in calls:
            acc = add(acc, state, batch, *extra)
        return finish(state, opt_state, acc)

    return step


def update_step_maker(pack_lengths: list[int]) -> Callable:
    """``make_accumulating_step`` when the run packs by length classes (``grpo.pack_lengths``),
    else ``grpo_step.make_grpo_step``; both take the same arguments."""
    return make_accumulating_step if pack_lengths else make_grpo_step

