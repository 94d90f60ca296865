"""DAPO dynamic sampling (``train/dynamic_sampling.py``) on constructed groups: which groups are
dropped, how large each refill round is, how many extra rows it costs, and that the round bound
and the prompt set bound hold. Rewards are set by hand per group; the fake refill rollout records
the prompts it was asked for. Then the config checks of ``grpo.dynamic_sampling``, and one GRPO
step of the tiny config (``configs/tiny_test.yaml``) with it on."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from rhyme_jax.config import ConfigError, load_config
from rhyme_jax.io.rollout_log import load_rollouts
from rhyme_jax.sched.step_group import StepGroup
from rhyme_jax.train.callbacks import TrainerCallback
from rhyme_jax.train.dynamic_sampling import fill_batch, has_signal, refill_prompts, refill_size
from rhyme_jax.train.prompts import prompt_schedule
from rhyme_jax.train.step_batch import StepBatch
from rhyme_jax.train.trainer import GRPOTrainer

N = 2  # samples per prompt
SEED, STEP, PROMPT_SET = 7, 3, 20
SIGNAL, FLAT = [0.0, 1.0], [1.0, 1.0]  # a group's rewards: with / without a nonzero advantage
CONFIG = Path(__file__).resolve().parents[1] / "configs" / "tiny_test.yaml"


def group(pid: int) -> StepGroup:
    return StepGroup(pid, np.array([1, 2], np.int32), [np.array([3, 4], np.int32)] * N,
                     [np.zeros(2, np.float32)] * N, ["eos"] * N, np.zeros(N, bool), STEP)


def batch(pids) -> StepBatch:
    return StepBatch(STEP, STEP - 1, [group(int(p)) for p in pids], [], None, 0.0)


class FakeRefill:
    """A refill rollout and its scorer: round k's groups get the k-th list of rewards, in order."""

    def __init__(self, rounds: list[list[list[float]]]):
        self.rounds, self.asked = rounds, []

    def rollout(self, k, idx):
        self.asked.append((k, np.asarray(idx).tolist()))
        return batch(idx)

    def score(self, sb):
        k = self.asked[-1][0]
        return np.array([r for g in self.rounds[k - 1][:len(sb.groups)] for r in g], np.float32)


def run(own_rewards, refills, per_step=4, max_rounds=3, prompt_set=PROMPT_SET):
    sb = batch(range(len(own_rewards)))
    sb.set_rewards(np.array([r for g in own_rewards for r in g], np.float32))
    fake = FakeRefill(refills)
    out = fill_batch(sb, per_step=per_step, max_rounds=max_rounds, prompt_set=prompt_set, seed=SEED,
                     rollout=fake.rollout, score=fake.score)
    return out, fake


def test_has_signal_keeps_groups_whose_rewards_differ():
    r = np.array([[1, 1, 1], [0, 1, 0], [0, 0, 0], [0.5, 0.5, 0.5], [np.nan, 1, 0], [-1, -0.75, -1]])
    assert has_signal(r).tolist() == [False, True, False, False, False, True]


@pytest.mark.parametrize("missing, kept, scored, per_step, size", [
    (0, 4, 4, 4, 0),   # full: no round
    (3, 0, 4, 4, 4),   # nothing kept yet: one step's batch
    (2, 2, 4, 4, 4),   # half kept: ceil(2 * 4 / 2)
    (1, 3, 4, 8, 2),   # ceil(1 * 4 / 3)
    (5, 1, 8, 6, 6),   # ceil(5 * 8 / 1) = 40, capped at per_step
])
def test_refill_size(missing, kept, scored, per_step, size):
    assert refill_size(missing, kept, scored, per_step) == size


