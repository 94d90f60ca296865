"""Truncated importance sampling (``grpo.tis``, ``train/tis.py``): hand-computed weights and
metrics, the loss unchanged (bit-identical) when every weight is 1 or none is given, the
trainer's recompute wired into the update. TRL parity of the corrected loss and gradient:
``tests/test_trl_parity.py::test_truncated_importance_sampling_matches_trl``."""

from __future__ import annotations

import math
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import f32
from rhyme_jax.config import ConfigError, load_config
from rhyme_jax.train import losses
from rhyme_jax.train.tis import METRICS, truncated_is_weights
from rhyme_jax.train.trainer import GRPOTrainer

CAP = 2.0


def _inputs():
    """2 rows x 4 tokens; row 0's last token and row 1's first are not response tokens."""
    diff = np.array([[0.0, math.log(1.5), math.log(3.0), 9.0],
                     [5.0, -math.log(2.0), math.log(2.0), 0.1]])
    sampler = np.array([[-1.0, -2.0, -0.5, -3.0], [-0.2, -1.5, -2.5, -0.7]], np.float32)
    trainer = (sampler + diff).astype(np.float32)
    mask = np.array([[1, 1, 1, 0], [0, 1, 1, 1]], np.float32)
    return trainer, sampler, mask


def test_weights_and_metrics_by_hand():
    trainer, sampler, mask = _inputs()
    w, m = truncated_is_weights(trainer, sampler, mask, CAP)
    # min(exp(trainer - sampler), 2) on response tokens, 1 elsewhere
    want = np.array([[1.0, 1.5, 2.0, 1.0], [1.0, 0.5, 2.0, math.exp(0.1)]])
    # trainer = sampler + diff rounded to float32 (|trainer| <= 3 on response tokens: abs. error <= 3 U),
    # trainer - sampler rounds once more (<= 3 U): exp turns that absolute error into a relative one and adds
    # its own ulps
    np.testing.assert_allclose(np.asarray(w), want, rtol=(f32.TRANSCENDENTAL_ULPS + 2 * 3.0) * f32.U, atol=0)
    on = [1.0, 1.5, 2.0, 0.5, 2.0, math.exp(0.1)]
    diffs = [0.0, math.log(1.5), math.log(3.0), math.log(2.0), math.log(2.0), 0.1]
    expect = {"tis/weight_mean": np.mean(on), "tis/weight_max": 2.0, "tis/clipped_fraction": 1 / 6,
              "tis/logprob_diff_mean": np.mean(diffs), "tis/logprob_diff_max": math.log(3.0)}
    assert set(m) == set(METRICS) == set(expect)
    for k, v in expect.items():
        assert float(m[k]) == pytest.approx(v, rel=1e-6), k
    with pytest.raises(ValueError, match="shape"):
        truncated_is_weights(trainer, sampler[:, :3], mask, CAP)
    _, empty = truncated_is_weights(trainer, sampler, np.zeros_like(mask), CAP)
    assert all(float(v) == 0.0 for v in empty.values())


@pytest.mark.parametrize("kl_coef", [0.0, 0.04])
def test_loss_by_hand_and_unchanged_by_unit_weights(kl_coef):
    """Per token ``w * pg + kl_coef * kl`` (TRL's order); weights of exactly 1 give the very loss
    and gradient of no weights (x * 1.0 == x in IEEE arithmetic), bit for bit."""
    trainer, sampler, mask = _inputs()
    rng = np.random.default_rng(0)
    lp = jnp.asarray(trainer + rng.normal(0, 0.3, trainer.shape).astype(np.float32))
    ref = jnp.asarray(trainer + rng.normal(0, 0.2, trainer.shape).astype(np.float32))
    adv = jnp.asarray([1.0, -0.5], jnp.float32)
    w, _ = truncated_is_weights(trainer, sampler, mask, CAP)
    kw = dict(eps_low=0.2, eps_high=0.28, ref_logprobs=ref if kl_coef else None, kl_coef=kl_coef)

    def loss(x, weights):
        return losses.grpo_loss(x, jnp.asarray(trainer), adv, jnp.asarray(mask), is_weights=weights, **kw)[0]

    # by hand, float64
    r = np.exp(np.asarray(lp, np.float64) - trainer)
    a = np.array([1.0, -0.5])[:, None]
    pg = -np.minimum(r * a, np.clip(r, 0.8, 1.28) * a)
    d = np.asarray(ref, np.float64) - np.asarray(lp, np.float64)
    per = np.asarray(w, np.float64) * pg + kl_coef * (np.exp(d) - d - 1)
    want = (per * mask).sum() / mask.sum()
    assert float(loss(lp, w)) == pytest.approx(want, rel=1e-5)

    ones = jnp.ones_like(lp)
    assert np.asarray(loss(lp, None)) == np.asarray(loss(lp, ones))
    g0, g1 = jax.grad(loss)(lp, None), jax.grad(loss)(lp, ones)
    np.testing.assert_array_equal(np.asarray(g0), np.asarray(g1))
    assert float(loss(lp, w)) != float(loss(lp, None))


