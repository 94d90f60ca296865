"""Paged KV pool of the rollout engine.

One pool holds every layer: ``k, v [num_layers, num_kv_heads, num_pages, page_size, head_dim]``;
``k[l]`` is the per-layer layout ``ragged_paged_attention`` reads. Page 0 is a reserved scratch
page: it is never handed to a sequence, and padding tokens / inactive decode slots write there.

On the CPU backend a bfloat16 pool is stored as its ``uint16`` bits (``storage_dtype``): XLA's CPU
backend scatters and gathers bfloat16 by converting the whole pool to float32 and back, and a
``bitcast_convert`` of a bfloat16 pool inside a pass is itself a pool-sized copy (two a layer, the
pass's writes done as bits). Stored as bits, the pass writes bits in place
(``forward._write_layer``) and the attention's gathers turn only the gathered pages into
bfloat16 (``reference._take_pages``). ``KVCache.dtype`` is the pool's compute dtype either way.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jaxtyping import Array, Shaped

from pallas_kernels.ragged_paged_attention import api as attention_api

BITS = jnp.uint16  # storage of a bfloat16 pool on the CPU backend (``storage_dtype``)


def storage_dtype(dtype) -> jnp.dtype:
    """The dtype a pool of compute ``dtype`` is stored in: ``uint16`` (its bits) for bfloat16 on
    the CPU backend (``attention_api.current_backend()``, so a program lowered for a GPU target
    on a CPU host keeps bfloat16), ``dtype`` otherwise (float32 everywhere; bfloat16 on GPU and
    TPU, whose kernels take the pool itself)."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.bfloat16 and attention_api.current_backend() == "cpu":
        return jnp.dtype(BITS)
    return dtype


@jax.tree_util.register_dataclass
@dataclass
class KVCache:
    """Pytree of the paged KV pool (donate it into jitted steps to update it in place).

    Attributes:
      k, v: ``[num_layers, num_kv_heads, num_pages, page_size, head_dim]`` in the model's compute
        dtype, or for bfloat16 on CPU ``uint16`` holding its bits (``storage_dtype``); page 0 is
        scratch.
    """

    k: Shaped[Array, "L KVH P ps hd"]
    v: Shaped[Array, "L KVH P ps hd"]

    @classmethod
    def create(cls, *, num_layers: int, num_kv_heads: int, num_pages: int, page_size: int,
               head_dim: int, dtype=jnp.float32) -> "KVCache":
        """Zero-filled pool of compute ``dtype``, stored in ``storage_dtype(dtype)``.

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
        store = storage_dtype(dtype)
        return cls(k=jnp.zeros(shape, store), v=jnp.zeros(shape, store))

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
        """The pool's compute dtype (bfloat16 for a pool stored as ``uint16`` bits)."""
        return jnp.dtype(jnp.bfloat16) if self.k.dtype == BITS else self.k.dtype

    @property
    def as_bits(self) -> bool:
        """Whether ``k, v`` hold bfloat16 as ``uint16`` bits (``storage_dtype``)."""
        return self.k.dtype == BITS

    @property
    def nbytes(self) -> int:
        """Device bytes held by the pool (k and v)."""
        return 2 * self.k.size * self.k.dtype.itemsize
