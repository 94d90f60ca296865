"""Lossless verification of history drafts (HistoSpec: docs/architecture.md, "HistoSpec in one paragraph").

Each sequence ``s`` fed ``1 + draft_lens[s]`` tokens (its pending token, then its draft) to one
forward pass, which gives target logits at ``K + 1`` positions. Verification emits between 1 and
``draft_lens[s] + 1`` tokens whose joint distribution is exactly that of plain token-by-token
sampling (speculative sampling with a one-hot draft distribution; Leviathan et al. 2023,
Chen et al. 2023, RhymeRL section 4):

* target distribution ``p_i`` at position ``i``: the processed distribution of
  ``rhyme_jax.rollout.sampling`` (temperature, then top-k, then top-p) -- the same program plain
  sampling uses;
* accept draft token ``x_i`` with probability ``p_i(x_i)`` (``u_i < p_i(x_i)``, ``u_i ~ U[0, 1)``);
* at the first rejection ``i`` emit a token from ``p_i`` with ``x_i`` removed and renormalised
  (the residual ``max(0, p_i - onehot(x_i))``), and stop;
* if all ``d`` draft tokens are accepted, emit a bonus token from ``p_d``;
* greedy (temperature 0): accept while ``x_i == argmax`` of the raw logits; the emitted token at
  the first mismatch (or the bonus) is the argmax itself.

Why it is exact: position ``i`` emits ``x_i`` with probability ``p_i(x_i)`` and any ``y != x_i``
with probability ``(1 - p_i(x_i)) * p_i(y) / (1 - p_i(x_i)) = p_i(y)``.

Emitted tokens carry the behaviour logprob plain sampling reports
(``sampling.behaviour_logprobs``): the token's logprob under ``softmax(logits / temperature)``
without the top-k / top-p filter (what the GRPO loss scores; not ``p_i`` and not the residual),
and ``log_softmax(raw logits)`` when greedy.

The dense reference that draws that way (drafts as a ``K`` dimension) lives with the tests
(tests/verify_reference.py). ``verify_packed`` (what the engine runs) couples the same rule to
plain sampling: it computes at every position the token plain decode would draw
there (the position's own draw, ``sampling.position_noise``), accepts a draft token iff it is
that token and emits that token at the first mismatch. A one-hot draft is accepted with
probability ``p_i(x_i)`` either way and the emitted tokens are exactly plain sampling's, so a
rollout with drafts emits the tokens plain decode emits with the same key.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from rhyme_jax.rollout.sampling import (MODES, SamplingError, _processed, behaviour_logprobs, position_noise,
                                        sample_tokens)


def _row_of(cu: Int[Array, "S1"], t_total: int) -> Int[Array, "T"]:
    """Row of every packed position: ``#{s : cu[s + 1] <= pos}`` clipped to ``[0, S - 1]`` (the
    same as ``searchsorted(cu[1:], pos, side="right")``, written as one compare-and-count so it
    compiles to a single fused kernel rather than a binary-search loop)."""
    pos = jnp.arange(t_total, dtype=jnp.int32)
    row = jnp.sum((cu[None, 1:] <= pos[:, None]).astype(jnp.int32), axis=1)
    return jnp.clip(row, 0, cu.shape[0] - 2).astype(jnp.int32)


def verify_packed(
    logits: Float[Array, "T V"],
    fed: Int[Array, "T"],
    cu_q_lens: Int[Array, "S1"],
    key: PRNGKeyArray,
    temperature,
    top_k=0,
    top_p=1.0,
    *,
    mode: str,
    streams: Int[Array, "T"] | None = None,
    positions: Int[Array, "T"] | None = None,
) -> tuple[Int[Array, "T"], Float[Array, "T"], Int[Array, "S"]]:
    """Verification over packed rows (drafts are query tokens, not a ``K`` dimension), coupled
    to plain sampling.

    Row ``s`` owns packed positions ``cu_q_lens[s] : cu_q_lens[s + 1]`` (``q_len = 1 + d`` with
    ``d`` draft tokens; ``q_len = 0`` for padding rows): it fed its pending token then its draft
    ``fed[cu + 1 : cu + 1 + d]``, and ``logits[cu + j]`` is the target distribution of the token
    after fed token ``j``. At every packed position ``t`` the token plain sampling would draw is
    ``y_t = sampling.sample_tokens`` of the processed distribution with the draw
    ``sampling.position_noise(key, streams[t], positions[t], V)``; draft token ``j`` is accepted
    iff it equals ``y`` at the position before it, and the row emits ``y`` at its first
    ``num_acc + 1`` positions (the accepted drafts, then the correction or bonus token). Each
    ``y_t`` is an exact draw from ``p_t`` with a draw that depends on nothing but the sequence and
    position, and a draft is a function of the tokens before it, so the emitted tokens are exactly
    those plain decode emits with the same key (speculative sampling with one-hot drafts, coupled
    through the draw; a one-hot draft ``x`` is accepted with probability ``p_t(x)``). Greedy:
    ``y`` is the argmax of the raw logits.

    Args:
      logits: ``f32[T, V]`` raw target logits of every packed position (padding rows ignored).
      fed: ``i32[T]`` tokens fed to the forward pass.
      cu_q_lens: ``i32[S+1]`` cumulative query lengths (``cu[0] = 0``, nondecreasing).
      key: PRNG key of this forward pass.
      temperature, top_k, top_p: sampling parameters (Python numbers or traced scalars).
      mode: sampling program (``rhyme_jax.rollout.sampling.MODES``); static under jit.
      streams: ``i32[T]`` sequence (request) of each packed token; default: its row.
      positions: ``i32[T]`` sequence position of each fed token; default: ``arange(T)``.

    Returns:
      ``(tokens i32[T], logprobs f32[T], num_emitted i32[S])``: row ``s`` emits
      ``tokens[cu[s] : cu[s] + num_emitted[s]]`` with behaviour logprobs at the same positions;
      ``num_emitted`` is 0 for padding rows, else in ``[1, d + 1]``; other entries are 0.

    Raises:
      SamplingError: unknown ``mode`` or inconsistent shapes.
    """
    if mode not in MODES:
        raise SamplingError(f"verify_packed: mode must be one of {MODES}, got {mode!r}")
    t_total = logits.shape[0]
    num_s = cu_q_lens.shape[0] - 1
    if fed.shape != (t_total,) or cu_q_lens.ndim != 1:
        raise SamplingError(f"verify_packed: fed must be [T={t_total}] and cu_q_lens [S+1], got "
                            f"{fed.shape} and {cu_q_lens.shape}")
    logits = logits.astype(jnp.float32)
    lp = _processed(logits, temperature, top_k, top_p, mode)  # [T, V]
    cu = cu_q_lens.astype(jnp.int32)
    q_lens = cu[1:] - cu[:-1]  # [S]
    lens = jnp.maximum(q_lens - 1, 0)  # draft tokens per row
    pos = jnp.arange(t_total, dtype=jnp.int32)
    row = _row_of(cu, t_total)  # [T]
    streams = row if streams is None else streams
    positions = pos if positions is None else positions
    y = sample_tokens(lp, logits, position_noise(key, streams, positions, logits.shape[-1]), temperature, mode=mode)
    live = pos < cu[-1]
    j = pos - cu[row]  # index of the position within its row
    nxt = jnp.concatenate([fed[1:], jnp.zeros((1,), fed.dtype)]).astype(jnp.int32)  # draft checked at t
    in_draft = live & (j < lens[row])
    # Accepted prefix length per row: index of the first draft token that is not y there (else lens).
    first_bad = jnp.where(in_draft & (nxt != y), j, jnp.iinfo(jnp.int32).max)
    num_acc = jnp.minimum(jax.ops.segment_min(first_bad, row, num_segments=num_s), lens).astype(jnp.int32)
    emitted = live & (j <= num_acc[row])
    tokens = jnp.where(emitted, y, 0).astype(jnp.int32)
    logprobs = jnp.where(emitted, behaviour_logprobs(logits, y, temperature, mode=mode, lp=lp), 0.0)
    num_emitted = jnp.where(q_lens > 0, num_acc + 1, 0).astype(jnp.int32)
    return tokens, logprobs, num_emitted


__all__ = ["verify_packed"]
