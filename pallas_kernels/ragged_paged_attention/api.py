"""Dispatch for ragged paged attention: pick an implementation by name (ARCHITECTURE.md section 8).

Only ``"reference"`` (plain jnp, ``reference.py``) is registered today; Pallas TPU/GPU kernels
register themselves here later under their own names with the same signature and semantics.
"""

from __future__ import annotations

import warnings
from typing import Callable, Sequence

from jaxtyping import Array, Float, Int

from pallas_kernels.ragged_paged_attention import reference

_IMPLEMENTATIONS: dict[str, Callable] = {"reference": reference.ragged_paged_attention}


def available_implementations() -> tuple[str, ...]:
    """Names accepted by ``implementation=`` (in registration order)."""
    return tuple(_IMPLEMENTATIONS)


def register_implementation(name: str, fn: Callable) -> None:
    """Register a kernel ``fn`` with the signature of ``reference.ragged_paged_attention``."""
    _IMPLEMENTATIONS[name] = fn


def resolve_implementation(implementation: str | Sequence[str]) -> Callable:
    """Return the attention function for a name, or the first available of an ordered list.

    A single name fails fast; with a list, skipping an unavailable entry emits a warning.

    Raises:
      ValueError: the named implementation (or every one in the list) is unknown.
    """
    if isinstance(implementation, str):
        if implementation not in _IMPLEMENTATIONS:
            raise ValueError(
                f"ragged_paged_attention: unknown implementation {implementation!r}; "
                f"available: {list(_IMPLEMENTATIONS)}")
        return _IMPLEMENTATIONS[implementation]
    names = list(implementation)
    for i, name in enumerate(names):
        if name in _IMPLEMENTATIONS:
            if i:
                warnings.warn(f"ragged_paged_attention: {names[:i]} unavailable, falling back to {name!r}")
            return _IMPLEMENTATIONS[name]
    raise ValueError(
        f"ragged_paged_attention: none of {names} is available; available: {list(_IMPLEMENTATIONS)}")


def ragged_paged_attention(
    q: Float[Array, "T H hd"],
    k_pages: Float[Array, "KVH P ps hd"],
    v_pages: Float[Array, "KVH P ps hd"],
    kv_lens: Int[Array, "S"],
    page_indices: Int[Array, "S pps"],
    cu_q_lens: Int[Array, "S+1"],
    num_seqs: Int[Array, "1"],
    *,
    sm_scale: float,
    max_q_len: int,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    implementation: str | Sequence[str] = "reference",
) -> Float[Array, "T H hd"]:
    """Ragged paged attention; see ``reference.ragged_paged_attention`` for the exact semantics.

    Raises:
      ValueError: unknown ``implementation``.
    """
    fn = resolve_implementation(implementation)
    return fn(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale=sm_scale,
              max_q_len=max_q_len, soft_cap=soft_cap, sliding_window=sliding_window)


write_kv = reference.write_kv

__all__ = ["available_implementations", "ragged_paged_attention", "register_implementation",
           "resolve_implementation", "write_kv"]
