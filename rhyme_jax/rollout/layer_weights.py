"""Per-layer rollout weights: the stacked ``[L, ...]`` block parameters as ``L`` separate arrays.

The trainer keeps one ``DecoderLayer`` whose parameters carry a leading layer axis and runs the
blocks with ``lax.scan`` (``model.transformer.scan_layers``). On XLA's CPU backend a scan reads
each block's weights through a dynamic slice that is materialised as a copy (14 MB a block for
SmolLM2-135M in float32), and the default concurrency-optimised scheduler runs those copies
beside the matrix products, which then share the cores and the memory bandwidth. A decode pass
whose blocks read ``L`` separate weight arrays has no such copies: on a 2-core AMD EPYC a
32-row SmolLM2-shaped decode pass went from 110-114 ms (scan over stacked weights) to 88 ms
(Python loop over per-layer arrays), the gain ``--xla_cpu_enable_concurrency_optimized_scheduler
=false`` gave, without that process-wide flag, which slows the update (docs/results.md).

``split_layers`` makes the rollout layout (one jitted copy of the block weights, after the
engine's dtype cast when there is one; 60-165 ms for SmolLM2 in float32), once per weight version
(``run_weights.rollout_weights``); ``merge_split`` gives the
``Decoder`` whose embedding, final norm and head the paged forward uses and the per-layer
states its layer loop reads (``rollout.forward.paged_forward``). ``use_split`` picks the layout:
``"auto"`` splits on CPU only, blocks of at least ``SPLIT_MIN_LAYER_BYTES`` (on a GPU a dynamic
slice of HBM costs microseconds and the split would hold a second copy of the weights). The
layer loop compiles about 4x slower than a scan (SmolLM2's pass programs: 8-12 s against 2-3 s
on 2 cores); the persistent compile cache (``rhyme_jax.compile_cache``) keeps them across runs.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels.ragged_paged_attention import api as attention_api

LAYOUTS = ("auto", "split", "stacked")
SPLIT_MIN_LAYER_BYTES = 4 << 20  # "auto" splits blocks of at least 4 MiB


class LayerSplit(NamedTuple):
    """A ``Decoder`` state in the rollout's per-layer layout (a pytree).

    Attributes:
      top: the state without its ``layers`` entry (embedding, final norm, head).
      layers: ``L`` one-block states; block ``i``'s leaves are the stacked leaves' row ``i``
        (shapes without the leading ``L``, same dtypes).
    """

    top: nnx.State
    layers: tuple


def layer_bytes(state: nnx.State) -> int:
    """Bytes of one block's weights in ``state`` (stacked ``layers`` leaves over their ``L``)."""
    leaves = jax.tree.leaves(state["layers"])
    return sum(math.prod(x.shape[1:]) * jnp.dtype(x.dtype).itemsize for x in leaves)


def use_split(layout: str, state: nnx.State | None = None) -> bool:
    """Whether the engine runs per-layer weights: ``"split"`` yes, ``"stacked"`` no, ``"auto"``
    when programs are built for the CPU backend (``api.current_backend``: a program lowered for
    CUDA on a CPU host under ``api.target_backend("gpu")`` keeps the stacked weights) and one
    block of ``state`` holds at least ``SPLIT_MIN_LAYER_BYTES`` (below it the slices are cheap
    copies and the extra program arguments cost more: the demo model's 0.8 MB blocks decoded
    3-11% slower split, SmolLM2-135M's 14 MB blocks 1.19-1.41x faster, 2-core AMD EPYC).

    Raises:
      ValueError: ``layout`` is not one of ``LAYOUTS``.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layer_weights={layout!r}: expected one of {list(LAYOUTS)}")
    if layout != "auto":
        return layout == "split"
    return attention_api.current_backend() == "cpu" and (state is None or layer_bytes(state) >= SPLIT_MIN_LAYER_BYTES)


def _split(state: nnx.State) -> LayerSplit:
    layers = state["layers"]
    n = jax.tree.leaves(layers)[0].shape[0]
    top = nnx.State({k: v for k, v in state.items() if k != "layers"})
    return LayerSplit(top, tuple(jax.tree.map(lambda x, i=i: x[i], layers) for i in range(n)))


_split_jit = jax.jit(_split)


def split_layers(state: nnx.State) -> LayerSplit:
    """``state`` (a ``Decoder``'s ``nnx.State`` with stacked ``layers``) in the per-layer layout.

    Array leaves are copied in one jitted call; ``jax.ShapeDtypeStruct`` leaves (an abstract
    state, for lowering) give an abstract split.

    Raises:
      KeyError: ``state`` has no ``layers`` entry.
    """
    if "layers" not in state:
        raise KeyError("split_layers: the state has no 'layers' entry (not a Decoder state)")
    if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(state)):
        return jax.eval_shape(_split, state)
    return _split_jit(state)


def merge_split(graphdef: nnx.GraphDef, split: LayerSplit) -> tuple[Any, tuple]:
    """``(model, layer_states)``: the ``Decoder`` of ``graphdef`` over ``split.top`` (its
    ``layers`` hold abstract stacked shapes: use ``layer_states``, never ``model.layers``'
    values) and ``split.layers``. Call inside ``jax.jit``; nothing is copied."""
    first = split.layers[0]
    n = len(split.layers)
    stacked = jax.tree.map(lambda x: jax.ShapeDtypeStruct((n, *x.shape), x.dtype), first)
    model = nnx.merge(graphdef, nnx.State({**split.top, "layers": stacked}))
    return model, split.layers


__all__ = ["LAYOUTS", "SPLIT_MIN_LAYER_BYTES", "LayerSplit", "layer_bytes", "merge_split", "split_layers",
           "use_split"]
