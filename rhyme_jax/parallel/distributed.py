"""Multi-host start-up: ``jax.distributed.initialize`` from the config or the environment.

Every process of a multi-host run (a TPU pod slice, several GPU hosts, or several CPU processes
in tests) calls ``initialize`` before touching a device. Sources, first match wins:

1. ``parallel.coordinator_address`` / ``num_processes`` / ``process_id`` in the config;
2. the environment: ``RHYME_COORDINATOR_ADDRESS``, ``RHYME_NUM_PROCESSES``, ``RHYME_PROCESS_ID``;
3. JAX's cluster auto-detection (Cloud TPU, SLURM, Open MPI, Kubernetes), when
   ``parallel.distributed`` is true and nothing above is set.

CPU processes use gloo collectives. The data pipeline needs no process-specific input: every
process derives the step's prompts from (seed, step) and runs the rollout groups of its own
workers (``process_groups``).
"""

from __future__ import annotations

import os

import jax
import numpy as np

from rhyme_jax.config import ParallelSection

ENV = ("RHYME_COORDINATOR_ADDRESS", "RHYME_NUM_PROCESSES", "RHYME_PROCESS_ID")


class DistributedConfigError(ValueError):
    """Multi-host settings are incomplete or inconsistent (names the field or variable)."""


def settings(section: ParallelSection) -> dict | None:
    """``{"coordinator_address", "num_processes", "process_id"}`` from the config section or
    the environment; ``{}`` = let JAX auto-detect; ``None`` = single process.

    Raises:
      DistributedConfigError: only some of the three are given, or a value is malformed.
    """
    addr = section.coordinator_address or os.environ.get(ENV[0], "")
    nproc = section.num_processes or int(os.environ.get(ENV[1], "0") or 0)
    pid = section.process_id if section.process_id >= 0 else int(os.environ.get(ENV[2], "-1") or -1)
    given = {"parallel.coordinator_address": bool(addr), "parallel.num_processes": nproc > 0,
             "parallel.process_id": pid >= 0}
    if any(given.values()):
        if not all(given.values()):
            missing = [k for k, v in given.items() if not v]
            raise DistributedConfigError(
                f"multi-host: {', '.join(missing)} not set (config or {'/'.join(ENV)})")
        if ":" not in addr or not 0 <= pid < nproc:
            raise DistributedConfigError(
                f"multi-host: need coordinator_address host:port and 0 <= process_id < num_processes, "
                f"got {addr!r}, process_id={pid}, num_processes={nproc}")
        return {"coordinator_address": addr, "num_processes": nproc, "process_id": pid}
    return {} if section.distributed else None


def initialize(section: ParallelSection) -> bool:
    """Start JAX's distributed runtime when the config or environment asks for it.

    Must run before any other JAX call that touches devices. Returns True when running
    multi-process. Idempotent (a second call is a no-op).

    Raises:
      DistributedConfigError: see ``settings``.
    """
    kw = settings(section)
    if kw is None:
        return False
    if getattr(initialize, "_done", False):
        return jax.process_count() > 1
    try:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except Exception:  # option renamed or removed in a future JAX: CPU collectives default
        pass
    jax.distributed.initialize(**kw)
    initialize._done = True
    return jax.process_count() > 1


def process_groups(num_groups: int, workers_per_process: int) -> list[np.ndarray]:
    """Rollout groups of this process's workers: the ``num_groups`` groups of a step split over
    ``process_count * workers_per_process`` global workers in order (``np.array_split``), and the
    slices of this process's workers returned (worker ``w`` of process ``p`` is global worker
    ``p * workers_per_process + w``).
    """
    total = jax.process_count() * workers_per_process
    parts = np.array_split(np.arange(num_groups), total)
    first = jax.process_index() * workers_per_process
    return parts[first:first + workers_per_process]
