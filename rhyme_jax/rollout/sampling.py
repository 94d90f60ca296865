"""Token sampling with temperature, top-k and top-p (nucleus) filtering, plus behaviour logprobs.

The processed distribution (also the target distribution of HistoSpec verification,
docs/architecture.md, "HistoSpec in one paragraph") is built in this order, as in HF ``generate`` and vLLM:

1. ``logits / temperature``;
2. top-k (``top_k > 0``): keep the ``top_k`` largest tokens (stable order breaks ties);
3. top-p (``top_p < 1``): over the renormalised result, keep the smallest set of most probable
   tokens whose cumulative probability is ``>= top_p`` (a token is kept when the mass strictly
   before it is ``< top_p``);
4. softmax over the kept tokens.

``temperature == 0`` is greedy: the token is the argmax of the raw logits.

Behaviour logprobs (``behaviour_logprobs``): the sampled token's logprob under
``softmax(logits / temperature)`` *without* the top-k / top-p filter, the distribution the GRPO
loss scores (``train.losses.token_logprobs`` / ``chunked_token_logprobs``) and the one TRL's
``GRPOTrainer`` recomputes its old logprobs under. Scored under the filtered distribution instead,
every kept token's behaviour logprob would exceed the trainer's by ``-log(kept mass)``, so every
ratio of the first update would sit below 1 and clipping would act on unchanged weights. Greedy
reports ``log_softmax(raw logits)``. Sampling itself still draws from the filtered distribution.

``mode`` picks a specialised program: ``"greedy"``, ``"plain"`` (no filtering), ``"filtered"``
or ``"dynamic"`` (temperature / top_k / top_p are traced values; greedy selected with ``where``).
Pass it explicitly under ``jax.jit`` as a static argument; ``None`` derives it from Python values.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

MODES = ("greedy", "plain", "filtered", "dynamic")


class SamplingError(ValueError):
    """Invalid sampling parameters (message names the field)."""


def sampling_mode(temperature, top_k, top_p) -> str:
    """Static program choice for Python-number parameters; ``"dynamic"`` if any is an array.

    Raises:
      SamplingError: temperature < 0, top_k < 0 or top_p outside (0, 1].
    """
    if any(isinstance(x, jax.Array) for x in (temperature, top_k, top_p)):
        return "dynamic"
    if temperature < 0:
        raise SamplingError(f"sampling: temperature must be >= 0, got {temperature}")
    if top_k < 0:
        raise SamplingError(f"sampling: top_k must be >= 0 (0 = off), got {top_k}")
    if not 0.0 < top_p <= 1.0:
        raise SamplingError(f"sampling: top_p must be in (0, 1], got {top_p}")
    if temperature == 0:
        return "greedy"
    if top_k > 0 or top_p < 1.0:
        return "filtered"
    return "plain"


def _filter_mask(x: Float[Array, "S V"], top_k, top_p) -> jax.Array:
    """Bool ``[S, V]``: tokens kept by top-k then top-p on the (temperature-scaled) logits ``x``."""
    vocab = x.shape[-1]
    order = jnp.argsort(-x, axis=-1, stable=True)  # [S, V] descending
    xs = jnp.take_along_axis(x, order, axis=-1)
    rank = jnp.arange(vocab)
    k_eff = jnp.where(jnp.asarray(top_k) > 0, jnp.minimum(jnp.asarray(top_k), vocab), vocab)
    keep_sorted = rank[None, :] < k_eff
    xs = jnp.where(keep_sorted, xs, -jnp.inf)
    ps = jax.nn.softmax(xs, axis=-1)
    before = jnp.cumsum(ps, axis=-1) - ps
    keep_sorted = keep_sorted & ((before < top_p) | (jnp.asarray(top_p) >= 1.0))
    keep_sorted = keep_sorted.at[:, 0].set(True)
    rows = jnp.arange(x.shape[0])[:, None]
    return jnp.zeros(x.shape, bool).at[rows, order].set(keep_sorted)


def _processed(logits, temperature, top_k, top_p, mode):
    logits = logits.astype(jnp.float32)
    if mode == "greedy":
        return jax.nn.log_softmax(logits, axis=-1)
    t = jnp.asarray(temperature, jnp.float32)
    x = logits / jnp.where(t > 0, t, 1.0)
    if mode in ("filtered", "dynamic"):
        x = jnp.where(_filter_mask(x, top_k, top_p), x, -jnp.inf)
    lp = jax.nn.log_softmax(x, axis=-1)
    if mode == "dynamic":
        lp = jnp.where(t > 0, lp, jax.nn.log_softmax(logits, axis=-1))
    return lp


def processed_logprobs(
    logits: Float[Array, "S V"], temperature, top_k=0, top_p=1.0, *, mode: str | None = None
) -> Float[Array, "S V"]:
    """Log-probabilities ``f32[S, V]`` of the sampling distribution (``-inf`` for filtered tokens):
    what tokens are drawn from (behaviour logprobs are ``behaviour_logprobs``, unfiltered).

    For ``temperature == 0`` this is ``log_softmax(logits)``.

    Raises:
      SamplingError: invalid parameters or unknown ``mode``.
    """
    mode = sampling_mode(temperature, top_k, top_p) if mode is None else mode
    if mode not in MODES:
        raise SamplingError(f"sampling: mode must be one of {MODES}, got {mode!r}")
    return _processed(logits, temperature, top_k, top_p, mode)


def behaviour_logprobs(
    logits: Float[Array, "N V"], tokens: Int[Array, "N"], temperature, *, mode: str,
    lp: Float[Array, "N V"] | None = None,
) -> Float[Array, "N"]:
    """``f32[N]``: log-probability of ``tokens`` under ``softmax(logits / temperature)``, unfiltered
    (module docstring), and under ``softmax(logits)`` where greedy (mode ``greedy``, or
    ``temperature == 0`` under ``dynamic``).

    Args:
      logits: ``[N, V]`` raw logits (computed in f32, as the loss does).
      tokens: ``i32[N]`` sampled ids.
      temperature: the sampling temperature (Python number or traced scalar).
      mode: the sampling program (``MODES``).
      lp: optional ``_processed`` log-probs of the same call; under ``greedy`` / ``plain`` (no
        filter) they are the answer and are gathered instead of recomputed.

    Raises:
      SamplingError: unknown ``mode``.
    """
    if mode not in MODES:
        raise SamplingError(f"sampling: mode must be one of {MODES}, got {mode!r}")
    tokens = tokens.astype(jnp.int32)[:, None]
    if lp is not None and mode in ("greedy", "plain"):
        return jnp.take_along_axis(lp, tokens, axis=-1)[:, 0]
    x = logits.astype(jnp.float32)
    if mode != "greedy":
        t = jnp.asarray(temperature, jnp.float32)
        x = x / jnp.where(t > 0, t, 1.0)  # temperature 0 (dynamic): greedy, raw logits
    return jnp.take_along_axis(x, tokens, axis=-1)[:, 0] - jax.nn.logsumexp(x, axis=-1)


GUMBEL_BLOCK = 256  # tokens per block of the two-level Gumbel-max draw (``gumbel_draw``)


class Noise(NamedTuple):
    """Gumbel noise of one draw per row for ``gumbel_draw``: ``block f32[N, nb]`` over the vocabulary's
    blocks of ``GUMBEL_BLOCK`` tokens and ``token f32[N, min(V, GUMBEL_BLOCK)]`` within a block."""

    block: Float[Array, "N nb"]
    token: Float[Array, "N B"]


def _block_shape(vocab: int) -> tuple[int, int]:
    width = min(int(vocab), GUMBEL_BLOCK)
    return -(-int(vocab) // width), width


def key_noise(key: PRNGKeyArray, rows: int, vocab: int) -> Noise:
    """``Noise`` for ``rows`` independent draws over a ``vocab``-token distribution from one key."""
    nb, width = _block_shape(vocab)
    kb, kt = jax.random.split(key)
    return Noise(jax.random.gumbel(kb, (rows, nb), jnp.float32), jax.random.gumbel(kt, (rows, width), jnp.float32))


def position_noise(key: PRNGKeyArray, streams: Int[Array, "N"], positions: Int[Array, "N"], vocab: int) -> Noise:
    """The draw of each sampled token, keyed by ``fold_in(fold_in(key, stream), position)``: the
    draw of a sequence's token depends only on the rollout key, the sequence (its request) and the
    position of the token it follows, never on which pass, program, row or slot samples it. Plain
    decode and speculative verification therefore draw the same tokens given the same prefix
    (``verification.verify_packed``), and a rollout's tokens do not depend on the drafts.
    ``streams``/``positions``: ``i32[N]``; ``vocab``: static vocabulary size."""
    def one(s, p):
        noise = key_noise(jax.random.fold_in(jax.random.fold_in(key, s), p), 1, vocab)
        return Noise(noise.block[0], noise.token[0])

    return jax.vmap(one)(streams.astype(jnp.uint32), positions.astype(jnp.uint32))


def gumbel_draw(lp: Float[Array, "N V"], noise: Noise) -> Int[Array, "N"]:
    """``i32[N]``: one exact draw per row from ``softmax(lp)`` by two-level Gumbel-max: the block
    of ``GUMBEL_BLOCK`` tokens is the argmax of its log-mass (``logsumexp`` over the block) plus
    ``noise.block``, the token the argmax of its log-probability within that block plus
    ``noise.token`` (Gumbel-max trick, Gumbel 1954 / Maddison et al. 2014: the block is drawn with
    its mass, the token with its mass within the block, so the token's probability is its own;
    filtered tokens, ``-inf``, are never drawn). Why not the inverse CDF: a cumulative sum over
    the vocabulary moves its boundaries with every logit, so logits that differ in their last bits
    between two programs (a decode pass and a verify pass of other shapes) change a draw with
    probability about (vocabulary x rounding); an argmax changes only when its top two candidates
    are within the rounding of each other. Cost: ``nb + GUMBEL_BLOCK`` noise values per row, not ``V``."""
    rows, vocab = lp.shape
    nb, width = _block_shape(vocab)
    x = jnp.pad(lp, ((0, 0), (0, nb * width - vocab)), constant_values=-jnp.inf).reshape(rows, nb, width)
    block = jnp.argmax(jax.nn.logsumexp(x, axis=-1) + noise.block, axis=-1)  # [N]
    within = jnp.take_along_axis(x, block[:, None, None], axis=1)[:, 0, :]  # [N, width]
    tok = block * width + jnp.argmax(within + noise.token, axis=-1)
    return jnp.minimum(tok, vocab - 1).astype(jnp.int32)


def sample_tokens(lp: Float[Array, "N V"], logits: Float[Array, "N V"], noise: Noise, temperature, *,
                  mode: str) -> Int[Array, "N"]:
    """``i32[N]`` tokens: ``gumbel_draw(lp, noise)`` under the sampling modes, the argmax of the raw
    ``logits`` under ``greedy`` (and under ``dynamic`` where ``temperature == 0``)."""
    greedy_tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if mode == "greedy":
        return greedy_tok
    tok = gumbel_draw(lp, noise)
    if mode == "dynamic":
        tok = jnp.where(jnp.asarray(temperature) > 0, tok, greedy_tok)
    return tok


def sample_at(
    logits: Float[Array, "S V"], key: PRNGKeyArray, streams: Int[Array, "S"], positions: Int[Array, "S"],
    temperature, top_k=0, top_p=1.0, *, mode: str,
) -> tuple[Int[Array, "S"], Float[Array, "S"]]:
    """``sample`` with the draws of ``position_noise(key, streams, positions, V)``: row ``i`` is
    the distribution of the token after position ``positions[i]`` of sequence ``streams[i]``.
    Returns ``(tokens i32[S], behaviour logprobs f32[S])`` (``behaviour_logprobs``).

    Raises:
      SamplingError: unknown ``mode``.
    """
    if mode not in MODES:
        raise SamplingError(f"sampling: mode must be one of {MODES}, got {mode!r}")
    lp = _processed(logits, temperature, top_k, top_p, mode)
    tok = sample_tokens(lp, logits, position_noise(key, streams, positions, logits.shape[-1]), temperature,
                        mode=mode)
    return tok, behaviour_logprobs(logits, tok, temperature, mode=mode, lp=lp)


def sample(
    logits: Float[Array, "S V"], key: PRNGKeyArray, temperature, top_k=0, top_p=1.0, *,
    mode: str | None = None,
) -> tuple[Int[Array, "S"], Float[Array, "S"]]:
    """Sample one token per row; returns ``(tokens i32[S], behaviour logprobs f32[S])``.

    Args:
      logits: ``[S, V]`` raw logits (any float dtype; computed in f32).
      key: PRNG key (``key_noise``: every row's draw from it; ``sample_at`` keys each row's draw itself).
      temperature: ``>= 0``; 0 = greedy argmax.
      top_k: ``0`` = off.
      top_p: ``1.0`` = off.
      mode: see the module docstring; ``None`` derives it from Python parameter values.

    Returns:
      Sampled ids (drawn from the filtered distribution) and their behaviour logprobs
      (``behaviour_logprobs``: under ``softmax(logits / temperature)`` without the filter, under
      ``softmax(raw logits)`` when greedy).

    Raises:
      SamplingError: invalid parameters or unknown ``mode``.
    """
    mode = sampling_mode(temperature, top_k, top_p) if mode is None else mode
    if mode not in MODES:
        raise SamplingError(f"sampling: mode must be one of {MODES}, got {mode!r}")
    lp = _processed(logits, temperature, top_k, top_p, mode)
    tok = sample_tokens(lp, logits, key_noise(key, *logits.shape), temperature, mode=mode)
    return tok, behaviour_logprobs(logits, tok, temperature, mode=mode, lp=lp)
