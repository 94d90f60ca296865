"""Dense reference verification (test helper): drafts as a ``K`` dimension, drawn the textbook way.

Each sequence ``s`` fed ``1 + draft_lens[s]`` tokens (its pending token, then its draft) to one
forward pass; ``verify`` accepts draft token ``x_i`` with probability ``p_i(x_i)``
(``u_i < p_i(x_i)``), draws the token at the first rejection from the residual (``p_i`` without
``x_i``) and a bonus token from ``p_d`` when every draft token is accepted (greedy: accept while
``x_i`` is the argmax). ``rhyme_jax.rollout.verification.verify_packed`` (what the engine runs)
couples the same law to plain sampling; tests/test_verification.py checks this reference against
the target distribution and tests/test_verification_packed.py checks ``verify_packed`` against
it (greedy, row by row). Moved here from ``rhyme_jax.rollout.verification``, where nothing but
the tests used it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from rhyme_jax.rollout.sampling import MODES, SamplingError, _processed, behaviour_logprobs


def _by_mode(mode: str, temperature, sampled, greedy):
    """``greedy`` under mode ``greedy``, ``sampled`` under the sampling modes, and per call by
    ``temperature > 0`` under ``dynamic`` (the same rule as ``sampling.sample``)."""
    if mode == "greedy":
        return greedy
    if mode == "dynamic":
        return jnp.where(jnp.asarray(temperature) > 0, sampled, greedy)
    return sampled


def _residual(lp_last: Float[Array, "S V"], rejected, x_rej) -> Float[Array, "S V"]:
    """Log-weights of the token after the accepted prefix: the residual (``p`` without the
    rejected draft token ``x_rej``, unnormalised) where ``rejected``, else ``p`` (bonus token)."""
    vocab_ids = jnp.arange(lp_last.shape[-1], dtype=jnp.int32)
    remove = rejected[:, None] & (vocab_ids[None, :] == x_rej[:, None])
    return jnp.where(remove, -jnp.inf, lp_last)


def _correction(key, lp_last: Float[Array, "S V"], rejected, x_rej) -> Int[Array, "S"]:
    """A draw from ``_residual`` with ``jax.random.categorical``."""
    return jax.random.categorical(key, _residual(lp_last, rejected, x_rej), axis=-1).astype(jnp.int32)


def verify(
    logits: Float[Array, "S K1 V"],
    draft_tokens: Int[Array, "S K"],
    draft_lens: Int[Array, "S"],
    key: PRNGKeyArray,
    temperature,
    top_k=0,
    top_p=1.0,
    *,
    mode: str,
) -> tuple[Int[Array, "S K1"], Float[Array, "S K1"], Int[Array, "S"]]:
    """Accept/reject every sequence's draft against the target logits in one batched program.

    Args:
      logits: ``f32[S, K+1, V]`` raw target logits; row ``i`` is the distribution of the token
        after draft token ``i - 1`` (row 0: after the pending token).
      draft_tokens: ``i32[S, K]`` drafts (entries past ``draft_lens`` are ignored).
      draft_lens: ``i32[S]`` in ``[0, K]``.
      key: PRNG key of this forward pass.
      temperature, top_k, top_p: sampling parameters (Python numbers or traced scalars).
      mode: sampling program (``rhyme_jax.rollout.sampling.MODES``); static under jit.

    Returns:
      ``(tokens i32[S, K+1], logprobs f32[S, K+1], num_emitted i32[S])``: sequence ``s`` emits
      ``tokens[s, :num_emitted[s]]`` (accepted draft tokens, then the correction or bonus token)
      with behaviour logprobs ``logprobs[s, :num_emitted[s]]``; ``1 <= num_emitted <= lens + 1``.

    Raises:
      SamplingError: unknown ``mode`` or inconsistent shapes.
    """
    if mode not in MODES:
        raise SamplingError(f"verify: mode must be one of {MODES}, got {mode!r}")
    num_s, k1, vocab = logits.shape
    k = k1 - 1
    if draft_tokens.shape != (num_s, k) or draft_lens.shape != (num_s,):
        raise SamplingError(
            f"verify: draft_tokens must be [S={num_s}, K={k}] and draft_lens [S], got "
            f"{draft_tokens.shape} and {draft_lens.shape}")
    logits = logits.astype(jnp.float32)
    flat = logits.reshape(num_s * k1, vocab)
    lp = _processed(flat, temperature, top_k, top_p, mode).reshape(num_s, k1, vocab)
    argmax = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [S, K+1]
    key_u, key_tok = jax.random.split(key)

    pos = jnp.arange(k, dtype=jnp.int32)
    in_draft = pos[None, :] < draft_lens[:, None]  # [S, K]
    drafts = jnp.where(in_draft, draft_tokens, 0).astype(jnp.int32)
    lp_draft = jnp.take_along_axis(lp[:, :k], drafts[..., None], axis=-1)[..., 0]  # [S, K]
    u = jax.random.uniform(key_u, (num_s, k))
    accept_sampled = u < jnp.exp(lp_draft)
    accept_greedy = drafts == argmax[:, :k]
    accept = _by_mode(mode, temperature, accept_sampled, accept_greedy)
    accept = accept & in_draft
    # Accepted prefix length: index of the first non-accepted position.
    num_acc = jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)  # [S]
    rejected = num_acc < draft_lens

    # Token at position num_acc: residual (draft token removed) on rejection, else bonus from p.
    lp_last = jnp.take_along_axis(lp, num_acc[:, None, None], axis=1)[:, 0]  # [S, V]
    x_rej = jnp.take_along_axis(jnp.pad(drafts, ((0, 0), (0, 1))), num_acc[:, None], axis=1)[:, 0]
    sampled = _correction(key_tok, lp_last, rejected, x_rej)
    greedy_last = jnp.take_along_axis(argmax, num_acc[:, None], axis=1)[:, 0]
    last = _by_mode(mode, temperature, sampled, greedy_last)

    full_pos = jnp.arange(k1, dtype=jnp.int32)
    tokens = jnp.where(full_pos[None, :] < num_acc[:, None], jnp.pad(drafts, ((0, 0), (0, 1))), 0)
    tokens = jnp.where(full_pos[None, :] == num_acc[:, None], last[:, None], tokens).astype(jnp.int32)
    logprobs = behaviour_logprobs(flat, tokens.reshape(-1), temperature, mode=mode,
                                  lp=lp.reshape(num_s * k1, vocab)).reshape(num_s, k1)
    num_emitted = num_acc + 1
    logprobs = jnp.where(full_pos[None, :] < num_emitted[:, None], logprobs, 0.0)
    return tokens, logprobs, num_emitted


__all__ = ["verify"]
