"""``RunConfig``: the whole run configuration, and the checks that span its sections.

Checks that need the device count are left to the mesh builders (``rhyme_jax.parallel.mesh``):
``rhyme-jax memory`` sizes configs for machines other than the one it runs on.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rhyme_jax.config.checks import ConfigError
from rhyme_jax.config.sections import (DataSection, GRPOSection, ModelSection, ParallelSection,
                                       RolloutSection, RunSection, SchedSection, SFTSection,
                                       SpecSection)


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
    rollout: RolloutSection = field(default_factory=RolloutSection)
    sft: SFTSection = field(default_factory=SFTSection)
    grpo: GRPOSection = field(default_factory=GRPOSection)
    run: RunSection = field(default_factory=RunSection)
    spec: SpecSection = field(default_factory=SpecSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    sched: SchedSection = field(default_factory=SchedSection)

    def __post_init__(self):
        _check_batch_layout(self)
        _check_tiny_layout(self)
        _check_backend(self)


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


def _check_tiny_layout(cfg: RunConfig) -> None:
    """The demo model's KV heads split over a rollout worker's devices (the KV pool is sharded by
    KV head)."""
    if cfg.model.path:
        return
    heads, tensor = cfg.model.tiny.num_kv_heads, cfg.parallel.rollout_tensor
    if heads % tensor:
        raise ConfigError(f"parallel.rollout_tensor={tensor} must divide model.tiny.num_kv_heads={heads}")


def _check_backend(cfg: RunConfig) -> None:
    """Multi-host settings are complete, and (single-process only: a multi-host run must not touch
    the backend before ``jax.distributed.initialize``; its engines check instead)
    ``rollout.attention_impl`` names an implementation that runs here with this page size."""
    from rhyme_jax.parallel import distributed

    try:
        multi_host = distributed.settings(cfg.parallel)
    except distributed.DistributedConfigError as exc:
        raise ConfigError(str(exc)) from None
    if multi_host is not None:
        return
    from pallas_kernels.ragged_paged_attention import api as attention_api

    try:
        name = attention_api.resolve_name(attention_api.parse_implementation(cfg.rollout.attention_impl))
    except ValueError as exc:
        raise ConfigError(f"rollout.attention_impl: {exc}") from None
    if name.startswith("pallas_gpu"):  # Triton tiles: pages_per_kv_block * page_size a power of two
        size = cfg.rollout.page_size
        if size & (size - 1):
            raise ConfigError(f"rollout.page_size={size} must be a power of two for attention "
                              f"implementation {name!r}")
        dim = cfg.model.tiny.head_dim
        if not cfg.model.path and (dim < 16 or dim & (dim - 1)):
            raise ConfigError(f"model.tiny.head_dim={dim} must be a power of two >= 16 for attention "
                              f"implementation {name!r}")
