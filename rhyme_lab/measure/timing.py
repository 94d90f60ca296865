"""The timing harness of the benchmarks: wall-clock seconds of a call after untimed warm-up runs.

A call that dispatches device work must block until its results are ready (the rollout engine's
``PassRunner.run`` ends with tokens on the host; a jitted update needs
``jax.block_until_ready``), so its wall time is the work's. Host timings on a shared machine are
noisy: compare figures of one run, and report medians.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable


def seconds_of(run: Callable[[], object], repeats: int, warmup: int = 0) -> list[float]:
    """Wall-clock seconds (``time.perf_counter``) of each of ``repeats`` calls of ``run()``,
    after ``warmup`` untimed calls.

    Raises:
      ValueError: ``repeats < 1`` or ``warmup < 0``.
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got {repeats}, {warmup}")
    for _ in range(warmup):
        run()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        out.append(time.perf_counter() - t0)
    return out


def median_seconds(run: Callable[[], object], repeats: int, warmup: int = 0) -> float:
    """Median of ``seconds_of(run, repeats, warmup)`` (seconds)."""
    return float(statistics.median(seconds_of(run, repeats, warmup)))
