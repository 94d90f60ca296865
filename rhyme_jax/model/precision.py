"""Compute-dtype copies of a model: its parameters cast (``cast_floating``) and its graph set to
compute in another dtype (``with_compute_dtype``).

The trainer keeps float32 master weights (``train.optim.PARAM_DTYPE``); a rollout engine may run
on a bfloat16 copy with a graph whose layers compute in bfloat16 and a bfloat16 KV pool (vLLM /
verl / TRL roll out in bf16: Yao et al. 2025, "Your efficient RL framework secretly brings you
off-policy RL training"). Mixed precision as in Micikevicius et al. 2018 (arXiv 1710.03740):
float32 master weights, low-precision copies for the forward pass.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


class PrecisionError(ValueError):
    """An unknown dtype name."""


def dtype_of(name: str, where: str = "dtype"):
    """The jnp dtype of a config name (``float32`` | ``bfloat16``).

    Raises:
      PrecisionError: unknown name; the message starts with ``where`` (the config field).
    """
    try:
        return DTYPES[name]
    except KeyError:
        raise PrecisionError(f"{where}={name!r}: expected one of {sorted(DTYPES)}") from None


def cast_floating(state: Any, dtype) -> Any:
    """``state`` with every floating-point leaf cast to ``dtype``.

    Leaves already in ``dtype`` and integer leaves are returned as they are (no copy), so a cast
    to the dtype a state already has returns the very same arrays. Each cast keeps its leaf's
    sharding. ``jax.ShapeDtypeStruct`` leaves (abstract states, for lowering) get the new dtype.

    Args:
      state: a params pytree (``nnx.State``), e.g. f32 leaves in the train layout.
      dtype: target dtype (``jnp.bfloat16``, ``"bfloat16"``, ...).

    Returns:
      The same structure with floating leaves in ``dtype`` (bf16 rounds to nearest even: relative
      error at most ``2**-8`` per weight).
    """
    dtype = jnp.dtype(dtype)

    def cast(x):
        if not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype == dtype:
            return x
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape, dtype, sharding=x.sharding)
        return x.astype(dtype)

    return jax.tree.map(cast, state)


def compute_dtype_of(graphdef: nnx.GraphDef, state: Any):
    """The dtype the ``Decoder`` of ``(graphdef, state)`` computes in (its ``dtype`` attribute)."""
    return jnp.dtype(nnx.merge(graphdef, _abstract(state)).dtype)


def with_compute_dtype(graphdef: nnx.GraphDef, state: Any, dtype) -> nnx.GraphDef:
    """``graphdef`` with every module's compute ``dtype`` set to ``dtype`` (the embedding, every
    linear layer and RMSNorm, the ``Decoder`` itself); ``state`` (or any tree of its structure)
    gives the structure to merge into. Returns ``graphdef`` itself when it already computes in
    ``dtype`` (the same program, nothing recompiles).

    The storage dtype of the parameters is the state's own (cast it with ``cast_floating``); the
    layers cast parameters and activations to ``dtype`` (``nnx.Linear``, ``model.layers``), the
    attention scores, softmax and output logits stay float32 (``model.transformer``).
    """
    dtype = jnp.dtype(dtype)
    model = nnx.merge(graphdef, _abstract(state))
    if jnp.dtype(model.dtype) == dtype:
        return graphdef
    for _, module in nnx.iter_modules(model):
        if hasattr(module, "dtype"):
            module.dtype = dtype
    return nnx.split(model)[0]


def _abstract(state: Any) -> Any:
    """``state`` as ``jax.ShapeDtypeStruct`` leaves (nothing allocated when merged)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
