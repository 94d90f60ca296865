"""Per-device memory of parameters and optimizer state under a mesh, from shapes alone.

Nothing is allocated: the model is built with ``nnx.eval_shape``, the optimizer state with
``jax.eval_shape``, and each leaf's shard shape follows from ``rules.param_specs`` on a mesh
*shape* (no devices needed), so the real recipe's layout can be planned on a laptop
(``rhyme-jax memory``). A run's trained parameters and AdamW moments are float32 whatever
``model.dtype`` computes in (``optim.PARAM_DTYPE``, mixed precision); a rollout worker's weights
are the compute-dtype copy (``policy.compute_params``): size each with its own ``param_dtype``.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import PartitionSpec

from rhyme_jax.model.config import ModelConfig
from rhyme_jax.model.lora import LoRASpec, lora_decoder, split_lora
from rhyme_jax.model.transformer import Decoder
from rhyme_jax.parallel.rules import param_specs


def _shard_bytes(leaf, spec: PartitionSpec, mesh_shape: Mapping[str, int]) -> int:
    n = 1
    for dim, entry in zip(leaf.shape, tuple(spec) + (None,) * (len(leaf.shape) - len(spec))):
        axes = () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))
        n *= -(-dim // math.prod(mesh_shape.get(a, 1) for a in axes))
    return n * np.dtype(leaf.dtype).itemsize


def state_memory(model_cfg: ModelConfig, mesh_shape: Mapping[str, int], *, param_dtype="float32",
                 optimizer: optax.GradientTransformation | None = None, lora: LoRASpec | None = None) -> dict[str, Any]:
    """Bytes per device of the parameters and the optimizer state of ``model_cfg`` on a mesh.

    Args:
      model_cfg: architecture (e.g. ``ModelConfig.from_hf_dir``).
      mesh_shape: ``{"data": d, "fsdp": f, "tensor": t}`` (missing axes = 1).
      param_dtype: storage dtype of the parameters (the optimizer moments follow it): float32
        for the train state (master weights + AdamW), ``model.dtype`` for a rollout worker.
      optimizer: default AdamW as the trainer builds it (two moments per parameter).
      lora: LoRA adapters (``lora`` section, ``model.lora``): the params are the frozen base plus
        the adapters, the optimizer state covers the adapters only.

    Returns:
      ``{"params": n_params, "trainable_params", "param_bytes_total", "param_bytes_per_device",
      "opt_bytes_total", "opt_bytes_per_device", "mesh": dict(mesh_shape)}`` (bytes, ints;
      per-device = the largest shard, i.e. device 0; ``params`` counts base and adapters).
    """
    from rhyme_jax.train.optim import make_optimizer

    abstract = nnx.eval_shape(lambda: Decoder(model_cfg, dtype=param_dtype, param_dtype=param_dtype,
                                              rngs=nnx.Rngs(0)))
    _, state = nnx.split(abstract)
    trained = state
    if lora is not None:  # the optimizer holds the adapters only
        _, trained, _, base = split_lora(lora_decoder(model_cfg, lora, dtype=param_dtype, param_dtype=param_dtype))
        state = (base, trained)
    opt = optimizer or make_optimizer(1e-6, 10, 0, 0.0, 1.0)
    opt_state = jax.eval_shape(opt.init, trained)
    specs = (tuple(param_specs(part, mesh_shape) for part in state) if lora is not None
             else param_specs(state, mesh_shape))
    is_spec = lambda x: isinstance(x, PartitionSpec)
    opt_specs = optax.tree_map_params(opt, lambda _, s: s, opt_state, param_specs(trained, mesh_shape),
                                      transform_non_params=lambda _: PartitionSpec(), is_leaf=None)
    p_leaves = jax.tree.leaves(state)
    o_leaves = jax.tree.leaves(opt_state)
    p_specs = jax.tree.leaves(specs, is_leaf=is_spec)
    o_specs = jax.tree.leaves(opt_specs, is_leaf=is_spec)
    full = lambda leaves: int(sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in leaves))
    shard = lambda leaves, sp: int(sum(_shard_bytes(x, s, mesh_shape) for x, s in zip(leaves, sp)))
    return {"params": int(sum(math.prod(x.shape) for x in p_leaves)),
            "trainable_params": int(sum(math.prod(x.shape) for x in jax.tree.leaves(trained))),
            "param_bytes_total": full(p_leaves), "param_bytes_per_device": shard(p_leaves, p_specs),
            "opt_bytes_total": full(o_leaves), "opt_bytes_per_device": shard(o_leaves, o_specs),
            "mesh": dict(mesh_shape)}
