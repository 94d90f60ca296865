"""HistoPipe over real rollout workers (issue 6): scheduling changes time, never results.

The multi-worker checks run in a subprocess with 8 fake CPU devices (4 workers x 2 devices,
tests/sched_cases.py); one_step_off's weight versions are checked in process on one device.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from rhyme_jax.config import ConfigError, load_config
from rhyme_jax.io.rollout_log import load_rollouts
from conftest import selected_cases
from rhyme_jax.train.prompts import prompt_schedule
from rhyme_jax.train.trainer import GRPOTrainer

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
CONFIG = ROOT / "configs" / "tiny_test.yaml"


@pytest.fixture(scope="module")
def sched_cases(tmp_path_factory, request):
    out = tmp_path_factory.mktemp("sched") / "cases.json"
    env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu",
               PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(TESTS / "sched_cases.py"), str(out), *selected_cases(request)], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0 and out.is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("case", ["histopipe_same_greedy_responses", "migrated_tokens_equal_unmigrated",
                                  pytest.param("trainer_histopipe_run", marks=pytest.mark.slow)])  # CI time:
# two GRPO steps on 4 workers; the engine cases above run the same scheduler, planner and migration
def test_four_workers(sched_cases, case):
    """See the docstring of ``case_<case>`` in tests/sched_cases.py."""
    assert sched_cases[case]["ok"], sched_cases[case]["detail"]


def _reward(text, problem):
    return float(len(text) % 2)


def _responses(run_dir, step):
    return [r.tolist() for r in load_rollouts(run_dir, step)["responses"]]


@pytest.mark.parametrize("cross_step", [pytest.param(False, marks=pytest.mark.slow), True])  # CI time
def test_one_step_off_uses_the_documented_weights(tmp_path, cross_step):
    """one_step_off: rollout s >= 2 is sampled with the params after s - 2 updates (metrics
    rollout/weights_step, staleness 1): regenerating step 2 with the initial params and step 3
    with the params after one update reproduces the saved rollouts token for token, and the
    other version does not. Every step trains each of its prompts' n samples exactly once.
    With cross-step worker queues (rollout s + 2 queued right after update s) the same holds."""
    steps = 4 if cross_step else 3
    cfg = load_config(CONFIG, [f"run.runs_dir={tmp_path}", "sched.pipeline=one_step_off", f"grpo.steps={steps}",
                               f"sched.cross_step={str(cross_step).lower()}",
                               "grpo.learning_rate=0.05", "rollout.max_new_tokens=24"])
    tr = GRPOTrainer(cfg, reward_fn=_reward)
    try:
        versions = [jax.tree.map(np.array, tr.state)]
        metrics = []
        for step in range(1, steps + 1):
            metrics.append(tr.train_step(step))
            tr.step = step
            versions.append(jax.tree.map(np.array, tr.state))
        assert [m["rollout/weights_step"] for m in metrics] == [0.0, 0.0, 1.0, 2.0][:steps]
        assert [m["rollout/staleness"] for m in metrics] == [0.0, 1.0, 1.0, 1.0][:steps]
        assert [m["sched/cross_step"] for m in metrics] == [float(cross_step)] * steps

        def regenerate(step, version):
            return [t.tolist() for t in tr.pipeline.run(step, versions[version], version, []).rollout.result.tokens]

        assert regenerate(2, 0) == _responses(tr.run_dir, 2)
        assert regenerate(3, 1) == _responses(tr.run_dir, 3)
        assert regenerate(3, 2) != _responses(tr.run_dir, 3)  # the on-policy weights differ
        if cross_step:
            assert regenerate(4, 2) == _responses(tr.run_dir, 4)
        n = cfg.grpo.samples_per_prompt
        for step in range(1, steps + 1):
            ids = load_rollouts(tr.run_dir, step)["prompt_ids"]
            want = prompt_schedule(cfg.run.seed, 200, step, cfg.grpo.prompts_per_step)
            np.testing.assert_array_equal(ids, np.repeat(want, n))
    finally:
        tr.close()


def test_sched_config_is_validated():
    with pytest.raises(ConfigError, match="sched.mode='lifo'"):
        load_config(CONFIG, ["sched.mode=lifo"])
    with pytest.raises(ConfigError, match="sched.pipeline"):
        load_config(CONFIG, ["sched.pipeline=async"])
    with pytest.raises(ConfigError, match="sched.tail_fraction"):
        load_config(CONFIG, ["sched.tail_fraction=0"])
    with pytest.raises(ConfigError, match="sched.cross_step=true needs sched.pipeline=one_step_off"):
        load_config(CONFIG, ["sched.cross_step=true"])


DEFER = ["sched.pipeline=one_step_off", "sched.mode=histopipe", "sched.growth=0.01", "sched.tail_fraction=1.0",
         "grpo.steps=3", "rollout.max_new_tokens=24"]


def _trained(run_dir, steps):
    """Sorted prompt ids of every trained sample in the saved rollouts of ``steps``."""
    out = []
    for step in steps:
        r = load_rollouts(run_dir, step)
        out += [int(p) for p in r["prompt_ids"]]
    return sorted(out)


def _scheduled(cfg, steps):
    n = cfg.grpo.samples_per_prompt
    return sorted(int(p) for s in steps for p in np.repeat(prompt_schedule(cfg.run.seed, 200, s,
                                                                            cfg.grpo.prompts_per_step), n))


@pytest.mark.slow  # CI time: test_cross_step_deferral_trains_every_sample_once covers the default set
def test_one_step_off_deferral_trains_every_sample_once(tmp_path):
    """Forced deferral (growth 0.01, tail fraction 1.0): tails of each one_step_off rollout are
    stopped and their groups carried to the next step, where the partial responses are continued
    and the complete groups trained. Over the run every prompt's n samples are trained exactly
    once (across a resume: the slow test below)."""
    cfg = load_config(CONFIG, [f"run.runs_dir={tmp_path}", "run.name=a", *DEFER])
    tr = GRPOTrainer(cfg, reward_fn=_reward)
    try:
        metrics = []
        for step in (1, 2, 3):
            metrics.append(tr.train_step(step))
            tr.step = step
    finally:
        tr.close()
    carried = [m["rollout/carried_groups"] for m in metrics]
    assert carried[0] > 0 and carried[2] == 0  # the last step defers nothing
    assert metrics[0]["sched/deferred_share"] > 0 and metrics[1]["sched/continued_rows"] > 0
    assert _trained(tr.run_dir, (1, 2, 3)) == _scheduled(cfg, (1, 2, 3))
    lengths = [len(r) for s in (1, 2, 3) for r in load_rollouts(tr.run_dir, s)["responses"]]
    assert max(lengths) <= 24


def test_cross_step_deferral_trains_every_sample_once(tmp_path):
    """Cross-step queues with forced deferral over 4 steps: rollout s + 1 is already queued when
    step s's tails are stopped, so their groups are continued by rollout s + 2 and trained then;
    the last two steps defer nothing, and every prompt's n samples are trained exactly once."""
    cfg = load_config(CONFIG, [f"run.runs_dir={tmp_path}", "run.name=c", *DEFER, "grpo.steps=4",
                               "sched.cross_step=true"])
    tr = GRPOTrainer(cfg, reward_fn=_reward)
    try:
        metrics = []
        for step in (1, 2, 3, 4):
            metrics.append(tr.train_step(step))
            tr.step = step
            if step == 2:  # a checkpoint here keeps the groups queued rollouts 3 and 4 continue
                carried = metrics[0]["rollout/carried_groups"] + metrics[1]["rollout/carried_groups"]
                assert len(tr.pipeline.pending_carry()) == carried > 0
    finally:
        tr.close()
    assert metrics[0]["sched/deferred_share"] > 0 and metrics[1]["sched/continued_rows"] == 0
    assert metrics[2]["sched/continued_rows"] > 0 and metrics[2]["sched/deferred_share"] == 0
    assert _trained(tr.run_dir, (1, 2, 3, 4)) == _scheduled(cfg, (1, 2, 3, 4))