def test_tis_config():
    cfg = load_config("configs/tiny_test.yaml", ["grpo.tis=true", "grpo.tis_cap=3"])
    assert cfg.grpo.tis and cfg.grpo.tis_cap == 3.0
    default = load_config("configs/tiny_test.yaml").grpo
    assert default.tis is False and default.tis_cap == 2.0
    with pytest.raises(ConfigError, match="grpo.tis_cap"):
        load_config("configs/tiny_test.yaml", ["grpo.tis_cap=0.5"])
    with pytest.raises(ConfigError, match="grpo.tis=true is not supported with lora.rank=4"):
        load_config("configs/tiny_test.yaml", ["grpo.tis=true", "lora.rank=4"])


def test_trainer_recomputes_old_logprobs_and_weights_the_batch():
    """``GRPOTrainer._truncated_is``: the learner's logprob function on the current params
    replaces the sampler's old logprobs; ``is_weights`` and the ``tis/*`` metrics follow."""
    trainer_lp, sampler, mask = _inputs()
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    seen = {}

    def logprob_fn(state, batch):
        seen["state"] = state
        return jnp.asarray(trainer_lp)

    stub = SimpleNamespace(learner=SimpleNamespace(ref_logprob_fn=logprob_fn, layout=SimpleNamespace(batch=sharding)),
                           state="current params", cfg=SimpleNamespace(grpo=SimpleNamespace(tis_cap=CAP)))
    loss_mask = np.concatenate([mask, np.zeros((2, 1), np.float32)], axis=1)  # [B, T]: the grid is T - 1
    batch = {"tokens": np.zeros((2, 5), np.int32), "loss_mask": loss_mask, "old_logprobs": sampler.copy()}
    metrics = GRPOTrainer._truncated_is(stub, batch)
    assert seen["state"] == "current params"
    np.testing.assert_array_equal(batch["old_logprobs"], trainer_lp)
    want, m = truncated_is_weights(trainer_lp, sampler, mask, CAP)
    np.testing.assert_array_equal(batch["is_weights"], np.asarray(want))
    assert metrics == {k: float(v) for k, v in m.items()}


@pytest.mark.slow
def test_bf16_rollout_with_tis_trains(tmp_path):
    """One GRPO step of the tiny run with bf16 rollouts and TIS (about 20 s: a bf16 engine's compiles
    besides the update's): the engine's pool is bf16, the tis/* metrics are written, the trainer's
    logprobs differ from the sampler's and the weights stay within the cap."""
    cfg = load_config("configs/tiny_test.yaml", [f"run.runs_dir={tmp_path}", "grpo.steps=1", "sft.steps=0",
                                                 "rollout.dtype=bfloat16", "grpo.tis=true", "data.num_eval=2"])
    trainer = GRPOTrainer(cfg, reward_fn=lambda text, problem: float(len(text) % 2))
    try:
        m = trainer.train_step(1)
        assert trainer.rollout.engines[0].kv.dtype == jnp.bfloat16
    finally:
        trainer.close()
    assert set(METRICS) <= set(m)
    assert m["tis/logprob_diff_mean"] > 0  # bf16 sampled: its logprobs are not the trainer's
    assert 0 < m["tis/weight_mean"] <= m["tis/weight_max"] <= CAP and 0 <= m["tis/clipped_fraction"] <= 1
    assert m["finite"] == 1.0
