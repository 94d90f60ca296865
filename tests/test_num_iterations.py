"""``grpo.num_iterations`` (TRL ``num_iterations``): a GRPO step makes ``num_iterations`` passes over
its ``grpo.minibatches`` minibatches, every pass against the rollout's behaviour logprobs, and the
learning-rate schedule counts those optimizer steps. One GRPO step of ``configs/tiny_test.yaml``.

Tolerances: ``ratio_mean`` is a float32 mean over the step's minibatch rows against a float64
mean of the same float32 values: ``gamma(32)`` = 1.9e-6 relative, under ``rtol=1e-6`` for
these 4 values; the first iteration is on-policy, so its ratio is ``exp(lp - lp_behaviour)``
with the two logprobs from two programs: ``f32.logprobs`` of the tiny model, well under 1e-4.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import numpy as np
import pytest

from rhyme_jax.config import load_config
from rhyme_jax.train.optim import grpo_schedule_steps
from rhyme_jax.train.trainer import GRPOTrainer, update_order

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "tiny_test.yaml"


def _adam_count(opt_state) -> int:
    counts = {int(leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(opt_state)
              if "count" in jax.tree_util.keystr(path)}
    assert len(counts) == 1, counts
    return counts.pop()


@pytest.mark.slow  # builds a trainer and runs a step (~20 s on 2 cores)
def test_two_iterations_make_twice_the_optimizer_steps_off_policy(compile_cache, tmp_path):
    cfg = load_config(CONFIG, [f"run.runs_dir={tmp_path}", "grpo.minibatches=2", "grpo.num_iterations=2",
                               "grpo.warmup_steps=1"])
    assert grpo_schedule_steps(cfg.grpo) == (4 * 2 * 2, 1 * 2 * 2)  # steps x minibatches x iterations
    trainer = GRPOTrainer(cfg, reward_fn=lambda text, problem: float(len(text) % 2))
    seen = []
    step_fn = trainer.learner.step_fn

    def recording(state, opt_state, batch):
        out = step_fn(state, opt_state, batch)
        seen.append((np.asarray(batch["old_logprobs"]), np.asarray(batch["advantages"]), jax.device_get(out[2])))
        return out

    trainer.learner = dataclasses.replace(trainer.learner, step_fn=recording)
    try:
        assert _adam_count(trainer.opt_state) == 0
        metrics = trainer.train_step(1)
        assert _adam_count(trainer.opt_state) == 4  # 2 iterations x 2 minibatches
    finally:
        trainer.close()
    assert len(seen) == 4 and all(m["finite"] == 1.0 for *_, m in seen)
    for first, second in zip(seen[:2], seen[2:]):  # the same minibatches, the same behaviour logprobs
        np.testing.assert_array_equal(first[0], second[0])
        np.testing.assert_array_equal(first[1], second[1])
    ratio = [float(m["ratio_mean"]) for *_, m in seen]
    assert abs(ratio[0] - 1.0) < 1e-4  # minibatch 0, iteration 1: on-policy
    assert abs(ratio[2] - 1.0) > 10 * max(abs(ratio[0] - 1.0), 1e-6)  # minibatch 0 again, two updates later
    assert float(seen[2][2]["approx_kl"]) > float(seen[0][2]["approx_kl"])
    np.testing.assert_allclose(metrics["ratio_mean"], np.mean(ratio), rtol=1e-6)  # the step's row: all 4 updates


def test_update_order_repeats_the_minibatches_in_the_same_order():
    """10 rows, 3 minibatches, 2 iterations: the slices 0-3, 4-6, 7-9 twice; 1 iteration = today's
    single pass (np.array_split)."""
    got = [m.tolist() for m in update_order(10, 3, 2)]
    assert got == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]] * 2
    assert [m.tolist() for m in update_order(10, 3, 1)] == [m.tolist() for m in np.array_split(np.arange(10), 3)]


def test_schedule_counts_iterations_times_minibatches():
    """grpo.steps x minibatches x num_iterations optimizer steps; warmup likewise (in GRPO steps)."""
    cfg = load_config(CONFIG, ["grpo.minibatches=2", "grpo.num_iterations=3", "grpo.warmup_steps=1"])
    assert grpo_schedule_steps(cfg.grpo) == (4 * 2 * 3, 1 * 2 * 3)  # tiny_test: grpo.steps = 4
    assert grpo_schedule_steps(load_config(CONFIG).grpo) == (4, 0)  # defaults: one pass, one minibatch