@pytest.mark.slow
@pytest.mark.parametrize("cross_step", [False, True])
def test_one_step_off_deferral_survives_a_resume(tmp_path, cross_step):
    """The deferral run interrupted after step 2 while groups are carried: the carried groups
    (with cross-step queues also those the queued rollouts were continuing) come back from the
    checkpoint and every sample is still trained exactly once."""
    steps = 4 if cross_step else 3
    cfg_b = load_config(CONFIG, [f"run.runs_dir={tmp_path}", "run.name=b", *DEFER, f"grpo.steps={steps}",
                                 f"sched.cross_step={str(cross_step).lower()}"])
    first = GRPOTrainer(cfg_b, reward_fn=_reward)
    try:
        for step in (1, 2):
            first.train_step(step)
            first.step = step
            first.save()
        pending = first.pipeline.pending_carry()
        assert pending, "the interrupted run carries groups into step 3"
    finally:
        first.close()
    second = GRPOTrainer(cfg_b, resume=True, reward_fn=_reward)
    try:
        assert second.step == 2 and len(second.pipeline.carry) == len(pending)
        for step in range(3, steps + 1):
            second.train_step(step)
            second.step = step
    finally:
        second.close()
    assert _trained(second.run_dir, range(1, steps + 1)) == _scheduled(cfg_b, range(1, steps + 1))


