"""The training state of a LoRA run (``lora.rank > 0``): adapters trained, base weights frozen.

A LoRA run's trainer state (``GRPOTrainer.state``, what the update donates, the optimizer holds
and the checkpoints save) is the adapters alone (``model.lora.split_lora``: every
``nnx.LoRAParam``, ``[L, in, r]`` / ``[L, r, out]`` per targeted projection). The base params (the
policy as ``assembly.build_policy`` and the warm start made them, float32) are kept once in
``LoRAParts.base`` and never change:

* the update (``make_grpo_step`` with ``frozen=(base[, dropout keys])``) merges them with the
  adapters into the LoRA decoder (``model.lora.lora_decoder``) and differentiates the adapters
  only, so AdamW's moments exist for the adapters only;
* the weight sync to the rollout engines (``RolloutParts.states``) first calls
  ``LoRAParts.merge``: one jitted ``W + (alpha / r) A B`` per adapted kernel on the train mesh,
  cast to ``model.dtype``, once per sync (every step; each evaluation). The engines keep the base
  ``Decoder`` graph and its kernels: they never see an adapter;
* the KL reference (``grpo.kl_coef > 0``) is the base itself (the adapted policy starts equal to
  it, ``B = 0``; TRL with a ``peft_config`` disables the adapter for the reference), not a copy;
* a resumed run rebuilds the base exactly as the first start did (``model.path`` / the tiny
  model's seed, then the warm start) and restores the adapters and their optimizer state.

Dropout keys (``lora.dropout > 0``): per optimizer step, ``fold_in(key(run.seed + 1), count)``
with ``count`` the optimizer's update counter (restored with its state, so a resumed run drops
the same features), then per adapter and layer (``model.lora.dropout_keys``). The micro-batches
of one optimizer step share the keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from rhyme_jax.model.config import ModelConfig
from rhyme_jax.model.lora import LoRASpec, dropout_keys, init_adapters, lora_decoder, merge_adapters, split_lora
from rhyme_jax.parallel.rules import param_shardings
from rhyme_jax.train.accumulate import update_step_maker
from rhyme_jax.train.grpo_step import TrainShardings, UpdateMemory, loss_options, make_logprob_fn
from rhyme_jax.train.optim import PARAM_DTYPE
from rhyme_jax.train.policy import compute_dtype, compute_params

if TYPE_CHECKING:
    from rhyme_jax.config import RunConfig

ADAPTER_SEED_OFFSET = 1  # adapters and dropout draw from run.seed + 1 (the tiny model's init uses run.seed)


def lora_spec(cfg: RunConfig) -> LoRASpec | None:
    """The run's ``LoRASpec``, or None when ``lora.rank`` is 0 (full fine-tuning)."""
    return LoRASpec.from_section(cfg.lora).check() if cfg.lora.rank > 0 else None


def lora_structure(model_cfg: ModelConfig, cfg: RunConfig) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
    """``(graphdef, abstract adapters, abstract dropout keys)`` of the run's LoRA decoder (shapes
    only; nothing the size of the model is allocated).

    Raises:
      LoRAError: ``lora.*`` out of range.
    """
    model = lora_decoder(model_cfg, lora_spec(cfg), dtype=compute_dtype(cfg.model.dtype), param_dtype=PARAM_DTYPE,
                         **cfg.model.decoder_options())
    graphdef, adapters, keys, _ = split_lora(model)
    return graphdef, adapters, keys


@dataclass
class LoRAParts:
    """What a LoRA run keeps besides its trained adapters.

    Attributes:
      spec: rank, alpha, dropout, targets (``lora`` section).
      graphdef: the LoRA decoder's graph (base ``Decoder`` + ``LoRALinear`` projections).
      base: the frozen base params (train layout, float32), never donated.
      keys_like: the dropout keys' abstract state (empty without dropout).
      merge: jitted ``adapters -> Decoder params`` in ``model.dtype`` (``W + scale A B``), laid out
        like ``base``: the weight sync's first stage.
      seed: ``run.seed + ADAPTER_SEED_OFFSET`` (adapter init and dropout keys).
    """

    spec: LoRASpec
    graphdef: nnx.GraphDef
    base: Any
    keys_like: Any
    merge: Callable
    seed: int


