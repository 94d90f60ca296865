"""Moving arrays between layouts: sharded model creation, train -> rollout weight sync, host
batches -> global sharded arrays, and layout-independent checksums.

Weight sync is ``jax.device_put`` to the rollout shardings: device to device, never through the
host. In a multi-host run a rollout worker's mesh is process-local while the train state spans
every process, so the sync first replicates each parameter over the train mesh (one jitted
all-gather) and then copies this process's replica into the worker's layout.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rhyme_jax.parallel.rules import param_shardings


def create_sharded(make_model: Callable[[], nnx.Module], mesh: Mesh) -> tuple[nnx.GraphDef, nnx.State, Any]:
    """Build a model directly in its shardings: ``nnx.eval_shape`` (no memory), then one jitted
    initialisation whose ``out_shardings`` place every parameter shard on its device, so no
    device ever holds the full model.

    Returns:
      ``(graphdef, state, shardings)``. The values do not depend on the mesh (the PRNG streams
      are layout-independent); they equal eager ``make_model()`` within float rounding (XLA may
      fuse the initialisers' arithmetic differently under jit: last-bit differences).
    """
    abstract = nnx.eval_shape(make_model)
    graphdef, abstract_state = nnx.split(abstract)
    shardings = param_shardings(abstract_state, mesh)
    state = jax.jit(lambda: nnx.split(make_model())[1], out_shardings=shardings)()
    return graphdef, state, shardings


def reshard(tree: Any, shardings: Any) -> Any:
    """``tree`` laid out as ``shardings`` (a matching tree or one sharding for all leaves).

    Single process: ``jax.device_put`` (device-to-device copies, or nothing when the layout is
    already right). Multi-process: a leaf already in its target layout is kept; a global target
    is reached by a jitted identity with that ``out_shardings``; a target on this process's
    devices only (a rollout worker) by first replicating the leaf over its own mesh (jitted
    identity, an all-gather) and then copying this process's replica into the target layout.
    """
    if jax.process_count() == 1:
        return jax.device_put(tree, shardings)
    leaves, treedef = jax.tree.flatten(tree)
    targets = (jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
               if not isinstance(shardings, jax.sharding.Sharding) else [shardings] * len(leaves))
    out = []
    for leaf, target in zip(leaves, targets):
        if getattr(leaf, "sharding", None) == target:
            out.append(leaf)
        elif not target.is_fully_addressable:  # global -> global: one jitted reshard
            out.append(jax.jit(lambda x: x, out_shardings=target)(leaf))
        elif leaf.is_fully_addressable:
            out.append(jax.device_put(leaf, target))
        else:  # global -> this process's devices
            full = jax.jit(lambda x: x, out_shardings=NamedSharding(leaf.sharding.mesh, PartitionSpec()))(leaf)
            out.append(jax.device_put(full.addressable_data(0), target))
    return jax.tree.unflatten(treedef, out)


def put_global(host: Any, sharding: NamedSharding) -> Any:
    """Host arrays (identical on every process) -> global arrays in ``sharding``.

    Each device receives only its block (``jax.make_array_from_callback``), so it works the same
    in one process and across hosts.
    """
    def put(x):
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])

    return jax.tree.map(put, host)


def to_host(x: jax.Array) -> np.ndarray:
    """The full value of ``x`` as a numpy array on every process (a multi-host array is first
    replicated over its mesh by a jitted identity)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated:
        x = jax.jit(lambda a: a, out_shardings=NamedSharding(x.sharding.mesh, PartitionSpec()))(x)
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        x = x.addressable_data(0)
    return np.asarray(x)


def leaf_checksums(tree: Any) -> np.ndarray:
    """Per-leaf ``(sum(x), sum(|x|), sum(x * i))`` in float64 on the host, ``f64[num_leaves, 3]``.

    ``i`` is the flat element index, so a permutation inside a leaf changes the checksum. The
    values do not depend on the layout; two trees are bit-identical when their ``np.asarray``
    values are, and tests compare those too. Multi-host leaves are gathered first.
    """
    rows = []
    for leaf in jax.tree.leaves(tree):
        x = to_host(leaf).astype(np.float64).reshape(-1)
        rows.append((x.sum(), np.abs(x).sum(), (x * np.arange(x.size)).sum()))
    return np.asarray(rows, np.float64)
