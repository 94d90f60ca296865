"""The policy's own mode as a drafter (``measure.policy_mode``, ``ablate.policy_modes``):
teacher-forced modes against the dense model, the greedy drafter on constructed sequences, the
cut bound's policy modes, and a capture along a tiny GRPO run whose teacher-forced logprobs equal
the sampler's behaviour logprobs.

Tolerances: the policy-mode capture runs the rollout's forward program and the test the dense
forward, so logprobs differ by ``f32.logprobs`` of the tiny model (below 1e-5: ``atol=1e-5``)
and the mode probability ``exp(lp)`` by that relatively (``rtol=1e-5, atol=1e-6``); against a
saved run's behaviour logprobs (``rtol=1e-4``) the difference is the same bound at the run's
larger logits. Calibrated estimates are float32 values of python floats: ``rtol=1e-6`` = 16.8 U.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rhyme_lab.measure import policy_mode as pm
from rhyme_lab.measure.draft_replay import Tally, drive
from rhyme_jax.spec.drafter import Drafter
from test_pass_replay import cut_bound_case
from test_rollout_engine import CFG, _dense_fn, _model


def test_modes_equal_the_dense_model_row_by_row():
    """Each row's argmax, mode probability and own-token logprob at temperature 0.7 equal those of
    the dense model run on that row alone (no padding), whatever the other rows of the batch."""
    graphdef, state = _model()
    rng = np.random.default_rng(3)
    prompts = [rng.integers(4, CFG.vocab_size, size=n).astype(np.int32) for n in (3, 9, 5)]
    responses = [rng.integers(4, CFG.vocab_size, size=n).astype(np.int32) for n in (6, 2, 11)]
    from rhyme_lab.ablate.policy_modes import mode_fn, policy_modes

    got = policy_modes(mode_fn(graphdef, 0.7), state, prompts, responses, pad_id=0, rows=2)
    dense = _dense_fn()
    for p, r, (amax, p_mode, logp) in zip(prompts, responses, got):
        seq = np.concatenate([p, r])[None]
        logits = np.asarray(dense(state, jnp.asarray(seq), jnp.array([seq.shape[1]])))[0]
        lp = np.asarray(jax.nn.log_softmax(jnp.asarray(logits[len(p) - 1: -1]) / 0.7, axis=-1))
        assert amax.shape == p_mode.shape == logp.shape == r.shape
        np.testing.assert_array_equal(amax, lp.argmax(-1))
        np.testing.assert_allclose(p_mode, np.exp(lp.max(-1)), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(logp, lp[np.arange(r.size), r], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="temperature"):
        mode_fn(graphdef, 0.0)


def test_mode_drafter_accepts_up_to_the_first_non_mode_token():
    """Response 5 6 7 8 9 10 whose sampled token 8 is not the mode (the policy's argmax there is
    30): after the prefill's 5 the greedy draft 6 7 30 9 10 gets 6 7 accepted and the pass emits 8;
    the next draft 9 10 is all accepted: 2 passes, 4 of 5 + 2 sent draft tokens accepted. The
    estimates are the running products of the mode probabilities."""
    prompt = np.array([1, 2, 3], np.int32)
    response = np.array([5, 6, 7, 8, 9, 10], np.int32)
    argmax = np.array([5, 6, 7, 30, 9, 10], np.int32)
    p_mode = np.array([0.9, 0.8, 0.5, 0.6, 0.7, 0.9], np.float32)
    batch = pm.ModeDrafter([prompt], [response], [(argmax, p_mode)], max_new_tokens=16)
    tally = Tally()
    passes = drive(batch, [prompt], [response], emitted=1, max_new=16, tally=tally)
    assert passes.tolist() == [2]
    assert (tally.accepted, tally.drafted) == (4, 5 + 2)
    np.testing.assert_allclose(batch.estimates[0, :3], [0.7, 0.63, 0.0], rtol=1e-6)  # the last pass: 9 10
    first = pm.ModeDrafter([prompt], [response], [(argmax, p_mode)], 16)
    tails = np.full((1, first.context_width), -1, np.int64)
    tails[0, :4] = [1, 2, 3, 5]
    drafts, lens = first.draft(np.array([0]), tails, np.array([3]))
    assert lens.tolist() == [3] and drafts[0, :3].tolist() == [6, 7, 30]
    np.testing.assert_allclose(first.estimates[0, :4], [0.8, 0.4, 0.24, 0.0], rtol=1e-6)
    with pytest.raises(pm.PolicyModeError):
        pm.ModeDrafter([prompt], [response[:3]], [(argmax, p_mode)], 16)


def test_modes_file_round_trip_and_mismatch(tmp_path):
    """``save_modes`` / ``load_modes`` keep each row's arrays; rows that do not fit the rollouts
    fail naming the file."""
    rows = [(np.array([4, 5], np.int32), np.array([0.5, 0.25], np.float32), np.array([-1.0, -2.0], np.float32)),
            (np.zeros(0, np.int32), np.zeros(0, np.float32), np.zeros(0, np.float32))]
    path = pm.save_modes(tmp_path, 3, rows)
    assert path == tmp_path / "policy_modes" / "step_000003.npz"
    back = pm.load_modes(tmp_path, 3, [np.zeros(2), np.zeros(0)])
    assert back[0][0].tolist() == [4, 5] and back[0][1].tolist() == [0.5, 0.25] and back[1][0].size == 0
    with pytest.raises(pm.PolicyModeError, match="step_000003.npz"):
        pm.load_modes(tmp_path, 3, [np.zeros(3), np.zeros(0)])
    with pytest.raises(pm.PolicyModeError, match="step_000004.npz: no such file"):
        pm.load_modes(tmp_path, 4, [np.zeros(2)])


def test_cut_bound_adds_the_policy_modes():
    """``cut_bound.bound_step`` with modes: a policy whose argmax is the response everywhere is the
    always-right drafter (every sent token accepted, fewer passes than the source-bound oracle,
    which cannot draft 20: it is held nowhere); knowing its acceptance changes nothing then."""
    from rhyme_lab.measure import cut_bound

    c = cut_bound_case()
    spec, prompt, pids, one, store, response = c.spec, c.prompt, c.pids, c.one, c.store, c.response
    modes = [(response.copy(), np.full(response.size, 0.99, np.float32))]
    drafters = {m: Drafter(spec, store) for m in ("estimates", "known")}
    try:
        got = cut_bound.bound_step(64, {0: prompt}, pids, [response], one, store, c.plan, c.cost, drafters, modes)
    finally:
        for d in drafters.values():
            d.close()
    policy, known = got["policy"], got["policy_known"]
    assert policy["accepted"] == policy["drafted"] == 7 and policy["passes"] == 1
    assert known == policy and got["oracle"]["passes"] == 3
    r = cut_bound.ratios(cut_bound.merge([got, got]))
    assert r["policy_share"] > 1.0 and r["policy"] == pytest.approx(7.0 / policy["seconds"])


def test_capture_along_a_tiny_run_matches_the_behaviour_logprobs(compile_cache, tmp_path):
    """Two GRPO steps of ``configs/tiny_test.yaml`` with the capture hook: every sampled token's
    teacher-forced logprob equals the behaviour logprob the sampler recorded (the forward is the
    sampling policy, here at temperature 0.1), the mode is never less likely than the sampled token, and the saved modes
    fit the saved rollouts."""
    from rhyme_lab.ablate.policy_modes import CaptureError, capture, check_config
    from rhyme_jax.io.rollout_log import load_rollouts
    from test_trainer import tiny_cfg

    cfg = tiny_cfg(tmp_path, "grpo.steps=2", "run.name=modes", "rollout.temperature=0.1")
    stats = capture(cfg, rows=4, log=lambda s: None)
    assert [s["step"] for s in stats] == [1, 2]
    for s in stats:
        assert s["tokens"] > 0 and s["max_logp_diff"] < 2e-4 and 0.5 < s["argmax_share"] <= 1.0
    run = tmp_path / "modes"
    ro = load_rollouts(run, 2)
    modes = pm.load_modes(run, 2, ro["responses"])
    raw = np.load(pm.modes_path(run, 2))
    same_total = 0
    for (amax, p_mode), r, lp in zip(modes, ro["responses"], np.split(raw["logp"], raw["offsets"][1:-1])):
        assert np.all(p_mode >= np.exp(lp) - 1e-5)
        same = amax == r
        same_total += int(same.sum())
        np.testing.assert_allclose(p_mode[same], np.exp(lp[same]), rtol=1e-4)
    assert same_total > 0
    with pytest.raises(CaptureError, match="sched.pipeline"):
        check_config(tiny_cfg(tmp_path, "sched.pipeline=one_step_off"))
