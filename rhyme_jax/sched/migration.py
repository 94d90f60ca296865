"""Tail migration (docs/architecture.md, "HistoPipe"; RhymeRL arXiv 2508.18588 section 5).

While a worker decodes, ``TailMigration.monitor(worker)`` is the engine's ``monitor`` callback.
A sequence is a migration candidate when

* its worker is in the tail of its work: at most ``tail_fraction`` (10%) of the worker's rows
  are still unfinished, and
* it has already generated more than ``growth`` x its predicted length (an outlier the history
  did not foresee),

and, in ``sync`` mode, some worker is idle: the sequence is stopped and queued; the idle worker
prefills prompt + partial response and continues it (under greedy sampling the same tokens as if
it had stayed). In ``one_step_off`` mode candidates are stopped and deferred to the next step
instead (``defer=True``), no idle worker needed.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from rhyme_jax.rollout.types import Progress
from rhyme_jax.sched.carry import CarriedRow


@dataclass
class TailMigration:
    """Shared migration state of one rollout step (thread-safe).

    Args:
      predicted: ``f64[R]`` predicted response length (tokens) of every row of the step.
      worker_rows: rows of each worker (``int64[r_w]`` per worker), in the order its engine got
        them (request ``i`` of worker ``w`` is row ``worker_rows[w][i]``).
      growth: a sequence longer than ``growth * predicted`` is an outlier.
      tail_fraction: a worker is in its tail when at most this share of its rows is unfinished.
      defer: one_step_off mode: stop candidates without needing an idle worker.
    """

    predicted: np.ndarray
    worker_rows: Sequence[np.ndarray]
    growth: float = 1.5
    tail_fraction: float = 0.1
    defer: bool = False
    idle: set = field(default_factory=set)
    queue: list = field(default_factory=list)
    moved: list = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def candidates(self, worker: int, progress: Progress) -> np.ndarray:
        """Request indices (into the worker's batch) that qualify for migration now."""
        rows = np.asarray(self.worker_rows[worker])
        unfinished = np.concatenate([progress.running, progress.waiting]).astype(np.int64)
        if unfinished.size == 0 or unfinished.size > max(1, int(self.tail_fraction * rows.size)):
            return np.zeros(0, np.int64)
        over = progress.generated[unfinished] > self.growth * self.predicted[rows[unfinished]]
        return unfinished[over & (progress.generated[unfinished] > 0)]

    def monitor(self, worker: int):
        """The engine ``monitor`` callback of ``worker``: returns the requests to stop now."""
        def check(progress: Progress) -> list[int]:
            picked = self.candidates(worker, progress)
            if picked.size == 0:
                return []
            with self.lock:
                if not self.defer:
                    room = len(self.idle) - len(self.queue)
                    if room <= 0:
                        return []
                    picked = picked[:room]
                self.moved.extend(int(self.worker_rows[worker][r]) for r in picked)
            return picked.tolist()

        return check

    def push(self, migrant: CarriedRow) -> None:
        """Queue a stopped sequence (``row``: its step row, ``source``: its worker) for an idle worker."""
        with self.lock:
            self.queue.append(migrant)

    def take(self, worker: int) -> CarriedRow | None:
        """An idle ``worker`` takes the next queued sequence (None when the queue is empty)."""
        with self.lock:
            return self.queue.pop(0) if self.queue else None

    def set_idle(self, worker: int, idle: bool) -> None:
        """Mark ``worker`` idle (waiting for migrants) or busy."""
        with self.lock:
            (self.idle.add if idle else self.idle.discard)(worker)
