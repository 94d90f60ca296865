"""``RunConfig``: the whole run configuration, and the checks that span its sections.

Only value checks live here: checks that need the machine (the device count, the backend, the
attention kernels, the distributed environment) run before any work in
``rhyme_jax.train.preflight.prepare`` and the mesh builders (``rhyme_jax.parallel.mesh``), so a
YAML file loads anywhere and ``rhyme-jax memory`` sizes configs for other machines.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rhyme_jax.config.checks import ConfigError
from rhyme_jax.config.sections import (DataSection, GRPOSection, LoRASection, ModelSection, ParallelSection,
                                       RewardSection, RolloutSection, RunSection, SchedSection,
                                       SFTSection, SpecSection)


@dataclass(frozen=True)
class RunConfig:
    """Top-level run configuration (configs/*.yaml), as ``load_config`` returns it: frozen,
    every section checked on construction.

    Raises:
      ConfigError: a section's own check, or one across sections (the message starts with the
        dotted key of a field involved).
    """

    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    reward: RewardSection = field(default_factory=RewardSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    sft: SFTSection = field(default_factory=SFTSection)
    grpo: GRPOSection = field(default_factory=GRPOSection)
    run: RunSection = field(default_factory=RunSection)
    spec: SpecSection = field(default_factory=SpecSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    sched: SchedSection = field(default_factory=SchedSection)
    lora: LoRASection = field(default_factory=LoRASection)

    def __post_init__(self):
        _check_batch_layout(self)
        _check_tiny_layout(self)
        _check_learning_signal(self)
        _check_dapo(self)
        _check_pack_lengths(self)
        _check_tis(self)


def _check_batch_layout(cfg: RunConfig) -> None:
    """The rollout batch splits into ``grpo.minibatches`` minibatches whose rows shard evenly over
    ``parallel.data x parallel.fsdp`` (when neither is -1, i.e. known without the devices)."""
    g, p = cfg.grpo, cfg.parallel
    if p.data < 1 or p.fsdp < 1:
        return
    rows, shards = g.prompts_per_step * g.samples_per_prompt, p.data * p.fsdp
    if rows % (g.minibatches * shards):
        raise ConfigError(f"grpo.prompts_per_step * grpo.samples_per_prompt = {rows} rows must split into "
                          f"grpo.minibatches={g.minibatches} minibatches of a multiple of parallel.data x "
                          f"parallel.fsdp = {shards} rows")


def _check_learning_signal(cfg: RunConfig) -> None:
    """Settings under which GRPO (or the SFT warm start) trains without ever changing the policy
    fail here, naming the key, instead of running quietly at reward 0:

    * ``grpo.samples_per_prompt=1``: an advantage is the reward minus its group's mean (GRPO,
      Shao et al. 2024 arXiv 2402.03300, eq. 3; Dr.GRPO and batch-std scaling subtract the same
      mean), so a group of one has advantage 0 on every row and the surrogate's gradient is 0
      (with ``grpo.kl_coef > 0`` only the pull back to the reference, which is where the policy
      starts, remains).
    * ``rollout.top_k=1``: sampling keeps only the most likely token, so the n samples of a prompt
      are one response n times, get one reward, and every advantage is 0.
    * a run of one optimizer step that warms up: warmup ramps linearly from rate 0
      (``optim.make_schedule``), so update 0 runs at rate 0; with ``grpo.steps x
      grpo.minibatches x grpo.num_iterations = 1`` (or ``sft.steps = 1``) it is the only update.

    Raises:
      ConfigError: one line starting with the key.
    """
    g, r, sft = cfg.grpo, cfg.rollout, cfg.sft
    if g.samples_per_prompt < 2:
        raise ConfigError(f"grpo.samples_per_prompt={g.samples_per_prompt} must be >= 2: an advantage is the "
                          f"reward minus its group's mean, so a group of one always has advantage 0 and GRPO "
                          f"never changes the policy")
    if r.top_k == 1:
        raise ConfigError("rollout.top_k=1 samples greedily: the grpo.samples_per_prompt responses of a prompt "
                          "are the same tokens with the same reward, so every advantage is 0 (0 = top-k off)")
    if g.steps * g.minibatches * g.num_iterations == 1 and g.warmup_steps > 0:
        raise ConfigError(f"grpo.warmup_steps={g.warmup_steps} leaves a run of one optimizer step (grpo.steps x "
                          f"grpo.minibatches x grpo.num_iterations = 1) at learning rate 0: warmup starts at 0 (use 0)")
    if sft.steps == 1 and sft.warmup_steps > 0:
        raise ConfigError(f"sft.warmup_steps={sft.warmup_steps} leaves a warm start of one step (sft.steps=1) at "
                          f"learning rate 0: warmup starts at 0 (use 0)")


def _check_tiny_layout(cfg: RunConfig) -> None:
    """The demo model's KV heads split over a rollout worker's devices (the KV pool is sharded by
    KV head)."""
    if cfg.model.path:
        return
    heads, tensor = cfg.model.tiny.num_kv_heads, cfg.parallel.rollout_tensor
    if heads % tensor:
        raise ConfigError(f"parallel.rollout_tensor={tensor} must divide model.tiny.num_kv_heads={heads}")


def _check_tis(cfg: RunConfig) -> None:
    """``grpo.tis`` recomputes the old logprobs with the trainer's full params; a LoRA run's
    trainer state is its adapters (``train/lora_state.py``), so the two are refused together.

    Raises:
      ConfigError: one line starting with the key.
    """
    if cfg.grpo.tis and cfg.lora.rank > 0:
        raise ConfigError(f"grpo.tis=true is not supported with lora.rank={cfg.lora.rank} > 0: the trainer's "
                          f"recompute of the old logprobs needs the merged weights (use rollout.dtype=float32 "
                          f"and grpo.tis=false, or full fine-tuning)")


def _check_dapo(cfg: RunConfig) -> None:
    """DAPO's options (arXiv 2503.14476) against the rest of the run:

    * ``grpo.dynamic_sampling`` refills a step with extra rollouts of the current params between
      scoring and the update; ``sched.pipeline=one_step_off`` has the next rollout running then
      (or queued, with ``sched.cross_step``), so the two are refused together
      (``train/dynamic_sampling.py``).
    * ``reward.soft_overlong_cache`` is a share of the response budget: at most
      ``rollout.max_new_tokens``.

    Raises:
      ConfigError: one line starting with the key.
    """
    if cfg.grpo.dynamic_sampling and cfg.sched.pipeline != "sync":
        raise ConfigError(f"grpo.dynamic_sampling=true needs sched.pipeline=sync (got sched.pipeline="
                          f"{cfg.sched.pipeline!r}): its refill rollouts run between scoring and the update, "
                          f"where one_step_off already runs the next step's rollout")
    cache, budget = cfg.reward.soft_overlong_cache, cfg.rollout.max_new_tokens
    if cache > budget:
        raise ConfigError(f"reward.soft_overlong_cache={cache} exceeds rollout.max_new_tokens={budget} (the "
                          f"penalty interval is [max_new_tokens - soft_overlong_cache, max_new_tokens])")


def _check_pack_lengths(cfg: RunConfig) -> None:
    """The largest of ``grpo.pack_lengths`` holds the longest sequence a rollout can give
    (``rollout.max_prompt_len + rollout.max_new_tokens``), so no row is left without a buffer.

    Raises:
      ConfigError: one line starting with the key.
    """
    lengths, longest = cfg.grpo.pack_lengths, cfg.rollout.max_prompt_len + cfg.rollout.max_new_tokens
    if lengths and lengths[-1] < longest:
        raise ConfigError(f"grpo.pack_lengths={list(lengths)}: the largest must be >= rollout.max_prompt_len + "
                          f"rollout.max_new_tokens = {longest} (the longest sequence a rollout can give)")