def test_refill_prompts_are_fresh_and_a_function_of_seed_step_round():
    used = {0, 1, 2, 3}
    a = refill_prompts(SEED, STEP, 1, PROMPT_SET, 5, used)
    assert a.dtype == np.int64 and len(a) == 5 and len(set(a.tolist())) == 5 and not set(a.tolist()) & used
    np.testing.assert_array_equal(a, refill_prompts(SEED, STEP, 1, PROMPT_SET, 5, used))
    assert not np.array_equal(a, refill_prompts(SEED, STEP, 2, PROMPT_SET, 5, used))
    assert not np.array_equal(a, refill_prompts(SEED, STEP + 1, 1, PROMPT_SET, 5, used))
    assert sorted(refill_prompts(SEED, STEP, 1, 6, 5, used).tolist()) == [4, 5]  # the set runs out


def test_fill_drops_flat_groups_and_refills_until_full():
    """Own groups 0-3: 1 and 2 flat (dropped), 2 kept, 2 missing. Round 1: ceil(2 x 4 / 2) = 4
    prompts, one with a signal (3 kept of 8 scored). Round 2: ceil(1 x 8 / 3) = 3 prompts, all
    with a signal: 6 kept, the first 4 train, 2 unused. Extra rows (4 + 3) x n = 14."""
    out, fake = run([SIGNAL, FLAT, [0.0, 0.0], SIGNAL], [[FLAT, SIGNAL, FLAT, FLAT], [SIGNAL] * 3])
    r1 = refill_prompts(SEED, STEP, 1, PROMPT_SET, 4, {0, 1, 2, 3})
    r2 = refill_prompts(SEED, STEP, 2, PROMPT_SET, 3, {0, 1, 2, 3, *r1.tolist()})
    assert fake.asked == [(1, r1.tolist()), (2, r2.tolist())]
    assert [g.prompt_idx for g in out.trained.groups] == [0, 3, int(r1[1]), int(r2[0])]
    assert [g.prompt_idx for g in out.scored.groups] == [0, 1, 2, 3, *r1.tolist(), *r2.tolist()]
    assert all(has_signal(out.trained.group_rewards))
    assert len(out.scored.rewards) == 11 * N  # every group rolled out is kept for the write-back
    assert out.metrics["dynamic_sampling/refill_rounds"] == 2.0
    assert out.metrics["dynamic_sampling/extra_rows"] == 14.0
    assert out.metrics["dynamic_sampling/filtered_share"] == pytest.approx(1 - 6 / 11)
    assert out.metrics["dynamic_sampling/missing_groups"] == 0.0
    assert out.metrics["dynamic_sampling/unused_groups"] == 2.0
    assert out.metrics["dynamic_sampling/reward_mean"] == pytest.approx(np.mean(out.scored.rewards))
    assert out.trained.step == STEP and out.trained.weights_step == STEP - 1


def test_round_bound_leaves_the_batch_short():
    """refill_rounds = 1 and a round of flat groups: the step trains its 2 groups with a signal,
    2 missing, after 4 extra prompts (8 rows)."""
    out, fake = run([SIGNAL, FLAT, FLAT, SIGNAL], [[FLAT] * 4, [SIGNAL] * 4], max_rounds=1)
    assert len(fake.asked) == 1
    assert [g.prompt_idx for g in out.trained.groups] == [0, 3]
    assert out.metrics["dynamic_sampling/refill_rounds"] == 1.0
    assert out.metrics["dynamic_sampling/extra_rows"] == 8.0
    assert out.metrics["dynamic_sampling/missing_groups"] == 2.0
    assert out.metrics["dynamic_sampling/filtered_share"] == pytest.approx(6 / 8)


def test_no_rounds_and_an_exhausted_prompt_set():
    out, fake = run([SIGNAL, FLAT, FLAT, SIGNAL], [], max_rounds=0)  # filter only
    assert fake.asked == [] and len(out.trained.groups) == 2 and out.metrics["dynamic_sampling/extra_rows"] == 0.0
    out, fake = run([SIGNAL, FLAT, FLAT, SIGNAL], [[FLAT]], prompt_set=5)  # one prompt left: one round
    assert fake.asked == [(1, [4])]
    assert out.metrics["dynamic_sampling/refill_rounds"] == 1.0 and out.metrics["dynamic_sampling/missing_groups"] == 2.0
    out, fake = run([SIGNAL] * 4, [])  # full already: the batch is the step's own
    assert fake.asked == [] and out.trained.groups == out.scored.groups and len(out.trained.groups) == 4


