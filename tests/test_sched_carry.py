"""Carried rows and groups (sched/carry.py): a step's rows split into trainable and carried groups,
the carried samples continued by a later rollout as ``CarriedRow`` s, the checkpoint form, and the
step batch (``train.step_batch.StepBatch``) the trained groups make."""

from __future__ import annotations

import numpy as np
import pytest

from rhyme_jax.rollout.types import RolloutResult
from rhyme_jax.sched import carry

N = 2  # samples per prompt


def _result(rows, tag):
    """A rollout result for ``rows``: row r answers ``[tag, r]`` with logprobs ``[-r, -r]``."""
    return RolloutResult([np.array([tag, r], np.int32) for r in rows], [np.full(2, -r, np.float32) for r in rows],
                         ["eos"] * len(rows), {"generated_tokens": 2 * len(rows)})


def _stopped(row, prompt_idx):
    return carry.CarriedRow(row, prompt_idx, np.array([prompt_idx], np.int32), np.array([9], np.int32),
                            np.array([-0.5], np.float32), source=1)


def test_deferred_samples_are_carried_then_completed_by_a_later_rollout():
    idx, prompts = np.array([7, 3]), [[7], [7], [3], [3]]
    # step 1: row 1 (prompt 7, sample 1) is deferred, rows 0, 2, 3 finish
    rows = np.array([0, 2, 3])
    trainable, pending = carry.step_groups(1, idx, prompts, N, [], rows, _result(rows, 1), [_stopped(1, 7)])
    assert [g.prompt_idx for g in trainable] == [3] and [g.prompt_idx for g in pending] == [7]
    (grp,) = pending
    assert grp.finish == ["eos", "deferred"] and grp.pending.tolist() == [False, True] and grp.origin == 1
    # the next rollout (2 prompts x 2 samples of its own) continues it as row 4
    (row,) = carry.pending_rows(pending, first_row=4)
    assert (row.row, row.prompt_idx, row.tokens.tolist(), row.source) == (4, 7, [9], -1)
    np.testing.assert_array_equal(row.prefix[1], [-0.5])
    rows2 = np.arange(5)
    trainable2, pending2 = carry.step_groups(2, np.array([5, 6]), [[5], [5], [6], [6]], N, pending, rows2,
                                             _result(rows2, 2), [])
    assert [g.prompt_idx for g in trainable2] == [7, 5, 6] and pending2 == []
    done = trainable2[0]
    assert done.complete and done.finish == ["eos", "eos"] and done.tokens[1].tolist() == [2, 4]


def test_a_lost_row_and_a_miscounted_continuation_are_errors():
    rows = np.array([0, 1, 2])  # row 3 neither rolled out nor deferred
    with pytest.raises(ValueError, match="row 3 of step 1"):
        carry.step_groups(1, np.array([7, 3]), [[7], [7], [3], [3]], N, [], rows, _result(rows, 1), [])
    _, pending = carry.step_groups(1, np.array([7]), [[7], [7]], N, [], np.array([0]), _result([0], 1),
                                   [_stopped(1, 7)])
    with pytest.raises(ValueError, match="2 continued rows for 1 deferred samples"):
        carry.complete(pending, _result([2, 3], 2), [0, 1])


def test_carried_groups_round_trip_through_bytes():
    _, pending = carry.step_groups(4, np.array([7]), [[7], [7]], N, [], np.array([0]), _result([0], 1),
                                   [_stopped(1, 7)])
    (back,) = carry.from_bytes(carry.to_bytes(pending), source="test")
    (grp,) = pending
    assert (back.prompt_idx, back.origin, back.finish) == (grp.prompt_idx, grp.origin, grp.finish)
    for a, b in zip(back.tokens + back.logprobs, grp.tokens + grp.logprobs):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(back.pending, grp.pending)


def test_step_batch_rows_and_rewards_follow_the_groups():
    """``train.step_batch.StepBatch``: the trained groups (a completed carried group first) as
    rows group after group, scored once (``set_rewards``) into each ``StepGroup`` and read back
    flat or group by group (what the advantages use)."""
    from rhyme_jax.train.step_batch import StepBatch

    idx, prompts = np.array([7, 3]), [[7], [7], [3], [3]]
    rows = np.array([0, 2, 3])
    _, pending = carry.step_groups(1, idx, prompts, N, [], rows, _result(rows, 1), [_stopped(1, 7)])
    rows2 = np.arange(5)
    trainable, _ = carry.step_groups(2, np.array([5, 6]), [[5], [5], [6], [6]], N, pending, rows2,
                                     _result(rows2, 2), [])
    sb = StepBatch(2, 1, trainable, [], rollout=None, seconds=0.0)
    assert sb.ids.tolist() == [7, 7, 5, 5, 6, 6] and sb.prompts == [[7], [7], [5], [5], [6], [6]]
    assert [t.tolist() for t in sb.tokens] == [[1, 0], [2, 4], [2, 0], [2, 1], [2, 2], [2, 3]]
    assert [lp.tolist() for lp in sb.logprobs][:2] == [[0.0, 0.0], [-4.0, -4.0]]
    assert sb.skipped.tolist() == [False] * 6
    with pytest.raises(ValueError, match="not scored yet"):
        sb.rewards
    with pytest.raises(ValueError, match="5 rewards for 6 rows"):
        sb.set_rewards(np.zeros(5, np.float32))
    sb.set_rewards(np.arange(6, dtype=np.float32))
    assert sb.rewards.dtype == np.float32 and sb.rewards.tolist() == [0, 1, 2, 3, 4, 5]
    assert sb.group_rewards.tolist() == [[0, 1], [2, 3], [4, 5]]
    assert [g.rewards.tolist() for g in trainable] == [[0, 1], [2, 3], [4, 5]]
