"""HistoSpec drafting (ARCHITECTURE.md s.5): history store, suffix indexes, numba draft kernels."""

from pathlib import Path

from rhyme_jax.spec.kernel_cache import refresh as _refresh_kernel_cache

_refresh_kernel_cache(Path(__file__).resolve().parent)
