"""Supervised warm start: next-token cross-entropy on prompt + worked solution + <eos>.

The jitted step is a pure function over ``nnx.split`` state: the
module graph is traversed once, outside the loop. Batches come from ``losses.sequence_batch``
with one fixed length for the whole run, so the step compiles once.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jaxtyping import Array, Float

from rhyme_jax.config import SFTSection
from rhyme_jax.train.losses import sequence_batch, token_logprobs
from rhyme_jax.train.packing import pack_minibatch
from rhyme_jax.train.optim import make_optimizer

SFT_MAX_GRAD_NORM = 1.0  # not in SFTSection; fixed here


class SFTError(ValueError):
    """Bad SFT input (no problems, a batch missing keys, an empty solution)."""


_BATCH_KEYS = ("tokens", "positions", "attn_mask", "loss_mask")


def sft_loss(model: Callable, batch: dict[str, Array]) -> tuple[Float[Array, ""], dict[str, Array]]:
    """Token-mean cross-entropy over the response (solution + eos) tokens.

    Args:
      model: callable ``model(tokens i32[B,T], positions i32[B,T], mask bool[B,T]) -> f32[B,T,V]``
        (an ``nnx.Module`` such as ``rhyme_jax.model.transformer.Decoder``).
      batch: ``losses.sequence_batch`` output: ``tokens``, ``positions``, ``attn_mask``,
        ``loss_mask`` (``logits[:, t]`` predicts ``tokens[:, t+1]``; scored where ``loss_mask[:, t]``),
        or ``pack_sft_batch`` of it (adds ``segment_ids``; the model then needs ``hidden`` and
        ``unembed``, as ``Decoder`` has).

    Returns:
      (loss f32[] in nats/token, metrics ``{"loss", "token_accuracy", "num_tokens"}``).

    Raises:
      SFTError: ``batch`` lacks one of the keys above.
    """
    missing = [k for k in _BATCH_KEYS if k not in batch]
    if missing:
        raise SFTError(f"sft.sft_loss: batch is missing {missing} (build it with losses.sequence_batch)")
    tokens = batch["tokens"]
    if "segment_ids" in batch:  # packed rows (sft.padding_free): attention within each segment
        logits = model.unembed(model.hidden(tokens, batch["positions"], batch["attn_mask"],
                                            segment_ids=batch["segment_ids"])).astype(jnp.float32)
    else:
        logits = model(tokens, batch["positions"], batch["attn_mask"])
    logits = logits[:, :-1]
    targets = tokens[:, 1:]
    mask = batch["loss_mask"][:, :-1].astype(jnp.float32)
    logp, _ = token_logprobs(logits, targets)
    count = jnp.sum(mask)
    denom = jnp.maximum(count, 1.0)
    loss = -jnp.sum(logp * mask) / denom
    correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
    metrics = {
        "loss": jax.lax.stop_gradient(loss),
        "token_accuracy": jnp.sum(correct * mask) / denom,
        "num_tokens": count,
    }
    return loss, metrics


def make_sft_step(graphdef: nnx.GraphDef, optimizer: optax.GradientTransformation) -> Callable:
    """Jitted SFT update over split state.

    Usage::

        graphdef, state = nnx.split(model)
        opt_state = init_opt_state(optimizer, state)
        step = make_sft_step(graphdef, optimizer)
        state, opt_state, metrics = step(state, opt_state, batch)

    ``state`` is the full ``nnx.State`` of the model; only its ``nnx.Param`` entries are trained
    (other variables pass through). ``state`` and ``opt_state`` are donated. A step whose loss or
    gradient norm is not finite leaves both unchanged and reports ``skipped = 1``.

    Returns:
      ``step(state, opt_state, batch) -> (state, opt_state, metrics)``; metrics are f32[] arrays:
      ``loss``, ``token_accuracy``, ``num_tokens``, ``grad_norm``, ``skipped``.
    """

    def step(state, opt_state, batch):
        params, rest = nnx.split_state(state, nnx.Param, ...)

        def loss_fn(p):
            model = nnx.merge(graphdef, p, rest)
            return sft_loss(model, batch)

        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        grad_norm = optax.tree.norm(grads)
        updates, new_opt = optimizer.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        keep = lambda new, old: jnp.where(ok, new, old)  # noqa: E731
        new_params = jax.tree.map(keep, new_params, params)
        new_opt = jax.tree.map(keep, new_opt, opt_state)
        metrics = dict(metrics, grad_norm=grad_norm, skipped=1.0 - ok.astype(jnp.float32))
        return nnx.merge_state(new_params, rest), new_opt, metrics

    return jax.jit(step, donate_argnums=(0, 1))


def init_opt_state(optimizer: optax.GradientTransformation, state: nnx.State) -> Any:
    """Optimizer state for the ``nnx.Param`` part of a full model state (``make_sft_step``)."""
    return optimizer.init(nnx.split_state(state, nnx.Param, ...)[0])


def _encode_problems(tokenizer, problems: Sequence[Any], prompt_template: str):
    prompts, responses = [], []
    for i, prob in enumerate(problems):
        prompt = tokenizer.encode(tokenizer.format_prompt(prompt_template, prob.question))
        solution = tokenizer.encode(prob.solution)
        if not prompt:
            raise SFTError(f"sft.run_sft: problem {i} encodes to an empty prompt")
        if not solution:
            raise SFTError(f"sft.run_sft: problem {i} has an empty solution")
        prompts.append(prompt)
        responses.append(solution + [tokenizer.eos_id])
    return prompts, responses


def pack_sft_batch(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``sequence_batch``'s ``B x T`` rows packed back to back into ``B' <= B`` buffers of ``T``
    tokens (``packing.pack_minibatch``: first-fit decreasing, ``positions`` restarting per
    segment, ``segment_ids``). The loss is unchanged: a segment's last token scores nothing (its
    ``loss_mask`` is 0, as a padded row's last real token), so no target crosses segments.

    Returns:
      ``tokens``, ``positions``, ``attn_mask``, ``loss_mask``, ``segment_ids`` of ``[B', T]``.
    """
    rows, width = batch["tokens"].shape
    dummy = dict(batch, old_logprobs=np.zeros((rows, width - 1), np.float32), advantages=np.zeros(rows, np.float32))
    packed = pack_minibatch(dummy, "token_mean")
    return {k: packed[k] for k in (*_BATCH_KEYS, "segment_ids")}