def test_dynamic_sampling_config():
    cfg = load_config(CONFIG)
    assert (cfg.grpo.dynamic_sampling, cfg.grpo.mask_truncated_completions, cfg.reward.soft_overlong_cache) == (
        False, False, 0)  # off by default
    with pytest.raises(ConfigError, match=r": grpo.dynamic_sampling=true needs sched.pipeline=sync \(got "
                                          r"sched.pipeline='one_step_off'\)"):
        load_config(CONFIG, ["grpo.dynamic_sampling=true", "sched.pipeline=one_step_off"])
    with pytest.raises(ConfigError, match=r": grpo.refill_rounds"):
        load_config(CONFIG, ["grpo.refill_rounds=-1"])


def signal_on_even_ids(text, problem):
    """The parity reward (tests/test_trainer.py) on problems of even id, 0 on the others: the
    groups of odd ids are flat."""
    return float(len(text) % 2) if problem.id % 2 == 0 else 0.0


class Batches(TrainerCallback):
    """The scored batch (``on_rollout_end``) and the trained one (``on_before_update``)."""

    def on_rollout_end(self, trainer, step, batch):
        self.scored = batch.ids.copy()

    def on_before_update(self, trainer, step, state, batch):
        self.ids, self.rewards, self.truncated = batch.ids.copy(), batch.group_rewards.copy(), batch.truncated.copy()


def test_a_step_with_dynamic_sampling_trains_groups_with_a_signal_only(compile_cache, tmp_path):
    """Step 1 of the tiny run (2 prompts x 4 samples; prompt 105 of the step is odd, so flat):
    the saved rollouts hold the step's own groups then the refill rounds'; the update gets the
    first 2 groups with a signal; the metrics count them; truncated rows are masked."""
    cb, (P, n) = Batches(), (2, 4)
    cfg = load_config(CONFIG, [f"run.runs_dir={tmp_path}", "grpo.dynamic_sampling=true",
                               "grpo.mask_truncated_completions=true"])
    trainer = GRPOTrainer(cfg, reward_fn=signal_on_even_ids, callbacks=[cb])
    try:
        m = trainer.train_step(1)
    finally:
        trainer.close()
    roll = load_rollouts(trainer.run_dir, 1)
    ids, rewards = roll["prompt_ids"][::n], roll["rewards"].reshape(-1, n)
    own = prompt_schedule(cfg.run.seed, 200, 1, P)
    assert ids[:P].tolist() == own.tolist() and own[0] % 2 == 1  # the step's own groups first; one flat
    signal = has_signal(rewards)
    assert not signal[0] and not signal[ids % 2 == 1].any()
    kept0 = int(signal[:P].sum())
    first = refill_prompts(cfg.run.seed, 1, 1, 200, refill_size(P - kept0, kept0, P, P), set(own.tolist()))
    assert ids[P:P + len(first)].tolist() == first.tolist()  # round 1's prompts
    trained = ids[signal][:P]
    np.testing.assert_array_equal(cb.scored, roll["prompt_ids"])
    np.testing.assert_array_equal(cb.ids, np.repeat(trained, n))
    assert has_signal(cb.rewards).all()
    assert m["rollout/trained_groups"] == len(trained) == P - m["dynamic_sampling/missing_groups"]
    assert m["dynamic_sampling/refill_rounds"] >= 1.0
    assert m["dynamic_sampling/extra_rows"] == (len(ids) - P) * n
    assert m["dynamic_sampling/filtered_share"] == pytest.approx(1 - signal.sum() / len(ids))
    assert m["dynamic_sampling/unused_groups"] == max(int(signal.sum()) - P, 0)
    assert m["rollout/truncated_masked"] == cb.truncated.sum()
    assert m["finite"] == 1.0 and m["grad_norm"] > 0.0
