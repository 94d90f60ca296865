"""DAPO's overlong handling (``train/overlong.py``): the soft overlong penalty at hand-computed
lengths and against TRL's ``get_soft_overlong_punishment``, and truncated rows masked out of the
loss (the loss then equals the loss over the other rows alone)."""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import f32
from rhyme_jax.config import ConfigError, load_config
from rhyme_jax.train import losses
from rhyme_jax.train.overlong import mask_rows, soft_overlong_penalty

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "tiny_test.yaml"


def test_soft_overlong_penalty_at_hand_computed_lengths():
    """L_max = 16, L_cache = 4: 0 up to 12 tokens, then (12 - |y|) / 4, -1 from 16 on (DAPO eq. 13)."""
    lengths = [0, 11, 12, 13, 14, 15, 16, 17, 40]
    expect = [0.0, 0.0, 0.0, -0.25, -0.5, -0.75, -1.0, -1.0, -1.0]
    np.testing.assert_array_equal(soft_overlong_penalty(lengths, 16, 4), np.array(expect, np.float32))
    np.testing.assert_array_equal(soft_overlong_penalty(lengths, 16, 4, factor=0.5),
                                  np.array(expect, np.float32) / 2)
    np.testing.assert_array_equal(soft_overlong_penalty(lengths, 16, 0), np.zeros(9, np.float32))  # off
    np.testing.assert_array_equal(soft_overlong_penalty([0, 1, 2], 2, 2), [0.0, -0.5, -1.0])  # cache = L_max
    with pytest.raises(ValueError, match="cache=17 must be in"):
        soft_overlong_penalty(lengths, 16, 17)


def test_soft_overlong_penalty_matches_trl():
    """TRL's reward function (float64 Python) on every length 0..130 for L_max = 100, L_cache =
    20 and 7: ours is its float32 rounding (one rounding of a value in [-1, 0]: within U)."""
    rewards = pytest.importorskip("trl.rewards", reason="needs trl (the `test` extra)")
    lengths = np.arange(131)
    for cache in (20, 7):
        theirs = rewards.get_soft_overlong_punishment(max_completion_len=100, soft_punish_cache=cache)(
            [[1] * int(n) for n in lengths])
        np.testing.assert_allclose(soft_overlong_penalty(lengths, 100, cache), theirs, rtol=0, atol=f32.U)


def test_soft_overlong_cache_config():
    assert load_config(CONFIG, ["reward.soft_overlong_cache=16"]).reward.soft_overlong_cache == 16
    with pytest.raises(ConfigError, match="reward.soft_overlong_cache=17 exceeds rollout.max_new_tokens=16"):
        load_config(CONFIG, ["reward.soft_overlong_cache=17"])
    with pytest.raises(ConfigError, match="reward.soft_overlong_factor"):
        load_config(CONFIG, ["reward.soft_overlong_factor=0"])


def _batch(rows, T):
    """``losses.sequence_batch`` of ``rows`` (prompt, response) pairs at length ``T``."""
    return losses.sequence_batch([p for p, _ in rows], [r for _, r in rows], 0, max_len=T)


@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean_token_mean", "step_token_mean",
                                      "seq_mean_token_sum_norm"])
def test_masked_truncated_rows_leave_the_loss_of_the_other_rows(loss_agg):
    """4 rows, row 1 cut at the budget: the loss with row 1 masked (``mask_rows``, the normaliser
    from the masked token count, as ``trainer._update`` does) equals the loss of rows 0, 2, 3
    alone, except under ``seq_mean_token_sum_norm`` (TRL ``dr_grpo``), whose rows x max_new_tokens
    normaliser still counts the masked row: 3/4 of it. Tolerance: the two losses reduce the same
    per-token values in different orders (float32 sums of up to B x T terms, f32.dot), plus one
    rounding of the division."""
    rng = np.random.default_rng(0)
    max_new, T = 6, 16
    rows = [(rng.integers(3, 50, p).tolist(), rng.integers(3, 50, m).tolist()) for p, m in
            ((4, 3), (5, max_new), (3, 5), (6, 2))]
    truncated = np.array([False, True, False, False])
    lp = rng.normal(-2.0, 0.5, (4, T - 1)).astype(np.float32)
    old = (lp + rng.normal(0.0, 0.3, lp.shape)).astype(np.float32)
    adv = np.array([1.0, -0.5, -1.5, 0.75], np.float32)

    def loss(idx, drop):
        mask = mask_rows(_batch([rows[i] for i in idx], T)["loss_mask"], drop)
        norm = losses.loss_normaliser(loss_agg, response_tokens=int(np.count_nonzero(mask)), rows=len(idx),
                                      minibatches=1, max_new_tokens=max_new)
        out, _ = losses.grpo_loss(jnp.asarray(lp[idx]), jnp.asarray(old[idx]), jnp.asarray(adv[idx]),
                                  jnp.asarray(mask[:, :-1]), eps_low=0.2, eps_high=0.28, loss_agg=loss_agg,
                                  loss_norm=norm)
        return float(out), mask

    full, mask = loss([0, 1, 2, 3], truncated)
    assert mask[1].sum() == 0 and mask[[0, 2, 3]].sum() == 3 + 5 + 2
    kept, _ = loss([0, 2, 3], np.zeros(3, bool))
    ratio = np.exp(lp.astype(np.float64) - old)
    per_token = np.maximum(-ratio * adv[:, None], -np.clip(ratio, 0.8, 1.28) * adv[:, None])
    abs_sum = float(np.sum(np.abs(per_token) * mask[:, :-1]))  # the loss's terms before the division
    tol = f32.between_programs(f32.dot(4 * (T - 1), abs_sum) + f32.U * abs(full))
    expect = kept * 3 / 4 if loss_agg == "seq_mean_token_sum_norm" else kept
    assert abs(kept) > 1e-2 and full == pytest.approx(expect, rel=0, abs=tol)
