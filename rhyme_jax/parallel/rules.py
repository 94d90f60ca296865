"""Logical-axis sharding rules: parameter / activation / KV-pool dimensions -> mesh axes.

Every array dimension gets a logical name (``batch``, ``embed``, ``heads``, ``kv_heads``, ``mlp``,
``vocab``, ``pages``, or ``None``); ``LOGICAL_RULES`` maps a name to the mesh axes that split it.
A rule only uses the axes the mesh has with size > 1, and a dimension the axes do not divide
evenly stays replicated, so one table serves the train mesh (``data``, ``fsdp``, ``tensor``), a
rollout worker's mesh (``tensor`` only) and a single device (everything replicated).

Megatron-style tensor parallelism falls out of the table: q/k/v and gate/up kernels are split
by output features (``heads`` / ``kv_heads`` / ``mlp``), o/down kernels by input features, so
XLA inserts one all-reduce after each; ``embed`` over ``fsdp`` is ZeRO-3 style parameter
sharding (gathered per use inside the jitted step). Reference: the MaxText / Flax logical
axis rules (``nn.logical_axis_rules``).
"""

from __future__ import annotations

import contextlib
import math
import threading
from typing import Any, Mapping, Optional, Sequence

import jax
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

LOGICAL_RULES: dict[str, tuple[str, ...]] = {
    "batch": ("data", "fsdp"),  # rows of a train batch
    "embed": ("fsdp",),  # hidden dimension of parameters (FSDP / ZeRO-3)
    "heads": ("tensor",),  # query heads (x head_dim) of q/o projections
    "kv_heads": ("tensor",),  # KV heads of k/v projections and of the paged KV pool
    "mlp": ("tensor",),  # intermediate features of the MLP
    "vocab": ("tensor",),  # vocabulary of the embedding / output head
    "pages": (),  # KV pool pages: indexed by the global page table, never split
    "layer": (),  # leading axis of the stacked decoder blocks (scanned over, never split)
}

# Parameter path suffix -> logical names of its dimensions (nnx.Linear kernels are [in, out]).
PARAM_AXES: dict[tuple[str, ...], tuple[Optional[str], ...]] = {
    ("embed", "embedding"): ("vocab", "embed"),
    ("lm_head", "kernel"): ("embed", "vocab"),
    ("q_proj", "kernel"): ("embed", "heads"),
    ("q_proj", "bias"): ("heads",),
    ("k_proj", "kernel"): ("embed", "kv_heads"),
    ("k_proj", "bias"): ("kv_heads",),
    ("v_proj", "kernel"): ("embed", "kv_heads"),
    ("v_proj", "bias"): ("kv_heads",),
    ("o_proj", "kernel"): ("heads", "embed"),
    ("o_proj", "bias"): (None,),
    ("gate_proj", "kernel"): ("embed", "mlp"),
    ("up_proj", "kernel"): ("embed", "mlp"),
    ("down_proj", "kernel"): ("mlp", "embed"),
    ("weight",): (None,),  # RMSNorm scales (input/post-attn/final/q/k norms)
    ("lora", "lora_a"): (None, None),  # LoRA adapters (model/lora.py): small, replicated
    ("lora", "lora_b"): (None, None),
    ("dropout_key",): (None,),  # a LoRA adapter's dropout key data (uint32[2] per layer)
}
# Paged KV pool ``[L, KVH, P, ps, hd]`` (rollout/kv_cache.py).
KV_POOL_AXES: tuple[Optional[str], ...] = (None, "kv_heads", "pages", None, None)


class ShardingRuleError(ValueError):
    """A parameter has no logical-axis rule or a rule does not match its rank (names the path)."""


def _axes_of(mesh: Mesh | Mapping[str, int]) -> Mapping[str, int]:
    return dict(mesh.shape) if isinstance(mesh, Mesh) else dict(mesh)


def logical_to_spec(names: Sequence[Optional[str]], shape: Sequence[int],
                    mesh: Mesh | Mapping[str, int],
                    rules: Mapping[str, tuple[str, ...]] = LOGICAL_RULES) -> PartitionSpec:
    """``PartitionSpec`` for an array of ``shape`` whose dimensions have logical ``names``.

    Mesh axes absent from ``mesh`` (or of size 1) are dropped; a dimension the remaining axes
    do not divide is replicated; a mesh axis is used by at most one dimension (first wins).

    Raises:
      ShardingRuleError: ``names`` and ``shape`` differ in length, or a name has no rule.
    """
    if len(names) != len(shape):
        raise ShardingRuleError(f"logical names {tuple(names)} do not match shape {tuple(shape)}")
    sizes = _axes_of(mesh)
    used: set[str] = set()
    out = []
    for name, dim in zip(names, shape):
        if name is None:
            out.append(None)
            continue
        if name not in rules:
            raise ShardingRuleError(f"no sharding rule for logical axis {name!r} (rules: {sorted(rules)})")
        axes = tuple(a for a in rules[name] if sizes.get(a, 1) > 1 and a not in used)
        if not axes or dim % math.prod(sizes[a] for a in axes):
            out.append(None)
            continue
        used.update(axes)
        out.append(axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*out)


