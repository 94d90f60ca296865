"""GRPO with HistoSpec on: drafts from the second epoch, history write-back, history in the
checkpoint and exact resumption (tiny config, 2 prompts cycled so every step is a new epoch)."""

from __future__ import annotations

import numpy as np
import pytest

from rhyme_jax.spec.history import HistoryStore
from rhyme_jax.train.checkpoint import Checkpointer
from rhyme_jax.train.trainer import GRPOTrainer
from test_trainer import (STEPS, assert_trees_equal, host_copy, parity_reward, tiny_cfg, train_rows,
                          train_steps_by_hand)

SPEC = ("spec.enabled=true", "grpo.num_prompts=2", "spec.window=fixed", "spec.fixed_window=4",
        "spec.min_token_prob=0.0", "spec.pattern_min=1", "spec.pattern_max=2")  # untrained model: short matches
# Wall-time metrics differ between identical runs.
VOLATILE = ("time/", "rollout/tokens_per_s", "spec/drafting")


@pytest.fixture(scope="module")
def spec_run(tmp_path_factory):
    trainer = GRPOTrainer(tiny_cfg(tmp_path_factory.mktemp("spec"), *SPEC), reward_fn=parity_reward)
    try:
        trainer.fit()
    finally:
        trainer.close()
    return trainer


def test_drafts_start_in_the_second_epoch(spec_run):
    rows = train_rows(spec_run.run_dir)
    assert [rows[s]["rollout/epoch"] for s in (1, 2, 3, 4)] == [1.0, 2.0, 3.0, 4.0]
    assert rows[1]["spec/drafted_tokens"] == 0  # cold start: plain decode
    for s in (2, 3, 4):
        assert rows[s]["spec/drafted_tokens"] > 0
        assert 0 <= rows[s]["spec/accepted_tokens"] <= rows[s]["spec/drafted_tokens"]
    # History holds each prompt's last rollout: the 4 samples of step 4.
    hist = spec_run.history
    assert sorted(hist.prompt_ids()) == sorted(set(hist.prompt_ids())) and len(hist) == 2
    for pid in hist.prompt_ids():
        (ro,) = hist.entry(pid).rollouts
        assert ro.step == STEPS and len(ro.responses) == 4


def test_history_is_saved_with_the_checkpoint(spec_run):
    with Checkpointer(spec_run.run_dir / "checkpoints") as c:
        blobs = c.restore_blobs(STEPS)
    saved = HistoryStore.from_bytes(blobs["history"], source="test")
    assert sorted(saved.prompt_ids()) == sorted(spec_run.history.prompt_ids())
    for pid in saved.prompt_ids():
        a, b = saved.entry(pid), spec_run.history.entry(pid)
        np.testing.assert_array_equal(a.prompt, b.prompt)
        for ra, rb in zip(a.rollouts, b.rollouts):
            assert ra.step == rb.step
            np.testing.assert_array_equal(ra.rewards, rb.rewards)
            for x, y in zip(ra.responses, rb.responses):
                np.testing.assert_array_equal(x, y)


def test_resume_with_history_is_bit_identical(spec_run, tmp_path):
    cfg = tiny_cfg(tmp_path, *SPEC)
    train_steps_by_hand(cfg, (1, 2))
    second = GRPOTrainer(cfg, resume=True, reward_fn=parity_reward)
    try:
        assert second.step == 2 and len(second.history) == 2
        second.fit()
    finally:
        second.close()
    assert_trees_equal(host_copy(second.state), host_copy(spec_run.state))
    want, got = train_rows(spec_run.run_dir), train_rows(second.run_dir)
    for step in (1, 2, 3, 4):
        for key, value in want[step].items():
            if not key.startswith(VOLATILE):
                assert got[step][key] == value, (step, key)
