"""HistoSpec changes how many forward passes a rollout takes, never what it samples: a GRPO run
with HistoSpec off, with the paper's AIMD drafter and with the goodput drafter, same seed, trains
on the same tokens, gets the same rewards and ends with the same weights (issue 32's one-workload
comparison at the trainer level; the default set checks tokens and rewards through
tests/test_learning_suite.py). Every draw is keyed by its request and position, and
verification accepts a draft token iff it equals that draw (Leviathan et al. 2023, greedy-key
form), so the three runs are one workload and their speed ratios compare decoding alone.

Tolerances: the HistoSpec runs sample the plain run's tokens exactly (asserted equal); their
behaviour logprobs come from other programs (verify vs decode), so they differ in the last bits
(``f32.logprobs``), and the trained weights after the steps differ by the updates' sensitivity
to them: a few ulps of the 1e-2-scale updates, below ``rtol=1e-5, atol=1e-6`` (168 U relative).
"""

from __future__ import annotations

import numpy as np
import pytest

from rhyme_jax.io.rollout_log import load_rollouts
from rhyme_jax.train.trainer import GRPOTrainer
from test_trainer import STEPS, host_copy, parity_reward, tiny_cfg, train_rows

pytestmark = pytest.mark.slow

# 2 prompts cycled: every step is a new epoch, so drafts come from history from step 2 on;
# short matches for the untrained model; the analytical pass-cost prior (no profiling); a low
# temperature so the untrained policy repeats its responses across epochs.
COMMON = ("grpo.num_prompts=2", "spec.pattern_min=1", "spec.min_token_prob=0.0", "spec.step_cost=prior",
          "rollout.temperature=0.1")  # a peaked policy repeats itself: drafts get accepted
MODES = {
    "plain": ("spec.enabled=false",),
    "aimd": ("spec.enabled=true", "spec.window=aimd"),
    "goodput": ("spec.enabled=true", "spec.window=goodput"),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for name, sets in MODES.items():
        trainer = GRPOTrainer(tiny_cfg(tmp_path_factory.mktemp(name), *COMMON, *sets), reward_fn=parity_reward)
        try:
            trainer.fit()
            out[name] = (trainer.run_dir, host_copy(trainer.state))
        finally:
            trainer.close()
    return out


@pytest.mark.parametrize("mode", ["aimd", "goodput"])
def test_histospec_runs_sample_the_plain_runs_tokens(runs, mode):
    plain_dir, plain_state = runs["plain"]
    run_dir, state = runs[mode]
    for step in range(1, STEPS + 1):
        a, b = load_rollouts(plain_dir, step), load_rollouts(run_dir, step)
        np.testing.assert_array_equal(a["prompt_ids"], b["prompt_ids"])
        np.testing.assert_array_equal(a["rewards"], b["rewards"])
        assert len(a["responses"]) == len(b["responses"])
        for x, y in zip(a["responses"], b["responses"]):
            np.testing.assert_array_equal(x, y, err_msg=f"{mode} step {step}")
    leaves_a, leaves_b = (np.concatenate([np.ravel(x) for x in __import__("jax").tree.leaves(s)])
                          for s in (plain_state, state))
    np.testing.assert_allclose(leaves_a, leaves_b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["aimd", "goodput"])
def test_the_comparison_is_not_vacuous(runs, mode):
    """Drafts were sent and accepted (verify passes emitted several tokens), the plain run drafted
    nothing, and every step updated the weights, so the later steps' equal tokens come from equal
    updates, not from a policy that never moved."""
    rows = train_rows(runs[mode][0])
    plain = train_rows(runs["plain"][0])
    assert sum(rows[s]["spec/accepted_tokens"] for s in rows) > 0
    assert sum(plain[s]["spec/drafted_tokens"] for s in plain) == 0
    assert all(plain[s]["grad_norm"] > 0 and len(set(load_rollouts(runs["plain"][0], s)["rewards"])) > 1
               for s in plain)
