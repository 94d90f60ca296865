"""Block-sparse causal attention over packed rows, in pure JAX (FlashAttention-2's tiling).

The training forward of a packed buffer (``train/packing.py``: rows back to back, ``segment_ids``
1, 2, ... and 0 for padding) needs, for each query, only the earlier keys of its own segment. The
dense path (``transformer.dense_attention``) computes and stores the whole ``[T, T]`` score
matrix per head: at T = 8,192 that is 256 MiB per head and row in float32, whatever the rows'
real lengths. This op splits the buffer into blocks of ``block`` tokens and visits the pair
(query block i, key block j) only when ``j <= i`` and some segment appears in both blocks, so
compute follows the sum of the segments' squared lengths (at block granularity) and memory is
``O(T * block)`` per head instead of ``O(T^2)``.

Forward: FlashAttention-2 (Dao 2023, arXiv 2307.08691, Algorithm 1): an online softmax over the
visited key blocks, keeping the log-sum-exp per query. Backward: Algorithm 2, recomputing each
visited block's probabilities from the saved log-sum-exp (``jax.custom_vjp``). Skipped blocks
cost a ``lax.switch`` each; a pair below the diagonal whose two blocks lie inside one segment (most
pairs of a long row) builds no mask. The op works head-major (``[B, K, G, T, d]``), so a block's
``[bq, bk]`` scores and probabilities feed every product in the layout they are computed in (on
the CPU, the transposed copies of them cost as much as the products: the update of a logged
ledger step with eight 4,096-token rows took 47.1 s before and 23.4 s after, docs/results.md, "L6
and L7 at commit 7290234"). Values equal the dense path's within float32 rounding
(tests/test_blocked_attention.py).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

_NEG = -1e30  # masked score: finite, so an all-masked block gives exp(0) * 0, not NaN
_BIG = jnp.iinfo(jnp.int32).max


def usable(length: int, block: int) -> bool:
    """Whether ``blocked_attention`` applies to buffers of ``length`` tokens: ``block > 0`` and
    more than one block (otherwise the dense path runs; a partial last block is padded)."""
    return block > 0 and length > block


def _segment_ranges(segments: Int[Array, "B T"], block: int):
    """Per row and block: the smallest and largest non-zero segment id (``[B, n]`` each; a block
    of padding only gets ``lo = int32 max``, ``hi = -1`` so it overlaps nothing)."""
    b, t = segments.shape
    s = segments.reshape(b, t // block, block)
    valid = s != 0
    return jnp.min(jnp.where(valid, s, _BIG), axis=2), jnp.max(jnp.where(valid, s, -1), axis=2)


def _needed(lo, hi, i, j):
    """Whether query block ``i`` and key block ``j`` can share a segment in any row (conservative:
    the id ranges overlap)."""
    return jnp.any((lo[:, i] <= hi[:, j]) & (lo[:, j] <= hi[:, i]))


def _pure(segments: Int[Array, "B T"], block: int):
    """Per row and block (``bool[B, n]``): every token of the block has one and the same non-zero
    segment id."""
    b, t = segments.shape
    s = segments.reshape(b, t // block, block)
    return jnp.all(s == s[:, :, :1], axis=2) & (s[:, :, 0] != 0)


def _kind(lo, hi, pure, i, j):
    """How the pair (query block ``i``, key block ``j <= i``) is visited: 0 skipped (no shared
    segment in any row), 2 whole (``j < i`` and, in every row, both blocks lie inside one and the
    same segment: every score is allowed, so no mask is built), 1 masked (the rest)."""
    whole = (j < i) & jnp.all(pure[:, i] & pure[:, j] & (lo[:, i] == lo[:, j]))
    return jnp.where(_needed(lo, hi, i, j), jnp.where(whole, 2, 1), 0)


def _slice(x, i, block, axis=1):
    return jax.lax.dynamic_slice_in_dim(x, i * block, block, axis=axis)


def _prescaled(q):
    """``(q', post)`` with ``q' . k * post == q . k * hd**-0.5``: float32 queries are scaled once
    (``O(T * hd)``), so no ``[bq, bk]`` pass multiplies scores; other dtypes keep their values and
    scale the float32 scores (``post = hd**-0.5``)."""
    scale = q.shape[-1] ** -0.5
    return (q * scale, 1.0) if q.dtype == jnp.float32 else (q, scale)


def _block_scores(qi, kj, si, sj, i, j, block, post):
    """Float32 scores ``[B, K, G, bq, bk]`` of one block pair (``qi . kj * post``; ``qi``
    ``[B, K, G, bq, d]``, ``kj`` ``[B, K, bk, d]``) and their mask (causal by buffer index, same
    segment, non-padding key)."""
    s = jnp.einsum("bkgqd,bksd->bkgqs", qi, kj, preferred_element_type=jnp.float32)
    if post != 1.0:
        s = s * post
    qpos = i * block + jnp.arange(block)
    kpos = j * block + jnp.arange(block)
    mask = (kpos[None, :] <= qpos[:, None])[None] & (si[:, :, None] == sj[:, None, :]) & (sj[:, None, :] != 0)
    return s, mask[:, None, None]


def _forward(q, k, v, segments, block):
    """Outputs ``f32[B, K, G, T, d]`` and log-sum-exp ``f32[B, K, G, T]`` (0 where a query has no
    allowed key; its output is 0) of head-major ``q`` ``[B, K, G, T, d]``, ``k`` and ``v``
    ``[B, K, T, d]``."""
    b, kh, g, t, d = q.shape
    n = t // block
    lo, hi = _segment_ranges(segments, block)
    pure = _pure(segments, block)
    q, post = _prescaled(q)

    def query_block(i):
        qi, si = _slice(q, i, block, axis=3), _slice(segments, i, block)

        def update(j, carry, masked: bool):
            m, l, acc = carry
            s, mask = _block_scores(qi, _slice(k, j, block, axis=2), si, _slice(segments, j, block), i, j, block,
                                    post)
            if masked:
                s = jnp.where(mask, s, _NEG)
            m_new = jnp.maximum(m, s.max(-1))
            m_ref = jnp.where(m_new == _NEG, 0.0, m_new)  # a query with no allowed key yet: exp(_NEG) = 0
            p = jnp.exp(s - m_ref[..., None])
            corr = jnp.exp(m - m_ref)
            pv = jnp.einsum("bkgqs,bksd->bkgqd", p.astype(v.dtype), _slice(v, j, block, axis=2),
                            preferred_element_type=jnp.float32)
            return m_new, l * corr + p.sum(-1), acc * corr[..., None] + pv

        def visit(j, carry):
            return jax.lax.switch(_kind(lo, hi, pure, i, j), [lambda c: c, partial(update, j, masked=True),
                                                               partial(update, j, masked=False)], carry)

        init = (jnp.full((b, kh, g, block), _NEG, jnp.float32), jnp.zeros((b, kh, g, block), jnp.float32),
                jnp.zeros((b, kh, g, block, d), jnp.float32))
        m, l, acc = jax.lax.fori_loop(0, i + 1, visit, init)
        some = l > 0
        safe_l = jnp.where(some, l, 1.0)
        out = jnp.where(some[..., None], acc / safe_l[..., None], 0.0)
        return out, jnp.where(some, m + jnp.log(safe_l), 0.0)

    out, lse = jax.lax.map(query_block, jnp.arange(n))          # [n, B, K, G, bq, (d)]
    out = jnp.transpose(out, (1, 2, 3, 0, 4, 5)).reshape(b, kh, g, t, d)
    lse = jnp.transpose(lse, (1, 2, 3, 0, 4)).reshape(b, kh, g, t)
    return out, lse


def _backward(q, k, v, segments, out, lse, dout, block):
    """Cotangents of q, k, v (float32) by FlashAttention-2's Algorithm 2 over the visited blocks.
    ``dk`` and ``dv`` accumulate as ``[B, K, d, bk]`` (the ``[bq, bk]`` probabilities enter their
    products in the layout they are computed in; no transposed copy of them)."""
    b, kh, g, t, d = q.shape
    n = t // block
    scale = d ** -0.5
    lo, hi = _segment_ranges(segments, block)
    pure = _pure(segments, block)
    qs, post = _prescaled(q)
    dout = dout.astype(jnp.float32)
    delta = jnp.sum(dout * out, axis=-1)  # [B, K, G, T]

    def key_block(dq, j):
        kj, vj, sj = _slice(k, j, block, axis=2), _slice(v, j, block, axis=2), _slice(segments, j, block)

        def update(i, carry, masked: bool):
            dq, dk, dv = carry
            qi, doi = _slice(qs, i, block, axis=3), _slice(dout, i, block, axis=3)
            s, mask = _block_scores(qi, kj, _slice(segments, i, block), sj, i, j, block, post)
            if masked:  # a query with no allowed key has lse 0: exp(_NEG) = 0
                s = jnp.where(mask, s, _NEG)
            p = jnp.exp(s - _slice(lse, i, block, axis=3)[..., None])
            dv = dv + jnp.einsum("bkgqd,bkgqs->bkds", doi, p)
            dp = jnp.einsum("bkgqd,bksd->bkgqs", doi, vj.astype(jnp.float32))
            ds = p * (dp - _slice(delta, i, block, axis=3)[..., None])  # dL/ds of the softmax scores s
            dq_i = jnp.einsum("bkgqs,bksd->bkgqd", ds, kj.astype(jnp.float32)) * scale
            dq = jax.lax.dynamic_update_slice_in_dim(dq, _slice(dq, i, block, axis=3) + dq_i, i * block, axis=3)
            dk = dk + jnp.einsum("bkgqd,bkgqs->bkds", qi.astype(jnp.float32), ds) * post
            return dq, dk, dv

        def visit(i, carry):
            return jax.lax.switch(_kind(lo, hi, pure, i, j), [lambda c: c, partial(update, i, masked=True),
                                                               partial(update, i, masked=False)], carry)

        zeros = jnp.zeros((b, kh, d, block), jnp.float32)
        dq, dk, dv = jax.lax.fori_loop(j, n, visit, (dq, zeros, zeros))
        return dq, (dk, dv)

    dq, (dk, dv) = jax.lax.scan(key_block, jnp.zeros(q.shape, jnp.float32), jnp.arange(n))
    unstack = lambda x: jnp.transpose(x, (1, 2, 0, 4, 3)).reshape(b, kh, t, d)  # noqa: E731  [n,B,K,d,bk]
    return dq, unstack(dk), unstack(dv)


@partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attention(q, k, v, segments, block):
    out, _ = _forward(q, k, v, segments, block)
    return out.astype(v.dtype)


def _attention_fwd(q, k, v, segments, block):
    out, lse = _forward(q, k, v, segments, block)
    return out.astype(v.dtype), (q, k, v, segments, out, lse)


def _attention_bwd(block, residuals, dout):
    q, k, v, segments, out, lse = residuals
    dq, dk, dv = _backward(q, k, v, segments, out, lse, dout, block)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_attention.defvjp(_attention_fwd, _attention_bwd)


def blocked_attention(q: Float[Array, "B T H hd"], k: Float[Array, "B T KVH hd"], v: Float[Array, "B T KVH hd"],
                      segments: Int[Array, "B T"], block: int) -> Float[Array, "B T H hd"]:
    """Causal attention within segments, computed block by block (differentiable).

    Args:
      q, k, v: queries and keys/values of one buffer (GQA: query head ``h`` reads KV head
        ``h // (H // KVH)``); scores ``q.k * hd**-0.5`` and the softmax in float32.
      segments: int32 segment id per token; a query attends to keys at or before it with the same
        id; 0 = padding (never attended; a padding query's output is 0).
      block: tokens per block; a ``T`` that is not a multiple of it is padded up to one inside
        (padding keys are never attended, padding queries dropped).

    Returns:
      ``[B, T, H, hd]`` in ``v.dtype``: equal to ``dense_attention`` with the same mask at every
      query that has an allowed key.

    Raises:
      ValueError: ``block < 1``, or ``k``'s length differs from ``q``'s.
    """
    b, t, h, hd = q.shape
    if k.shape[1] != t or block < 1:
        raise ValueError(f"blocked_attention: {t} queries and {k.shape[1]} keys must be equal, block {block} >= 1")
    kvh = k.shape[2]
    pad = -t % block
    if pad:
        widen = lambda x: jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))  # noqa: E731
        q, k, v, segments = widen(q), widen(k), widen(v), widen(segments)
    heads = lambda x: jnp.moveaxis(x, 1, -2)  # noqa: E731  [B, T, ..., hd] -> [B, ..., T, hd]
    qh = heads(q.reshape(b, t + pad, kvh, h // kvh, hd))
    out = _attention(qh, heads(k), heads(v), segments.astype(jnp.int32), int(block))  # [B, K, G, T, hd]
    return jnp.moveaxis(out, -2, 1).reshape(b, t + pad, h, hd)[:, :t]