def build_lora(cfg: RunConfig, model_cfg: ModelConfig, base: Any, mesh: jax.sharding.Mesh) -> tuple[LoRAParts | None, Any]:
    """``(parts, adapters)`` of a LoRA run on the train ``mesh``; ``(None, base)`` when ``lora.rank``
    is 0 (the state trains as it is).

    Args:
      model_cfg: the policy's architecture; ``base``: its params (after the warm start).

    Returns:
      The parts and the initial adapters (``init_adapters`` from ``run.seed + 1``; ``B = 0``, so the
      adapted policy equals the base), replicated on ``mesh`` (``parallel.rules``: adapters are small).

    Raises:
      LoRAError: ``lora.*`` out of range.
    """
    spec = lora_spec(cfg)
    if spec is None:
        return None, base
    graphdef, adapters_like, keys_like = lora_structure(model_cfg, cfg)
    seed = int(cfg.run.seed) + ADAPTER_SEED_OFFSET
    adapters = jax.jit(lambda: init_adapters(adapters_like, jax.random.key(seed)),
                       out_shardings=param_shardings(adapters_like, mesh))()
    dtype = compute_dtype(cfg.model.dtype)
    merge = jax.jit(lambda b, a: compute_params(merge_adapters(b, a, spec.scale), dtype),
                    out_shardings=param_shardings(base, mesh))
    return LoRAParts(spec, graphdef, base, keys_like, lambda a: merge(base, a), seed), adapters


def optimizer_count(opt_state: Any) -> jax.Array:
    """The optimizer's update counter (the first ``count`` leaf of the optax state, int32[])."""
    found = optax.tree_utils.tree_get_all_with_path(opt_state, "count")
    if not found:
        raise ValueError("lora_state: the optimizer state has no 'count' (dropout keys follow it)")
    return found[0][1]


def _frozen(parts: LoRAParts, mesh: jax.sharding.Mesh | None) -> tuple[Callable, Any]:
    """``(frozen_of(opt_state) -> frozen tuple, its shardings)`` for ``make_grpo_step``."""
    if not jax.tree.leaves(parts.keys_like):
        return (lambda _: (parts.base,)), ((param_shardings(parts.base, mesh),) if mesh is not None else None)
    root = jax.random.key(parts.seed)
    keys_of = lambda opt_state: dropout_keys(parts.keys_like, jax.random.fold_in(root, optimizer_count(opt_state)))
    if mesh is None:
        keys_fn = jax.jit(keys_of)
        return (lambda o: (parts.base, keys_fn(o))), None
    keys_sh = param_shardings(parts.keys_like, mesh)
    keys_fn = jax.jit(keys_of, out_shardings=keys_sh)
    return (lambda o: (parts.base, keys_fn(o))), (param_shardings(parts.base, mesh), keys_sh)


def lora_learner(cfg: RunConfig, base_graphdef: nnx.GraphDef, parts: LoRAParts,
                 optimizer: optax.GradientTransformation, layout: TrainShardings | None
                 ) -> tuple[Callable, Callable, Any]:
    """``(step_fn, ref_logprob_fn, ref_state)`` of a LoRA run's ``assembly.Learner``.

    ``step_fn(adapters, opt_state, batch) -> (adapters, opt_state, metrics)``: ``make_grpo_step``
    over the LoRA graph with the base (and this step's dropout keys) frozen; ``layout.params`` /
    ``layout.opt_state`` are the adapters' and their optimizer state's shardings. The KL reference
    is the base model (``base_graphdef`` with ``parts.base``; None when ``grpo.kl_coef`` is 0).
    """
    g = cfg.grpo
    mesh = layout.mesh if layout is not None else None
    frozen_of, frozen_sh = _frozen(parts, mesh)
    step = update_step_maker(g.pack_lengths)(parts.graphdef, optimizer, eps_low=g.eps_low, eps_high=g.eps_high, kl_coef=g.kl_coef,
                          loss_agg=g.loss_agg, temperature=cfg.rollout.temperature, shardings=layout,
                          memory=UpdateMemory(g.micro_batch_tokens, g.logit_chunk, g.remat),
                          frozen_shardings=frozen_sh, **loss_options(g))

    def step_fn(adapters, opt_state, batch):
        return step(adapters, opt_state, batch, frozen_of(opt_state))

    ref_layout = layout._replace(params=param_shardings(parts.base, mesh)) if layout is not None else None
    ref_fn = make_logprob_fn(base_graphdef, cfg.rollout.temperature, ref_layout, logit_chunk=g.logit_chunk)
    return step_fn, ref_fn, (parts.base if g.kl_coef > 0 else None)


def trainable_fraction(adapters: Any, base: Any) -> float:
    """Adapter parameters as a fraction of the base model's (PEFT ``print_trainable_parameters``)."""
    count = lambda tree: sum(int(jnp.size(x)) for x in jax.tree.leaves(tree))
    return count(adapters) / max(1, count(base))