def _step_batch(prompts, responses, pad_id: int, max_len: int, packed: bool) -> dict[str, Array]:
    """One SFT step's device batch: ``sequence_batch`` padded to ``max_len``, packed when asked."""
    nb = sequence_batch(prompts, responses, pad_id, max_len=max_len)
    keys = _BATCH_KEYS
    if packed:
        nb, keys = pack_sft_batch(nb), (*_BATCH_KEYS, "segment_ids")
    return {k: jnp.asarray(nb[k]) for k in keys}


def run_sft(
    model: nnx.Module,
    tokenizer: Any,
    problems: Sequence[Any],
    cfg_sft: SFTSection,
    *,
    prompt_template: str,
    seed: int,
    progress: bool = True,
    log_fn: Callable[[int, dict[str, float]], None] | None = None,
) -> nnx.Module:
    """Fine-tune ``model`` on ``format_prompt(template, question)`` -> ``solution + <eos>``.

    Problems are shuffled each epoch by ``np.random.default_rng(seed)`` and taken
    ``cfg_sft.batch_size`` at a time; every batch is padded to the longest encoded problem (one
    compile), and with ``cfg_sft.padding_free`` packed (``pack_sft_batch``: at most 8 shapes). With ``cfg_sft.max_tokens > 0`` only problems whose prompt + solution + eos fit in
    it are trained on. Optimizer: ``make_optimizer(cfg_sft.learning_rate, cfg_sft.steps,
    cfg_sft.warmup_steps, cfg_sft.weight_decay, max_grad_norm=1.0, schedule=cfg_sft.schedule)``
    (``constant`` or ``cosine`` after warmup; ``cosine`` when the section has no schedule field).

    Args:
      model: nnx module with the ``Decoder`` call signature; updated in place and returned.
      tokenizer: has ``encode(str) -> list[int]``, ``eos_id``, ``pad_id``, ``format_prompt``.
      problems: objects with ``.question`` and ``.solution`` strings.
      cfg_sft: ``config.SFTSection`` (steps, batch_size, learning_rate, warmup_steps, weight_decay).
      prompt_template: e.g. ``"{question}\\n"`` (``model.prompt_template``).
      seed: data-order seed.
      progress: show a tqdm bar.
      log_fn: called as ``log_fn(step, metrics)`` after every step (1-based step, float metrics).

    Returns:
      The same ``model`` with trained parameters.

    Raises:
      SFTError: no problems, ``steps``/``batch_size`` < 1, a problem encodes to nothing, or no
        problem fits ``sft.max_tokens``.
    """
    from tqdm.auto import tqdm

    if not problems:
        raise SFTError("sft.run_sft: no problems to train on")
    steps, batch_size = int(cfg_sft.steps), int(cfg_sft.batch_size)
    if steps < 1 or batch_size < 1:
        raise SFTError(f"sft.run_sft: sft.steps and sft.batch_size must be >= 1, got {steps}, {batch_size}")
    prompts, responses = _encode_problems(tokenizer, problems, prompt_template)
    limit = int(getattr(cfg_sft, "max_tokens", 0))
    if limit > 0:
        keep = [i for i, (p, r) in enumerate(zip(prompts, responses)) if len(p) + len(r) <= limit]
        if not keep:
            raise SFTError(f"sft.run_sft: no problem fits sft.max_tokens={limit}")
        prompts, responses = [prompts[i] for i in keep], [responses[i] for i in keep]
    max_len = max(len(p) + len(r) for p, r in zip(prompts, responses))

    optimizer = make_optimizer(
        cfg_sft.learning_rate, steps, min(int(cfg_sft.warmup_steps), steps), cfg_sft.weight_decay,
        SFT_MAX_GRAD_NORM, schedule=getattr(cfg_sft, "schedule", "cosine"),
    )
    graphdef, state = nnx.split(model)
    opt_state = init_opt_state(optimizer, state)
    step_fn = make_sft_step(graphdef, optimizer)

    rng = np.random.default_rng(seed)
    order = np.empty(0, np.int64)
    bar = tqdm(range(1, steps + 1), desc="sft", disable=not progress)
    for step in bar:
        while len(order) < batch_size:
            order = np.concatenate([order, rng.permutation(len(prompts))])
        idx, order = order[:batch_size], order[batch_size:]
        batch = _step_batch([prompts[i] for i in idx], [responses[i] for i in idx], tokenizer.pad_id, max_len,
                            bool(getattr(cfg_sft, "padding_free", False)))
        state, opt_state, metrics = step_fn(state, opt_state, batch)
        if log_fn is not None or progress:
            m = {k: float(v) for k, v in metrics.items()}
            if log_fn is not None:
                log_fn(step, m)
            bar.set_postfix(loss=f"{m['loss']:.3f}", acc=f"{m['token_accuracy']:.2f}")
    nnx.update(model, state)
    return model
