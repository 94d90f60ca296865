"""Run configuration: a frozen dataclass tree built from YAML files and dotted CLI overrides.

``load_config(path, overrides)`` returns a ``RunConfig`` (sections ``model, data, reward, rollout,
sft, grpo, run, spec, parallel, sched, lora``; attribute access ``cfg.grpo.steps``). OmegaConf parses and
merges the YAML and ``--set a.b=c`` overrides onto the schema, so a typo in a key fails naming
it; each section then checks its values in ``__post_init__`` (allowed values are the fields'
``Literal`` annotations) and ``RunConfig`` checks across sections, so a bad value fails at load
with one line ``<file>: <key>=<value> must be ...`` before any work starts.

Modules: ``checks`` (ConfigError, value checks), ``sections`` (the section dataclasses),
``run_config`` (RunConfig, cross-section checks), ``loader`` (load_config, to_dict, to_yaml).
"""

from rhyme_jax.config.checks import ConfigError
from rhyme_jax.config.loader import check_required, load_config, required_keys, schema_fields, to_dict, to_yaml
from rhyme_jax.config.run_config import RunConfig
from rhyme_jax.config.sections import (DataSection, GRPOSection, LoRASection, ModelSection, ParallelSection,
                                       RewardSection, RolloutSection, RunSection, SchedSection,
                                       SFTSection, SpecSection, TinyModelConfig)

__all__ = [
    "ConfigError", "DataSection", "GRPOSection", "LoRASection", "ModelSection", "ParallelSection", "RewardSection",
    "RolloutSection",
    "RunConfig", "RunSection", "SFTSection", "SchedSection", "SpecSection", "TinyModelConfig",
    "check_required", "load_config", "required_keys", "schema_fields", "to_dict", "to_yaml",
]
