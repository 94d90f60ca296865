"""GRPO math vs independent numpy implementations; batching alignment; optimizer.

Tolerances (float32 JAX against float64 numpy references; U = 2**-24, tests/f32.py): every
input is O(1) and every reduction has at most 54 terms (the 6 x 9 fixture). ``rtol=1e-6``
(16.8 U) bounds a value of at most 8 roundings and one exp or log (``f32.short(8, 1)`` = 16 U):
advantages, gradients of one term, schedule values. ``rtol=1e-5`` (168 U) bounds a mean or sum
of up to 54 such terms of one sign (``f32.gamma(54) + f32.short(8, 1)`` = 70 U; the
log-sum-exp of 11 logits less). The surrogate loss sums terms of both signs, so its bound is
computed in the test from the same aggregation of the terms' absolute values (``f32.dot``). ``rtol=1e-4``
(1,678 U) is for the k3 terms ``exp(d) - d - 1`` (d ~ N(0, 0.3) here): each has an absolute
error of about ``(e^|d| + |d| + 1 + 8) U`` = 11 U (the exp's 8 ulps included) while the terms
average ``d**2 / 2`` = 0.045, so the mean's relative error is at most ~250 U plus ``gamma(54)``;
their gradient ``1 - exp(-d)`` likewise (``f32.cancellation``). Each still fails on a wrong
formula: a sign, a missing clip or a wrong normaliser moves the value by percent, not by ulps.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import f32 as f32_bounds

from rhyme_jax.train.losses import (
    LOSS_AGGS,
    SCALE_REWARDS,
    LossInputError,
    SequenceBatchError,
    aggregate,
    chunked_token_logprobs,
    grpo_loss,
    group_advantages,
    loss_normaliser,
    loss_weights,
    response_grid,
    sequence_batch,
    token_logprobs,
    weighted_grpo_loss,
)
from rhyme_jax.train.optim import OptimizerConfigError, make_optimizer, make_schedule


# ---------------------------------------------------------------- numpy references
def np_std(x):
    """Sample (Bessel-corrected) std of a list; 0 for fewer than 2 values (TRL's convention)."""
    n = len(x)
    if n < 2:
        return 0.0
    m = sum(x) / n
    return np.sqrt(sum((v - m) ** 2 for v in x) / (n - 1))


def np_advantages(r, scale, eps=1e-4):
    """(r - group mean) / (std + eps): std of the group, of all rewards (batch), or none."""
    out = np.zeros_like(r)
    everything = [float(v) for v in r.reshape(-1)]
    for g in range(r.shape[0]):
        m = sum(r[g]) / len(r[g])
        std = np_std(list(r[g])) if scale == "group" else np_std(everything)
        out[g] = [(x - m) / (std + eps) if scale != "none" else x - m for x in r[g]]
    return out


def np_aggregate(per, mask, agg, norm=None):
    """The aggregations written out row by row (losses module docstring)."""
    B = per.shape[0]
    if agg == "token_mean":
        return (per * mask).sum() / mask.sum()
    if agg == "seq_mean_token_mean":  # rows without tokens are left out of the mean
        seqs = [(per[b] * mask[b]).sum() / mask[b].sum() for b in range(B) if mask[b].sum() > 0]
        return sum(seqs) / len(seqs)
    # seq_mean_token_sum_norm / step_token_mean: every token's loss summed, over the step's normaliser
    return sum((per[b] * mask[b]).sum() for b in range(B)) / norm


def np_grpo(lp, old, adv, mask, eps_low, eps_high, ref=None, kl_coef=0.0, agg="token_mean", norm=None):
    B, T = lp.shape
    per = np.zeros((B, T))
    clipfrac_num = 0.0
    for b in range(B):
        for t in range(T):
            r = np.exp(lp[b, t] - old[b, t])
            a = adv[b]
            rc = min(max(r, 1 - eps_low), 1 + eps_high)
            obj = min(r * a, rc * a)
            per[b, t] = -obj
            if ref is not None:
                d = ref[b, t] - lp[b, t]
                per[b, t] += kl_coef * (np.exp(d) - d - 1)
            if mask[b, t] and rc * a < r * a:
                clipfrac_num += 1
    return np_aggregate(per, mask, agg, norm), clipfrac_num / mask.sum()


@pytest.fixture
def grpo_inputs():
    rng = np.random.default_rng(0)
    B, T = 6, 9
    lp = rng.normal(-1.5, 0.5, (B, T))
    # ratios spread widely so both clip sides are hit for both advantage signs
    old = lp + rng.normal(0.0, 0.4, (B, T))
    adv = np.array([1.3, -0.7, 0.5, -2.0, 0.9, 0.0])
    mask = (rng.random((B, T)) < 0.7).astype(np.float64)
    mask[5] = 0.0  # an all-padding row
    mask[0, :3] = 1.0
    ref = lp + rng.normal(0.0, 0.3, (B, T))
    return lp, old, adv, mask, ref


# ---------------------------------------------------------------- advantages
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages_matches_numpy(scale):
    r = np.random.default_rng(1).random((4, 8)).round(1)
    r[2] = 1.0  # constant group -> zero advantage, not NaN
    got = np.asarray(group_advantages(jnp.asarray(r), scale_rewards=scale))
    np.testing.assert_allclose(got, np_advantages(r, scale), rtol=1e-5, atol=1e-5)
    assert np.all(got[2] == 0.0)


def test_group_advantages_use_the_sample_std_and_eps_1e_4():
    """TRL's convention: rewards (1, 0) have std sqrt(0.5) (not 0.5), so advantages +-1 / (0.7071 +
    1e-4); one success in 8 gets (7/8) / (sqrt(1/8) + 1e-4)."""
    got = np.asarray(group_advantages(jnp.array([[1.0, 0.0]])))
    np.testing.assert_allclose(got, [[0.5 / (np.sqrt(0.5) + 1e-4), -0.5 / (np.sqrt(0.5) + 1e-4)]], rtol=1e-6)
    one = np.asarray(group_advantages(jnp.asarray([[1.0] + [0.0] * 7])))
    np.testing.assert_allclose(one[0, 0], (7 / 8) / (np.sqrt(1 / 8) + 1e-4), rtol=1e-6)
    # batch scaling: the std of all rewards, the mean still per group
    r = np.array([[1.0, 0.0], [1.0, 1.0]])
    np.testing.assert_allclose(np.asarray(group_advantages(jnp.asarray(r), scale_rewards="batch")),
                               [[0.5 / (0.5 + 1e-4), -0.5 / (0.5 + 1e-4)], [0.0, 0.0]], rtol=1e-6)


def test_group_advantages_groups_of_one_are_zero_not_nan():
    for scale in ("group", "batch", "none"):
        got = np.asarray(group_advantages(jnp.array([[0.3], [0.9]]), scale_rewards=scale))
        np.testing.assert_array_equal(got, 0.0)
    np.testing.assert_array_equal(np.asarray(group_advantages(jnp.array([[0.7]]), scale_rewards="batch")), 0.0)


def test_config_choices_are_the_losses_modes():
    from rhyme_jax.config.checks import field_types, literal_choices
    from rhyme_jax.config.sections import GRPOSection

    hints = field_types(GRPOSection)
    assert literal_choices(hints["loss_agg"]) == LOSS_AGGS
    assert literal_choices(hints["scale_rewards"]) == SCALE_REWARDS
    assert "scale_by_std" not in hints  # replaced by grpo.scale_rewards (none = the old false)


def test_group_advantages_rejects_bad_input():
    with pytest.raises(LossInputError, match="rewards must be"):
        group_advantages(jnp.ones(4))
    with pytest.raises(LossInputError, match="scale_rewards"):
        group_advantages(jnp.ones((2, 2)), scale_rewards="std")


# ---------------------------------------------------------------- token logprobs
def test_token_logprobs_vs_log_softmax_gather():
    rng = np.random.default_rng(2)
    logits = rng.normal(0, 2, (2, 5, 11)).astype(np.float32)
    tgt = rng.integers(0, 11, (2, 5))
    for temp in (1.0, 0.7):
        lp, ent = token_logprobs(jnp.asarray(logits), jnp.asarray(tgt), temperature=temp)
        z = logits / temp
        z = z - z.max(-1, keepdims=True)
        logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
        want_lp = np.take_along_axis(logp, tgt[..., None], -1)[..., 0]
        want_ent = -(np.exp(logp) * logp).sum(-1)
        np.testing.assert_allclose(np.asarray(lp), want_lp, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(ent), want_ent, rtol=1e-5, atol=1e-5)


def test_token_logprobs_bad_shapes():
    with pytest.raises(LossInputError):
        token_logprobs(jnp.zeros((2, 5, 7)), jnp.zeros((2, 4), jnp.int32))
    with pytest.raises(LossInputError, match="temperature"):
        token_logprobs(jnp.zeros((2, 5, 7)), jnp.zeros((2, 5), jnp.int32), temperature=0.0)


# ---------------------------------------------------------------- grpo loss
@pytest.mark.parametrize("agg", LOSS_AGGS)
@pytest.mark.parametrize("with_ref", [False, True])
def test_grpo_loss_matches_numpy(grpo_inputs, agg, with_ref):
    lp, old, adv, mask, ref = grpo_inputs
    eps_low, eps_high, kl_coef = 0.2, 0.28, 0.1
    norm = 37.5  # a step normaliser (loss_normaliser); only the normalised modes read it
    want, want_cf = np_grpo(lp, old, adv, mask, eps_low, eps_high, ref if with_ref else None, kl_coef, agg, norm)
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    loss, m = grpo_loss(
        f32(lp), f32(old), f32(adv), f32(mask), eps_low=eps_low, eps_high=eps_high,
        ref_logprobs=f32(ref) if with_ref else None, kl_coef=kl_coef, loss_agg=agg, loss_norm=norm,
    )
    # the loss sums terms of both signs: its float32 error is relative to the same aggregation of
    # the terms' absolute values (f32.dot), each term within f32.short(8, 1) (an exp, a clip, products)
    r, a = np.exp(lp - old), adv[:, None]
    terms = np.abs(np.minimum(r * a, np.clip(r, 1 - eps_low, 1 + eps_high) * a))
    if with_ref:
        terms = terms + kl_coef * (np.exp(ref - lp) - (ref - lp) - 1)
    abs_sum = np_aggregate(terms, mask, agg, norm)
    bound = f32_bounds.between_programs((f32_bounds.gamma(lp.size) + f32_bounds.short(8, 1)) * abs_sum)
    assert abs(float(loss) - want) <= bound, (float(loss), want, bound)
    np.testing.assert_allclose(float(m["clip_fraction"]), want_cf, rtol=1e-6)
    assert 0.0 < want_cf < 1.0  # the fixture exercises clipping
    ratio = np.exp(lp - old)
    np.testing.assert_allclose(float(m["ratio_mean"]), (ratio * mask).sum() / mask.sum(), rtol=1e-5)
    np.testing.assert_allclose(
        float(m["approx_kl"]), ((ratio - 1 - np.log(ratio)) * mask).sum() / mask.sum(), rtol=1e-4
    )
    if with_ref:
        d = ref - lp
        np.testing.assert_allclose(float(m["kl"]), ((np.exp(d) - d - 1) * mask).sum() / mask.sum(), rtol=1e-4)
    else:
        assert float(m["kl"]) == 0.0


def test_grpo_clipping_both_sides_and_gradient_sign():
    # one token per sequence; ratios chosen inside / above / below the clip range
    old = jnp.zeros((6, 1))
    lp = jnp.log(jnp.array([[1.0], [1.5], [0.5], [1.0], [1.5], [0.5]]))
    adv = jnp.array([1.0, 1.0, 1.0, -1.0, -1.0, -1.0])
    mask = jnp.ones((6, 1))

    def per_seq_grad(i):
        m = mask * (jnp.arange(6) == i)[:, None]
        g = jax.grad(lambda x: grpo_loss(x, old, adv, m, eps_low=0.2, eps_high=0.28)[0])(lp)
        return float(g[i, 0])

    grads = [per_seq_grad(i) for i in range(6)]
    # A>0: in range -> descend raises lp (negative grad); ratio 1.5 > 1.28 clipped -> 0;
    #       ratio 0.5 < 0.8: min picks unclipped -> still pushes up.
    assert grads[0] < 0 and grads[1] == 0.0 and grads[2] < 0
    # A<0: in range -> pushes lp down (positive grad); ratio 1.5: unclipped active -> pushes down;
    #       ratio 0.5 < 0.8 clipped -> 0.
    assert grads[3] > 0 and grads[4] > 0 and grads[5] == 0.0
    # exact values: d/dlp of -(r*A) = -r*A
    np.testing.assert_allclose(grads[0], -1.0, rtol=1e-6)
    np.testing.assert_allclose(grads[4], 1.5, rtol=1e-6)
    _, m = grpo_loss(lp, old, adv, mask, eps_low=0.2, eps_high=0.28)
    np.testing.assert_allclose(float(m["clip_fraction"]), 2 / 6, rtol=1e-6)


def test_grpo_kl_gradient_pulls_towards_reference():
    lp = jnp.array([[-1.0, -2.0]])
    ref = jnp.array([[-1.5, -1.0]])
    g = jax.grad(
        lambda x: grpo_loss(x, x, jnp.zeros(1), jnp.ones((1, 2)), eps_low=0.2, eps_high=0.2,
                            ref_logprobs=ref, kl_coef=1.0)[0]
    )(lp)
    # d/dlp [exp(ref-lp) - (ref-lp) - 1] / 2 = (1 - exp(ref-lp)) / 2
    np.testing.assert_allclose(np.asarray(g), (1 - np.exp(ref - lp)) / 2, rtol=1e-6)
    assert g[0, 0] > 0 and g[0, 1] < 0


def test_kl_ratio_weighted_term_value_and_gradient():
    """TRL's use_bias_correction_kl: the k3 term times the (differentiable) ratio r = exp(lp - old);
    its gradient per token is r * (lp - ref), the unbiased reverse-KL gradient (DeepSeek-V3.2)."""
    rng = np.random.default_rng(5)
    lp, old, ref = (jnp.asarray(rng.normal(-1.0, 0.4, (2, 3)), jnp.float32) for _ in range(3))
    mask = jnp.ones((2, 3))
    kl_only = lambda x: grpo_loss(x, old, jnp.zeros(2), mask, eps_low=0.2, eps_high=0.2, ref_logprobs=ref,  # noqa: E731
                                  kl_coef=1.0, loss_agg="step_token_mean", loss_norm=1.0, kl_ratio_weighted=True)[0]
    r, d = np.exp(np.asarray(lp - old)), np.asarray(ref - lp)
    np.testing.assert_allclose(float(kl_only(lp)), (r * (np.exp(d) - d - 1)).sum(), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(jax.grad(kl_only)(lp)), r * np.asarray(lp - ref), rtol=1e-4, atol=1e-6)


def test_sequence_level_ratio_matches_hand_computation():
    """GSPO: every token of a row carries r_b = exp(masked mean of lp - old), clipped as one number;
    the gradient of row b's token t is -A_b r_b / |y_b| when unclipped, 0 when clipped."""
    lp = jnp.log(jnp.array([[1.2, 1.2, 1.0], [2.0, 1.0, 1.0], [0.9, 1.0, 1.0]]))
    old = jnp.zeros((3, 3))
    mask = jnp.array([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])  # padding ignored in the mean
    adv = jnp.array([1.0, 1.0, -1.0])
    f = lambda x: grpo_loss(x, old, adv, mask, eps_low=0.2, eps_high=0.28, loss_agg="seq_mean_token_mean",  # noqa: E731
                            importance_sampling_level="sequence")
    loss, m = f(lp)
    r = np.array([1.2, 2.0 ** (1 / 3), 0.9])  # 1.26 (in range), 1.26 (in range), 0.9
    np.testing.assert_allclose(float(loss), -(r[0] + r[1] - r[2]) / 3, rtol=1e-6)
    np.testing.assert_allclose(float(m["ratio_mean"]), (2 * r[0] + 3 * r[1] + r[2]) / 6, rtol=1e-6)
    assert float(m["clip_fraction"]) == 0.0
    g = np.asarray(jax.grad(lambda x: f(x)[0])(lp))
    np.testing.assert_allclose(g[0], [-r[0] / 2 / 3, -r[0] / 2 / 3, 0.0], rtol=1e-6)
    np.testing.assert_allclose(g[1], np.full(3, -r[1] / 3 / 3), rtol=1e-6)
    np.testing.assert_allclose(g[2], [r[2] / 3, 0.0, 0.0], rtol=1e-6)
    # row 1 at 2^(2/3) = 1.59 > 1.28 with A > 0: clipped as a whole, no gradient on any token
    lp2 = lp.at[1, 1].set(jnp.log(2.0))
    g2 = np.asarray(jax.grad(lambda x: f(x)[0])(lp2))
    np.testing.assert_allclose(g2[1], 0.0)
    assert float(f(lp2)[1]["clip_fraction"]) == 3 / 6
    token, _ = grpo_loss(lp, old, adv, mask, eps_low=0.2, eps_high=0.28, loss_agg="seq_mean_token_mean")
    assert abs(float(token) - float(loss)) > 1e-3  # the level changes the loss


def test_sequence_level_ratio_adds_up_over_micro_batches(grpo_inputs):
    """The row mean reads the mask from token_w > 0, so a split over rows sums to the whole."""
    lp, old, adv, mask, ref = (jnp.asarray(x, jnp.float32) for x in grpo_inputs)
    loss_w, token_w = loss_weights(mask, "token_mean")
    kw = dict(eps_low=0.2, eps_high=0.28, ref_logprobs=ref, kl_coef=0.1, kl_ratio_weighted=True,
              importance_sampling_level="sequence")
    whole = weighted_grpo_loss(lp, old, adv, loss_w, token_w, **kw)[0]
    h = lp.shape[0] // 2
    parts = sum(float(weighted_grpo_loss(lp[s], old[s], adv[s], loss_w[s], token_w[s],
                                         ref_logprobs=ref[s], **{k: v for k, v in kw.items() if k != "ref_logprobs"})[0])
                for s in (slice(0, h), slice(h, None)))
    np.testing.assert_allclose(parts, float(whole), rtol=1e-5)


def test_entropy_bonus_is_the_token_mean_whatever_the_aggregation(grpo_inputs):
    """loss - coef x sum(H mask) / sum(mask) (TRL entropy_coef), gradient -coef mask / sum(mask)."""
    lp, old, adv, mask, _ = (jnp.asarray(x, jnp.float32) for x in grpo_inputs)
    ent = jnp.asarray(np.random.default_rng(2).uniform(0.1, 2.0, lp.shape), jnp.float32)
    for agg in LOSS_AGGS:
        kw = dict(eps_low=0.2, eps_high=0.28, loss_agg=agg, loss_norm=37.5)
        base = float(grpo_loss(lp, old, adv, mask, **kw)[0])
        f = lambda e: grpo_loss(lp, old, adv, mask, entropy=e, entropy_coef=0.3, **kw)  # noqa: E731
        loss, m = f(ent)
        mean_h = float((np.asarray(ent) * np.asarray(mask)).sum() / np.asarray(mask).sum())
        np.testing.assert_allclose(float(loss), base - 0.3 * mean_h, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(float(m["entropy_bonus"]), mean_h, rtol=1e-6)
        np.testing.assert_allclose(np.asarray(jax.grad(lambda e: f(e)[0])(ent)),
                                   -0.3 * np.asarray(mask) / np.asarray(mask).sum(), rtol=1e-6)
    assert "entropy_bonus" not in grpo_loss(lp, old, adv, mask, eps_low=0.2, eps_high=0.28)[1]


def test_differentiable_chunked_entropy_matches_token_logprobs():
    """entropy_grad=True: the same entropies as token_logprobs, and the same gradient."""
    rng = np.random.default_rng(4)
    h = jnp.asarray(rng.normal(size=(2, 5, 3)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(3, 7)), jnp.float32)
    t = jnp.asarray(rng.integers(0, 7, (2, 5)), jnp.int32)
    ours = lambda h: chunked_token_logprobs(h, t, lambda x: x @ w, 0.7, 4, entropy_grad=True)[1]  # noqa: E731
    ref = lambda h: token_logprobs(h @ w, t, 0.7)[1]  # noqa: E731
    np.testing.assert_allclose(np.asarray(ours(h)), np.asarray(ref(h)), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(jax.grad(lambda h: ours(h).sum())(h)),
                               np.asarray(jax.grad(lambda h: ref(h).sum())(h)), rtol=1e-4, atol=1e-6)
    stopped = jax.grad(lambda h: chunked_token_logprobs(h, t, lambda x: x @ w, 0.7)[1].sum())(h)
    assert float(jnp.abs(stopped).max()) == 0.0


def test_grpo_loss_bad_inputs():
    x = jnp.zeros((2, 3))
    with pytest.raises(LossInputError, match="advantages"):
        grpo_loss(x, x, jnp.zeros(3), x, eps_low=0.2, eps_high=0.2)
    with pytest.raises(LossInputError, match="loss_agg"):
        grpo_loss(x, x, jnp.zeros(2), x, eps_low=0.2, eps_high=0.2, loss_agg="sum")
    with pytest.raises(LossInputError, match="share shape"):
        grpo_loss(x, jnp.zeros((2, 4)), jnp.zeros(2), x, eps_low=0.2, eps_high=0.2)
    with pytest.raises(LossInputError, match="importance_sampling_level"):
        grpo_loss(x, x, jnp.zeros(2), x, eps_low=0.2, eps_high=0.2, importance_sampling_level="row")
    with pytest.raises(LossInputError, match="entropy_coef"):
        grpo_loss(x, x, jnp.zeros(2), x, eps_low=0.2, eps_high=0.2, entropy=x, entropy_coef=-0.1)
    with pytest.raises(LossInputError, match="entropy"):
        grpo_loss(x, x, jnp.zeros(2), x, eps_low=0.2, eps_high=0.2, entropy_coef=0.1)


@pytest.mark.parametrize("agg", LOSS_AGGS)
def test_aggregate_and_loss_weights_agree_and_split_over_rows(grpo_inputs, agg):
    """``aggregate`` (direct formulas) == numpy == ``sum(x * loss_weights)``; weights computed on
    the whole minibatch add up over any split of its rows (the micro-batches of the update)."""
    _, _, _, mask, ref = grpo_inputs
    per = jnp.asarray(ref, jnp.float32)
    want = np_aggregate(ref, mask, agg, 21.0)
    got = float(aggregate(per, jnp.asarray(mask), agg, 21.0))
    loss_w, token_w = loss_weights(jnp.asarray(mask), agg, 21.0)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_allclose(float(jnp.sum(per * loss_w)), want, rtol=1e-5)
    halves = [float(jnp.sum(per[rows] * loss_w[rows])) for rows in (np.arange(0, 6, 2), np.arange(1, 6, 2))]
    np.testing.assert_allclose(sum(halves), want, rtol=1e-5)
    np.testing.assert_allclose(float(jnp.sum(token_w)), 1.0, rtol=1e-6)


def test_normalised_modes_ignore_row_lengths_and_padding_rows():
    """Dr.GRPO's normaliser is a constant: a longer response weighs each of its tokens the same
    (unlike seq_mean_token_mean); a minibatch of padding rows (loss_norm 0) weighs 0, not NaN."""
    mask = jnp.array([[1.0, 0, 0, 0], [1, 1, 1, 1]])
    w, _ = loss_weights(mask, "seq_mean_token_sum_norm", 2 * 4)
    np.testing.assert_allclose(np.asarray(w), np.asarray(mask) / 8)
    w_seq, _ = loss_weights(mask, "seq_mean_token_mean")
    np.testing.assert_allclose(np.asarray(w_seq)[:, 0], [0.5, 0.125])
    w0, _ = loss_weights(jnp.zeros((2, 4)), "step_token_mean", 0.0)
    assert np.all(np.asarray(w0) == 0.0)


def test_loss_normaliser_values_and_errors():
    kw = dict(response_tokens=300, rows=16, minibatches=4, max_new_tokens=64)
    assert loss_normaliser("step_token_mean", **kw) == 75.0  # TRL dapo: N_gen * GA / steps_per_generation
    assert loss_normaliser("seq_mean_token_sum_norm", **kw) == 4 * 64  # TRL dr_grpo: rows x max_completion_length
    assert loss_normaliser("token_mean", **kw) == 1.0
    assert loss_normaliser("step_token_mean", **dict(kw, response_tokens=0)) == 0.25  # clamped at 1 token
    with pytest.raises(LossInputError, match="loss_agg"):
        loss_normaliser("dapo", **kw)
    with pytest.raises(LossInputError, match="minibatches"):
        loss_normaliser("step_token_mean", **dict(kw, minibatches=0))
    x = jnp.zeros((2, 3))
    with pytest.raises(LossInputError, match="needs the step's normaliser"):
        grpo_loss(x, x, jnp.zeros(2), x, eps_low=0.2, eps_high=0.2, loss_agg="step_token_mean")


# ---------------------------------------------------------------- sequence_batch
def test_sequence_batch_alignment():
    prompts = [[5, 6, 7], [8], [9, 10]]
    responses = [[11, 12], [13, 14, 15, 16], []]
    b = sequence_batch(prompts, responses, pad_id=0)
    T = b["tokens"].shape[1]
    assert T == 16 and b["tokens"].dtype == np.int32 and b["loss_mask"].dtype == np.float32
    assert b["attn_mask"].dtype == bool and b["positions"].dtype == np.int32
    targets, mask = b["tokens"][:, 1:], b["loss_mask"][:, :-1]
    for i, (p, r) in enumerate(zip(prompts, responses)):
        assert list(targets[i][mask[i] == 1]) == r  # exactly the response tokens are targets
        assert b["attn_mask"][i].sum() == len(p) + len(r)
        assert list(b["tokens"][i, : len(p) + len(r)]) == p + r
        assert np.all(b["tokens"][i, len(p) + len(r):] == 0)
    assert np.all(b["loss_mask"][:, -1] == 0)
    np.testing.assert_array_equal(b["positions"][1], np.arange(16))
    np.testing.assert_array_equal(b["prompt_lens"], [3, 1, 2])

    # behaviour log-probs placed on the same grid line up with the mask
    grid = response_grid([[0.1, 0.2], [1, 2, 3, 4], []], b["prompt_lens"], T)
    np.testing.assert_array_equal(grid != 0, mask == 1)


def test_sequence_batch_length_bucketing_and_errors():
    assert sequence_batch([[1] * 10], [[2] * 7], 0)["tokens"].shape == (1, 32)
    assert sequence_batch([[1]], [[2]], 0, max_len=40)["tokens"].shape == (1, 48)
    with pytest.raises(SequenceBatchError, match="max_len"):
        sequence_batch([[1] * 10], [[2] * 7], 0, max_len=16)
    with pytest.raises(SequenceBatchError, match="empty"):
        sequence_batch([[]], [[2]], 0)
    with pytest.raises(SequenceBatchError, match="responses"):
        sequence_batch([[1]], [], 0)


# ---------------------------------------------------------------- optimizer
def test_optimizer_reduces_quadratic():
    target = jnp.array([[1.0, -2.0], [3.0, 0.5]])
    params = {"w": jnp.zeros((2, 2)), "b": jnp.zeros(2)}
    loss = lambda p: jnp.sum((p["w"] - target) ** 2) + jnp.sum((p["b"] - 1.0) ** 2)  # noqa: E731
    tx = make_optimizer(0.1, total_steps=60, warmup_steps=5, weight_decay=0.0, max_grad_norm=1.0)
    st = tx.init(params)
    start = float(loss(params))
    for _ in range(60):
        g = jax.grad(loss)(params)
        u, st = tx.update(g, st, params)
        params = optax.apply_updates(params, u)
    assert float(loss(params)) < 0.05 * start


def test_schedule_values():
    s = make_schedule(1e-3, total_steps=100, warmup_steps=10)
    np.testing.assert_allclose(float(s(0)), 0.0, atol=1e-12)
    np.testing.assert_allclose(float(s(5)), 5e-4, rtol=1e-6)
    np.testing.assert_allclose(float(s(10)), 1e-3, rtol=1e-6)  # peak exactly at the warmup boundary
    np.testing.assert_allclose(float(s(55)), 0.5e-3, rtol=1e-5)  # cosine half-way
    np.testing.assert_allclose(float(s(100)), 0.0, atol=1e-9)
    c = make_schedule(1e-3, total_steps=100, warmup_steps=10, schedule="constant")
    np.testing.assert_allclose([float(c(i)) for i in (0, 5, 10, 99)], [0, 5e-4, 1e-3, 1e-3], rtol=1e-6)
    np.testing.assert_allclose(float(make_schedule(1e-3, 10, 0, schedule="constant")(3)), 1e-3)
    np.testing.assert_allclose(float(make_schedule(1e-3, 10, 0)(0)), 1e-3)
    with pytest.raises(OptimizerConfigError, match="warmup_steps"):
        make_schedule(1e-3, 10, 20)


def test_weight_decay_and_clipping():
    params = {"w": jnp.ones((2, 2)), "b": jnp.ones(2)}
    zero = jax.tree.map(jnp.zeros_like, params)
    tx = make_optimizer(0.1, 10, 0, weight_decay=0.5, max_grad_norm=1.0, schedule="constant")
    u, _ = tx.update(zero, tx.init(params), params)
    np.testing.assert_allclose(np.asarray(u["w"]), -0.05 * np.ones((2, 2)), rtol=1e-6)  # -lr*wd*w
    np.testing.assert_allclose(np.asarray(u["b"]), 0.0)  # biases are not decayed
    # stacked decoder blocks (leading layer axis): kernels decayed, norm scales / biases not
    stacked = {"layers": {"k": jnp.ones((3, 2, 2)), "norm": jnp.ones((3, 2))}, "head": jnp.ones((2, 2))}
    u, _ = tx.update(jax.tree.map(jnp.zeros_like, stacked), tx.init(stacked), stacked)
    np.testing.assert_allclose(np.asarray(u["layers"]["k"]), -0.05, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(u["layers"]["norm"]), 0.0)
    np.testing.assert_allclose(np.asarray(u["head"]), -0.05, rtol=1e-6)
    # clipping: Adam's first moment after one step is (1 - b1) * clipped gradient (global norm 1)
    g = {"w": jnp.full((2, 2), 100.0), "b": jnp.zeros(2)}
    for max_norm, want_norm in ((1.0, 1.0), (0.0, 200.0)):
        tx = make_optimizer(0.1, 10, 0, 0.0, max_grad_norm=max_norm, b1=0.9)
        _, st = tx.update(g, tx.init(params), params)
        adam = [x for x in jax.tree.leaves(st, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
                if isinstance(x, optax.ScaleByAdamState)][0]
        np.testing.assert_allclose(float(optax.tree.norm(adam.mu)), 0.1 * want_norm, rtol=1e-5)


def test_sequence_log_ratio_per_segment_of_a_packed_row():
    """In a packed row (segment ids 1, 1, 2, 2, 2, 0) each target carries its own segment's masked
    mean of the log-ratio, not the row's; without segment ids the row is one sequence. Exact
    in float32: means of at most 3 small dyadic numbers."""
    from rhyme_jax.train.losses import sequence_log_ratio

    lr = jnp.array([[0.5, 0.25, -1.0, 0.5, 2.0, 7.0]])
    mask = jnp.array([[True, True, True, False, True, False]])  # padding (segment 0) carries no loss
    seg = jnp.array([[1, 1, 2, 2, 2, 0]])
    got = np.asarray(sequence_log_ratio(lr, mask, seg))
    np.testing.assert_array_equal(got, [[0.375, 0.375, 0.5, 0.5, 0.5, 0.0]])
    np.testing.assert_array_equal(np.asarray(sequence_log_ratio(lr, mask)), [[1.75 / 4]])
    g = np.asarray(jax.grad(lambda x: sequence_log_ratio(x, mask, seg).sum())(lr))
    # segment 1: 2 copies of its mean of 2 tokens; segment 2: 3 copies (the unmasked target too) of 2
    np.testing.assert_array_equal(g, [[1.0, 1.0, 1.5, 0.0, 1.5, 0.0]])
