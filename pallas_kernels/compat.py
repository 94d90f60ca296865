"""Every Pallas import of the project, in one place.

The Pallas API moves between JAX releases (``TPUCompilerParams`` -> ``pltpu.CompilerParams``,
``TritonCompilerParams`` -> ``plgpu.CompilerParams``, the Triton backend deprecated in 0.11).
Kernels import ``pl``, ``pltpu``, ``pl_triton`` and the helpers below from here, never from
``jax.experimental.pallas`` directly, so a JAX upgrade touches only this module. Supported:
jax 0.10.x (CPU CI, interpret mode) and 0.11.x (the GPU machine).

Names that a JAX build lacks are ``None`` (e.g. ``pl_triton`` where the Triton backend was
removed).
"""

from __future__ import annotations

from typing import Any

from jax.experimental import pallas as pl

try:  # Mosaic TPU (also provides the TPU interpreter that runs on CPU)
    from jax.experimental.pallas import tpu as pltpu
except ImportError:  # pragma: no cover - every supported jax ships it
    pltpu = None

try:  # Triton lowering for NVIDIA GPUs (interpret=True runs it on CPU)
    from jax.experimental.pallas import triton as pl_triton
except ImportError:  # pragma: no cover - removed in some future jax
    pl_triton = None


def tpu_compiler_params(**kwargs: Any) -> Any:
    """``CompilerParams`` of the Mosaic TPU backend under whichever name this JAX uses.

    Args:
      kwargs: e.g. ``dimension_semantics=("parallel", "arbitrary")``, ``vmem_limit_bytes``.
    """
    cls = getattr(pltpu, "CompilerParams", None) or getattr(pltpu, "TPUCompilerParams")
    return cls(**kwargs)


def triton_compiler_params(**kwargs: Any) -> Any:
    """``CompilerParams`` of the Triton GPU backend (``num_warps``, ``num_stages``).

    Raises:
      RuntimeError: this JAX has no Triton backend.
    """
    if pl_triton is None:
        raise RuntimeError("pallas_kernels/compat.py: this jax has no Pallas Triton backend")
    cls = getattr(pl_triton, "CompilerParams", None) or getattr(pl_triton, "TritonCompilerParams")
    return cls(**kwargs)


def tpu_interpret_params(**kwargs: Any) -> Any:
    """``pltpu.InterpretParams`` (CPU emulation of a TPU core; e.g. ``detect_races=True,
    uninitialized_memory="nan"``)."""
    return pltpu.InterpretParams(**kwargs)


def tpu_interpret_races_found() -> bool | None:
    """Whether the TPU interpreter's race detector flagged a data race in the last kernel run
    with ``detect_races=True``; ``None`` when this JAX does not expose the detector state."""
    try:
        from jax._src.pallas.mosaic.interpret import interpret_pallas_call as _ipc
    except ImportError:  # pragma: no cover - private module moved in a future jax
        return None
    races = getattr(_ipc, "races", None)
    return None if races is None else bool(getattr(races, "races_found", False))


__all__ = ["pl", "pl_triton", "pltpu", "tpu_compiler_params", "tpu_interpret_params",
           "tpu_interpret_races_found", "triton_compiler_params"]
