"""The run-config loader: a frozen dataclass tree, every shipped YAML loads, and every value that
would fail after a run starts fails in ``load_config`` with one line naming the key."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from rhyme_jax.config import (ConfigError, DataSection, GRPOSection, RunConfig, load_config,
                              schema_fields, to_dict, to_yaml)
from rhyme_jax.config.checks import field_types, literal_choices

REPO = Path(__file__).resolve().parents[1]
DEFAULT = str(REPO / "configs" / "default.yaml")
YAMLS = sorted((REPO / "configs").rglob("*.yaml"))


def test_load_config_returns_a_frozen_dataclass_tree():
    cfg = load_config(DEFAULT, ["grpo.steps=7"])
    assert isinstance(cfg, RunConfig) and dataclasses.is_dataclass(cfg)
    assert cfg.grpo.steps == 7 and cfg.rollout.temperature == 1.0 and cfg.model.tiny.num_layers == 4
    for obj, name in ((cfg, "grpo"), (cfg.grpo, "steps"), (cfg.model.tiny, "head_dim")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(obj, name, getattr(obj, name))
    assert hash(cfg) == hash(load_config(DEFAULT, ["grpo.steps=7"]))  # frozen + eq: hashable


@pytest.mark.parametrize("path", YAMLS, ids=[str(p.relative_to(REPO / "configs")) for p in YAMLS])
def test_every_shipped_yaml_loads(path):
    assert isinstance(load_config(path), RunConfig)


def test_to_yaml_round_trips(tmp_path):
    cfg = load_config(DEFAULT, ["grpo.steps=7", "model.prompt_template='Q {question}\\n'"])
    saved = tmp_path / "config.yaml"
    saved.write_text(to_yaml(cfg))
    assert load_config(saved) == cfg
    assert list(to_dict(cfg)) == [f.name for f in dataclasses.fields(RunConfig)]
    assert sorted(schema_fields()) == sorted(_leaf_keys(to_dict(cfg)))


def _leaf_keys(d: dict, prefix: str = "") -> list[str]:
    """Dotted keys of the nested sections; a mapping-valued field (``reward.kwargs``) is one key."""
    out, mappings = [], {"reward.kwargs"}
    for k, v in d.items():
        nested = isinstance(v, dict) and prefix + k not in mappings
        out += _leaf_keys(v, f"{prefix}{k}.") if nested else [prefix + k]
    return out


def test_unknown_and_removed_keys_fail_naming_the_key(tmp_path):
    path = tmp_path / "old.yaml"
    path.write_text("rollout:\n  prefill_chunk: 0\n")  # removed: no code read it
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value).startswith(f"{path}: rollout.prefill_chunk")
    with pytest.raises(ConfigError, match="grpo.nosuch"):
        load_config(DEFAULT, ["grpo.nosuch=1"])
    with pytest.raises(ConfigError, match=r"rollout.top_k: .*not a YAML value|rollout.top_k"):
        load_config(DEFAULT, ["rollout.top_k=[1"])


def test_choices_are_the_literal_annotations():
    assert literal_choices(field_types(GRPOSection)["loss_agg"]) == (
        "token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm", "step_token_mean")
    assert literal_choices(field_types(GRPOSection)["scale_rewards"]) == ("group", "batch", "none")
    with pytest.raises(ConfigError, match=r"data.answer_extraction='regex' must be one of \['marker', 'last_number'\]"):
        DataSection(answer_extraction="regex")  # checked on direct construction too
    with pytest.raises(ConfigError, match="model.tiny.family='gpt2' must be one of"):
        load_config(DEFAULT, ["model.tiny.family=gpt2"])


# Values that got past load_config before and failed after the run had started (tracebacks from
# the optimizer, the loss, the engine, the mesh or the drafter), and their boundaries.
BAD_VALUES = [
    ("grpo.learning_rate=0", "grpo.learning_rate"),
    ("grpo.learning_rate=-1e-3", "grpo.learning_rate"),
    ("sft.learning_rate=0", "sft.learning_rate"),
    ("grpo.learning_rate=nan", "grpo.learning_rate"),
    ("grpo.max_grad_norm=inf", "grpo.max_grad_norm"),
    ("rollout.temperature=0", "rollout.temperature"),
    ("rollout.temperature=-1", "rollout.temperature"),
    ("rollout.top_p=0", "rollout.top_p"),
    ("rollout.top_p=1.5", "rollout.top_p"),
    ("rollout.top_k=-1", "rollout.top_k"),
    ("rollout.page_size=0", "rollout.page_size"),
    ("rollout.num_pages=-1", "rollout.num_pages"),
    ("rollout.num_pages=5", "rollout.num_pages"),  # < one full-length sequence + scratch page
    ("rollout.max_verify_tokens=-1", "rollout.max_verify_tokens"),
    ("grpo.steps=0", "grpo.steps"),
    ("grpo.minibatches=3", "grpo.minibatches"),  # 128 rows do not split into 3
    ("grpo.minibatches=256", "grpo.minibatches"),
    ("grpo.eps_low=-0.1", "grpo.eps_low"),
    ("grpo.eps_high=-0.1", "grpo.eps_high"),
    ("grpo.kl_coef=-1", "grpo.kl_coef"),
    ("grpo.kl_ratio_weighted=true", "grpo.kl_ratio_weighted"),  # kl_coef is 0: nothing to weight
    ("grpo.importance_sampling_level=row", "grpo.importance_sampling_level"),
    ("grpo.entropy_coef=-0.01", "grpo.entropy_coef"),
    ("grpo.num_iterations=0", "grpo.num_iterations"),
    ("reward.fns=[{fn: bad}]", "reward.fns[0].fn"),
    ("reward.fns=[{fn: 'a:b'}, {fn: 'c:d', weight: .nan}]", "reward.fns[1].weight"),
    ("reward.fns=[{fn: 'a:b', wt: 1}]", "reward.fns"),  # unknown field of an entry
    ("reward.fns=[{fn: 'a:b'}, {fn: 'c:b'}]", "reward.fns"),  # two functions logged as reward/b/mean
    ("grpo.weight_decay=-1", "grpo.weight_decay"),
    ("sft.weight_decay=-1", "sft.weight_decay"),
    ("sft.steps=-1", "sft.steps"),
    ("grpo.warmup_steps=-1", "grpo.warmup_steps"),
    ("grpo.max_consecutive_nonfinite=0", "grpo.max_consecutive_nonfinite"),
    ("data.num_train=0", "data.num_train"),
    ("data.min_steps=0", "data.min_steps"),
    ("data.max_steps=1", "data.max_steps"),
    ("data.max_number=1", "data.max_number"),
    ("data.tokenizer_vocab_size=0", "data.tokenizer_vocab_size"),
    ("model.tiny.num_kv_heads=3", "model.tiny.num_kv_heads"),
    ("model.tiny.hidden_size=0", "model.tiny.hidden_size"),
    ("model.tiny.rope_theta=0", "model.tiny.rope_theta"),
    ("model.prompt_template='{q}'", "model.prompt_template"),
    ("run.seed=-1", "run.seed"),
    ("run.seed=4294967296", "run.seed"),
    ("run.eval_every=-1", "run.eval_every"),
    ("run.eval_samples=-1", "run.eval_samples"),
    ("run.name=", "run.name"),
    ("run.name=' '", "run.name"),
    ("run.init_from=/nonexistent/params", "run.init_from"),
    ("spec.pattern_max=1000", "spec.pattern_max"),
    ("spec.pattern_min=0", "spec.pattern_min"),
    ("spec.fixed_window=33", "spec.fixed_window"),
    ("spec.history_depth=0", "spec.history_depth"),
    ("spec.min_token_prob=1", "spec.min_token_prob"),
    ("parallel.rollout_tensor=4", "parallel.rollout_tensor"),  # the demo model has 2 KV heads
    ("parallel.num_processes=-1", "parallel.num_processes"),
    ("parallel.process_id=-2", "parallel.process_id"),
    ("parallel.tensor=-2", "parallel.tensor"),
    ("sched.growth=nan", "sched.growth"),
    ("sched.growth=0", "sched.growth"),
    ("sched.num_groups=-1", "sched.num_groups"),
    ("sched.cost_model=/nonexistent/cost.json", "sched.cost_model"),
]


@pytest.mark.parametrize("override, key", BAD_VALUES, ids=[o for o, _ in BAD_VALUES])
def test_bad_values_fail_in_load_config_naming_the_key(override, key):
    with pytest.raises(ConfigError) as info:
        load_config(DEFAULT, [override])
    msg = str(info.value)
    assert msg.startswith(DEFAULT) and f": {key}" in msg and "\n" not in msg


@pytest.mark.parametrize("overrides, key", [
    (["parallel.data=-1", "parallel.fsdp=-1"], "parallel.data and parallel.fsdp are both -1"),
    (["parallel.fsdp=2", "grpo.prompts_per_step=1", "grpo.samples_per_prompt=3"], "grpo.prompts_per_step"),
    (["data.min_steps=3", "data.max_steps=2"], "data.max_steps=2 must be >= 3"),
    (["sft.steps=5", "sft.warmup_steps=6"], "sft.warmup_steps=6 must be in [0, sft.steps=5]"),
    (["reward.fn=a:b", "reward.fns=[{fn: 'c:d'}]"], "reward.fn='a:b' and reward.fns are both set"),
], ids=["two-fill-axes", "rows-over-shards", "steps-order", "sft-warmup", "fn-and-fns"])
def test_cross_field_checks(overrides, key):
    with pytest.raises(ConfigError, match="^" + DEFAULT) as info:
        load_config(DEFAULT, overrides)
    assert key in str(info.value)


@pytest.mark.parametrize("override", [
    "rollout.num_pages=11",  # (96 + 64) / 16 = 10 pages + scratch page 0
    "rollout.top_p=1", "rollout.top_k=1000000", "grpo.max_grad_norm=0", "grpo.kl_coef=0.01",
    "sft.steps=0", "spec.pattern_max=256", "spec.pattern_min=7", "run.eval_every=5",
    "parallel.data=-1", "parallel.rollout_tensor=2", "run.seed=4294967295",
    "model.prompt_template='Q {question} {{a}}'", "grpo.importance_sampling_level=sequence",
    "grpo.entropy_coef=0", "reward.fns=[{fn: 'a:b', weight: -0.5, kwargs: {k: 1}}, {fn: 'c.d:e'}]",
])
def test_boundary_values_still_load(override):
    load_config(DEFAULT, [override])


# Settings under which GRPO (or SFT) runs without ever changing the policy (RunConfig's
# _check_learning_signal): each fails at load naming the key, in one line.
NO_LEARNING = [
    # group of one: advantage = reward - group mean = 0 on every row
    (["grpo.samples_per_prompt=1"], "grpo.samples_per_prompt=1 must be >= 2"),
    (["grpo.samples_per_prompt=1", "grpo.kl_coef=0.05"], "grpo.samples_per_prompt=1"),
    # greedy rollouts: one response n times, one reward, advantage 0
    (["rollout.top_k=1"], "rollout.top_k=1"),
    # one optimizer step, and warmup makes update 0 run at rate 0
    (["grpo.steps=1", "grpo.warmup_steps=1", "grpo.minibatches=1"], "grpo.warmup_steps=1"),
    (["sft.steps=1", "sft.warmup_steps=1"], "sft.warmup_steps=1"),
]


@pytest.mark.parametrize("overrides, key", NO_LEARNING, ids=[" ".join(o) for o, _ in NO_LEARNING])
def test_settings_that_cannot_learn_fail_at_load(overrides, key):
    with pytest.raises(ConfigError) as info:
        load_config(DEFAULT, overrides)
    msg = str(info.value)
    assert msg.startswith(DEFAULT) and f": {key}" in msg and "\n" not in msg


@pytest.mark.parametrize("overrides", [
    ["grpo.samples_per_prompt=2"], ["rollout.top_k=2"], ["grpo.steps=1", "grpo.warmup_steps=0"],
    ["grpo.steps=1", "grpo.warmup_steps=1", "grpo.minibatches=2"],  # update 1 runs at half the peak
    ["grpo.steps=1", "grpo.warmup_steps=1", "grpo.num_iterations=2"],  # likewise: two passes
    ["grpo.steps=2", "grpo.warmup_steps=2"], ["sft.steps=2", "sft.warmup_steps=2"],
    ["sft.steps=1", "sft.warmup_steps=0"],
    ["grpo.eps_low=0", "grpo.eps_high=0"],  # still a gradient: -min(r A, A) at r = 1 flows through r A
], ids=lambda o: " ".join(o))
def test_edges_of_the_learning_signal_checks_still_load(overrides):
    load_config(DEFAULT, overrides)


def test_trl_loss_keys_reach_the_update():
    """grpo.kl_ratio_weighted / importance_sampling_level / entropy_coef are the keywords the GRPO
    step gets (grpo_step.loss_options; TRL use_bias_correction_kl / importance_sampling_level /
    entropy_coef); the defaults are today's loss: False, "token", 0.0."""
    from rhyme_jax.train.grpo_step import loss_options

    assert loss_options(load_config(DEFAULT).grpo) == {
        "kl_ratio_weighted": False, "importance_sampling_level": "token", "entropy_coef": 0.0}
    g = load_config(DEFAULT, ["grpo.kl_coef=0.04", "grpo.kl_ratio_weighted=true",
                              "grpo.importance_sampling_level=sequence", "grpo.entropy_coef=0.01"]).grpo
    assert loss_options(g) == {"kl_ratio_weighted": True, "importance_sampling_level": "sequence",
                               "entropy_coef": 0.01}
