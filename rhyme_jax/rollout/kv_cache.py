"""Paged KV pool of the rollout engine.

One pool holds every layer: ``k, v [num_layers, num_kv_heads, num_pages, page_size, head_dim]``;
``k[l]`` is the per-layer layout ``ragged_paged_attention`` reads. Page 0 is a reserved scratch
page: it is never handed to a sequence, and padding tokens / inactive decode slots write there.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float


@jax.tree_util.register_dataclass
@dataclass
class KVCache:
    """Pytree of the paged KV pool (donate it into jitted steps to update it in place).

    Attributes:
      k, v: ``[num_layers, num_kv_heads, num_pages, page_size, head_dim]`` in the model's compute
        dtype; page 0 is scratch.
    """

    k: Float[Array, "L KVH P ps hd"]
    v: Float[Array, "L KVH P ps hd"]

    @classmethod
    def create(cls, *, num_layers: int, num_kv_heads: int, num_pages: int, page_size: int,
               head_dim: int, dtype=jnp.float32) -> "KVCache":
        """Zero-filled pool.

        Raises:
          ValueError: a size is not positive, or ``num_pages < 2`` (page 0 is scratch).
        """
        sizes = dict(num_layers=num_layers, num_kv_heads=num_kv_heads, num_pages=num_pages,
                     page_size=page_size, head_dim=head_dim)
        for name, val in sizes.items():
            if int(val) < 1:
                raise ValueError(f"rhyme_jax/rollout/kv_cache.py: KVCache.{name} must be >= 1, got {val}")
        if num_pages < 2:
            raise ValueError("rhyme_jax/rollout/kv_cache.py: KVCache.num_pages must be >= 2 "
                             f"(page 0 is reserved scratch), got {num_pages}")
        shape = (num_layers, num_kv_heads, num_pages, page_size, head_dim)
        return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]

    @property
    def num_pages(self) -> int:
        return self.k.shape[2]

    @property
    def page_size(self) -> int:
        return self.k.shape[3]

    @property
    def dtype(self):
        return self.k.dtype

    @property
    def nbytes(self) -> int:
        """Device bytes held by the pool (k and v)."""
        return 2 * self.k.size * self.k.dtype.itemsize
