"""The engine's jitted forward passes: paged forward + on-device sampling, pure functions of their inputs.

``prefill_pass`` (prefill: one sampled token per sequence) and ``verify_pass`` (decode and
HistoSpec verification: every sequence feeds its pending token plus its draft, packed back to
back; decode is the same pass with one token per row) are jitted once at module level with
``static`` (graphdef + state treedef) and the shape-like ``max_q_len`` / sampling ``mode`` /
``attention_impl`` static, and the KV pool donated. No ``nnx.jit`` graph traversal happens per call: the state travels as flat leaves.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from rhyme_jax.rollout.forward import paged_forward
from rhyme_jax.rollout.sampling import sample_at
from rhyme_jax.rollout.verification import verify_packed


class StaticModel:
    """Hashable ``(graphdef, state treedef)`` with a cached hash.

    ``jax.jit`` hashes static arguments on every call and hashing a GraphDef walks the whole
    module graph; caching it keeps per-step host overhead O(1).
    """

    __slots__ = ("value", "_hash")

    def __init__(self, graphdef, treedef):
        self.value = (graphdef, treedef)
        self._hash = hash(self.value)

    def __hash__(self):
        return self._hash

    def __eq__(self, other):
        return isinstance(other, StaticModel) and (self.value is other.value or self.value == other.value)


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("max_q_len", "mode", "attention_impl", "mesh"),
                   donate_argnums=(2,))
def prefill_pass(static: StaticModel, leaves, kv, tokens: Int[Array, "T"], positions: Int[Array, "T"], meta,
                 logits_rows: Int[Array, "S"], streams: Int[Array, "T"], key, temperature: Float[Array, ""],
                 top_k: Int[Array, ""], top_p: Float[Array, ""], *, max_q_len: int, mode: str,
                 attention_impl: str, mesh=None):
    """One forward pass + sampling of each sequence's next token (``sampling.sample_at``: the
    draw of the token after position ``positions[r]`` of sequence ``streams[r]`` at every logits
    row ``r``, from the rollout ``key``).

    Returns:
      ``(tokens i32[S], behaviour logprobs f32[S], updated kv)``.
    """
    graphdef, treedef = static.value
    state = jax.tree.unflatten(treedef, leaves)
    logits, kv = paged_forward(graphdef, state, kv, tokens, positions, meta, max_q_len=max_q_len,
                               logits_rows=logits_rows, attention_impl=attention_impl, mesh=mesh)
    toks, lps = sample_at(logits, key, streams[logits_rows], positions[logits_rows], temperature, top_k, top_p,
                          mode=mode)
    return toks, lps, kv


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("max_q_len", "mode", "attention_impl", "mesh"),
                   donate_argnums=(2,))
def verify_pass(static: StaticModel, leaves, kv, tokens: Int[Array, "T"], positions: Int[Array, "T"], meta,
                streams: Int[Array, "T"], key, temperature: Float[Array, ""], top_k: Int[Array, ""],
                top_p: Float[Array, ""], *, max_q_len: int, mode: str, attention_impl: str, mesh=None):
    """One forward pass over the packed ``[pending token + draft]`` of every row, then lossless
    verification over the packed rows (``rhyme_jax.rollout.verification.verify_packed``), coupled
    to plain sampling through the per-position draws of the rollout ``key`` (``streams``: the
    sequence of each packed token), so it emits what plain decode would. Plain decode is the same
    program with one token per row (``max_q_len = 1``); a row's draft length is its query length
    minus one (``meta.cu_q_lens``), so drafts add no dimension to the shape.

    Returns:
      ``(tokens i32[T], behaviour logprobs f32[T], num_emitted i32[S], updated kv)``: row ``s``
      emits ``tokens[cu[s] : cu[s] + num_emitted[s]]``.
    """
    graphdef, treedef = static.value
    state = jax.tree.unflatten(treedef, leaves)
    rows = jnp.arange(tokens.shape[0], dtype=jnp.int32)
    logits, kv = paged_forward(graphdef, state, kv, tokens, positions, meta, max_q_len=max_q_len,
                               logits_rows=rows, attention_impl=attention_impl, mesh=mesh)
    toks, lps, n = verify_packed(logits, tokens, meta.cu_q_lens, key, temperature, top_k, top_p, mode=mode,
                                 streams=streams, positions=positions)
    return toks, lps, n, kv
