"""HistoSpec drafting: history store, suffix indexes, numba draft kernels.

Overview: docs/architecture.md, "HistoSpec in one paragraph".
"""

from pathlib import Path

from rhyme_jax.spec.kernel_cache import refresh as _refresh_kernel_cache

_refresh_kernel_cache(Path(__file__).resolve().parent)
