"""Checks of a run config that need this machine, run before any work by every entry point
(``rhyme-jax`` commands, ``GRPOTrainer``, the SFT warm start).

``rhyme_jax.config`` reads YAML and checks values only (it imports nothing but the standard library,
YAML and OmegaConf), so a config loads anywhere; what depends on where it runs is checked here,
with the same one-line ``ConfigError`` naming the key.
"""

from __future__ import annotations

from pathlib import Path

from rhyme_jax.config import ConfigError, RunConfig
from rhyme_jax.io.wandb_sink import WandbMissingError, require_wandb


def prepare(cfg: RunConfig) -> RunConfig:
    """``cfg`` unchanged, after the machine checks below (idempotent, cheap: no model, no compile).

    * multi-host settings (``parallel.coordinator_address`` and friends, or the environment they
      come from) are complete (``parallel.distributed.settings``);
    * ``reward.fn`` imports and has the documented signature (``data.custom_reward.task_reward``);
    * ``wandb`` imports when ``run.report_to`` lists it (``io.wandb_sink.require_wandb``; not
      imported otherwise);
    * ``model.chat_template`` names a template the tokenizer has, or a valid jinja file
      (``policy.select_chat_template``; a known model not imported yet is checked by
      ``build_tokenizer`` right after its import);
    * single process only (a multi-host run must not touch the backend before
      ``jax.distributed.initialize``; its engines check instead): ``rollout.attention_impl``
      names an implementation that runs on this backend, and for the Triton kernels
      (``pallas_gpu*``) ``rollout.page_size`` (and the demo model's ``head_dim``) fit its tiles.

    Raises:
      ConfigError: one line starting with the key (``RewardError`` is one).
    """
    from rhyme_jax.data.custom_reward import task_reward
    from rhyme_jax.parallel import distributed

    task_reward(cfg)
    if "wandb" in cfg.run.report_to:
        try:
            require_wandb()
        except WandbMissingError as exc:
            raise ConfigError(str(exc)) from None
    _check_chat_template(cfg)

    try:
        multi_host = distributed.settings(cfg.parallel)
    except distributed.DistributedConfigError as exc:
        raise ConfigError(str(exc)) from None
    if multi_host is None:
        _check_attention(cfg)
    return cfg


def _check_chat_template(cfg: RunConfig) -> None:
    """``model.chat_template`` loads for the run's tokenizer directory, where that exists already."""
    from rhyme_jax.model.chat_template import ChatTemplateError
    from rhyme_jax.train.policy import select_chat_template, tokenizer_file

    if cfg.model.chat_template == "none":
        return
    directory = tokenizer_file(cfg, Path(cfg.run.runs_dir) / cfg.run.name).parent
    if cfg.model.path and not directory.is_dir():  # a known model imported on first use, or a bad path
        return
    try:
        select_chat_template(cfg, directory)
    except ChatTemplateError as exc:
        raise ConfigError(str(exc)) from None


def _check_attention(cfg: RunConfig) -> None:
    """``rollout.attention_impl`` resolves here, and the Triton kernels' tile constraints hold."""
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
