"""Ragged paged attention: the reference oracle and the implementation dispatch (``api``)."""

from pallas_kernels.ragged_paged_attention.api import (
    available_implementations,
    ragged_paged_attention,
    register_implementation,
    resolve_implementation,
    write_kv,
)
from pallas_kernels.ragged_paged_attention.reference import RaggedAttentionInputError

__all__ = ["RaggedAttentionInputError", "available_implementations", "ragged_paged_attention",
           "register_implementation", "resolve_implementation", "write_kv"]
