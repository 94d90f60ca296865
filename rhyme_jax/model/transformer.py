"""Decoder-only transformer (Qwen2 / Qwen3 / Llama) in Flax NNX, dense causal attention.

The forward is composed from public parts so the rollout engine's paged forward is the same
computation with a different attention op::

    h = model.embed_tokens(tokens)
    for each layer (scan_layers over the stacked model.layers):
        x = layer.input_norm(h)
        q, k, v = layer.attn.project_qkv(x, positions)
        o = attention(q, k, v)                       # scale head_dim ** -0.5, causal, GQA
        h = h + layer.attn.project_out(o)
        h = h + layer.mlp(layer.post_attn_norm(h))
    logits = model.unembed(h)                        # final_norm + lm_head (or tied), float32

The ``num_layers`` blocks are ONE ``DecoderLayer`` whose parameters carry a leading layer axis
(``layers.attn.q_proj.kernel: [L, D, H*hd]``); the forward runs them with ``jax.lax.scan``
(``scan_layers``), so XLA compiles one block whatever the depth (MaxText's ``scan_layers``).
``remat=True`` rematerialises each block in the backward pass (only the residual stream between
blocks is kept: ``jax.checkpoint`` of the scan body).

Reference: HF ``modeling_llama.py`` / ``modeling_qwen2.py`` / ``modeling_qwen3.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from rhyme_jax.model.blocked_attention import blocked_attention, usable
from rhyme_jax.model.config import ModelConfig
from rhyme_jax.model.layers import INIT_STD, MLP, Attention, RMSNorm, linear
from rhyme_jax.parallel.rules import constrain

NEG_INF = float(jnp.finfo(jnp.float32).min)


def dense_attention(q: Float[Array, "B T H hd"], k: Float[Array, "B S KVH hd"], v: Float[Array, "B S KVH hd"],
                    allowed: Bool[Array, "B T S"]) -> Float[Array, "B T H hd"]:
    """Softmax attention with GQA (query head ``h`` reads KV head ``h // (H // KVH)``).

    Scores ``q.k * hd**-0.5`` and the softmax are float32; probabilities are cast to ``v.dtype``
    for the value product (HF eager attention). Disallowed keys get the float32 minimum, so a
    query with no allowed key yields a finite (uniform) average instead of NaN.
    """
    b, t, h, hd = q.shape
    kvh = k.shape[2]
    qg = q.reshape(b, t, kvh, h // kvh, hd)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * (hd ** -0.5)
    scores = jnp.where(allowed[:, None, None, :, :], scores, NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
    return out.reshape(b, t, h, hd)


class DecoderLayer(nnx.Module):
    """Pre-norm block: ``h + attn(input_norm(h))`` then ``h + mlp(post_attn_norm(h))``."""

    def __init__(self, cfg: ModelConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, param_dtype=param_dtype)
        self.attn = Attention(cfg, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, param_dtype=param_dtype)
        self.mlp = MLP(cfg, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, h: Float[Array, "B T D"], positions: Int[Array, "B T"],
                 allowed: Bool[Array, "B T T"]) -> Float[Array, "B T D"]:
        """One block with dense attention restricted to ``allowed[b, query, key]``."""
        return self.apply(h, positions, lambda q, k, v: dense_attention(q, k, v, allowed))

    def apply(self, h: Float[Array, "B T D"], positions: Int[Array, "B T"], attend) -> Float[Array, "B T D"]:
        """One block whose attention is ``attend(q, k, v) -> [B, T, H, hd]`` (dense or blocked)."""
        q, k, v = self.attn.project_qkv(self.input_norm(h), positions)
        h = h + self.attn.project_out(attend(q, k, v))
        return h + self.mlp(self.post_attn_norm(h))


def stack_layers(layers: list[DecoderLayer]) -> DecoderLayer:
    """One ``DecoderLayer`` whose every parameter is the per-layer parameters stacked on a new
    leading axis (``[L, ...]``). Raises ValueError on an empty list."""
    if not layers:
        raise ValueError("stack_layers: no layers")
    graphdef, first = nnx.split(layers[0])
    states = [first] + [nnx.split(layer)[1] for layer in layers[1:]]
    return nnx.merge(graphdef, jax.tree.map(lambda *xs: jnp.stack(xs), *states))


def layer_at(layers: DecoderLayer, index: int) -> DecoderLayer:
    """Block ``index`` of a stacked ``DecoderLayer`` as a standalone one-layer module (a copy of
    the parameters' row ``index``; for tests and inspection)."""
    graphdef, params = nnx.split(layers)
    return nnx.merge(graphdef, jax.tree.map(lambda x: x[index], params))


def scan_layers(layers: DecoderLayer, h: Float[Array, "..."], step, extra=None, *, remat: bool = False,
                unroll: int = 1, per_layer=None):
    """Run a stacked ``DecoderLayer`` over ``h`` with ``jax.lax.scan``.

    ``step(layer, h, index, extra) -> (h, extra)`` applies one block (``layer`` is a one-layer
    view merged from the stacked parameters' slice ``index``); ``extra`` is carried state (e.g.
    the paged KV pool). With ``remat`` the step is ``jax.checkpoint``-ed: its activations are
    recomputed in the backward pass instead of stored. ``unroll`` blocks run per scan iteration
    (``jax.lax.scan(unroll=)``): 1 compiles one block whatever the depth; ``>= L`` unrolls fully.
    ``per_layer``: the blocks' parameters as ``L`` separate one-block states (the rollout's
    layout, ``rollout.layer_weights``) instead of ``layers``' stacked values: a Python loop runs
    them in order with ``index`` a Python int (no scan, no weight slices).

    Returns ``(h, extra)`` after the last layer.
    """
    graphdef, params = nnx.split(layers)
    if per_layer is not None:
        carry = (h, extra)
        for index, p in enumerate(per_layer):
            carry = step(nnx.merge(graphdef, p), carry[0], index, carry[1])
        return carry
    n = jax.tree.leaves(params)[0].shape[0]

    def body(carry, xs):
        p, index = xs
        out = step(nnx.merge(graphdef, p), carry[0], index, carry[1])
        return out, None

    if remat:
        body = jax.checkpoint(body)
    (h, extra), _ = jax.lax.scan(body, (h, extra), (params, jnp.arange(n, dtype=jnp.int32)),
                                 unroll=max(1, min(int(unroll), n)))
    return h, extra


class Decoder(nnx.Module):
    """Causal LM: embedding, ``num_layers`` ``DecoderLayer``s, final RMSNorm, output head.

    Args:
      cfg: architecture.
      dtype: compute dtype (``jnp.float32`` / ``jnp.bfloat16`` or their names).
      param_dtype: storage dtype of the parameters.
      rngs: initialisation randomness; weights ~ N(0, 0.02^2), biases 0, norms 1.

    ``lm_head`` is ``None`` when ``cfg.tie_word_embeddings`` (logits = h @ embed.embedding.T).
    ``layers`` is one ``DecoderLayer`` with ``[num_layers, ...]`` parameters, initialised layer by
    layer in order from ``rngs`` (the same values as ``num_layers`` separate blocks).
    ``scan_unroll`` (``model.scan_unroll``): blocks per ``lax.scan`` iteration in every forward
    (training and rollout); 1 = compile time independent of depth, ``>= num_layers`` = unrolled
    (a few small blocks run faster unrolled on CPU). A plain attribute: set it after loading.
    ``attention_block`` (``model.attention_block``): in ``hidden`` (training and scoring), buffers
    longer than this many tokens use ``blocked_attention`` (block-sparse
    over segments, O(T * block) memory) instead of the dense ``[T, T]`` scores; 0 = always dense.
    A plain attribute too.
    """

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs,
                 scan_unroll: int = 1, attention_block: int = 0):
        dtype, param_dtype = jnp.dtype(dtype), jnp.dtype(param_dtype)
        self.cfg = cfg
        self.scan_unroll = int(scan_unroll)
        self.attention_block = int(attention_block)
        self.dtype = dtype
        self.embed = nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, param_dtype=param_dtype,
                               embedding_init=nnx.initializers.normal(INIT_STD), rngs=rngs)
        self.layers = stack_layers([DecoderLayer(cfg, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
                                    for _ in range(cfg.num_layers)])
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, param_dtype=param_dtype)
        self.lm_head = None if cfg.tie_word_embeddings else linear(
            cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def embed_tokens(self, tokens: Int[Array, "..."]) -> Float[Array, "... D"]:
        """Embedding rows of ``tokens`` in the compute dtype."""
        return self.embed(tokens).astype(self.dtype)

    def unembed(self, h: Float[Array, "... D"]) -> Float[Array, "... V"]:
        """``final_norm`` then the output head; the matmul accumulates and returns float32."""
        x = self.final_norm(h).astype(self.dtype)
        if self.lm_head is None:
            w = self.embed.embedding[...].astype(self.dtype).T
        else:
            w = self.lm_head.kernel[...].astype(self.dtype)
        return jnp.matmul(x, w, preferred_element_type=jnp.float32)

    def hidden(self, tokens: Int[Array, "B T"], positions: Int[Array, "B T"],
               mask: Bool[Array, "B T"] | None = None, *, remat: bool = False,
               segment_ids: Int[Array, "B T"] | None = None) -> Float[Array, "B T D"]:
        """Residual stream after the last block (before ``final_norm``), compute dtype.

        Args:
          tokens: token ids.
          positions: RoPE positions (normally ``arange(T)`` per row; per segment when packed).
          mask: True at valid tokens; padded keys are never attended. None = all valid.
          segment_ids: packed rows (``train/packing.py``): a query attends only to earlier keys
            of its own segment; 0 marks padding. None = one sequence per row.
          remat: recompute each block in the backward pass (activation memory: one ``[B, T, D]``
            per layer instead of every intermediate).

        Raises:
          ValueError: tokens / positions / mask shapes differ or are not 2-D.
        """
        if tokens.ndim != 2 or positions.shape != tokens.shape or (mask is not None and mask.shape != tokens.shape):
            raise ValueError(
                f"Decoder.__call__: tokens {tokens.shape}, positions {positions.shape}, "
                f"mask {None if mask is None else mask.shape} must all be the same [B, T]")
        attend = self._attention_op(tokens.shape, mask, segment_ids)
        # Under parallel.rules.activation_mesh the residual stream stays split by rows (FSDP
        # gathers parameters, not activations); without it these are no-ops.
        h = constrain(self.embed_tokens(tokens), ("batch", None, None))

        def block(layer, h, index, extra):
            return constrain(layer.apply(h, positions, attend), ("batch", None, None)), extra

        h, _ = scan_layers(self.layers, h, block, remat=remat, unroll=self.scan_unroll)
        return h

    def _attention_op(self, shape, mask, segment_ids):
        """``attend(q, k, v)`` for ``hidden``: causal, within ``segment_ids``, never to a masked
        key; blocked (``attention_block``) when the buffer length allows it, else dense."""
        b, t = shape
        block = self.attention_block
        if usable(t, block):
            segments = jnp.ones(shape, jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
            if mask is not None:
                segments = jnp.where(mask.astype(bool), segments, 0)
            return lambda q, k, v: blocked_attention(q, k, v, segments, block)
        allowed = jnp.tril(jnp.ones((t, t), bool))[None]
        if segment_ids is not None:
            allowed = allowed & (segment_ids[:, :, None] == segment_ids[:, None, :])
        if mask is not None:
            allowed = allowed & mask[:, None, :].astype(bool)
        elif segment_ids is None:
            allowed = jnp.broadcast_to(allowed, (b, t, t))
        return lambda q, k, v: dense_attention(q, k, v, allowed)

    def __call__(self, tokens: Int[Array, "B T"], positions: Int[Array, "B T"],
                 mask: Bool[Array, "B T"] | None = None) -> Float[Array, "B T V"]:
        """Logits ``f32[B, T, V]`` of a (right-padded) batch with dense causal attention.

        Args:
          tokens: token ids.
          positions: RoPE positions (normally ``arange(T)`` per row).
          mask: True at valid tokens; padded keys are never attended. Logits at padded positions
            are finite but meaningless. None = all valid.

        Raises:
          ValueError: tokens / positions / mask shapes differ or are not 2-D.
        """
        h = self.hidden(tokens, positions, mask)
        return constrain(self.unembed(h), ("batch", None, "vocab"))
