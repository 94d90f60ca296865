"""Paged forward pass of the policy over a ragged batch of new tokens (prefill, decode, verify).

Built from the model parts of ``rhyme_jax.model.transformer.Decoder`` (same composition as its
dense ``__call__``)::

    h = embed_tokens(t)
    for layer (scan_layers): x = input_norm(h); q, k, v = attn.project_qkv(x, pos)
               write k, v into the paged pool; o = ragged_paged_attention(q, pool, layer)
               h = h + attn.project_out(o); h = h + mlp(post_attn_norm(h))
    logits = unembed(h[logits_rows])

Pure function of ``(graphdef, state, kv, ...)``: call it inside ``jax.jit`` with ``graphdef``
static and ``kv`` donated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from pallas_kernels.ragged_paged_attention import api as attention_api
from rhyme_jax.model.transformer import scan_layers
from rhyme_jax.rollout.kv_cache import BITS, KVCache
from rhyme_jax.rollout.layer_weights import LayerSplit, merge_split


@jax.tree_util.register_dataclass
@dataclass
class RaggedMeta:
    """Ragged batch metadata (the attention reference's layout), all int32.

    Attributes:
      kv_lens: ``[S]`` cached tokens per sequence including the new ones.
      page_indices: ``[S, pages_per_seq]`` page table rows (unused entries 0).
      cu_q_lens: ``[S+1]`` cumulative new-token counts.
      num_seqs: ``[1]`` live sequences.
      slot_mapping: ``[T]`` flat KV slot ``page * page_size + offset`` of each new token
        (padding tokens: a slot in scratch page 0).
    """

    kv_lens: Int[Array, "S"]
    page_indices: Int[Array, "S pps"]
    cu_q_lens: Int[Array, "S+1"]
    num_seqs: Int[Array, "1"]
    slot_mapping: Int[Array, "T"]


def _write_layer(pool: jax.Array, layer, new: jax.Array, slots: jax.Array, dtype) -> jax.Array:
    """Scatter ``new [T, KVH, hd]`` into ``pool [L, KVH, P, ps, hd]`` at layer ``layer`` (an int
    or an int32 scalar: the scan's layer index) at flat slots ``page * page_size + offset``, cast
    to the pool's compute ``dtype`` (written as ``uint16`` bits into a pool stored so).

    Indexed by (page, offset) on the pool's own shape, never through a flat reshape: a 1-token
    write becomes a dynamic-update-slice, and with a reshape around it XLA fused it into two
    consumers of different shapes and copied the whole donated pool six times per layer (the
    1-row decode of SmolLM2 took 5 s a pass on CPU instead of 0.08 s;
    ``tests/test_rollout_engine.py::test_decode_programs_update_the_kv_pool_in_place``)."""
    ps = pool.shape[3]
    new = new.astype(dtype)
    if pool.dtype == BITS:  # a bfloat16 pool stored as its bits (kv_cache.storage_dtype): exact overwrite
        new = jax.lax.bitcast_convert_type(new, BITS)
    # advanced index dims lead: [T, KVH, hd]
    return pool.at[layer, :, slots // ps, slots % ps].set(new)


def paged_forward(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    kv: KVCache,
    tokens: Int[Array, "T"],
    positions: Int[Array, "T"],
    meta: RaggedMeta,
    *,
    max_q_len: int,
    logits_rows: Int[Array, "S"],
    attention_impl: str | Sequence[str] = "reference",
    mesh: jax.sharding.Mesh | None = None,
) -> tuple[Float[Array, "S V"], KVCache]:
    """Run the decoder on packed new tokens, reading and extending the paged KV pool.

    Args:
      graphdef, state: ``nnx.split`` of a ``Decoder``; ``state`` may be in the per-layer layout
        (``layer_weights.LayerSplit``: the blocks run in a Python loop over separate weights).
      kv: the pool; the new tokens' K/V are written at ``meta.slot_mapping`` in every layer.
      tokens, positions: ``i32[T]`` packed new tokens and their absolute positions.
      meta: ragged metadata of the batch.
      max_q_len: static bound on any sequence's number of new tokens.
      logits_rows: ``i32[S']`` packed rows whose logits are returned (e.g. each sequence's last).
      attention_impl: ``ragged_paged_attention`` implementation name (or ordered list).
      mesh: if given, the attention op runs inside ``shard_map`` over it (heads and the KV
        pool's KV heads split over its ``tensor`` axis; ``api.sharded_ragged_paged_attention``).

    Returns:
      ``(logits f32[S', V], updated kv)``.
    """
    if isinstance(state, LayerSplit):
        model, per_layer = merge_split(graphdef, state)
    else:
        model, per_layer = nnx.merge(graphdef, state), None
    if kv.as_bits and attention_api.current_backend() != "cpu":
        raise ValueError(f"rhyme_jax/rollout/forward.py: a KV pool stored as uint16 bits (made on the CPU "
                         f"backend, kv_cache.storage_dtype) cannot run on {attention_api.current_backend()!r}")
    head_dim = model.cfg.head_dim
    h = model.embed_tokens(tokens)  # [T, D]
    kw = dict(sm_scale=head_dim ** -0.5, max_q_len=max_q_len, implementation=attention_impl)

    def block(layer, h, li, pools):
        k_pool, v_pool = pools
        x = layer.input_norm(h)
        q, k, v = layer.attn.project_qkv(x, positions)  # [T,H,hd], [T,KVH,hd], [T,KVH,hd]
        k_pool = _write_layer(k_pool, li, k, meta.slot_mapping, kv.dtype)
        v_pool = _write_layer(v_pool, li, v, meta.slot_mapping, kv.dtype)
        # the whole stacked pool and the layer index, never k_pool[li]: a kernel operand sliced
        # from the loop-carried pool is a copy per layer (api.ragged_paged_attention, layer=)
        args = (q, k_pool, v_pool, meta.kv_lens, meta.page_indices, meta.cu_q_lens, meta.num_seqs)
        if mesh is None:
            o = attention_api.ragged_paged_attention(*args, layer=li, **kw)
        else:
            o = attention_api.sharded_ragged_paged_attention(mesh, *args, layer=li, **kw)
        h = h + layer.attn.project_out(o.astype(h.dtype))
        return h + layer.mlp(layer.post_attn_norm(h)), (k_pool, v_pool)

    h, (k_pool, v_pool) = scan_layers(model.layers, h, block, (kv.k, kv.v), unroll=model.scan_unroll,
                                    per_layer=per_layer)
    logits = model.unembed(h[logits_rows]).astype(jnp.float32)
    return logits, KVCache(k=k_pool, v=v_pool)
