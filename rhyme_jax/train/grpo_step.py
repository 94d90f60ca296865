"""The jitted GRPO update: one pure function over ``nnx.split`` state with donated buffers.

Loss: clipped surrogate with eps_low / eps_high (DAPO clip-higher), optional k3 KL to a frozen
reference, aggregated by ``grpo.loss_agg`` (``losses`` module docstring; DeepSeekMath eq. 3,
DAPO eq. 8). ``make_grads_fn`` is the loss and gradient the jitted step differentiates
(``tests/test_trl_parity.py`` checks both against TRL's ``GRPOTrainer``; docs/trl_mapping.md).
A step whose loss or gradients are not finite leaves parameters and optimizer state unchanged and
reports ``finite = 0``; the trainer counts and stops on repeats.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from rhyme_jax.parallel.rules import activation_mesh
from rhyme_jax.train import losses


class TrainShardings(NamedTuple):
    """Layout of the jitted train programs: ``params`` / ``opt_state`` are trees of
    ``NamedSharding`` (``parallel.rules.param_shardings`` / ``opt_state_shardings``), ``batch``
    one ``NamedSharding`` for every batch field (rows over ``("data", "fsdp")``)."""

    mesh: jax.sharding.Mesh
    params: Any
    opt_state: Any
    batch: jax.sharding.NamedSharding


class UpdateMemory(NamedTuple):
    """How one update bounds its memory (``grpo.micro_batch_tokens`` / ``logit_chunk`` / ``remat``).

    Attributes:
      micro_batch_tokens: token budget (rows x padded length) of one gradient micro-batch per
        device; the minibatch's gradient is accumulated (float32) over micro-batches. 0 = the
        whole minibatch in one pass.
      logit_chunk: tokens whose ``[tokens, vocabulary]`` logits exist at once in the log-prob /
        entropy computation (``losses.chunked_token_logprobs``); 0 = one chunk.
      remat: rematerialise each decoder block in the backward pass.
    """

    micro_batch_tokens: int = 0
    logit_chunk: int = 0
    remat: bool = False


def num_micro_batches(rows: int, seq_len: int, shards: int, budget: int) -> int:
    """Micro-batches of a minibatch of ``rows`` (split over ``shards`` devices) x ``seq_len``
    tokens under a per-device token ``budget``: the fewest whose per-device rows divide the
    device's rows and fit ``rows_per_device x seq_len <= budget`` (one row at least). 0 budget =
    1 micro-batch."""
    per_device = max(1, rows // max(shards, 1))
    if budget <= 0 or per_device * seq_len <= budget:
        return 1
    fit = max(1, budget // seq_len)
    micro_rows = max(d for d in range(1, per_device + 1) if per_device % d == 0 and d <= fit)
    return per_device // micro_rows


def _target_logprobs(graphdef: nnx.GraphDef, state: nnx.State, batch: dict, temperature: float,
                     memory: UpdateMemory = UpdateMemory(), entropy_grad: bool = False, frozen: tuple = ()):
    """Log p(tokens[:, t+1] | tokens[:, :t+1]) under ``softmax(logits / temperature)``.

    Returns f32[B, T-1] logprobs and f32[B, T-1] entropies (aligned with ``loss_mask[:, :-1]``),
    computed chunk by chunk from the last hidden states (``losses.chunked_token_logprobs``);
    the entropies carry a gradient only with ``entropy_grad``. ``frozen``: further states of
    ``graphdef`` merged with ``state`` (LoRA: the frozen base params and dropout keys).
    """
    model = nnx.merge(graphdef, state, *frozen)
    h = model.hidden(batch["tokens"], batch["positions"], batch["attn_mask"], remat=memory.remat,
                     segment_ids=batch.get("segment_ids"))
    return losses.chunked_token_logprobs(h[:, :-1], batch["tokens"][:, 1:], model.unembed, temperature,
                                         memory.logit_chunk, entropy_grad=entropy_grad)


def batch_shards(shardings: Optional[TrainShardings]) -> int:
    """Devices the batch rows are split over: the ``data`` x ``fsdp`` mesh axes (1 without shardings)."""
    if shardings is None:
        return 1
    return int(math.prod(shardings.mesh.shape.get(a, 1) for a in ("data", "fsdp")))


def make_logprob_fn(graphdef: nnx.GraphDef, temperature: float,
                    shardings: Optional[TrainShardings] = None, logit_chunk: int = 0) -> Callable:
    """Jitted ``(state, batch) -> f32[B, T-1]`` target logprobs (for the frozen KL reference);
    laid out by ``shardings`` when given (output rows like the batch); logits ``logit_chunk``
    tokens at a time."""
    mesh = shardings.mesh if shardings is not None else None
    memory = UpdateMemory(logit_chunk=logit_chunk)

    def logprob_fn(state, batch):
        with activation_mesh(mesh):
            return _target_logprobs(graphdef, state, batch, temperature, memory)[0]

    if shardings is None:
        return jax.jit(logprob_fn)
    return jax.jit(logprob_fn, in_shardings=(shardings.params, shardings.batch),
                   out_shardings=shardings.batch)


def minibatch_loss_weights(batch: dict, loss_agg: str) -> tuple[jax.Array, jax.Array]:
    """``(loss_w, token_w)`` f32[B, T-1] of a whole minibatch (``losses.loss_weights`` over
    ``batch["loss_mask"][:, :-1]``); the normalised aggregations read the step's normaliser from
    ``batch["loss_norm"]`` (f32[B]: ``losses.loss_normaliser`` on every real row, 0 on padding
    rows).

    Raises:
      LossInputError: unknown ``loss_agg``, or a normalised one without ``batch["loss_norm"]``.

    A packed minibatch (``train/packing.pack_minibatch``) carries its weights, computed over the
    padded layout: ``batch["loss_w"]`` and ``batch["token_w"]`` are returned as they are.
    """
    if "loss_w" in batch:
        return batch["loss_w"], batch["token_w"]
    norm = None
    if loss_agg in losses.NORMALISED_AGGS:
        if "loss_norm" not in batch:
            raise losses.LossInputError(f"grpo_step: loss_agg={loss_agg!r} needs batch['loss_norm'] "
                                        f"(f32[B], losses.loss_normaliser on every real row)")
        norm = jnp.max(jnp.asarray(batch["loss_norm"], jnp.float32))  # padding rows hold 0
    return losses.loss_weights(batch["loss_mask"][:, :-1], loss_agg, norm)


def make_weighted_grads_fn(graphdef: nnx.GraphDef, *, eps_low: float, eps_high: float, kl_coef: float,
                           temperature: float, shards: int = 1, memory: UpdateMemory = UpdateMemory(),
                           kl_ratio_weighted: bool = False, importance_sampling_level: str = "token",
                           entropy_coef: float = 0.0) -> Callable:
    """``grads(state, batch, loss_w, token_w) -> ((loss f32[], metrics), grads)``: the clipped
    surrogate (``losses.weighted_grpo_loss``) of a minibatch under the loss weights
    ``minibatch_loss_weights`` gives, and its gradient with respect to ``state``; not jitted.

    The gradient is accumulated in float32 over ``num_micro_batches(rows, T, shards,
    memory.micro_batch_tokens)`` micro-batches (rows ``j, j + n, j + 2n, ...``: every device keeps
    its share); the weights of the whole minibatch make it equal the one-pass gradient within
    float tolerance. ``kl_ratio_weighted`` weights the k3 term by the policy ratio (TRL
    ``use_bias_correction_kl``); ``importance_sampling_level`` and ``entropy_coef`` as
    ``losses.grpo_loss`` (TRL's names; ``grpo.*`` keys of the same names). In a packed minibatch
    (``batch["segment_ids"]``) target t belongs to token t's segment, so the sequence-level ratio
    is each segment's, not each row's.

    Metrics (f32 scalars, gradient-stopped): ``pg_loss``, ``clip_fraction``, ``ratio_mean``,
    ``approx_kl``, ``kl``, ``entropy`` (token means).

    Raises:
      LossInputError: unknown ``importance_sampling_level`` or ``entropy_coef < 0``.
    """
    bonus = entropy_coef > 0
    losses._check_options(importance_sampling_level, 0.0 if bonus else None, entropy_coef)

    def loss_fn(state, mb, loss_w, token_w, frozen):
        logprobs, entropy = _target_logprobs(graphdef, state, mb, temperature, memory, entropy_grad=bonus,
                                             frozen=frozen)
        loss, metrics = losses.weighted_grpo_loss(
            logprobs, mb["old_logprobs"], mb["advantages"], loss_w, token_w,
            eps_low=eps_low, eps_high=eps_high,
            ref_logprobs=mb.get("ref_logprobs") if kl_coef > 0 else None, kl_coef=kl_coef,
            kl_ratio_weighted=kl_ratio_weighted, importance_sampling_level=importance_sampling_level,
            entropy=entropy if bonus else None, entropy_coef=entropy_coef,
            segment_ids=mb["segment_ids"][:, :-1] if "segment_ids" in mb else None,
            is_weights=mb.get("is_weights"))
        metrics.pop("entropy_bonus", None)  # the same value as "entropy", gradient-stopped below
        return loss, dict(metrics, entropy=jnp.sum(jax.lax.stop_gradient(entropy) * token_w))

    def grads_of(state, batch, loss_w, token_w, frozen=()):
        rows, seq_len = batch["tokens"].shape
        n = num_micro_batches(rows, seq_len, shards, memory.micro_batch_tokens)
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        if n == 1:
            return grad_fn(state, batch, loss_w, token_w, frozen)
        # Micro-batch j = rows j, j + n, ...: a reshape that keeps each device's rows local.
        split = lambda x: jnp.moveaxis(x.reshape(x.shape[0] // n, n, *x.shape[1:]), 1, 0)
        parts = jax.tree.map(split, (batch, loss_w, token_w))

        def body(acc, part):
            out = grad_fn(state, *part, frozen)
            return jax.tree.map(lambda a, x: a + x.astype(jnp.float32), acc, out), None

        zero = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32),
                            jax.eval_shape(grad_fn, state, *jax.tree.map(lambda x: x[0], parts), frozen))
        ((loss, metrics), grads), _ = jax.lax.scan(body, zero, parts)
        return (loss, metrics), jax.tree.map(lambda g, p: g.astype(p.dtype), grads, state)

    return grads_of


def make_grads_fn(graphdef: nnx.GraphDef, *, eps_low: float, eps_high: float, kl_coef: float, loss_agg: str,
                  temperature: float, shards: int = 1, memory: UpdateMemory = UpdateMemory(),
                  kl_ratio_weighted: bool = False, importance_sampling_level: str = "token",
                  entropy_coef: float = 0.0) -> Callable:
    """``grads(state, batch) -> ((loss f32[], metrics), grads)``: the minibatch's GRPO loss and its
    gradient with respect to ``state``, as the update computes them (not jitted; trace it inside
    ``jax.jit``): ``minibatch_loss_weights(batch, loss_agg)`` then ``make_weighted_grads_fn``.
    ``batch`` is the one ``make_grpo_step`` documents.

    Raises:
      LossInputError: an unknown ``loss_agg`` or ``importance_sampling_level``, ``entropy_coef <
        0``; (at trace time) a normalised ``loss_agg`` without ``batch["loss_norm"]``.
    """
    if loss_agg not in losses.LOSS_AGGS:
        raise losses.LossInputError(f"grpo_step: loss_agg must be one of {losses.LOSS_AGGS}, got {loss_agg!r}")
    weighted = make_weighted_grads_fn(graphdef, eps_low=eps_low, eps_high=eps_high, kl_coef=kl_coef,
                                      temperature=temperature, shards=shards, memory=memory,
                                      kl_ratio_weighted=kl_ratio_weighted,
                                      importance_sampling_level=importance_sampling_level,
                                      entropy_coef=entropy_coef)
    return lambda state, batch, frozen=(): weighted(state, batch, *minibatch_loss_weights(batch, loss_agg), frozen)


def loss_options(grpo: Any) -> dict[str, Any]:
    """The loss keywords of ``make_grpo_step`` / ``make_grads_fn`` that the ``grpo`` config
    section sets besides the clip range, KL weight and aggregation: ``kl_ratio_weighted``,
    ``importance_sampling_level``, ``entropy_coef`` (``grpo.*`` keys of the same names)."""
    return {"kl_ratio_weighted": bool(grpo.kl_ratio_weighted),
            "importance_sampling_level": str(grpo.importance_sampling_level),
            "entropy_coef": float(grpo.entropy_coef)}


def apply_grads(optimizer: optax.GradientTransformation, state: Any, opt_state: Any,
                grads_out: tuple[tuple[jax.Array, dict], Any]) -> tuple[Any, Any, dict]:
    """One optimizer step from ``((loss, metrics), grads)`` (``make_grads_fn``'s output); traced
    inside the jitted update. A non-finite loss or gradient norm leaves ``state`` and
    ``opt_state`` as they were. Returns ``(state, opt_state, metrics)``, the metrics f32 scalars
    with ``loss``, ``grad_norm`` and ``finite`` (1/0) added."""
    (loss, metrics), grads = grads_out
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    updates, new_opt_state = optimizer.update(grads, opt_state, state)
    new_state = optax.apply_updates(state, updates)
    keep = lambda new, old: jnp.where(finite, new, old)
    new_state = jax.tree.map(keep, new_state, state)
    new_opt_state = jax.tree.map(keep, new_opt_state, opt_state)
    metrics = {k: jnp.asarray(v, jnp.float32) for k, v in metrics.items()}
    metrics.update(loss=loss.astype(jnp.float32), grad_norm=grad_norm.astype(jnp.float32),
                   finite=finite.astype(jnp.float32))
    return new_state, new_opt_state, metrics


def make_grpo_step(graphdef: nnx.GraphDef, optimizer: optax.GradientTransformation, *,
                   eps_low: float, eps_high: float, kl_coef: float, loss_agg: str,
                   temperature: float, shardings: Optional[TrainShardings] = None,
                   memory: UpdateMemory = UpdateMemory(), kl_ratio_weighted: bool = False,
                   importance_sampling_level: str = "token", entropy_coef: float = 0.0,
                   frozen_shardings: Any = None) -> Callable:
    """Build ``step(state, opt_state, batch[, frozen]) -> (state, opt_state, metrics)``.

    ``batch`` holds ``tokens i32[B,T]``, ``positions i32[B,T]``, ``attn_mask bool[B,T]``,
    ``loss_mask f32[B,T]`` (1 where the next token is a response token), ``old_logprobs f32[B,T-1]``
    (behaviour logprobs aligned with targets ``tokens[:, 1:]``), ``advantages f32[B]``, when
    ``kl_coef > 0`` ``ref_logprobs f32[B,T-1]``, for ``loss_agg`` in
    ``losses.NORMALISED_AGGS`` ``loss_norm f32[B]`` (``losses.loss_normaliser`` on every real row,
    0 on padding rows), and with ``grpo.tis`` ``is_weights f32[B,T-1]`` (``tis.truncated_is_weights``:
    each token's policy-gradient term is multiplied by it; without the key the program is unchanged). ``state`` and ``opt_state`` are donated.
    Metrics are f32 scalars: loss, grad_norm, entropy, clip_fraction, kl, finite (1/0).

    The loss and gradient are ``make_grads_fn``'s: ``memory`` bounds the update's temporaries
    (gradient accumulated over micro-batches with the whole minibatch's loss weights, so the
    result equals the one-pass update within float tolerance; logits chunked; blocks
    rematerialised). ``kl_ratio_weighted``, ``importance_sampling_level`` and ``entropy_coef``:
    ``losses.grpo_loss`` (``grpo.*`` keys of the same names; TRL ``use_bias_correction_kl``,
    ``importance_sampling_level``, ``entropy_coef``).

    With ``shardings`` the step is jitted with those in/out shardings (FSDP and tensor parallel
    over ``shardings.mesh``; activations constrained to rows over ``("data", "fsdp")``); the
    math is the same, so results equal the single-device step within float tolerance.

    ``frozen``: a tuple of further states of ``graphdef`` that the forward merges with ``state``
    but the step neither differentiates nor updates (LoRA, ``train/lora_state.py``: ``state`` is
    the adapters, ``frozen`` the base params and dropout keys); laid out by ``frozen_shardings``
    (needed with ``shardings`` when the step is called with ``frozen``), never donated.
    """
    mesh = shardings.mesh if shardings is not None else None
    grads_of = make_grads_fn(graphdef, eps_low=eps_low, eps_high=eps_high, kl_coef=kl_coef, loss_agg=loss_agg,
                             temperature=temperature, shards=batch_shards(shardings), memory=memory,
                             kl_ratio_weighted=kl_ratio_weighted, importance_sampling_level=importance_sampling_level,
                             entropy_coef=entropy_coef)

    def step(state, opt_state, batch, frozen=()):
        with activation_mesh(mesh):
            out = grads_of(state, batch, frozen)
        return apply_grads(optimizer, state, opt_state, out)

    if shardings is None:
        return jax.jit(step, donate_argnums=(0, 1))
    replicated = jax.sharding.NamedSharding(shardings.mesh, jax.sharding.PartitionSpec())
    extra = () if frozen_shardings is None else (frozen_shardings,)
    return jax.jit(step, donate_argnums=(0, 1),
                   in_shardings=(shardings.params, shardings.opt_state, shardings.batch, *extra),
                   out_shardings=(shardings.params, shardings.opt_state, replicated))