# The ablation suite's own base runs (python -m rhyme_lab ablate): the demo / recipe scaled down, so they
# change sizes as well as switches; the configs that include them switch one part each.
SCALED_ABLATION_RUNS = {"e2e_fifo.yaml", "histospec_per_step.yaml", "histospec_real.yaml", "histospec_tiny.yaml",
                        "learn_plain.yaml", "learn_real_plain.yaml", "learn_workers_fifo.yaml",
                        "longtail_goodput.yaml", "longtail_bound.yaml", "longtail_smollm2.yaml",
                        "longtail_plain_long.yaml", "longtail_recur.yaml"}  # the learning suites' base runs
SEED_RUNS = {"longtail_plain_seed1.yaml", "longtail_plain_long_seed1.yaml", "longtail_recur_seed1.yaml"}  # a learning run's second seed


def test_ablation_configs_load_and_switch_one_part_each():
    """configs/ablations/*.yaml: each loads, has its own run name, and (except the ablation suite's
    scaled base runs) differs from the config it includes only in the HistoSpec or the HistoPipe
    switches (plus 4 workers for the histopipe_* ones, and a HistoSpec one's verify token budget)."""
    from omegaconf import OmegaConf

    seen = set()
    for path in sorted((ROOT / "configs" / "ablations").glob("*.yaml")):
        (include,) = OmegaConf.load(path).defaults
        base = load_config(path.parent / include)
        cfg = load_config(path)
        assert cfg.run.name not in seen and cfg.run.name != base.run.name
        seen.add(cfg.run.name)
        if path.name in SCALED_ABLATION_RUNS:
            continue
        if path.name in SEED_RUNS:  # the run seed and the name, nothing else
            assert cfg.run.seed != base.run.seed, path.name
            same = dataclasses.replace(cfg.run, seed=base.run.seed, name=base.run.name)
            assert dataclasses.replace(cfg, run=same) == base, path.name
            continue
        # a HistoSpec config may also raise the verify token budget (room for whole drafts)
        budget = dataclasses.replace(cfg.rollout, max_verify_tokens=base.rollout.max_verify_tokens)
        assert cfg.grpo == base.grpo and cfg.model == base.model and budget == base.rollout, path.name
        assert cfg.rollout == base.rollout or cfg.spec != base.spec, path.name
        if path.name.startswith("histopipe_"):
            assert cfg.parallel.rollout_workers == 4 and cfg.spec == base.spec, path.name
        elif cfg.sched != base.sched:
            assert cfg.spec == base.spec and cfg.parallel == base.parallel, path.name
        else:
            assert cfg.spec != base.spec and cfg.parallel == base.parallel, path.name
    assert len(seen) == 38
