"""Device meshes: the train mesh (``data``, ``fsdp``, ``tensor``) and the rollout workers' sub-meshes.

The train layout is one global mesh over ``data x fsdp x tensor`` devices (across every process
of a multi-host run). Rollout runs on W data-parallel workers per process, each an engine on its
own sub-mesh of ``rollout_tensor`` *local* devices with a single ``tensor`` axis
(docs/architecture.md, "Data flow of one GRPO step", the two layouts). The two layouts may
overlap (co-located trainer and rollout, as verl's hybrid engine) or not; the weight sync
reshards between them (``parallel/reshard.py``).
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

AXES = ("data", "fsdp", "tensor")


class MeshConfigError(ValueError):
    """A mesh size in the ``parallel`` config section cannot be laid out on the devices
    (the message names the field and the device count)."""


def mesh_shape(data: int, fsdp: int, tensor: int, num_devices: int) -> tuple[int, int, int]:
    """Resolve ``(data, fsdp, tensor)``; at most one of them may be ``-1`` (= the devices left).

    Raises:
      MeshConfigError: a size is 0 or below -1, two sizes are -1, or the product does not fit
        ``num_devices`` (names the ``parallel.*`` fields).
    """
    sizes = {"data": int(data), "fsdp": int(fsdp), "tensor": int(tensor)}
    bad = [k for k, v in sizes.items() if v == 0 or v < -1]
    if bad:
        raise MeshConfigError(f"parallel.{bad[0]}={sizes[bad[0]]}: mesh sizes must be >= 1 or -1 (fill)")
    fill = [k for k, v in sizes.items() if v == -1]
    if len(fill) > 1:
        raise MeshConfigError(f"parallel.{fill[0]} and parallel.{fill[1]} are both -1; at most one may fill")
    fixed = math.prod(v for v in sizes.values() if v != -1)
    if fill:
        if num_devices % fixed:
            raise MeshConfigError(f"parallel.{fill[0]}=-1: {num_devices} devices are not a multiple of "
                                  f"the other axes' product {fixed}")
        sizes[fill[0]] = num_devices // fixed
    total = math.prod(sizes.values())
    if total > num_devices:
        raise MeshConfigError(f"parallel.data x fsdp x tensor = {sizes['data']} x {sizes['fsdp']} x "
                              f"{sizes['tensor']} = {total} devices, but only {num_devices} exist")
    return sizes["data"], sizes["fsdp"], sizes["tensor"]


def train_mesh(data: int = 1, fsdp: int = 1, tensor: int = 1,
               devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The train mesh with axes ``("data", "fsdp", "tensor")`` over the first ``data*fsdp*tensor``
    of ``devices`` (default: every device of every process, ``jax.devices()``).

    Devices are laid out process-major, so in a multi-host run each process's devices form a
    contiguous block of the ``data`` (then ``fsdp``) axis: its rows of a batch sharded over
    ``("data", "fsdp")`` live on its own devices.

    Raises:
      MeshConfigError: see ``mesh_shape``.
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = mesh_shape(data, fsdp, tensor, len(devices))
    devices = sorted(devices[: math.prod(shape)], key=lambda d: (d.process_index, d.id))
    return Mesh(np.array(devices, dtype=object).reshape(shape), AXES)


def rollout_meshes(tensor: int = 1, workers: int = 1,
                   devices: Sequence[jax.Device] | None = None) -> list[Mesh]:
    """Sub-meshes of the rollout workers: worker ``w`` gets local devices
    ``[w * tensor, (w + 1) * tensor)`` as a 1-D mesh with axis ``"tensor"``.

    Args:
      tensor: devices per worker (tensor parallelism over heads inside a worker).
      workers: workers in this process; 0 = as many as the local devices allow.
      devices: default ``jax.local_devices()`` (a worker never spans processes).

    Raises:
      MeshConfigError: ``tensor < 1``, ``workers < 0`` or too few local devices.
    """
    devices = list(jax.local_devices() if devices is None else devices)
    if tensor < 1 or workers < 0:
        raise MeshConfigError(f"parallel.rollout_tensor={tensor} must be >= 1 and "
                              f"parallel.rollout_workers={workers} >= 0")
    workers = workers or len(devices) // tensor
    if workers < 1 or workers * tensor > len(devices):
        raise MeshConfigError(f"parallel.rollout_workers={workers} x parallel.rollout_tensor={tensor} "
                              f"needs {max(workers, 1) * tensor} devices per process, this process has "
                              f"{len(devices)}")
    return [Mesh(np.array(devices[w * tensor:(w + 1) * tensor], dtype=object), ("tensor",))
            for w in range(workers)]