def _path_names(key_path) -> tuple[str, ...]:
    names = []
    for k in key_path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                names.append(str(getattr(k, attr)))
                break
    if names and names[-1] == "value":  # nnx.Variable's value field
        names.pop()
    return tuple(names)


def param_logical_axes(path: Sequence[str], ndim: int) -> tuple[Optional[str], ...]:
    """Logical names of a parameter at ``path`` (e.g. ``("layers", "attn", "q_proj", "kernel")``).

    Parameters under ``layers`` are stacked over the decoder's blocks (``transformer.scan_layers``):
    their leading axis is the logical ``layer`` axis, never split (each device holds its shard of
    every layer).

    Raises:
      ShardingRuleError: no entry of ``PARAM_AXES`` matches the path's suffix, or its rank differs.
    """
    path = tuple(path)
    stacked = bool(path) and path[0] == "layers"
    for suffix, names in PARAM_AXES.items():
        if path[-len(suffix):] == suffix:
            if len(names) + stacked != ndim:
                break
            return (("layer",) if stacked else ()) + names
    raise ShardingRuleError(f"parameter {'/'.join(path)} (rank {ndim}) has no rule in "
                            f"rhyme_jax/parallel/rules.py PARAM_AXES")


def param_specs(abstract_state: Any, mesh: Mesh | Mapping[str, int]) -> Any:
    """``PartitionSpec`` per parameter leaf (same tree as ``abstract_state``, an ``nnx.State`` of
    arrays or ``ShapeDtypeStruct``s).

    Raises:
      ShardingRuleError: see ``param_logical_axes``.
    """
    def spec(kp, leaf):
        return logical_to_spec(param_logical_axes(_path_names(kp), len(leaf.shape)), leaf.shape, mesh)

    return jax.tree_util.tree_map_with_path(spec, abstract_state)


def param_shardings(abstract_state: Any, mesh: Mesh) -> Any:
    """``NamedSharding`` per parameter leaf on ``mesh`` (see ``param_specs``)."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs(abstract_state, mesh),
                        is_leaf=lambda x: isinstance(x, PartitionSpec))


def opt_state_shardings(optimizer: optax.GradientTransformation, abstract_opt_state: Any,
                        state_shardings: Any, mesh: Mesh) -> Any:
    """Shardings of an optax state: moments like their parameters, counters replicated.

    Uses ``optax.tree_map_params``, so every optax transformation whose state mirrors the params
    (Adam moments, masked states) is covered.
    """
    replicated = NamedSharding(mesh, PartitionSpec())
    return optax.tree_map_params(optimizer, lambda _, sh: sh, abstract_opt_state, state_shardings,
                                 transform_non_params=lambda _: replicated)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Rows split over ``("data", "fsdp")`` (the ``batch`` rule), other dims replicated."""
    axes = tuple(a for a in LOGICAL_RULES["batch"] if mesh.shape.get(a, 1) > 1)
    return NamedSharding(mesh, PartitionSpec(axes or None))


def kv_pool_sharding(mesh: Mesh, shape: Sequence[int]) -> NamedSharding:
    """Sharding of the paged KV pool ``[L, KVH, P, ps, hd]``: split by KV head (``kv_heads``)."""
    return NamedSharding(mesh, logical_to_spec(KV_POOL_AXES, shape, mesh))


# ---------------------------------------------------------------- activation constraints
_ACTIVE = threading.local()


@contextlib.contextmanager
def activation_mesh(mesh: Optional[Mesh]):
    """While tracing inside this context, ``constrain`` pins activations to ``mesh``'s rules.

    ``None`` (or no context) makes ``constrain`` a no-op, so the same model code runs unsharded.
    """
    prev = getattr(_ACTIVE, "mesh", None)
    _ACTIVE.mesh = mesh
    try:
        yield
    finally:
        _ACTIVE.mesh = prev


def constrain(x: jax.Array, names: Sequence[Optional[str]]) -> jax.Array:
    """``with_sharding_constraint(x, rules(names))`` under ``activation_mesh``; else ``x``.

    Example: ``h = constrain(h, ("batch", None, None))`` keeps the residual stream split by rows
    (FSDP gathers parameters, never activations).
    """
    mesh = getattr(_ACTIVE, "mesh", None)
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, logical_to_spec(names, x.shape, mesh)))
